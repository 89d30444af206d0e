/* Test of the emulated NCCL (tests/emu/nccl_emu.cpp): every case forks one process per rank that
 * talk through the shared-memory segment, as the data-parallel trainer's ranks will. Checks the
 * collectives bit for bit against sums in rank order (and across ranks), sizes of 1, odd and more
 * than one 4 MiB slot, in place and out of place; that bad inits (duplicate rank, mismatched
 * nranks, a missing rank), a dead rank, an aborting rank and mismatched calls fail with an error
 * instead of hanging; that a non-blocking communicator (ncclConfig_t.blocking = 0) works the way
 * NCCL's fault-tolerance pattern polls it (init and collectives return ncclInProgress; completion
 * through cudaStreamQuery; errors through ncclCommGetAsyncError; ncclCommAbort ends a collective
 * stuck on a lost peer, also with NCCL_EMU_PEER_LOSS=hang where nothing else notices the loss);
 * and that no /dev/shm/bt-nccl-emu-* entry stays behind.
 * Each case is a cmocka test ("[ RUN      ] name", "[       OK ] name" / "[  FAILED  ] name");
 * the binary ends with "test_nccl_emu: N passed, M failed, 0 skipped" (the line tests/emu/run.sh
 * collects) and exits non-zero on any failure. */
#include <cuda_runtime.h>
#include <nccl.h>

#include <dirent.h>
#include <signal.h>
#include <sys/mman.h>
#include <sys/stat.h>
#include <sys/wait.h>
#include <unistd.h>

#include <chrono>
#include <cmath>
#include <csetjmp>
#include <cstdarg>
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <functional>
#include <string>
#include <vector>

extern "C" {
#include <cmocka.h>
}

