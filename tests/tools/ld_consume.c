/* ld_consume: a minimal trainer-side consumer of loaderd through proto/client.h, for the
 * process-level tests (tests/py/test_loaderd_faults.py) and for poking a running loaderd.
 *   ld_consume --socket PATH --job FILE --batches N [--rank R] [--world W] [--report-every K]
 *              [--timeout-ms MS] [--hold-ms MS]
 * Attaches the job spec read from FILE (a JSON object), takes N batches with bt_client_next
 * (validated there: checksum, layout, consecutive steps) and prints one line per batch,
 * flushed at once:  "batch STEP CHECKSUM(16 hex) JOB_ID N_REAL N_DOCS EPOCH"
 * then "reconnects K" and "end" (end of data) or "done". --hold-ms sleeps that long holding each
 * batch (a slow trainer), --report-every sends bt_client_report every K batches.
 * Exit 0 on success, 1 on any client error (message on stderr), 2 on usage errors. */
#include <getopt.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>

#include "common/bt_common.h"
#include "proto/client.h"

static char *slurp(const char *path) {
    FILE *f = fopen(path, "rb");
    if (!f) return NULL;
    size_t cap = 4096, n = 0;
    char *b = bt_xmalloc(cap);
    size_t r;
    while ((r = fread(b + n, 1, cap - n - 1, f)) > 0) {
        n += r;
        if (cap - n < 2) b = bt_xrealloc(b, cap *= 2);
    }
    fclose(f);
    b[n] = 0;
    return b;
}

int main(int argc, char **argv) {
    const char *sock = NULL, *job_path = NULL;
    long batches = 10, rank = 0, world = 1, report_every = 0, timeout_ms = 120000, hold_ms = 0;
    static const struct option lopts[] = {
        {"socket", required_argument, NULL, 's'},       {"job", required_argument, NULL, 'j'},
        {"batches", required_argument, NULL, 'n'},      {"rank", required_argument, NULL, 'r'},
        {"world", required_argument, NULL, 'w'},        {"report-every", required_argument, NULL, 'e'},
        {"timeout-ms", required_argument, NULL, 't'},   {"hold-ms", required_argument, NULL, 'H'},
        {"help", no_argument, NULL, 'h'},               {NULL, 0, NULL, 0}};
    int opt, bad = 0;
    while ((opt = getopt_long(argc, argv, "", lopts, NULL)) != -1) {
        switch (opt) {
        case 's': sock = optarg; break;
        case 'j': job_path = optarg; break;
        case 'n': batches = atol(optarg); break;
        case 'r': rank = atol(optarg); break;
        case 'w': world = atol(optarg); break;
        case 'e': report_every = atol(optarg); break;
        case 't': timeout_ms = atol(optarg); break;
        case 'H': hold_ms = atol(optarg); break;
        case 'h': bad = -1; break;
        default: bad = 1; break;
        }
    }
    if (bad || optind != argc || !job_path || batches < 0) {
        fprintf(bad < 0 ? stdout : stderr,
                "usage: ld_consume --socket PATH --job FILE --batches N [--rank R] [--world W] "
                "[--report-every K] [--timeout-ms MS] [--hold-ms MS]\n");
        return bad < 0 ? 0 : 2;
    }
    char *job = slurp(job_path);
    if (!job) {
        fprintf(stderr, "ld_consume: cannot read %s\n", job_path);
        return 2;
    }
    bt_client *c = NULL;
    int rc = bt_client_attach(&c, sock, job, (int)rank, (int)world, NULL);
    free(job);
    if (rc) {
        fprintf(stderr, "ld_consume: attach: %s\n", bt_last_error());
        return 1;
    }
    printf("attached job %u B=%u T=%u vocab=%d\n", bt_client_job_id(c), bt_client_B(c), bt_client_T(c),
           bt_client_vocab(c));
    fflush(stdout);
    int status = 0, ended = 0;
    for (long k = 0; k < batches; k++) {
        bt_batch_view v;
        rc = bt_client_next(c, &v, (int)timeout_ms);
        if (rc == 1) {
            ended = 1;
            break;
        }
        if (rc < 0) {
            fprintf(stderr, "ld_consume: batch %ld: %s\n", k, bt_last_error());
            status = 1;
            break;
        }
        printf("batch %llu %016llx %u %u %u %u\n", (unsigned long long)v.hdr->step,
               (unsigned long long)v.hdr->checksum, v.hdr->job_id, v.hdr->n_real_tokens, v.hdr->n_docs, v.hdr->epoch);
        fflush(stdout);
        if (hold_ms > 0) {
            struct timespec ts = {hold_ms / 1000, (hold_ms % 1000) * 1000000L};
            nanosleep(&ts, NULL);
        }
        if (report_every > 0 && (k + 1) % report_every == 0 && bt_client_report(c, (uint64_t)k, 2.5, 1000.0))
            fprintf(stderr, "ld_consume: report: %s\n", bt_last_error());
        bt_client_release(c);
    }
    printf("reconnects %llu\n%s\n", (unsigned long long)bt_client_reconnects(c), ended ? "end" : "done");
    fflush(stdout);
    bt_client_close(c);
    return status;
}
