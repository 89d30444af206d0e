/* trainer: the BarqTrain LoRA/QLoRA trainer (the CPU backend, and the CUDA one when linked with it:
 * trainer/backend/backend.h).
 *   trainer train --config job.json [--set key.path=value ...]
 *   trainer eval  --config job.json [--set key.path=value ...]
 *   trainer --help
 * Exit status (trainer/loop/train.h BT_EXIT_*): 0 success, 1 runtime failure, 2 usage or
 * configuration error, 3 training diverged (non-finite loss, gradients or parameters: nothing of
 * the diverged steps was saved; out_dir and checkpoint_dir keep the last good adapter and
 * checkpoint), 75 interrupted (a signal; the last completed step is saved). */
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "common/bt_common.h"
#include "kernels/kernels.h"
#include "trainer/backend/backend.h"
#include "trainer/config.h"
#include "trainer/estimate.h"
#include "trainer/io/export.h"
#include "trainer/infer/generate.h"
#include "trainer/report/report.h"
#include "trainer/loop/train.h"

static void usage(FILE *f) {
    fprintf(f,
            "usage: trainer train --config JOB.json|JOB.yaml [--set key.path=value ...]\n"
            "                     [--resume CKPT_DIR] [--device cpu|cuda] [--profile] [--force]\n"
            "       trainer eval  --config JOB [--adapter DIR | --checkpoint DIR] [--set ...]\n"
            "                     [--device cpu|cuda]\n"
            "       trainer estimate --config JOB [--set key.path=value ...] [--max-seq-len-for GiB]\n"
            "       trainer report RUN_DIR             (the plot of a run's metrics.jsonl)\n"
            "       trainer config --template default|qlora|long-context [--documented]\n"
            "                      [--format json|yaml]\n"
            "       trainer config --check JOB [--set key.path=value ...] [--format json|yaml]\n"
            "                      [--print KEY]\n"
            "       trainer export --model BASE.gguf --adapter DIR --format peft|gguf-lora|gguf|safetensors\n"
            "                      --out PATH [--dtype f32|f16|bf16|q8_0]   (trainer export --help)\n"
            "       trainer generate --model M.gguf (--prompt TEXT | --chat TEXT) [--adapter DIR] ...\n"
            "                      (trainer generate --help)\n"
            "       trainer --help\n"
            "\n"
            "train  attach to loaderd, evaluate on eval.shards, train `steps` optimiser steps of\n"
            "       LoRA on the frozen (NF4 or fp32) base, save the PEFT adapter to out_dir,\n"
            "       evaluate again and print the held-out loss change.\n"
            "eval   held-out loss and perplexity on eval.shards of the base model, of a PEFT adapter\n"
            "       (--adapter DIR: ours or written by PEFT) or of a checkpoint (--checkpoint DIR,\n"
            "       config resume_from).\n"
            "estimate  memory bill (CPU fp32 and CUDA bf16) from the model's header and the job;\n"
            "          --max-seq-len-for GiB: the longest data.seq_len that fits in that memory.\n"
            "config    print a config template (--documented: with \"#\" comment keys, which the\n"
            "          parser ignores), or validate a job and print its effective config (--print\n"
            "          KEY: one key's value, e.g. --print socket).\n"
            "--resume DIR continues a run from a checkpoint (config resume_from; checkpoints are\n"
            "written every checkpoint_every steps to checkpoint_dir).\n"
            "--device cpu|cuda is config `device` (cuda: the GPU trainer, only in a trainer built\n"
            "with `make CUDA=1`%s).\n"
            "\n"
            "--profile (train) prints the time and memory of every op of one step.\n"
            "Before it loads anything, train checks that every output directory (out_dir,\n"
            "checkpoint_dir, report.dir) can be written and holds nothing BarqTrain did not write,\n"
            "and that its memory plan (the bill of `trainer estimate`) fits in what the process may\n"
            "use (MemAvailable, the cgroup's memory limit, RLIMIT_AS); --force (train) starts\n"
            "anyway when the plan does not fit.\n"
            "--set overrides a config key; the value is parsed as JSON when it parses, else taken\n"
            "as a string: --set optim.lr=1e-3 --set socket=/tmp/loaderd.sock\n"
            "         --set lora.target_modules='[\"q_proj\",\"v_proj\"]'\n"
            "A job file serves every command (each reads its part); a --set, --device or option\n"
            "that the command would ignore is refused by name.\n"
            "\n"
            "config keys (defaults): model (required), base_dtype \"auto\"|\"gguf\"|\"nf4\"|\"fp32\",\n"
            "  socket, base_model_name_or_path, name, data.{shards (required), format \"chat\",\n"
            "  text_field, seq_len 512, micro_batch_size 4, seed 1234, tokenizer_threads 2},\n"
            "  eval.{shards [], max_batches 0}, lora.{r 16, lora_alpha 32, lora_dropout 0.05,\n"
            "  target_modules [all 7]}, optim.{lr 2e-4, weight_decay 0, beta1 0.9, beta2 0.999,\n"
            "  eps 1e-8, warmup_steps 0, grad_clip 1.0}, steps 100, grad_accum 1,\n"
            "  schedule \"cosine\"|\"linear\"|\"constant\", min_lr_ratio 0.1,\n"
            "  activation_checkpointing \"auto\" (on from checkpointing_min_seq_len 4096), save_every 0,\n"
            "  out_dir \"runs/adapter\", context_extension.{target_length, method \"linear\"|\"yarn\"|\n"
            "  \"dynamic\"}, attention.s2.{group_fraction 0.25}, eval.lengths [],\n"
            "  cuda.{attention, nf4_matmul, offload_checkpoints false},\n"
            "  threads 0 (Slurm's CPUs for the task, else OpenMP default), seed 1234, log_every 1,\n"
            "  timeout_s 600, dist.{master_addr \"127.0.0.1\", master_port 29500, timeout_s 600,\n"
            "  heartbeat_timeout_s 60, secret_file null}. socket unset: $LOADERD_SOCKET, else\n"
            "  /run/loaderd/loaderd.sock.\n"
            "\n"
            "Several processes (one per GPU, device cuda) train data-parallel and all-reduce the\n"
            "LoRA gradients with NCCL: rank and world size come from RANK/WORLD_SIZE/LOCAL_RANK\n"
            "(torchrun) or SLURM_PROCID/SLURM_NTASKS/SLURM_LOCALID (srun; scripts/train.sbatch);\n"
            "rank 0's address from MASTER_ADDR/MASTER_PORT, else the first node of the Slurm step,\n"
            "else dist.master_addr/master_port; every rank needs the same job secret\n"
            "(BT_DIST_SECRET, or dist.secret_file). Rank 0 prints progress and saves.\n"
            "\n"
            "Signals: SIGINT, SIGTERM or SIGUSR1 (Slurm's early warning) stop the run mid-step;\n"
            "the adapter and checkpoint of the last completed step are saved.\n"
            "Exit status: 0 done, 1 failure, 2 usage or configuration error, 75 interrupted\n"
            "(continue with --resume CHECKPOINT_DIR).\n",
            bt_backend_find(BT_DEVICE_CUDA) ? "; this one is" : "; this one is not");
}

