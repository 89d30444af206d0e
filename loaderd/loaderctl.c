/* loaderctl: operator client of loaderd's control socket (protocol: proto/PROTOCOL.md).
 *   loaderctl [--socket PATH] status|jobs|metrics|drain|watch [--json] [--interval S]
 * Default socket: $LOADERD_SOCKET, else /run/loaderd/loaderd.sock. Human tables by default;
 * --json prints loaderd's raw reply line. `watch` redraws the status table every --interval
 * seconds (default 2) until Ctrl-C. Exit: 0 ok, 1 loaderd unreachable or refused, 2 usage. */
#include <errno.h>
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
    for (int off = 0; off < n;) {
        ssize_t w = send(fd, req + off, (size_t)(n - off), MSG_NOSIGNAL);
        if (w < 0 && errno == EINTR) continue;
        if (w < 0) {
            fprintf(stderr, "loaderctl: send: %s\n", strerror(errno));
            close(fd);
            return -1;
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
            fprintf(stderr, "loaderctl: no reply from loaderd within %d s\n", TIMEOUT_MS / 1000);
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
            fprintf(stderr, "loaderctl: loaderd closed the connection without a reply\n");
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

static const char *str(json_t *o, const char *k) {
    const char *s = json_string_value(json_object_get(o, k));
    return s ? s : "-";
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

static void print_status(json_t *r) {
    char up[32];
    fmt_uptime(up, sizeof up, num(r, "uptime_s"));
    json_t *jobs = json_object_get(r, "jobs");
    printf("loaderd pid %.0f on %s, up %s, %.0f client(s), %zu job(s)%s\n", num(r, "pid"), str(r, "socket"), up,
           num(r, "clients"), json_array_size(jobs), json_is_true(json_object_get(r, "draining")) ? ", DRAINING" : "");
    if (json_array_size(jobs) == 0) {
        printf("no jobs attached\n");
        return;
    }
    printf("%-4s %-20s %-7s %-8s %9s %9s %6s %7s %8s %6s %8s %8s %9s\n", "JOB", "NAME", "RANK", "STATE", "DOCS/S",
           "TOKENS/S", "PACK%", "RING", "BATCHES", "BAD", "STEP", "LOSS", "TRN TOK/S");
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
        printf("%-4.0f %-20.20s %-7s %-8s %9s %9s %5.1f%% %7s %8.0f %6.0f %8s %8s %9s\n", num(j, "job_id"),
               str(j, "name"), rank, str(j, "state"), dr, tr, 100.0 * num(j, "packing_efficiency"), ring,
               num(j, "batches"), num(j, "bad_lines_total"), step, loss, ttr);
    }
    /* bad lines by reason, and errors, one line per job that has any */
    json_array_foreach(jobs, i, j) {
        json_t *bad = json_object_get(j, "bad_lines");
        const char *k;
        json_t *v;
        int any = 0;
        json_object_foreach(bad, k, v) {
            if (json_integer_value(v) == 0) continue;
            if (!any) printf("job %.0f bad lines:", num(j, "job_id"));
            printf(" %s=%lld", k, (long long)json_integer_value(v));
            any = 1;
        }
        if (any) printf("\n");
        if (json_object_get(j, "error")) printf("job %.0f error: %s\n", num(j, "job_id"), str(j, "error"));
    }
}

static void print_jobs(json_t *r) {
    json_t *jobs = json_object_get(r, "jobs");
    if (json_array_size(jobs) == 0) {
        printf("no jobs attached\n");
        return;
    }
    printf("%-4s %-24s %-7s %-8s %8s %8s\n", "JOB", "NAME", "RANK", "STATE", "BATCHES", "PID");
    size_t i;
    json_t *j;
    json_array_foreach(jobs, i, j) {
        char rank[24];
        snprintf(rank, sizeof rank, "%.0f/%.0f", num(j, "rank"), num(j, "world_size"));
        printf("%-4.0f %-24.24s %-7s %-8s %8.0f %8.0f\n", num(j, "job_id"), str(j, "name"), rank, str(j, "state"),
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
    if (!json_is_true(json_object_get(r, "ok"))) {
        if (as_json) printf("%s\n", line);
        fprintf(stderr, "loaderctl: loaderd refused %s: %s\n", op, str(r, "error"));
        rc = 1;
    } else if (as_json) {
        printf("%s\n", line);
    } else if (!strcmp(op, "status")) {
        print_status(r);
    } else if (!strcmp(op, "jobs")) {
        print_jobs(r);
    } else if (!strcmp(op, "metrics")) {
        fputs(str(r, "text"), stdout);
    } else if (!strcmp(op, "drain")) {
        printf("loaderd is draining: %.0f job(s) left; it exits when they detach\n", num(r, "jobs"));
    }
    fflush(stdout);
    json_decref(r);
    free(line);
    return rc;
}

static void usage(FILE *f) {
    fprintf(f, "usage: loaderctl [--socket PATH] status|jobs|metrics|drain|watch [--json] [--interval S]\n"
               "  default socket: $LOADERD_SOCKET or %s\n", BT_DEFAULT_SOCKET);
}

int main(int argc, char **argv) {
    const char *sock = getenv("LOADERD_SOCKET");
    if (!sock || !*sock) sock = BT_DEFAULT_SOCKET;
    const char *cmd = NULL;
    int as_json = 0;
    double interval = 2.0;
    for (int i = 1; i < argc; i++) {
        if (!strcmp(argv[i], "--socket") && i + 1 < argc) sock = argv[++i];
        else if (!strcmp(argv[i], "--json")) as_json = 1;
        else if (!strcmp(argv[i], "--interval") && i + 1 < argc) {
            char *end;
            interval = strtod(argv[++i], &end);
            if (*end || !(interval >= 0.1 && interval <= 3600)) {
                fprintf(stderr, "loaderctl: --interval wants seconds in [0.1, 3600]\n");
                return 2;
            }
        } else if (!strcmp(argv[i], "--help") || !strcmp(argv[i], "-h")) {
            usage(stdout);
            return 0;
        } else if (!cmd && (!strcmp(argv[i], "status") || !strcmp(argv[i], "jobs") || !strcmp(argv[i], "metrics") ||
                            !strcmp(argv[i], "drain") || !strcmp(argv[i], "watch"))) {
            cmd = argv[i];
        } else {
            fprintf(stderr, "loaderctl: unknown or incomplete argument '%s'\n", argv[i]);
            usage(stderr);
            return 2;
        }
    }
    if (!cmd) {
        usage(stderr);
        return 2;
    }
    signal(SIGPIPE, SIG_IGN);
    if (strcmp(cmd, "watch")) return run_once(sock, cmd, as_json);
    struct sigaction sa = {.sa_handler = on_sigint};
    sigaction(SIGINT, &sa, NULL); /* no SA_RESTART: Ctrl-C interrupts the sleep */
    sigaction(SIGTERM, &sa, NULL);
    int tty = isatty(STDOUT_FILENO);
    while (!g_stop) {
        if (tty && !as_json) fputs("\033[H\033[2J", stdout);
        time_t now = time(NULL);
        char ts[32];
        strftime(ts, sizeof ts, "%H:%M:%S", localtime(&now));
        if (!as_json) printf("loaderctl watch %s every %.1f s (Ctrl-C to quit)  %s\n", sock, interval, ts);
        run_once(sock, cmd, as_json);
        struct timespec ts_sleep = {(time_t)interval, (long)((interval - (double)(time_t)interval) * 1e9)};
        while (!g_stop && nanosleep(&ts_sleep, &ts_sleep) != 0 && errno == EINTR) {
        }
    }
    return 0;
}
