/* libFuzzer target: the token-cache entry reader (loaderd/tcache_entry.c) on hostile entries.
 * Input: byte 0 picks the mode. Mode 0 (byte0 % 3 == 0): the rest is the whole file. Modes 1
 * and 2: the rest is the raw record bytes of one block, wrapped into an otherwise valid entry
 * with correct SHA-256s (as someone able to write the cache directory could forge one), stored
 * raw (1) or zstd-compressed (2); byte 1 sets the block's record count (1..256), byte 2 the
 * trailer's line count slack. Every input is written to a file in a private temporary
 * directory and read with tc_reader_open + ld_tc_next to the end.
 * Invariants: ld_tc_next returns only 1, 0 or LD_TC_DAMAGED; a preference record's lengths add up
 * to its tokens (prompt shorter than the first document, kto: one document); a document has as many mask values
 * as ids, every id is in [0, vocab), every mask value is 0 or 1; line numbers strictly
 * increase; no more records than the trailer announces. */
#include <stdint.h>
#include <stdlib.h>
#include <string.h>
#include <unistd.h>
#include <zstd.h>

#include "fuzz_common.h"
#include "common/bt_le.h"
#include "loaderd/tcache_priv.h"

#define VOCAB 49152

static ld_tcache *g_cache;
static char g_path[256];
static const uint8_t g_key[32] = {1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15, 16,
                                  17, 18, 19, 20, 21, 22, 23, 24, 25, 26, 27, 28, 29, 30, 31, 32};

static void sha(const void *a, size_t na, const void *b, size_t nb, uint8_t out[32]) {
    tc_sha s;
    if (tc_sha_init(&s) != BT_OK) fuzz_fail("sha init");
    tc_sha_update(&s, a, na);
    tc_sha_update(&s, b, nb);
    tc_sha_final(&s, out);
}

int LLVMFuzzerInitialize(int *argc, char ***argv) {
    (void)argc, (void)argv;
    bt_log_set_level(BT_LOG_ERROR);
    char dir[] = "/tmp/bt_fuzz_tcache_XXXXXX";
    if (!mkdtemp(dir)) fuzz_fail("mkdtemp");
    if (ld_tcache_open(&g_cache, dir, 1ull << 30, 0) != BT_OK) fuzz_fail("ld_tcache_open");
    snprintf(g_path, sizeof g_path, "%s/entry.btc", dir);
    return 0;
}

/* A valid entry around `raw` (one block of n records), stored raw or compressed. */
static uint8_t *wrap(const uint8_t *raw, size_t n_raw, uint32_t n_rec, uint64_t slack, int compress, size_t *len) {
    size_t cap = ZSTD_compressBound(n_raw);
    uint8_t *z = malloc(cap + 1);
    const uint8_t *stored = raw;
    size_t sn = n_raw;
    if (compress) {
        size_t r = ZSTD_compress(z, cap, raw, n_raw, 1);
        if (!ZSTD_isError(r) && r < n_raw) stored = z, sn = r;
    }
    uint8_t *f = malloc(64 + 48 + sn + 72);
    memset(f, 0, 64);
    memcpy(f, TC_MAGIC, 8);
    bt_put32(f + 8, TC_VERSION);
    bt_put32(f + 12, 64);
    memcpy(f + 16, g_key, 32);
    uint8_t *bh = f + 64;
    bt_put32(bh, TC_BLOCK_MAGIC);
    bt_put32(bh + 4, n_rec);
    bt_put32(bh + 8, (uint32_t)n_raw);
    bt_put32(bh + 12, (uint32_t)sn);
    sha(bh, 16, stored, sn, bh + 16);
    if (sn) memcpy(bh + 48, stored, sn);
    uint8_t *t = bh + 48 + sn;
    bt_put32(t, TC_TRAILER_MAGIC);
    bt_put32(t + 4, TC_VERSION);
    bt_put64(t + 8, n_rec);
    bt_put64(t + 16, n_rec + slack);
    bt_put64(t + 24, 0);
    bt_put64(t + 32, 1);
    tc_sha s;
    if (tc_sha_init(&s) != BT_OK) fuzz_fail("sha init");
    tc_sha_update(&s, f, 64);
    tc_sha_update(&s, bh + 16, 32);
    tc_sha_update(&s, t, 40);
    tc_sha_final(&s, t + 40);
    free(z);
    *len = 64 + 48 + sn + 72;
    return f;
}

int LLVMFuzzerTestOneInput(const uint8_t *data, size_t size) {
    if (size < 3 || size > (1u << 20)) return 0;
    int mode = data[0] % 3;
    uint8_t *file = NULL;
    size_t len = 0;
    uint32_t n_rec = 1 + data[1];
    if (mode == 0) {
        file = malloc(size);
        memcpy(file, data + 1, size - 1);
        len = size - 1;
    } else {
        if (size == 3) return 0;
        file = wrap(data + 3, size - 3, n_rec, data[2], mode == 2, &len);
    }
    FILE *f = fopen(g_path, "wb");
    if (!f) fuzz_fail("fopen");
    if (len && fwrite(file, 1, len, f) != len) fuzz_fail("fwrite");
    fclose(f);
    free(file);
    ld_tc_reader *r = NULL;
    if (tc_reader_open(g_cache, g_path, g_key, VOCAB, &r) != TC_OPEN_OK) return 0;
    tc_inuse_add(g_cache, g_key); /* as open_entry does; ld_tc_close releases it */
    bt_ids ids = {0}, mask = {0};
    uint64_t last = 0, n = 0;
    for (;;) {
        ld_tc_record rec;
        size_t i0 = ids.n;
        int rc = ld_tc_next(r, &rec, &ids, &mask);
        if (rc == 0 || rc == LD_TC_DAMAGED) break;
        if (rc != 1) fuzz_fail("ld_tc_next returned something else than 1, 0 or LD_TC_DAMAGED");
        if (rec.line_no <= last) fuzz_fail("line numbers do not increase");
        last = rec.line_no;
        if (++n > ld_tc_records(r) || ids.n != mask.n) fuzz_fail("record count or mask length");
        for (size_t k = i0; k < ids.n; k++)
            if (ids.v[k] < 0 || ids.v[k] >= VOCAB || (mask.v[k] != 0 && mask.v[k] != 1)) fuzz_fail("bad id or mask");
        if (rec.kind != 0 && rec.msg_len > TC_MSG_MAX) fuzz_fail("message too long");
        if (rec.kind == TC_PREF && (rec.n_docs < 1 || rec.n_docs > 2 || rec.label < -1 || rec.label > 1 ||
                                    rec.prompt_len >= rec.len[0] || (rec.n_docs == 1) != (rec.len[1] == 0) ||
                                    (uint64_t)rec.len[0] + rec.len[1] != ids.n - i0))
            fuzz_fail("preference record lengths");
    }
    bt_ids_free(&ids);
    bt_ids_free(&mask);
    ld_tc_close(r);
    return 0;
}
