/* loaderd control protocol, request side: one request line -> a checked request (no I/O, no
 * server state), so the parsing can be unit-tested and fuzzed without sockets
 * (tests/fuzz/fuzz_control.c). Wire format: proto/PROTOCOL.md §1. */
#ifndef LD_SERVER_PROTO_H
#define LD_SERVER_PROTO_H
#include <jansson.h>
#include <stddef.h>
#include <stdint.h>

#include "proto/batch.h"

typedef enum {
    LD_OP_HELLO = 0,
    LD_OP_ATTACH,
    LD_OP_DETACH,
    LD_OP_REPORT,
    LD_OP_STATUS,
    LD_OP_JOBS,
    LD_OP_METRICS,
    LD_OP_DRAIN,
    LD_OP_RELOAD,
    LD_OP_N
} ld_op;

/* Name of an op ("hello", "attach", ...); "?" outside [0, LD_OP_N). */
const char *ld_op_name(ld_op op);
/* Comma-separated list of every op name, for error messages and the hello reply. */
const char *ld_op_list(void);

#define LD_RUN_MAX 64 /* bytes of an attach's "run" */

typedef struct {
    json_t *root;          /* owned: the parsed request object (ld_request_free) */
    ld_op op;
    const char *op_name;   /* the request's "op" string (points into root), NULL if absent */
    /* attach */
    json_t *job;           /* borrowed from root: the job spec object (not yet checked) */
    uint32_t rank, world;  /* default 0 / 1; rank < world */
    char run[LD_RUN_MAX + 1]; /* "run": the training run the rank belongs to; "" when absent */
    int has_resume;
    uint8_t resume[BT_RESUME_STATE_BYTES];
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
} ld_request;

/* Parse and check one request line p[0..n) (no '\n'; trailing '\r', blanks already removed by
 * the caller or not, both fine). Checks, in order: nesting depth <= max_depth
 * (ld_json_depth_ok), valid JSON object, "v" == BT_PROTO_VERSION, "op" one of ld_op_list(),
 * and the op's own arguments:
 *   attach: "job" object; "rank" int [0, 65535]; "world_size" int [1, 65536]; rank < world;
 *           "resume" null or 2*BT_RESUME_STATE_BYTES hex digits; "run" null or 1..LD_RUN_MAX
 *           characters of [A-Za-z0-9._:-] (the training run the rank belongs to).
 *   detach: "job_id" (optional) int [0, 2^32).
 *   report: "step" int >= 0; "loss"/"tokens_per_s" number or null; "job_id" as detach; "base"
 *           (optional) object: "dtype" 1..15 and "types" 1..63 bytes of [A-Za-z0-9_+.-],
 *           "bits_per_weight" number in [0, 64], "bytes" int in [0, 2^53) (other keys ignored).
 * Returns 0 with *r filled (free with ld_request_free), or 1 for a bad request: err (errlen
 * bytes) holds a message for the client and *r holds only op/op_name (for the reply's "op"
 * echo, r->op_name NULL when unknown) and root (may be NULL); ld_request_free is still
 * required. Never fails on any byte content. */
int ld_request_parse(ld_request *r, const char *p, size_t n, unsigned max_depth, char *err, size_t errlen);
void ld_request_free(ld_request *r);

#endif
