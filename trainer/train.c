/* The CPU training loop. See train.h. */
#include "trainer/train.h"

#include <errno.h>
#include <math.h>
#include <omp.h>
#include <openssl/evp.h>
#include <signal.h>
#include <stdatomic.h>
#include <stdlib.h>
#include <string.h>
#include <sys/random.h>
#include <sys/resource.h>

#include "common/atomic_io.h"
#include "common/bt_common.h"
#include "kernels/kernels.h"
#include "proto/client.h"
#include "trainer/adapter.h"
#include "trainer/adapter_load.h"
#include "trainer/checkpoint.h"
#include "trainer/dist.h"
#include "trainer/dist_monitor.h"
#include "trainer/optim.h"
#include "trainer/profile.h"
#include "trainer/report.h"
#include "trainer/rng.h"
#ifdef BT_WITH_CUDA
#include "trainer/cuda/cuda_trainer.h"
/* device "cuda" (make CUDA=1): the GPU trainer replaces the CPU step context; NULL on the CPU */
static bt_cuda_trainer *g_cuda;
#endif

/* device "cuda": bring the host LoRA state up to date before it is saved (no-op on the CPU). */
static int sync_host_lora(bt_lora *lo, int moments) {
#ifdef BT_WITH_CUDA
    if (g_cuda)
        return bt_cuda_trainer_download_lora(g_cuda, lo,
                                             BT_CUDA_DL_PARAMS | (moments ? BT_CUDA_DL_MOMENTS : 0));
#endif
    (void)lo;
    (void)moments;
    return 0;
}

/* this process's place in a data-parallel run (trainer/dist.h; rank 0 of 1 by default) */
static bt_dist_env g_dist = {0, 1, 0, "single"};
/* the run's name for loaderd (the attach's "run"): the same on every rank (run_id_init) */
static char g_run[17];

/* vals[0..n) <- their sum over all ranks (a no-op for one process). Every rank must call it at
 * the same point (an NCCL collective on device "cuda"). */
static int dist_sum(double *vals, int n) {
#ifdef BT_WITH_CUDA
    if (g_dist.world > 1 && g_cuda) return bt_cuda_trainer_allreduce_sum(g_cuda, vals, n);
#endif
    (void)vals;
    (void)n;
    return 0;
}

/* all[r * BT_RESUME_STATE_BYTES ...] <- rank r's loader state (collective, like dist_sum). */
static int dist_gather_resume(const uint8_t *mine, uint8_t *all) {
#ifdef BT_WITH_CUDA
    if (g_dist.world > 1 && g_cuda)
        return bt_cuda_trainer_allgather(g_cuda, mine, all, BT_RESUME_STATE_BYTES);
#endif
    memcpy(all, mine, BT_RESUME_STATE_BYTES);
    return 0;
}

/* After a step that only rank 0 performed (a save): every rank learns whether it failed, so all
 * of them stop together instead of the others waiting forever in the next collective. */
static int dist_agree(int rc, const char *what) {
    if (g_dist.world == 1) return rc;
    double f = rc != 0;
    int rc2 = dist_sum(&f, 1);
    if (rc) return rc;
    if (rc2) return rc2;
    return f > 0 ? bt_fail(BT_ERR_IO, "%s failed on another rank (see its log)", what) : 0;
}

/* A checkpoint of every rank's loader state `all` (gathered with the step), written by rank 0;
 * every rank learns whether it worked (collective). */
static int save_checkpoint(const bt_train_config *cfg, const bt_model *m, bt_lora *lo, int step,
                           const uint8_t *all) {
    int rc = 0;
    if (g_dist.rank == 0) {
        rc = sync_host_lora(lo, 1);
        if (!rc) rc = bt_checkpoint_save_ex(cfg->checkpoint_dir, cfg, m, lo, step, all,
                                            g_dist.world);
    }
    return dist_agree(rc, "saving the checkpoint");
}

/* A run whose loss, gradient norm or parameters became non-finite at `step` (issue 10 §4):
 * nothing more is written (the writers refuse non-finite tensors anyway), so out_dir and
 * checkpoint_dir keep the last good saves. Returns BT_ERR_DIVERGED with the message (exit
 * status 3, trainer/main.c). */
static int diverged(const bt_train_config *cfg, int step, const char *what, double lr,
                    int adapter_step, int ck_step) {
    char saved[1024];
    int n = 0;
    if (adapter_step > 0)
        n = snprintf(saved, sizeof saved, "the adapter in %s is the one saved at step %d", cfg->out_dir,
                     adapter_step);
    else
        n = snprintf(saved, sizeof saved, "no adapter was saved by this run (%s is untouched)",
                     cfg->out_dir);
    if (cfg->checkpoint_every > 0 && n > 0 && (size_t)n < sizeof saved) {
        if (ck_step > 0)
            snprintf(saved + n, sizeof saved - (size_t)n, ", the checkpoint in %s is the one of step %d",
                     cfg->checkpoint_dir, ck_step);
        else
            snprintf(saved + n, sizeof saved - (size_t)n, ", no checkpoint was written by this run (%s is "
                     "untouched)", cfg->checkpoint_dir);
    }
    return bt_fail(BT_ERR_DIVERGED,
                   "training diverged at step %d: non-finite %s (learning rate %.3g): stopped without saving "
                   "anything of this step or later; %s. Lower optim.lr (now %g), raise optim.warmup_steps or "
                   "set optim.grad_clip, then resume from the last checkpoint or start again",
                   step, what, lr, saved, cfg->optim.lr);
}

/* Fault injection for the tests of the divergence stop (tests/py/test_trainer_hardening.py):
 * $BT_TEST_NONFINITE_GRAD_AT_STEP = k makes a gradient of (CPU) step k NaN, as an overflow
 * would. A valid configuration cannot diverge within a test's few steps on a tiny fp32 model
 * (the hyper-parameter ranges and RMSNorm see to that), so the path is driven this way. 0 when
 * unset. */
static int test_poison_step(void) {
    const char *e = getenv("BT_TEST_NONFINITE_GRAD_AT_STEP");
    return e && *e ? atoi(e) : 0;
}

static int on_device(const bt_train_config *cfg) { return cfg->device == BT_DEVICE_CUDA; }

/* The signal that asked this process to stop (SIGINT, SIGTERM, SIGUSR1: Slurm's early warning
 * before a time limit, scripts/train.sbatch); 0 = none. */
static atomic_int g_stop;
static void on_signal(int sig) { atomic_store(&g_stop, sig); }
static const int k_stop_signals[] = {SIGINT, SIGTERM, SIGUSR1};
#define N_STOP_SIGNALS 3

/* several ranks: the watchdog that names a rank that dies or stalls and relays stop requests */
static bt_dist_monitor *g_mon;

static const char *stop_signal_name(int sig) {
    return sig == SIGINT ? "SIGINT" : sig == SIGTERM ? "SIGTERM" : sig == SIGUSR1 ? "SIGUSR1" : "a signal";
}

/* 0 to go on; else why to stop now, with bt_last_error set: BT_ERR_CANCELLED for a stop request
 * (a signal to this process, or one relayed from another rank), another code when another rank
 * failed (trainer/dist_monitor.h names it). Asked while waiting for batches, before every layer
 * (bt_step_ctx_set_check, bt_cuda_hooks) and in every NCCL wait: a stop lands mid-step. */
static int stop_check(void *arg) {
    (void)arg;
    int rc = bt_dist_monitor_check(g_mon);
    if (rc) return rc;
    int sig = atomic_load(&g_stop);
    return sig ? bt_fail(BT_ERR_CANCELLED, "interrupted by %s", stop_signal_name(sig)) : 0;
}

#ifdef BT_WITH_CUDA
static void on_collective(void *arg, int entering) {
    (void)arg;
    bt_dist_monitor_collective(g_mon, entering);
}
#endif

