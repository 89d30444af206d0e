/* The trainer's output destinations (trainer/io/outputs.h; issue 21 §1): every directory the
 * adapter and checkpoint writers build carries BarqTrain's marker; such a directory, and one an
 * earlier BarqTrain wrote (no marker, recognised by content: our exact adapter_config.json keys,
 * the checkpoint magic, our metrics lines), is replaced or written into; a directory holding
 * anything else (a README, a PEFT adapter someone else wrote, a foreign metrics.jsonl) is
 * refused with nothing changed; a GGUF is replaced only when an export of ours wrote it; and
 * `trainer train`'s up-front check names the config key. */
#include <stdarg.h>
#include <stddef.h>
#include <stdint.h>
#include <setjmp.h>
#include <cmocka.h>

#include <dirent.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/stat.h>
#include <unistd.h>

#include "common/bt_common.h"
#include "common/gguf.h"
#include "common/out_dir.h"
#include "trainer/config.h"
#include "trainer/io/adapter.h"
#include "trainer/io/export.h"
#include "trainer/io/model_card.h"
#include "trainer/io/outputs.h"
#include "trainer/io/checkpoint.h"
#include "trainer/model/lora.h"
#include "trainer/model/model.h"
#include "tests/unit/util/test_util.h"
#include "tests/unit/util/tiny_gguf.h"

static char g_dir[64];

static const bt_llama_hparams k_hp = {
    .n_layer = 2, .d_model = 64, .n_head = 4, .n_kv_head = 2, .head_dim = 16, .d_ff = 128,
    .vocab = 96, .ctx = 64, .rope_theta = 10000.f, .rms_eps = 1e-5f};

static int setup(void **st) {
    (void)st;
    return tu_make_tmpdir(g_dir, sizeof g_dir, "outputs");
}

static int teardown(void **st) {
    (void)st;
    return tu_remove_dir(g_dir);
}

static void at(char *buf, size_t n, const char *rel) { snprintf(buf, n, "%s/%s", g_dir, rel); }

static void spit(const char *dir, const char *name, const char *text) {
    char p[400];
    snprintf(p, sizeof p, "%s/%s", dir, name);
    tu_write_file(NULL, p, text, strlen(text));
}

static int entries(const char *dir) {
    DIR *d = opendir(dir);
    assert_non_null(d);
    int n = 0;
    for (struct dirent *e; (e = readdir(d));) n += e->d_name[0] != '.' || (e->d_name[1] && e->d_name[1] != '.');
    closedir(d);
    return n;
}

static void config(bt_train_config *c, const char *extra) {
    char txt[1024];
    snprintf(txt, sizeof txt, "{\"model\": \"m.gguf\", \"data\": {\"shards\": [\"d\"], \"seq_len\": 32, "
             "\"micro_batch_size\": 2}, \"lora\": {\"r\": 2, \"lora_alpha\": 4}%s}", extra ? extra : "");
    assert_int_equal(bt_config_parse(c, txt, "t", NULL, 0), 0);
}

/* Adapter directories: marked, replaced again and again, never over a user's file; one written
 * before the marker is ours by its adapter_config.json, a PEFT-written one is not. */
