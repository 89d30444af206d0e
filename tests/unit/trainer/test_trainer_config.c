/* Trainer job config: defaults, --set overrides, refusal of unknown keys / wrong types /
 * impossible values with messages naming the key, and the loaderd job spec it produces. */
#include <stdarg.h>
#include <stddef.h>
#include <stdint.h>
#include <setjmp.h>
#include <cmocka.h>

#include <jansson.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <unistd.h>

#include "common/bt_common.h"
#include "trainer/config.h"

#define MINIMAL "{\"model\": \"m.gguf\", \"data\": {\"shards\": [\"d/*.jsonl.zst\"]}}"

static void test_defaults(void **st) {
    (void)st;
    bt_train_config c;
    unsetenv("LOADERD_SOCKET");
    assert_int_equal(bt_config_parse(&c, MINIMAL, "t", NULL, 0), 0);
    assert_string_equal(c.model, "m.gguf");
    assert_int_equal(c.base_dtype, BT_BASE_AUTO); /* gguf for a .gguf, nf4 for a directory */
    assert_string_equal(c.socket, "/run/loaderd/loaderd.sock");
    assert_string_equal(c.base_model_name_or_path, "HuggingFaceTB/SmolLM2-135M-Instruct");
    assert_int_equal(c.data.n_shards, 1);
    assert_string_equal(c.data.shards[0], "d/*.jsonl.zst");
    assert_string_equal(c.data.format, "chat");
    assert_string_equal(c.data.text_field, "text");
    assert_int_equal(c.data.seq_len, 512);
    assert_int_equal(c.data.micro_batch_size, 4);
    assert_int_equal((int)c.data.seed, 1234);
    assert_int_equal(c.data.tokenizer_threads, 2);
    assert_int_equal(c.eval.n_shards, 0);
    assert_int_equal(c.eval.max_batches, 0);
    assert_int_equal(c.lora.r, 16);
    assert_true(c.lora.alpha == 32.0);
    assert_true(c.lora.dropout == 0.05);
    assert_int_equal(c.lora.target_mask, (1u << BT_MOD_N) - 1);
    assert_true(c.optim.lr == 2e-4);
    assert_true(c.optim.weight_decay == 0.0);
    assert_true(c.optim.beta1 == 0.9 && c.optim.beta2 == 0.999 && c.optim.eps == 1e-8);
    assert_true(c.optim.grad_clip == 1.0);
    assert_int_equal(c.optim.warmup_steps, 0);
    assert_int_equal(c.steps, 100);
    assert_int_equal(c.grad_accum, 1);
    assert_int_equal(c.schedule, BT_SCHED_COSINE);
    assert_true(c.min_lr_ratio == 0.1);
    assert_int_equal(c.activation_checkpointing, 0);
    assert_int_equal(c.save_every, 0);
    assert_string_equal(c.out_dir, "runs/adapter");
    assert_int_equal(c.threads, 0);
    assert_int_equal(c.log_every, 1);
    char *dump = bt_config_dump(&c);
    assert_non_null(dump);
    assert_non_null(strstr(dump, "\"lr\":"));
    assert_non_null(strstr(dump, "\"base_dtype\":\"auto\""));
    free(dump);
    bt_config_free(&c);
    const char *gg[] = {"base_dtype=gguf"};
    assert_int_equal(bt_config_parse(&c, MINIMAL, "t", gg, 1), 0);
    assert_int_equal(c.base_dtype, BT_BASE_GGUF);
    bt_config_free(&c);
}