void bt_fmt_duration(char *buf, size_t n, double s) {
    if (!(s >= 0) || s > 1e9) s = 0;
    long t = (long)(s + 0.5);
    if (t >= 3600) snprintf(buf, n, "%ldh%02ldm%02lds", t / 3600, t / 60 % 60, t % 60);
    else snprintf(buf, n, "%ldm%02lds", t / 60, t % 60);
}

double bt_peak_rss_mib(void) {
    struct rusage ru;
    if (getrusage(RUSAGE_SELF, &ru) != 0) return 0;
    return (double)ru.ru_maxrss / 1024.0; /* ru_maxrss is in KiB on Linux */
}

/* A trainer-owned copy of one micro-batch (the ring slot is released right away). */
typedef struct {
    int32_t *ids, *labels, *pos, *cu;
    int n_cu;
    uint32_t n_real;
    uint8_t resume[BT_RESUME_STATE_BYTES]; /* loader state after this batch */
} mb_copy;

static void mb_view(const mb_copy *c, int B, int T, bt_microbatch *mb) {
    mb->B = B;
    mb->T = T;
    mb->input_ids = c->ids;
    mb->labels = c->labels;
    mb->position_ids = c->pos;
    mb->cu_seqlens = c->cu;
    mb->n_cu = c->n_cu;
}

static int mb_take(mb_copy *c, const bt_batch_view *v, int B, int T) {
    size_t M = (size_t)B * T;
    if (v->hdr->B != (uint32_t)B || v->hdr->T != (uint32_t)T || v->hdr->n_cu < 2 ||
        v->hdr->n_cu > M + 1)
        return bt_fail(BT_ERR_FORMAT, "batch %llu: shape %ux%u (n_cu %u), expected %dx%d",
                       (unsigned long long)v->hdr->step, v->hdr->B, v->hdr->T, v->hdr->n_cu, B, T);
    memcpy(c->ids, v->input_ids, M * 4);
    memcpy(c->labels, v->labels, M * 4);
    memcpy(c->pos, v->position_ids, M * 4);
    memcpy(c->cu, v->cu_seqlens, (size_t)v->hdr->n_cu * 4);
    c->n_cu = (int)v->hdr->n_cu;
    c->n_real = v->hdr->n_real_tokens;
    memcpy(c->resume, v->hdr->resume_state, BT_RESUME_STATE_BYTES);
    return 0;
}

static int mb_alloc(mb_copy *c, int B, int T) {
    size_t M = (size_t)B * T;
    c->ids = malloc(M * 4);
    c->labels = malloc(M * 4);
    c->pos = malloc(M * 4);
    c->cu = malloc((M + 1) * 4);
    if (!c->ids || !c->labels || !c->pos || !c->cu)
        return bt_fail(BT_ERR_NOMEM, "out of memory for batch copies");
    return 0;
}

static void mb_free(mb_copy *c) {
    free(c->ids);
    free(c->labels);
    free(c->pos);
    free(c->cu);
    memset(c, 0, sizeof *c);
}

/* resume: NULL = from the start, else the BT_RESUME_STATE_BYTES state to continue after. */
static int attach(bt_client **cl, const bt_train_config *cfg, int eval, const uint8_t *resume) {
    char *job = bt_config_job_json(cfg, eval);
    if (!job) return bt_fail(BT_ERR_NOMEM, "out of memory");
    int rc = bt_client_attach_run(cl, cfg->socket, job, g_dist.rank, g_dist.world, resume, g_run);
    free(job);
    if (rc) return bt_fail(rc, "attach to loaderd at %s (%s stream): %s", cfg->socket,
                           eval ? "eval" : "train", bt_last_error());
    if (bt_client_B(*cl) != (uint32_t)cfg->data.micro_batch_size ||
        bt_client_T(*cl) != (uint32_t)cfg->data.seq_len) {
        rc = bt_fail(BT_ERR_FORMAT, "loaderd serves %ux%u batches, config asks %dx%d",
                     bt_client_B(*cl), bt_client_T(*cl), cfg->data.micro_batch_size,
                     cfg->data.seq_len);
        bt_client_close(*cl);
        *cl = NULL;
    }
    return rc;
}

/* 0: a batch in *dst; 1: end of data; 2: a stop request while waiting (nothing taken); <0: error
 * (another rank's failure included). The wait (up to timeout_s) is cut into 1 s slices so that
 * a signal stops it promptly: the client retries EINTR, so the handler alone would only take
 * effect once a batch arrived. */
static int next_batch(bt_client *cl, const bt_train_config *cfg, mb_copy *dst, const char *what) {
    bt_batch_view v;
    double deadline = bt_now() + cfg->timeout_s;
    int rc;
    for (;;) {
        double left = deadline - bt_now();
        rc = bt_client_next(cl, &v, left >= 1.0 ? 1000 : left > 0 ? (int)(left * 1000.0) : 0);
        if (rc != BT_ERR_TIMEOUT || bt_now() >= deadline) break;
        int st = stop_check(NULL);
        if (st) return st == BT_ERR_CANCELLED ? 2 : st;
    }
    if (rc == 1) return 1;
    if (rc == BT_ERR_TIMEOUT)
        return bt_fail(rc, "no %s batch from loaderd within %d s (timeout_s)", what,
                       cfg->timeout_s);
    if (rc) return bt_fail(rc, "%s batch: %s", what, bt_last_error());
    rc = mb_take(dst, &v, cfg->data.micro_batch_size, cfg->data.seq_len);
    bt_client_release(cl);
    return rc;
}

/* Labels of segments shorter than `full` tokens become -100 (in place), so that only whole
 * `full`-token windows count; returns the number of whole windows: segments of exactly `full`
 * tokens that carry labels (a padding row is a `full`-token segment without any). full = 0:
 * nothing changes, returns 0. */
static int keep_full_windows(mb_copy *c, int M, int full) {
    if (full <= 0) return 0;
    int n = 0;
    for (int i = 0; i + 1 < c->n_cu; i++) {
        const int a = c->cu[i], b = c->cu[i + 1];
        if (b - a == full) {
            int labelled = 0;
            for (int t = a; t < b && t < M && !labelled; t++) labelled = c->labels[t] != -100;
            n += labelled;
            continue;
        }
        for (int t = a; t < b && t < M; t++) c->labels[t] = -100;
    }
    return n;
}

/* Drop the trailing rows of mb that carry no label (each row starts a segment, so the rows
 * before them are unaffected); returns the rows left (0: nothing to compute). */
static int trim_unlabelled_rows(bt_microbatch *mb) {
    int rows = mb->B;
    while (rows > 0) {
        int labelled = 0;
        for (int t = (rows - 1) * mb->T; t < rows * mb->T && !labelled; t++)
            labelled = mb->labels[t] != -100;
        if (labelled) break;
        rows--;
    }
    if (rows > 0 && rows < mb->B) {
        int n = 0;
        while (n < mb->n_cu && mb->cu_seqlens[n] < rows * mb->T) n++;
        /* cu_seqlens[n] == rows * T: a row start is always a boundary */
        mb->n_cu = n + 1;
        mb->B = rows;
    }
    return rows;
}

/* One pass over cfg's held-out stream (cfg->data.seq_len x micro_batch_size rows). full > 0:
 * only segments of exactly `full` tokens carry loss (per-length evaluation). Sums (over all
 * ranks) into *sum / *cnt / *windows; *cut = interrupted by a signal. */
