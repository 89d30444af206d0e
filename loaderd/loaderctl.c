/* loaderctl: operator client of loaderd's control socket (protocol: proto/PROTOCOL.md).
 *   loaderctl [--socket PATH | --config FILE] status|jobs|metrics|drain|reload|watch|hello [--json]
 *             [--interval S]
 *   loaderctl preview --job JOB.json [--rows N] [--color|--no-color]
 *   loaderctl tokenize --tokenizer PATH [--ids] [--no-special]
 * Default socket: $LOADERD_SOCKET, else /run/loaderd/loaderd.sock; --config FILE takes the "socket"
 * of loaderd's configuration file instead (the default when FILE does not say or does not parse:
 * loaderd itself then says what is wrong with it). `reload` asks loaderd to re-read its
 * configuration (as SIGHUP does; operators only) and exits 1 when loaderd refuses the new one and
 * keeps the running one: the unit's ExecReload=, so `systemctl reload loaderd` reports it. Human tables by default;
 * --json prints loaderd's raw reply line. `watch` redraws the status table in place every
 * --interval seconds (default 2) until Ctrl-C.
 * `preview` needs no daemon: it runs the job's pipeline in this process (ld_job_spec_parse,
 * ld_pipeline_new/next with the job's tokenizer, rank 0 of 1) and prints the first N rows
 * (default 4) decoded: loss-carrying spans in reverse green on a terminal or between [[ ]]
 * otherwise, each packed document opened by a |doc K| marker, the row's padding as |pad N|,
 * newlines shown as a visible return sign, control bytes escaped; then per-row and total stats.
 * `tokenize` reads UTF-8 text lines on stdin and prints, per line, the token ids (--ids) or the
 * vocabulary pieces (GPT-2 byte alphabet, as HF tokenize() shows them), space-separated;
 * control-token strings such as <|im_start|> are parsed unless --no-special.
 * Exit: 0 ok, 1 loaderd unreachable / refused or a preview/tokenize error, 2 usage. Options are
 * read with getopt_long (in any order around the command; --opt=value also works). */
#include <errno.h>
#include <getopt.h>
#include <jansson.h>
#include <math.h>
#include <poll.h>
#include <signal.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/socket.h>
#include <sys/un.h>
#include <time.h>
#include <unistd.h>

#include "common/bt_common.h"
#include "common/bt_json.h"
#include "common/tokenizer.h"
#include "loaderd/pipeline.h"
#include "proto/batch.h"
#include "proto/client.h"

#define MAX_REPLY (64u << 20)
#define TIMEOUT_MS 10000

static volatile sig_atomic_t g_stop;
static void on_sigint(int sig) { g_stop = 1; }

/* Connect, send {"v":1,"op":op}, read one reply line (malloc'd, NUL-terminated) into *out.
 * 0 on success, -1 with a message on stderr. */
static int request(const char *path, const char *op, char **out) {
    *out = NULL;
    struct sockaddr_un sa = {.sun_family = AF_UNIX};
    if (strlen(path) >= sizeof sa.sun_path) {
        fprintf(stderr, "loaderctl: socket path too long: %s\n", path);
        return -1;
    }
    strcpy(sa.sun_path, path);
    int fd = socket(AF_UNIX, SOCK_STREAM | SOCK_CLOEXEC, 0);
    if (fd < 0 || connect(fd, (struct sockaddr *)&sa, sizeof sa) != 0) {
        fprintf(stderr, "loaderctl: cannot connect to %s: %s (is loaderd running? set --socket or $LOADERD_SOCKET)\n",
                path, strerror(errno));
        if (fd >= 0) close(fd);
        return -1;
    }
    char req[128];
    int n = snprintf(req, sizeof req, "{\"v\":%d,\"op\":\"%s\"}\n", BT_PROTO_VERSION, op);
    int send_err = 0;
    for (int off = 0; off < n;) {
        ssize_t w = send(fd, req + off, (size_t)(n - off), MSG_NOSIGNAL);
        if (w < 0 && errno == EINTR) continue;
        if (w < 0) { /* refused at accept and closed: the reason is queued for us, read it below */
            send_err = errno;
            break;
        }
        off += (int)w;
    }
    size_t cap = 65536, len = 0;
    char *buf = malloc(cap);
    int rc = -1;
    while (buf) {
        struct pollfd p = {.fd = fd, .events = POLLIN};
        int pr = poll(&p, 1, TIMEOUT_MS);
        if (pr < 0 && errno == EINTR) {
            if (g_stop) break;
            continue;
        }
        if (pr <= 0) {
            if (send_err) fprintf(stderr, "loaderctl: send: %s\n", strerror(send_err));
            else fprintf(stderr, "loaderctl: no reply from loaderd within %d s\n", TIMEOUT_MS / 1000);
            break;
        }
        if (cap - len < 4096) {
            if (cap >= MAX_REPLY) {
                fprintf(stderr, "loaderctl: reply larger than %u bytes\n", MAX_REPLY);
                break;
            }
            char *nb = realloc(buf, cap *= 2);
            if (!nb) break;
            buf = nb;
        }
        ssize_t r = recv(fd, buf + len, cap - len - 1, 0);
        if (r < 0 && errno == EINTR) continue;
        if (r <= 0) {
            if (send_err) fprintf(stderr, "loaderctl: send: %s\n", strerror(send_err));
            else fprintf(stderr, "loaderctl: loaderd closed the connection without a reply\n");
            break;
        }
        char *nl = memchr(buf + len, '\n', (size_t)r);
        len += (size_t)r;
        if (nl) {
            *nl = 0;
            rc = 0;
            break;
        }
    }
    close(fd);
    if (rc) free(buf);
    else *out = buf;
    return rc;
}