static void test_full_and_sets(void **st) {
    (void)st;
    const char *txt =
        "{\"model\": \"x.gguf\", \"base_dtype\": \"fp32\", \"socket\": \"/tmp/s.sock\","
        " \"data\": {\"shards\": [\"a\", \"b\"], \"format\": \"text\", \"seq_len\": 256,"
        "  \"micro_batch_size\": 2, \"seed\": 7},"
        " \"eval\": {\"shards\": [\"e\"], \"max_batches\": 3},"
        " \"lora\": {\"r\": 8, \"lora_alpha\": 16, \"lora_dropout\": 0,"
        "  \"target_modules\": [\"q_proj\", \"v_proj\"]},"
        " \"optim\": {\"lr\": 1e-3, \"warmup_steps\": 5, \"grad_clip\": 0.5},"
        " \"steps\": 60, \"grad_accum\": 2, \"schedule\": \"linear\", \"save_every\": 20,"
        " \"out_dir\": \"runs/x\", \"threads\": 2, \"seed\": 9}";
    const char *sets[] = {"optim.lr=3e-4", "socket=/run/other.sock", "steps=80",
                          "lora.target_modules=[\"o_proj\",\"down_proj\"]",
                          "data.shards=[\"c/*.jsonl\"]", "activation_checkpointing=true",
                          "name=my job"};
    bt_train_config c;
    assert_int_equal(bt_config_parse(&c, txt, "t", sets, 7), 0);
    assert_int_equal(c.base_dtype, BT_BASE_FP32);
    assert_string_equal(bt_base_dtype_name(c.base_dtype), "fp32");
    assert_true(c.optim.lr == 3e-4);                  /* JSON number */
    assert_string_equal(c.socket, "/run/other.sock"); /* not JSON -> string */
    assert_string_equal(c.name, "my job");
    assert_int_equal(c.steps, 80);
    assert_int_equal(c.lora.target_mask, (1u << BT_MOD_O) | (1u << BT_MOD_DOWN));
    assert_int_equal(c.data.n_shards, 1);
    assert_string_equal(c.data.shards[0], "c/*.jsonl");
    assert_int_equal(c.activation_checkpointing, 1);
    assert_int_equal(c.eval.n_shards, 1);
    assert_int_equal(c.eval.max_batches, 3);
    assert_int_equal(c.lora.r, 8);
    assert_true(c.lora.dropout == 0.0);
    assert_int_equal(c.schedule, BT_SCHED_LINEAR);
    assert_int_equal(c.optim.warmup_steps, 5);
    assert_int_equal(c.grad_accum, 2);

    /* job specs */
    char *job = bt_config_job_json(&c, 0, NULL);
    json_error_t e;
    json_t *j = json_loads(job, 0, &e);
    assert_non_null(j);
    char cwd[4096], want[4200];
    assert_non_null(getcwd(cwd, sizeof cwd));
    snprintf(want, sizeof want, "%s/x.gguf", cwd);
    assert_string_equal(json_string_value(json_object_get(j, "tokenizer")), want);
    assert_string_equal(json_string_value(json_object_get(j, "format")), "text");
    assert_int_equal(json_integer_value(json_object_get(j, "seq_len")), 256);
    assert_int_equal(json_integer_value(json_object_get(j, "micro_batch_size")), 2);
    assert_int_equal(json_integer_value(json_object_get(j, "seed")), 7);
    assert_int_equal(json_integer_value(json_object_get(j, "epochs")), 0);
    snprintf(want, sizeof want, "%s/c/*.jsonl", cwd);
    assert_string_equal(json_string_value(json_array_get(json_object_get(j, "shards"), 0)), want);
    json_decref(j);
    free(job);
    job = bt_config_job_json(&c, 1, NULL);
    j = json_loads(job, 0, &e);
    assert_non_null(j);
    assert_int_equal(json_integer_value(json_object_get(j, "epochs")), 1);
    snprintf(want, sizeof want, "%s/e", cwd);
    assert_string_equal(json_string_value(json_array_get(json_object_get(j, "shards"), 0)), want);
    assert_null(json_object_get(j, "chat_template")); /* format "text" */
    json_decref(j);
    free(job);
    bt_config_free(&c);
    /* data.chat_template reaches loaderd's job spec; "auto" (the default) is loaderd's own default
     * and is not sent, so a job's identity does not change with the key's introduction */
    const char *chat = "{\"model\": \"x.gguf\", \"data\": {\"shards\": [\"c\"], \"format\": \"chat\"}}";
    const char *tpl_set[] = {"data.chat_template=phi3"};
    for (int k = 0; k < 2; k++) {
        assert_int_equal(bt_config_parse(&c, chat, "t", tpl_set, k), 0);
        job = bt_config_job_json(&c, 0, NULL);
        j = json_loads(job, 0, &e);
        assert_non_null(j);
        if (k) assert_string_equal(json_string_value(json_object_get(j, "chat_template")), "phi3");
        else assert_null(json_object_get(j, "chat_template"));
        json_decref(j);
        free(job);
        bt_config_free(&c);
    }
    const char *bad[] = {"data.chat_template=vicuna"};
    assert_int_equal(bt_config_parse(&c, chat, "t", bad, 1), BT_ERR_INVALID);
    assert_non_null(strstr(bt_last_error(), "data.chat_template"));
}

/* Parse must fail with BT_ERR_INVALID and a message containing `needle`. */
static void expect_refused(const char *txt, const char *set, const char *needle) {
    bt_train_config c;
    const char *sets[1] = {set};
    int rc = bt_config_parse(&c, txt, "t", set ? sets : NULL, set ? 1 : 0);
    if (rc != BT_ERR_INVALID || !strstr(bt_last_error(), needle))
        fail_msg("expected refusal mentioning '%s' for %s %s; got rc %d: %s", needle, txt,
                 set ? set : "", rc, bt_last_error());
    assert_null(c.model); /* zeroed on failure */
}

