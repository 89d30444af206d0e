/* NCCL for the CPU CUDA emulator (tests/emu/README.md, "NCCL"): the subset of the real
 * $(CUDA_HOME)/include/nccl.h API that data-parallel training uses, across PROCESSES (one per rank)
 * on one machine. Device pointers are host pointers in the emulator.
 *
 * Blocking communicators (ncclCommInitRank, or ncclCommInitRankConfig with config->blocking != 0)
 * run every call synchronously (streams are ignored): a collective returns with its result in
 * recvbuff. Non-blocking ones (ncclCommInitRankConfig with config->blocking == 0, NCCL's mode for
 * fault tolerance) behave like NCCL's: init returns ncclInProgress and ncclCommGetAsyncError says
 * ncclInProgress until every rank has joined; a collective returns ncclInProgress once enqueued
 * and runs on the communicator's own thread (the "GPU"), holding its stream until it completes
 * (tests/emu/cuda_emu.cpp bt_emu_stream_hold: cudaStreamQuery is cudaErrorNotReady meanwhile, and
 * later work on the stream waits for it); a failure sets the communicator's async error and keeps
 * the stream held (NCCL kernels keep spinning) until ncclCommAbort, which ends the communicator's
 * waits at once, from any thread.
 *
 * ncclCommInitRank attaches to the POSIX shared memory "/bt-nccl-emu-<hex of the id>", created
 * zero-filled by the first rank; once all ranks are attached each one unlinks the name, so nothing
 * stays in /dev/shm. Layout: [0, kHdr) Hdr (init counters, barrier, first failure, per-rank pid and
 * call descriptor), then one 4 MiB data slot per rank. A collective, chunked through the slots:
 * write my chunk into my slot, barrier, read the slots (reductions in rank order 0..n-1, so every
 * rank gets bit-identical results), barrier. The barrier is sense-reversing on a generation counter
 * (spin, sched_yield, then nanosleep). Every wait returns an error on a failure another rank
 * recorded, on a peer process that died, on ncclCommAbort, or after NCCL_EMU_TIMEOUT_S seconds
 * (default 120, 0 = never); the failing rank records why in the segment and the others return
 * ncclRemoteError. NCCL_EMU_PEER_LOSS=hang emulates NCCL within one node (shared memory, NVLink)
 * instead: a peer that dies or is stopped, or aborts its communicator, is noticed by nobody, and
 * the others wait until their own ncclCommAbort (or NCCL_EMU_TIMEOUT_S). The message is in
 * ncclGetLastError, and on stderr when NCCL_DEBUG is set. nranks == 1: no shm. */
#include <nccl.h>

#include <atomic>
#include <cerrno>
#include <condition_variable>
#include <cstdarg>
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <ctime>
#include <deque>
#include <functional>
#include <mutex>
#include <thread>
#include <type_traits>

#include <fcntl.h>
#include <sched.h>
#include <signal.h>
#include <sys/mman.h>
#include <sys/random.h>
#include <sys/stat.h>
#include <unistd.h>