static double num(json_t *o, const char *k) {
    json_t *v = json_object_get(o, k);
    return json_is_number(v) ? json_number_value(v) : NAN;
}

/* A string of the reply, for the terminal: control characters made visible (bt_escape_text),
 * so nothing a client or a file name put there can forge lines or drive the terminal. Valid
 * until 16 more calls (a ring of buffers: one printf uses several). */
static const char *str(json_t *o, const char *k) {
    static char ring[16][2048];
    static unsigned next;
    const char *s = json_string_value(json_object_get(o, k));
    if (!s) return "-";
    char *b = ring[next++ % 16];
    bt_escape_text(b, sizeof ring[0], s, json_string_length(json_object_get(o, k)));
    return b;
}

/* Text of several lines (the metrics exposition): each line escaped as str() does. */
static void put_lines(const char *s, FILE *f) {
    static char b[8192];
    while (*s) {
        const char *nl = strchr(s, '\n');
        size_t n = nl ? (size_t)(nl - s) : strlen(s);
        bt_escape_text(b, sizeof b, s, n);
        fputs(b, f);
        if (!nl) break;
        fputc('\n', f);
        s = nl + 1;
    }
}

static void fmt_rate(char *b, size_t n, double x) {
    if (!isfinite(x)) snprintf(b, n, "-");
    else if (x >= 1e6) snprintf(b, n, "%.2fM", x / 1e6);
    else if (x >= 1e4) snprintf(b, n, "%.1fk", x / 1e3);
    else snprintf(b, n, "%.1f", x);
}

static void fmt_uptime(char *b, size_t n, double s) {
    long t = isfinite(s) ? (long)s : 0;
    if (t >= 86400) snprintf(b, n, "%ldd%02ldh%02ldm", t / 86400, t % 86400 / 3600, t % 3600 / 60);
    else if (t >= 3600) snprintf(b, n, "%ldh%02ldm%02lds", t / 3600, t % 3600 / 60, t % 60);
    else snprintf(b, n, "%ldm%02lds", t / 60, t % 60);
}

static FILE *g_out; /* where replies are rendered: stdout, or a frame buffer in `watch` */

/* The ranks of each data-parallel run (world size > 1) attached here, in rank order: step, loss,
 * tokens/s, ring fill, age of the last report, and a mark on a rank that falls behind (loaderd's
 * "behind", server_priv.h ld_rank_behind). A run is its jobs' "run" (else name + world + uid). */
static void run_key(json_t *j, char *k, size_t n) {
    if (json_is_string(json_object_get(j, "run")))
        snprintf(k, n, "%s/%s", str(j, "run"), str(j, "name"));
    else
        snprintf(k, n, "%s/%.0f/%.0f", str(j, "name"), num(j, "world_size"), num(json_object_get(j, "peer"), "uid"));
}

