/* libFuzzer target: loaderd's control-protocol request handling without sockets
 * (ld_request_parse against loaderd's command table, loaderd/server_proto.h: depth limit, JSON,
 * version, op, per-op arguments).
 * The input is split at '\n' like the server splits a connection's bytes into request lines;
 * byte 0 picks the depth limit (2 + byte % 64).
 * Invariants: never crashes or leaks; a rejected line has a message; an accepted one has a known
 * op, and for attach a job object and rank < world_size, for report a step, and its job_id when
 * given fits 32 bits; report numbers are finite or NaN (null); no string or key of an accepted
 * request holds a control character (bt_text_unsafe), nor does the line once passed through
 * bt_escape_text (what every output to operators applies, error replies included). */
#include <math.h>
#include <stdint.h>
#include <string.h>

#include "fuzz_common.h"
#include "loaderd/server.h"
#include "loaderd/server_proto.h"

static int all_safe(json_t *v) {
    if (json_is_string(v)) return bt_text_unsafe(json_string_value(v), json_string_length(v), NULL) == json_string_length(v);
    size_t i;
    const char *k;
    json_t *x;
    if (json_is_array(v)) {
        json_array_foreach(v, i, x) if (!all_safe(x)) return 0;
    }
    if (json_is_object(v)) {
        json_object_foreach(v, k, x) if (bt_text_unsafe(k, strlen(k), NULL) != strlen(k) || !all_safe(x)) return 0;
    }
    return 1;
}

int LLVMFuzzerTestOneInput(const uint8_t *data, size_t size) {
    if (size == 0) return 0;
    unsigned depth = 2 + data[0] % 64;
    const char *p = (const char *)data + 1, *end = (const char *)data + size;
    while (p <= end) {
        const char *nl = memchr(p, '\n', (size_t)(end - p));
        size_t n = nl ? (size_t)(nl - p) : (size_t)(end - p);
        ld_request r;
        int rc = ld_request_parse(&r, ld_server_commands(), p, n, depth);
        char esc[4096];
        size_t en = bt_escape_text(esc, sizeof esc, p, n);
        if (en >= sizeof esc || bt_text_unsafe(esc, en, NULL) != en) fuzz_fail("escaped text still unsafe");
        if (rc == BT_ERR_INVALID) {
            if (!bt_last_error()[0]) fuzz_fail("rejected request without a message");
        } else if (rc == BT_OK) {
            if (!r.cmd || !r.op_name || strcmp(r.op_name, r.cmd->name) != 0)
                fuzz_fail("accepted request with an unknown op");
            if (!strcmp(r.cmd->name, "attach") && (!json_is_object(r.job) || r.rank >= r.world))
                fuzz_fail("accepted attach without a job object or with rank >= world_size");
            if (!strcmp(r.cmd->name, "report") && (isinf(r.loss) || isinf(r.tokens_per_s)))
                fuzz_fail("accepted report with an infinite number");
            if (!all_safe(r.root)) fuzz_fail("accepted request with a control character");
        } else {
            fuzz_fail("unexpected return value");
        }
        ld_request_free(&r);
        if (!nl) break;
        p = nl + 1;
    }
    return 0;
}
