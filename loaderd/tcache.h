/* loaderd token cache: every shard is tokenized once per cluster, not once per rank, node or
 * epoch. A directory (config "token_cache_dir", on a shared filesystem to share it between
 * nodes) holds one entry per (shard content, tokenizer, format): the shard's lines rendered by
 * ld_format_render (loaderd/format.h: documents as token ids + loss mask, before the T cut, or
 * the bad-line reason and message), in line order. Later epochs, later jobs and other loaderds
 * read the entry instead of tokenizing; what depends on the job (T, overlong policy, packing,
 * ranks) is applied after reading, so a batch is the same whether its documents came from the
 * cache or from the tokenizer.
 *
 * Key: SHA-256 (OpenSSL) over "barqtrain-tcache-key-v1", the SHA-256 and size of the shard's
 * bytes, the tokenizer's digest (bt_tokenizer_digest: vocabulary, merges, added tokens,
 * normalizers, pre-tokenizers, special ids, implementation version), the format (text field,
 * chat template, BOS rule) and LD_TC_FORMAT_VERSION. Shard hashes are remembered per
 * (device, inode, size, mtime, ctime) for the life of the process, so a shard is hashed once.
 *
 * Entry "<dir>/v1/<k0k1>/<k>.btc" (k = first 32 hex digits of the key), little-endian:
 *   header 64 B: "BTTKCACH", u32 version 1, u32 64, key[32], u64 shard size, u64 0
 *   blocks:      u32 "BTCB", u32 records, u32 raw bytes, u32 stored bytes,
 *                SHA-256(these 16 bytes + stored bytes), stored bytes (zstd level 1 of the raw
 *                records, or the raw records when that is not smaller)
 *   trailer 72 B: u32 "BTCE", u32 1, u64 records, u64 lines, u64 blank lines, u64 blocks,
 *                SHA-256(header, every block's SHA-256, these 40 bytes)
 *   record:      u8 kind (0 document, 1 bad line, 2 shard error, 3 preference / kto record),
 *                LEB128 line-number delta (> 0), then for a document LEB128 n, n LEB128 ids,
 *                LEB128 mask runs, run lengths (alternating 0-runs and 1-runs, starting with 0s);
 *                for a preference / kto record (ld_format_pref_render's output, before
 *                ld_format_pref_fit) u8 n_docs (2 pair, 1 kto), u8 label + 1 (0 preference, 1 kto
 *                undesirable, 2 desirable), LEB128 prompt_len, LEB128 len0 (the first document's
 *                tokens), then its documents as one document (n = len0 + len1) as above; for a
 *                bad line or shard error u8 ld_bad_reason, LEB128 message length (< 120), the
 *                message.
 * Written with common/atomic_io (temporary file, fsync, rename): readers see a whole entry or
 * none. Read with read(2) (no mmap: a file truncated under us cannot raise SIGBUS), each block
 * checked against its hash before use, the trailer hash at the end; ids are checked against the
 * tokenizer's vocabulary and every length against what is left. An entry that fails any check
 * is damaged: counted, removed and rebuilt; the records already delivered stay valid and the
 * rest of the shard is read raw (LD_TC_DAMAGED). A file whose header holds another key is stale
 * (counted, removed, rebuilt). Nothing in a cache file can crash loaderd; entries are trusted
 * no further than their checksums, and anyone who can write a level of the tree could forge one:
 * so every level (the directory, v1/, each v1/<xx>/) must be a real directory owned by
 * loaderd's effective uid and writable by nobody else (no group/other write bit, sticky or
 * not), each parent owned by root or that uid and sticky if others may write it; checked at
 * ld_tcache_open (refused) and before every use (bypassed, counted as untrusted). Entry files
 * not owned by that uid are removed. Shards are opened with bt_open_file (regular files only,
 * never blocking, no link swapped in after the attach check).
 *
 * Building and sharing: whoever needs a missing entry takes an exclusive flock(2) on
 * "<k>.lock" next to it (released by the kernel if the process dies; works between nodes on
 * NFS, Lustre and GPFS with locking enabled) and tokenizes the shard into the entry with
 * n_threads workers; within one process a key is built by one thread at a time. A process that
 * finds the lock taken builds other missing entries of its job meanwhile, then waits (polling
 * the lock every 20..250 ms, at most "token_cache_wait_s") and reads the entry the other one
 * wrote: N loaderds on one shared directory tokenize each shard once in total. If the shard
 * cannot be read to its end, its content changes while being built, the directory cannot be
 * written or the wait times out, the shard is read raw instead (counted as bypassed).
 *
 * Size: entries and the temporary files of live builders count; after a build, when they exceed
 * max_bytes, the least recently used entries (file mtime, refreshed on every read) are removed
 * until they fit in 90% of it, never one this process is reading. Temporary files of builders
 * that died (nobody holds the flock their writer keeps until the rename; common/atomic_io.h) are
 * removed at open and at every such scan, and counted (temps_removed).
 * Thread-safe. */