static void print_runs(json_t *jobs) {
    size_t n = json_array_size(jobs);
    char *done = calloc(n ? n : 1, 1);
    if (!done) return;
    for (size_t a = 0; a < n; a++) {
        json_t *ja = json_array_get(jobs, a);
        if (done[a] || num(ja, "world_size") < 2) continue;
        char ka[256], kb[256];
        run_key(ja, ka, sizeof ka);
        size_t here = 0;
        for (size_t b = a; b < n; b++) {
            run_key(json_array_get(jobs, b), kb, sizeof kb);
            here += !strcmp(ka, kb);
        }
        json_t *run = json_object_get(ja, "run");
        fprintf(g_out, "\nrun %s \"%s\": %zu of %.0f ranks on this node\n", json_is_string(run) ? str(ja, "run") : "-",
                str(ja, "name"), here, num(ja, "world_size"));
        fprintf(g_out, "  %-7s %8s %8s %9s %7s %12s\n", "RANK", "STEP", "LOSS", "TOK/S", "RING", "LAST REPORT");
        for (double want = 0; want < num(ja, "world_size"); want++) /* rank order */
            for (size_t b = a; b < n; b++) {
                json_t *j = json_array_get(jobs, b);
                run_key(j, kb, sizeof kb);
                if (done[b] || strcmp(ka, kb) || num(j, "rank") != want) continue;
                done[b] = 1;
                json_t *t = json_object_get(j, "trainer");
                char rank[24], ring[24], step[24] = "-", loss[24] = "-", tps[16], age[24] = "none";
                snprintf(rank, sizeof rank, "%.0f/%.0f", num(j, "rank"), num(j, "world_size"));
                snprintf(ring, sizeof ring, "%.0f/%.0f", num(j, "ring_fill"), num(j, "ring_slots"));
                fmt_rate(tps, sizeof tps, json_is_object(t) ? num(t, "tokens_per_s") : NAN);
                if (json_is_object(t)) {
                    snprintf(step, sizeof step, "%.0f", num(t, "step"));
                    if (isfinite(num(t, "loss"))) snprintf(loss, sizeof loss, "%.4f", num(t, "loss"));
                    snprintf(age, sizeof age, "%.1fs ago", num(t, "age_s"));
                }
                fprintf(g_out, "  %-7s %8s %8s %9s %7s %12s", rank, step, loss, tps, ring, age);
                if (json_is_true(json_object_get(j, "behind")))
                    fprintf(g_out, "  << BEHIND: %s", str(j, "behind_reason"));
                fputc('\n', g_out);
            }
    }
    free(done);
}