static int eval_stream(const bt_train_config *cfg, const bt_model *m, bt_lora *lo, bt_step_ctx *ctx,
                       int full, double *sum_out, long long *cnt_out, long long *windows_out,
                       int *cut_out, int *nb_out) {
    int cut = 0;
    bt_client *cl = NULL;
    mb_copy mc = {0};
    double sum = 0;
    long long cnt = 0, windows = 0;
    int nb = 0;
    const int B = cfg->data.micro_batch_size, T = cfg->data.seq_len;
    int rc = attach(&cl, cfg, 1, NULL); /* the eval stream restarts every time */
    if (!rc) rc = mb_alloc(&mc, B, T);
    while (!rc && (cfg->eval.max_batches == 0 || nb < cfg->eval.max_batches)) {
        rc = next_batch(cl, cfg, &mc, "eval");
        if (rc == 1 || rc == 2) {
            cut = rc == 2;
            rc = 0;
            break;
        }
        if (rc) break;
        windows += keep_full_windows(&mc, B * T, full);
        bt_microbatch mb;
        mb_view(&mc, B, T, &mb);
        /* rows after the last labelled one (the last batch's padding rows, or rows whose only
         * segments are shorter than a window) change no loss: not computed */
        if (trim_unlabelled_rows(&mb) == 0) {
            nb++;
            continue;
        }
        double ls;
        int nv;
#ifdef BT_WITH_CUDA
        if (g_cuda) rc = bt_cuda_trainer_step(g_cuda, &mb, 0, 1.0f, 0, &ls, &nv);
        else
#endif
            rc = bt_forward_backward(ctx, m, lo, &mb, 0, 1.0f, 0, &ls, &nv);
        if (rc == BT_ERR_CANCELLED) { /* mid-batch: that batch does not count */
            cut = 1;
            rc = 0;
            break;
        }
        if (rc) break;
        sum += ls;
        cnt += nv;
        nb++;
        bt_log(BT_LOG_DEBUG, "trainer", "held-out batch %d: %d labelled tokens", nb, nv);
        if (atomic_load(&g_stop) && (cfg->eval.max_batches == 0 || nb < cfg->eval.max_batches)) {
            cut = 1;
            break;
        }
    }
    if (cut && g_dist.world > 1) { /* every rank stops (relayed): no collective any more */
        rc = stop_check(NULL);
        if (!rc) rc = bt_fail(BT_ERR_CANCELLED, "interrupted");
        goto out;
    }
    /* every rank evaluated its own share of the held-out stream: add them up (a collective; a
     * rank whose evaluation failed still takes part, so that none of the others waits forever) */
    if (g_dist.world > 1) {
        double v[6] = {sum, (double)cnt, cut, nb, rc != 0, (double)windows};
        int rc2 = dist_sum(v, 6);
        if (!rc && rc2) rc = rc2;
        if (!rc && v[4] > 0)
            rc = bt_fail(BT_ERR_IO, "held-out evaluation failed on another rank (see its log)");
        sum = v[0];
        cnt = (long long)v[1];
        cut = v[2] > 0;
        nb = (int)v[3];
        windows = (long long)v[5];
    }
out:
    mb_free(&mc);
    bt_client_close(cl);
    *sum_out = sum;
    *cnt_out = cnt;
    *windows_out = windows;
    *cut_out = cut;
    *nb_out = nb;
    return rc;
}

int bt_eval_heldout(const bt_train_config *cfg, const bt_model *m, bt_lora *lo, bt_step_ctx *ctx,
                    double *mean_loss, long long *n_tokens, int *interrupted) {
    *mean_loss = NAN;
    *n_tokens = 0;
    double sum, t0 = bt_now();
    long long cnt, windows;
    int cut, nb;
    int rc = eval_stream(cfg, m, lo, ctx, 0, &sum, &cnt, &windows, &cut, &nb);
    if (rc) return rc;
    if (interrupted) *interrupted = cut;
    if (cnt == 0 && cut) {
        bt_log(BT_LOG_WARN, "trainer", "held-out evaluation interrupted before any batch");
        return 0;
    }
    if (cnt == 0)
        return bt_fail(BT_ERR_INVALID, "the held-out stream (eval.shards) gave no labelled "
                       "tokens in %d batches", nb);
    *mean_loss = sum / (double)cnt;
    *n_tokens = cnt;
    if (g_dist.rank == 0)
        bt_log(BT_LOG_INFO, "trainer", "held-out%s: %d batches, %lld labelled tokens, loss %.4f "
               "(%.1f s)", cut ? " (partial, interrupted)" : "", nb, cnt, *mean_loss, bt_now() - t0);
    return 0;
}

int bt_eval_lengths(const bt_train_config *cfg, const bt_model *m, bt_lora *lo, bt_step_ctx *ctx,
                    int max_M, bt_eval_length *res, int *interrupted) {
    int rc = 0, cut = 0;
    if (interrupted) *interrupted = 0;
    for (int i = 0; i < cfg->eval.n_lengths && !rc && !cut; i++) {
        const int L = cfg->eval.lengths[i];
        bt_eval_length *r = &res[i];
        memset(r, 0, sizeof *r);
        r->length = L;
        r->loss = NAN;
        /* the same stream at row length L (loaderd splits text documents into consecutive
         * L-token pieces): as many rows as the training workspace holds, else one row in a
         * forward-only workspace of its own (CPU) */
        bt_train_config c = *cfg;
        char name[600];
        snprintf(name, sizeof name, "%s-L%d", cfg->name, L);
        c.name = name;
        c.data.seq_len = L;
        c.data.micro_batch_size = L <= max_M ? max_M / L : 1;
        if (c.data.micro_batch_size > 64) c.data.micro_batch_size = 64;
        bt_step_ctx *ectx = ctx;
        if (L > max_M) {
#ifdef BT_WITH_CUDA
            if (g_cuda)
                return bt_fail(BT_ERR_INVALID, "config: eval.lengths: %d tokens exceed the GPU "
                               "workspace of data.seq_len x data.micro_batch_size = %d; raise "
                               "data.seq_len or drop that length", L, max_M);
#endif
            if ((rc = bt_step_ctx_new(&ectx, m, lo, L, 1))) break;
        }
        double sum, t0 = bt_now();
        long long cnt, windows;
        int nb;
        rc = eval_stream(&c, m, lo, ectx, L, &sum, &cnt, &windows, &cut, &nb);
        if (ectx != ctx) bt_step_ctx_free(ectx);
        if (rc) break;
        r->windows = windows;
        r->tokens = cnt;
        if (cnt > 0) r->loss = sum / (double)cnt;
        if (g_dist.rank == 0)
            bt_log(BT_LOG_INFO, "trainer", "held-out at %d tokens%s: %lld windows, %lld labelled "
                   "tokens, loss %.4f, perplexity %.3f (%.1f s)", L,
                   cut ? " (partial, interrupted)" : "", windows, cnt, r->loss, exp(r->loss),
                   bt_now() - t0);
        if (cnt == 0 && !cut)
            bt_log(BT_LOG_WARN, "trainer", "held-out at %d tokens: no document has %d tokens "
                   "(%d batches read): no perplexity at this length", L, L, nb);
    }
    if (interrupted) *interrupted = cut;
    return rc;
}

/* "at 2048: 12.345 (loss 2.5132, 96 windows)" lines of a per-length evaluation */
static void print_lengths(FILE *out, const bt_eval_length *a, const bt_eval_length *b, int n) {
    for (int i = 0; i < n; i++) {
        if (!b)
            fprintf(out, "held-out perplexity at %d tokens: %.3f (loss %.4f, %lld windows, %lld "
                    "tokens)\n", a[i].length, exp(a[i].loss), a[i].loss, a[i].windows, a[i].tokens);
        else
            fprintf(out, "held-out perplexity at %d tokens: before %.3f -> after %.3f (loss %.4f "
                    "-> %.4f, %lld windows)\n", a[i].length, exp(a[i].loss), exp(b[i].loss),
                    a[i].loss, b[i].loss, b[i].windows);
    }
    fflush(out);
}

