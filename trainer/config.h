/* Trainer job configuration: a JSON file (jansson) or a YAML file (.yaml / .yml, libyaml through
 * common/yaml_json.h: the same keys, the same tree, the same validation; messages then carry the
 * file and line of the key, e.g. "config: job.yaml:12: optim.lr: expected a number in (0, 1], got
 * \"abc\""; duplicate keys are refused naming both lines), overridden by
 * `--set key.path=value`.
 *
 * Keys and defaults (every key is optional unless marked required):
 *   name "barqtrain"                   job name given to loaderd
 *   model (required)                   path of the base model .gguf (llama architecture)
 *   base_dtype "auto"                  how the frozen base linears are held: "gguf" keeps a GGUF
 *                                      file's own blocks (Q4_0..Q6_K, F16/BF16/F32; no
 *                                      re-quantisation), "nf4" re-quantises to NF4 (QLoRA),
 *                                      "fp32" dequantises; "auto" = "gguf" for a .gguf model,
 *                                      "nf4" for a Hugging Face directory
 *   base_model_name_or_path "HuggingFaceTB/SmolLM2-135M-Instruct"   written to adapter_config.json
 *   socket                             loaderd control socket; when the job does not set it (nor
 *                                      --set socket=...): $LOADERD_SOCKET, else
 *                                      "/run/loaderd/loaderd.sock" (bt_config_default_socket)
 *   data: { shards (required, [glob, ...]), format "chat" ("chat"|"text"|"alpaca"),
 *           text_field "text", seq_len 512 [16, 2^20], micro_batch_size 4 [1, 4096], seed 1234,
 *           tokenizer_threads 2 [1, 256] }, seq_len x micro_batch_size <= 2^24
 *          (all sent to loaderd in the job spec, with "tokenizer" = model; the ranges are the ones
 *          loaderd accepts, proto/job_limits.h, so `trainer config --check` refuses what loaderd
 *          would)
 *   eval: { shards [] (empty = no held-out evaluation), max_batches 0 (0 = until end of data;
 *           per rank: with several ranks each evaluates up to this many of its own batches and
 *           the loss is the token mean over all of them), lengths [] (each in [16, 2^20]; perplexity per context
 *           length: for each L the held-out documents are cut into consecutive L-token windows
 *           (loaderd's text packing at seq_len L) and the loss is over the windows of exactly L
 *           tokens; [] = one evaluation at data.seq_len over every row, as before) }
 *   lora: { r 16 [1, 4096], lora_alpha 32 (0, 65536], lora_dropout 0.05 [0, 1) (BT_LORA_*: the
 *           same limits apply to an adapter read from disk, trainer/io/adapter_load.h),
 *           target_modules ["q_proj","k_proj","v_proj","o_proj","gate_proj","up_proj","down_proj"] }
 *   optim: { lr 2e-4 (0, 1], weight_decay 0.0 [0, 1], beta1 0.9 [0, 1), beta2 0.999 [0, 1),
 *            eps 1e-8 (0, 1], warmup_steps 0 (>= 0; more than `steps` is allowed, as in HF
 *            Trainer, with a warning at start: the rate never reaches lr), grad_clip 1.0
 *            [0, 1e6] (0 = no clipping) }  (out of range: refused at start naming the key and
 *            the range; a run whose loss or gradients still become non-finite stops: exit
 *            status 3, main.c)
 *   steps 100                          optimizer steps
 *   grad_accum 1                       micro-batches per optimizer step
 *   schedule "cosine" ("cosine"|"linear"|"constant"), min_lr_ratio 0.1
 *   activation_checkpointing "auto"    recompute each layer's activations in backward instead of
 *                                      keeping them: true, false, or "auto" = on when
 *                                      data.seq_len >= checkpointing_min_seq_len (gradients are
 *                                      bit-identical either way; one extra forward per step)
 *   checkpointing_min_seq_len 4096     the row length from which "auto" checkpoints
 *   context_extension: { target_length (required when present), method "linear" }
 *                                      extend the model's context window: RoPE scaled so that
 *                                      target_length positions cover the model's trained context,
 *                                      factor = target_length / context_length, with method
 *                                      "linear" (position interpolation, as LongLoRA), "yarn" or
 *                                      "dynamic" (NTK-aware), each as transformers'
 *                                      modeling_rope_utils.py defines it; composes with the
 *                                      model's own scaling (llama3); recorded in the adapter and
 *                                      in every export (trainer/model/model.h bt_model_extend_context)
 *   attention: { s2: { group_fraction 0.25 } }
 *                                      LongLoRA shifted sparse attention in training: groups of
 *                                      group_fraction x seq_len tokens (rounded to even), half the
 *                                      heads shifted by half a group; evaluation and generation
 *                                      use full attention. Absent, null or false: full attention
 *   save_every 0                       also save the adapter every N steps (0 = only at the end)
 *   out_dir "runs/adapter"             adapter directory (replaced atomically on every save)
 *   threads 0                          OpenMP threads for every kernel (0 = the CPUs Slurm gives
 *                                      the task, trainer/parallel/dist.h bt_dist_slurm_cpus, else OpenMP's
 *                                      default: every CPU the process may run on)
 *   device "cpu"                       "cpu" | "cuda" (the GPU trainer, trainer/cuda/; only in a
 *                                      trainer built with `make CUDA=1`, else refused at start)
 *   cuda: { attention "wmma", nf4_matmul "dequant", offload_checkpoints false }
 *                                      kernel choices of the GPU trainer (ignored on the CPU):
 *                                      attention "wmma" (kernels/cuda/attention.cu) | "mma"
 *                                      (attention_mma.cu, register-resident mma.sync FA2);
 *                                      nf4_matmul "dequant" (dequantise the weight, then cuBLAS)
 *                                      | "fused" (nf4_gemm.cu: dequantise in the GEMM main loop);
 *                                      the same choice for a GGUF-native base's ggml blocks
 *                                      offload_checkpoints: keep the checkpointed layer inputs in
 *                                      pinned host memory instead of on the GPU (copies overlap
 *                                      the compute; needs activation checkpointing)
 *   dist: { master_addr "127.0.0.1", master_port 29500, timeout_s 600, heartbeat_timeout_s 60,
 *           secret_file null }
 *                                      data-parallel training over several processes, one per GPU
 *                                      (device "cuda"; trainer/parallel/dist.h): rank 0's address and TCP
 *                                      port for the start-up rendezvous (the environment's
 *                                      MASTER_ADDR / MASTER_PORT, as torchrun and train.sbatch set
 *                                      them, take precedence), and how long the rendezvous and
 *                                      NCCL start-up wait for every rank; rank and world size come
 *                                      from RANK / WORLD_SIZE / LOCAL_RANK or SLURM_PROCID /
 *                                      SLURM_NTASKS / SLURM_LOCALID (one process: rank 0 of 1).
 *                                      timeout_s also bounds each NCCL collective: a rank that has
 *                                      not reached a collective another rank has waited in this
 *                                      long is named and the run ends. heartbeat_timeout_s: a rank
 *                                      that dies, is stopped or loses its network is named on
 *                                      every rank and the run ends within this time
 *                                      (trainer/parallel/dist_monitor.h). secret_file: a file only you can
 *                                      read (mode 0600) holding the job secret that authenticates
 *                                      the ranks at the rendezvous; null: $BT_DIST_SECRET, which
 *                                      scripts/train.sbatch sets per job (trainer/parallel/dist.h
 *                                      bt_dist_key_load)
 *   seed 1234                          LoRA init and dropout seed
 *   log_every 1                        progress line every N steps (and always at the last step)
 *   timeout_s 600                      longest wait for one batch from loaderd, in [1, 2147483]
 *   trainable_modules []               LongLoRA "LoRA+" dense trainable modules on top of LoRA:
 *                                      "embed_tokens" (token embedding; with tied embeddings also
 *                                      the lm_head) and/or "norm" (every RMSNorm weight); saved
 *                                      in the adapter as PEFT modules_to_save (adapter.h)
 *   checkpoint_every 0                 write a resumable checkpoint every N steps (0 = never;
 *                                      also written when a run stops early: stop_at_step, SIGINT,
 *                                      SIGTERM; not after the last step, whose result is out_dir;
 *                                      format: trainer/io/checkpoint.h)
 *   checkpoint_dir "runs/checkpoint"   the checkpoint directory (replaced atomically); must
 *                                      differ from out_dir when checkpoint_every > 0
 *   resume_from null                   checkpoint directory to continue from (also `--resume DIR`)
 *   stop_at_step 0                     stop (and checkpoint) once this many optimiser steps are
 *                                      done, keeping the schedule of `steps` (0 = run to `steps`;
 *                                      for preemptible slots)
 *   report: { dir null, plot true, tensorboard false }
 *                                      the run report (trainer/report/report.h): metrics.jsonl (one JSON
 *                                      line per step and per held-out evaluation) in `dir` (null =
 *                                      "report" beside out_dir, e.g. runs/demo/adapter ->
 *                                      runs/demo/report); plot: report.png at the end (gnuplot);
 *                                      tensorboard: also TensorBoard scalar event files
 *                                      (events.out.tfevents.*) in dir
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
enum { BT_CUDA_NF4_DEQUANT = 0, BT_CUDA_NF4_FUSED = 1 };
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
        char *format;               /* "chat" | "text" | "alpaca" */
        char *text_field;
        int seq_len;                /* T */
        int micro_batch_size;       /* B */
        uint64_t seed;
        int tokenizer_threads;
    } data;
    struct {
        char **shards;
        int n_shards;               /* 0: no held-out evaluation */
        int max_batches;            /* 0: until END_OF_DATA */
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
    int cuda_nf4_matmul;            /* BT_CUDA_NF4_* (device "cuda" only) */
    int cuda_offload;               /* cuda.offload_checkpoints (device "cuda" only) */
    struct {
        char *master_addr;
        int master_port;            /* [1, 65535] */
        int timeout_s;              /* [1, 86400] */
        int heartbeat_timeout_s;    /* [1, 86400] */
        char *secret_file;          /* NULL: $BT_DIST_SECRET */
    } dist;
    struct {
        char *dir;                  /* run report directory (owned; never NULL after parsing) */
        int plot;                   /* bool */
        int tensorboard;            /* bool */
    } report;
    const char *eval_adapter;       /* `trainer eval --adapter DIR` (command line only, not a
                                     * key; borrowed, not freed by bt_config_free) */
    int profile;                    /* `trainer train --profile` (command line only) */
    int force;                      /* `trainer train --force`: start even when the memory plan
                                     * exceeds what the process may use (command line only) */
} bt_train_config;

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
 *   eval      name, model, base_dtype, socket, data.{format, text_field, seq_len,
 *             micro_batch_size, seed, tokenizer_threads}, eval.*, activation_checkpointing,
 *             threads, timeout_s, device, dist.*, cuda.* (device "cuda"), resume_from (the
 *             checkpoint evaluated) and, when a checkpoint is evaluated, the keys its identity
 *             is checked against (lora.*, trainable_modules, seed, grad_accum, data.shards);
 *             never with --adapter (cfg->eval_adapter): the adapter's own config decides;
 *   estimate  model, base_dtype, data.seq_len, data.micro_batch_size, grad_accum, lora.r,
 *             lora.target_modules, trainable_modules, activation_checkpointing, threads.
 * Returns 1 (read) or 0 (ignored). */
int bt_config_key_used(int command, const char *path, const bt_train_config *cfg);

/* The socket a job uses when it does not set "socket": $LOADERD_SOCKET when set and non-empty,
 * else BT_DEFAULT_SOCKET (proto/client.h), as loaderctl does. Borrowed string. */
const char *bt_config_default_socket(void);

/* The loaderd job spec (JSON object text, malloc'd; free()) for the training stream
 * (eval = 0: data.shards, epochs 0 = endless) or the held-out stream (eval = 1: eval.shards,
 * epochs 1). Keys as proto/client.h lists; "tokenizer" is the model path. Relative shard globs
 * and the model path are made absolute against the current directory (loaderd runs elsewhere).
 * NULL on OOM. */
char *bt_config_job_json(const bt_train_config *cfg, int eval);

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
