/* The run report: metrics.jsonl, report.png (gnuplot), TensorBoard events. See report.h. */
#include "trainer/report/report.h"

#include <errno.h>
#include <fcntl.h>
#include <jansson.h>
#include <math.h>
#include <spawn.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/stat.h>
#include <sys/wait.h>
#include <time.h>
#include <unistd.h>

#include "common/atomic_io.h"
#include "common/bt_common.h"
#include "common/out_dir.h"
#include "trainer/io/outputs.h"
#include "trainer/report/tb_events.h"

extern char **environ;

struct bt_report {
    FILE *f;
    char *path;
    bt_tb_writer *tb;
    char *dir;
};

static double wall_now(void) {
    struct timespec ts;
    clock_gettime(CLOCK_REALTIME, &ts);
    return (double)ts.tv_sec + 1e-9 * (double)ts.tv_nsec;
}

/* The longest metrics line we read back: ours are ~300 bytes; a longer one is not ours. */
#define METRICS_LINE_MAX 65536

/* One line of `f` into buf[METRICS_LINE_MAX] (without the newline): 1, 0 at the end, -1 for a line
 * longer than the buffer (skipped to its end). Never reads more than the buffer at once, so a
 * file with no newline costs no more memory than that (issue 21 §11). */
static int read_line_bounded(FILE *f, char *buf) {
    if (!fgets(buf, METRICS_LINE_MAX, f)) return 0;
    size_t n = strlen(buf);
    if (n && buf[n - 1] == '\n') {
        buf[n - 1] = 0;
        return 1;
    }
    if (n < METRICS_LINE_MAX - 1) return 1; /* the last line, without a newline */
    int c;
    while ((c = fgetc(f)) != EOF && c != '\n') {}
    return -1;
}

/* Copy the lines of an existing metrics.jsonl (`path`) with step <= keep_step to `out` (a
 * resumed run continues it), line by line. Returns 0 or BT_ERR_IO. */
static int copy_kept_lines(const char *path, int keep_step, FILE *out, const char *out_path) {
    int fd = open(path, O_RDONLY | O_NOFOLLOW | O_NONBLOCK | O_CLOEXEC);
    FILE *f = fd >= 0 ? fdopen(fd, "rb") : NULL;
    if (!f) {
        if (fd >= 0) close(fd);
        return 0; /* no earlier metrics: nothing to keep */
    }
    char *line = malloc(METRICS_LINE_MAX);
    int rc = line ? 0 : bt_fail(BT_ERR_NOMEM, "report: out of memory"), r;
    while (!rc && (r = read_line_bounded(f, line)) != 0) {
        if (r < 0) continue;
        json_t *j = json_loads(line, 0, NULL);
        json_t *st = j ? json_object_get(j, "step") : NULL;
        int keep = json_is_integer(st) && json_integer_value(st) <= keep_step;
        json_decref(j);
        if (keep && (fputs(line, out) < 0 || fputc('\n', out) == EOF))
            rc = bt_fail(BT_ERR_IO, "report: write %s: %s", out_path, strerror(errno));
    }
    free(line);
    fclose(f);
    return rc;
}

static int put_line(bt_report *r, json_t *j);