static void print_status(json_t *r) {
    char up[32];
    fmt_uptime(up, sizeof up, num(r, "uptime_s"));
    json_t *jobs = json_object_get(r, "jobs");
    fprintf(g_out, "loaderd pid %.0f on %s, up %s, %.0f client(s), %zu job(s)%s\n", num(r, "pid"), str(r, "socket"), up,
           num(r, "clients"), json_array_size(jobs), json_is_true(json_object_get(r, "draining")) ? ", DRAINING" : "");
    json_t *tc = json_object_get(r, "token_cache");
    if (json_is_object(tc))
        fprintf(g_out, "token cache %s: %.1f of %.1f MiB, %.0f shard(s) tokenized here, %.0f hit(s), %.0f wait(s), "
                "%.0f damaged, %.0f stale, %.0f bypassed (%.0f untrusted), %.0f evicted, %.0f stale temporary "
                "file(s) removed; %.0f stream(s)\n", str(tc, "dir"),
                num(tc, "bytes") / 1048576.0, num(tc, "max_bytes") / 1048576.0, num(tc, "built"), num(tc, "hits"),
                num(tc, "waited"), num(tc, "damaged"), num(tc, "stale"), num(tc, "bypassed"), num(tc, "untrusted"),
                num(tc, "evicted"), num(tc, "temps_removed"), num(r, "streams"));
    if (json_is_object(tc) && num(tc, "ref_tables") > 0) /* reference log-probs (loaderd/refstore.h) */
        fprintf(g_out, "reference log-probs: %.0f table(s), %.0f file(s) read, %.0f written, %.0f refused; %.0f value(s) "
                "put and kept, %.0f refused; %.0f segment(s) served, %.0f without a value\n", num(tc, "ref_tables"),
                num(tc, "ref_loaded"), num(tc, "ref_written"), num(tc, "ref_refused"), num(tc, "ref_accepted"),
                num(tc, "ref_rejected"), num(tc, "ref_served"), num(tc, "ref_missed"));
    double mb = num(r, "memory_budget_bytes"), mu = num(r, "memory_used_bytes"), mt = num(r, "tokenizer_memory_bytes");
    if (isfinite(mb) && mb > 0)
        fprintf(g_out, "memory: %.1f MiB of %.1f MiB budget in use (%.1f%%; rings + pipeline buffers, and %.1f MiB of "
                "tokenizers)\n", mu / 1048576.0, mb / 1048576.0, 100.0 * mu / mb, isfinite(mt) ? mt / 1048576.0 : 0.0);
    if (json_array_size(jobs) == 0) {
        fprintf(g_out, "no jobs attached\n");
        return;
    }
    fprintf(g_out, "%-4s %-20s %-7s %-8s %9s %9s %6s %7s %8s %5s %6s %6s %8s %8s %9s\n", "JOB", "NAME", "RANK", "STATE",
            "DOCS/S", "TOKENS/S", "PACK%", "RING", "BATCHES", "LAG", "IDLE", "BAD", "STEP", "LOSS", "TRN TOK/S");
    size_t i;
    json_t *j;
    json_array_foreach(jobs, i, j) {
        char rank[24], ring[24], dr[16], tr[16], ttr[16], step[24] = "-", loss[24] = "-";
        snprintf(rank, sizeof rank, "%.0f/%.0f", num(j, "rank"), num(j, "world_size"));
        snprintf(ring, sizeof ring, "%.0f/%.0f", num(j, "ring_fill"), num(j, "ring_slots"));
        fmt_rate(dr, sizeof dr, num(j, "docs_per_s"));
        fmt_rate(tr, sizeof tr, num(j, "tokens_per_s"));
        json_t *t = json_object_get(j, "trainer");
        fmt_rate(ttr, sizeof ttr, json_is_object(t) ? num(t, "tokens_per_s") : NAN);
        if (json_is_object(t)) {
            snprintf(step, sizeof step, "%.0f", num(t, "step"));
            if (isfinite(num(t, "loss"))) snprintf(loss, sizeof loss, "%.4f", num(t, "loss"));
        }
        char idle[16];
        snprintf(idle, sizeof idle, "%.1fs", num(j, "consumer_idle_s"));
        fprintf(g_out, "%-4.0f %-20.20s %-7s %-8s %9s %9s %5.1f%% %7s %8.0f %5.0f %6s %6.0f %8s %8s %9s\n",
                num(j, "job_id"), str(j, "name"), rank, str(j, "state"), dr, tr, 100.0 * num(j, "packing_efficiency"),
                ring, num(j, "batches"), num(j, "consumer_lag_batches"), idle, num(j, "bad_lines_total"), step, loss,
                ttr);
    }
    /* bad lines by reason, and errors, one line per job that has any */
    json_array_foreach(jobs, i, j) {
        json_t *bad = json_object_get(j, "bad_lines");
        const char *k;
        json_t *v;
        int any = 0;
        json_object_foreach(bad, k, v) {
            if (json_integer_value(v) == 0) continue;
            if (!any) fprintf(g_out, "job %.0f bad lines:", num(j, "job_id"));
            char kb[128];
            bt_escape_text(kb, sizeof kb, k, strlen(k));
            fprintf(g_out, " %s=%lld", kb, (long long)json_integer_value(v));
            any = 1;
        }
        if (any) fprintf(g_out, "\n");
        if (json_object_get(j, "error")) fprintf(g_out, "job %.0f error: %s\n", num(j, "job_id"), str(j, "error"));
        json_t *t = json_object_get(j, "trainer"), *b = json_is_object(t) ? json_object_get(t, "base") : NULL;
        if (json_is_object(b))
            fprintf(g_out, "job %.0f base: %s %s, %.2f bits per weight, %.1f MiB of linears\n", num(j, "job_id"),
                    str(b, "dtype"), str(b, "types"), num(b, "bits_per_weight"), num(b, "bytes") / 1048576.0);
    }
    print_runs(jobs);
}

static void print_jobs(json_t *r) {
    json_t *jobs = json_object_get(r, "jobs");
    if (json_array_size(jobs) == 0) {
        fprintf(g_out, "no jobs attached\n");
        return;
    }
    fprintf(g_out, "%-4s %-24s %-7s %-8s %8s %8s\n", "JOB", "NAME", "RANK", "STATE", "BATCHES", "PID");
    size_t i;
    json_t *j;
    json_array_foreach(jobs, i, j) {
        char rank[24];
        snprintf(rank, sizeof rank, "%.0f/%.0f", num(j, "rank"), num(j, "world_size"));
        fprintf(g_out, "%-4.0f %-24.24s %-7s %-8s %8.0f %8.0f\n", num(j, "job_id"), str(j, "name"), rank, str(j, "state"),
               num(j, "batches"), num(j, "peer_pid"));
    }
}

