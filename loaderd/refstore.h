/* loaderd reference log-probs (issue 25 §2): the frozen reference model's summed log-probability of
 * every preference / kto segment, computed once by a trainer and kept next to the shard's tokens in
 * the token cache (loaderd/tcache.h), so that later epochs, later jobs and the other ranks and
 * nodes of a run read it instead of running the reference forward pass again (TRL's
 * precompute_ref_log_probs, made persistent and shared).
 *
 * A table holds the values of one shard under one reference key. The key (SHA-256 over
 * "barqtrain-refkey-v1" and the parts) is made of
 *   - the shard's token-cache entry key (its content, size, tokenizer digest, format, chat
 *     template, BOS rule: loaderd/tcache.h),
 *   - the job's "ref_base": the trainer's identifier of the reference model (the SHA-256 of the
 *     base model's weights, with whatever else changes its outputs: 1..128 characters of
 *     [A-Za-z0-9._:+-]),
 *   - the packing parameters that decide a record's tokens and whether it is packed at all:
 *     seq_len (T), max_prompt_length, max_length,
 *   - the uid of the trainer that attached (values are shared by the jobs of one user only: another
 *     user's trainer can never put values this job reads).
 * Its records are the shard's preference / kto records that the job packs (the entry's records
 * after ld_format_pref_fit with the job's T / max_prompt_length / max_length), each with 2 values
 * (chosen, rejected) or 1 (kto), found by the record's 1-based line number (the batch's seg_line).
 *
 * Sidecar "<dir>/v1/<k0k1>/<k>-<r>.ref" (k: the entry's 32 hex digits, r: the first 32 hex digits of
 * the reference key), written with common/atomic_io (temporary file, fsync, rename) once every
 * value of the table is known; little-endian:
 *   header 128 B: "BTREFLP1", u32 version 1, u32 uid, reference key[32], entry key[32], u32 T,
 *                 u32 max_prompt_length, u32 max_length, u32 base length (1..128), u64 records,
 *                 u64 values, 16 zero bytes
 *   the base string, zero-padded to a multiple of 8
 *   records:      u64 line, f64 chosen (or kto) value, f64 rejected value (0 for kto)
 *   SHA-256 of everything before it.
 * Several nodes: each loaderd's trainers put the values of the segments its ranks get, so a
 * loaderd's table alone is complete only when it serves every rank; ld_reftab_sync exchanges the
 * rest through part files in the same directory (at each epoch's reopening of the shard and at the
 * end of the last job using the table), and whoever completes the table writes the sidecar.
 * Read with read(2); a file that fails any check (size, magic, hash, a key part that differs from
 * the job's, records that differ from the entry's, a value that is not finite or > 0) is refused
 * with a log line naming the file and what differs ("base ... but this job has ..."), counted
 * (ref_refused), removed, and the table starts empty: a wrong value is never served.
 *
 * Puts (a trainer handing back values, op "ref_put", proto/PROTOCOL.md): a value is accepted only
 * for a record of the table (shard / line / side it really has), finite and in [-1e9, 0]; the
 * first value of a slot stays: a later, different one (relative difference > 1e-6) is a conflict,
 * refused. Memory is bounded by the shard's records (16 bytes per value), whatever the client
 * sends. Thread-safe (one mutex per table, one for the registry). */
#ifndef LD_REFSTORE_H
#define LD_REFSTORE_H
#include <stddef.h>
#include <stdint.h>

#include "loaderd/format.h"
#include "loaderd/tcache.h"

#define LD_REF_BASE_MAX 128
#define LD_REF_MIN_VALUE (-1e9)

typedef struct ld_reftab ld_reftab;

/* The reference key parts of a job other than the shard. */
typedef struct {
    const char *base; /* ref_base (1..LD_REF_BASE_MAX bytes, checked by the job parser) */
    uint32_t uid;     /* the attaching trainer's uid */
} ld_refparams;

/* The table of the shard whose token-cache entry has key entry_key (ld_tc_key of an open reader),
 * for format cfg fcfg (its T, max_prompt_length, max_length) and rp: found among the live tables,
 * else made by reading the entry once (its records through ld_format_pref_fit) and filled from
 * its sidecar when there is a valid one. Returns BT_OK with *out (a reference: ld_reftab_put),
 * LD_TC_BYPASS when the entry cannot be read whole (no table: values are neither served nor
 * kept), or BT_ERR_NOMEM. */
int ld_reftab_get(ld_tcache *c, const uint8_t entry_key[32], const ld_format_cfg *fcfg, const ld_refparams *rp,
                  ld_reftab **out);
/* Drop a reference (NULL is fine); the last one frees the table. */
void ld_reftab_put(ld_reftab *t);

/* side: 0 the chosen segment (or the kto segment), 1 the rejected one (proto/batch.h seg_kind). */
int ld_ref_side(int32_t seg_kind);

/* The value of (line, side): 1 with *v, 0 when not known (yet). Counts ref_served / ref_missed. */
int ld_reftab_lookup(ld_reftab *t, uint64_t line, int side, double *v);

/* Store a value. BT_OK when stored (or equal to the one already there); BT_ERR_INVALID with `why`
 * (cap bytes) naming the reason: no such record or side, not finite, outside [LD_REF_MIN_VALUE, 0],
 * a conflict with the value already stored. When the last missing value arrives the sidecar is to
 * be written (a file write, an fsync and a directory scan for part files): with done == NULL here
 * and now; otherwise *done = t with a reference taken, and the caller hands it to
 * ld_reftab_complete on a thread that may block (loaderd's event loop never writes files). *done
 * is NULL when nothing is to be written. Its failure is logged and counted, the values stay in
 * memory. */
int ld_reftab_set(ld_reftab *t, uint64_t line, int side, double v, char *why, size_t cap, ld_reftab **done);

/* Write the sidecar of a table whose every value is known (ld_reftab_set's *done), merging and
 * removing the part files, then drop the reference ld_reftab_set took. Blocks on the file system. */
void ld_reftab_complete(ld_reftab *t);

/* Share what this loaderd knows with the other nodes: write its values as its own part file
 * ("<sidecar>.part-<16 hex digits of host and pid>", same format with flags 1 and unknown slots
 * 1.0) when it knows values its last one lacked, then merge the part files of other loaderds
 * (each checked like a sidecar; a value that differs from a known one is logged, the first kept).
 * When every value is then known the sidecar is written and the part files are removed. Called
 * when a shard is opened again (each epoch) and when the last job using the table ends. */
void ld_reftab_sync(ld_reftab *t);

/* Values known / values of the table (tests, status). */
void ld_reftab_fill(ld_reftab *t, uint64_t *have, uint64_t *total);

#endif