static void test_refusals(void **st) {
    (void)st;
    /* exact message format */
    bt_train_config c;
    const char *s1[] = {"optim.lr=abc"};
    assert_int_equal(bt_config_parse(&c, MINIMAL, "t", s1, 1), BT_ERR_INVALID);
    assert_string_equal(bt_last_error(), "config: optim.lr: expected a number in (0, 1], got \"abc\"");

    expect_refused(MINIMAL, "optim.momentum=0.9", "unknown key \"optim.momentum\"");
    expect_refused(MINIMAL, "trainer_steps=3", "unknown key \"trainer_steps\"");
    expect_refused(MINIMAL, "data.seq_len=\"long\"", "data.seq_len: expected an integer");
    expect_refused(MINIMAL, "data.seq_len=1.5", "data.seq_len: expected an integer");
    expect_refused(MINIMAL, "steps=0", "steps: expected an integer >= 1");
    expect_refused(MINIMAL, "optim.lr=-1", "optim.lr");
    expect_refused(MINIMAL, "lora.lora_dropout=1", "lora.lora_dropout");
    expect_refused(MINIMAL, "lora.r=0", "lora.r");
    expect_refused(MINIMAL, "lora.target_modules=[\"q_proj\",\"foo_proj\"]",
                   "lora.target_modules");
    expect_refused(MINIMAL, "lora.target_modules=[]", "lora.target_modules");
    expect_refused(MINIMAL, "base_dtype=int8",
                   "base_dtype: expected one of \"nf4\", \"fp32\", \"gguf\", \"auto\"");
    expect_refused(MINIMAL, "schedule=exp", "schedule");
    expect_refused(MINIMAL, "data.format=xml", "data.format");
    expect_refused(MINIMAL, "optim.beta2=1", "optim.beta2");
    expect_refused(MINIMAL, "activation_checkpointing=1", "activation_checkpointing: expected true");
    expect_refused(MINIMAL, "optim.warmup_steps=-1", "optim.warmup_steps");
    expect_refused(MINIMAL, "data=3", "data: expected an object");
    expect_refused(MINIMAL, "data.shards.x=1", "\"shards\" is not an object");
    expect_refused(MINIMAL, "steps.x=1", "steps: expected an integer");
    expect_refused(MINIMAL, "noequals", "expected key.path=value");
    /* the trainer waits timeout_s * 1000 ms in an int: larger values would overflow */
    expect_refused(MINIMAL, "timeout_s=2147484", "timeout_s: expected an integer in [1, 2147483]");
    expect_refused(MINIMAL, "timeout_s=2147483647", "timeout_s");
    /* a checkpoint in out_dir would be deleted by the next adapter save */
    const char *s3[] = {"checkpoint_every=5", "checkpoint_dir=runs/adapter"};
    assert_int_equal(bt_config_parse(&c, MINIMAL, "t", s3, 2), BT_ERR_INVALID);
    assert_string_equal(bt_last_error(), "config: checkpoint_dir: expected a directory other than "
                        "out_dir (\"runs/adapter\": every adapter save replaces out_dir and would "
                        "delete the checkpoint's trainer_state.bin)");
    const char *s5[] = {"checkpoint_every=5", "checkpoint_dir=./runs/adapter/"};
    assert_int_equal(bt_config_parse(&c, MINIMAL, "t", s5, 2), BT_ERR_INVALID);
    assert_non_null(strstr(bt_last_error(), "checkpoint_dir"));
    const char *s4[] = {"checkpoint_every=0", "checkpoint_dir=runs/adapter"}; /* unused: fine */
    assert_int_equal(bt_config_parse(&c, MINIMAL, "t", s4, 2), 0);
    bt_config_free(&c);
    const char *s2[] = {"timeout_s=2147483"};
    assert_int_equal(bt_config_parse(&c, MINIMAL, "t", s2, 1), 0);
    assert_int_equal(c.timeout_s, 2147483);
    bt_config_free(&c);
    expect_refused("{\"data\": {\"shards\": [\"a\"]}}", NULL, "model: required key missing");
    expect_refused("{\"model\": \"m\"}", NULL, "data.shards: required key missing");
    expect_refused("{\"model\": \"m\", \"data\": {\"shards\": []}}", NULL, "data.shards");
    expect_refused("{\"model\": \"m\", \"data\": {\"shards\": [3]}}", NULL, "data.shards");
    expect_refused("{\"model\": 5, \"data\": {\"shards\": [\"a\"]}}", NULL,
                   "model: expected a non-empty string, got 5");

    /* hyper-parameter ranges, refused up front naming the key and the range (issue 10 §4:
     * optim.lr 1e308 used to run, diverge and exit 0) */
    expect_refused(MINIMAL, "optim.lr=1e308", "optim.lr: expected a number in (0, 1], got 1e308");
    expect_refused(MINIMAL, "optim.lr=0", "optim.lr: expected a number in (0, 1]");
    expect_refused(MINIMAL, "optim.weight_decay=2", "optim.weight_decay: expected a number in [0, 1]");
    expect_refused(MINIMAL, "optim.eps=0", "optim.eps: expected a number in (0, 1]");
    expect_refused(MINIMAL, "optim.eps=10", "optim.eps");
    expect_refused(MINIMAL, "optim.beta1=1", "optim.beta1: expected a number in [0, 1)");
    expect_refused(MINIMAL, "optim.grad_clip=1e7", "optim.grad_clip: expected a number in [0, 1000000]");
    expect_refused(MINIMAL, "lora.lora_alpha=1e9", "lora.lora_alpha: expected a number in (0, 65536]");
    {   /* the edges are in; warmup past steps is allowed (HF Trainer does; train warns) */
        const char *ok[] = {"steps=10", "optim.warmup_steps=11", "optim.lr=1", "optim.weight_decay=1"};
        assert_int_equal(bt_config_parse(&c, MINIMAL, "t", ok, 4), 0);
        bt_config_free(&c);
    }

    /* a key given twice is refused naming it (issue 10 §5), in the file and in a --set value */
    assert_int_equal(bt_config_parse(&c, "{\"model\": \"a.gguf\", \"data\": {\"shards\": [\"x\"], \"seq_len\": 64,"
                                         "\n \"seq_len\": 128}}", "job.json", NULL, 0), BT_ERR_FORMAT);
    assert_string_equal(bt_last_error(), "config: job.json:2:10: duplicate key \"seq_len\" (each key may appear "
                                         "only once in an object)");
    assert_null(c.model);
    const char *dup[] = {"lora={\"r\": 4, \"r\": 8}"};
    assert_int_equal(bt_config_parse(&c, MINIMAL, "t", dup, 1), BT_ERR_INVALID);
    assert_non_null(strstr(bt_last_error(), "duplicate object key near '\"r\"'"));
    /* a UTF-8 byte-order mark is skipped */
    assert_int_equal(bt_config_parse(&c, "\xEF\xBB\xBF" MINIMAL, "bom.json", NULL, 0), 0);
    assert_string_equal(c.model, "m.gguf");
    bt_config_free(&c);

    /* not JSON / not an object */
    assert_int_equal(bt_config_parse(&c, "{\"model\": ", "job.json", NULL, 0), BT_ERR_FORMAT);
    assert_non_null(strstr(bt_last_error(), "job.json"));
    assert_int_equal(bt_config_parse(&c, "[1,2]", "job.json", NULL, 0), BT_ERR_FORMAT);
}