int bt_report_open(bt_report **out, const bt_train_config *cfg, int start_step) {
    *out = NULL;
    /* never write into a directory holding files BarqTrain did not write (common/out_dir.h) */
    int rc = bt_out_dir_check(cfg->report.dir, &bt_out_report, "report");
    if (rc || (rc = bt_mkdir_p(cfg->report.dir, "report")) ||
        (rc = bt_out_dir_mark(cfg->report.dir, &bt_out_report, "report")))
        return rc;
    bt_report *r = calloc(1, sizeof *r);
    if (!r) return bt_fail(BT_ERR_NOMEM, "report: out of memory");
    r->dir = bt_xstrdup(cfg->report.dir);
    if (asprintf(&r->path, "%s/metrics.jsonl", cfg->report.dir) < 0) r->path = NULL;
    /* a fresh file (or the kept lines of a resumed run) put in place of the old one by rename */
    bt_atomic_file af = {.fd = -1};
    if (!r->path) rc = bt_fail(BT_ERR_NOMEM, "report: out of memory");
    else if (!(rc = bt_atomic_open(&af, r->path, "report")) && !(r->f = fdopen(af.fd, "wb")))
        rc = bt_fail(BT_ERR_IO, "report: %s: %s", af.tmp, strerror(errno));
    if (!rc && start_step > 0) rc = copy_kept_lines(r->path, start_step, r->f, af.tmp);
    if (!rc && (fflush(r->f) || rename(af.tmp, r->path) != 0))
        rc = bt_fail(BT_ERR_IO, "report: create %s: %s", r->path, strerror(errno));
    if (r->f) af.fd = -1; /* the FILE owns it now */
    if (rc) bt_atomic_abort(&af);
    else {
        free(af.tmp);
        free(af.path);
    }
    if (!rc && cfg->report.tensorboard) rc = bt_tb_open(&r->tb, cfg->report.dir);
    if (!rc) { /* what the plot's title names: the run and its model (the last such line wins) */
        json_t *j = json_pack("{s:s, s:i, s:s, s:s, s:s, s:f}", "type", "run", "step", start_step,
                              "name", cfg->name ? cfg->name : "", "model",
                              cfg->model ? cfg->model : "", "base_dtype",
                              bt_base_dtype_name(cfg->base_dtype), "time", wall_now());
        rc = j ? put_line(r, j) : bt_fail(BT_ERR_NOMEM, "report: out of memory");
    }
    if (rc) {
        bt_report_close(r, 0);
        return rc;
    }
    bt_log(BT_LOG_INFO, "report", "metrics: %s%s%s", r->path, r->tb ? ", TensorBoard: " : "",
           r->tb ? bt_tb_path(r->tb) : "");
    *out = r;
    return 0;
}

static json_t *num(double x) { return isfinite(x) ? json_real(x) : json_null(); }

static int put_line(bt_report *r, json_t *j) {
    char *s = json_dumps(j, JSON_COMPACT | JSON_REAL_PRECISION(15)); /* "time" to the ms */
    json_decref(j);
    if (!s) return bt_fail(BT_ERR_NOMEM, "report: out of memory");
    int rc = 0;
    if (fputs(s, r->f) < 0 || fputc('\n', r->f) == EOF || fflush(r->f))
        rc = bt_fail(BT_ERR_IO, "report: write %s: %s", r->path, strerror(errno));
    free(s);
    return rc;
}

/* TRL's metric names (trainer/preference.h bt_pref_metrics), in its order, then ours:
 * logps/accuracies, logps/margins (the policy's own preference; pairs only) */
#define PREF_N 12
static const char *const k_pref_names[PREF_N] = {
    "rewards/chosen", "rewards/rejected", "rewards/accuracies", "rewards/margins", "logps/chosen",
    "logps/rejected", "nll_loss", "log_odds_ratio", "log_odds_chosen", "kl", "logps/accuracies",
    "logps/margins"};

static void pref_values(const bt_pref_metrics *m, double v[PREF_N]) {
    const double x[PREF_N] = {m->rewards_chosen, m->rewards_rejected, m->rewards_accuracies,
                              m->rewards_margins, m->logps_chosen, m->logps_rejected, m->nll_loss,
                              m->log_odds_ratio, m->log_odds_chosen, m->kl, m->logps_accuracies,
                              m->logps_margins};
    memcpy(v, x, sizeof x);
}

/* the six TRL logs for every algorithm always (null when not finite), the others when finite */
static void pref_keys(json_t *j, const bt_pref_metrics *m) {
    double v[PREF_N];
    pref_values(m, v);
    for (int i = 0; i < PREF_N; i++)
        if (i < 6 || isfinite(v[i])) json_object_set_new(j, k_pref_names[i], num(v[i]));
}

static int pref_tb(bt_report *r, const char *prefix, int step, double t, const bt_pref_metrics *m) {
    double v[PREF_N];
    pref_values(m, v);
    char tag[64];
    int rc = 0;
    for (int i = 0; i < PREF_N && !rc; i++) {
        if (!isfinite(v[i])) continue;
        snprintf(tag, sizeof tag, "%s%s", prefix, k_pref_names[i]);
        rc = bt_tb_scalar(r->tb, tag, step, t, (float)v[i]);
    }
    return rc;
}

