/* bench_ring: the memfd ring (proto/ring.h) between two processes, as loaderd and a trainer use
 * it. Run by tests/bench/bench_ring.sh (`make bench`); prints a markdown section.
 *   bench_ring [--B 4] [--T 2048] [--slots 8] [--seconds 3] [--samples 3000] [--no-pin]
 * Hand-off: the producer (parent) copies a prepared batch from private memory into each slot and
 * commits it, as loaderd's producer thread does; the consumer (a forked child that maps the
 * memfd through bt_ring_attach, like a trainer) copies each slot out into its own buffer (the
 * trainer's staging copy) and releases it. GB/s = slot bytes x batches / wall time at the
 * consumer; both copies are included, so this is the rate at which whole batches move.
 * Wake-up latency: the producer waits until the ring is empty and the consumer is asleep in
 * FUTEX_WAIT (its consumer_waiting flag is up), stamps CLOCK_MONOTONIC into the slot and commits;
 * the consumer reads the clock as soon as bt_ring_consumer_peek returns. Median / p99 / max of
 * --samples wake-ups, in microseconds. With two or more CPUs the processes are pinned to
 * different CPUs (--no-pin leaves placement to the scheduler).
 * Exit 0, 1 with a message when the ring fails, or 2 with the usage on a bad command line. */
#include <getopt.h>
#include <errno.h>
#include <sched.h>
#include <stdatomic.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/wait.h>
#include <time.h>
#include <unistd.h>

#include "common/bt_common.h"
#include "proto/batch.h"
#include "proto/ring.h"

static uint64_t now_ns(void) {
    struct timespec ts;
    clock_gettime(CLOCK_MONOTONIC, &ts);
    return (uint64_t)ts.tv_sec * 1000000000ull + (uint64_t)ts.tv_nsec;
}

static void pin(int cpu) {
    cpu_set_t set;
    CPU_ZERO(&set);
    CPU_SET(cpu, &set);
    sched_setaffinity(0, sizeof set, &set); /* best effort */
}

static int write_all(int fd, const void *p, size_t n) {
    const char *c = p;
    while (n) {
        ssize_t w = write(fd, c, n);
        if (w < 0 && errno == EINTR) continue;
        if (w <= 0) return -1;
        c += w;
        n -= (size_t)w;
    }
    return 0;
}

static int read_all(int fd, void *p, size_t n) {
    char *c = p;
    while (n) {
        ssize_t r = read(fd, c, n);
        if (r < 0 && errno == EINTR) continue;
        if (r <= 0) return -1;
        c += r;
        n -= (size_t)r;
    }
    return 0;
}

static int cmp_u64(const void *a, const void *b) {
    uint64_t x = *(const uint64_t *)a, y = *(const uint64_t *)b;
    return x < y ? -1 : x > y;
}

#define STOP_MARK UINT64_MAX /* first 8 bytes of the slot that ends the throughput phase */

/* Consumer process: throughput phase (batches until the one marked STOP_MARK), then the latency
 * phase (n_lat samples); batch count, nanoseconds and samples are written to `out`. */
static int consumer(int fd, int out, uint32_t n_lat) {
    bt_ring r;
    if (bt_ring_attach(&r, fd)) {
        fprintf(stderr, "bench_ring consumer: %s\n", bt_last_error());
        return 1;
    }
    uint8_t *mine = bt_aligned_alloc(r.slot_bytes);
    uint64_t t0 = 0, t1 = 0, sink = 0, n_tp = 0;
    for (;;) {
        void *s = bt_ring_consumer_peek(&r, 30000);
        if (!s) {
            fprintf(stderr, "bench_ring consumer: %s\n", bt_last_error());
            return 1;
        }
        uint64_t mark;
        memcpy(&mark, s, sizeof mark);
        if (mark == STOP_MARK) {
            bt_ring_consumer_release(&r);
            break;
        }
        memcpy(mine, s, r.slot_bytes);
        sink += mine[r.slot_bytes - 1];
        bt_ring_consumer_release(&r);
        /* time from the end of the first batch: the ring is in steady state from there */
        if (n_tp++ == 0) t0 = now_ns();
        t1 = now_ns();
    }
    n_tp = n_tp ? n_tp - 1 : 0;
    uint64_t t_tp = t1 - t0;
    uint64_t *lat = calloc(n_lat ? n_lat : 1, sizeof *lat);
    for (uint32_t i = 0; i < n_lat; i++) {
        void *s = bt_ring_consumer_peek(&r, 30000);
        uint64_t t = now_ns();
        if (!s) {
            fprintf(stderr, "bench_ring consumer (latency): %s\n", bt_last_error());
            return 1;
        }
        uint64_t stamp;
        memcpy(&stamp, s, sizeof stamp);
        lat[i] = t - stamp;
        bt_ring_consumer_release(&r);
    }
    int rc = write_all(out, &n_tp, sizeof n_tp) || write_all(out, &t_tp, sizeof t_tp) ||
             write_all(out, &sink, sizeof sink) ||
             write_all(out, lat, n_lat * sizeof *lat);
    free(lat);
    free(mine);
    bt_ring_consumer_close(&r);
    bt_ring_close(&r);
    return rc ? 1 : 0;
}