/* kernels/cpu keeps OpenBLAS at one thread and parallelises everything (GEMMs included) with
 * OpenMP (kernels/cpu/blas_par.c), so the OpenMP team size is the one knob. threads 0: the CPUs
 * Slurm gives the task (a node's other tasks must not be oversubscribed), else OpenMP's default. */
static void set_threads(int n) {
    char how[128];
    if (n <= 0 && (n = bt_dist_slurm_cpus(how, sizeof how)) > 0)
        bt_log(BT_LOG_INFO, "trainer", "threads: %d (%s)", n, how);
    if (n > 0) omp_set_num_threads(n);
}

/* --profile: the table on `out`, profile.json in the report directory. */
static int print_profile(const bt_train_config *cfg, const bt_prof *p, int step, double step_s,
                         const bt_step_ctx *ctx, FILE *out) {
    char title[160];
    double ws = ctx ? bt_step_ctx_bytes(ctx) / 1048576.0 : 0, dev = -1;
#ifdef BT_WITH_CUDA
    if (g_cuda) {
        ws = bt_cuda_trainer_bytes(g_cuda) / 1048576.0;
        dev = bt_cuda_trainer_peak_used(g_cuda, NULL) / 1048576.0;
    }
#endif
    snprintf(title, sizeof title, "step %d, %d x %d tokens x grad_accum %d, %s%s", step,
             cfg->data.micro_batch_size, cfg->data.seq_len, cfg->grad_accum,
             cfg->device == BT_DEVICE_CUDA ? "cuda (CUDA events)" : "cpu",
             cfg->activation_checkpointing ? ", activation checkpointing" : "");
    if (bt_prof_print(p, out, title, step_s, ws, bt_peak_rss_mib(), dev) < 0 || fflush(out))
        return bt_fail(BT_ERR_IO, "profile: write: %s", strerror(errno));
    char *path = NULL;
    if (asprintf(&path, "%s/profile.json", cfg->report.dir) < 0)
        return bt_fail(BT_ERR_NOMEM, "out of memory");
    int rc = bt_prof_write_json(p, path, title, step_s);
    free(path);
    return rc;
}

/* An interrupted run keeps its last completed step: rank 0 saves the adapter and a checkpoint
 * (every rank's loader state after that step: all_done, gathered with it, so no collective is
 * needed now that the others may be gone) and writes where into saved. */
static int save_interrupted(const bt_train_config *cfg, const bt_model *m, bt_lora *lo, int step,
                            const uint8_t *all_done, char *saved, size_t n) {
    int rc = sync_host_lora(lo, 1);
    if (!rc) rc = bt_adapter_save(lo, cfg->base_model_name_or_path, cfg->out_dir);
    if (rc) return rc;
    int ck = step < cfg->steps && strcmp(cfg->checkpoint_dir, cfg->out_dir) != 0;
    if (ck && (rc = bt_checkpoint_save_ex(cfg->checkpoint_dir, cfg, m, lo, step, all_done,
                                          g_dist.world)))
        return rc;
    if (ck)
        snprintf(saved, n, "adapter saved to %s, checkpoint to %s (continue with --resume %s)",
                 cfg->out_dir, cfg->checkpoint_dir, cfg->checkpoint_dir);
    else
        snprintf(saved, n, "adapter saved to %s", cfg->out_dir);
    return 0;
}

/* g_run, 16 hex digits: the first 8 bytes of SHA-256 of the NCCL id rank 0 handed every rank
 * (world > 1: the same on all ranks, and no way back to the id), else 8 random bytes. */
static int run_id_init(const uint8_t nccl_id[128]) {
    uint8_t h[32];
    unsigned n = 0;
    if (g_dist.world > 1 ? EVP_Digest(nccl_id, 128, h, &n, EVP_sha256(), NULL) != 1
                         : getrandom(h, 8, 0) != 8)
        return bt_fail(BT_ERR_IO, "cannot make the run's id");
    for (int i = 0; i < 8; i++) snprintf(g_run + 2 * i, 3, "%02x", h[i]);
    return 0;
}

/* Data-parallel start-up (trainer/dist.h): the job key, the rendezvous that checks every rank
 * runs this job and hands out rank 0's NCCL id, then the watchdog on its connections. */
static int dist_start(const bt_train_config *cfg, uint8_t nccl_id[128]) {
#ifdef BT_WITH_CUDA
    char addr[256], src[300];
    int port = 0, rc;
    uint8_t key[BT_DIST_KEY_BYTES];
    if ((rc = bt_dist_master_resolve(&g_dist, cfg->dist.master_addr, cfg->dist.master_port, addr,
                                     sizeof addr, &port)) ||
        (rc = bt_dist_key_load(cfg->dist.secret_file, key, src, sizeof src)))
        return rc;
    char *dump = bt_config_dump(cfg);
    if (!dump) return bt_fail(BT_ERR_NOMEM, "out of memory");
    uint8_t digest[32];
    bt_dist_digest(dump, strlen(dump), digest);
    free(dump);
    if (g_dist.rank == 0 && (rc = bt_cuda_dist_unique_id(nccl_id))) return rc;
    bt_log(BT_LOG_INFO, "trainer", "rank %d of %d (local rank %d, from %s): rendezvous at %s:%d, "
           "job secret from %s", g_dist.rank, g_dist.world, g_dist.local_rank, g_dist.source, addr,
           port, src);
    bt_dist_link *link = NULL;
    rc = bt_dist_rendezvous(addr, port, g_dist.rank, g_dist.world, digest, key, nccl_id, 128,
                            cfg->dist.timeout_s, &link);
    memset(key, 0, sizeof key);
    if (rc) return rc;
    bt_dist_monitor_opts mo = {cfg->dist.heartbeat_timeout_s, cfg->dist.timeout_s, &g_stop};
    return bt_dist_monitor_start(&g_mon, link, &mo);
#else
    (void)cfg;
    (void)nccl_id;
    return bt_fail(BT_ERR_UNSUPPORTED, "data-parallel training needs a trainer built with CUDA");
#endif
}