int bt_report_eval_pref(bt_report *r, int step, const bt_pref_metrics *m, long long records) {
    if (!r) return 0;
    double t = wall_now();
    json_t *j = json_pack("{s:s, s:i, s:o, s:I}", "type", "eval", "step", step, "loss", num(m->loss),
                          "records", (json_int_t)records);
    if (!j) return bt_fail(BT_ERR_NOMEM, "report: out of memory");
    pref_keys(j, m);
    json_object_set_new(j, "time", json_real(t));
    int rc = put_line(r, j);
    if (!rc && r->tb && isfinite(m->loss)) rc = bt_tb_scalar(r->tb, "eval/loss", step, t, (float)m->loss);
    if (!rc && r->tb) rc = pref_tb(r, "eval/", step, t, m);
    return rc;
}

int bt_report_step(bt_report *r, const bt_step_metrics *m) {
    if (!r) return 0;
    double t = wall_now();
    double tps = m->step_s > 0 ? (double)m->tokens / m->step_s : 0;
    json_t *j = json_pack("{s:s, s:i, s:o, s:o, s:o, s:I, s:o, s:o, s:o, s:o}", "type", "train",
                          "step", m->step, "loss", num(m->loss), "lr", num(m->lr), "grad_norm",
                          num(m->grad_norm), "tokens", (json_int_t)m->tokens, "tokens_per_s",
                          num(tps), "step_s", num(m->step_s), "data_wait_s", num(m->data_wait_s),
                          "peak_rss_mib", num(m->peak_rss_mib));
    if (!j) return bt_fail(BT_ERR_NOMEM, "report: out of memory");
    if (m->device_mib >= 0) json_object_set_new(j, "device_mib", num(m->device_mib));
    if (m->pref) pref_keys(j, m->pref);
    json_object_set_new(j, "time", json_real(t));
    int rc = put_line(r, j);
    if (!rc && r->tb) {
        static const char *const tags[] = {"train/loss", "train/lr", "train/grad_norm",
                                           "train/tokens_per_s", "train/data_wait_s",
                                           "train/peak_rss_mib"};
        const double v[] = {m->loss, m->lr, m->grad_norm, tps, m->data_wait_s, m->peak_rss_mib};
        for (int i = 0; i < 6 && !rc; i++)
            if (isfinite(v[i])) rc = bt_tb_scalar(r->tb, tags[i], m->step, t, (float)v[i]);
        if (!rc && m->pref) rc = pref_tb(r, "train/", m->step, t, m->pref);
    }
    return rc;
}

int bt_report_eval(bt_report *r, int step, double loss, long long tokens) {
    if (!r) return 0;
    double t = wall_now();
    json_t *j = json_pack("{s:s, s:i, s:o, s:o, s:I, s:f}", "type", "eval", "step", step, "loss",
                          num(loss), "perplexity", num(exp(loss)), "tokens", (json_int_t)tokens,
                          "time", t);
    if (!j) return bt_fail(BT_ERR_NOMEM, "report: out of memory");
    int rc = put_line(r, j);
    if (!rc && r->tb && isfinite(loss)) {
        rc = bt_tb_scalar(r->tb, "eval/loss", step, t, (float)loss);
        if (!rc && isfinite(exp(loss))) rc = bt_tb_scalar(r->tb, "eval/perplexity", step, t, (float)exp(loss));
    }
    return rc;
}

void bt_report_close(bt_report *r, int plot) {
    if (!r) return;
    if (r->f) fclose(r->f);
    bt_tb_close(r->tb);
    if (plot) {
        int n = 0;
        if (bt_report_plot(r->dir, &n) == 0)
            bt_log(BT_LOG_INFO, "report", "plot of %d steps: %s/report.png", n, r->dir);
        else
            bt_log(BT_LOG_WARN, "report", "no plot: %s (the metrics are in %s)", bt_last_error(),
                   r->path);
    }
    free(r->path);
    free(r->dir);
    free(r);
}

/* ---- the plot ---- */