static void test_load_file(void **st) {
    (void)st;
    char path[] = "/tmp/bt_cfg_XXXXXX";
    int fd = mkstemp(path);
    assert_true(fd >= 0);
    FILE *f = fdopen(fd, "w");
    fputs(MINIMAL, f);
    fclose(f);
    bt_train_config c;
    const char *sets[] = {"eval.shards=[\"e.jsonl\"]", "eval.max_batches=2"};
    assert_int_equal(bt_config_load(&c, path, sets, 2), 0);
    assert_int_equal(c.eval.n_shards, 1);
    assert_string_equal(c.eval.shards[0], "e.jsonl");
    bt_config_free(&c);
    unlink(path);
    assert_int_equal(bt_config_load(&c, "/nonexistent/job.json", NULL, 0), BT_ERR_IO);
    assert_non_null(strstr(bt_last_error(), "/nonexistent/job.json"));
}

static void test_demo_config(void **st) {
    (void)st;
    bt_train_config c;
    int rc = bt_config_load(&c, "scripts/job.demo.json", NULL, 0);
    if (rc) fail_msg("scripts/job.demo.json: %s", bt_last_error());
    assert_int_equal(c.data.seq_len, 512);
    assert_int_equal(c.data.micro_batch_size, 4);
    assert_true(c.eval.n_shards > 0);
    bt_config_free(&c);
}

