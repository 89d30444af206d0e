/* The data-parallel watchdog (trainer/parallel/dist_monitor.h): one thread per process does all the
 * socket I/O; the training thread only posts requests (under the mutex, then a byte on the wake
 * pipe) and reads the outcome. */
#include "trainer/parallel/dist_monitor.h"

#include <errno.h>
#include <fcntl.h>
#include <poll.h>
#include <pthread.h>
#include <signal.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/socket.h>
#include <time.h>
#include <unistd.h>

#include "common/bt_common.h"
#include "trainer/parallel/dist_wire.h"

enum { F_HB = 1, F_STOP = 2, F_ABORT = 3, F_BYE = 4 };
#define HDR 8
#define PAYLOAD_MAX 512
#define OUT_MAX 8192 /* queued bytes per connection; heartbeats are dropped beyond half of it */

typedef struct {
    int fd, r;                     /* r: the rank at the other end */
    int closed, bye;               /* closed: fd gone; bye: it said BYE */
    double last_rx;
    uint8_t in[HDR + PAYLOAD_MAX];
    size_t in_len;
    uint8_t out[OUT_MAX];
    size_t out_len;
    uint64_t progress;             /* rank 0: the peer's collectives entered */
    int in_coll;
    double coll_since;             /* when it was first seen waiting in this collective */
} peer;

struct bt_dist_monitor {
    bt_dist_link *link;
    bt_dist_monitor_opts o;
    int rank, world, n;            /* n peers: world - 1 (rank 0) or 1 */
    peer *p;
    double hb_interval;
    int wake[2];
    pthread_t th;
    int started;
    atomic_int any;                /* a failure or stop was recorded (fast path of check) */
    atomic_ullong progress;        /* this rank's collectives entered */
    atomic_int in_coll;
    double coll_since;             /* this rank (monitor thread's view) */
    uint64_t coll_seen;
    pthread_mutex_t mu;            /* guards everything below */
    pthread_cond_t cv;
    int fail_code;
    char fail[1024];
    int stop_rank, stop_sig;       /* stop_rank >= 0: a stop was relayed to us */
    char stop_name[160];           /* that rank's name, as rank 0 relayed it */
    int stop_sent;                 /* this rank's own stop has been queued */
    char abort_text[480];
    int abort_posted, bye_posted, flushed, rank0_bye, quit;
};

static const char *sig_name(int sig) {
    switch (sig) {
    case SIGINT: return "SIGINT";
    case SIGTERM: return "SIGTERM";
    case SIGUSR1: return "SIGUSR1";
    case SIGUSR2: return "SIGUSR2";
    case SIGHUP: return "SIGHUP";
    default: return "a signal";
    }
}

/* "rank R (pid P on HOST)" as far as this rank knows it. */
static void who(const bt_dist_monitor *m, int r, char *out, size_t n) {
    if (r >= 0 && r < m->world && m->link->pid[r] > 0)
        snprintf(out, n, "rank %d (pid %d on %s)", r, m->link->pid[r], m->link->host[r]);
    else
        snprintf(out, n, "rank %d", r);
}

static void wake(bt_dist_monitor *m) {
    char c = 1;
    ssize_t k = write(m->wake[1], &c, 1);
    (void)k; /* a full pipe already wakes it */
}

/* Record the first failure (mu held). */
static void set_fail_locked(bt_dist_monitor *m, int code, const char *msg) {
    if (m->fail_code) return;
    m->fail_code = code;
    snprintf(m->fail, sizeof m->fail, "%s", msg);
    atomic_store(&m->any, 1);
    pthread_cond_broadcast(&m->cv);
}

/* ---------------------------------------------------------------- framing (monitor thread) --- */

static void queue(peer *c, int type, const void *payload, size_t len, int droppable) {
    if (c->closed) return;
    if (len > PAYLOAD_MAX) len = PAYLOAD_MAX;
    if (c->out_len + HDR + len > (droppable ? OUT_MAX / 2 : OUT_MAX)) return; /* it is not reading */
    uint8_t *h = c->out + c->out_len;
    memset(h, 0, HDR);
    h[0] = (uint8_t)type;
    bt_put32(h + 4, (uint32_t)len);
    if (len) memcpy(h + HDR, payload, len);
    c->out_len += HDR + len;
}

/* To every open connection but `except` (a rank). */
static void queue_all(bt_dist_monitor *m, int type, const void *payload, size_t len, int except) {
    for (int i = 0; i < m->n; i++)
        if (m->p[i].r != except) queue(&m->p[i], type, payload, len, type == F_HB);
}