/* The options of `trainer train|eval|estimate` (argv is borrowed; sets/given are owned). */
typedef struct {
    int cmd; /* BT_CMD_TRAIN, BT_CMD_EVAL, BT_CMD_ESTIMATE */
    const char *name; /* the command as typed, for messages */
    const char *config, *resume, *checkpoint, *adapter;
    int profile, force;
    double fit_gib; /* estimate --max-seq-len-for GiB; 0: not asked */
    const char **sets;  /* "key=value" settings: --set, and --device X as device=X */
    const char **given; /* what each setting was given as on the command line, for refusals */
    int n_sets;
    char device_set[64];
} run_args;

/* Command-line parsing of train/eval/estimate into *a (a->sets/given allocated here: free them).
 * Returns 0, 2 for a usage error (message on stderr), or -1 when --help was printed. An option
 * that another command takes is refused naming the command that does, never ignored. */
static int parse_run_args(int argc, char **argv, run_args *a) {
    const int cmd = a->cmd;
    a->sets = calloc((size_t)argc, sizeof(char *));
    a->given = calloc((size_t)argc, sizeof(char *));
    if (!a->sets || !a->given) {
        fprintf(stderr, "trainer: out of memory\n");
        return 2;
    }
    for (int i = 2; i < argc; i++) {
        const char *arg = argv[i];
        const char *opt = NULL; /* an option this command does not take */
        if (!strcmp(arg, "--help") || !strcmp(arg, "-h")) {
            usage(stdout);
            return -1;
        } else if (!strcmp(arg, "--config") && i + 1 < argc) {
            a->config = argv[++i];
        } else if (!strncmp(arg, "--config=", 9)) {
            a->config = arg + 9;
        } else if (!strcmp(arg, "--set") && i + 1 < argc) {
            a->given[a->n_sets] = "--set";
            a->sets[a->n_sets++] = argv[++i];
        } else if (!strncmp(arg, "--set=", 6)) {
            a->given[a->n_sets] = "--set";
            a->sets[a->n_sets++] = arg + 6;
        } else if (!strcmp(arg, "--device") && i + 1 < argc) {
            snprintf(a->device_set, sizeof a->device_set, "device=%s", argv[++i]);
            a->given[a->n_sets] = "--device";
            a->sets[a->n_sets++] = a->device_set;
        } else if (!strcmp(arg, "--resume") && i + 1 < argc) {
            if (cmd == BT_CMD_TRAIN) a->resume = argv[++i];
            else opt = cmd == BT_CMD_EVAL ? "--resume continues training; evaluate a checkpoint "
                                            "with --checkpoint DIR" : "--resume";
        } else if (!strcmp(arg, "--checkpoint") && i + 1 < argc) {
            if (cmd == BT_CMD_EVAL) a->checkpoint = argv[++i];
            else opt = cmd == BT_CMD_TRAIN ? "--checkpoint is for eval; continue training from a "
                                             "checkpoint with --resume DIR" : "--checkpoint";
        } else if (!strcmp(arg, "--adapter") && i + 1 < argc) {
            if (cmd == BT_CMD_EVAL) a->adapter = argv[++i];
            else opt = "--adapter (evaluate an adapter with trainer eval --adapter DIR)";
        } else if (!strcmp(arg, "--profile")) {
            if (cmd == BT_CMD_TRAIN) a->profile = 1;
            else opt = "--profile (trainer train --profile)";
        } else if (!strcmp(arg, "--force")) {
            if (cmd == BT_CMD_TRAIN) a->force = 1;
            else opt = "--force (trainer train --force)";
        } else if (!strcmp(arg, "--max-seq-len-for") && i + 1 < argc) {
            char *end;
            if (cmd != BT_CMD_ESTIMATE) {
                opt = "--max-seq-len-for (trainer estimate --max-seq-len-for GiB)";
            } else if (a->fit_gib = strtod(argv[++i], &end),
                       *end || !(a->fit_gib > 0) || a->fit_gib > 1e6) {
                fprintf(stderr, "trainer: --max-seq-len-for: expected a memory size in GiB > 0, "
                        "got \"%s\"\n", argv[i]);
                return 2;
            }
        } else {
            fprintf(stderr, "trainer: unexpected argument \"%s\" (try --help)\n", arg);
            return 2;
        }
        if (opt) {
            fprintf(stderr, "trainer %s: %s is not an option of this command: refused rather than "
                    "ignored\n", a->name, opt);
            return 2;
        }
    }
    if (a->adapter && a->checkpoint) {
        fprintf(stderr, "trainer eval: give --adapter DIR or --checkpoint DIR, not both\n");
        return 2;
    }
    if (!a->config) {
        fprintf(stderr, "trainer: --config JOB.json|JOB.yaml is required (try --help)\n");
        return 2;
    }
    return 0;
}

