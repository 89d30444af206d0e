/* Stop requests, signals and the collectives of one run. See run.h. */
#include <string.h>

#include "common/bt_common.h"
#include "trainer/loop/run.h"
#include "trainer/model/rng.h"

atomic_int bt_run_stop_sig;

static void on_signal(int sig) { atomic_store(&bt_run_stop_sig, sig); }
static const int k_stop_signals[] = {SIGINT, SIGTERM, SIGUSR1};
#define N_STOP_SIGNALS 3
_Static_assert(sizeof ((bt_run_signals *)0)->old / sizeof(struct sigaction) == N_STOP_SIGNALS,
               "one saved disposition per stop signal");

void bt_run_catch_signals(bt_run_signals *saved) {
    atomic_store(&bt_run_stop_sig, 0);
    struct sigaction sa;
    memset(&sa, 0, sizeof sa);
    sa.sa_handler = on_signal;
    for (int i = 0; i < N_STOP_SIGNALS; i++) sigaction(k_stop_signals[i], &sa, &saved->old[i]);
}

void bt_run_restore_signals(const bt_run_signals *saved) {
    for (int i = 0; i < N_STOP_SIGNALS; i++) sigaction(k_stop_signals[i], &saved->old[i], NULL);
}

static const char *stop_signal_name(int sig) {
    return sig == SIGINT ? "SIGINT" : sig == SIGTERM ? "SIGTERM" : sig == SIGUSR1 ? "SIGUSR1" : "a signal";
}

int bt_run_stop_check(void *arg) {
    const bt_run *r = arg;
    int rc = bt_dist_monitor_check(r ? r->mon : NULL);
    if (rc) return rc;
    int sig = atomic_load(&bt_run_stop_sig);
    return sig ? bt_fail(BT_ERR_CANCELLED, "interrupted by %s", stop_signal_name(sig)) : 0;
}

int bt_run_stop_error(bt_run *r) {
    int rc = bt_run_stop_check(r);
    return rc ? rc : bt_fail(BT_ERR_CANCELLED, "interrupted");
}

void bt_run_on_collective(void *arg, int entering) {
    bt_run *r = arg;
    bt_dist_monitor_collective(r->mon, entering);
}

int bt_run_dist_sum(bt_run *r, double *vals, int n) {
    return r->dist.world > 1 && r->be ? bt_backend_allreduce_sum(r->be, vals, n) : 0;
}

int bt_run_gather_resume(bt_run *r, const uint8_t *mine, uint8_t *all) {
    if (r->dist.world > 1 && r->be)
        return bt_backend_allgather(r->be, mine, all, BT_RESUME_STATE_BYTES);
    memcpy(all, mine, BT_RESUME_STATE_BYTES);
    return 0;
}

int bt_run_agree(bt_run *r, int rc, const char *what) {
    if (r->dist.world == 1) return rc;
    double f = rc != 0;
    int rc2 = bt_run_dist_sum(r, &f, 1);
    if (rc) return rc;
    if (rc2) return rc2;
    return f > 0 ? bt_fail(BT_ERR_IO, "%s failed on another rank (see its log)", what) : 0;
}

uint64_t bt_run_drop_key(const bt_run *r, int step, int i) {
    uint64_t key = bt_hash64(r->cfg->seed ^ bt_hash64(((uint64_t)step << 20) + (uint64_t)i + 1));
    if (r->dist.rank > 0) key = bt_hash64(key ^ (uint64_t)r->dist.rank);
    return key | 1;
}