/* An ABORT {rank, text}. */
static void queue_abort(bt_dist_monitor *m, int rank, const char *text, int except) {
    uint8_t b[PAYLOAD_MAX];
    size_t n = strlen(text);
    if (n > PAYLOAD_MAX - 4) n = PAYLOAD_MAX - 4;
    bt_put32(b, (uint32_t)rank);
    memcpy(b + 4, text, n);
    queue_all(m, F_ABORT, b, 4 + n, except);
}

static void flush(peer *c) {
    while (c->out_len && !c->closed) {
        ssize_t k = send(c->fd, c->out, c->out_len, MSG_NOSIGNAL | MSG_DONTWAIT);
        if (k > 0) {
            memmove(c->out, c->out + k, c->out_len - (size_t)k);
            c->out_len -= (size_t)k;
            continue;
        }
        if (k < 0 && errno == EINTR) continue;
        return; /* EAGAIN (POLLOUT later) or an error (the read side will see it) */
    }
}

/* The connection to rank c->r is gone (EOF or error) without a BYE: that rank died, or (for a
 * peer) rank 0 did. mu held. */
static void lost(bt_dist_monitor *m, peer *c, const char *how) {
    char name[160], msg[1024];
    who(m, c->r, name, sizeof name);
    snprintf(msg, sizeof msg, "%s died: %s (killed, crashed, or its node failed)", name, how);
    set_fail_locked(m, BT_ERR_CLOSED, msg);
    if (m->rank == 0) queue_abort(m, c->r, msg, c->r);
}

/* One complete frame from c (mu held). */
static void on_frame(bt_dist_monitor *m, peer *c, int type, const uint8_t *pl, size_t len, double now) {
    char name[160], msg[1024];
    if (type == F_HB && len >= 12) {
        uint64_t prog = bt_get64(pl);
        int in = (int)bt_get32(pl + 8);
        if (in && (!c->in_coll || prog != c->progress)) c->coll_since = now;
        c->progress = prog;
        c->in_coll = in;
    } else if (type == F_STOP && len >= 8) {
        int r = (int)bt_get32(pl), sig = (int)bt_get32(pl + 4);
        if (m->rank != 0 || (r == c->r)) { /* rank 0 believes only the rank itself */
            if (m->stop_rank < 0) {
                m->stop_rank = r;
                m->stop_sig = sig;
                if (m->rank == 0) {
                    who(m, r, m->stop_name, sizeof m->stop_name);
                } else { /* rank 0 appended the name */
                    size_t n = len - 8 < sizeof m->stop_name - 1 ? len - 8 : sizeof m->stop_name - 1;
                    memcpy(m->stop_name, pl + 8, n);
                    m->stop_name[n] = 0;
                    for (size_t i = 0; i < n; i++)
                        if ((unsigned char)m->stop_name[i] < 0x20 || (unsigned char)m->stop_name[i] > 0x7e)
                            m->stop_name[i] = '?';
                    if (!n) who(m, r, m->stop_name, sizeof m->stop_name);
                }
                atomic_store(&m->any, 1);
            }
            if (m->rank == 0) { /* relay {rank, signal, name} */
                uint8_t b[8 + sizeof m->stop_name];
                size_t n = strlen(m->stop_name);
                memcpy(b, pl, 8);
                memcpy(b + 8, m->stop_name, n);
                queue_all(m, F_STOP, b, 8 + n, c->r);
            }
        }
    } else if (type == F_ABORT && len >= 4) {
        int r = (int)bt_get32(pl);
        char text[PAYLOAD_MAX + 1];
        size_t n = len - 4;
        memcpy(text, pl + 4, n);
        text[n] = 0;
        for (size_t i = 0; i < n; i++)
            if ((unsigned char)text[i] < 0x20 || (unsigned char)text[i] > 0x7e) text[i] = '?';
        if (m->rank == 0) { /* from the failing rank itself: name it, tell everybody */
            who(m, c->r, name, sizeof name);
            snprintf(msg, sizeof msg, "%s failed: %s", name, text);
            set_fail_locked(m, BT_ERR_IO, msg);
            queue_abort(m, c->r, msg, c->r);
        } else { /* rank 0's relay: the text names the rank already */
            (void)r;
            set_fail_locked(m, BT_ERR_IO, text);
        }
    } else if (type == F_BYE) {
        c->bye = 1;
        if (m->rank != 0) m->rank0_bye = 1;
        pthread_cond_broadcast(&m->cv);
    }
}

