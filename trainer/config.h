/* Trainer job configuration: a JSON file (jansson) or a YAML file (.yaml / .yml, libyaml through
 * common/yaml_json.h: the same keys, the same tree, the same validation; messages then carry the
 * file and line of the key, e.g. "config: job.yaml:12: optim.lr: expected a number in (0, 1], got
 * \"abc\""; duplicate keys are refused naming both lines), overridden by
 * `--set key.path=value`.
 *
 * The keys, their types, ranges, defaults and meaning are one table, bt_config_keys
 * (trainer/config_keys.c), which drives the parser, bt_config_dump, the templates, which command
 * reads which key and the reference docs/CONFIG.md (`trainer config --reference`). Renamed keys
 * stay accepted under their old name: cuda.nf4_matmul is cuda.base_matmul.
 *
 * Comments: in every object, keys starting with "#" are ignored (JSON has no comments), e.g.
 *   "#": "what this section is for", "#seq_len": "tokens per packed row"
 * `trainer config --template NAME --documented` writes such keys (with --format yaml: YAML
 * comments instead).
 *
 * Errors always name the key and what was expected, e.g.
 *   config: optim.lr: expected a number in (0, 1], got "abc"
 *   config: unknown key "optim.momentum" (known: lr, weight_decay, ...)
 */
#ifndef BT_TRAINER_CONFIG_H
#define BT_TRAINER_CONFIG_H
#include <stdint.h>
#include <stdio.h>

#include "common/keytab.h"
#include "trainer/preference.h"

/* How the frozen base linears are held (config base_dtype; trainer/model/model.h):
 *   BT_BASE_NF4   re-quantised to NF4 with double quantisation (bitsandbytes layout, QLoRA);
 *   BT_BASE_FP32  dequantised to fp32 (plain LoRA);
 *   BT_BASE_GGUF  kept in the GGUF file's own ggml blocks (Q4_0 .. Q6_K, F16/BF16/F32), no
 *                 re-quantisation: the adapter trains against exactly the weights llama.cpp runs;
 *   BT_BASE_AUTO  (config only; the default) GGUF for a .gguf model, NF4 for a Hugging Face
 *                 directory; resolved when the model loads (bt_model_load). */
enum { BT_BASE_NF4 = 0, BT_BASE_FP32 = 1, BT_BASE_GGUF = 2, BT_BASE_AUTO = 3 };
/* "nf4", "fp32", "gguf", "auto"; "?" for other values. */
const char *bt_base_dtype_name(int base_dtype);
enum { BT_SCHED_COSINE = 0, BT_SCHED_LINEAR = 1, BT_SCHED_CONSTANT = 2 };
enum { BT_DEVICE_CPU = 0, BT_DEVICE_CUDA = 1 };
enum { BT_CUDA_ATTN_WMMA = 0, BT_CUDA_ATTN_MMA = 1 };
/* cuda.base_matmul (alias cuda.nf4_matmul): the matmuls against a quantised base, NF4 or GGUF. */
enum { BT_CUDA_BASE_DEQUANT = 0, BT_CUDA_BASE_FUSED = 1 };
/* RoPE context scaling methods (context_extension.method; trainer/model/model.h hp.rope_ext). */
enum { BT_ROPE_EXT_NONE = 0, BT_ROPE_EXT_LINEAR = 1, BT_ROPE_EXT_YARN = 2, BT_ROPE_EXT_DYNAMIC = 3 };
#define BT_MAX_EVAL_LENGTHS 16

/* LoRA hyper-parameter limits, one definition for the job config (lora.r, lora.lora_alpha) and for
 * every adapter the trainer reads (trainer/io/adapter_load.h bt_lora_load_peft): r in
 * [1, BT_LORA_R_MAX], lora_alpha in (0, BT_LORA_ALPHA_MAX], lora_dropout in [0, 1). A larger
 * alpha / r scale only overflows fp32 (lora_alpha 1e38 makes every logit nan). */
#define BT_LORA_R_MAX 4096
#define BT_LORA_ALPHA_MAX 65536.0