/* Run one command; 0 ok, 1 failure. */
static int run_once(const char *sock, const char *cmd, int as_json) {
    const char *op = !strcmp(cmd, "watch") ? "status" : cmd;
    char *line = NULL;
    if (request(sock, op, &line)) return 1;
    json_error_t e;
    json_t *r = json_loads(line, 0, &e);
    if (!r || !json_is_object(r)) {
        fprintf(stderr, "loaderctl: unreadable reply from loaderd: %s\n", e.text);
        json_decref(r);
        free(line);
        return 1;
    }
    int rc = 0;
    /* --json: the reply re-encoded with every non-ASCII character escaped (\u001b, not ESC) */
    char *js = as_json ? json_dumps(r, JSON_COMPACT | JSON_ENSURE_ASCII) : NULL;
    if (!json_is_true(json_object_get(r, "ok"))) {
        if (as_json) fprintf(g_out, "%s\n", js ? js : "{}");
        fprintf(stderr, "loaderctl: loaderd refused %s: %s\n", op, str(r, "error"));
        rc = 1;
    } else if (as_json) {
        fprintf(g_out, "%s\n", js ? js : "{}");
    } else if (!strcmp(op, "status")) {
        print_status(r);
    } else if (!strcmp(op, "jobs")) {
        print_jobs(r);
    } else if (!strcmp(op, "metrics")) {
        const char *t = json_string_value(json_object_get(r, "text"));
        put_lines(t ? t : "", g_out);
    } else if (!strcmp(op, "hello")) {
        fprintf(g_out, "loaderd pid %.0f speaks protocol %.0f (ring v%.0f, batch layout v%.0f); you are uid %.0f gid %.0f\n",
                num(r, "pid"), num(r, "proto"), num(r, "ring_version"), num(r, "batch_layout_version"), num(r, "uid"),
                num(r, "gid"));
    } else if (!strcmp(op, "drain")) {
        fprintf(g_out, "loaderd is draining: %.0f job(s) left; it exits when they detach\n", num(r, "jobs"));
    } else if (!strcmp(op, "reload")) {
        fprintf(g_out, "loaderd reloaded %s: %.0f setting(s) changed\n", str(r, "config"), num(r, "changed"));
    }
    fflush(g_out);
    free(js);
    json_decref(r);
    free(line);
    return rc;
}

static void usage(FILE *f) {
    fprintf(f, "usage: loaderctl [--socket PATH | --config FILE] status|jobs|metrics|drain|reload|watch|hello [--json]\n"
               "                 [--interval S]\n"
               "       loaderctl preview --job JOB.json [--rows N] [--color|--no-color]\n"
               "       loaderctl tokenize --tokenizer PATH [--ids] [--no-special]   (text lines on stdin)\n"
               "  default socket: $LOADERD_SOCKET or %s\n", BT_DEFAULT_SOCKET);
}

/* ------------------------------------------------------------------ preview */

/* Print decoded bytes for a terminal or a file: newline as a visible return sign plus a real
 * newline, tab kept, other control bytes (ESC included: nothing in the data may drive the
 * terminal) as \xNN. */
static void put_text(const char *p, size_t n) {
    for (size_t i = 0; i < n; i++) {
        unsigned char ch = (unsigned char)p[i];
        if (ch == '\n') fputs("\u21b5\n", stdout);
        else if (ch == '\t') putchar('\t');
        else if (ch < 0x20 || ch == 0x7f) printf("\\x%02x", ch);
        else putchar(ch);
    }
}

/* Decode ids[0..n) (keep special tokens) and print them, marked as loss when `loss`. */
static int put_run(const bt_tokenizer *tok, const int32_t *ids, size_t n, int loss, int color) {
    char *text = NULL;
    size_t len = 0;
    if (bt_detokenize(tok, ids, n, 1, &text, &len)) return -1;
    if (loss) fputs(color ? "\033[7;32m" : "[[", stdout);
    put_text(text, len);
    if (loss) fputs(color ? "\033[0m" : "]]", stdout);
    free(text);
    return 0;
}

typedef struct {
    uint64_t rows, docs, real, labelled, pad;
} preview_totals;

/* Print row r of batch v. Segments come from cu_seqlens; the row's last segment is padding when
 * every id is the pad id and no label is set (a document always has a label after its first
 * token, so it can never look like that). */