/* LoRA+, checkpoint and resume keys: defaults, values, refusals naming the key. */
static void test_new_keys(void **st) {
    (void)st;
    bt_train_config c;
    assert_int_equal(bt_config_parse(&c, MINIMAL, "t", NULL, 0), 0);
    assert_int_equal(c.trainable_mask, 0);
    assert_int_equal(c.checkpoint_every, 0);
    assert_string_equal(c.checkpoint_dir, "runs/checkpoint");
    assert_null(c.resume_from);
    assert_int_equal(c.stop_at_step, 0);
    bt_config_free(&c);
    const char *sets[] = {"trainable_modules=[\"norm\",\"embed_tokens\"]", "checkpoint_every=5",
                          "checkpoint_dir=/tmp/ck", "resume_from=/tmp/ck", "stop_at_step=50"};
    assert_int_equal(bt_config_parse(&c, MINIMAL, "t", sets, 5), 0);
    assert_int_equal(c.trainable_mask, (1u << BT_TRAINABLE_EMBED) | (1u << BT_TRAINABLE_NORM));
    assert_int_equal(c.checkpoint_every, 5);
    assert_string_equal(c.checkpoint_dir, "/tmp/ck");
    assert_string_equal(c.resume_from, "/tmp/ck");
    assert_int_equal(c.stop_at_step, 50);
    char *dump = bt_config_dump(&c);
    assert_non_null(strstr(dump, "\"trainable_modules\":[\"embed_tokens\",\"norm\"]"));
    assert_non_null(strstr(dump, "\"resume_from\":\"/tmp/ck\""));
    free(dump);
    bt_config_free(&c);
    const char *nul[] = {"resume_from=null"};
    assert_int_equal(bt_config_parse(&c, MINIMAL, "t", nul, 1), 0);
    assert_null(c.resume_from);
    bt_config_free(&c);
    expect_refused(MINIMAL, "trainable_modules=[\"lm_head\"]",
                   "trainable_modules: expected an array of module names (embed_tokens, norm)");
    expect_refused(MINIMAL, "trainable_modules=\"norm\"", "trainable_modules: expected an array");
    expect_refused(MINIMAL, "checkpoint_every=-1", "checkpoint_every: expected an integer >= 0");
    expect_refused(MINIMAL, "checkpoint_dir=3", "checkpoint_dir: expected a non-empty string");
    expect_refused(MINIMAL, "resume_from=[]", "resume_from: expected a non-empty string");
    expect_refused(MINIMAL, "stop_at_step=101", "stop_at_step: expected an integer in [0, steps = 100]");
}

/* cuda.attention / cuda.base_matmul (set here through its old name, cuda.nf4_matmul): defaults (the kernels verified first), overrides, dump, and
 * refusal of unknown values and keys naming the key. */
static void test_cuda_keys(void **st) {
    (void)st;
    bt_train_config c;
    assert_int_equal(bt_config_parse(&c, MINIMAL, "t", NULL, 0), 0);
    assert_int_equal(c.cuda_attention, BT_CUDA_ATTN_WMMA);
    assert_int_equal(c.cuda_base_matmul, BT_CUDA_BASE_DEQUANT);
    bt_config_free(&c);
    const char *sets[] = {"cuda.attention=mma", "cuda.nf4_matmul=fused", "device=cuda"};
    assert_int_equal(bt_config_parse(&c, MINIMAL, "t", sets, 3), 0);
    assert_int_equal(c.cuda_attention, BT_CUDA_ATTN_MMA);
    assert_int_equal(c.cuda_base_matmul, BT_CUDA_BASE_FUSED);
    assert_int_equal(c.device, BT_DEVICE_CUDA);
    char *dump = bt_config_dump(&c);
    assert_non_null(strstr(dump, "\"cuda\":{\"attention\":\"mma\",\"base_matmul\":\"fused\","
                                 "\"offload_checkpoints\":false}"));
    free(dump);
    bt_config_free(&c);
    expect_refused(MINIMAL, "cuda.attention=flash", "cuda.attention");
    expect_refused(MINIMAL, "cuda.nf4_matmul=1", "cuda.nf4_matmul");
    expect_refused(MINIMAL, "cuda.tiles=64", "cuda.tiles");
    expect_refused(MINIMAL, "cuda=3", "cuda");
}

/* Keys starting with "#" are comments, at every level; other unknown keys still fail. */
static void test_comment_keys(void **st) {
    (void)st;
    const char *txt = "{\"#\": \"job\", \"#model\": \"the base\", \"model\": \"m.gguf\","
                      " \"data\": {\"#\": 1, \"#seq_len\": [true], \"shards\": [\"d\"]},"
                      " \"lora\": {\"#r\": null}, \"optim\": {\"#lr\": {}}}";
    bt_train_config c;
    assert_int_equal(bt_config_parse(&c, txt, "t", NULL, 0), 0);
    assert_string_equal(c.model, "m.gguf");
    bt_config_free(&c);
    expect_refused(txt, "data.x#=1", "unknown key \"data.x#\"");
}

/* Every template (plain and documented) parses as is, and the documented one gives the same
 * configuration; unknown names are refused. */
/* Long-context keys: context_extension, attention.s2, activation_checkpointing "auto" with its
 * threshold, eval.lengths, cuda.offload_checkpoints; each refusal names the key. */