int main(int argc, char **argv) {
    uint32_t B = 4, T = 2048, slots = 8, samples = 3000;
    double seconds = 3.0;
    int do_pin = 1;
    static const struct option lopts[] = {
        {"B", required_argument, NULL, 'B'},       {"T", required_argument, NULL, 'T'},
        {"slots", required_argument, NULL, 's'},   {"seconds", required_argument, NULL, 't'},
        {"samples", required_argument, NULL, 'n'}, {"no-pin", no_argument, NULL, 'p'},
        {"help", no_argument, NULL, 'h'},          {NULL, 0, NULL, 0}};
    static const char usage[] = "usage: bench_ring [--B 4] [--T 2048] [--slots 8] [--seconds 3] [--samples 3000] "
                                "[--no-pin]\n";
    int c;
    while ((c = getopt_long(argc, argv, "", lopts, NULL)) != -1) {
        switch (c) {
        case 'B': B = (uint32_t)atoi(optarg); break;
        case 'T': T = (uint32_t)atoi(optarg); break;
        case 's': slots = (uint32_t)atoi(optarg); break;
        case 't': seconds = atof(optarg); break;
        case 'n': samples = (uint32_t)atoi(optarg); break;
        case 'p': do_pin = 0; break;
        case 'h': fputs(usage, stdout); return 0;
        default: fputs(usage, stderr); return 2;
        }
    }
    if (optind != argc) {
        fputs(usage, stderr);
        return 2;
    }
    bt_ring r;
    if (bt_ring_create(&r, slots, B, T)) {
        fprintf(stderr, "bench_ring: %s\n", bt_last_error());
        return 1;
    }
    size_t sb = r.slot_bytes;
    uint8_t *priv = bt_aligned_alloc(sb);
    for (size_t k = 0; k < sb; k++) priv[k] = (uint8_t)(k * 131u + 7u);
    memset(priv, 0, 8); /* not the stop mark */
    long ncpu = sysconf(_SC_NPROCESSORS_ONLN);
    int pinned = do_pin && ncpu >= 2;
    int pfd[2];
    if (pipe(pfd) != 0) return 1;
    pid_t pid = fork();
    if (pid < 0) return 1;
    if (pid == 0) {
        close(pfd[0]);
        if (pinned) pin(1);
        int fd = dup(r.fd);
        _exit(consumer(fd, pfd[1], samples));
    }
    close(pfd[1]);
    if (pinned) pin(0);
    uint64_t deadline = now_ns() + (uint64_t)(seconds * 1e9);
    for (uint64_t i = 0;; i++) {
        void *s = bt_ring_producer_acquire(&r, 30000);
        if (!s) {
            fprintf(stderr, "bench_ring producer: %s\n", bt_last_error());
            return 1;
        }
        int stop = (i & 15) == 0 && now_ns() >= deadline;
        if (stop) {
            uint64_t mark = STOP_MARK;
            memcpy(s, &mark, sizeof mark);
        } else {
            memcpy(s, priv, sb);
        }
        bt_ring_producer_commit(&r);
        if (stop) break;
    }
    for (uint32_t i = 0; i < samples; i++) {
        /* wait for an empty ring and a sleeping consumer */
        uint64_t spin0 = now_ns();
        while (bt_ring_fill(&r) != 0 || !atomic_load(&r.hdr->consumer_waiting)) {
            if (now_ns() - spin0 > 30000000000ull) {
                fprintf(stderr, "bench_ring: consumer never went to sleep\n");
                return 1;
            }
            sched_yield();
        }
        struct timespec ts = {0, 200000}; /* let it settle into FUTEX_WAIT */
        nanosleep(&ts, NULL);
        void *s = bt_ring_producer_acquire(&r, 30000);
        if (!s) return 1;
        uint64_t stamp = now_ns();
        memcpy(s, &stamp, sizeof stamp);
        bt_ring_producer_commit(&r);
    }
    uint64_t n_tp = 0, t_tp = 0, sink = 0;
    uint64_t *lat = calloc(samples ? samples : 1, sizeof *lat);
    int bad = read_all(pfd[0], &n_tp, sizeof n_tp) || read_all(pfd[0], &t_tp, sizeof t_tp) || read_all(pfd[0], &sink, sizeof sink) ||
              read_all(pfd[0], lat, samples * sizeof *lat);
    int st = 0;
    waitpid(pid, &st, 0);
    if (bad || !WIFEXITED(st) || WEXITSTATUS(st) != 0) {
        fprintf(stderr, "bench_ring: the consumer failed\n");
        return 1;
    }
    qsort(lat, samples, sizeof *lat, cmp_u64);
    double secs = t_tp > 0 ? (double)t_tp / 1e9 : 1e-9;
    double gbs = (double)sb * (double)n_tp / secs / 1e9;
    double bps = (double)n_tp / secs;
    double med = samples ? lat[samples / 2] / 1e3 : 0, p99 = samples ? lat[(size_t)(samples * 0.99)] / 1e3 : 0;
    double mx = samples ? lat[samples - 1] / 1e3 : 0;
    printf("| %u | %u | %zu | %u | %s | %llu | %.2f | %.0f | %u | %.1f | %.1f | %.1f |\n", B, T, sb, slots,
           pinned ? "yes" : "no", (unsigned long long)n_tp, gbs, bps, samples, med, p99, mx);
    free(lat);
    free(priv);
    bt_ring_producer_close(&r);
    bt_ring_close(&r);
    return 0;
}