/* LoRA target modules, in the order used everywhere in the trainer (bit i of target_mask). */
enum { BT_MOD_Q = 0, BT_MOD_K, BT_MOD_V, BT_MOD_O, BT_MOD_GATE, BT_MOD_UP, BT_MOD_DOWN, BT_MOD_N };
/* LongLoRA trainable modules (bit i of trainable_mask): "embed_tokens", "norm". */
enum { BT_TRAINABLE_EMBED = 0, BT_TRAINABLE_NORM, BT_TRAINABLE_N };
/* "q_proj", ... "down_proj" for i in [0, BT_MOD_N); NULL otherwise. */
const char *bt_module_name(int mod);

typedef struct {
    char *name;
    char *model;
    int base_dtype;                 /* BT_BASE_* (BT_BASE_AUTO until the model resolves it) */
    char *base_model_name_or_path;
    char *socket;
    struct {
        char **shards;
        int n_shards;
        char *format;               /* "chat" | "text" | "alpaca" | "preference" | "kto" */
        char *text_field;
        char *chat_template;        /* loaderd's chat_template ("auto": not sent) */
        int seq_len;                /* T */
        int micro_batch_size;       /* B */
        uint64_t seed;
        int tokenizer_threads;
        int max_prompt_length;      /* preference / kto truncation (TRL's names), 0 = none */
        int max_length;
    } data;
    struct {
        char **shards;
        int n_shards;               /* 0: no held-out evaluation */
        int max_batches;            /* 0: until END_OF_DATA */
        int every;                  /* > 0: also every `every` optimiser steps; 0: off */
        int lengths[BT_MAX_EVAL_LENGTHS]; /* perplexity per context length (tokens) */
        int n_lengths;              /* 0: one evaluation at data.seq_len */
    } eval;
    struct {
        int r;
        double alpha;
        double dropout;             /* [0, 1) */
        unsigned target_mask;       /* bit BT_MOD_* set = module adapted */
    } lora;
    struct {
        double lr, weight_decay, beta1, beta2, eps, grad_clip;
        int warmup_steps;
    } optim;
    int steps;
    int grad_accum;
    int schedule;                   /* BT_SCHED_* */
    double min_lr_ratio;            /* [0, 1] */
    int activation_checkpointing;   /* bool: the effective setting ("auto" resolved) */
    int checkpointing_auto;         /* the key was "auto" (or absent) */
    int checkpointing_min_seq_len;  /* "auto" checkpoints from this data.seq_len on */
    struct {
        int target_length;          /* 0: no context extension */
        int method;                 /* BT_ROPE_EXT_LINEAR | _YARN | _DYNAMIC */
    } context_extension;
    double s2_group_fraction;       /* attention.s2.group_fraction; 0: full attention */
    int save_every;
    char *out_dir;
    int threads;
    uint64_t seed;
    int log_every;
    int timeout_s;
    unsigned trainable_mask;        /* bit BT_TRAINABLE_* */
    int checkpoint_every;           /* 0 = off */
    char *checkpoint_dir;
    char *resume_from;              /* NULL = fresh start */
    int stop_at_step;               /* 0 = steps */
    int device;                     /* BT_DEVICE_* */
    int cuda_attention;             /* BT_CUDA_ATTN_* (device "cuda" only) */
    int cuda_base_matmul;           /* BT_CUDA_BASE_* (device "cuda" only) */
    int cuda_offload;               /* cuda.offload_checkpoints (device "cuda" only) */
    struct {
        char *master_addr;
        int master_port;            /* [1, 65535] */
        int timeout_s;              /* [1, 86400] */
        int heartbeat_timeout_s;    /* [1, 86400] */
        char *secret_file;          /* NULL: $BT_DIST_SECRET */
        int shard_base;             /* bool: each of the W ranks holds 1/W of every frozen base
                                     * linear, all-gathered per layer (device "cuda" only;
                                     * one rank: nothing to shard, a no-op said in the log) */
    } dist;
    struct {
        char *dir;                  /* run report directory (owned; never NULL after parsing) */
        int plot;                   /* bool */
        int tensorboard;            /* bool */
    } report;
    /* The training objective (issue 25): "sft" (token cross-entropy, the default) or a preference
     * objective with TRL 1.16.0's keys (trainer/preference.h). The rows fill `preference`
     * as written; finish() (config.c) resolves them into `pref` (bt_pref_defaults of the
     * algorithm, then the keys given) and checks it with bt_pref_check. */
    char *objective;                /* "sft" | "dpo" | "orpo" | "simpo" | "cpo" | "kto" */
    struct {
        double beta, label_smoothing, simpo_gamma, desirable_weight, undesirable_weight;
        double cpo_alpha;           /* NAN (null): the algorithm's (cpo 1, simpo 0) */
        char loss_type[BT_PREF_MAX_LOSS_TYPES][24];
        int n_loss_type;            /* 0 (null): the algorithm's default loss type */
        double loss_weights[BT_PREF_MAX_LOSS_TYPES];
        int n_loss_weights;         /* 0 (null): every weight 1 */
        int precompute_ref_log_probs;
    } preference;
    int pref_on;                    /* objective is not "sft" */
    bt_pref_params pref;            /* resolved (pref_on only) */
    const char *eval_adapter;       /* `trainer eval --adapter DIR` (command line only, not a
                                     * key; borrowed, not freed by bt_config_free) */
    int profile;                    /* `trainer train --profile` (command line only) */
    int force;                      /* `trainer train --force`: start even when the memory plan
                                     * exceeds what the process may use (command line only) */
    int world_size;                 /* `trainer estimate --world-size W`: the data-parallel ranks
                                     * the bill is per rank of (command line only; 0: one) */
} bt_train_config;