static int preview_row(const bt_tokenizer *tok, const bt_batch_view *v, uint32_t r, int32_t pad_id, int color,
                       uint64_t *doc_no, preview_totals *tot) {
    uint32_t T = v->hdr->T, lo = r * T, hi = lo + T;
    uint32_t docs = 0, real = 0, lab = 0, pad = 0;
    printf("--- batch %llu row %u ---\n", (unsigned long long)v->hdr->step, r);
    for (uint32_t k = 0; k + 1 < v->hdr->n_cu; k++) {
        uint32_t a = (uint32_t)v->cu_seqlens[k], b = (uint32_t)v->cu_seqlens[k + 1];
        if (a < lo || b > hi || a >= b) continue;
        int is_pad = b == hi;
        for (uint32_t t = a; t < b && is_pad; t++) is_pad = v->input_ids[t] == pad_id && v->labels[t] == BT_LABEL_IGNORE;
        if (is_pad) {
            pad += b - a;
            printf("%s|pad %u|%s", color ? "\033[2m" : "", b - a, color ? "\033[0m" : "");
            continue;
        }
        docs++;
        real += b - a;
        printf("%s|doc %llu|%s", color ? "\033[1;36m" : "", (unsigned long long)++*doc_no, color ? "\033[0m" : "");
        for (uint32_t t = a; t < b;) { /* runs of equal loss state */
            int loss = v->labels[t] != BT_LABEL_IGNORE;
            uint32_t e = t;
            while (e < b && (v->labels[e] != BT_LABEL_IGNORE) == loss) e++;
            if (loss) lab += e - t;
            if (put_run(tok, v->input_ids + t, e - t, loss, color)) return -1;
            t = e;
        }
    }
    printf("\n--- row stats: %u doc(s), %u real token(s), %u labelled (%.1f%% of real), %u padding (packing %.1f%%)\n",
           docs, real, lab, real ? 100.0 * lab / real : 0.0, pad, 100.0 * real / T);
    tot->rows++;
    tot->docs += docs;
    tot->real += real;
    tot->labelled += lab;
    tot->pad += pad;
    return 0;
}

static int cmd_preview(const char *job_path, long rows, int color) {
    char *text = NULL;
    if (bt_read_file(job_path, 4u << 20, &text, NULL)) {
        fprintf(stderr, "loaderctl preview: cannot read %s\n", bt_last_error());
        return 1;
    }
    ld_job_spec spec;
    int rc = ld_job_spec_parse(&spec, text, NULL);
    free(text);
    if (rc) {
        fprintf(stderr, "loaderctl preview: %s: %s\n", job_path, bt_last_error());
        return 1;
    }
    if (spec.n_threads > 4) spec.n_threads = 4;
    bt_tokenizer *tok = NULL;
    if (bt_tokenizer_load(&tok, spec.tokenizer)) {
        fprintf(stderr, "loaderctl preview: tokenizer %s: %s\n", spec.tokenizer, bt_last_error());
        ld_job_spec_free(&spec);
        return 1;
    }
    int32_t pad_id = bt_tokenizer_pad(tok); /* the pipeline's choice: pad, else eos, else 0 */
    if (pad_id < 0) pad_id = bt_tokenizer_eos(tok);
    if (pad_id < 0) pad_id = 0;
    static ld_stats stats; /* zero-initialised atomics */
    ld_pipeline *p = NULL;
    uint8_t *slot = NULL;
    int status = 0;
    if (ld_pipeline_new(&p, &spec, tok, NULL, &stats)) {
        fprintf(stderr, "loaderctl preview: %s\n", bt_last_error());
        status = 1;
        goto out;
    }
    slot = bt_aligned_alloc(bt_batch_slot_bytes(spec.B, spec.T));
    bt_batch_view v;
    bt_batch_view_init(&v, slot, spec.B, spec.T);
    printf("preview of %s: job \"%s\", B=%u T=%u, tokenizer %s (vocab %d); loss spans %s\n", job_path, spec.name,
           spec.B, spec.T, spec.tokenizer, bt_tokenizer_vocab_size(tok), color ? "highlighted" : "between double brackets");
    preview_totals tot = {0};
    uint64_t doc_no = 0;
    int ended = 0;
    while ((long)tot.rows < rows && !ended) {
        rc = ld_pipeline_next(p, &v, 0);
        if (rc < 0) {
            fprintf(stderr, "loaderctl preview: pipeline: %s\n", bt_last_error());
            status = 1;
            break;
        }
        if (rc == 1) {
            ended = 1;
            break;
        }
        for (uint32_t r = 0; r < spec.B && (long)tot.rows < rows; r++)
            if (preview_row(tok, &v, r, pad_id, color, &doc_no, &tot)) {
                fprintf(stderr, "loaderctl preview: decoding: %s\n", bt_last_error());
                status = 1;
                goto out;
            }
    }
    uint64_t bad = 0;
    for (int i = 0; i < LD_BAD_N; i++) bad += atomic_load(&stats.bad[i]);
    printf("=== %llu row(s), %llu doc(s), %llu real token(s), %llu labelled (%.1f%%), %llu padding, packing "
           "%.1f%%%s; lines read %llu, bad lines %llu",
           (unsigned long long)tot.rows, (unsigned long long)tot.docs, (unsigned long long)tot.real,
           (unsigned long long)tot.labelled, tot.real ? 100.0 * (double)tot.labelled / (double)tot.real : 0.0,
           (unsigned long long)tot.pad, tot.rows ? 100.0 * (double)tot.real / ((double)tot.rows * spec.T) : 0.0,
           ended ? ", end of data" : "", (unsigned long long)atomic_load(&stats.lines), (unsigned long long)bad);
    for (int i = 0; i < LD_BAD_N; i++)
        if (atomic_load(&stats.bad[i]))
            printf(" %s=%llu", ld_bad_reason_name(i), (unsigned long long)atomic_load(&stats.bad[i]));
    printf("\n");
out:
    free(slot);
    ld_pipeline_free(p);
    bt_tokenizer_free(tok);
    ld_job_spec_free(&spec);
    return status;
}

