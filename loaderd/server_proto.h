/* loaderd control protocol, request side: one request line -> a checked request (no I/O, no
 * server state), so the parsing can be unit-tested and fuzzed without sockets
 * (tests/fuzz/fuzz_control.c). Wire format: proto/PROTOCOL.md §1.
 *
 * The ops are the rows of a command table (redis's redisCommandTable): each row names an op, the
 * parser of its own arguments, its handler and who may call it. loaderd's table is in server.c
 * (ld_server_commands); the hello reply's "ops", the "unknown op (...)" refusal and the
 * operators-only refusal are all made from it, so adding an op is one row. */
#ifndef LD_SERVER_PROTO_H
#define LD_SERVER_PROTO_H
#include <jansson.h>
#include <stddef.h>
#include <stdint.h>

#include "proto/batch.h"
#include "proto/client.h"

#define LD_RUN_MAX 64 /* bytes of an attach's "run" */

struct conn;
typedef struct ld_request ld_request;

/* Who may call an op: anyone the socket admits, or operators only (root, loaderd's own uid and
 * the members of operator_groups; loaderd/config.h ld_peer_is_operator). */
typedef enum { LD_ANYONE = 0, LD_OPERATORS = 1 } ld_who;

typedef struct ld_command {
    const char *name;                               /* the request's "op" */
    int (*parse)(ld_request *r);                    /* its own arguments (below); NULL: none */
    void (*handler)(struct conn *c, ld_request *r); /* loop thread (loaderd/server_priv.h) */
    ld_who who;
} ld_command;

/* The names of a table's ops (rows up to the one with a NULL name), comma-separated in table
 * order ("hello, attach, ..."), into buf (cap bytes, truncated). Returns buf. */
const char *ld_command_list(const ld_command *table, char *buf, size_t cap);

struct ld_request {
    json_t *root;             /* owned: the parsed request object (ld_request_free) */
    const ld_command *cmd;    /* the table row of its op; NULL when unknown */
    const char *op_name;      /* the request's "op" string (points into root), NULL if absent */
    /* attach */
    json_t *job;              /* borrowed from root: the job spec object (not yet checked) */
    uint32_t rank, world;     /* default 0 / 1; rank < world */
    char run[LD_RUN_MAX + 1]; /* "run": the training run the rank belongs to; "" when absent */
    int has_resume;
    uint8_t resume[BT_RESUME_STATE_BYTES];
    uint32_t resume_world; /* "resume_world" (0: absent) */
    /* detach / report */
    int has_job_id;
    uint32_t job_id;
    /* report */
    uint64_t step;
    double loss, tokens_per_s; /* NaN when null/absent */
    int has_base;              /* "base" present (the trainer's frozen base) */
    char base_dtype[16], base_types[64];
    double base_bpw;
    uint64_t base_bytes;
    /* ref_put */
    const char *ref_base;     /* points into root */
    json_t *ref_values;       /* borrowed from root: array of at most LD_REF_PUT_MAX entries */
};

#define LD_REF_PUT_MAX BT_REF_PUT_MAX /* values in one ref_put (proto/client.h) */

/* Parse and check one request line p[0..n) (no '\n'; trailing '\r', blanks already removed by
 * the caller or not, both fine) against the command table `table` (rows up to a NULL name).
 * Checks, in order: nesting depth <= max_depth (ld_json_depth_ok), valid JSON object, every
 * string and key safe text (bt_text_unsafe), "v" == BT_PROTO_VERSION, "op" one of the table's,
 * and the op's own arguments (its row's parse). Keys a request does not use are ignored
 * (additive changes keep the protocol version, proto/PROTOCOL.md "Versioning").
 * Returns BT_OK with *r filled (r->cmd set; free with ld_request_free), or BT_ERR_INVALID for a
 * bad request: bt_last_error() holds a message for the client, and *r holds only cmd / op_name
 * (for the reply's "op" echo; op_name NULL when absent or not yet looked at) and root (may be
 * NULL); ld_request_free is still required. Never fails on any byte content. */
int ld_request_parse(ld_request *r, const ld_command *table, const char *p, size_t n, unsigned max_depth);
void ld_request_free(ld_request *r);

/* The ops' argument parsers (the rows' `parse`), on r->root; BT_OK, or BT_ERR_INVALID with the
 * client's message in bt_last_error():
 *   attach: "job" object; "rank" int [0, 65535]; "world_size" int [1, 65536]; rank < world;
 *           "resume" null or 2*BT_RESUME_STATE_BYTES hex digits; "run" null or 1..LD_RUN_MAX
 *           characters of [A-Za-z0-9._:-] (the training run the rank belongs to).
 *   detach: "job_id" (optional) int [0, 2^32).
 *   report: "step" int >= 0; "loss"/"tokens_per_s" number or null; "job_id" as detach; "base"
 *           (optional) exactly {"dtype": 1..15 and "types": 1..63 bytes of [A-Za-z0-9_+.-],
 *           "bits_per_weight": number in [0, 64], "bytes": int in [0, 2^53)} (json_unpack_ex,
 *           strict: a key more is refused, naming it). */
int ld_parse_attach(ld_request *r);
int ld_parse_detach(ld_request *r);
int ld_parse_report(ld_request *r);
/*   ref_put: "base" string (1..128 bytes); "values" array of 0..LD_REF_PUT_MAX entries (each checked
 *           by the handler: [shard, line, side, logp]); "job_id" as detach. */
int ld_parse_ref_put(ld_request *r);

#endif
