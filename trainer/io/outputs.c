/* The trainer's output destinations. See outputs.h. */
#include "trainer/io/outputs.h"

#include <fcntl.h>
#include <jansson.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <unistd.h>

#include "common/bt_common.h"
#include "common/bt_json.h"
#include "common/gguf.h"
#include "trainer/io/adapter.h"
#include "trainer/io/checkpoint.h"
#include "trainer/io/export.h"
#include "trainer/io/model_card.h"

/* ---- adapter and checkpoint directories ---- */

static int owns_adapter(const char *name) {
    return !strcmp(name, "adapter_model.safetensors") || !strcmp(name, "adapter_config.json") ||
           !strcmp(name, "trainer_state.bin") || !strcmp(name, "config.json") ||
           !strcmp(name, "README.md"); /* the model card (trainer/io/model_card.h) */
}

/* 1: dir/name is absent, 0: present. */
static int absent(const char *dir, const char *name) {
    char *p = NULL;
    if (asprintf(&p, "%s/%s", dir, name) < 0) return 0;
    int r = access(p, F_OK) != 0;
    free(p);
    return r;
}

/* dir/adapter_config.json has exactly the keys our writer writes, peft_type "LORA". */
static int our_adapter_config(const char *dir) {
    char *p = NULL;
    json_t *j = NULL;
    if (asprintf(&p, "%s/adapter_config.json", dir) < 0) return 0;
    int ok = bt_json_load_file(&j, p, 0, 1u << 20) == 0 && json_is_object(j) &&
             json_is_string(json_object_get(j, "peft_type")) &&
             !strcmp(json_string_value(json_object_get(j, "peft_type")), "LORA");
    free(p);
    size_t n_ours = 0;
    const char *k;
    json_t *v;
    json_object_foreach(ok ? j : NULL, k, v) {
        int known = !strcmp(k, "barqtrain_context_extension");
        for (int i = 0; !known && bt_adapter_config_keys[i]; i++) known = !strcmp(k, bt_adapter_config_keys[i]);
        if (!known) ok = 0;
        else if (strcmp(k, "barqtrain_context_extension")) n_ours++;
    }
    size_t want = 0;
    while (bt_adapter_config_keys[want]) want++;
    json_decref(j);
    return ok && n_ours == want;
}

/* dir/trainer_state.bin starts with the checkpoint magic. */
static int our_trainer_state(const char *dir) {
    char *p = NULL, head[8];
    if (asprintf(&p, "%s/trainer_state.bin", dir) < 0) return 0;
    int fd = open(p, O_RDONLY | O_NOFOLLOW | O_NONBLOCK | O_CLOEXEC);
    free(p);
    if (fd < 0) return 0;
    int ok = read(fd, head, 8) == 8 && !memcmp(head, BT_CKPT_MAGIC, 8);
    close(fd);
    return ok;
}

static int legacy_adapter(const char *dir) {
    int has_ac = !absent(dir, "adapter_config.json"), has_ts = !absent(dir, "trainer_state.bin");
    if (!has_ac && !has_ts) return 0;
    if (has_ac && !our_adapter_config(dir)) return 0;
    if (has_ts && !our_trainer_state(dir)) return 0;
    return has_ts || absent(dir, "config.json"); /* config.json only beside a checkpoint's state */
}

/* README.md is ours only when it is our model card: the front matter, then BT_MODEL_CARD_MARK,
 * within its first 4 KiB (a user's README.md put into the directory is never replaced). */
static int adapter_file_ours(int dfd, const char *name) {
    if (strcmp(name, "README.md")) return 1;
    int fd = openat(dfd, name, O_RDONLY | O_NOFOLLOW | O_NONBLOCK | O_CLOEXEC);
    if (fd < 0) return 0;
    char head[4097];
    ssize_t n = read(fd, head, sizeof head - 1);
    close(fd);
    if (n <= 0) return 0;
    head[n] = 0;
    return !strncmp(head, "---\n", 4) && strstr(head, "\n---\n" BT_MODEL_CARD_MARK "\n") != NULL;
}

const bt_out_kind bt_out_adapter = {"adapter", owns_adapter, legacy_adapter, 1, adapter_file_ours};
const bt_out_kind bt_out_checkpoint = {"checkpoint", owns_adapter, legacy_adapter, 1, adapter_file_ours};

/* ---- merged Hugging Face exports ---- */

const bt_out_kind bt_out_export = {"export", bt_export_hf_owns, NULL, 0, NULL};

/* ---- run reports ---- */

static int owns_report(const char *name) {
    return !strcmp(name, "metrics.jsonl") || !strcmp(name, "report.png") || !strcmp(name, "profile.json") ||
           !strncmp(name, "events.out.tfevents.", 20) || !strncmp(name, ".plot-", 6);
}

/* metrics.jsonl starts with one of our lines: {"type": "run"|"train"|"eval", "step": N, ...}. */
static int legacy_report(const char *dir) {
    char *p = NULL, line[4096];
    if (asprintf(&p, "%s/metrics.jsonl", dir) < 0) return 0;
    int fd = open(p, O_RDONLY | O_NOFOLLOW | O_NONBLOCK | O_CLOEXEC);
    free(p);
    if (fd < 0) return 0;
    ssize_t n = read(fd, line, sizeof line - 1);
    close(fd);
    if (n <= 0) return n == 0; /* an empty metrics.jsonl: a run that stopped before its first line */
    line[n] = 0;
    char *nl = strchr(line, '\n');
    if (!nl) return 0;
    *nl = 0;
    json_t *j = json_loads(line, 0, NULL);
    const char *ty = json_string_value(json_object_get(j, "type"));
    int ok = ty && (!strcmp(ty, "run") || !strcmp(ty, "train") || !strcmp(ty, "eval")) &&
             json_is_integer(json_object_get(j, "step"));
    json_decref(j);
    return ok;
}

const bt_out_kind bt_out_report = {"report", owns_report, legacy_report, 0, NULL};

/* ---- GGUF files ---- */

int bt_out_gguf_is_ours(const char *path) {
    bt_gguf *g = NULL;
    if (bt_gguf_open(&g, path) != 0) return 0;
    bt_str s;
    int ours = bt_gguf_find_key(g, BT_EXPORT_GGUF_MARK_KEY) >= 0 ||
               (bt_gguf_get_str(g, "general.name", &s) == 0 && s.len == 14 && !memcmp(s.ptr, "BarqTrain LoRA", 14));
    if (bt_gguf_check(g, 0)) ours = 0;
    bt_gguf_close(g);
    return ours;
}

/* ---- a run's destinations ---- */

static int check_one(const char *key, const char *path, const bt_out_kind *k) {
    int rc = bt_out_dir_check(path, k, k->what);
    return rc ? bt_fail(rc, "%s: %s", key, bt_last_error()) : 0;
}

int bt_train_check_outputs(const bt_train_config *cfg) {
    int rc = check_one("out_dir", cfg->out_dir, &bt_out_adapter);
    if (!rc && strcmp(cfg->checkpoint_dir, cfg->out_dir))
        rc = check_one("checkpoint_dir", cfg->checkpoint_dir, &bt_out_checkpoint);
    if (!rc) rc = check_one("report.dir", cfg->report.dir, &bt_out_report);
    return rc;
}
