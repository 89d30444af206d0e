/* Tokenizer throughput, single thread:
 *   bench_tok [--min-seconds S] [--dump FILE] [--wx] [--engine dedicated|pcre2] [--special-flags]
 *             TOKENIZER CORPUS
 * TOKENIZER: anything bt_tokenizer_load accepts (GGUF, tokenizer.json[.zst], model directory).
 * CORPUS: a BTTKCORP record file (tests/fixtures/tokenizer/corpus.bin.zst format: "BTTKCORP",
 * u32 count, then u8 flags, u32 length, bytes per document; zstd-compressed or not) or a plain
 * text file (one document per line). Every document is encoded with parse_special = 0 (special
 * strings as text: tiktoken encode_ordinary / HF encode_special_tokens = True), repeated until
 * S seconds (default 2) have passed. Prints one JSON line:
 *   {"tokenizer", "engine", "wx", "jit", "docs", "bytes", "tokens", "seconds", "cpu_seconds",
 *    "mb_s", "tok_s", "mb_s_cpu"}
 * bytes and tokens are totals over all passes, seconds the wall time, cpu_seconds the thread's
 * CPU time (CLOCK_THREAD_CPUTIME_ID; what "per thread" means on a shared machine), MB = 1e6
 * bytes. --wx: before anything else, forbid writable+executable memory for this process
 * (prctl(PR_SET_MDWE, PR_MDWE_REFUSE_EXEC_GAIN), Linux >= 6.3, as systemd's
 * MemoryDenyWriteExecute=yes does; PCRE2 then cannot JIT); fails if the kernel refuses.
 * --engine: the pre-tokenizer engine (default: the tokenizer's own, see
 * bt_tokenizer_pre_engine). "jit" says whether PCRE2 could JIT in this process. The thread's
 * piece cache is released after every pass (bt_tokenize_release_cache), so repeating the corpus
 * does not turn it into a lookup table.
 * --dump FILE writes the ids of the first pass: per document u32 n then n int32 (little endian).
 * --special-flags: encode each BTTKCORP document with parse_special = bit 0 of its flags byte, as
 * the parity fixtures do (gen_tokenizer_fixtures.py), instead of parse_special = 0 for all; with
 * --min-seconds 0 --dump this gives our ids of a parity corpus, for the llama.cpp cross-check
 * (tests/py/test_llamacpp.py). */
#define PCRE2_CODE_UNIT_WIDTH 8
#include <getopt.h>
#include <pcre2.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/prctl.h>
#include <time.h>
#include <zstd.h>

#ifndef PR_SET_MDWE
#define PR_SET_MDWE 65
#endif
#ifndef PR_MDWE_REFUSE_EXEC_GAIN
#define PR_MDWE_REFUSE_EXEC_GAIN 1
#endif

#include "common/bt_common.h"
#include "common/tokenizer.h"

static char *read_all(const char *path, size_t *len) {
    FILE *f = fopen(path, "rb");
    if (!f) return NULL;
    size_t cap = 1 << 20, n = 0;
    char *b = malloc(cap);
    size_t r;
    while (b && (r = fread(b + n, 1, cap - n, f)) > 0) {
        n += r;
        if (n == cap) {
            cap *= 2;
            char *nb = realloc(b, cap);
            if (!nb) { free(b); b = NULL; }
            b = nb;
        }
    }
    fclose(f);
    if (!b) return NULL;
    static const unsigned char zmagic[4] = {0x28, 0xB5, 0x2F, 0xFD};
    if (n >= 4 && memcmp(b, zmagic, 4) == 0) {
        size_t dcap = n * 6 + 1024, dn = 0;
        char *d = malloc(dcap);
        ZSTD_DStream *ds = ZSTD_createDStream();
        ZSTD_inBuffer in = {b, n, 0};
        for (;;) {
            if (dn == dcap) { dcap *= 2; d = realloc(d, dcap); }
            if (!d) break;
            ZSTD_outBuffer ob = {d, dcap, dn};
            size_t rr = ZSTD_decompressStream(ds, &ob, &in);
            if (ZSTD_isError(rr)) { free(d); d = NULL; break; }
            dn = ob.pos;
            if (rr == 0 && in.pos == in.size) break;
            if (in.pos == in.size && ob.pos < dcap && rr != 0) { free(d); d = NULL; break; }
        }
        ZSTD_freeDStream(ds);
        free(b);
        b = d;
        n = dn;
    }
    *len = n;
    return b;
}

typedef struct {
    const char *p;
    size_t n;
    int special; /* parse_special for this document */
} doc_t;

static double thread_cpu(void) {
    struct timespec ts;
    clock_gettime(CLOCK_THREAD_CPUTIME_ID, &ts);
    return (double)ts.tv_sec + (double)ts.tv_nsec * 1e-9;
}

/* Whether PCRE2 can JIT-compile here (false under W^X). */
static int jit_works(void) {
    int err;
    PCRE2_SIZE off;
    pcre2_code *re = pcre2_compile((PCRE2_SPTR) "a+", 2, 0, &err, &off, NULL);
    int ok = re && pcre2_jit_compile(re, PCRE2_JIT_COMPLETE) == 0;
    pcre2_code_free(re);
    return ok;
}

