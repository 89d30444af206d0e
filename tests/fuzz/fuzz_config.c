/* libFuzzer target: the configuration and job-spec parsers users feed us JSON through
 * (issue 10 §8): loaderd's config (ld_config_parse, loaderd/config.h), loaderd's job spec
 * (ld_job_spec_parse, loaderd/job.h) and the trainer's job config with --set overrides
 * (bt_config_parse, trainer/config.h).
 * Input: byte 0 picks the parser (byte % 3: 0 loaderd config, 1 job spec, 2 trainer config);
 * the rest is the JSON text, for the trainer split at the first '\n' lines after the first
 * one being "--set key=value" overrides (at most 8).
 * Invariants: never crashes or leaks; every refusal leaves a message; accepted values are in
 * their documented ranges (loaderd: max_clients >= 1, max_clients_per_uid >= 1, memory budget
 * >= 16 MiB, socket mode <= 0777; job spec: 16 <= T <= 2^20, B >= 1, B*T <= 2^24, 1..256
 * threads, at least one dataset with shards; trainer: 0 < lr <= 1, 0 <= betas < 1,
 * 0 < eps <= 1, 0 <= weight_decay <= 1, stop_at_step <= steps, loaderd's seq_len range
 * (proto/job_limits.h), the LoRA limits the adapter loader shares (BT_LORA_*)), an accepted
 * --set names its key with no empty segment (issue 21 §11), a text with a key given twice in one
 * object is refused, and the trainer's effective config (bt_config_dump) parses again to the same
 * dump. */
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

#include "fuzz_common.h"
#include "loaderd/config.h"
#include "loaderd/pipeline.h"
#include "proto/job_limits.h"
#include "trainer/config.h"

static char *dup_n(const uint8_t *p, size_t n) {
    char *s = malloc(n + 1);
    if (!s) fuzz_fail("out of memory");
    memcpy(s, p, n);
    s[n] = 0;
    return s;
}

static void fuzz_loaderd_config(const char *text) {
    ld_config c;
    if (ld_config_parse(&c, text, "fuzz.json")) {
        if (!bt_last_error()[0]) fuzz_fail("loaderd config refused without a message");
        return;
    }
    if (c.max_clients < 1 || c.max_clients_per_uid < 1 || c.memory_budget_bytes < (16u << 20) ||
        c.socket_mode > 0777 || !c.socket_path || c.tokenizer_threads < 1 || c.ring_slots < 2)
        fuzz_fail("loaderd config accepted out of range");
    ld_config_free(&c);
}

static void fuzz_job_spec(const char *text) {
    ld_job_spec s;
    bt_keypath bad;
    if (ld_job_spec_parse(&s, text, &bad)) {
        if (!bt_last_error()[0]) fuzz_fail("job spec refused without a message");
        return;
    }
    if (s.T < BT_JOB_MIN_SEQ_LEN || s.T > BT_JOB_MAX_SEQ_LEN || s.B < 1 ||
        (uint64_t)s.B * s.T > BT_JOB_MAX_BATCH_TOKENS || s.n_threads < 1 || s.n_threads > BT_JOB_MAX_TOKENIZER_THREADS ||
        !s.tokenizer || (s.n_datasets == 0 && (s.n_shards < 1 || s.n_shards > (int)BT_JOB_MAX_SHARD_PATTERNS)))
        fuzz_fail("job spec accepted out of range");
    for (int d = 0; d < s.n_datasets; d++)
        if (s.datasets[d].n_shards < 1 || !(s.datasets[d].weight > 0)) fuzz_fail("dataset accepted out of range");
    ld_job_spec_free(&s);
}

static void fuzz_trainer_config(const char *text) {
    const char *sets[8];
    int n_sets = 0;
    char *body = strdup(text);
    if (!body) fuzz_fail("out of memory");
    char *nl = strchr(body, '\n');
    if (nl) { /* the first line is the JSON text; the others are --set overrides */
        *nl = 0;
        char *p = nl + 1;
        while (p && *p && n_sets < 8) {
            sets[n_sets++] = p;
            char *e = strchr(p, '\n');
            if (e) *e++ = 0;
            p = e;
        }
    }
    bt_train_config c;
    if (bt_config_parse(&c, body, "fuzz.json", sets, n_sets)) {
        if (!bt_last_error()[0]) fuzz_fail("trainer config refused without a message");
        free(body);
        return;
    }
    if (!(c.optim.lr > 0 && c.optim.lr <= 1) || !(c.optim.beta1 >= 0 && c.optim.beta1 < 1) ||
        !(c.optim.beta2 >= 0 && c.optim.beta2 < 1) || !(c.optim.eps > 0 && c.optim.eps <= 1) ||
        !(c.optim.weight_decay >= 0 && c.optim.weight_decay <= 1) || c.optim.warmup_steps < 0 ||
        c.stop_at_step > c.steps || c.steps < 1 || c.data.seq_len < (int)BT_JOB_MIN_SEQ_LEN ||
        c.data.seq_len > (int)BT_JOB_MAX_SEQ_LEN || c.lora.r < 1 || c.lora.r > BT_LORA_R_MAX ||
        !(c.lora.alpha > 0 && c.lora.alpha <= BT_LORA_ALPHA_MAX))
        fuzz_fail("trainer config accepted out of range");
    for (int i = 0; i < n_sets; i++) { /* every accepted --set path names a key */
        const char *eq = strchr(sets[i], '=');
        size_t k = eq ? (size_t)(eq - sets[i]) : 0;
        if (!k || sets[i][0] == '.' || sets[i][k - 1] == '.' || memmem(sets[i], k, "..", 2))
            fuzz_fail("a --set with an empty key segment was accepted");
    }
    char *dump = bt_config_dump(&c);
    if (!dump) fuzz_fail("no effective config");
    bt_train_config c2;
    if (bt_config_parse(&c2, dump, "dump", NULL, 0)) fuzz_fail("the effective config does not parse again");
    char *dump2 = bt_config_dump(&c2);
    if (!dump2 || strcmp(dump, dump2) != 0) fuzz_fail("the effective config changes when parsed again");
    free(dump2);
    free(dump);
    bt_config_free(&c2);
    bt_config_free(&c);
    free(body);
}

int LLVMFuzzerTestOneInput(const uint8_t *data, size_t size) {
    if (size == 0) return 0;
    bt_log_set_level(BT_LOG_ERROR);
    char *text = dup_n(data + 1, size - 1);
    switch (data[0] % 3) {
    case 0: fuzz_loaderd_config(text); break;
    case 1: fuzz_job_spec(text); break;
    default: fuzz_trainer_config(text); break;
    }
    free(text);
    return 0;
}
