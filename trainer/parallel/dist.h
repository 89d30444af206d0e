/* Distributed-training bootstrap: who am I (rank / world discovery from the launcher's
 * environment) and a TCP rendezvous that hands rank 0's opaque blob (the 128-byte NCCL
 * ncclUniqueId, made by rank 0 before ncclCommInitRank) to every other rank, after checking that
 * every rank holds the job's secret and runs the same job; its connections then carry the
 * monitor (trainer/parallel/dist_monitor.h). Plain C with OpenSSL's libcrypto: no CUDA or NCCL here
 * (built in every build).
 *
 * Conventions followed (so the trainer runs unchanged under either launcher):
 * - torch.distributed "env://" rendezvous, as set by torchrun / torch.distributed.run:
 *   RANK (global rank), WORLD_SIZE (number of processes), LOCAL_RANK (rank on this node),
 *   MASTER_ADDR / MASTER_PORT (rank 0's host and TCP port; torch's default port is 29500).
 * - Slurm srun task environment (srun(1), "OUTPUT ENVIRONMENT VARIABLES"): SLURM_PROCID (global
 *   task id), SLURM_NTASKS (number of tasks), SLURM_LOCALID (task id on this node),
 *   SLURM_STEP_NODELIST / SLURM_JOB_NODELIST (compressed host lists, e.g. "gpu[01-04,07]"; task 0
 *   runs on the first host, which is therefore rank 0's address: bt_dist_master_resolve).
 * Caveat: the environment of an sbatch batch script itself (outside srun) may also carry
 * SLURM_PROCID=0 and, with --ntasks, SLURM_NTASKS; a trainer started there without srun then
 * believes it is rank 0 of N, and its rendezvous times out naming the ranks that never came.
 * Start one trainer per task with srun (scripts/train.sbatch does).
 *
 * Wire protocol (TCP, little-endian, fixed sizes; version BT_DIST_VERSION; trainer/parallel/dist_rdv.c):
 *   challenge, rank 0 -> a new connection (44 bytes): magic "BTDIST02", u32 version, nonce0[32]
 *   hello, rank r -> rank 0 (184 bytes): magic, u32 version, u32 rank, u32 world, u32 pid,
 *       host[64] (NUL-padded), digest[32], nonce1[32], mac[32] = HMAC-SHA256(key, "BTDIST02 hello"
 *       || nonce0 || the 152 bytes before mac)
 *   reply, rank 0 -> rank r (32 bytes + len): magic, u32 status (0 ok, else the negated bt_err of
 *       the failure: 6 invalid / refused, 8 timeout, ...), u32 len, tag[16], then len bytes:
 *       AES-256-GCM (IV 0, additional data: the first 16 bytes) under
 *       HMAC-SHA256(key, "BTDIST02 reply" || nonce0 || nonce1) of {blob, u32 pid of rank 0,
 *       host[64] of rank 0} (status 0) or of an error message. A hello whose mac is wrong gets
 *       status | 0x80000000 and a plain-text refusal (its sender cannot check a seal anyway).
 * key = HMAC-SHA256(job secret, "BarqTrain dist job key v2") (bt_dist_key_load). The nonces are
 * fresh (getrandom) per connection, so a recorded hello or reply is worth nothing later.
 * Rank 0 holds one connection per rank until every rank has said hello, so it needs about
 * world + 70 file descriptors (`ulimit -n`); running out fails with BT_ERR_IO saying so. */
#ifndef BT_TRAINER_DIST_H
#define BT_TRAINER_DIST_H
#include <stddef.h>
#include <stdint.h>

#define BT_DIST_VERSION 2u
#define BT_DIST_MAX_WORLD 65536
#define BT_DIST_BLOB_MAX 1024
#define BT_DIST_DEFAULT_PORT 29500 /* torch.distributed's default MASTER_PORT */
#define BT_DIST_KEY_BYTES 32
#define BT_DIST_SECRET_MIN 16   /* bytes of job secret, at least */
#define BT_DIST_SECRET_MAX 4096

/* The connections a rendezvous leaves open for the monitor (trainer/parallel/dist_monitor.h). */
typedef struct bt_dist_link bt_dist_link;
void bt_dist_link_free(bt_dist_link *l);

typedef struct {
    int rank;        /* global rank in [0, world) */
    int world;       /* number of processes, >= 1 */
    int local_rank;  /* rank on this node, in [0, world) */
    char source[16]; /* "torchrun" (RANK/WORLD_SIZE set), "slurm" (SLURM_PROCID/SLURM_NTASKS), or "single" */
} bt_dist_env;

