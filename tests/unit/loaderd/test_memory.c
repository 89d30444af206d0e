/* A document larger than memory allows never aborts loaderd (issue 22 §4): the tokenizer, the
 * chat and text formats and the whole pipeline grow a document's token arrays fallibly, so such a
 * document is skipped and counted as a bad line ("memory", with its file and line) and the next
 * ones go on. Each case runs in a forked child whose memory is limited: RLIMIT_AS a few tens of
 * MiB above what it uses (mallopt M_ARENA_MAX 1: one heap, no per-thread arena reservations);
 * under ASan, whose shadow already reserves the address space, ASan's own max_allocation_size_mb
 * instead. The document is 6 MiB of digits: SmolLM2's tokenizer makes one token of each digit,
 * 6 Mi tokens, 24 MiB of ids and 24 MiB of mask, where its text needs 6 MiB. The SentencePiece
 * family runs the same cases: a GGUF "llama" vocabulary (common/tokenizer_spm.c: Llama 2's,
 * fetched by scripts/fetch-tokenizers; skipped, saying why, where that reported PyPI unreachable)
 * holds 16 bytes of symbol per digit, and a tokenizer.json BPE with byte_fallback and Metaspace
 * (Mistral v0.3's, in tests/fixtures) gets 6 MiB of spaces, 18 MiB once each is "▁". */
#include <malloc.h>
#include <setjmp.h>
#include <stdarg.h>
#include <stddef.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/resource.h>
#include <sys/wait.h>
#include <unistd.h>

#include <cmocka.h>
#include <fcntl.h>

#include "common/bt_common.h"
#include "loaderd/format.h"
#include "loaderd/pipeline.h"
#include "tests/unit/util/test_util.h"

#if defined(__SANITIZE_ADDRESS__)
#define UNDER_ASAN 1
#else
#define UNDER_ASAN 0
#endif
/* ASan: a single allocation over 24 MiB fails (returns NULL) as one past the limit would */
const char *__asan_default_options(void);
const char *__asan_default_options(void) { return "allocator_may_return_null=1:max_allocation_size_mb=24"; }

#define BIG ((size_t)6 << 20)

static bt_tokenizer *g_tok;
static bt_tokenizer *g_cur; /* the tokenizer the child under test uses */
static char g_dir[64];
static char *g_digits; /* BIG digits, NUL-terminated */
static char *g_spaces; /* BIG spaces, NUL-terminated */
static const char *g_doc; /* the big document of the case */

static int setup(void **state) {
    (void)state;
    if (tu_load_tokenizer(&g_tok) || tu_make_tmpdir(g_dir, sizeof g_dir, "memory")) return -1;
    g_digits = malloc(BIG + 1);
    for (size_t i = 0; i < BIG; i++) g_digits[i] = (char)('0' + i % 10);
    g_digits[BIG] = 0;
    g_spaces = malloc(BIG + 1);
    memset(g_spaces, ' ', BIG);
    g_spaces[BIG] = 0;
    return 0;
}

static int teardown(void **state) {
    (void)state;
    free(g_digits);
    free(g_spaces);
    bt_tokenizer_free(g_tok);
    return tu_remove_dir(g_dir);
}