static void on_readable(bt_dist_monitor *m, peer *c, double now) {
    for (;;) {
        ssize_t k = recv(c->fd, c->in + c->in_len, sizeof c->in - c->in_len, MSG_DONTWAIT);
        if (k < 0 && errno == EINTR) continue;
        if (k < 0 && (errno == EAGAIN || errno == EWOULDBLOCK)) return;
        if (k <= 0) {
            int err = k < 0 ? errno : 0;
            close(c->fd);
            c->closed = 1;
            c->out_len = 0;
            if (!c->bye) {
                char how[160];
                snprintf(how, sizeof how, "the connection %s%s", err ? "failed: " : "closed",
                         err ? strerror(err) : "");
                lost(m, c, how);
            }
            pthread_cond_broadcast(&m->cv);
            return;
        }
        c->in_len += (size_t)k;
        c->last_rx = now;
        while (c->in_len >= HDR) {
            uint32_t len = bt_get32(c->in + 4);
            if (len > PAYLOAD_MAX) { /* not our protocol: treat it as a lost rank */
                close(c->fd);
                c->closed = 1;
                lost(m, c, "it sent a malformed monitor frame");
                return;
            }
            if (c->in_len < HDR + len) break;
            on_frame(m, c, c->in[0], c->in + HDR, len, now);
            memmove(c->in, c->in + HDR + len, c->in_len - HDR - len);
            c->in_len -= HDR + len;
        }
    }
}

/* Silence and stragglers (mu held). */
static void check_times(bt_dist_monitor *m, double now) {
    char name[160], msg[1024];
    for (int i = 0; i < m->n && !m->fail_code; i++) {
        peer *c = &m->p[i];
        if (c->closed || c->bye || now - c->last_rx <= m->o.heartbeat_timeout_s) continue;
        who(m, c->r, name, sizeof name);
        snprintf(msg, sizeof msg, "%s stopped responding: nothing heard from it for %.0f s "
                 "(dist.heartbeat_timeout_s; it is stopped, hung, or its network failed)", name, now - c->last_rx);
        set_fail_locked(m, BT_ERR_TIMEOUT, msg);
        if (m->rank == 0) queue_abort(m, c->r, msg, c->r);
    }
    if (m->rank != 0 || m->o.collective_timeout_s <= 0 || m->fail_code) return;
    /* rank 0: the longest waiter, and the ranks that have not reached its collective */
    uint64_t mine = atomic_load(&m->progress);
    int mine_in = atomic_load(&m->in_coll);
    if (mine_in && mine != m->coll_seen) {
        m->coll_seen = mine;
        m->coll_since = now;
    }
    double since = mine_in ? m->coll_since : now;
    uint64_t n = mine;
    int waiter = 0;
    for (int i = 0; i < m->n; i++)
        if (!m->p[i].closed && m->p[i].in_coll && m->p[i].coll_since < since) {
            since = m->p[i].coll_since;
            n = m->p[i].progress;
            waiter = m->p[i].r;
        }
    if (now - since <= m->o.collective_timeout_s) return;
    int late = mine < n ? 0 : -1;
    for (int i = 0; i < m->n && late < 0; i++)
        if (!m->p[i].closed && !m->p[i].bye && m->p[i].progress < n) late = m->p[i].r;
    if (late < 0) return; /* all are in it: NCCL itself is stuck (the local timeout ends that) */
    char wname[160];
    who(m, late, name, sizeof name);
    who(m, waiter, wname, sizeof wname);
    snprintf(msg, sizeof msg, "%s has not reached collective #%llu, which %s has waited in for %.0f s "
             "(dist.timeout_s): it is stuck outside NCCL (a hung device, a deadlock, a stalled loader)", name,
             (unsigned long long)n, wname, now - since);
    set_fail_locked(m, BT_ERR_TIMEOUT, msg);
    queue_abort(m, late, msg, -1);
}

/* Requests from the training thread, and this rank's own stop (mu held). */
static void take_requests(bt_dist_monitor *m) {
    int sig = m->o.local_stop ? atomic_load(m->o.local_stop) : 0;
    if (sig && !m->stop_sent) {
        uint8_t b[8];
        bt_put32(b, (uint32_t)m->rank);
        bt_put32(b + 4, (uint32_t)sig);
        queue_all(m, F_STOP, b, 8, -1);
        m->stop_sent = 1;
    }
    if (m->abort_posted == 1) {
        queue_abort(m, m->rank, m->abort_text, -1);
        m->abort_posted = 2;
    }
    if (m->bye_posted == 1) {
        queue_all(m, F_BYE, NULL, 0, -1);
        m->bye_posted = 2;
    }
}