int main(int argc, char **argv) {
    double min_s = 2.0;
    const char *dump = NULL, *engine = NULL;
    int wx = 0, special_flags = 0;
    static const struct option lopts[] = {
        {"min-seconds", required_argument, NULL, 's'}, {"dump", required_argument, NULL, 'd'},
        {"engine", required_argument, NULL, 'e'},      {"wx", no_argument, NULL, 'w'},
        {"special-flags", no_argument, NULL, 'f'},     {"help", no_argument, NULL, 'h'},
        {NULL, 0, NULL, 0}};
    int c, bad = 0;
    while ((c = getopt_long(argc, argv, "", lopts, NULL)) != -1) {
        switch (c) {
        case 's': min_s = atof(optarg); break;
        case 'd': dump = optarg; break;
        case 'e': engine = optarg; break;
        case 'w': wx = 1; break;
        case 'f': special_flags = 1; break;
        case 'h': bad = -1; break;
        default: bad = 1; break;
        }
    }
    const int i = optind;
    if (bad || argc - i != 2 || (engine && strcmp(engine, "pcre2") != 0 && strcmp(engine, "dedicated") != 0)) {
        fprintf(bad < 0 ? stdout : stderr, "usage: %s [--min-seconds S] [--dump FILE] [--wx] "
                "[--engine dedicated|pcre2] [--special-flags] TOKENIZER CORPUS\n", argv[0]);
        return bad < 0 ? 0 : 2;
    }
    if (wx && prctl(PR_SET_MDWE, PR_MDWE_REFUSE_EXEC_GAIN, 0L, 0L, 0L) != 0) {
        perror("bench_tok: prctl(PR_SET_MDWE) (needs Linux >= 6.3)");
        return 1;
    }
    bt_tokenizer *t = NULL;
    if (bt_tokenizer_load(&t, argv[i]) < 0) {
        fprintf(stderr, "bench_tok: %s: %s\n", argv[i], bt_last_error());
        return 1;
    }
    if (engine && bt_tokenizer_set_pre_engine(t, strcmp(engine, "dedicated") == 0) < 0) {
        fprintf(stderr, "bench_tok: %s\n", bt_last_error());
        return 1;
    }
    size_t len = 0;
    char *buf = read_all(argv[i + 1], &len);
    if (!buf) {
        fprintf(stderr, "bench_tok: cannot read %s\n", argv[i + 1]);
        bt_tokenizer_free(t);
        return 1;
    }
    size_t nd = 0, cap = 1024, bytes = 0;
    doc_t *docs = malloc(cap * sizeof *docs);
    if (len >= 12 && memcmp(buf, "BTTKCORP", 8) == 0) {
        size_t off = 12;
        while (off + 5 <= len) {
            uint32_t l;
            memcpy(&l, buf + off + 1, 4);
            int sp = special_flags && (buf[off] & 1);
            off += 5;
            if (l > len - off) break;
            if (nd == cap) docs = realloc(docs, (cap *= 2) * sizeof *docs);
            docs[nd++] = (doc_t){buf + off, l, sp};
            off += l;
        }
    } else {
        size_t a = 0;
        for (size_t k = 0; k <= len; k++)
            if (k == len || buf[k] == '\n') {
                if (k > a) {
                    if (nd == cap) docs = realloc(docs, (cap *= 2) * sizeof *docs);
                    docs[nd++] = (doc_t){buf + a, k - a, 0};
                }
                a = k + 1;
            }
    }
    for (size_t k = 0; k < nd; k++) bytes += docs[k].n;
    bt_ids ids = {0};
    FILE *df = dump ? fopen(dump, "wb") : NULL;
    if (dump && !df) {
        fprintf(stderr, "bench_tok: cannot write %s\n", dump);
        return 1;
    }
    size_t tokens = 0, passes = 0;
    double t0 = bt_now(), c0 = thread_cpu(), el = 0;
    do {
        for (size_t k = 0; k < nd; k++) {
            ids.n = 0;
            if (bt_tokenize(t, docs[k].p, docs[k].n, docs[k].special, &ids) < 0) {
                fprintf(stderr, "bench_tok: doc %zu: %s\n", k, bt_last_error());
                return 1;
            }
            tokens += ids.n;
            if (df) {
                uint32_t n32 = (uint32_t)ids.n;
                fwrite(&n32, 4, 1, df);
                fwrite(ids.v, 4, ids.n, df);
            }
        }
        if (df) { fclose(df); df = NULL; }
        bt_tokenize_release_cache(); /* every pass starts cold: the corpus is not memorised */
        passes++;
        el = bt_now() - t0;
    } while (el < min_s);
    double cpu = thread_cpu() - c0;
    printf("{\"tokenizer\": \"%s\", \"engine\": \"%s\", \"wx\": %s, \"jit\": %s, \"docs\": %zu, \"bytes\": %zu, "
           "\"tokens\": %zu, \"seconds\": %.4f, \"cpu_seconds\": %.4f, \"mb_s\": %.3f, \"tok_s\": %.0f, "
           "\"mb_s_cpu\": %.3f}\n",
           argv[i], bt_tokenizer_pre_engine(t), wx ? "true" : "false", jit_works() ? "true" : "false", nd,
           bytes * passes, tokens, el, cpu, (double)bytes * (double)passes / el / 1e6, (double)tokens / el,
           (double)bytes * (double)passes / cpu / 1e6);
    bt_ids_free(&ids);
    free(docs);
    free(buf);
    bt_tokenizer_free(t);
    return 0;
}