static void test_long_context_keys(void **st) {
    (void)st;
    bt_train_config c;
    assert_int_equal(bt_config_parse(&c, MINIMAL, "t", NULL, 0), 0);
    assert_int_equal(c.context_extension.target_length, 0);
    assert_int_equal(bt_config_s2_group(&c), 0);
    assert_int_equal(c.checkpointing_auto, 1); /* "auto", off at seq_len 512 */
    assert_int_equal(c.activation_checkpointing, 0);
    assert_int_equal(c.checkpointing_min_seq_len, 4096);
    assert_int_equal(c.eval.n_lengths, 0);
    assert_int_equal(c.cuda_offload, 0);
    bt_config_free(&c);
    const char *sets[] = {"data.seq_len=8192", "context_extension={\"target_length\": 16384, "
                          "\"method\": \"yarn\"}", "attention.s2.group_fraction=0.125",
                          "eval.lengths=[8192, 2048, 4096]", "cuda.offload_checkpoints=true"};
    assert_int_equal(bt_config_parse(&c, MINIMAL, "t", sets, 5), 0);
    assert_int_equal(c.activation_checkpointing, 1); /* auto: 8192 >= 4096 */
    assert_int_equal(c.context_extension.target_length, 16384);
    assert_int_equal(c.context_extension.method, BT_ROPE_EXT_YARN);
    assert_int_equal(bt_config_s2_group(&c), 1024);
    assert_int_equal(c.eval.n_lengths, 3);
    assert_int_equal(c.eval.lengths[0], 2048); /* sorted */
    assert_int_equal(c.eval.lengths[2], 8192);
    assert_int_equal(c.cuda_offload, 1);
    /* the dump is a config that parses back to the same */
    char *dump = bt_config_dump(&c);
    bt_train_config d;
    if (bt_config_parse(&d, dump, "dump", NULL, 0)) fail_msg("%s", bt_last_error());
    char *dump2 = bt_config_dump(&d);
    assert_string_equal(dump, dump2);
    free(dump), free(dump2);
    bt_config_free(&d);
    bt_config_free(&c);
    /* S^2 group rounding: 1000 x 0.25 = 250, 1002 x 0.25 = 250.5 -> 250, tiny -> 2 */
    const char *g1[] = {"data.seq_len=1002", "attention={\"s2\": {}}"};
    assert_int_equal(bt_config_parse(&c, MINIMAL, "t", g1, 2), 0);
    assert_int_equal(bt_config_s2_group(&c), 250);
    bt_config_free(&c);
    const char *g2[] = {"data.seq_len=16", "attention.s2.group_fraction=0.1"};
    assert_int_equal(bt_config_parse(&c, MINIMAL, "t", g2, 2), 0);
    assert_int_equal(bt_config_s2_group(&c), 2);
    bt_config_free(&c);
    const char *off[] = {"attention.s2=false", "activation_checkpointing=true"};
    assert_int_equal(bt_config_parse(&c, MINIMAL, "t", off, 2), 0);
    assert_int_equal(bt_config_s2_group(&c), 0);
    assert_int_equal(c.activation_checkpointing, 1);
    assert_int_equal(c.checkpointing_auto, 0);
    bt_config_free(&c);
    expect_refused(MINIMAL, "context_extension={\"method\": \"linear\"}", "target_length");
    expect_refused(MINIMAL, "context_extension={\"target_length\": 16384, \"method\": \"ntk\"}",
                   "context_extension.method");
    expect_refused(MINIMAL, "context_extension={\"target_length\": 16384, \"factor\": 2}",
                   "context_extension.factor");
    expect_refused(MINIMAL, "context_extension=16384", "context_extension");
    expect_refused(MINIMAL, "attention.s2.group_fraction=0", "attention.s2.group_fraction");
    expect_refused(MINIMAL, "attention.s2.group_fraction=1.5", "attention.s2.group_fraction");
    expect_refused(MINIMAL, "attention.s2.groups=4", "attention.s2.groups");
    expect_refused(MINIMAL, "attention.s2=4", "attention.s2");
    expect_refused(MINIMAL, "attention.flash=true", "attention.flash");
    expect_refused(MINIMAL, "activation_checkpointing=sometimes", "activation_checkpointing");
    expect_refused(MINIMAL, "checkpointing_min_seq_len=0", "checkpointing_min_seq_len");
    expect_refused(MINIMAL, "eval.lengths=[2048, 2048]", "eval.lengths");
    expect_refused(MINIMAL, "eval.lengths=[1]", "eval.lengths");
    expect_refused(MINIMAL, "eval.lengths=2048", "eval.lengths");
    expect_refused(MINIMAL, "cuda.offload_checkpoints=true", "cuda.offload_checkpoints");
}