namespace {

constexpr int kMaxRanks = 256;
constexpr size_t kSlot = (size_t)4 << 20;
constexpr char kTag[16] = "bt-nccl-emu-id"; /* id bytes 0..15; 16..31 random */
using A32 = std::atomic<uint32_t>;
static_assert(A32::is_always_lock_free, "shared-memory atomics must be lock-free");

enum Kind : uint32_t { kAllReduce = 1, kBroadcast, kAllGather, kReduceScatter };
const char *const kKindName[] = {"?", "ncclAllReduce", "ncclBroadcast", "ncclAllGather", "ncclReduceScatter"};
struct OpDesc { /* the call a rank is in; all ranks must agree (compared with memcmp: no padding) */
    uint64_t seq, count;
    uint32_t kind, dtype, op;
    int32_t root;
};
struct Hdr {
    A32 nranks; /* set by the creator; 0 = not yet */
    A32 arrived, bar_count, bar_gen;
    A32 fail_code, fail_ready; /* the first failure: its code, then why[] is complete */
    char why[400];
    A32 taken[kMaxRanks];
    int32_t pid[kMaxRanks];
    OpDesc desc[kMaxRanks];
};
constexpr size_t kHdr = (sizeof(Hdr) + 4095) / 4096 * 4096;

thread_local char g_last[512] = "";

/* tests/emu/cuda_emu.cpp when linked (emulated programs); absent in test_nccl_emu */
extern "C" void bt_emu_stream_hold(cudaStream_t s, int delta) __attribute__((weak));
void stream_hold(cudaStream_t s, int delta)
{
    if (bt_emu_stream_hold) bt_emu_stream_hold(s, delta);
}

bool peer_loss_hangs() /* NCCL_EMU_PEER_LOSS=hang: nothing notices a lost peer */
{
    const char *e = getenv("NCCL_EMU_PEER_LOSS");
    return e && !strcmp(e, "hang");
}

double now_s()
{
    timespec ts;
    clock_gettime(CLOCK_MONOTONIC, &ts);
    return (double)ts.tv_sec + 1e-9 * (double)ts.tv_nsec;
}

double timeout_s()
{
    const char *e = getenv("NCCL_EMU_TIMEOUT_S");
    return e && *e ? atof(e) : 120.0;
}

bool process_dead(int pid) /* gone, or a zombie nobody reaped yet */
{
    if (pid <= 0) return false;
    if (kill(pid, 0) != 0 && errno == ESRCH) return true;
    char path[64], buf[512];
    snprintf(path, sizeof path, "/proc/%d/stat", pid);
    FILE *f = fopen(path, "r");
    if (!f) return false;
    buf[fread(buf, 1, sizeof buf - 1, f)] = 0;
    fclose(f);
    const char *p = strrchr(buf, ')'); /* "pid (comm) S ..." */
    return p && p[1] == ' ' && (p[2] == 'Z' || p[2] == 'X');
}

} // namespace

struct ncclComm {
    Hdr *h = nullptr;
    size_t map_bytes = 0;
    int n = 0, rank = 0;
    uint64_t seq = 0;
    std::atomic<ncclResult_t> err{ncclSuccess}; /* sticky: a failed communicator stays failed */
    char name[64] = "";                         /* the shm name until every rank is attached */
    char *slot(int r) const { return (char *)h + kHdr + (size_t)r * kSlot; }
    /* non-blocking mode: calls run in order on `worker` */
    bool nonblocking = false;
    std::atomic<bool> init_done{true}, aborting{false};
    std::mutex mu; /* guards queue, quit, stuck, why */
    std::condition_variable cv;
    std::deque<std::pair<std::function<ncclResult_t()>, cudaStream_t>> queue;
    std::vector<cudaStream_t> stuck; /* streams held by failed calls, released by ncclCommAbort */
    bool quit = false;
    std::thread worker;
    char why[512] = ""; /* the communicator's last error, for ncclGetLastError(comm) */
};