/* Runs `gnuplot script` and waits; BT_ERR_IO when it cannot start or fails. */
static int run_gnuplot(const char *script) {
    pid_t pid;
    char *argv[] = {"gnuplot", (char *)script, NULL};
    int err = posix_spawnp(&pid, "gnuplot", NULL, NULL, argv, environ);
    if (err)
        return bt_fail(BT_ERR_IO, "cannot run gnuplot (%s): install it with apt-get install "
                       "gnuplot-nox", strerror(err));
    int st;
    while (waitpid(pid, &st, 0) < 0)
        if (errno != EINTR) return bt_fail(BT_ERR_IO, "gnuplot: waitpid: %s", strerror(errno));
    if (!WIFEXITED(st) || WEXITSTATUS(st) != 0)
        return bt_fail(BT_ERR_IO, "gnuplot failed (status %d; see its message above)", st);
    return 0;
}

typedef struct {
    int n_train, n_eval, n_bad;
    int n_acc; /* lines with a preference objective's rewards/accuracies */
    double first_loss, last_loss, eval_first, eval_last, tps_sum;
    int eval_first_step, eval_last_step;
    int step_min, step_max;   /* over train and eval lines: the one x range of every panel */
    char title[512];          /* "run NAME, model MODEL" from the last run line; "" = none */
} summary_t;

/* The step range every panel shares. */
static void widen(summary_t *s, int step) {
    if (s->n_train + s->n_eval == 0 || step < s->step_min) s->step_min = step;
    if (s->n_train + s->n_eval == 0 || step > s->step_max) s->step_max = step;
}

/* metrics.jsonl -> train.dat (step loss lr tokens/s) and eval.dat (step loss). */
static int write_data(const char *dir, const char *tmp, summary_t *s) {
    char *mp = NULL, *tp = NULL, *ep = NULL;
    int rc = 0;
    if (asprintf(&mp, "%s/metrics.jsonl", dir) < 0 || asprintf(&tp, "%s.train.dat", tmp) < 0 ||
        asprintf(&ep, "%s.eval.dat", tmp) < 0)
        return bt_fail(BT_ERR_NOMEM, "report: out of memory");
    /* read as it is written: a regular file, line by line (never a FIFO, never whole) */
    int fd = open(mp, O_RDONLY | O_NONBLOCK | O_CLOEXEC);
    struct stat fst;
    FILE *in = NULL, *ft = NULL, *fe = NULL;
    if (fd < 0 || fstat(fd, &fst) != 0) {
        rc = bt_fail(BT_ERR_IO, "report: %s: %s", mp, strerror(errno));
    } else if (!S_ISREG(fst.st_mode)) {
        rc = bt_fail(BT_ERR_IO, "report: %s: not a regular file", mp);
    } else if (!(in = fdopen(fd, "rb"))) {
        rc = bt_fail(BT_ERR_IO, "report: %s: %s", mp, strerror(errno));
    }
    if (rc) {
        if (fd >= 0) close(fd);
        goto out;
    }
    ft = fopen(tp, "wb"), fe = fopen(ep, "wb");
    if (!ft || !fe) {
        rc = bt_fail(BT_ERR_IO, "report: create %s: %s", tp, strerror(errno));
        goto out;
    }
    char *line = malloc(METRICS_LINE_MAX);
    if (!line) {
        rc = bt_fail(BT_ERR_NOMEM, "report: out of memory");
        goto out;
    }
    memset(s, 0, sizeof *s);
    for (int got; (got = read_line_bounded(in, line)) != 0;) {
        if (got < 0) { /* longer than any line of ours */
            s->n_bad++;
            continue;
        }
        json_t *j = json_loads(line, 0, NULL);
        const char *type = json_string_value(json_object_get(j, "type"));
        json_t *step = json_object_get(j, "step"), *loss = json_object_get(j, "loss");
        if (!json_is_object(j) || !type || !json_is_integer(step)) {
            s->n_bad++;
        } else if (!strcmp(type, "run")) {
            const char *nm = json_string_value(json_object_get(j, "name"));
            const char *md = json_string_value(json_object_get(j, "model"));
            const char *slash = md ? strrchr(md, '/') : NULL;
            snprintf(s->title, sizeof s->title, "run %s, model %s", nm && *nm ? nm : "(unnamed)",
                     slash && slash[1] ? slash + 1 : md && *md ? md : "(unknown)");
        } else if (!strcmp(type, "train")) {
            widen(s, (int)json_integer_value(step));
            double l = json_is_number(loss) ? json_number_value(loss) : NAN;
            double lr = json_number_value(json_object_get(j, "lr"));
            double tps = json_number_value(json_object_get(j, "tokens_per_s"));
            json_t *acc = json_object_get(j, "rewards/accuracies");
            s->n_acc += json_is_number(acc);
            fprintf(ft, "%lld %.9g %.9g %.9g %.9g\n", (long long)json_integer_value(step),
                    isfinite(l) ? l : NAN, lr, tps, json_is_number(acc) ? json_number_value(acc) : NAN);
            if (isfinite(l)) {
                if (!s->n_train) s->first_loss = l;
                s->last_loss = l;
            }
            s->tps_sum += tps;
            s->n_train++;
        } else if (!strcmp(type, "eval") && json_is_number(loss)) {
            double l = json_number_value(loss);
            int st = (int)json_integer_value(step);
            widen(s, st);
            json_t *acc = json_object_get(j, "rewards/accuracies");
            s->n_acc += json_is_number(acc);
            fprintf(fe, "%d %.9g %.9g\n", st, l, json_is_number(acc) ? json_number_value(acc) : NAN);
            if (!s->n_eval) s->eval_first = l, s->eval_first_step = st;
            s->eval_last = l, s->eval_last_step = st;
            s->n_eval++;
        } else {
            s->n_bad++;
        }
        json_decref(j);
    }
    free(line);
    if (s->n_bad)
        bt_log(BT_LOG_WARN, "report", "%s: %d lines skipped (not a train or eval metrics object)",
               mp, s->n_bad);
    if (!s->n_train) rc = bt_fail(BT_ERR_INVALID, "report: %s has no train lines to plot", mp);
out:
    if (in) fclose(in);
    if (ft && fclose(ft) && !rc) rc = bt_fail(BT_ERR_IO, "report: write %s", tp);
    if (fe && fclose(fe) && !rc) rc = bt_fail(BT_ERR_IO, "report: write %s", ep);
    free(mp), free(tp), free(ep);
    return rc;
}