#ifndef LD_TCACHE_H
#define LD_TCACHE_H
#include <stdatomic.h>
#include <stddef.h>
#include <stdint.h>

#include "loaderd/format.h"

/* bump when ld_format_render's output changes; 2: Llama-3's trim is Python's str.strip (Unicode
 * whitespace), the SentencePiece families' templates */
#define LD_TC_FORMAT_VERSION 2u

enum {
    LD_TC_BYPASS = 1,  /* ld_tcache_acquire: no entry can be had; read the shard raw */
    LD_TC_DAMAGED = 2, /* ld_tc_next: the entry failed a check; the rest of the shard is raw */
};

typedef struct {
    _Atomic uint64_t hits;         /* entries read (lookups that found a valid entry) */
    _Atomic uint64_t misses;       /* lookups that found no entry */
    _Atomic uint64_t built;        /* entries this process tokenized and wrote */
    _Atomic uint64_t waited;       /* lookups that waited for another builder of the same entry */
    _Atomic uint64_t damaged;      /* entries that failed a check (removed; rebuilt when needed) */
    _Atomic uint64_t stale;        /* entries holding another key, or shards that changed while built */
    _Atomic uint64_t bypassed;     /* shards read raw because no entry could be had */
    _Atomic uint64_t evicted;      /* entries removed to stay under max_bytes */
    _Atomic uint64_t build_bytes;  /* shard bytes tokenized into entries */
    _Atomic uint64_t build_tokens; /* tokens written into entries */
    _Atomic uint64_t read_bytes;   /* entry bytes read */
    _Atomic uint64_t hashed_bytes; /* shard bytes hashed for keys */
    _Atomic uint64_t bytes;        /* size of the entries and of live builders' temporary files at
                                      the last scan, plus builds since */
    _Atomic uint64_t temps_removed; /* temporary files of builders that died, removed */
    _Atomic uint64_t untrusted;    /* lookups that bypassed the cache: its tree failed the check */
    /* reference log-probs (loaderd/refstore.h) */
    _Atomic uint64_t ref_tables;   /* tables made (a shard under a reference key, read from its entry) */
    _Atomic uint64_t ref_loaded;   /* sidecars read (every value of a table at once) */
    _Atomic uint64_t ref_refused;  /* sidecars refused: damaged, or a key part that differs (logged, removed) */
    _Atomic uint64_t ref_written;  /* sidecars written (a table's last value arrived) */
    _Atomic uint64_t ref_accepted; /* values put by trainers and kept */
    _Atomic uint64_t ref_rejected; /* values put by trainers and refused (malformed, unknown record, conflict) */
    _Atomic uint64_t ref_served;   /* segments given their cached value in a batch */
    _Atomic uint64_t ref_missed;   /* segments of a job with ref_base that had none yet */
} ld_tcache_stats;

typedef struct ld_tcache ld_tcache;

/* Open (create if missing, mode 0750) the cache directory `dir` (absolute path; used by its
 * realpath), check its whole tree (above), remove stale temporary files. max_bytes: size bound
 * of the entries (>= 16 MiB); wait_s: longest wait for another builder (0: never wait, read raw
 * at once). BT_ERR_INVALID for a relative path or a level that fails the check (message names
 * the level and why), BT_ERR_IO when it cannot be created or written (message names the path and
 * the fix). */