namespace {

constexpr int kMaxProcs = 4;
struct Shared { /* written by the children, read by the parent */
    int rc[kMaxProcs];
    uint64_t hash[kMaxProcs];
    char msg[kMaxProcs][512];
};
Shared *g_sh;
bool g_case_ok; /* the current case's reports so far */
std::vector<std::string> g_names; /* the shm names of every id this test made */

uint64_t fnv(const void *p, size_t n, uint64_t h = 1469598103934665603ull)
{
    for (size_t i = 0; i < n; i++) h = (h ^ ((const uint8_t *)p)[i]) * 1099511628211ull;
    return h;
}

ncclUniqueId new_id()
{
    ncclUniqueId id;
    if (ncclGetUniqueId(&id) != ncclSuccess) {
        printf("ncclGetUniqueId failed\n");
        exit(1);
    }
    char name[64] = "bt-nccl-emu-";
    for (int i = 16; i < 32; i++) snprintf(name + strlen(name), 3, "%02x", (uint8_t)id.internal[i]);
    g_names.push_back(name);
    return id;
}

#define CHECK(cond, ...)                                                                          \
    do {                                                                                          \
        if (!(cond)) {                                                                            \
            snprintf(g_sh->msg[me], sizeof g_sh->msg[me], __VA_ARGS__);                          \
            return 1;                                                                             \
        }                                                                                         \
    } while (0)
#define NCCL_OK(call) CHECK((call) == ncclSuccess, "%s: %s", #call, ncclGetLastError(nullptr))

/* Forks nprocs children running body(me) (me = 0..nprocs-1; its exit code: 0 = ok); returns the
 * children's codes through g_sh->rc. A child that hangs is killed by alarm() after 100 s. */
void run_procs(int nprocs, const std::function<int(int me)> &body)
{
    memset(g_sh, 0, sizeof *g_sh);
    fflush(stdout);
    std::vector<pid_t> pids;
    for (int me = 0; me < nprocs; me++) {
        pid_t p = fork();
        if (p == 0) {
            /* a child that crashes dies of it: cmocka's handlers (inherited) would resume the
             * parent's test runner inside the child */
            for (int sig : {SIGSEGV, SIGILL, SIGFPE, SIGBUS, SIGSYS})
                signal(sig, SIG_DFL);
            alarm(100);
            _exit(body(me));
        }
        pids.push_back(p);
    }
    for (int me = 0; me < nprocs; me++) {
        int st = 0;
        waitpid(pids[(size_t)me], &st, 0);
        g_sh->rc[me] = WIFEXITED(st) ? WEXITSTATUS(st) : 128 + WTERMSIG(st);
    }
}

void report(const char *name, bool ok, int nprocs)
{
    for (int r = 0; r < nprocs; r++)
        if (g_sh->rc[r] != 0 || g_sh->msg[r][0])
            printf("    process %d: exit %d %s\n", r, g_sh->rc[r], g_sh->msg[r]);
    printf("    %s: %s\n", name, ok ? "ok" : "FAILED");
    fflush(stdout);
    g_case_ok = g_case_ok && ok;
}

bool all_ok(int nprocs)
{
    for (int r = 0; r < nprocs; r++)
        if (g_sh->rc[r] != 0) return false;
    return true;
}

bool same_hash(int nprocs)
{
    for (int r = 1; r < nprocs; r++)
        if (g_sh->hash[r] != g_sh->hash[0]) return false;
    return true;
}

/* Deterministic per-rank data with a wide exponent range, so that the summation order matters. */
float valf(int rank, size_t i) { return (float)(std::sin(0.37 * (double)i + rank) * std::pow(2.0, (double)((i * 7 + rank * 3) % 23) - 11)); }
double vald(int rank, size_t i) { return (double)valf(rank, i) * (1.0 + 1e-9 * (double)i); }
int64_t vali(int rank, size_t i) { return (int64_t)((i * 2654435761u) % 1000003) * (rank % 2 ? -1 : 1) + (int64_t)rank * ((int64_t)1 << 40); }

constexpr int R = 3; /* ranks of the collective tests */

double secs_since(std::chrono::steady_clock::time_point t0)
{
    return std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
}

/* ncclCommInitRankConfig with blocking = 0, then polls ncclCommGetAsyncError until the init is
 * done (NCCL's documented loop). */
ncclResult_t init_nonblocking(ncclComm_t *c, int n, const ncclUniqueId &id, int me)
{
    ncclConfig_t cfg = NCCL_CONFIG_INITIALIZER;
    cfg.blocking = 0;
    ncclResult_t r = ncclCommInitRankConfig(c, n, id, me, &cfg);
    if (r != ncclInProgress) return r == ncclSuccess ? ncclInternalError : r; /* must be in progress */
    const auto t0 = std::chrono::steady_clock::now();
    do {
        if (ncclCommGetAsyncError(*c, &r) != ncclSuccess) return ncclInternalError;
        usleep(1000);
    } while (r == ncclInProgress && secs_since(t0) < 30);
    return r;
}
const size_t kSizes[] = {1, 1001, (size_t)2500000 + 3}; /* the last: 10 MB of fp32, 3 slot chunks */

void queries_and_single_rank()
{
    { /* queries, version, error strings, nranks == 1 without shared memory */
        const ncclUniqueId id = new_id();
        run_procs(1, [&](int me) {
            int v = 0, n = 0, r = -1, d = -1;
            NCCL_OK(ncclGetVersion(&v));
            CHECK(v == NCCL_VERSION_CODE, "version %d", v);
            CHECK(strcmp(ncclGetErrorString(ncclSuccess), "no error") == 0, "error string");
            CHECK(strstr(ncclGetErrorString(ncclRemoteError), "remote") != nullptr, "error string");
            ncclComm_t c;
            NCCL_OK(ncclCommInitRank(&c, 1, id, 0));
            NCCL_OK(ncclCommCount(c, &n));
            NCCL_OK(ncclCommUserRank(c, &r));
            NCCL_OK(ncclCommCuDevice(c, &d));
            CHECK(n == 1 && r == 0 && d == 0, "count %d rank %d device %d", n, r, d);
            std::vector<float> x(kSizes[2]), y(kSizes[2]);
            for (size_t i = 0; i < x.size(); i++) x[i] = valf(0, i);
            NCCL_OK(ncclGroupStart());
            NCCL_OK(ncclAllReduce(x.data(), y.data(), x.size(), ncclFloat32, ncclSum, c, nullptr));
            NCCL_OK(ncclGroupEnd());
            CHECK(memcmp(x.data(), y.data(), x.size() * 4) == 0, "1-rank out-of-place allreduce");
            NCCL_OK(ncclAllReduce(x.data(), x.data(), x.size(), ncclFloat32, ncclAvg, c, nullptr));
            CHECK(memcmp(x.data(), y.data(), x.size() * 4) == 0, "1-rank in-place allreduce");
            ncclResult_t ae = ncclInternalError;
            NCCL_OK(ncclCommGetAsyncError(c, &ae));
            CHECK(ae == ncclSuccess, "async error %d", (int)ae);
            ncclUniqueId bad;
            memset(&bad, 0, sizeof bad);
            ncclComm_t c2;
            CHECK(ncclCommInitRank(&c2, 2, bad, 0) == ncclInvalidArgument, "init with a zero id");
            CHECK(ncclCommInitRank(&c2, 2, id, 2) == ncclInvalidArgument, "init with rank 2 of 2");
            NCCL_OK(ncclCommDestroy(c));
            return 0;
        });
        report("queries_and_single_rank", all_ok(1), 1);
    }
}

void allreduce_fp32_sum()
{
    { /* all-reduce sum of fp32: sizes 1 / odd / 3 chunks, out of place then in place */
        const ncclUniqueId id = new_id();
        run_procs(R, [&](int me) {
            ncclComm_t c;
            NCCL_OK(ncclCommInitRank(&c, R, id, me));
            int n = 0, r = -1;
            NCCL_OK(ncclCommCount(c, &n));
            NCCL_OK(ncclCommUserRank(c, &r));
            CHECK(n == R && r == me, "count %d rank %d", n, r);
            uint64_t h = 0;
            for (size_t count : kSizes)
                for (int inplace = 0; inplace < 2; inplace++) {
                    std::vector<float> x(count), y(count, NAN), want(count);
                    for (size_t i = 0; i < count; i++) {
                        x[i] = valf(me, i);
                        want[i] = valf(0, i);
                        for (int q = 1; q < R; q++) want[i] += valf(q, i); /* rank order */
                    }
                    float *out = inplace ? x.data() : y.data();
                    NCCL_OK(ncclAllReduce(x.data(), out, count, ncclFloat32, ncclSum, c, nullptr));
                    CHECK(memcmp(out, want.data(), count * 4) == 0, "fp32 sum count %zu inplace %d differs", count,
                          inplace);
                    if (!inplace) CHECK(x[0] == valf(me, 0), "out-of-place allreduce changed sendbuff");
                    h = fnv(out, count * 4, h ^ count);
                }
            g_sh->hash[me] = h;
            NCCL_OK(ncclCommDestroy(c));
            return 0;
        });
        report("allreduce_fp32_sum", all_ok(R) && same_hash(R), R);
    }
}

void allreduce_fp64_int64_uint64_int32_bf16_max_min_avg()
{
    { /* fp64 / int64 / uint64 / int32 / bf16 sums, fp32 max/min, int32 min, fp32 avg */
        const ncclUniqueId id = new_id();
        run_procs(R, [&](int me) {
            ncclComm_t c;
            NCCL_OK(ncclCommInitRank(&c, R, id, me));
            uint64_t h = 0;
            for (size_t count : {(size_t)1, (size_t)777, (size_t)600001}) { /* fp64: 600001 = 2 chunks */
                std::vector<double> d(count), dw(count);
                std::vector<int64_t> l(count), lw(count);
                std::vector<uint64_t> u(count), uw(count);
                std::vector<int32_t> s(count), sw(count), smin(count);
                std::vector<float> f(count), fmax(count), fmin(count), fmaxw(count), fminw(count), favg(count),
                    favgw(count);
                std::vector<__nv_bfloat16> b(count), bw(count);
                for (size_t i = 0; i < count; i++) {
                    d[i] = vald(me, i), l[i] = vali(me, i), u[i] = (uint64_t)vali(me, i) * 3u;
                    s[i] = (int32_t)(vali(me, i) % 100000), f[i] = valf(me, i);
                    b[i] = __float2bfloat16(valf(me, i));
                    dw[i] = vald(0, i), lw[i] = vali(0, i), uw[i] = (uint64_t)vali(0, i) * 3u;
                    sw[i] = (int32_t)(vali(0, i) % 100000), fmaxw[i] = fminw[i] = favgw[i] = valf(0, i);
                    bw[i] = __float2bfloat16(valf(0, i));
                    int32_t smw = sw[i];
                    for (int q = 1; q < R; q++) {
                        dw[i] += vald(q, i), lw[i] += vali(q, i), uw[i] += (uint64_t)vali(q, i) * 3u;
                        const int32_t sq = (int32_t)(vali(q, i) % 100000);
                        sw[i] += sq, smw = sq < smw ? sq : smw;
                        fmaxw[i] = std::fmax(fmaxw[i], valf(q, i)), fminw[i] = std::fmin(fminw[i], valf(q, i));
                        favgw[i] += valf(q, i);
                        bw[i] = __float2bfloat16(__bfloat162float(bw[i]) + __bfloat162float(__float2bfloat16(valf(q, i))));
                    }
                    smin[i] = smw;
                    favgw[i] /= (float)R;
                }
                NCCL_OK(ncclAllReduce(d.data(), d.data(), count, ncclFloat64, ncclSum, c, nullptr));
                NCCL_OK(ncclAllReduce(l.data(), l.data(), count, ncclInt64, ncclSum, c, nullptr));
                NCCL_OK(ncclAllReduce(u.data(), u.data(), count, ncclUint64, ncclSum, c, nullptr));
                std::vector<int32_t> s2 = s;
                NCCL_OK(ncclAllReduce(s.data(), s.data(), count, ncclInt32, ncclSum, c, nullptr));
                NCCL_OK(ncclAllReduce(s2.data(), s2.data(), count, ncclInt32, ncclMin, c, nullptr));
                NCCL_OK(ncclAllReduce(f.data(), fmax.data(), count, ncclFloat32, ncclMax, c, nullptr));
                NCCL_OK(ncclAllReduce(f.data(), fmin.data(), count, ncclFloat32, ncclMin, c, nullptr));
                NCCL_OK(ncclAllReduce(f.data(), favg.data(), count, ncclFloat32, ncclAvg, c, nullptr));
                NCCL_OK(ncclAllReduce(b.data(), b.data(), count, ncclBfloat16, ncclSum, c, nullptr));
                CHECK(memcmp(d.data(), dw.data(), count * 8) == 0, "fp64 sum, count %zu", count);
                CHECK(l == lw, "int64 sum, count %zu", count);
                CHECK(u == uw, "uint64 sum, count %zu", count);
                CHECK(s == sw, "int32 sum, count %zu", count);
                CHECK(s2 == smin, "int32 min, count %zu", count);
                CHECK(memcmp(fmax.data(), fmaxw.data(), count * 4) == 0, "fp32 max, count %zu", count);
                CHECK(memcmp(fmin.data(), fminw.data(), count * 4) == 0, "fp32 min, count %zu", count);
                CHECK(memcmp(favg.data(), favgw.data(), count * 4) == 0, "fp32 avg, count %zu", count);
                CHECK(memcmp(b.data(), bw.data(), count * 2) == 0, "bf16 sum, count %zu", count);
                h = fnv(d.data(), count * 8, h);
                h = fnv(fmax.data(), count * 4, h);
                h = fnv(b.data(), count * 2, h);
            }
            g_sh->hash[me] = h;
            NCCL_OK(ncclCommDestroy(c));
            return 0;
        });
        report("allreduce_fp64_int64_uint64_int32_bf16_max_min_avg", all_ok(R) && same_hash(R), R);
    }
}

void allgather_broadcast_reducescatter()
{
    { /* all-gather (out of place and in place), broadcast (root 1; out of place and in place),
       * reduce-scatter; the large size needs 3 chunks */
        const ncclUniqueId id = new_id();
        run_procs(R, [&](int me) {
            ncclComm_t c;
            NCCL_OK(ncclCommInitRank(&c, R, id, me));
            uint64_t h = 0;
            for (size_t count : kSizes) {
                std::vector<float> x(count), g(count * R, NAN), gi(count * R, NAN), want(count * R);
                for (size_t i = 0; i < count; i++) x[i] = valf(me, i);
                for (int q = 0; q < R; q++)
                    for (size_t i = 0; i < count; i++) want[(size_t)q * count + i] = valf(q, i);
                NCCL_OK(ncclAllGather(x.data(), g.data(), count, ncclFloat32, c, nullptr));
                CHECK(memcmp(g.data(), want.data(), count * R * 4) == 0, "allgather count %zu", count);
                memcpy(gi.data() + (size_t)me * count, x.data(), count * 4);
                NCCL_OK(ncclAllGather(gi.data() + (size_t)me * count, gi.data(), count, ncclFloat32, c, nullptr));
                CHECK(memcmp(gi.data(), want.data(), count * R * 4) == 0, "in-place allgather count %zu", count);

                std::vector<float> bo(count, NAN), bi = x;
                NCCL_OK(ncclBroadcast(x.data(), bo.data(), count, ncclFloat32, 1, c, nullptr));
                NCCL_OK(ncclBroadcast(bi.data(), bi.data(), count, ncclFloat32, 1, c, nullptr));
                CHECK(memcmp(bo.data(), want.data() + count, count * 4) == 0, "broadcast count %zu", count);
                CHECK(memcmp(bi.data(), want.data() + count, count * 4) == 0, "in-place broadcast count %zu", count);

                std::vector<double> rs(count * R), ro(count, NAN), rw(count);
                for (size_t i = 0; i < count * R; i++) rs[i] = vald(me, i);
                for (size_t i = 0; i < count; i++) {
                    rw[i] = vald(0, (size_t)me * count + i);
                    for (int q = 1; q < R; q++) rw[i] += vald(q, (size_t)me * count + i);
                }
                NCCL_OK(ncclReduceScatter(rs.data(), ro.data(), count, ncclFloat64, ncclSum, c, nullptr));
                CHECK(memcmp(ro.data(), rw.data(), count * 8) == 0, "reduce-scatter count %zu", count);
                NCCL_OK(ncclReduceScatter(rs.data(), rs.data() + (size_t)me * count, count, ncclFloat64, ncclSum, c,
                                          nullptr));
                CHECK(memcmp(rs.data() + (size_t)me * count, rw.data(), count * 8) == 0,
                      "in-place reduce-scatter count %zu", count);
                h = fnv(g.data(), count * R * 4, h);
                h = fnv(bo.data(), count * 4, h);
            }
            g_sh->hash[me] = h;
            NCCL_OK(ncclCommDestroy(c));
            return 0;
        });
        report("allgather_broadcast_reducescatter", all_ok(R) && same_hash(R), R);
    }
}

void init_duplicate_rank_fails()
{
    /* The failure cases: every process must return an error (exit 0 = got the expected error). */
    { /* ranks 0, 1, 1 of 3: the duplicate fails with ncclInvalidUsage, the others stop too. (The
       * duplicate comes last: a process that comes after the failure would wait for its timeout.) */
        const ncclUniqueId id = new_id();
        run_procs(3, [&](int me) {
            setenv("NCCL_EMU_TIMEOUT_S", "10", 1);
            if (me == 2) usleep(300000);
            ncclComm_t c;
            const ncclResult_t r = ncclCommInitRank(&c, 3, id, me == 2 ? 1 : me);
            snprintf(g_sh->msg[me], sizeof g_sh->msg[me], "(expected) %s: %s", ncclGetErrorString(r),
                     ncclGetLastError(nullptr));
            g_sh->hash[me] = (uint64_t)r;
            return r != ncclSuccess ? 0 : 1;
        });
        bool usage = false;
        for (int r = 0; r < 3; r++) usage |= g_sh->hash[r] == (uint64_t)ncclInvalidUsage;
        report("init_duplicate_rank_fails", all_ok(3) && usage, 3);
    }
}

void init_mismatched_nranks_fails()
{
    { /* nranks 2 and 3 with one id */
        const ncclUniqueId id = new_id();
        run_procs(2, [&](int me) {
            setenv("NCCL_EMU_TIMEOUT_S", "30", 1);
            ncclComm_t c;
            const ncclResult_t r = ncclCommInitRank(&c, 2 + me, id, me);
            snprintf(g_sh->msg[me], sizeof g_sh->msg[me], "(expected) %s: %s", ncclGetErrorString(r),
                     ncclGetLastError(nullptr));
            return r == ncclInvalidUsage || r == ncclRemoteError ? 0 : 1;
        });
        report("init_mismatched_nranks_fails", all_ok(2), 2);
    }
}

void init_missing_rank_times_out()
{
    { /* ranks 0 and 1 of 3; rank 2 never comes: both time out after NCCL_EMU_TIMEOUT_S = 1 */
        const ncclUniqueId id = new_id();
        run_procs(2, [&](int me) {
            setenv("NCCL_EMU_TIMEOUT_S", "1", 1);
            const auto t0 = std::chrono::steady_clock::now();
            ncclComm_t c;
            const ncclResult_t r = ncclCommInitRank(&c, 3, id, me);
            const double s = std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
            snprintf(g_sh->msg[me], sizeof g_sh->msg[me], "(expected) %s after %.1f s: %s", ncclGetErrorString(r), s,
                     ncclGetLastError(nullptr));
            return r != ncclSuccess && s > 0.9 && s < 20 && strstr(g_sh->msg[me], "timed out") ? 0 : 1;
        });
        report("init_missing_rank_times_out", all_ok(2), 2);
    }
}

void dead_rank_fails_collective()
{
    { /* rank 2 exits after init; the all-reduce of ranks 0 and 1 fails long before the timeout */
        const ncclUniqueId id = new_id();
        run_procs(3, [&](int me) {
            setenv("NCCL_EMU_TIMEOUT_S", "60", 1);
            ncclComm_t c;
            NCCL_OK(ncclCommInitRank(&c, 3, id, me));
            if (me == 2) return 0;
            const auto t0 = std::chrono::steady_clock::now();
            std::vector<float> x(1000, 1.0f);
            const ncclResult_t r = ncclAllReduce(x.data(), x.data(), x.size(), ncclFloat32, ncclSum, c, nullptr);
            const double s = std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
            snprintf(g_sh->msg[me], sizeof g_sh->msg[me], "(expected) %s after %.1f s: %s", ncclGetErrorString(r), s,
                     ncclGetLastError(nullptr));
            ncclResult_t ae = ncclSuccess;
            NCCL_OK(ncclCommGetAsyncError(c, &ae));
            const ncclResult_t again = ncclAllReduce(x.data(), x.data(), 1, ncclFloat32, ncclSum, c, nullptr);
            ncclCommDestroy(c);
            return r == ncclRemoteError && ae == ncclRemoteError && again != ncclSuccess && s < 10 ? 0 : 1;
        });
        report("dead_rank_fails_collective", all_ok(3), 3);
    }
}

void abort_fails_the_others()
{
    { /* rank 1 aborts; then rank 0's broadcast fails */
        const ncclUniqueId id = new_id();
        run_procs(2, [&](int me) {
            setenv("NCCL_EMU_TIMEOUT_S", "60", 1);
            ncclComm_t c;
            NCCL_OK(ncclCommInitRank(&c, 2, id, me));
            std::vector<int64_t> x(10, me);
            NCCL_OK(ncclAllReduce(x.data(), x.data(), x.size(), ncclInt64, ncclSum, c, nullptr));
            CHECK(x[9] == 1, "int64 sum %lld", (long long)x[9]);
            if (me == 1) {
                NCCL_OK(ncclCommAbort(c));
                sleep(2); /* still alive: rank 0 must notice the abort, not the exit */
                return 0;
            }
            const ncclResult_t r = ncclBroadcast(x.data(), x.data(), x.size(), ncclInt64, 0, c, nullptr);
            snprintf(g_sh->msg[me], sizeof g_sh->msg[me], "(expected) %s: %s", ncclGetErrorString(r),
                     ncclGetLastError(nullptr));
            ncclCommDestroy(c);
            return r == ncclRemoteError && strstr(g_sh->msg[me], "ncclCommAbort") ? 0 : 1;
        });
        report("abort_fails_the_others", all_ok(2), 2);
    }
}

void nonblocking_init_and_collectives()
{
    { /* non-blocking: init and collectives return ncclInProgress, complete through the stream */
        const ncclUniqueId id = new_id();
        run_procs(2, [&](int me) {
            setenv("NCCL_EMU_TIMEOUT_S", "60", 1);
            ncclComm_t c;
            NCCL_OK(init_nonblocking(&c, 2, id, me));
            cudaStream_t s;
            CHECK(cudaStreamCreate(&s) == cudaSuccess, "cudaStreamCreate");
            const size_t count = kSizes[2];
            std::vector<float> x(count), want(count);
            for (size_t i = 0; i < count; i++) {
                x[i] = valf(me, i);
                want[i] = valf(0, i) + valf(1, i);
            }
            ncclResult_t r = ncclAllReduce(x.data(), x.data(), count, ncclFloat32, ncclSum, c, s);
            CHECK(r == ncclInProgress, "non-blocking ncclAllReduce returned %s", ncclGetErrorString(r));
            cudaError_t q;
            const auto t0 = std::chrono::steady_clock::now();
            while ((q = cudaStreamQuery(s)) == cudaErrorNotReady && secs_since(t0) < 60) {
                NCCL_OK(ncclCommGetAsyncError(c, &r));
                CHECK(r == ncclSuccess || r == ncclInProgress, "async error %s", ncclGetErrorString(r));
                usleep(200);
            }
            CHECK(q == cudaSuccess, "cudaStreamQuery %d", (int)q);
            CHECK(memcmp(x.data(), want.data(), count * 4) == 0, "non-blocking fp32 sum differs");
            std::vector<double> d(5, 1.0 + me);
            r = ncclAllReduce(d.data(), d.data(), d.size(), ncclFloat64, ncclSum, c, s);
            CHECK(r == ncclInProgress, "second ncclAllReduce returned %s", ncclGetErrorString(r));
            CHECK(cudaStreamSynchronize(s) == cudaSuccess && d[4] == 3.0, "after sync: %g", d[4]);
            NCCL_OK(ncclCommDestroy(c));
            cudaStreamDestroy(s);
            return 0;
        });
        report("nonblocking_init_and_collectives", all_ok(2), 2);
    }
}

/* rank 1 dies after init; rank 0's collective is stuck (hang: NCCL_EMU_PEER_LOSS=hang) */
template <int hang>
void nonblocking_peer_loss()
{
    {
        const ncclUniqueId id = new_id();
        run_procs(2, [&](int me) {
            setenv("NCCL_EMU_TIMEOUT_S", hang ? "0" : "60", 1);
            if (hang) setenv("NCCL_EMU_PEER_LOSS", "hang", 1);
            ncclComm_t c;
            NCCL_OK(init_nonblocking(&c, 2, id, me));
            if (me == 1) _exit(0);
            cudaStream_t s;
            CHECK(cudaStreamCreate(&s) == cudaSuccess, "cudaStreamCreate");
            std::vector<float> x(1000, 1.0f);
            ncclResult_t r = ncclAllReduce(x.data(), x.data(), x.size(), ncclFloat32, ncclSum, c, s), ae = ncclSuccess;
            CHECK(r == ncclInProgress, "ncclAllReduce returned %s", ncclGetErrorString(r));
            /* detect: the dead peer shows up as an async error; hang (NCCL in one node): nothing
             * shows for 1.5 s. Either way the stream stays busy: the collective is stuck. */
            const auto t0 = std::chrono::steady_clock::now();
            while (secs_since(t0) < (hang ? 1.5 : 30)) {
                NCCL_OK(ncclCommGetAsyncError(c, &ae));
                CHECK(cudaStreamQuery(s) == cudaErrorNotReady, "the stuck collective completed");
                if (ae != ncclSuccess) break;
                usleep(1000);
            }
            CHECK(hang ? ae == ncclSuccess : ae == ncclRemoteError, "async error %s after %.1f s (hang %d): %s",
                  ncclGetErrorString(ae), secs_since(t0), hang, ncclGetLastError(c));
            const auto t1 = std::chrono::steady_clock::now();
            NCCL_OK(ncclCommAbort(c));
            CHECK(cudaStreamQuery(s) == cudaSuccess, "the stream is still busy after ncclCommAbort");
            CHECK(secs_since(t1) < 10, "ncclCommAbort took %.1f s", secs_since(t1));
            cudaStreamDestroy(s);
            return 0;
        });
        report(hang ? "nonblocking_abort_ends_a_hang" : "nonblocking_dead_peer_is_an_async_error", all_ok(2), 2);
    }
}

void mismatched_count_fails()
{
    { /* different counts, then a different call: ncclInvalidUsage on every rank, no hang */
        const ncclUniqueId id = new_id();
        run_procs(2, [&](int me) {
            setenv("NCCL_EMU_TIMEOUT_S", "60", 1);
            ncclComm_t c;
            NCCL_OK(ncclCommInitRank(&c, 2, id, me));
            std::vector<float> x(20, 1.0f), y(40);
            const ncclResult_t r = ncclAllReduce(x.data(), x.data(), 10 + (size_t)me, ncclFloat32, ncclSum, c, nullptr);
            snprintf(g_sh->msg[me], sizeof g_sh->msg[me], "(expected) %s: %s", ncclGetErrorString(r),
                     ncclGetLastError(nullptr));
            ncclCommDestroy(c);
            return r == ncclInvalidUsage ? 0 : 1;
        });
        report("mismatched_count_fails", all_ok(2), 2);
    }
}

void no_shm_left_behind()
{
    /* nothing left in /dev/shm by this test's ids (others' bt-nccl-emu-* entries are only shown) */
    {
        bool ok = true;
        for (const std::string &n : g_names) {
            struct stat st;
            if (stat(("/dev/shm/" + n).c_str(), &st) == 0) {
                printf("    left behind: /dev/shm/%s\n", n.c_str());
                ok = false;
            }
        }
        if (DIR *d = opendir("/dev/shm")) {
            while (dirent *e = readdir(d))
                if (strncmp(e->d_name, "bt-nccl-emu-", 12) == 0) printf("    note: /dev/shm/%s exists\n", e->d_name);
            closedir(d);
        }
        report("no_shm_left_behind", ok, 0);
    }
}

/* cmocka case: runs fn, then fails when one of its reports did (after fn returned, so that its
 * locals are destroyed). */
template <void (*fn)()>
void run_case(void **)
{
    g_case_ok = true;
    fn();
    if (!g_case_ok)
        fail_msg("a report failed (the lines above)");
}
#define CASE(fn) {#fn, run_case<fn>, nullptr, nullptr, nullptr}

} // namespace

