/* libFuzzer target: ld_source (loaderd/source.h) over a file holding the fuzz input, plain or
 * zstd-compressed.
 * Input: byte 0 picks the mode (0..2 of byte%3: 0 the rest as is; 1 the rest compressed with
 * ZSTD_compress; 2 compressed, then cut at a point and one byte flipped, from bytes 1-2), the
 * line limit (byte 0 >> 2: 16 << (x % 8) bytes); the rest is the payload.
 * The file lives in a memfd and is opened through /proc/self/fd/N (no disk traffic).
 * Invariants: ld_source_next never fails on content (only LD_SRC_* codes), lines hold no '\n',
 * are at most the limit long (without '\r'), line numbers strictly increase from 1, a plain
 * input gives exactly its lines back in order, and after LD_SRC_END / LD_SRC_ZSTD only END. */
#include <stdint.h>
#include <string.h>
#include <sys/mman.h>
#include <unistd.h>
#include <zstd.h>

#include "fuzz_common.h"
#include "loaderd/source.h"

static void write_all(int fd, const void *p, size_t n) {
    const char *c = p;
    while (n) {
        ssize_t w = write(fd, c, n);
        if (w <= 0) fuzz_fail("write to memfd failed");
        c += w;
        n -= (size_t)w;
    }
}

int LLVMFuzzerTestOneInput(const uint8_t *data, size_t size) {
    if (size < 3) return 0;
    int mode = data[0] % 3;
    size_t max_line = (size_t)16 << ((data[0] >> 2) % 8);
    const uint8_t *pay = data + 3;
    size_t n = size - 3;
    int fd = memfd_create("fuzz-shard", MFD_CLOEXEC);
    if (fd < 0) fuzz_fail("memfd_create");
    if (mode == 0) {
        write_all(fd, pay, n);
    } else {
        size_t cap = ZSTD_compressBound(n);
        uint8_t *z = malloc(cap ? cap : 1);
        size_t zn = ZSTD_compress(z, cap, pay, n, 1);
        if (ZSTD_isError(zn)) fuzz_fail("ZSTD_compress");
        if (mode == 2 && zn > 0) {
            size_t cut = ((size_t)data[1] * zn) / 255;
            if (cut < zn) z[cut] ^= (uint8_t)(data[2] | 1);
            zn = cut + (zn - cut) / 2;
        }
        write_all(fd, z, zn);
        free(z);
    }
    char path[64];
    snprintf(path, sizeof path, "/proc/self/fd/%d", fd);
    ld_source *s = NULL;
    if (ld_source_open(&s, path, max_line)) fuzz_fail("ld_source_open failed on a readable file");
    const char *line;
    size_t len;
    uint64_t no = 0, prev = 0;
    /* a plain shard without over-long lines must come back exactly, line by line */
    int exact = mode == 0 && !ld_source_is_zstd(s);
    size_t pos = 0; /* exact mode: where the next line starts in pay */
    int done = 0;
    for (int iter = 0; iter < 1 << 20; iter++) {
        int rc = ld_source_next(s, &line, &len, &no);
        if (rc < 0) fuzz_fail("ld_source_next returned an error code");
        if (done) {
            if (rc != LD_SRC_END) fuzz_fail("data after the end");
            break;
        }
        if (rc == LD_SRC_END || rc == LD_SRC_ZSTD) {
            if (rc == LD_SRC_END && exact && pos != n) fuzz_fail("plain shard ended before its last line");
            done = 1;
            continue;
        }
        if (no <= prev) fuzz_fail("line numbers do not increase");
        prev = no;
        if (rc == LD_SRC_TOO_LONG) {
            exact = 0;
            continue;
        }
        if (rc != LD_SRC_LINE) fuzz_fail("unknown result code");
        if (len > max_line) fuzz_fail("line longer than the limit");
        if (len && memchr(line, '\n', len)) fuzz_fail("line contains a newline");
        if (exact) {
            if (pos >= n) fuzz_fail("plain shard gave more lines than it has");
            const uint8_t *nl = memchr(pay + pos, '\n', n - pos);
            size_t e = nl ? (size_t)(nl - pay) : n;
            size_t want = e - pos;
            if (want && pay[pos + want - 1] == '\r') want--;
            if (want != len || (len && memcmp(pay + pos, line, len) != 0)) fuzz_fail("plain line content differs");
            pos = nl ? e + 1 : n;
        }
    }
    ld_source_close(s);
    close(fd);
    return 0;
}