namespace {

/* Sets the error of c (and ncclGetLastError); shared: also record it in the segment (the first
 * failure wins) so that the other ranks stop waiting. During init, removes the shm name. */
ncclResult_t error(ncclComm *c, ncclResult_t code, bool shared, const char *fmt, ...)
    __attribute__((format(printf, 4, 5)));
ncclResult_t error(ncclComm *c, ncclResult_t code, bool shared, const char *fmt, ...)
{
    char msg[380];
    va_list ap;
    va_start(ap, fmt);
    vsnprintf(msg, sizeof msg, fmt, ap);
    va_end(ap);
    snprintf(g_last, sizeof g_last, "bt-nccl-emu rank %d: %s", c->rank, msg);
    if (getenv("NCCL_DEBUG")) fprintf(stderr, "%s\n", g_last);
    {
        std::lock_guard<std::mutex> lk(c->mu);
        snprintf(c->why, sizeof c->why, "%s", g_last);
    }
    uint32_t zero = 0;
    if (shared && c->n > 1 && c->h->fail_code.compare_exchange_strong(zero, (uint32_t)code)) {
        snprintf(c->h->why, sizeof c->h->why, "rank %d: %s", c->rank, msg);
        c->h->fail_ready.store(1, std::memory_order_release);
    }
    if (c->name[0]) shm_unlink(c->name);
    c->err = code;
    return code;
}

/* Waits until done(); fails on a recorded failure, a dead peer or the timeout. */
template <class F> ncclResult_t wait_until(ncclComm *c, F done, const char *what)
{
    const double t0 = now_s(), limit = timeout_s();
    double next_check = t0 + 0.05;
    const bool hang = peer_loss_hangs();
    for (unsigned spins = 0;; spins++) {
        if (done()) return ncclSuccess;
        if (c->aborting.load(std::memory_order_acquire))
            return error(c, ncclSystemError, false, "%s: the communicator was aborted (ncclCommAbort)", what);
        if (c->h->fail_code.load(std::memory_order_acquire) && !done()) {
            for (int i = 0; i < 10000 && !c->h->fail_ready.load(std::memory_order_acquire); i++) sched_yield();
            return error(c, ncclRemoteError, false, "%s aborted: %s", what,
                         c->h->fail_ready.load(std::memory_order_acquire) ? c->h->why : "another rank failed");
        }
        if (spins < 200) continue;
        if (spins < 2000) {
            sched_yield();
            continue;
        }
        const timespec ts = {0, 100000};
        nanosleep(&ts, nullptr);
        const double t = now_s();
        if (t < next_check) continue;
        next_check = t + 0.05;
        for (int r = 0; r < c->n && !hang; r++)
            if (r != c->rank && process_dead(c->h->pid[r]) && !done() && !c->h->fail_code.load())
                return error(c, ncclRemoteError, true, "rank %d (pid %d) exited while rank %d waited in %s", r,
                             c->h->pid[r], c->rank, what);
        if (limit > 0 && t - t0 > limit && !done() && !c->h->fail_code.load())
            return error(c, ncclSystemError, true, "timed out after %g s in %s (NCCL_EMU_TIMEOUT_S)", limit, what);
    }
}

ncclResult_t barrier(ncclComm *c, const char *what)
{
    if (c->n == 1) return ncclSuccess;
    Hdr *h = c->h;
    const uint32_t gen = h->bar_gen.load(std::memory_order_acquire);
    if (h->bar_count.fetch_add(1, std::memory_order_acq_rel) + 1 == (uint32_t)c->n) {
        h->bar_count.store(0, std::memory_order_relaxed);
        h->bar_gen.store(gen + 1, std::memory_order_release);
        return ncclSuccess;
    }
    return wait_until(c, [&] { return h->bar_gen.load(std::memory_order_acquire) != gen; }, what);
}

size_t dtype_size(ncclDataType_t t)
{
    switch (t) {
    case ncclInt8: case ncclUint8: return 1;
    case ncclFloat16: case ncclBfloat16: return 2;
    case ncclInt32: case ncclUint32: case ncclFloat32: return 4;
    case ncclInt64: case ncclUint64: case ncclFloat64: return 8;
    default: return 0;
    }
}

/* 16-bit floats are widened to float and rounded back after every step (like each hop of a ring);
 * integer sums and products wrap. */
template <class T> T ld(T v) { return v; }
float ld(__nv_bfloat16 v) { return __bfloat162float(v); }
float ld(__half v) { return __half2float(v); }
template <class T> void st(T &o, T v) { o = v; }
void st(__nv_bfloat16 &o, float v) { o = __float2bfloat16(v); }
void st(__half &o, float v) { o = __float2half(v); }

template <class A> A combine(A a, A b, ncclRedOp_t op)
{
    if constexpr (std::is_integral_v<A>) {
        using U = std::make_unsigned_t<A>;
        if (op == ncclSum || op == ncclAvg) return (A)(U)((U)a + (U)b);
        if (op == ncclProd) return (A)(U)((U)a * (U)b);
    } else {
        if (op == ncclSum || op == ncclAvg) return a + b;
        if (op == ncclProd) return a * b;
    }
    return op == ncclMax ? (b > a ? b : a) : (b < a ? b : a);
}

/* out[0, n) = op over the ranks 0..n-1, in that order, of slot_r[off, off + n) (elements). */
template <class T> void reduce_t(ncclComm *c, void *out, size_t off, size_t n, ncclRedOp_t op)
{
    using A = decltype(ld(T()));
    T *o = (T *)out;
    memcpy(o, (const T *)c->slot(0) + off, n * sizeof(T));
    for (int r = 1; r < c->n; r++) {
        const T *s = (const T *)c->slot(r) + off;
        for (size_t i = 0; i < n; i++) st(o[i], combine<A>(ld(o[i]), ld(s[i]), op));
    }
    if (op == ncclAvg)
        for (size_t i = 0; i < n; i++) st(o[i], (A)(ld(o[i]) / (A)c->n));
}

void reduce_slots(ncclComm *c, ncclDataType_t dt, void *out, size_t off, size_t n, ncclRedOp_t op)
{
    switch (dt) {
    case ncclInt8: return reduce_t<int8_t>(c, out, off, n, op);
    case ncclUint8: return reduce_t<uint8_t>(c, out, off, n, op);
    case ncclInt32: return reduce_t<int32_t>(c, out, off, n, op);
    case ncclUint32: return reduce_t<uint32_t>(c, out, off, n, op);
    case ncclInt64: return reduce_t<int64_t>(c, out, off, n, op);
    case ncclUint64: return reduce_t<uint64_t>(c, out, off, n, op);
    case ncclFloat16: return reduce_t<__half>(c, out, off, n, op);
    case ncclFloat32: return reduce_t<float>(c, out, off, n, op);
    case ncclFloat64: return reduce_t<double>(c, out, off, n, op);
    case ncclBfloat16: return reduce_t<__nv_bfloat16>(c, out, off, n, op);
    default: return;
    }
}

ncclResult_t no_comm(Kind kind)
{
    snprintf(g_last, sizeof g_last, "bt-nccl-emu: %s: comm is NULL", kKindName[kind]);
    return ncclInvalidArgument;
}

/* One collective: argument checks, then rounds of at most per_round elements (at least one round,
 * so the check that all ranks are in the same call always runs): fill(off, n) writes my slot,
 * barrier, drain(off, n) reads the slots, barrier (before the slots are reused). */
template <class Fill, class Drain>
ncclResult_t collective(ncclComm *c, Kind kind, size_t count, ncclDataType_t dt, ncclRedOp_t op, int root,
                        size_t per_round_bytes, Fill fill, Drain drain)
{
    const char *what = kKindName[kind];
    if (!c) {
        snprintf(g_last, sizeof g_last, "bt-nccl-emu: %s: comm is NULL", what);
        return ncclInvalidArgument;
    }
    if (c->err != ncclSuccess) return error(c, c->err, false, "%s on a communicator that failed earlier", what);
    if (dtype_size(dt) == 0 || ((kind == kAllReduce || kind == kReduceScatter) && (unsigned)op > (unsigned)ncclAvg))
        return error(c, ncclInvalidArgument, false, "%s: unsupported datatype %d / op %d", what, (int)dt, (int)op);
    if (root < 0 || root >= c->n) return error(c, ncclInvalidArgument, false, "%s: invalid root %d", what, root);
    const OpDesc me = {++c->seq, (uint64_t)count, kind, (uint32_t)dt, (uint32_t)op, root};
    c->h->desc[c->rank] = me;
    const size_t per_round = per_round_bytes / dtype_size(dt);
    size_t off = 0;
    do {
        const size_t n = count - off < per_round ? count - off : per_round;
        fill(off, n);
        if (ncclResult_t r = barrier(c, what)) return r;
        for (int q = 0; q < c->n && off == 0; q++) {
            const OpDesc &o = c->h->desc[q];
            if (memcmp(&o, &me, sizeof me) != 0)
                return error(c, ncclInvalidUsage, false,
                             "call #%llu differs: rank %d is in %s(count %llu, dtype %u, op %u, root %d), rank %d "
                             "in call #%llu %s(count %llu, dtype %u, op %u, root %d)",
                             (unsigned long long)me.seq, c->rank, what, (unsigned long long)count, me.dtype, me.op,
                             root, q, (unsigned long long)o.seq, kKindName[o.kind <= kReduceScatter ? o.kind : 0],
                             (unsigned long long)o.count, o.dtype, o.op, o.root);
        }
        drain(off, n);
        if (ncclResult_t r = barrier(c, what)) return r;
        off += n;
    } while (off < count);
    return ncclSuccess;
}

ncclResult_t init_rank(ncclComm *c, int nranks, const ncclUniqueId &id, int rank)
{
    if (nranks == 1) { /* no other process: private zero-filled memory */
        c->map_bytes = kHdr + kSlot;
        void *p = mmap(nullptr, c->map_bytes, PROT_READ | PROT_WRITE, MAP_PRIVATE | MAP_ANONYMOUS, -1, 0);
        if (p == MAP_FAILED) return error(c, ncclSystemError, false, "mmap: %s", strerror(errno));
        c->h = (Hdr *)p;
        return ncclSuccess;
    }
    int k = snprintf(c->name, sizeof c->name, "/bt-nccl-emu-");
    for (int i = 16; i < 32; i++) k += snprintf(c->name + k, sizeof c->name - (size_t)k, "%02x", (uint8_t)id.internal[i]);
    const double t0 = now_s(), limit = timeout_s();
    int fd;
    bool creator;
    for (;;) { /* a failing rank may unlink the name between the two opens: retry */
        fd = shm_open(c->name, O_RDWR | O_CREAT | O_EXCL, 0600);
        creator = fd >= 0;
        if (!creator && errno == EEXIST) fd = shm_open(c->name, O_RDWR, 0);
        if (fd >= 0) break;
        if (errno != ENOENT || (limit > 0 && now_s() - t0 > limit))
            return error(c, ncclSystemError, false, "shm_open %s: %s", c->name, strerror(errno));
    }
    struct stat st = {};
    if (creator && ftruncate(fd, (off_t)(kHdr + (size_t)nranks * kSlot)) != 0) st.st_size = -1;
    while (st.st_size == 0 && fstat(fd, &st) == 0 && st.st_size == 0 && (limit <= 0 || now_s() - t0 < limit))
        sched_yield(); /* for the creator's ftruncate */
    void *p = st.st_size > 0 ? mmap(nullptr, (size_t)st.st_size, PROT_READ | PROT_WRITE, MAP_SHARED, fd, 0) : MAP_FAILED;
    const int map_errno = errno;
    close(fd);
    if (p == MAP_FAILED)
        return error(c, ncclSystemError, false, "creating/mapping %s (size %lld): %s", c->name, (long long)st.st_size,
                     strerror(map_errno));
    c->h = (Hdr *)p;
    c->map_bytes = (size_t)st.st_size;
    Hdr *h = c->h;
    if (creator) h->nranks.store((uint32_t)nranks, std::memory_order_release);
    if (ncclResult_t r = wait_until(c, [&] { return h->nranks.load() != 0; }, "ncclCommInitRank")) return r;
    const int have = (int)h->nranks.load(std::memory_order_acquire);
    if (have != nranks || c->map_bytes != kHdr + (size_t)have * kSlot)
        return error(c, ncclInvalidUsage, true, "ncclCommInitRank: nranks %d, but another rank passed %d", nranks, have);
    if (h->taken[rank].exchange(1) != 0)
        return error(c, ncclInvalidUsage, true, "ncclCommInitRank: rank %d is used by two processes", rank);
    h->pid[rank] = (int32_t)getpid();
    h->arrived.fetch_add(1, std::memory_order_acq_rel);
    if (ncclResult_t r = wait_until(c, [&] { return h->arrived.load() == (uint32_t)nranks; },
                                    "ncclCommInitRank (waiting for all ranks)"))
        return r;
    shm_unlink(c->name); /* all attached: gone from /dev/shm (ENOENT for all but the first rank) */
    c->name[0] = 0;
    return ncclSuccess;
}

} // namespace