/* Resolve rank / world / local rank from the environment, in this order:
 *   1. torchrun: RANK and WORLD_SIZE (either one set selects this source), LOCAL_RANK (default:
 *      the rank, i.e. one node); source "torchrun".
 *   2. Slurm: SLURM_PROCID and SLURM_NTASKS (either one set selects it), SLURM_LOCALID
 *      (default 0); source "slurm".
 *   3. neither: rank 0 of 1, local rank 0; source "single".
 * Values are plain decimal integers ("3"; no sign, spaces or suffix). *e is written only on
 * success. Returns 0, or BT_ERR_INVALID with a message naming the variable and its value when a
 * value is empty, not an integer, has trailing junk, is negative or too large, when world is 0
 * or above BT_DIST_MAX_WORLD, when rank >= world or local rank >= world, or when only one of a
 * pair is set (RANK without WORLD_SIZE and vice versa; SLURM_PROCID without SLURM_NTASKS and vice
 * versa). Pure getenv: no other side effects. */
int bt_dist_env_resolve(bt_dist_env *e);

/* Rank 0's address and port for bt_dist_rendezvous, from the environment and the job config
 * (trainer/config.h dist.master_addr / dist.master_port):
 *   addr: MASTER_ADDR if set and non-empty; else, when e is a multi-rank "slurm" environment, the
 *         first host of SLURM_STEP_NODELIST (else SLURM_JOB_NODELIST) if set, where task 0 runs
 *         under Slurm's default block distribution (so a config address is not used there: set
 *         MASTER_ADDR to override); else cfg_addr (NULL or "" -> "127.0.0.1").
 *   port: MASTER_PORT if set; else cfg_port if in [1, 65535]; else BT_DIST_DEFAULT_PORT.
 * e may be NULL (no Slurm look-up). addr receives a NUL-terminated copy (addr_size bytes
 * available; 256 holds any host name); *port is written on success only. Returns 0, or
 * BT_ERR_INVALID (MASTER_PORT not a plain integer in [1, 65535]; a host list that cannot be
 * parsed, see bt_dist_first_host; an address longer than addr_size - 1 bytes). */
int bt_dist_master_resolve(const bt_dist_env *e, const char *cfg_addr, int cfg_port, char *addr,
                           size_t addr_size, int *port);

/* First host name of a Slurm compressed host list: "gpu[01-04,07],cpu9" -> "gpu01",
 * "rack[1-2]-n[3,5]" -> "rack1-n3", "node7,node8" -> "node7". out gets a NUL-terminated string
 * (out_size bytes). Returns 0, or BT_ERR_INVALID (empty list or host, unbalanced or nested
 * brackets, an empty range, or the name does not fit). */
int bt_dist_first_host(const char *nodelist, char *out, size_t out_size);

/* 32-byte digest of data[0..n) that ranks compare to make sure they run the same job (the
 * caller hashes its effective config text). Four independent 64-bit lanes, each a chain of the
 * splitmix64 finaliser (common/rng.h bt_hash64) over the input's 8-byte little-endian words with
 * its own seed and word rotation, the length folded in at the end; out = the four lanes,
 * little-endian. Deterministic across hosts and builds. A consistency check against accidents
 * (different configs or versions), NOT a cryptographic hash: it gives no protection against
 * someone crafting a collision. data may be NULL when n == 0. */
void bt_dist_digest(const void *data, size_t n, uint8_t out[32]);

/* The job secret that authenticates the ranks of one run to each other, as a key for
 * bt_dist_rendezvous. From, in this order:
 *   secret_file (config dist.secret_file; NULL or "" = none): a regular file owned by this user
 *     and not readable or writable by group or others (mode 0600 / 0400), holding 16 to 4096
 *     bytes (trailing newlines and spaces ignored) -- a file only the user can read, shared by
 *     the nodes (home directory);
 *   the environment's BT_DIST_SECRET (16 to 4096 bytes): a per-job secret from the launcher
 *     (scripts/train.sbatch exports a fresh random one; every srun task inherits it).
 * key = HMAC-SHA256(secret, "BarqTrain dist job key v2") (OpenSSL). source (may be NULL) names
 * where it came from ("BT_DIST_SECRET" / "dist.secret_file PATH"). Errors (BT_ERR_INVALID, the
 * message says how to fix it): neither is set; too short or long; a file with group/other
 * permission bits (names the mode and `chmod 600 PATH`), owned by another user, or not a regular
 * file; BT_ERR_IO: the file cannot be read. The secret itself is never logged. */
int bt_dist_key_load(const char *secret_file, uint8_t key[BT_DIST_KEY_BYTES], char *source,
                     size_t source_size);

/* The CPUs Slurm gives this task, for the CPU backend's threads when `threads` is 0: 0 outside a
 * Slurm job (SLURM_JOB_ID unset); else SLURM_CPUS_PER_TASK when set (sbatch/srun
 * --cpus-per-task), else SLURM_CPUS_ON_NODE (the CPUs of the job step on this node) divided by
 * the tasks on this node (SLURM_STEP_TASKS_PER_NODE, else SLURM_TASKS_PER_NODE, "2(x3),1" form,
 * indexed by SLURM_NODEID), at least 1; 0 when those are missing or malformed. how (may be NULL)
 * says which rule applied, for the log. Pure getenv. */