/* The job config of a's --config with its settings, then the command line's own options.
 * Refuses (2, message on stderr; *cfg freed) a setting the command would not read
 * (bt_config_key_used) and two sources of the weights to evaluate. */
static int load_run_config(const run_args *a, bt_train_config *cfg) {
    if (bt_config_load(cfg, a->config, a->sets, a->n_sets)) {
        fprintf(stderr, "trainer: %s\n", bt_last_error());
        return 2;
    }
    if (a->resume || a->checkpoint) {
        free(cfg->resume_from);
        cfg->resume_from = bt_xstrdup(a->resume ? a->resume : a->checkpoint);
    }
    cfg->eval_adapter = a->adapter;
    cfg->profile = a->profile;
    cfg->force = a->force;
    int rc = 0;
    for (int i = 0; i < a->n_sets && !rc; i++) {
        const char *set = a->sets[i], *eq = strchr(set, '=');
        char path[256];
        snprintf(path, sizeof path, "%.*s", eq ? (int)(eq - set) : 0, set);
        if (!bt_config_key_used(a->cmd, path, cfg)) {
            fprintf(stderr, "trainer %s: %s %s: %s does not use %s%s; refused rather than "
                    "ignored\n", a->name, a->given[i], !strcmp(a->given[i], "--set") ? set : eq + 1,
                    a->name, path,
                    a->cmd == BT_CMD_EVAL && a->adapter ? " when evaluating --adapter (the "
                    "adapter's adapter_config.json decides)" : !strncmp(path, "cuda", 4) &&
                    cfg->device != BT_DEVICE_CUDA ? " on device \"cpu\"" : "");
            rc = 2;
        }
    }
    if (!rc && a->cmd == BT_CMD_EVAL && a->adapter && cfg->resume_from) {
        fprintf(stderr, "trainer eval: --adapter DIR and resume_from (%s) both name the weights to "
                "evaluate: drop one\n", cfg->resume_from);
        rc = 2;
    }
    const bt_backend_reg *reg;
    if (!rc && a->cmd != BT_CMD_ESTIMATE && bt_backend_get(cfg->device, &reg)) {
        fprintf(stderr, "trainer: %s\n", bt_last_error()); /* a device this build has not */
        rc = 2;
    }
    if (rc) bt_config_free(cfg);
    return rc;
}