extern "C" {

ncclResult_t ncclGetVersion(int *version)
{
    if (!version) return ncclInvalidArgument;
    *version = NCCL_VERSION_CODE;
    return ncclSuccess;
}

ncclResult_t ncclGetUniqueId(ncclUniqueId *uniqueId)
{
    if (!uniqueId) return ncclInvalidArgument;
    memset(uniqueId, 0, sizeof *uniqueId);
    memcpy(uniqueId->internal, kTag, sizeof kTag);
    if (getrandom(uniqueId->internal + 16, 16, 0) == 16) return ncclSuccess;
    snprintf(g_last, sizeof g_last, "bt-nccl-emu: getrandom: %s", strerror(errno));
    return ncclSystemError;
}

namespace {

/* The non-blocking communicator's thread: runs the queued calls in order. A call that succeeds
 * releases its stream; one that fails keeps it held (ncclCommAbort releases it), and so do the
 * calls queued behind it, which fail at once on the sticky error. */
void worker_main(ncclComm *c)
{
    for (;;) {
        std::unique_lock<std::mutex> lk(c->mu);
        c->cv.wait(lk, [&] { return c->quit || !c->queue.empty(); });
        if (c->queue.empty()) return;
        auto job = std::move(c->queue.front());
        c->queue.pop_front();
        lk.unlock();
        const ncclResult_t r = job.first();
        lk.lock();
        if (r == ncclSuccess) stream_hold(job.second, -1);
        else c->stuck.push_back(job.second);
    }
}

/* Run `call` now (blocking communicator) or queue it on the communicator's thread holding
 * `stream` (non-blocking: returns ncclInProgress, or the sticky error of a failed one). */
ncclResult_t submit(ncclComm *c, cudaStream_t stream, std::function<ncclResult_t()> call)
{
    if (!c->nonblocking) return call();
    if (c->err != ncclSuccess) return c->err;
    stream_hold(stream, 1);
    {
        std::lock_guard<std::mutex> lk(c->mu);
        c->queue.emplace_back(std::move(call), stream);
    }
    c->cv.notify_one();
    return ncclInProgress;
}

/* Stops the communicator's thread: after the queued calls (drain) or at once (abort: waits end
 * with an error, calls not started are dropped); every stream still held is released. */
void stop_worker(ncclComm *c, bool drain)
{
    if (!c->worker.joinable()) return;
    if (!drain) c->aborting.store(true, std::memory_order_release);
    {
        std::lock_guard<std::mutex> lk(c->mu);
        c->quit = true;
        if (!drain)
            for (auto &q : c->queue) c->stuck.push_back(q.second);
        if (!drain) c->queue.clear();
    }
    c->cv.notify_all();
    c->worker.join();
    for (cudaStream_t s : c->stuck) stream_hold(s, -1);
    c->stuck.clear();
}

void comm_free(ncclComm *c)
{
    if (c->h) munmap(c->h, c->map_bytes);
    delete c;
}

ncclResult_t comm_init(ncclComm_t *comm, int nranks, const ncclUniqueId &id, int rank, bool nonblocking)
{
    if (!comm) return ncclInvalidArgument;
    ncclComm *c = new ncclComm;
    *comm = nullptr;
    c->n = nranks;
    c->rank = rank;
    if (nranks < 1 || nranks > kMaxRanks || rank < 0 || rank >= nranks) {
        const ncclResult_t r = error(c, ncclInvalidArgument, false, "ncclCommInitRank: rank %d of %d (at most %d ranks)",
                                     rank, nranks, kMaxRanks);
        comm_free(c);
        return r;
    }
    if (memcmp(id.internal, kTag, sizeof kTag) != 0) {
        const ncclResult_t r =
            error(c, ncclInvalidArgument, false, "ncclCommInitRank: the id does not come from ncclGetUniqueId");
        comm_free(c);
        return r;
    }
    if (!nonblocking) {
        const ncclResult_t r = init_rank(c, nranks, id, rank);
        if (r == ncclSuccess) *comm = c;
        else comm_free(c);
        return r;
    }
    /* NCCL's non-blocking init: the handle is valid at once, the joining happens meanwhile */
    c->nonblocking = true;
    c->init_done.store(false);
    c->worker = std::thread(worker_main, c);
    *comm = c;
    const ncclUniqueId idc = id;
    {
        std::lock_guard<std::mutex> lk(c->mu);
        c->queue.emplace_back(
            [c, nranks, idc, rank] {
                const ncclResult_t r = init_rank(c, nranks, idc, rank);
                c->init_done.store(true, std::memory_order_release);
                return r;
            },
            nullptr);
    }
    stream_hold(nullptr, 1); /* balanced by the worker (the init "runs" on the null stream) */
    c->cv.notify_one();
    return ncclInProgress;
}

} // namespace

ncclResult_t ncclCommInitRank(ncclComm_t *comm, int nranks, ncclUniqueId commId, int rank)
{
    return comm_init(comm, nranks, commId, rank, false);
}

/* config: only `blocking` is read (0 = non-blocking; NCCL_CONFIG_UNDEF_INT or 1 = blocking). */
ncclResult_t ncclCommInitRankConfig(ncclComm_t *comm, int nranks, ncclUniqueId commId, int rank, ncclConfig_t *config)
{
    return comm_init(comm, nranks, commId, rank, config && config->blocking == 0);
}

ncclResult_t ncclCommFinalize(ncclComm_t) { return ncclSuccess; }

/* Waits for the queued calls (like NCCL, it hangs if one never completes: use ncclCommAbort). */
ncclResult_t ncclCommDestroy(ncclComm_t comm)
{
    if (!comm) return ncclSuccess;
    stop_worker(comm, true);
    comm_free(comm);
    return ncclSuccess;
}

/* Ends the communicator's waits now (from any thread), tells the other ranks (their current or
 * next wait returns ncclRemoteError; not with NCCL_EMU_PEER_LOSS=hang), then destroys it. */
ncclResult_t ncclCommAbort(ncclComm_t comm)
{
    if (!comm) return ncclSuccess;
    stop_worker(comm, false);
    if (comm->err == ncclSuccess && comm->n > 1 && comm->h && !peer_loss_hangs())
        error(comm, ncclRemoteError, true, "ncclCommAbort was called");
    comm_free(comm);
    return ncclSuccess;
}

const char *ncclGetErrorString(ncclResult_t result)
{
    switch (result) {
    case ncclSuccess: return "no error";
    case ncclUnhandledCudaError: return "unhandled cuda error (run with NCCL_DEBUG=INFO for details)";
    case ncclSystemError: return "unhandled system error (run with NCCL_DEBUG=INFO for details)";
    case ncclInternalError: return "internal error - please report this issue to the NCCL developers";
    case ncclInvalidArgument: return "invalid argument (run with NCCL_DEBUG=WARN for details)";
    case ncclInvalidUsage: return "invalid usage (run with NCCL_DEBUG=WARN for details)";
    case ncclRemoteError: return "remote process exited or there was a network error";
    case ncclInProgress: return "NCCL operation in progress";
    default: return "unknown result code";
    }
}

/* The communicator's last error (its own thread's, in non-blocking mode), else the calling
 * thread's. */
const char *ncclGetLastError(ncclComm_t comm)
{
    if (comm) {
        std::lock_guard<std::mutex> lk(comm->mu);
        if (comm->why[0]) snprintf(g_last, sizeof g_last, "%s", comm->why);
    }
    return g_last;
}

#define BT_NCCL_GET(fn, T, expr)                                \
    ncclResult_t fn(const ncclComm_t comm, T *out)              \
    {                                                           \
        if (!comm || !out) return ncclInvalidArgument;          \
        *out = (expr);                                          \
        return ncclSuccess;                                     \
    }
/* the sticky error of a failed comm; ncclInProgress while a non-blocking init is joining */
BT_NCCL_GET(ncclCommGetAsyncError, ncclResult_t,
            comm->err != ncclSuccess ? comm->err.load() : comm->init_done.load() ? ncclSuccess : ncclInProgress)
BT_NCCL_GET(ncclCommCount, int, comm->n)
BT_NCCL_GET(ncclCommCuDevice, int, 0)
BT_NCCL_GET(ncclCommUserRank, int, comm->rank)

ncclResult_t ncclAllReduce(const void *sendbuff, void *recvbuff, size_t count, ncclDataType_t datatype,
                           ncclRedOp_t op, ncclComm_t comm, cudaStream_t stream)
{
    if (!comm) return no_comm(kAllReduce);
    return submit(comm, stream, [=] {
        const size_t es = dtype_size(datatype);
        return collective(
            comm, kAllReduce, count, datatype, op, 0, kSlot,
            [&](size_t off, size_t n) { memcpy(comm->slot(comm->rank), (const char *)sendbuff + off * es, n * es); },
            [&](size_t off, size_t n) { reduce_slots(comm, datatype, (char *)recvbuff + off * es, 0, n, op); });
    });
}

ncclResult_t ncclBroadcast(const void *sendbuff, void *recvbuff, size_t count, ncclDataType_t datatype, int root,
                           ncclComm_t comm, cudaStream_t stream)
{
    if (!comm) return no_comm(kBroadcast);
    return submit(comm, stream, [=] {
        const size_t es = dtype_size(datatype);
        return collective(
            comm, kBroadcast, count, datatype, ncclSum, root, kSlot,
            [&](size_t off, size_t n) {
                if (comm->rank == root) memcpy(comm->slot(root), (const char *)sendbuff + off * es, n * es);
            },
            [&](size_t off, size_t n) { memcpy((char *)recvbuff + off * es, comm->slot(root), n * es); });
    });
}

/* recvbuff[q * sendcount, +sendcount) = sendbuff of rank q; in place: sendbuff at my own part. */
ncclResult_t ncclAllGather(const void *sendbuff, void *recvbuff, size_t sendcount, ncclDataType_t datatype,
                           ncclComm_t comm, cudaStream_t stream)
{
    if (!comm) return no_comm(kAllGather);
    return submit(comm, stream, [=] {
        const size_t es = dtype_size(datatype);
        return collective(
            comm, kAllGather, sendcount, datatype, ncclSum, 0, kSlot,
            [&](size_t off, size_t n) { memcpy(comm->slot(comm->rank), (const char *)sendbuff + off * es, n * es); },
            [&](size_t off, size_t n) {
                for (int q = 0; q < comm->n; q++)
                    memmove((char *)recvbuff + ((size_t)q * sendcount + off) * es, comm->slot(q), n * es);
            });
    });
}

/* recvbuff = op over the ranks of their sendbuff[rank * recvcount, +recvcount). */
ncclResult_t ncclReduceScatter(const void *sendbuff, void *recvbuff, size_t recvcount, ncclDataType_t datatype,
                               ncclRedOp_t op, ncclComm_t comm, cudaStream_t stream)
{
    if (!comm) return no_comm(kReduceScatter);
    return submit(comm, stream, [=] {
        const size_t es = dtype_size(datatype), nr = (size_t)comm->n, per = es ? kSlot / es / nr : 0;
        return collective(
            comm, kReduceScatter, recvcount, datatype, op, 0, per * es,
            [&](size_t off, size_t n) {
                for (size_t q = 0; q < nr; q++)
                    memcpy(comm->slot(comm->rank) + q * per * es, (const char *)sendbuff + (q * recvcount + off) * es,
                           n * es);
            },
            [&](size_t off, size_t n) {
                reduce_slots(comm, datatype, (char *)recvbuff + off * es, (size_t)comm->rank * per, n, op);
            });
    });
}

/* Every call completes on its own (synchronously, or in order on a non-blocking communicator's
 * thread): groups have nothing to fuse. */
ncclResult_t ncclGroupStart() { return ncclSuccess; }
ncclResult_t ncclGroupEnd() { return ncclSuccess; }

} // extern "C"