static void *run(void *arg) {
    bt_dist_monitor *m = arg;
    struct pollfd *pf = bt_xmalloc(sizeof *pf * (size_t)(m->n + 1));
    double next_hb = 0;
    pthread_mutex_lock(&m->mu);
    while (!m->quit) {
        double now = bt_now();
        take_requests(m);
        if (now >= next_hb) {
            uint8_t b[12];
            bt_put64(b, atomic_load(&m->progress));
            bt_put32(b + 8, (uint32_t)atomic_load(&m->in_coll));
            queue_all(m, F_HB, b, sizeof b, -1);
            next_hb = now + m->hb_interval;
        }
        int queued = 0;
        for (int i = 0; i < m->n; i++) {
            flush(&m->p[i]);
            queued |= m->p[i].out_len > 0;
        }
        int was = m->flushed;
        m->flushed = !queued;
        if (m->flushed != was) pthread_cond_broadcast(&m->cv);
        check_times(m, now);
        pthread_mutex_unlock(&m->mu);

        pf[0] = (struct pollfd){.fd = m->wake[0], .events = POLLIN};
        for (int i = 0; i < m->n; i++)
            pf[i + 1] = (struct pollfd){.fd = m->p[i].closed ? -1 : m->p[i].fd,
                                        .events = (short)(POLLIN | (m->p[i].out_len ? POLLOUT : 0))};
        int ms = (int)((next_hb - bt_now()) * 1000.0) + 1;
        if (ms > 100) ms = 100; /* the local stop flag is a plain variable: look at it often */
        if (ms < 1) ms = 1;
        int k = poll(pf, (nfds_t)m->n + 1, ms);

        pthread_mutex_lock(&m->mu);
        if (k <= 0) continue;
        if (pf[0].revents) {
            char buf[64];
            while (read(m->wake[0], buf, sizeof buf) > 0) {}
        }
        now = bt_now();
        for (int i = 0; i < m->n; i++)
            if (!m->p[i].closed && (pf[i + 1].revents & (POLLIN | POLLHUP | POLLERR))) on_readable(m, &m->p[i], now);
    }
    pthread_mutex_unlock(&m->mu);
    free(pf);
    return NULL;
}

/* ---------------------------------------------------------------- API (training thread) ------ */

int bt_dist_monitor_start(bt_dist_monitor **out, bt_dist_link *link, const bt_dist_monitor_opts *o) {
    *out = NULL;
    if (!link || !o || !(o->heartbeat_timeout_s > 0) || o->collective_timeout_s < 0) {
        bt_dist_link_free(link);
        return bt_fail(BT_ERR_INVALID, "dist: monitor: bad options");
    }
    bt_dist_monitor *m = bt_xcalloc(1, sizeof *m);
    m->link = link;
    m->o = *o;
    m->rank = link->rank;
    m->world = link->world;
    m->stop_rank = -1;
    m->hb_interval = o->heartbeat_timeout_s / 4;
    if (m->hb_interval > 1.0) m->hb_interval = 1.0;
    if (m->hb_interval < 0.05) m->hb_interval = 0.05;
    m->n = m->rank == 0 ? m->world - 1 : 1;
    m->p = bt_xcalloc((size_t)(m->n > 0 ? m->n : 1), sizeof *m->p);
    double now = bt_now();
    for (int i = 0; i < m->n; i++) {
        int r = m->rank == 0 ? i + 1 : 0;
        m->p[i] = (peer){.fd = link->fd[r], .r = r, .last_rx = now, .coll_since = now};
        link->fd[r] = -1; /* the monitor closes it */
        if (m->p[i].fd < 0) m->p[i].closed = 1;
    }
    pthread_mutex_init(&m->mu, NULL);
    pthread_cond_init(&m->cv, NULL);
    m->wake[0] = m->wake[1] = -1;
    if (pipe2(m->wake, O_NONBLOCK | O_CLOEXEC)) {
        int e = errno;
        bt_dist_monitor_free(m);
        return bt_fail(BT_ERR_IO, "dist: monitor: pipe: %s", strerror(e));
    }
    sigset_t all, old; /* signals go to the training thread, not to the monitor */
    sigfillset(&all);
    pthread_sigmask(SIG_BLOCK, &all, &old);
    int e = pthread_create(&m->th, NULL, run, m);
    pthread_sigmask(SIG_SETMASK, &old, NULL);
    if (e) {
        bt_dist_monitor_free(m);
        return bt_fail(BT_ERR_IO, "dist: monitor: pthread_create: %s", strerror(e));
    }
    m->started = 1;
    bt_log(BT_LOG_DEBUG, "dist", "rank %d: monitor watching %d connection(s), heartbeat every %.2f s, "
           "timeout %.0f s", m->rank, m->n, m->hb_interval, o->heartbeat_timeout_s);
    *out = m;
    return 0;
}

