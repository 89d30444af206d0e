/* loaderd stream: the part of a pipeline that does not depend on the rank (internal to
 * loaderd/pipeline.c and loaderd/stream.c; the contract is in loaderd/pipeline.h).
 *
 * A stream reads a job's datasets (reader thread: shards or token-cache entries -> merged line
 * stream), tokenizes them on n workers (loaderd/chunkq.h) and packs windows; each window holds
 * the rows of every rank. One stream serves all of a job's ranks on this node (ld_hub): each
 * rank's cursor (ld_pipeline) walks the windows and takes its own rows. Windows are built on
 * demand by whichever cursor needs the next one first (the others wait for it) and kept while a
 * cursor may still need them: from the slowest cursor (less LD_KEEP_BEHIND windows, for ranks
 * that attach a little later) up to at most LD_MAX_WINDOWS; a cursor that falls further behind
 * continues on a stream of its own from where it is (a window is a pure function of its start,
 * so its batches do not change). */
#ifndef LD_STREAM_H
#define LD_STREAM_H
#include <pthread.h>
#include <stdatomic.h>
#include <stdint.h>

#include "loaderd/chunkq.h"
#include "loaderd/format.h"
#include "loaderd/packer.h"
#include "loaderd/job.h"
#include "loaderd/refstore.h"
#include "loaderd/tcache.h"

#define LD_WINDOW_ROWS 256u
#define LD_WINDOW_DOCS 65536u
#define LD_WINDOW_MAX_TOKENS ((uint64_t)1 << 22)
#define LD_KEEP_BEHIND 2u  /* windows kept behind the slowest cursor (late-attaching ranks) */
#define LD_MAX_WINDOWS 16u /* windows kept at most; a cursor further behind goes its own way */

typedef struct {
    uint32_t pass; /* pass (epoch) of the dataset */
    uint64_t g;    /* index of the next line within that pass */
} ld_dpos;

/* A position in the merged stream: the start of a window. */
typedef struct {
    uint32_t epoch;
    uint64_t g;                      /* merged index within the epoch */
    ld_dpos pos[LD_MAX_DATASETS];    /* per dataset */
} ld_spos;

typedef struct {
    uint32_t first, n; /* paths[first .. first + n) */
    uint32_t q;        /* integer SWRR weight, 1..1000 */
    char *text_field;
    ld_format_cfg fcfg;
} ld_dataset;

/* Everything about a job that does not depend on the rank; immutable, shared by reference. */
typedef struct {
    _Atomic int refs;
    uint32_t T, B, world, epochs, n_threads;
    uint64_t seed;
    char **paths;
    size_t n_paths;
    ld_dataset ds[LD_MAX_DATASETS];
    uint32_t n_ds, W; /* W = sum of q */
    int32_t pad_id;
    uint64_t win_tokens;
    const bt_tokenizer *tok; /* borrowed: outlives every pipeline using it */
    ld_tcache *cache;        /* borrowed, NULL: no token cache */
    uint8_t tok_sha256[32];
    ld_tc_shard *shards;     /* [n_paths] for the token cache */
    /* reference log-probs (loaderd/refstore.h): with a cache, a preference / kto dataset and the job's
     * ref_base; NULL otherwise. ref_tab[f]: shard f's table, set once by the reader when it opens the
     * shard's cache entry (NULL until then, or when the shard is read raw); owned references. */
    char *ref_base;
    uint32_t ref_uid;
    _Atomic(struct ld_reftab *) *ref_tab;
    uint8_t *canon;          /* canonical description (datasets, paths, seed, T, B, world, ...) */
    size_t canon_len;
} ld_scfg;

typedef struct ld_window {
    uint64_t seq;      /* index in its stream */
    int refs;          /* the stream's list + cursors on it (under the stream's mu) */
    ld_pack_doc *docs;
    bt_ids *ids, *mask;
    size_t n_docs, cap;
    uint64_t tokens;
    ld_pack_plan plan;
    size_t rank_rows;  /* rows of every rank: ceil(plan.n_rows / world) */
    ld_spos start, end; /* stream positions before and after it */
    int ends_epoch, last;
    struct ld_window *next;
} ld_window;

typedef struct ld_stream ld_stream;

struct ld_stream {
    ld_scfg *cfg;
    ld_stats *stats; /* stream counters: the private cursor's, or own_stats when shared */
    ld_stats own_stats;
    /* reader */
    ld_chunkq *q;
    pthread_t reader;
    int reader_started;
    _Atomic int stop;
    ld_spos start;
    uint64_t log_seen_reader[LD_BAD_N];
    /* window builder (one thread at a time: `building`) */
    uint64_t log_seen[LD_BAD_N];
    ld_chunk *cc;
    size_t cc_pos;
    ld_spos cpos;       /* consumer position: start of the next window */
    uint64_t epoch_docs;
    int epoch_from_start, exhausted;
    /* windows and cursors (under mu) */
    pthread_mutex_t mu;
    pthread_cond_t cv;
    ld_window *head, *tail;
    uint64_t next_seq;
    int building;
    int err;
    char err_msg[512];
    struct ld_pipeline **members; /* the cursors on it (loaderd/pipeline.c; the stream never calls them) */
    size_t n_members, cap_members;
    uint32_t max_windows; /* LD_MAX_WINDOWS unless the hub says otherwise */
    /* hub (under the hub's mutex) */
    int shared;
    ld_stream *hub_next;
};

/* Start a stream of cfg (reference taken) at position `start` (first window starts there).
 * stats: counters to update (NULL: own). BT_ERR_NOMEM when a thread cannot start. */
int ld_stream_new(ld_stream **out, ld_scfg *cfg, const ld_spos *start, ld_stats *stats);
/* Stop the threads and free (no cursor may use it any more). */
void ld_stream_free(ld_stream *s);
/* Build the next window (caller holds the `building` role, not mu): appended to the list by
 * the caller. <0 on error (message in bt_last_error). */
int ld_stream_build_window(ld_stream *s, ld_window **out);
/* Drop a reference to a window (under mu); frees it at zero. */
void ld_window_put(ld_window *w);

/* Drop a reference to a job configuration; frees it at zero (NULL is fine). */
void ld_scfg_put(ld_scfg *cfg);
/* Position of the next window to be built in s (under mu). */
const ld_spos *ld_stream_next_start(const ld_stream *s);

#endif