/* The key table of bt_train_config (common/keytab.h; trainer/config_keys.c). Its user flags say
 * which command reads a key (bt_config_key_used) and which keys every template writes. */
extern const bt_key bt_config_keys[];
enum {
    BT_CFG_EVAL = BT_KEY_USER << 0,     /* read by `trainer eval` */
    BT_CFG_CKPT = BT_KEY_USER << 1,     /* checked against the checkpoint `trainer eval` evaluates */
    BT_CFG_ESTIMATE = BT_KEY_USER << 2, /* read by `trainer estimate` */
    BT_CFG_TEMPLATE = BT_KEY_USER << 3, /* written by every template */
};
/* The reference of every key (Markdown, docs/CONFIG.md) on f. */
void bt_config_reference_md(FILE *f);

/* The S^2-Attn group size in tokens for the job: 0 when attention.s2 is off, else
 * data.seq_len x group_fraction rounded to the nearest even number, at least 2 (LongLoRA:
 * group_size = q_len * group_size_ratio). */
int bt_config_s2_group(const bt_train_config *cfg);

/* Parse a config from JSON text, then apply `n_sets` overrides "a.b=value" in order (value is
 * parsed as JSON when it parses, else taken as a string), then validate.
 * `origin` names the source in messages (file path). On success *cfg is filled (owned; free with
 * bt_config_free). Errors: BT_ERR_INVALID (message "config: <key>: ..." in bt_last_error),
 * BT_ERR_FORMAT (text is not a JSON object). *cfg is left zeroed on failure. */
int bt_config_parse(bt_train_config *cfg, const char *json_text, const char *origin,
                    const char *const *sets, int n_sets);
/* The same from YAML text (len bytes; common/yaml_json.h bt_yaml_load gives the tree, then the
 * same overrides and validation). Validation messages name "<origin>:<line>" of the key they are
 * about (or of its nearest enclosing key present in the file when the key is missing; not for a
 * key given by --set). Errors: BT_ERR_FORMAT ("config: <origin>:<line>:<column>: ..." for YAML
 * syntax, duplicate keys, unsupported tags, aliases past the size cap, a non-mapping root),
 * BT_ERR_INVALID as bt_config_parse. */
int bt_config_parse_yaml(bt_train_config *cfg, const char *text, size_t len, const char *origin,
                         const char *const *sets, int n_sets);
/* 1 if `path` names a YAML config (ends in .yaml or .yml), else 0 (JSON). */
int bt_config_is_yaml(const char *path);
/* Same, reading `path` (BT_ERR_IO if unreadable): YAML when bt_config_is_yaml(path), else JSON. */
int bt_config_load(bt_train_config *cfg, const char *path, const char *const *sets, int n_sets);
void bt_config_free(bt_train_config *cfg);

/* Commands that read a job config (trainer/main.c). */
enum { BT_CMD_TRAIN = 0, BT_CMD_EVAL, BT_CMD_ESTIMATE };