static void test_adapter_dirs(void **st) {
    (void)st;
    bt_model m;
    assert_int_equal(bt_model_init_random(&m, &k_hp, BT_BASE_FP32, 1, 3), 0);
    bt_lora lo;
    assert_int_equal(bt_lora_init(&lo, &m, 2, 4, 0, (1u << BT_MOD_N) - 1, 0, 1), 0);
    char dir[200];
    at(dir, sizeof dir, "adapter");
    assert_int_equal(bt_adapter_save(&lo, "base", dir, NULL), 0);
    assert_true(bt_out_dir_marked(dir));
    assert_int_equal(entries(dir), 3);
    assert_int_equal(bt_adapter_save(&lo, "base", dir, NULL), 0); /* over its own output */
    /* a file BarqTrain did not write: refused before anything is written, nothing lost (a
     * README.md counts as ours only when it is our model card, by its content) */
    spit(dir, "README.md", "my notes");
    assert_int_equal(bt_adapter_save(&lo, "base", dir, NULL), BT_ERR_INVALID);
    assert_non_null(strstr(bt_last_error(), "adapter: "));
    assert_non_null(strstr(bt_last_error(), "\"README.md\""));
    assert_int_equal(entries(dir), 4);
    assert_int_equal(entries(g_dir), 1); /* no temporary left beside it */
    char p[300];
    snprintf(p, sizeof p, "%s/README.md", dir);
    unlink(p);
    /* our own model card is ours: the next save replaces the directory, card included */
    bt_train_config cfg = {.name = "t", .model = "m.gguf", .steps = 1, .data.format = "chat"};
    const bt_model_card_result res = {1, 0, 1, 2.0, 3.0, 2.5, 10};
    assert_int_equal(bt_model_card_write(dir, &cfg, &res), 0);
    assert_int_equal(entries(dir), 4);
    assert_int_equal(bt_adapter_save(&lo, "base", dir, NULL), 0);
    assert_int_equal(entries(dir), 3);
    /* written before the marker existed: recognised by our adapter_config.json, marked again */
    snprintf(p, sizeof p, "%s/" BT_OUT_MARKER, dir);
    unlink(p);
    assert_int_equal(bt_out_dir_check(dir, &bt_out_adapter, "adapter"), 0);
    assert_int_equal(bt_adapter_save(&lo, "base", dir, NULL), 0);
    assert_true(bt_out_dir_marked(dir));
    /* an adapter PEFT wrote (its own key set) without the marker: not ours */
    unlink(p);
    spit(dir, "adapter_config.json", "{\"peft_type\": \"LORA\", \"r\": 2, \"lora_alpha\": 4, \"peft_version\": "
         "\"0.17.1\", \"target_modules\": [\"q_proj\"]}");
    assert_int_equal(bt_adapter_save(&lo, "base", dir, NULL), BT_ERR_INVALID);
    assert_non_null(strstr(bt_last_error(), "not recognisably BarqTrain's"));
    snprintf(p, sizeof p, "%s/adapter_config.json", dir);
    size_t n;
    char *kept = (char *)tu_slurp(p, &n);
    assert_non_null(strstr(kept, "peft_version")); /* untouched */
    free(kept);
    bt_lora_free(&lo);
    bt_model_free(&m);
}

/* Checkpoint directories: marked; without the marker recognised by the checkpoint magic; an
 * out_dir that once held a checkpoint is ours for the adapter writer too. */
static void test_checkpoint_dirs(void **st) {
    (void)st;
    bt_train_config c;
    config(&c, NULL);
    bt_model m;
    assert_int_equal(bt_model_init_random(&m, &k_hp, BT_BASE_FP32, 1, 3), 0);
    bt_lora lo;
    assert_int_equal(bt_lora_init(&lo, &m, 2, 4, 0, (1u << BT_MOD_N) - 1, 0, 1), 0);
    char dir[200], p[300];
    at(dir, sizeof dir, "ckpt");
    assert_int_equal(bt_checkpoint_save(dir, &c, &m, &lo, 1, NULL, 1), 0);
    assert_true(bt_out_dir_marked(dir));
    assert_int_equal(entries(dir), 5);
    snprintf(p, sizeof p, "%s/" BT_OUT_MARKER, dir);
    unlink(p);
    assert_int_equal(bt_out_dir_check(dir, &bt_out_checkpoint, "checkpoint"), 0);
    assert_int_equal(bt_out_dir_check(dir, &bt_out_adapter, "adapter"), 0);
    assert_int_equal(bt_checkpoint_save(dir, &c, &m, &lo, 2, NULL, 1), 0);
    assert_int_equal(bt_adapter_save(&lo, "base", dir, NULL), 0); /* an out_dir pointed at it */
    assert_int_equal(entries(dir), 3);
    /* a trainer_state.bin that is not ours, without the marker */
    assert_int_equal(bt_checkpoint_save(dir, &c, &m, &lo, 2, NULL, 1), 0);
    unlink(p);
    spit(dir, "trainer_state.bin", "someone else's state");
    spit(dir, "adapter_config.json", "{}");
    assert_int_equal(bt_checkpoint_save(dir, &c, &m, &lo, 3, NULL, 1), BT_ERR_INVALID);
    bt_lora_free(&lo);
    bt_model_free(&m);
    bt_config_free(&c);
}

/* Report directories are written into: ours with the marker, or by our metrics lines. */
static void test_report_dirs(void **st) {
    (void)st;
    char dir[200];
    at(dir, sizeof dir, "report");
    assert_int_equal(bt_out_dir_check(dir, &bt_out_report, "report"), 0);
    assert_int_equal(mkdir(dir, 0755), 0);
    spit(dir, "metrics.jsonl", "{\"type\": \"train\", \"step\": 1, \"loss\": 2.5}\n");
    spit(dir, "report.png", "png");
    spit(dir, "events.out.tfevents.1795000000.host.42.0", "ev");
    assert_int_equal(bt_out_dir_check(dir, &bt_out_report, "report"), 0); /* an earlier version's */
    spit(dir, "metrics.jsonl", "epoch,loss\n1,2.5\n");
    assert_int_equal(bt_out_dir_check(dir, &bt_out_report, "report"), BT_ERR_INVALID);
    assert_int_equal(bt_out_dir_mark(dir, &bt_out_report, "report"), 0);
    assert_int_equal(bt_out_dir_check(dir, &bt_out_report, "report"), 0);
    spit(dir, "notes.txt", "mine");
    assert_int_equal(bt_out_dir_check(dir, &bt_out_report, "report"), BT_ERR_INVALID);
    assert_non_null(strstr(bt_last_error(), "refusing to write into it"));
}