int main()
{
    setvbuf(stdout, nullptr, _IOLBF, 0);
    g_sh = (Shared *)mmap(nullptr, sizeof(Shared), PROT_READ | PROT_WRITE, MAP_SHARED | MAP_ANONYMOUS, -1, 0);
    const auto t_start = std::chrono::steady_clock::now();
    const struct CMUnitTest tests[] = {
        CASE(queries_and_single_rank),
        CASE(allreduce_fp32_sum),
        CASE(allreduce_fp64_int64_uint64_int32_bf16_max_min_avg),
        CASE(allgather_broadcast_reducescatter),
        CASE(init_duplicate_rank_fails),
        CASE(init_mismatched_nranks_fails),
        CASE(init_missing_rank_times_out),
        CASE(dead_rank_fails_collective),
        CASE(abort_fails_the_others),
        CASE(nonblocking_init_and_collectives),
        {"nonblocking_dead_peer_is_an_async_error", run_case<nonblocking_peer_loss<0>>, nullptr,
         nullptr, nullptr},
        {"nonblocking_abort_ends_a_hang", run_case<nonblocking_peer_loss<1>>, nullptr, nullptr,
         nullptr},
        CASE(mismatched_count_fails),
        CASE(no_shm_left_behind),
    };
    const int n = (int)(sizeof tests / sizeof tests[0]);
    const int failed = cmocka_run_group_tests_name("test_nccl_emu", tests, nullptr, nullptr);
    const double secs = std::chrono::duration<double>(std::chrono::steady_clock::now() - t_start).count();
    printf("test_nccl_emu: %d passed, %d failed, 0 skipped (%.1f s)\n", n - failed, failed, secs);
    return failed ? 1 : 0;
}