#define CHECK(c)                                                                                             \
    do {                                                                                                     \
        if (!(c)) {                                                                                          \
            fprintf(stderr, "%s:%d: check failed: %s (last error: %s)\n", __FILE__, __LINE__, #c, bt_last_error()); \
            _exit(1);                                                                                        \
        }                                                                                                    \
    } while (0)

/* In the child: allow `extra` bytes of address space more than it holds now. */
static void limit_memory(size_t extra) {
    if (UNDER_ASAN) return;
    FILE *f = fopen("/proc/self/status", "r");
    CHECK(f);
    char line[256];
    unsigned long long vm_kb = 0;
    while (fgets(line, sizeof line, f))
        if (sscanf(line, "VmSize: %llu kB", &vm_kb) == 1) break;
    fclose(f);
    CHECK(vm_kb > 0);
    struct rlimit rl = {(rlim_t)(vm_kb * 1024 + extra), (rlim_t)(vm_kb * 1024 + extra)};
    CHECK(setrlimit(RLIMIT_AS, &rl) == 0);
}

/* Run fn in a forked child (stderr to err_path when not NULL); its exit status must be 0. */
static void in_child(void (*fn)(void), const char *err_path) {
    fflush(NULL);
    pid_t pid = fork();
    assert_true(pid >= 0);
    if (pid == 0) {
        if (err_path) {
            int fd = open(err_path, O_WRONLY | O_CREAT | O_TRUNC | O_CLOEXEC, 0600);
            CHECK(fd >= 0 && dup2(fd, STDERR_FILENO) == STDERR_FILENO);
            close(fd);
        }
        mallopt(M_ARENA_MAX, 1);
        fn();
        fflush(NULL);
        _exit(0);
    }
    int st = 0;
    assert_int_equal(waitpid(pid, &st, 0), pid);
    if (!WIFEXITED(st) || WEXITSTATUS(st) != 0)
        fail_msg("child %s %d (an abort is signal 6)", WIFEXITED(st) ? "exited" : "killed by signal",
                 WIFEXITED(st) ? WEXITSTATUS(st) : WTERMSIG(st));
}

static void tokenize_child(void) {
    bt_ids ids = {0};
    bt_ids_push(&ids, 7);
    CHECK(bt_tokenize(g_cur, "12", 2, 0, &ids) == BT_OK && ids.n >= 2); /* before the limit: it works */
    size_t n0 = ids.n;
    limit_memory((size_t)24 << 20);
    CHECK(bt_tokenize(g_cur, g_doc, BIG, 0, &ids) == BT_ERR_NOMEM);
    CHECK(strstr(bt_last_error(), "out of memory") != NULL);
    CHECK(ids.n == n0 && ids.v[0] == 7); /* nothing appended */
    CHECK(bt_tokenize(g_cur, "hello world", 11, 0, &ids) == BT_OK && ids.n > n0); /* and it goes on */
    bt_ids_free(&ids);
}

static void test_tokenize_fails_cleanly(void **state) {
    (void)state;
    g_cur = g_tok;
    g_doc = g_digits;
    in_child(tokenize_child, NULL);
}

/* Llama 2's SentencePiece GGUF vocabulary (models/tokenizers, scripts/fetch-tokenizers): the
 * path, or a skip saying why when the fetch reported PyPI unreachable (models/tokenizers/SKIPPED,
 * as tests/unit/common/test_tokenizer_spm.c); a missing file without that note fails. */
static bt_tokenizer *load_spm(void) {
    const char *d = getenv("BT_TOKENIZERS_DIR");
    char path[512], sk[512];
    snprintf(path, sizeof path, "%s/ggml-vocab-llama-spm.gguf", d && *d ? d : "models/tokenizers");
    snprintf(sk, sizeof sk, "%s/SKIPPED", d && *d ? d : "models/tokenizers");
    if (access(path, R_OK) != 0) {
        if (access(sk, R_OK) == 0) {
            fprintf(stderr, "SKIPPED: %s not fetched (see %s)\n", path, sk);
            skip();
        }
        fail_msg("%s missing: run `make tokenizers` (scripts/fetch-tokenizers)", path);
    }
    bt_tokenizer *t = NULL;
    if (bt_tokenizer_load(&t, path) != BT_OK) fail_msg("load %s: %s", path, bt_last_error());
    assert_string_equal(bt_tokenizer_pre_engine(t), "spm");
    return t;
}

static void test_tokenize_spm_fails_cleanly(void **state) {
    (void)state;
    g_cur = load_spm();
    g_doc = g_digits;
    in_child(tokenize_child, NULL);
    bt_tokenizer_free(g_cur);
}

/* tokenizer.json BPE over chars with byte_fallback behind a Metaspace pre-tokenizer: the
 * replacement of 6 Mi spaces (3 bytes each) is itself too big. */
static void test_tokenize_metaspace_fails_cleanly(void **state) {
    (void)state;
    const char *path = "tests/fixtures/tokenizer/mistral-v0.3-tokenizer.json.zst";
    if (bt_tokenizer_load(&g_cur, path) != BT_OK) fail_msg("load %s: %s", path, bt_last_error());
    assert_string_equal(bt_tokenizer_pre(g_cur), "sentencepiece");
    g_doc = g_spaces;
    in_child(tokenize_child, NULL);
    bt_tokenizer_free(g_cur);
}

/* ld_format_line for a text and a chat document of BIG digits: BT_ERR_NOMEM, ids and mask as
 * they were; a small document afterwards formats. */
static void format_child(void) {
    size_t cap = BIG + 256;
    char *text = malloc(cap), *chat = malloc(cap);
    CHECK(text && chat);
    int tn = snprintf(text, cap, "{\"text\":\"%s\"}", g_digits);
    int cn = snprintf(chat, cap, "{\"messages\":[{\"role\":\"user\",\"content\":\"hi\"},{\"role\":\"assistant\","
                                 "\"content\":\"%s\"}]}", g_digits);
    ld_format_cfg tcfg = {LD_FMT_TEXT, NULL, g_tok, 0, LD_TPL_CHATML, 0, 0, 0, 0};
    ld_format_cfg ccfg = {LD_FMT_CHAT, NULL, g_tok, 0, LD_TPL_CHATML, 0, 0, 0, 0};
    bt_ids ids = {0}, mask = {0};
    int trunc, reason;
    limit_memory((size_t)28 << 20);
    CHECK(ld_format_line(&tcfg, text, (size_t)tn, &ids, &mask, &trunc, &reason) == BT_ERR_NOMEM);
    CHECK(ids.n == 0 && mask.n == 0);
    CHECK(ld_format_line(&ccfg, chat, (size_t)cn, &ids, &mask, &trunc, &reason) == BT_ERR_NOMEM);
    CHECK(ids.n == 0 && mask.n == 0);
    const char *small = "{\"text\":\"a small document\"}";
    CHECK(ld_format_line(&tcfg, small, strlen(small), &ids, &mask, &trunc, &reason) == 0);
    CHECK(ids.n > 2 && ids.n == mask.n);
    bt_ids_free(&ids);
    bt_ids_free(&mask);
    free(text);
    free(chat);
}

static void test_format_fails_cleanly(void **state) {
    (void)state;
    in_child(format_child, NULL);
}

/* The pipeline: a shard of a small document, the big one, another small one. The big one is
 * skipped and counted as "memory" and logged with its file and line; both small ones are
 * packed; the job ends normally. */
static char g_shard[128];

static void pipeline_child(void) {
    char json[1024];
    snprintf(json, sizeof json,
             "{\"name\":\"m\",\"shards\":[\"%s\"],\"format\":\"text\",\"tokenizer\":\"%s\",\"seq_len\":64,"
             "\"micro_batch_size\":1,\"epochs\":1,\"tokenizer_threads\":1}", g_shard, tu_model_path());
    ld_job_spec spec;
    CHECK(ld_job_spec_parse(&spec, json, NULL) == BT_OK);
    static ld_stats st;
    ld_pipeline *p = NULL;
    CHECK(ld_pipeline_new(&p, &spec, g_cur, NULL, &st) == BT_OK);
    uint8_t *slot = bt_aligned_alloc(bt_batch_slot_bytes(1, 64));
    CHECK(slot);
    bt_batch_view v;
    bt_batch_view_init(&v, slot, 1, 64);
    limit_memory((size_t)40 << 20); /* the line's copies fit (source, chunk: 8 MiB each), its tokens do not */
    int rc, batches = 0;
    while ((rc = ld_pipeline_next(p, &v, 1)) == 0) batches++;
    CHECK(rc == 1);
    CHECK(atomic_load(&st.bad[LD_BAD_MEMORY]) == 1);
    CHECK(atomic_load(&st.docs) == 2);
    CHECK(atomic_load(&st.lines) == 3);
    CHECK(batches >= 1);
    ld_pipeline_free(p);
    free(slot);
    ld_job_spec_free(&spec);
}

static void pipeline_case(void) {
    snprintf(g_shard, sizeof g_shard, "%s/big.jsonl", g_dir);
    FILE *f = fopen(g_shard, "w");
    assert_non_null(f);
    fprintf(f, "{\"text\":\"the first small document\"}\n{\"text\":\"%s\"}\n{\"text\":\"the last small document\"}\n",
            g_digits);
    fclose(f);
    char err_path[128];
    snprintf(err_path, sizeof err_path, "%s/stderr.txt", g_dir);
    in_child(pipeline_child, err_path);
    size_t n = 0;
    char *log = (char *)tu_slurp(err_path, &n);
    log[n] = 0;
    char want[256];
    snprintf(want, sizeof want, "%s:2: memory: out of memory", g_shard);
    if (!strstr(log, want)) fail_msg("log lacks \"%s\":\n%s", want, log);
    free(log);
}

static void test_pipeline_skips_and_counts(void **state) {
    (void)state;
    g_cur = g_tok;
    pipeline_case();
}

/* The same document through a SentencePiece tokenizer: skipped and counted, never an abort. */
static void test_pipeline_spm_skips_and_counts(void **state) {
    (void)state;
    g_cur = load_spm();
    pipeline_case();
    bt_tokenizer_free(g_cur);
}

int main(void) {
    const struct CMUnitTest tests[] = {
        cmocka_unit_test(test_tokenize_fails_cleanly),
        cmocka_unit_test(test_tokenize_spm_fails_cleanly),
        cmocka_unit_test(test_tokenize_metaspace_fails_cleanly),
        cmocka_unit_test(test_format_fails_cleanly),
        cmocka_unit_test(test_pipeline_skips_and_counts),
        cmocka_unit_test(test_pipeline_spm_skips_and_counts),
    };
    return cmocka_run_group_tests(tests, setup, teardown);
}