/* Runs a loaded train/eval/estimate; returns the process exit status (train.h's table). */
static int run_command(const run_args *a, const bt_train_config *cfg) {
    int rc;
    if (a->cmd == BT_CMD_ESTIMATE) {
        rc = bt_estimate_print(cfg, a->fit_gib, stdout);
        if (rc) fprintf(stderr, "trainer: %s\n", bt_last_error());
        return rc ? BT_EXIT_FAILURE : BT_EXIT_OK;
    }
    char *dump = bt_config_dump(cfg);
    if (dump) bt_log(BT_LOG_INFO, "trainer", "config: %s", dump);
    free(dump);
    rc = bt_train_run(cfg, a->cmd == BT_CMD_EVAL, stdout);
    if (rc) fprintf(stderr, "trainer: %s\n", bt_last_error());
    return rc == BT_ERR_CANCELLED ? BT_EXIT_INTERRUPTED
           : rc == BT_ERR_DIVERGED ? BT_EXIT_DIVERGED
           : rc                    ? BT_EXIT_FAILURE
                                   : BT_EXIT_OK;
}

int main(int argc, char **argv) {
    /* OpenBLAS mis-detects recent x86 CPUs (~8x slower sgemm); fixes it by re-exec'ing with
     * OPENBLAS_CORETYPE set (kernels.h). Must run before any BLAS call. */
    bt_openblas_env_reexec(argv);
    if (argc < 2) {
        usage(stderr);
        return 2;
    }
    if (!strcmp(argv[1], "--help") || !strcmp(argv[1], "-h") || !strcmp(argv[1], "help")) {
        usage(stdout);
        return 0;
    }
    if (!strcmp(argv[1], "export")) return bt_export_main(argc - 1, argv + 1);
    if (!strcmp(argv[1], "generate")) return bt_generate_cli(argc - 1, argv + 1);
    if (!strcmp(argv[1], "config")) return bt_config_cmd(argc - 1, argv + 1, stdout);
    if (!strcmp(argv[1], "report")) return bt_report_cli(argc - 1, argv + 1);
    run_args a = {.name = argv[1]};
    if (!strcmp(argv[1], "train")) a.cmd = BT_CMD_TRAIN;
    else if (!strcmp(argv[1], "eval")) a.cmd = BT_CMD_EVAL;
    else if (!strcmp(argv[1], "estimate")) a.cmd = BT_CMD_ESTIMATE;
    else {
        fprintf(stderr, "trainer: unknown command \"%s\" (try --help)\n", argv[1]);
        return 2;
    }
    int rc = parse_run_args(argc, argv, &a);
    bt_train_config cfg;
    if (!rc) rc = load_run_config(&a, &cfg);
    free(a.sets);
    free(a.given);
    if (rc) return rc < 0 ? 0 : rc;
    rc = run_command(&a, &cfg);
    bt_config_free(&cfg);
    return rc;
}