/* GGUF files: ours by the export's KV (or the old LoRA GGUF's general.name). */
static void test_gguf_files(void **st) {
    (void)st;
    char p[200];
    at(p, sizeof p, "base.gguf");
    tu_tiny_spec ts = tu_tiny_default();
    assert_int_equal(tu_tiny_gguf_write(p, &ts, NULL), 0);
    assert_false(bt_out_gguf_is_ours(p));
    assert_int_equal(bt_out_file_check(p, bt_out_gguf_is_ours, "export"), BT_ERR_INVALID);
    for (int k = 0; k < 2; k++) {
        bt_gguf_writer *w = bt_gguf_writer_new();
        assert_non_null(w);
        if (k == 0) assert_int_equal(bt_gguf_w_str(w, BT_EXPORT_GGUF_MARK_KEY, "gguf", 4), 0);
        else assert_int_equal(bt_gguf_w_str(w, "general.name", "BarqTrain LoRA", 14), 0);
        at(p, sizeof p, "ours.gguf");
        assert_int_equal(bt_gguf_writer_write(w, p), 0);
        bt_gguf_writer_free(w);
        assert_true(bt_out_gguf_is_ours(p));
        assert_int_equal(bt_out_file_check(p, bt_out_gguf_is_ours, "export"), 0);
    }
    at(p, sizeof p, "notes.txt");
    tu_write_file(NULL, p, "x", 1);
    assert_false(bt_out_gguf_is_ours(p));
}

/* `trainer train`'s check names the key of the refused destination. */
static void test_train_check_outputs(void **st) {
    (void)st;
    char out[100], txt[512];
    at(out, sizeof out, "home");
    assert_int_equal(mkdir(out, 0755), 0);
    spit(out, "thesis.tex", "years of work");
    snprintf(txt, sizeof txt, ", \"out_dir\": \"%s/run/adapter\", \"checkpoint_dir\": \"%s\"", g_dir, out);
    bt_train_config c;
    config(&c, txt);
    assert_int_equal(bt_train_check_outputs(&c), BT_ERR_INVALID);
    assert_non_null(strstr(bt_last_error(), "checkpoint_dir: checkpoint: "));
    assert_non_null(strstr(bt_last_error(), "\"thesis.tex\""));
    bt_config_free(&c);
    snprintf(txt, sizeof txt, ", \"out_dir\": \"%s\"", out);
    config(&c, txt);
    assert_int_equal(bt_train_check_outputs(&c), BT_ERR_INVALID);
    assert_non_null(strstr(bt_last_error(), "out_dir: adapter: "));
    bt_config_free(&c);
    snprintf(txt, sizeof txt, ", \"out_dir\": \"%s/a\", \"report\": {\"dir\": \"%s\"}", g_dir, out);
    config(&c, txt);
    assert_int_equal(bt_train_check_outputs(&c), BT_ERR_INVALID);
    assert_non_null(strstr(bt_last_error(), "report.dir: report: "));
    bt_config_free(&c);
    snprintf(txt, sizeof txt, ", \"out_dir\": \"%s/new/adapter\", \"checkpoint_dir\": \"%s/new/ckpt\"", g_dir, g_dir);
    config(&c, txt);
    assert_int_equal(bt_train_check_outputs(&c), 0);
    bt_config_free(&c);
    snprintf(txt, sizeof txt, "%s/thesis.tex", out);
    size_t n;
    char *kept = (char *)tu_slurp(txt, &n);
    assert_int_equal(n, 13);
    free(kept);
}

int main(void) {
    const struct CMUnitTest tests[] = {
        cmocka_unit_test_setup_teardown(test_adapter_dirs, setup, teardown),
        cmocka_unit_test_setup_teardown(test_checkpoint_dirs, setup, teardown),
        cmocka_unit_test_setup_teardown(test_report_dirs, setup, teardown),
        cmocka_unit_test_setup_teardown(test_gguf_files, setup, teardown),
        cmocka_unit_test_setup_teardown(test_train_check_outputs, setup, teardown),
    };
    return cmocka_run_group_tests(tests, NULL, NULL);
}