int bt_dist_monitor_check(bt_dist_monitor *m) {
    if (!m || !atomic_load(&m->any)) return 0;
    int rc = 0;
    pthread_mutex_lock(&m->mu);
    if (m->fail_code) {
        rc = bt_fail(m->fail_code, "dist: %s", m->fail);
    } else if (m->stop_rank >= 0) {
        rc = bt_fail(BT_ERR_CANCELLED, "dist: %s was interrupted (%s): every rank stops", m->stop_name,
                     sig_name(m->stop_sig));
    }
    pthread_mutex_unlock(&m->mu);
    return rc;
}

void bt_dist_monitor_collective(bt_dist_monitor *m, int entering) {
    if (!m) return;
    if (entering) atomic_fetch_add(&m->progress, 1);
    atomic_store(&m->in_coll, entering);
}

/* Wait (mu held) until pred or the deadline; 0 when pred held. */
static int wait_until(bt_dist_monitor *m, int (*pred)(bt_dist_monitor *), double secs) {
    struct timespec ts;
    clock_gettime(CLOCK_REALTIME, &ts);
    long long ns = (long long)ts.tv_nsec + (long long)(secs * 1e9);
    ts.tv_sec += (time_t)(ns / 1000000000LL);
    ts.tv_nsec = (long)(ns % 1000000000LL);
    while (!pred(m))
        if (pthread_cond_timedwait(&m->cv, &m->mu, &ts)) return pred(m) ? 0 : -1;
    return 0;
}

static int sent(bt_dist_monitor *m) { return m->flushed && m->abort_posted != 1 && m->bye_posted != 1; }
static int rank0_done(bt_dist_monitor *m) { return m->rank0_bye || m->fail_code || m->p[0].closed; }

void bt_dist_monitor_fail(bt_dist_monitor *m, const char *why) {
    if (!m) return;
    pthread_mutex_lock(&m->mu);
    if (!m->fail_code && !m->abort_posted) { /* a failure the monitor reported is known already */
        snprintf(m->abort_text, sizeof m->abort_text, "%s", why ? why : "?");
        m->abort_posted = 1;
        m->flushed = 0;
        wake(m);
        (void)wait_until(m, sent, 2.0);
    }
    pthread_mutex_unlock(&m->mu);
}

int bt_dist_monitor_finish(bt_dist_monitor *m) {
    if (!m) return 0;
    int rc = 0;
    pthread_mutex_lock(&m->mu);
    m->bye_posted = 1;
    m->flushed = 0;
    wake(m);
    if (m->rank == 0) {
        (void)wait_until(m, sent, 5.0);
    } else {
        while (wait_until(m, rank0_done, 3600.0)) {}
        if (!m->rank0_bye && m->fail_code) rc = m->fail_code;
        if (!m->rank0_bye && !m->fail_code) rc = BT_ERR_CLOSED;
    }
    char msg[sizeof m->fail];
    snprintf(msg, sizeof msg, "%s", m->fail_code ? m->fail : "rank 0 closed its connection without a goodbye");
    pthread_mutex_unlock(&m->mu);
    return rc ? bt_fail(rc, "dist: waiting for rank 0 to finish: %s", msg) : 0;
}

void bt_dist_monitor_free(bt_dist_monitor *m) {
    if (!m) return;
    if (m->started) {
        pthread_mutex_lock(&m->mu);
        m->quit = 1;
        pthread_mutex_unlock(&m->mu);
        wake(m);
        pthread_join(m->th, NULL);
    }
    for (int i = 0; i < m->n; i++)
        if (!m->p[i].closed) close(m->p[i].fd);
    if (m->wake[0] >= 0) close(m->wake[0]);
    if (m->wake[1] >= 0) close(m->wake[1]);
    pthread_mutex_destroy(&m->mu);
    pthread_cond_destroy(&m->cv);
    bt_dist_link_free(m->link);
    free(m->p);
    free(m);
}