/* gnuplot string literal: single quotes, ' doubled. */
static void gp_str(FILE *f, const char *s) {
    fputc('\'', f);
    for (; *s; s++) {
        if (*s == '\'') fputc('\'', f);
        fputc(*s == '\n' ? ' ' : *s, f);
    }
    fputc('\'', f);
}

static int plot_with(const char *dir, summary_t *s) {
    memset(s, 0, sizeof *s);
    /* nothing to plot: say so first (nothing would be written) */
    char *mp = NULL;
    if (asprintf(&mp, "%s/metrics.jsonl", dir) < 0) return bt_fail(BT_ERR_NOMEM, "report: out of memory");
    struct stat mst;
    int rc = stat(mp, &mst) != 0 ? bt_fail(BT_ERR_IO, "report: %s: %s", mp, strerror(errno)) : 0;
    free(mp);
    /* report.png and the plot's temporaries go only into a report directory of ours
     * (common/out_dir.h; `trainer report DIR` names any directory) */
    if (!rc) rc = bt_out_dir_check(dir, &bt_out_report, "report");
    if (rc) return rc;
    char *tmp = NULL, *gp = NULL, *png = NULL, *out = NULL;
    if (asprintf(&tmp, "%s/.plot-%d", dir, (int)getpid()) < 0 || asprintf(&gp, "%s.gp", tmp) < 0 ||
        asprintf(&png, "%s.png", tmp) < 0 || asprintf(&out, "%s/report.png", dir) < 0)
        return bt_fail(BT_ERR_NOMEM, "report: out of memory");
    rc = write_data(dir, tmp, s);
    FILE *f = rc ? NULL : fopen(gp, "wb");
    if (!rc && !f) rc = bt_fail(BT_ERR_IO, "report: create %s: %s", gp, strerror(errno));
    if (f) {
        char dat[1024];
        fputs("set terminal pngcairo noenhanced size 1200,900 font 'sans,10'\nset output ", f);
        gp_str(f, png);
        fprintf(f, "\nset multiplot layout %d,1 title ", s->n_acc ? 4 : 3);
        gp_str(f, s->title[0] ? s->title : dir);
        /* one step axis: the same x range and the same margins in every panel, so that a step
         * lines up vertically across loss, learning rate and throughput */
        fprintf(f, "\nset xrange [%d:%d]\nset lmargin 12\nset rmargin 4\n", s->step_min,
                s->step_max > s->step_min ? s->step_max : s->step_min + 1);
        if (s->step_max - s->step_min <= 10) fputs("set xtics 1\n", f); /* whole steps */
        fputs("set grid\nset key top right\nset xlabel 'step'\nset ylabel 'loss'\n", f);
        snprintf(dat, sizeof dat, "%s.train.dat", tmp);
        fputs("plot ", f);
        gp_str(f, dat);
        fputs(" using 1:2 with lines lw 2 title 'train'", f);
        if (s->n_eval) {
            snprintf(dat, sizeof dat, "%s.eval.dat", tmp);
            fputs(", ", f);
            gp_str(f, dat);
            fputs(" using 1:2 with linespoints pt 7 ps 1.2 lw 2 title 'held-out'", f);
        }
        snprintf(dat, sizeof dat, "%s.train.dat", tmp);
        fputs("\nset ylabel 'learning rate'\nset format y '%.1e'\nplot ", f);
        gp_str(f, dat);
        fputs(" using 1:3 with lines lw 2 title 'lr'\nset format y '%g'\n"
              "set ylabel 'tokens/s'\nplot ", f);
        gp_str(f, dat);
        fputs(" using 1:4 with lines lw 2 title 'tokens/s'\n", f);
        if (s->n_acc) { /* a preference objective: TRL's rewards/accuracies, train and held-out */
            fputs("set ylabel 'rewards/accuracies'\nset yrange [0:1.05]\nplot ", f);
            gp_str(f, dat);
            fputs(" using 1:5 with lines lw 2 title 'train'", f);
            if (s->n_eval) {
                snprintf(dat, sizeof dat, "%s.eval.dat", tmp);
                fputs(", ", f);
                gp_str(f, dat);
                fputs(" using 1:3 with linespoints pt 7 ps 1.2 lw 2 title 'held-out'", f);
            }
            fputs("\n", f);
        }
        fputs("unset multiplot\n", f);
        if (fclose(f)) rc = bt_fail(BT_ERR_IO, "report: write %s", gp);
        if (!rc) rc = run_gnuplot(gp);
        if (!rc && rename(png, out) != 0)
            rc = bt_fail(BT_ERR_IO, "report: rename %s -> %s: %s", png, out, strerror(errno));
    }
    char *rm[4] = {gp, png, NULL, NULL};
    if (asprintf(&rm[2], "%s.train.dat", tmp) < 0) rm[2] = NULL;
    if (asprintf(&rm[3], "%s.eval.dat", tmp) < 0) rm[3] = NULL;
    for (int i = 0; i < 4; i++)
        if (rm[i]) unlink(rm[i]);
    free(rm[2]), free(rm[3]);
    free(tmp), free(gp), free(png), free(out);
    return rc;
}