int bt_train_run(const bt_train_config *cfg, int eval_only, FILE *out) {
#ifndef BT_WITH_CUDA
    if (cfg->device == BT_DEVICE_CUDA)
        return bt_fail(BT_ERR_UNSUPPORTED, "config: device: \"cuda\": this trainer was built "
                       "without CUDA (make CUDA=1)");
#endif
    set_threads(cfg->threads);
    atomic_store(&g_stop, 0);
    struct sigaction sa, old_sa[N_STOP_SIGNALS];
    memset(&sa, 0, sizeof sa);
    sa.sa_handler = on_signal;
    for (int i = 0; i < N_STOP_SIGNALS; i++) sigaction(k_stop_signals[i], &sa, &old_sa[i]);

    bt_model model;
    bt_lora lora;
    memset(&lora, 0, sizeof lora);
    bt_report *rep = NULL; /* the run report (trainer/report.h; rank 0 of `trainer train`) */
    int rep_steps = 0;     /* steps it recorded */
    bt_prof *prof = NULL;  /* --profile: the profiled step's per-op times */
    bt_step_ctx *ctx = NULL;
    bt_client *cl = NULL;
    mb_copy *mbs = NULL;
    uint8_t *all_done = NULL, *all_next = NULL; /* every rank's loader state, see save_interrupted */
    int B = cfg->data.micro_batch_size, T = cfg->data.seq_len, M = B * T;
    int rc, start_step = 0, done_steps = 0;
    int at_mb = 0; /* the micro-batch of the step in progress (for the stop message) */

    /* data-parallel start-up: rank/world from the launcher's environment, then dist_start */
    uint8_t nccl_id[128];
    memset(nccl_id, 0, sizeof nccl_id);
    if ((rc = bt_dist_env_resolve(&g_dist))) goto done_nomodel;
    if (!eval_only && g_dist.rank == 0 && cfg->optim.warmup_steps > cfg->steps)
        bt_log(BT_LOG_WARN, "trainer", "optim.warmup_steps %d > steps %d: the learning rate never reaches "
               "optim.lr %g", cfg->optim.warmup_steps, cfg->steps, cfg->optim.lr);
    if (!eval_only && g_dist.rank == 0) { /* saves killed mid-write by an earlier run (SIGKILL) */
        bt_clean_stale_temps(cfg->out_dir, "trainer");
        if (cfg->checkpoint_every > 0 || cfg->resume_from)
            bt_clean_stale_temps(cfg->checkpoint_dir, "trainer");
    }
    if (g_dist.world > 1) {
        if (cfg->device != BT_DEVICE_CUDA) {
            rc = bt_fail(BT_ERR_UNSUPPORTED, "%d processes (%s: rank %d): data-parallel training "
                         "all-reduces gradients with NCCL and needs device \"cuda\"", g_dist.world,
                         g_dist.source, g_dist.rank);
            goto done_nomodel;
        }
        if ((rc = dist_start(cfg, nccl_id))) goto done_nomodel;
    }
    if ((rc = run_id_init(nccl_id))) goto done_nomodel;

    double t0 = bt_now();
    bt_model_load_opts lopts = {cfg->base_dtype, 0};
    if ((rc = bt_model_load(&model, cfg->model, &lopts))) goto done_nomodel;
    bt_base_info binfo;
    bt_model_base_info(&model, &binfo);
    bt_log(BT_LOG_INFO, "trainer",
           "model %s: %d layers, d_model %d, heads %d/%d, ffn %d, vocab %d%s, %.0f MiB, "
           "loaded in %.1f s; base linears %s (%s: %.2f bits per weight, %.1f MiB)",
           cfg->model, model.hp.n_layer, model.hp.d_model, model.hp.n_head, model.hp.n_kv_head,
           model.hp.d_ff, model.hp.vocab, model.tied ? ", tied embeddings" : "",
           bt_model_bytes(&model) / 1048576.0, bt_now() - t0,
           bt_base_dtype_name(model.base_dtype),
           model.base_dtype == BT_BASE_GGUF ? binfo.types
           : model.base_dtype == BT_BASE_NF4 ? "re-quantised, double-quantised absmax"
                                             : "dequantised",
           binfo.bits_per_weight, binfo.bytes / 1048576.0);
    if (cfg->context_extension.target_length > 0) {
        const int ctx0 = model.hp.ctx;
        if ((rc = bt_model_extend_context(&model, cfg->context_extension.method,
                                          cfg->context_extension.target_length)))
            goto done;
        bt_log(BT_LOG_INFO, "trainer", "context extension: %d -> %d tokens, %s RoPE scaling, "
               "factor %g%s", ctx0, model.hp.ctx, bt_rope_ext_name(model.hp.rope_ext),
               (double)model.hp.rope_ext_factor,
               model.ctx_extended ? "" : " (the model already carries it)");
    } else if (T > model.hp.ctx && model.hp.ctx > 0) {
        bt_log(BT_LOG_WARN, "trainer", "data.seq_len %d exceeds the model's context length %d: "
               "positions beyond it were never trained (set context_extension.target_length to "
               "extend the RoPE)", T, model.hp.ctx);
    }
    const int s2_group = bt_config_s2_group(cfg);
    if (s2_group > 0 && !eval_only)
        bt_log(BT_LOG_INFO, "trainer", "S2-Attn in training: groups of %d tokens (group_fraction "
               "%g of %d), half the heads shifted by %d; evaluation uses full attention", s2_group,
               cfg->s2_group_fraction, T, s2_group / 2);
    unsigned trainable = ((cfg->trainable_mask & (1u << BT_TRAINABLE_EMBED)) ? BT_TRAIN_EMBED : 0) |
                         ((cfg->trainable_mask & (1u << BT_TRAINABLE_NORM)) ? BT_TRAIN_NORM : 0);
    if ((rc = bt_lora_init_ex(&lora, &model, cfg->lora.r, cfg->lora.alpha, cfg->lora.dropout,
                              cfg->lora.target_mask, trainable, cfg->seed)))
        goto done;
    bt_log(BT_LOG_INFO, "trainer", "LoRA r %d alpha %g dropout %g: %lld trainable parameters%s",
           lora.r, lora.alpha, lora.dropout, (long long)lora.n_params,
           trainable ? " (LoRA+: with dense embed_tokens/norm weights)" : "");
    /* resume: parameters, AdamW moments, step and the loader position */
    int has_resume = 0;
    uint8_t resume[BT_RESUME_STATE_BYTES];
    memset(resume, 0, sizeof resume);
    if (eval_only && cfg->eval_adapter) { /* trainer eval --adapter DIR: its own r, targets... */
        bt_lora_free(&lora);
        /* positions as the adapter was trained (its barqtrain_context_extension note), as
         * `trainer export` and `generate` apply it */
        if ((rc = bt_adapter_apply_context(&model, cfg->eval_adapter))) goto done;
        if ((rc = bt_lora_load_peft(&lora, &model, cfg->eval_adapter))) goto done;
        bt_log(BT_LOG_INFO, "trainer", "evaluating adapter %s: r %d, alpha %g%s", cfg->eval_adapter,
               lora.r, lora.alpha, lora.trainable ? ", LoRA+ embed_tokens/norms" : "");
    }
    if (cfg->resume_from && !cfg->eval_adapter) {
        int64_t st = 0;
        int ck_steps = 0;
        if ((rc = bt_checkpoint_load_ex(cfg->resume_from, cfg, &model, &lora, &st, resume,
                                        &has_resume, &ck_steps, g_dist.rank, g_dist.world)))
            goto done;
        if (eval_only) {
            bt_log(BT_LOG_INFO, "trainer", "evaluating checkpoint %s (step %lld)", cfg->resume_from,
                   (long long)st);
        } else if (st > cfg->steps) {
            rc = bt_fail(BT_ERR_INVALID, "checkpoint %s is at step %lld, past steps = %d",
                         cfg->resume_from, (long long)st, cfg->steps);
            goto done;
        }
        start_step = (int)st;
        if (ck_steps != cfg->steps && !eval_only)
            bt_log(BT_LOG_WARN, "trainer", "checkpoint was written by a run of %d steps, this run "
                   "has %d: the learning-rate schedule follows %d", ck_steps, cfg->steps,
                   cfg->steps);
        if (!eval_only)
            bt_log(BT_LOG_INFO, "trainer", "resumed from %s at step %d", cfg->resume_from, start_step);
    }
    done_steps = start_step;
#ifdef BT_WITH_CUDA
    if (cfg->device == BT_DEVICE_CUDA) {
        bt_cuda_trainer_opts co;
        memset(&co, 0, sizeof co);
        co.checkpointing = cfg->activation_checkpointing;
        co.attn_impl = cfg->cuda_attention == BT_CUDA_ATTN_MMA;
        co.nf4_impl = cfg->cuda_nf4_matmul == BT_CUDA_NF4_FUSED;
        co.s2_group = s2_group;
        co.offload = cfg->cuda_offload;
        if ((rc = bt_cuda_device_for_local_rank(g_dist.local_rank, &co.device))) goto done;
        if ((rc = bt_cuda_trainer_new_ex(&g_cuda, &model, &lora, M, &co))) goto done;
        /* a collective waits at most dist.timeout_s, plus the time the watchdog needs to name a
         * lost rank first (rank 0's straggler check uses dist.timeout_s itself) */
        bt_cuda_hooks hooks = {stop_check, on_collective, NULL,
                               (double)cfg->dist.timeout_s + cfg->dist.heartbeat_timeout_s};
        bt_cuda_trainer_set_hooks(g_cuda, &hooks);
        if ((rc = bt_cuda_trainer_dist_init(g_cuda, nccl_id, g_dist.rank, g_dist.world))) goto done;
        if (g_dist.world > 1)
            bt_log(BT_LOG_INFO, "trainer", "NCCL: rank %d of %d on CUDA device %d", g_dist.rank,
                   g_dist.world, co.device);
        bt_log(BT_LOG_INFO, "trainer", "CUDA device %s: model + LoRA + workspace for %dx%d tokens: "
               "%.0f MiB%s; attention %s, NF4 matmul %s", bt_cuda_trainer_device_name(g_cuda), B, T,
               bt_cuda_trainer_bytes(g_cuda) / 1048576.0,
               cfg->activation_checkpointing ? " (activation checkpointing)" : "",
               co.attn_impl ? "mma" : "wmma", co.nf4_impl ? "fused" : "dequant+cuBLAS");
    } else
#endif
    {
    if ((rc = bt_step_ctx_new(&ctx, &model, &lora, M, cfg->activation_checkpointing))) goto done;
    bt_step_ctx_set_check(ctx, stop_check, NULL);
    if ((rc = bt_step_set_s2(ctx, s2_group))) goto done;
    bt_log(BT_LOG_INFO, "trainer", "workspace for %dx%d tokens: %.0f MiB%s", B, T,
           bt_step_ctx_bytes(ctx) / 1048576.0,
           cfg->activation_checkpointing ? (cfg->checkpointing_auto ? " (activation checkpointing: "
                                            "auto, seq_len >= checkpointing_min_seq_len)"
                                                                    : " (activation checkpointing)")
                                         : "");
    }

    double before = NAN, after = NAN;
    long long n_eval = 0;
    int eval_cut = 0;
    bt_eval_length len_before[BT_MAX_EVAL_LENGTHS], len_after[BT_MAX_EVAL_LENGTHS];
    const int by_len = cfg->eval.n_lengths > 0;
    if (cfg->eval.n_shards > 0) {
        if (by_len) rc = bt_eval_lengths(cfg, &model, &lora, ctx, M, len_before, &eval_cut);
        else rc = bt_eval_heldout(cfg, &model, &lora, ctx, &before, &n_eval, &eval_cut);
        if (rc) {
            if (eval_only) goto done;
            goto stop_or_fail;
        }
    }
    if (!eval_only && g_dist.rank == 0) {
        if ((rc = bt_report_open(&rep, cfg, start_step))) goto done;
        if (cfg->eval.n_shards > 0 && !(eval_cut && n_eval == 0) &&
            (rc = bt_report_eval(rep, start_step, before, n_eval)))
            goto done;
    }
    if (eval_only) {
        if (cfg->eval.n_shards == 0) {
            rc = bt_fail(BT_ERR_INVALID, "config: eval.shards: required for `trainer eval`");
            goto done;
        }
        if (g_dist.rank == 0) {
            if (by_len) {
                if (eval_cut) fprintf(out, "held-out evaluation interrupted\n");
                print_lengths(out, len_before, NULL, cfg->eval.n_lengths);
            } else if (eval_cut && n_eval == 0)
                fprintf(out, "held-out loss (partial, interrupted): no batch evaluated\n");
            else
                fprintf(out, "held-out loss%s: %.6f, perplexity %.3f (%lld tokens%s%s)\n",
                        eval_cut ? " (partial, interrupted)" : "", before, exp(before), n_eval,
                        cfg->eval_adapter ? "; adapter " : cfg->resume_from ? "; checkpoint " : "",
                        cfg->eval_adapter ? cfg->eval_adapter
                        : cfg->resume_from ? cfg->resume_from
                                           : "");
            fflush(out);
        }
        if (eval_cut) rc = stop_check(NULL);
        if (eval_cut && !rc) rc = bt_fail(BT_ERR_CANCELLED, "interrupted");
        if (rc == BT_ERR_CANCELLED)
            rc = bt_fail(rc, "%s: the held-out evaluation is partial", bt_last_error());
        goto done;
    }
    if (eval_cut) {
        rc = stop_check(NULL);
        if (!rc) rc = bt_fail(BT_ERR_CANCELLED, "interrupted");
        goto stop_or_fail;
    }

    if ((rc = attach(&cl, cfg, 0, has_resume ? resume : NULL))) goto done;
    /* loaderd shows the base this run trains against (loaderctl status): type and real size */
    bt_client_set_base(cl, bt_base_dtype_name(binfo.base_dtype), binfo.types,
                       binfo.bits_per_weight, binfo.bytes);
    mbs = calloc((size_t)cfg->grad_accum, sizeof(mb_copy));
    all_done = calloc((size_t)g_dist.world, BT_RESUME_STATE_BYTES);
    all_next = calloc((size_t)g_dist.world, BT_RESUME_STATE_BYTES);
    if (!mbs || !all_done || !all_next) {
        rc = bt_fail(BT_ERR_NOMEM, "out of memory");
        goto done;
    }
    for (int i = 0; i < cfg->grad_accum; i++)
        if ((rc = mb_alloc(&mbs[i], B, T))) goto done;
    bt_schedule sched = {cfg->schedule, cfg->optim.lr, cfg->min_lr_ratio, cfg->optim.warmup_steps,
                         cfg->steps};
    double train_t0 = bt_now();
    int end_step = cfg->stop_at_step > 0 ? cfg->stop_at_step : cfg->steps;
    double last_loss = NAN;
    int ck_step = -1; /* the step of the last checkpoint written */
    int adapter_step = -1; /* the step of the last adapter written by this run (save_every) */
    const int poison_step = test_poison_step();
    /* --profile: the second step of the run (the first warms caches and pages), or the only one */
    const int prof_step = !cfg->profile ? -1 : end_step - start_step >= 2 ? start_step + 1 : start_step;
    /* A stop request (a signal on any rank, relayed by the watchdog) lands mid-step: every wait
     * and every layer asks stop_check, the step is dropped, and `interrupted` keeps the last
     * completed one. */
    for (int step = start_step; step < end_step; step++) {
        double ts = bt_now();
        if ((rc = stop_check(NULL))) goto stop_or_fail;
        if (step == prof_step) {
            if (!(prof = bt_prof_new())) {
                rc = bt_fail(BT_ERR_NOMEM, "out of memory");
                goto done;
            }
#ifdef BT_WITH_CUDA
            if (g_cuda) bt_cuda_trainer_set_profile(g_cuda, prof);
            else
#endif
                bt_step_ctx_set_profile(ctx, prof);
        }
        /* 1. Gather all micro-batches of the step: the loss is normalised by the labelled
         *    targets over all of them (exact mean, independent of how tokens fall into
         *    micro-batches, and of how rows fall onto ranks), so they are counted before any
         *    backward. */
        long long n_lab = 0, n_real = 0;
        int got = 0; /* 0 ok, 1 end of stream, 2 stop request while waiting, <0 error */
        double wait_s = 0; /* time spent waiting for loaderd in this step */
        for (int i = 0; i < cfg->grad_accum && got == 0; i++) {
            double tw = bt_now();
            got = next_batch(cl, cfg, &mbs[i], "train");
            wait_s += bt_now() - tw;
            if (got) break;
            bt_microbatch mb;
            mb_view(&mbs[i], B, T, &mb);
            int n = bt_shift_targets(NULL, &mb, model.hp.vocab);
            if (n < 0) {
                got = n;
                break;
            }
            n_lab += n;
            n_real += mbs[i].n_real;
        }
        if (got == 2) {
            rc = stop_check(NULL);
            if (!rc) rc = bt_fail(BT_ERR_CANCELLED, "interrupted");
            goto stop_or_fail;
        }
        if (got == 1)
            got = bt_fail(BT_ERR_CLOSED, "the training stream ended after step %d of %d%s", step,
                          cfg->steps, g_dist.world > 1 ? " (on this rank)" : "");
        const long long n_real_local = n_real;
        /* ... over all ranks: counts, and whether any rank's stream failed */
        double st[3] = {(double)n_lab, (double)n_real, got < 0};
        if ((rc = dist_sum(st, 3))) goto stop_or_fail;
        n_lab = (long long)st[0];
        n_real = (long long)st[1];
        if (st[2] > 0) { /* the batch stream failed (here or on another rank) */
            rc = got < 0 ? got
                         : bt_fail(BT_ERR_CLOSED, "another rank could not get its batches for "
                                   "step %d (see its log)", step + 1);
            goto failed;
        }
        memcpy(resume, mbs[cfg->grad_accum - 1].resume, BT_RESUME_STATE_BYTES);
        has_resume = 1;
        /* every rank's loader state after this step (for checkpoints: see save_interrupted) */
        if ((rc = dist_gather_resume(resume, all_next))) goto stop_or_fail;
        /* 2. forward + backward */
#ifdef BT_WITH_CUDA
        if (g_cuda && (rc = bt_cuda_trainer_zero_grad(g_cuda))) goto done;
        if (!g_cuda)
#endif
            bt_lora_zero_grad(&lora);
        double loss_sum = 0;
        float gscale = n_lab > 0 ? (float)(1.0 / (double)n_lab) : 0.f;
        for (int i = 0; i < cfg->grad_accum; i++) {
            bt_microbatch mb;
            mb_view(&mbs[i], B, T, &mb);
            at_mb = i + 1;
            /* the dropout key also depends on the rank: the ranks' rows are different rows */
            uint64_t key = bt_hash64(cfg->seed ^ bt_hash64(((uint64_t)step << 20) + (uint64_t)i + 1));
            if (g_dist.rank > 0) key = bt_hash64(key ^ (uint64_t)g_dist.rank);
            double ls;
#ifdef BT_WITH_CUDA
            if (g_cuda) rc = bt_cuda_trainer_step(g_cuda, &mb, 1, gscale, key | 1, &ls, NULL);
            else
#endif
                rc = bt_forward_backward(ctx, &model, &lora, &mb, 1, gscale, key | 1, &ls, NULL);
            if (rc) goto stop_or_fail;
            loss_sum += ls;
        }
        if (poison_step == step + 1 && lora.n_params > 0 && !on_device(cfg)) lora.grads[0] = NAN;
#ifdef BT_WITH_CUDA
        /* sum of every rank's d(loss_sum / n_lab): the gradient of the global mean loss */
        if (g_cuda && g_dist.world > 1 && (rc = bt_cuda_trainer_allreduce_grads(g_cuda)))
            goto stop_or_fail;
#endif
        if ((rc = dist_sum(&loss_sum, 1))) goto stop_or_fail;
        double loss = n_lab > 0 ? loss_sum / (double)n_lab : NAN;
        /* 3. clip + AdamW (every rank holds the same summed gradients, so every rank computes
         *    the same norm and the same update) */
        double lr = bt_schedule_lr(&sched, step);
        double gnorm;
        int on_gpu = 0;
#ifdef BT_WITH_CUDA
        if (g_cuda) { /* the same clip + AdamW on the device (skipped in the same cases) */
            on_gpu = 1;
            if ((rc = bt_cuda_trainer_clip_and_step(
                     g_cuda, cfg->optim.grad_clip, (float)lr, (float)cfg->optim.beta1,
                     (float)cfg->optim.beta2, (float)cfg->optim.eps, (float)cfg->optim.weight_decay,
                     step + 1, n_lab == 0 || !isfinite(loss), &gnorm, NULL)))
                goto done;
        } else
#endif
        {
            double t_clip = bt_now();
            gnorm = bt_clip_grad_norm(lora.grads, lora.n_params, cfg->optim.grad_clip);
            bt_prof_add(prof, "clip grad norm", bt_now() - t_clip, 0.0);
        }
        double t_opt = bt_now();
        if (n_lab == 0) {
            bt_log(BT_LOG_WARN, "trainer", "step %d: no labelled tokens; update skipped", step + 1);
        } else if (!isfinite(gnorm) || !isfinite(loss)) {
            /* diverged: stop here, save nothing (every rank sees the same loss and norm) */
            char what[96];
            snprintf(what, sizeof what, "%s %g", !isfinite(loss) ? "loss" : "gradient norm",
                     !isfinite(loss) ? loss : gnorm);
            rc = diverged(cfg, step + 1, what, lr, adapter_step, ck_step);
            goto done;
        } else if (!on_gpu) {
            /* [0, n_decay): LoRA (+ embedding) with weight decay; the LoRA+ norm weights after
             * it without (lora.h) */
            bt_adamw_step(lora.params, lora.grads, lora.m, lora.v, lora.n_decay, (float)lr,
                          (float)cfg->optim.beta1, (float)cfg->optim.beta2, (float)cfg->optim.eps,
                          (float)cfg->optim.weight_decay, step + 1);
            int64_t nd = lora.n_decay;
            if (lora.n_params > nd)
                bt_adamw_step(lora.params + nd, lora.grads + nd, lora.m + nd, lora.v + nd,
                              lora.n_params - nd, (float)lr, (float)cfg->optim.beta1,
                              (float)cfg->optim.beta2, (float)cfg->optim.eps, 0.f, step + 1);
            bt_prof_add(prof, "adamw", bt_now() - t_opt, 4.0 * 3.0 * (double)lora.n_params);
            size_t at = 0;
            if (!bt_all_finite_f32(lora.params, (size_t)lora.n_params, &at)) {
                char what[96];
                snprintf(what, sizeof what, "LoRA parameter %zu after the update", at);
                rc = diverged(cfg, step + 1, what, lr, adapter_step, ck_step);
                goto done;
            }
        }
        done_steps = step + 1;
        at_mb = 0;
        uint8_t *swap = all_done;
        all_done = all_next;
        all_next = swap;
        last_loss = loss;
        /* 4. progress: tokens/s of all ranks on the console (rank 0), this rank's to loaderd */
        double now = bt_now(), dt = now - ts, el = now - train_t0;
        double tps = dt > 0 ? (double)n_real / dt : 0;
        bt_client_report(cl, (uint64_t)done_steps, loss, dt > 0 ? (double)n_real_local / dt : 0);
        if (g_dist.rank == 0 && (done_steps % cfg->log_every == 0 || done_steps == cfg->steps ||
                                 done_steps == end_step)) {
            char e1[24], e2[24];
            bt_fmt_duration(e1, sizeof e1, el);
            bt_fmt_duration(e2, sizeof e2, el / (done_steps - start_step) * (end_step - done_steps));
            fprintf(out, "step %d/%d | loss %.4f | lr %.2e | %.0f tok/s | elapsed %s | eta %s\n",
                    done_steps, cfg->steps, loss, lr, tps, e1, e2);
            fflush(out);
            /* full precision, for exact comparisons (resume tests) */
            bt_log(BT_LOG_DEBUG, "trainer", "step %d loss %.17g grad norm %.17g", done_steps, loss,
                   gnorm);
        }
        if (rep) {
            bt_step_metrics sm = {done_steps, loss, lr, gnorm, n_real, dt, wait_s,
                                  bt_peak_rss_mib(), -1};
#ifdef BT_WITH_CUDA
            if (g_cuda) sm.device_mib = bt_cuda_trainer_bytes(g_cuda) / 1048576.0;
#endif
            if ((rc = bt_report_step(rep, &sm))) goto done;
            rep_steps++;
        }
        if (prof) {
#ifdef BT_WITH_CUDA
            if (g_cuda) bt_cuda_trainer_set_profile(g_cuda, NULL);
            else
#endif
                bt_step_ctx_set_profile(ctx, NULL);
            if (g_dist.rank == 0 && (rc = print_profile(cfg, prof, done_steps, dt, ctx, out)))
                goto done;
            bt_prof_free(prof);
            prof = NULL;
        }
        if (cfg->checkpoint_every > 0 && done_steps < cfg->steps &&
            (done_steps % cfg->checkpoint_every == 0 || done_steps == end_step)) {
            if ((rc = save_checkpoint(cfg, &model, &lora, done_steps, all_done))) goto stop_or_fail;
            if (g_dist.rank == 0)
                bt_log(BT_LOG_INFO, "trainer", "step %d: checkpoint saved to %s", done_steps,
                       cfg->checkpoint_dir);
            ck_step = done_steps;
        }
        if (cfg->save_every > 0 && done_steps % cfg->save_every == 0 && done_steps < cfg->steps) {
            if (g_dist.rank == 0) {
                rc = sync_host_lora(&lora, 0);
                if (!rc) rc = bt_adapter_save_ex(&lora, cfg->base_model_name_or_path, cfg->out_dir, &model);
                if (!rc)
                    bt_log(BT_LOG_INFO, "trainer", "step %d: adapter saved to %s", done_steps,
                           cfg->out_dir);
            }
            if ((rc = dist_agree(rc, "saving the adapter"))) goto stop_or_fail;
            adapter_step = done_steps;
        }
    }
    if (end_step < cfg->steps)
        bt_log(BT_LOG_INFO, "trainer", "stopped after step %d of %d (stop_at_step)", done_steps,
               cfg->steps);
    bt_client_close(cl);
    cl = NULL;
    if (g_dist.rank == 0) {
        rc = sync_host_lora(&lora, 0);
        if (!rc) rc = bt_adapter_save_ex(&lora, cfg->base_model_name_or_path, cfg->out_dir, &model);
    }
    if ((rc = dist_agree(rc, "saving the adapter"))) goto stop_or_fail;
    if (g_dist.rank == 0)
        bt_log(BT_LOG_INFO, "trainer", "%d steps in %.1f s, last loss %.4f, peak RSS %.0f MiB",
               done_steps, bt_now() - train_t0, last_loss, bt_peak_rss_mib());
    if (cfg->eval.n_shards > 0) {
        int cut = 0;
        rc = by_len ? bt_eval_lengths(cfg, &model, &lora, ctx, M, len_after, &cut)
                    : bt_eval_heldout(cfg, &model, &lora, ctx, &after, &n_eval, &cut);
        if (rc) goto stop_or_fail;
        if (cut) { /* the training is complete and saved: only the evaluation was cut short */
            rc = stop_check(NULL);
            if (!rc) rc = bt_fail(BT_ERR_CANCELLED, "interrupted");
            rc = bt_fail(rc, "%s during the final held-out evaluation; adapter for step %d of %d "
                         "saved to %s", bt_last_error(), done_steps, cfg->steps, cfg->out_dir);
            goto done;
        }
        if (by_len) {
            if (g_dist.rank == 0) print_lengths(out, len_before, len_after, cfg->eval.n_lengths);
        } else {
            if (rep && (rc = bt_report_eval(rep, done_steps, after, n_eval))) goto done;
            if (g_dist.rank == 0)
                fprintf(out, "held-out loss: before %.4f -> after %.4f (%+.1f%%)\n", before, after,
                        100.0 * (after - before) / before);
        }
    }
    if (g_dist.rank == 0) {
        fprintf(out, "adapter: %s\n", cfg->out_dir);
        fflush(out);
    }
    goto done;
stop_or_fail: /* rc from a wait, a layer or a collective: a stop request, or a failure */
    if (rc != BT_ERR_CANCELLED) goto done;
    { /* interrupted: keep the last completed step; with several ranks every rank comes here
       * (relayed), no collective is used any more, and rank 0 alone saves */
        char why[600], saved[1200] = "";
        snprintf(why, sizeof why, "%s", bt_last_error());
        bt_client_close(cl);
        cl = NULL;
        int src = 0;
        if (at_mb > 0)
            bt_log(BT_LOG_WARN, "trainer", "%s: stopping mid-step %d (in micro-batch %d of %d)",
                   why, done_steps + 1, at_mb, cfg->grad_accum);
        else
            bt_log(BT_LOG_WARN, "trainer", "%s: stopping before step %d's forward", why,
                   done_steps + 1);
        if (g_dist.rank == 0 && done_steps > start_step) {
            src = save_interrupted(cfg, &model, &lora, done_steps, all_done, saved, sizeof saved);
        }
        if (src)
            rc = bt_fail(BT_ERR_IO, "%s after step %d; saving it failed: %s", why, done_steps,
                         bt_last_error());
        else if (g_dist.rank != 0)
            rc = bt_fail(BT_ERR_CANCELLED, "%s: stopped after step %d of %d (rank 0 saves)", why,
                         done_steps, cfg->steps);
        else if (done_steps > start_step)
            rc = bt_fail(BT_ERR_CANCELLED, "%s: stopped after step %d of %d; %s", why, done_steps,
                         cfg->steps, saved);
        else
            rc = bt_fail(BT_ERR_CANCELLED, "%s before step %d completed: nothing new to save", why,
                         start_step + 1);
        goto done;
    }
failed: /* the batch stream failed after some steps: keep them (adapter + checkpoint); with
         * several ranks every rank comes here together (the step's first collective) */
    if (done_steps > start_step) {
        char why[1024];
        snprintf(why, sizeof why, "%s", bt_last_error());
        bt_client_close(cl); /* first: its best-effort detach may overwrite bt_last_error */
        cl = NULL;
        int src = 0;
        if (g_dist.rank == 0) {
            src = sync_host_lora(&lora, 1);
            if (!src) src = bt_adapter_save_ex(&lora, cfg->base_model_name_or_path, cfg->out_dir, &model);
        }
        src = dist_agree(src, "saving the adapter");
        if (!src && cfg->checkpoint_every > 0 && ck_step != done_steps)
            src = save_checkpoint(cfg, &model, &lora, done_steps, all_done);
        if (src)
            rc = bt_fail(rc, "%s; saving step %d also failed: %s", why, done_steps,
                         bt_last_error());
        else
            rc = bt_fail(rc, "%s; adapter for step %d of %d saved to %s%s%s", why, done_steps,
                         cfg->steps, cfg->out_dir,
                         cfg->checkpoint_every > 0 ? ", checkpoint to " : "",
                         cfg->checkpoint_every > 0 ? cfg->checkpoint_dir : "");
    }
done:
    bt_report_close(rep, cfg->report.plot && rep_steps > 0); /* the plot of what did run */
    bt_prof_free(prof);
    if (mbs)
        for (int i = 0; i < cfg->grad_accum; i++) mb_free(&mbs[i]);
    free(mbs);
    free(all_done);
    free(all_next);
    bt_client_close(cl);
    bt_step_ctx_free(ctx);
#ifdef BT_WITH_CUDA
    if (rc == BT_ERR_CANCELLED) bt_cuda_trainer_dist_abort(g_cuda); /* peers may be gone */
    bt_cuda_trainer_free(g_cuda);
    g_cuda = NULL;
#endif
    bt_lora_free(&lora);
    bt_model_free(&model);
done_nomodel:
    if (g_mon) { /* the last word to the other ranks: goodbye, or this rank's error */
        char keep[1400];
        snprintf(keep, sizeof keep, "%s", bt_last_error());
        if (rc == 0 || rc == BT_ERR_CANCELLED) {
            int frc = bt_dist_monitor_finish(g_mon);
            if (!rc && frc) rc = frc;
            else bt_fail(rc, "%s", keep);
        } else {
            if (!bt_dist_monitor_check(g_mon)) bt_dist_monitor_fail(g_mon, keep); /* else known */
            bt_fail(rc, "%s", keep);
        }
        bt_dist_monitor_free(g_mon);
        g_mon = NULL;
    }
    for (int i = 0; i < N_STOP_SIGNALS; i++) sigaction(k_stop_signals[i], &old_sa[i], NULL);
    return rc;
}