static void test_templates(void **st) {
    (void)st;
    for (int i = 0; bt_config_template_names[i]; i++) {
        char *plain = bt_config_template(bt_config_template_names[i], 0);
        char *doc = bt_config_template(bt_config_template_names[i], 1);
        assert_non_null(plain);
        assert_non_null(doc);
        assert_null(strstr(plain, "\"#"));
        assert_non_null(strstr(doc, "\"#seq_len\""));
        bt_train_config a, b;
        if (bt_config_parse(&a, plain, "template", NULL, 0) != 0)
            fail_msg("template %s: %s", bt_config_template_names[i], bt_last_error());
        assert_int_equal(bt_config_parse(&b, doc, "template", NULL, 0), 0);
        char *da = bt_config_dump(&a), *db = bt_config_dump(&b);
        assert_string_equal(da, db);
        free(da);
        free(db);
        if (!strcmp(bt_config_template_names[i], "long-context")) {
            assert_int_equal(a.trainable_mask, 3);
            assert_int_equal(a.activation_checkpointing, 1);
            assert_int_equal(a.checkpointing_auto, 1);
            assert_int_equal(a.lora.r, 8);
            assert_int_equal(a.lora.target_mask, 0xf);
            assert_int_equal(a.data.seq_len, 16384);
            assert_string_equal(a.data.format, "text");
            assert_int_equal(a.context_extension.target_length, 16384);
            assert_int_equal(a.context_extension.method, BT_ROPE_EXT_LINEAR);
            assert_int_equal(bt_config_s2_group(&a), 4096);
            assert_int_equal(a.eval.n_lengths, 4);
            assert_int_equal(a.eval.lengths[0], 2048);
            assert_int_equal(a.eval.lengths[3], 16384);
        } else if (!strcmp(bt_config_template_names[i], "qlora")) {
            assert_int_equal(a.lora.r, 64);
            assert_true(a.optim.grad_clip == 0.3);
            assert_int_equal(a.schedule, BT_SCHED_CONSTANT);
        }
        bt_config_free(&a);
        bt_config_free(&b);
        free(plain);
        free(doc);
    }
    assert_null(bt_config_template("nope", 0));
    assert_non_null(strstr(bt_last_error(), "unknown template \"nope\""));
    assert_null(bt_config_template(NULL, 1));
}

/* "socket" unset: $LOADERD_SOCKET (non-empty), else the default; set in the job or by --set: as
 * given. dist.heartbeat_timeout_s and dist.secret_file defaults and checks. */
static void test_socket_rule_and_dist_keys(void **st) {
    (void)st;
    bt_train_config c;
    setenv("LOADERD_SOCKET", "/tmp/env.sock", 1);
    assert_int_equal(bt_config_parse(&c, MINIMAL, "t", NULL, 0), 0);
    assert_string_equal(c.socket, "/tmp/env.sock");
    assert_int_equal(c.dist.heartbeat_timeout_s, 60);
    assert_null(c.dist.secret_file);
    bt_config_free(&c);
    const char *sets[] = {"socket=/tmp/set.sock", "dist.heartbeat_timeout_s=5", "dist.secret_file=/home/u/s"};
    assert_int_equal(bt_config_parse(&c, MINIMAL, "t", sets, 3), 0);
    assert_string_equal(c.socket, "/tmp/set.sock");
    assert_int_equal(c.dist.heartbeat_timeout_s, 5);
    assert_string_equal(c.dist.secret_file, "/home/u/s");
    bt_config_free(&c);
    assert_int_equal(bt_config_parse(&c, "{\"model\": \"m\", \"socket\": \"/tmp/job.sock\", "
                                         "\"data\": {\"shards\": [\"x\"]}}", "t", NULL, 0), 0);
    assert_string_equal(c.socket, "/tmp/job.sock");
    bt_config_free(&c);
    setenv("LOADERD_SOCKET", "", 1);
    assert_int_equal(bt_config_parse(&c, MINIMAL, "t", NULL, 0), 0);
    assert_string_equal(c.socket, "/run/loaderd/loaderd.sock");
    bt_config_free(&c);
    unsetenv("LOADERD_SOCKET");
    const char *bad[] = {"dist.heartbeat_timeout_s=0"};
    assert_int_equal(bt_config_parse(&c, MINIMAL, "t", bad, 1), BT_ERR_INVALID);
    assert_non_null(strstr(bt_last_error(), "dist.heartbeat_timeout_s"));
    const char *bad2[] = {"dist.secret_file=7"};
    assert_int_equal(bt_config_parse(&c, MINIMAL, "t", bad2, 1), BT_ERR_INVALID);
    assert_non_null(strstr(bt_last_error(), "dist.secret_file"));
}

/* Each output directory belongs to one writer (issue 21 §1): out_dir, checkpoint_dir and
 * report.dir are three directories, none inside another. */