int bt_report_plot(const char *dir, int *n_steps) {
    summary_t s;
    int rc = plot_with(dir, &s);
    if (n_steps) *n_steps = rc ? 0 : s.n_train;
    return rc;
}

int bt_report_cli(int argc, char **argv) {
    if (argc != 2 || argv[1][0] == '-') {
        int help = argc == 2 && (!strcmp(argv[1], "--help") || !strcmp(argv[1], "-h"));
        fprintf(help ? stdout : stderr,
                "usage: trainer report RUN_DIR\n"
                "Draws RUN_DIR/report.png (loss: train and held-out, learning rate, tokens/s\n"
                "against step; gnuplot) from RUN_DIR/metrics.jsonl, which every run writes to its\n"
                "report.dir (default: \"report\" beside out_dir), and prints a summary.\n");
        return help ? 0 : 2;
    }
    summary_t s;
    if (plot_with(argv[1], &s) != 0) {
        fprintf(stderr, "trainer report: %s\n", bt_last_error());
        return 1;
    }
    printf("%s/report.png: %d steps, loss %.4f -> %.4f, mean %.0f tokens/s", argv[1], s.n_train,
           s.first_loss, s.last_loss, s.tps_sum / s.n_train);
    if (s.n_eval > 1)
        printf(", held-out loss %.4f (step %d) -> %.4f (step %d)", s.eval_first, s.eval_first_step,
               s.eval_last, s.eval_last_step);
    else if (s.n_eval == 1)
        printf(", held-out loss %.4f (step %d)", s.eval_first, s.eval_first_step);
    printf("\n");
    return 0;
}