/* ------------------------------------------------------------------ tokenize */

static int cmd_tokenize(const char *tok_path, int ids_only, int parse_special) {
    bt_tokenizer *tok = NULL;
    if (bt_tokenizer_load(&tok, tok_path)) {
        fprintf(stderr, "loaderctl tokenize: %s: %s\n", tok_path, bt_last_error());
        return 1;
    }
    char *line = NULL;
    size_t cap = 0;
    ssize_t n;
    int status = 0;
    bt_ids ids = {0};
    while ((n = getline(&line, &cap, stdin)) >= 0) {
        if (n > 0 && line[n - 1] == '\n') n--;
        if (n > 0 && line[n - 1] == '\r') n--;
        ids.n = 0;
        if (bt_tokenize(tok, line, (size_t)n, parse_special, &ids)) {
            fprintf(stderr, "loaderctl tokenize: %s\n", bt_last_error());
            status = 1;
            break;
        }
        for (size_t i = 0; i < ids.n; i++) {
            if (i) putchar(' ');
            if (ids_only) printf("%d", ids.v[i]);
            else fputs(bt_tokenizer_piece(tok, ids.v[i]) ? bt_tokenizer_piece(tok, ids.v[i]) : "?", stdout);
        }
        putchar('\n');
    }
    fflush(stdout);
    bt_ids_free(&ids);
    free(line);
    bt_tokenizer_free(tok);
    return status;
}

/* The "socket" of loaderd's configuration file `path` (a copy in buf), else BT_DEFAULT_SOCKET with a
 * note on stderr: a file that is unreadable or broken still leads to the default socket, where a
 * running loaderd refuses the file with its own reason (`loaderctl --config F reload`). */
static const char *socket_of_config(const char *path, char *buf, size_t cap) {
    json_t *root = NULL;
    const char *s = NULL;
    if (bt_json_load_file(&root, path, 0, 1u << 20) == 0 && json_is_object(root))
        s = json_string_value(json_object_get(root, "socket"));
    else if (!root)
        fprintf(stderr, "loaderctl: %s: %s; trying the default socket %s\n", path, bt_last_error(), BT_DEFAULT_SOCKET);
    if (s && strlen(s) < cap) snprintf(buf, cap, "%s", s);
    else snprintf(buf, cap, "%s", BT_DEFAULT_SOCKET);
    json_decref(root);
    return buf;
}

static int is_cmd(const char *a) {
    static const char *cmds[] = {"status", "jobs", "metrics", "drain", "reload", "watch", "hello", "preview", "tokenize"};
    for (size_t i = 0; i < sizeof cmds / sizeof cmds[0]; i++)
        if (!strcmp(a, cmds[i])) return 1;
    return 0;
}