int bt_dist_slurm_cpus(char *how, size_t how_size);

/* Rendezvous of `world` processes over TCP, authenticated by the job key (bt_dist_key_load).
 * world == 1: returns 0 at once, blob untouched, *link NULL. Every rank passes the same
 * addr/port/world/key/timeout_s, its own rank, and its digest (bt_dist_digest of its config).
 * blob: blob_len bytes (<= BT_DIST_BLOB_MAX; the NCCL id is 128) that rank 0 fills in before the
 * call and every other rank receives; the caller owns it. link (may be NULL): on success, the
 * authenticated connections (rank 0: to every rank; the others: to rank 0), each rank's pid and
 * host, for bt_dist_monitor_start (owned by the caller: bt_dist_link_free); NULL: closed.
 *
 * Rank 0 listens on `port` on all interfaces (IPv6 dual-stack socket, else IPv4; SO_REUSEADDR;
 * addr is only used in messages and may be NULL), sends every connection a fresh challenge and
 * serves every connection at once (poll, no per-client blocking), until ranks 1..world-1 have
 * each said an authenticated hello; then it stops listening:
 *   - a connection that sends a bad magic or version or garbage, or closes before a full hello,
 *     is dropped and counted (WARN log); a silent one is kept pending until the end, the oldest
 *     being dropped once 64 are pending (a peer whose connection is dropped connects again);
 *   - a hello without a valid proof of the key (a stray or hostile client, or a rank with another
 *     secret) gets a plain "authentication failed" refusal and is dropped: whatever it claims
 *     (rank, world, digest), it cannot end, block or delay the rendezvous, and never sees the
 *     blob (which only travels sealed under a key the connection's proof derived);
 *   - an authenticated hello whose world differs, whose rank is out of [1, world), or whose
 *     digest differs gets an error reply, and the rendezvous FAILS on rank 0 with BT_ERR_INVALID
 *     naming the rank and what differed (mismatched jobs of the same secret must not train
 *     together); ranks already joined get an error reply too, so they fail at once;
 *   - a second authenticated hello for a rank already joined gets an error reply ("already
 *     joined"), which does not fail the run; a joined rank whose connection closes is forgotten
 *     and may rejoin.
 * When all have said hello, rank 0 sends each {status ok, sealed blob} and hands the connections
 * to *link (or closes them). Each other rank connects to addr:port (getaddrinfo: host name, IPv4
 * or IPv6 literal), retrying every 100-200 ms while rank 0 is not reachable, answers the
 * challenge and waits for the reply, whose seal it checks: a process that is not this job's rank
 * 0 (another job on the port, another secret) cannot hand it a blob.
 *
 * On success (0) every rank holds rank 0's blob and all ranks are known alive; each rank logs one
 * INFO line ("dist: rendezvous of N ranks at addr:port in X s (authenticated)"). Every blocking
 * step (accept, read, write, connect retries) honours one overall deadline of timeout_s (>= 1)
 * seconds from the call (name resolution excepted: getaddrinfo cannot be bounded). Errors:
 *   BT_ERR_INVALID  bad arguments; a job mismatch (see above; on a peer, the message is the one
 *                   rank 0 sent: "dist: rank r: rank 0 at addr:port refused it: ..."), including
 *                   "authentication failed" (different secrets); a reply that fails its seal; a
 *                   resolver failure other than EAI_NONAME / EAI_AGAIN (those are retried);
 *   BT_ERR_TIMEOUT  rank 0: "... ranks never arrived: 1,3-5 (N stray connections dropped, M of
 *                   them without the job secret)"; others: "could not reach rank 0 at addr:port
 *                   ... (last error: ...)" or, when connected, that rank 0 did not answer in
 *                   time;
 *   BT_ERR_IO       socket / bind / listen / accept failures (port in use, out of fds), getrandom;
 *   BT_ERR_CLOSED   rank 0: a rank went away while being sent the blob (the ranks not yet served
 *                   then get the error too); (a peer whose connection rank 0 closes before
 *                   replying connects again until the deadline: BT_ERR_TIMEOUT, naming it);
 *   BT_ERR_FORMAT   a peer: rank 0's challenge or reply is malformed, or its blob length is not
 *                   blob_len.
 * Every socket is closed on every path (but those handed to *link); sends use MSG_NOSIGNAL (no
 * SIGPIPE); EINTR is retried. Thread-safe (no static state); messages go to the calling thread's
 * bt_last_error(). */
int bt_dist_rendezvous(const char *addr, int port, int rank, int world, const uint8_t digest[32],
                       const uint8_t key[BT_DIST_KEY_BYTES], uint8_t *blob, size_t blob_len,
                       int timeout_s, bt_dist_link **link);

#endif