/* Whether `command` reads config key `path` ("optim.lr"; a section name such as "optim" counts
 * as read when any key under it is) for the job in cfg, so that a command line setting of a key
 * the command would ignore can be refused by name instead of being dropped silently:
 *   train     every key (cuda.* only with device "cuda");
 *   eval      the rows flagged BT_CFG_EVAL, cuda.* (device "cuda"), and, when a checkpoint is
 *             evaluated, the rows flagged BT_CFG_CKPT (the keys its identity is checked against);
 *             never resume_from with --adapter (cfg->eval_adapter): the adapter's own config decides;
 *   estimate  the rows flagged BT_CFG_ESTIMATE.
 * Returns 1 (read) or 0 (ignored). */
int bt_config_key_used(int command, const char *path, const bt_train_config *cfg);

/* The socket a job uses when it does not set "socket": $LOADERD_SOCKET when set and non-empty,
 * else BT_DEFAULT_SOCKET (proto/client.h), as loaderctl does. Borrowed string. */
const char *bt_config_default_socket(void);

/* The loaderd job spec (JSON object text, malloc'd; free()) for the training stream
 * (eval = 0: data.shards, epochs 0 = endless) or the held-out stream (eval = 1: eval.shards,
 * epochs 1). Keys as proto/client.h lists; "tokenizer" is the model path (a GGUF file), or
 * <model>/tokenizer.json for a Hugging Face model directory. Relative shard globs
 * and the model path are made absolute against the current directory (loaderd runs elsewhere).
 * ref_base (NULL: none): the job key "ref_base" (proto/PROTOCOL.md), the reference model's
 * identity (bt_model_ref_id) when preference.precompute_ref_log_probs asks for loaderd's cached
 * reference log-probs. NULL on OOM. */
char *bt_config_job_json(const bt_train_config *cfg, int eval, const char *ref_base);

/* The effective configuration as JSON text (malloc'd, free()), for logs. */
char *bt_config_dump(const bt_train_config *cfg);

/* Config templates for `trainer config --template NAME` (trainer/templates.c):
 *   "default"       the SmolLM2-135M demo job (QLoRA r 16 on all linears, seq 512 x 4);
 *   "qlora"         QLoRA paper recipe (Dettmers et al. 2023, arXiv 2305.14314: NF4 base,
 *                   r 64, alpha 16, dropout 0.1 (0.05 for 33B/65B), lr 2e-4, constant
 *                   schedule, max grad norm 0.3, warm-up ratio 0.03, effective batch 16);
 *   "long-context"  LongLoRA recipe (Chen et al. 2023, arXiv 2309.12307, fine-tune.py: r 8,
 *                   alpha 16, q/k/v/o, trainable embed_tokens + norm, lr 2e-5, weight decay 0,
 *                   warm-up 20, constant schedule, batch 1 x grad_accum 8) extending SmolLM2's
 *                   8192-token context to 16384 with linear interpolation (context_extension),
 *                   S^2-Attn with group_fraction 1/4, activation checkpointing ("auto": on at
 *                   this length), held-out perplexity at 2K / 4K / 8K / 16K (eval.lengths).
 * documented != 0 adds "#"-comment keys (ignored by the parser) describing every section and
 * key. Returns pretty-printed JSON text (malloc'd, free()) that bt_config_parse accepts as is,
 * or NULL with BT_ERR_INVALID for an unknown name (message lists the names). */
char *bt_config_template(const char *name, int documented);
/* NULL-terminated list of template names. */
extern const char *const bt_config_template_names[];

/* `trainer config` (argv[0] == "config"):
 *   --template NAME [--documented]   print bt_config_template(NAME) to `out`;
 *   --check JOB.json|JOB.yaml [--set k=v ...] validate a job and print its effective config
 *                                    (compact JSON);
 *   --format json|yaml               how both are printed (yaml: bt_yaml_dump, "#" keys as
 *                                    comments; default json);
 *   --print KEY                      with --check: only that key's value (dotted, e.g. socket,
 *                                    dist.master_port), a string as is, anything else as JSON,
 *                                    whatever --format says (scripts ask the trainer this way:
 *                                    train.sbatch's socket, out_dir, checkpoint_dir).
 * Returns the exit status: 0, 1 (I/O), 2 (usage or configuration error; message on stderr
 * naming the key). */
int bt_config_cmd(int argc, char **argv, FILE *out);

#endif