int main(int argc, char **argv) {
    const char *sock = getenv("LOADERD_SOCKET");
    if (!sock || !*sock) sock = BT_DEFAULT_SOCKET;
    const char *cmd = NULL, *job = NULL, *tokp = NULL;
    int as_json = 0, ids_only = 0, parse_special = 1, color = -1;
    long rows = 4;
    double interval = 2.0;
    char conf_sock[4096];
    enum { O_SOCKET = 256, O_CONFIG, O_JSON, O_JOB, O_TOKENIZER, O_IDS, O_NO_SPECIAL, O_COLOR, O_NO_COLOR, O_ROWS,
           O_INTERVAL };
    static const struct option longopts[] = {
        {"socket", required_argument, NULL, O_SOCKET},
        {"config", required_argument, NULL, O_CONFIG},
        {"json", no_argument, NULL, O_JSON},
        {"job", required_argument, NULL, O_JOB},
        {"tokenizer", required_argument, NULL, O_TOKENIZER},
        {"ids", no_argument, NULL, O_IDS},
        {"no-special", no_argument, NULL, O_NO_SPECIAL},
        {"color", no_argument, NULL, O_COLOR},
        {"no-color", no_argument, NULL, O_NO_COLOR},
        {"rows", required_argument, NULL, O_ROWS},
        {"interval", required_argument, NULL, O_INTERVAL},
        {"help", no_argument, NULL, 'h'},
        {NULL, 0, NULL, 0},
    };
    int opt;
    char *end;
    opterr = 0; /* our own messages below */
    /* "-": the command (not an option) comes back in order, as 1 */
    while ((opt = getopt_long(argc, argv, "-:h", longopts, NULL)) != -1) {
        switch (opt) {
        case O_SOCKET: sock = optarg; break;
        case O_CONFIG: sock = socket_of_config(optarg, conf_sock, sizeof conf_sock); break;
        case O_JSON: as_json = 1; break;
        case O_JOB: job = optarg; break;
        case O_TOKENIZER: tokp = optarg; break;
        case O_IDS: ids_only = 1; break;
        case O_NO_SPECIAL: parse_special = 0; break;
        case O_COLOR: color = 1; break;
        case O_NO_COLOR: color = 0; break;
        case O_ROWS:
            rows = strtol(optarg, &end, 10);
            if (*end || rows < 1 || rows > 1000000) {
                fprintf(stderr, "loaderctl: --rows wants an integer in [1, 1000000]\n");
                return 2;
            }
            break;
        case O_INTERVAL:
            interval = strtod(optarg, &end);
            if (*end || !(interval >= 0.1 && interval <= 3600)) {
                fprintf(stderr, "loaderctl: --interval wants seconds in [0.1, 3600]\n");
                return 2;
            }
            break;
        case 'h': usage(stdout); return 0;
        case 1:
            if (!cmd && is_cmd(optarg)) {
                cmd = optarg;
                break;
            }
            __attribute__((fallthrough)); /* a second command, or not a command */
        default: /* '?': unknown option; ':': its argument is missing */
            fprintf(stderr, "loaderctl: unknown or incomplete argument '%s'\n", opt == 1 ? optarg : argv[optind - 1]);
            usage(stderr);
            return 2;
        }
    }
    if (!cmd) {
        usage(stderr);
        return 2;
    }
    signal(SIGPIPE, SIG_IGN);
    g_out = stdout;
    if (!strcmp(cmd, "preview")) {
        if (!job) {
            fprintf(stderr, "loaderctl preview: --job JOB.json is required\n");
            return 2;
        }
        bt_log_set_level(BT_LOG_WARN);
        return cmd_preview(job, rows, color >= 0 ? color : isatty(STDOUT_FILENO));
    }
    if (!strcmp(cmd, "tokenize")) {
        if (!tokp) {
            fprintf(stderr, "loaderctl tokenize: --tokenizer PATH is required\n");
            return 2;
        }
        bt_log_set_level(BT_LOG_WARN);
        return cmd_tokenize(tokp, ids_only, parse_special);
    }
    if (strcmp(cmd, "watch")) return run_once(sock, cmd, as_json);
    struct sigaction sa = {.sa_handler = on_sigint};
    sigaction(SIGINT, &sa, NULL); /* no SA_RESTART: Ctrl-C interrupts the sleep */
    sigaction(SIGTERM, &sa, NULL);
    int tty = isatty(STDOUT_FILENO);
    if (tty && !as_json) fputs("\033[?25l", stdout); /* hide the cursor while redrawing */
    while (!g_stop) {
        /* redraw in place: home the cursor, draw, clear what is left of the previous frame */
        if (tty && !as_json) fputs("\033[H", stdout);
        time_t now = time(NULL);
        char ts[32];
        strftime(ts, sizeof ts, "%H:%M:%S", localtime(&now));
        char *frame = NULL;
        size_t flen = 0;
        g_out = tty && !as_json ? open_memstream(&frame, &flen) : stdout;
        if (!g_out) g_out = stdout;
        if (!as_json) fprintf(g_out, "loaderctl watch %s every %.1f s (Ctrl-C to quit)  %s\n", sock, interval, ts);
        run_once(sock, cmd, as_json);
        if (g_out != stdout) {
            fclose(g_out);
            g_out = stdout;
            for (size_t k = 0; k < flen; k++) { /* clear the rest of each line of the previous frame */
                if (frame[k] == '\n') fputs("\033[K", stdout);
                putchar(frame[k]);
            }
            fputs("\033[J", stdout);
            free(frame);
        }
        fflush(stdout);
        struct timespec ts_sleep = {(time_t)interval, (long)((interval - (double)(time_t)interval) * 1e9)};
        while (!g_stop && nanosleep(&ts_sleep, &ts_sleep) != 0 && errno == EINTR) {
        }
    }
    if (tty && !as_json) fputs("\033[?25h\n", stdout);
    return 0;
}
