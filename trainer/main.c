/* trainer: the BarqTrain LoRA/QLoRA trainer (the CPU backend, and the CUDA one when linked with it:
 * trainer/backend/backend.h).
 *   trainer train --config job.json [--set key.path=value ...]
 *   trainer eval  --config job.json [--set key.path=value ...]
 *   trainer --help
 * Exit status (trainer/loop/train.h BT_EXIT_*): 0 success, 1 runtime failure, 2 usage or
 * configuration error, 3 training diverged (non-finite loss, gradients or parameters: nothing of
 * the diverged steps was saved; out_dir and checkpoint_dir keep the last good adapter and
 * checkpoint), 75 interrupted (a signal; the last completed step is saved). */
#include <getopt.h>
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
            "                        [--world-size W] [--gpus-for GiB]\n"
            "       trainer report RUN_DIR             (the plot of a run's metrics.jsonl)\n"
            "       trainer config --template default|qlora|long-context [--documented]\n"
            "                      [--format json|yaml]\n"
            "       trainer config --check JOB [--set key.path=value ...] [--format json|yaml]\n"
            "                      [--print KEY]\n"
            "       trainer config --reference         (every config key, as docs/CONFIG.md)\n"
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
            "          --max-seq-len-for GiB: the longest data.seq_len that fits in that memory;\n"
            "          --world-size W: the CUDA bill per rank of W (with dist.shard_base: 1/W of\n"
            "          the base each); --gpus-for GiB: the fewest GPUs of that memory whose ranks\n"
            "          fit the job with dist.shard_base.\n"
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
            "config keys: every key with its range, default and meaning is in docs/CONFIG.md\n"
            "  (trainer config --reference prints it); model and data.shards are required.\n"
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
    double gpus_gib; /* estimate --gpus-for GiB; 0: not asked */
    int world_size;  /* estimate --world-size W; 0: not given */
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
    enum { O_CONFIG = 256, O_SET, O_DEVICE, O_RESUME, O_CHECKPOINT, O_ADAPTER, O_PROFILE, O_FORCE, O_FIT,
           O_GPUS, O_WORLD };
    static const struct option opts[] = {
        {"help", no_argument, NULL, 'h'},           {"config", required_argument, NULL, O_CONFIG},
        {"set", required_argument, NULL, O_SET},    {"device", required_argument, NULL, O_DEVICE},
        {"resume", required_argument, NULL, O_RESUME}, {"checkpoint", required_argument, NULL, O_CHECKPOINT},
        {"adapter", required_argument, NULL, O_ADAPTER}, {"profile", no_argument, NULL, O_PROFILE},
        {"force", no_argument, NULL, O_FORCE},      {"max-seq-len-for", required_argument, NULL, O_FIT},
        {"gpus-for", required_argument, NULL, O_GPUS}, {"world-size", required_argument, NULL, O_WORLD},
        {NULL, 0, NULL, 0},
    };
    /* argv[1] is the command: getopt_long reads argv[2..] as the options of argv + 1 */
    optind = 0;
    opterr = 0;
    int o;
    while ((o = getopt_long(argc - 1, argv + 1, "+:h", opts, NULL)) != -1) {
        const char *opt = NULL; /* an option this command does not take */
        switch (o) {
        case 'h': usage(stdout); return -1;
        case O_CONFIG: a->config = optarg; break;
        case O_SET:
            a->given[a->n_sets] = "--set";
            a->sets[a->n_sets++] = optarg;
            break;
        case O_DEVICE:
            snprintf(a->device_set, sizeof a->device_set, "device=%s", optarg);
            a->given[a->n_sets] = "--device";
            a->sets[a->n_sets++] = a->device_set;
            break;
        case O_RESUME:
            if (cmd == BT_CMD_TRAIN) a->resume = optarg;
            else opt = cmd == BT_CMD_EVAL ? "--resume continues training; evaluate a checkpoint "
                                            "with --checkpoint DIR" : "--resume";
            break;
        case O_CHECKPOINT:
            if (cmd == BT_CMD_EVAL) a->checkpoint = optarg;
            else opt = cmd == BT_CMD_TRAIN ? "--checkpoint is for eval; continue training from a "
                                             "checkpoint with --resume DIR" : "--checkpoint";
            break;
        case O_ADAPTER:
            if (cmd == BT_CMD_EVAL) a->adapter = optarg;
            else opt = "--adapter (evaluate an adapter with trainer eval --adapter DIR)";
            break;
        case O_PROFILE:
            if (cmd == BT_CMD_TRAIN) a->profile = 1;
            else opt = "--profile (trainer train --profile)";
            break;
        case O_FORCE:
            if (cmd == BT_CMD_TRAIN) a->force = 1;
            else opt = "--force (trainer train --force)";
            break;
        case O_FIT: {
            char *end;
            if (cmd != BT_CMD_ESTIMATE) {
                opt = "--max-seq-len-for (trainer estimate --max-seq-len-for GiB)";
            } else if (a->fit_gib = strtod(optarg, &end), *end || !(a->fit_gib > 0) || a->fit_gib > 1e6) {
                fprintf(stderr, "trainer: --max-seq-len-for: expected a memory size in GiB > 0, "
                        "got \"%s\"\n", optarg);
                return 2;
            }
            break;
        }
        case O_GPUS: {
            char *end;
            if (cmd != BT_CMD_ESTIMATE) {
                opt = "--gpus-for (trainer estimate --gpus-for GiB)";
            } else if (a->gpus_gib = strtod(optarg, &end), *end || !(a->gpus_gib > 0) || a->gpus_gib > 1e6) {
                fprintf(stderr, "trainer: --gpus-for: expected a GPU memory size in GiB > 0, got \"%s\"\n",
                        optarg);
                return 2;
            }
            break;
        }
        case O_WORLD: {
            char *end;
            long w = strtol(optarg, &end, 10);
            if (cmd != BT_CMD_ESTIMATE) {
                opt = "--world-size (trainer estimate --world-size W; a job takes its ranks from Slurm or "
                      "WORLD_SIZE)";
            } else if (*end || end == optarg || w < 1 || w > 65536) {
                fprintf(stderr, "trainer: --world-size: expected a number of ranks in [1, 65536], got "
                        "\"%s\"\n", optarg);
                return 2;
            } else {
                a->world_size = (int)w;
            }
            break;
        }
        default: /* an unknown option, or one without its value */
            fprintf(stderr, "trainer: unexpected argument \"%s\" (try --help)\n", argv[optind]);
            return 2;
        }
        if (opt) {
            fprintf(stderr, "trainer %s: %s is not an option of this command: refused rather than "
                    "ignored\n", a->name, opt);
            return 2;
        }
    }
    if (optind + 1 < argc) {
        fprintf(stderr, "trainer: unexpected argument \"%s\" (try --help)\n", argv[optind + 1]);
        return 2;
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
    if (!rc && a->cmd != BT_CMD_ESTIMATE && cfg->dist.shard_base && cfg->device != BT_DEVICE_CUDA) {
        fprintf(stderr, "trainer %s: dist.shard_base shards the frozen base across the GPUs of a "
                "data-parallel job (device \"cuda\"); the CPU backend runs one process holding the whole "
                "base: set device \"cuda\" or drop dist.shard_base\n", a->name);
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
        bt_train_config c = *cfg;
        c.world_size = a->world_size;
        rc = bt_estimate_print(&c, a->fit_gib, stdout);
        if (!rc && a->gpus_gib > 0) rc = bt_estimate_print_gpus_for(&c, a->gpus_gib, stdout);
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