int ld_tcache_open(ld_tcache **out, const char *dir, uint64_t max_bytes, uint32_t wait_s);
void ld_tcache_free(ld_tcache *c);
const char *ld_tcache_dir(const ld_tcache *c);
uint64_t ld_tcache_max_bytes(const ld_tcache *c);
/* A file of `bytes` bytes was written into the cache tree beside entry `keep` (a reference
 * log-prob sidecar or part file, loaderd/refstore.h): counted in the stats' bytes, and when the
 * total passes max_bytes the tree is rescanned and the least recently used entries and sidecars
 * (never those of `keep` nor of an entry in use) removed until it fits in 90% of it, as after a
 * build. c NULL: nothing. A rewritten part file is counted again until that rescan corrects it. */
void ld_tcache_grew(ld_tcache *c, const uint8_t keep[32], uint64_t bytes);
/* Live counters (atomics; read with atomic_load). */
ld_tcache_stats *ld_tcache_stats_of(ld_tcache *c);

/* A shard as the cache sees it: path, format (cfg->T and overlong_drop are ignored) and the
 * SHA-256 of its tokenizer's bt_tokenizer_digest (ld_tcache_tokenizer_sha256). */
typedef struct {
    const char *path;
    const ld_format_cfg *fcfg;
    const uint8_t *tok_sha256; /* [32] */
} ld_tc_shard;

void ld_tcache_tokenizer_sha256(const bt_tokenizer *tok, uint8_t out[32]);

typedef struct ld_tc_reader ld_tc_reader;

/* The entry of `shard`, building it if needed (see the header comment: lock, build with
 * n_threads tokenize workers, or build others of `others[0..n_others)` while someone else
 * builds this one, then wait). *stop set by another thread makes it give up. Returns BT_OK
 * with *out (close with ld_tc_close), LD_TC_BYPASS (read the shard raw), BT_ERR_TIMEOUT
 * when *stop was set, or another BT_ERR_* (out of memory). */
int ld_tcache_acquire(ld_tcache *c, const ld_tc_shard *shard, const ld_tc_shard *others, size_t n_others,
                      uint32_t n_threads, const _Atomic int *stop, ld_tc_reader **out);

typedef struct {
    int kind;                /* 0 document, 1 bad line, 2 shard error, 3 preference / kto record */
    uint64_t line_no;        /* 1-based, in the shard */
    int reason;              /* kinds 1, 2: ld_bad_reason */
    const char *msg;         /* kinds 1, 2: message, msg_len bytes (not NUL-terminated) */
    size_t msg_len;
    /* kind 3: ld_pref_rec's fields (truncated 0: stored before ld_format_pref_fit) */
    int n_docs, label;
    uint32_t prompt_len, len[2];
} ld_tc_record;

/* Next record: 1 with *rec (kind 0: the document is appended to ids and mask, same length,
 * kind 3 likewise with its n_docs documents, len[0] + len[1] tokens,
 * mask 0/1; ids in [0, vocab); a document whose tokens do not fit in memory comes back as kind 1
 * with reason LD_BAD_MEMORY), 0 at the end of the entry (every check passed), LD_TC_DAMAGED
 * when the entry failed a check (it is removed; records already returned stay valid). A
 * document record is skipped without decoding its ids when ids is NULL. */
int ld_tc_next(ld_tc_reader *r, ld_tc_record *rec, bt_ids *ids, bt_ids *mask);
/* Records returned so far, and the shard's line and blank-line counts (from the trailer). */
uint64_t ld_tc_records(const ld_tc_reader *r);
uint64_t ld_tc_lines(const ld_tc_reader *r);
uint64_t ld_tc_blank(const ld_tc_reader *r);
/* The entry's key (32 bytes, valid until ld_tc_close): the shard part of a reference key
 * (loaderd/refstore.h). */
const uint8_t *ld_tc_key(const ld_tc_reader *r);
void ld_tc_close(ld_tc_reader *r);

#endif