static void test_output_dirs_not_nested(void **st) {
    (void)st;
    expect_refused(MINIMAL, "checkpoint_dir=\"runs/adapter/ckpt\"", "checkpoint_dir: \"runs/adapter/ckpt\" is inside out_dir");
    expect_refused(MINIMAL, "report.dir=\"runs/adapter\"", "report.dir: \"runs/adapter\" is the same directory as out_dir");
    expect_refused(MINIMAL, "out_dir=\"runs\"", "checkpoint_dir: \"runs/checkpoint\" is inside out_dir");
    bt_train_config c;
    const char *same[] = {"out_dir=\"runs/x\"", "checkpoint_dir=\"runs/x/\""}; /* no checkpoints: allowed */
    assert_int_equal(bt_config_parse(&c, MINIMAL, "t", same, 2), 0);
    bt_config_free(&c);
}

/* The LoRA limits are one definition shared with the adapter loader (trainer/config.h BT_LORA_*;
 * issue 21 §6). */
static void test_lora_limits(void **st) {
    (void)st;
    expect_refused(MINIMAL, "lora.r=4097", "lora.r: expected an integer in [1, 4096]");
    expect_refused(MINIMAL, "lora.lora_alpha=1e38", "lora.lora_alpha: expected a number in (0, 65536]");
}

/* What loaderd would refuse is refused here, from proto/job_limits.h (issue 21 §9). */
/* Phi-3's fused PEFT module names (trainer/model/lora.h): qkv_proj = q|k|v, gate_up_proj =
 * gate|up; the dump lists the parts; an unknown name is still refused. */
static void test_fused_target_names(void **st) {
    (void)st;
    const char *sets[] = {"lora.target_modules=[\"qkv_proj\",\"gate_up_proj\",\"o_proj\"]"};
    bt_train_config c;
    assert_int_equal(bt_config_parse(&c, "{\"model\": \"m\", \"data\": {\"shards\": [\"d\"]}}",
                                     "t", sets, 1), 0);
    assert_int_equal(c.lora.target_mask, (1u << BT_MOD_N) - 1 - (1u << BT_MOD_DOWN));
    bt_config_free(&c);
    const char *bad[] = {"lora.target_modules=[\"qkv\"]"};
    assert_int_equal(bt_config_parse(&c, "{\"model\": \"m\", \"data\": {\"shards\": [\"d\"]}}",
                                     "t", bad, 1), BT_ERR_INVALID);
    assert_non_null(strstr(bt_last_error(), "qkv_proj"));
}

static void test_loaderd_limits(void **st) {
    (void)st;
    expect_refused(MINIMAL, "data.seq_len=15", "data.seq_len: expected an integer in [16, 1048576], got 15");
    expect_refused(MINIMAL, "eval.lengths=[8]", "eval.lengths");
    bt_train_config c;
    const char *sixteen[] = {"data.seq_len=16"};
    assert_int_equal(bt_config_parse(&c, MINIMAL, "t", sixteen, 1), 0);
    bt_config_free(&c);
}

/* A --set key path names exactly one key (issue 21 §11): empty segments, leading / trailing dots
 * and comment keys are refused, not read as another key. */
static void test_set_paths(void **st) {
    (void)st;
    expect_refused(MINIMAL, "optim..lr=0.5", "the key path \"optim..lr\" has an empty segment");
    expect_refused(MINIMAL, ".optim.lr=0.5", "starts with '.'");
    expect_refused(MINIMAL, "optim.lr.=0.5", "ends with '.'");
    expect_refused(MINIMAL, ".=0.5", "starts with '.'");
    expect_refused(MINIMAL, "optim.#lr=0.5", "comment key");
    expect_refused(MINIMAL, "#note=x", "comment key");
    bt_train_config c;
    const char *ok[] = {"optim.lr=0.5"};
    assert_int_equal(bt_config_parse(&c, MINIMAL, "t", ok, 1), 0);
    assert_true(c.optim.lr == 0.5);
    bt_config_free(&c);
}

int main(void) {
    const struct CMUnitTest tests[] = {
        cmocka_unit_test(test_defaults),   cmocka_unit_test(test_full_and_sets),
        cmocka_unit_test(test_refusals),   cmocka_unit_test(test_load_file),
        cmocka_unit_test(test_demo_config), cmocka_unit_test(test_new_keys),
        cmocka_unit_test(test_comment_keys), cmocka_unit_test(test_templates), cmocka_unit_test(test_cuda_keys),
        cmocka_unit_test(test_socket_rule_and_dist_keys),
        cmocka_unit_test(test_long_context_keys),
        cmocka_unit_test(test_output_dirs_not_nested),
        cmocka_unit_test(test_lora_limits),
        cmocka_unit_test(test_loaderd_limits),
        cmocka_unit_test(test_fused_target_names),
        cmocka_unit_test(test_set_paths),
    };
    return cmocka_run_group_tests(tests, NULL, NULL);
}
