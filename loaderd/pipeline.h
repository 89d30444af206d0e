/* loaderd's data pipeline for one (job, rank): shards -> documents -> tokens -> packed batches.
 * mmap -> zstd streaming decode (plain .jsonl also accepted) -> lines -> jansson parse ->
 * format (chat template / alpaca / text) -> tokenize on n_threads workers (results
 * re-sequenced by document index) -> pack rows of T with document boundaries -> batches of B.
 * Documents are assigned to ranks by global line index % world_size == rank, where the index
 * counts the non-blank lines of an epoch across the sorted shards (over-long lines included), so
 * a rank parses and tokenizes only its own lines.
 * Bad lines (malformed JSON, invalid UTF-8, missing/wrongly typed fields, empty documents,
 * over-long lines, truncated zstd frames) are skipped, counted by reason and logged with
 * file and line (rate-limited). Deterministic: batch i is a pure function of the spec. */
#ifndef LD_PIPELINE_H
#define LD_PIPELINE_H
#include <stdatomic.h>
#include <stdint.h>

#include "../common/tokenizer.h"
#include "../proto/batch.h"

typedef enum { LD_FMT_TEXT = 0, LD_FMT_CHAT = 1, LD_FMT_ALPACA = 2 } ld_format;

typedef enum {
    LD_BAD_JSON = 0,      /* not valid JSON / not an object */
    LD_BAD_UTF8,          /* invalid UTF-8 in the line */
    LD_BAD_FIELD,         /* missing or wrongly typed field */
    LD_BAD_EMPTY,         /* document renders to no trainable tokens */
    LD_BAD_TOO_LONG,      /* line longer than the limit (16 MiB) */
    LD_BAD_ZSTD,          /* corrupt or truncated zstd data (rest of that shard skipped) */
    LD_BAD_IO,            /* shard unreadable */
    LD_BAD_N
} ld_bad_reason;
/* Static name of a reason: "json", "utf8", "field", "empty", "too_long", "zstd", "io";
 * "unknown" outside [0, LD_BAD_N). */
const char *ld_bad_reason_name(int reason);

typedef struct {
    char *name;
    char **shards;      /* glob patterns, expanded and sorted at pipeline creation */
    int n_shards;
    ld_format format;
    char *text_field;   /* for LD_FMT_TEXT, default "text" */
    char *tokenizer;    /* path of the .gguf holding the vocabulary */
    uint32_t T, B;
    uint64_t seed;
    uint32_t rank, world_size;
    uint32_t epochs;    /* 0 = endless */
    uint32_t n_threads; /* tokenizer workers, >= 1 */
} ld_job_spec;

/* Parse a job spec JSON object text (keys as in proto/client.h) into *spec (owned; free with
 * ld_job_spec_free). Required: shards, format, tokenizer, seq_len (16..2^20), micro_batch_size
 * (>= 1, B*T <= 2^24). Optional: name ("job"), text_field ("text"; format "text" only), seed
 * (0..2^63-1, default 0), epochs (default 0 = endless), tokenizer_threads (1..256, default 2),
 * ring_slots (1..65536, checked and ignored here). rank = 0, world_size = 1 (the caller sets
 * them from the attach request). BT_ERR_INVALID naming the key for unknown keys / wrong types /
 * bad values; the message also goes to err (errlen bytes, may be NULL). *spec is zeroed on error. */
int ld_job_spec_parse(ld_job_spec *spec, const char *json_text, char *err, size_t errlen);
void ld_job_spec_free(ld_job_spec *spec);

/* Live counters, updated by the pipeline (relaxed atomics), read by status/metrics. */
typedef struct {
    _Atomic uint64_t docs;          /* documents accepted */
    _Atomic uint64_t tokens;        /* tokens produced into rows (real, non-padding) */
    _Atomic uint64_t slot_tokens;   /* B*T per emitted batch */
    _Atomic uint64_t labelled;      /* tokens with loss */
    _Atomic uint64_t batches;
    _Atomic uint64_t truncated;     /* documents truncated to T */
    _Atomic uint64_t lines;         /* lines read (all ranks' lines: every rank reads every shard) */
    _Atomic uint64_t blank;         /* blank (whitespace-only) lines skipped; they get no index */
    _Atomic uint64_t bad[LD_BAD_N];
    _Atomic uint32_t epoch;
} ld_stats;

typedef struct ld_pipeline ld_pipeline;

/* Create (spawns one reader thread and spec->n_threads tokenize threads). tok is borrowed (must
 * outlive the pipeline). Shard globs are expanded with glob(3), sorted and deduplicated; a
 * pattern matching nothing is BT_ERR_NOTFOUND naming the pattern.
 * resume_state: NULL to start from the beginning, else the state from a batch header
 * (BT_RESUME_STATE_BYTES): the next batches are exactly those that followed that batch in the
 * original run. BT_ERR_INVALID if it was written for another spec (shards, format, text field,
 * T, B, seed, rank or world size differ). Resuming replays the epoch's shards from their start,
 * decoding but not parsing the lines before the window that holds the next row.
 * stats is borrowed and updated live (NULL: internal counters). BT_ERR_* with message in
 * bt_last_error. */
int ld_pipeline_new(ld_pipeline **out, const ld_job_spec *spec, const bt_tokenizer *tok,
                    const uint8_t *resume_state, ld_stats *stats);
/* Fill the next batch into v (a view over a slot of bt_batch_slot_bytes(B,T)): all header
 * fields (magic, version, step, counts, checksum, resume_state; job_id/rank as given) and arrays.
 * Blocks until the data is ready. Rows come from windows of about 64*T tokens packed with
 * best-fit decreasing and shuffled by (seed, epoch, window); when the last epoch ends, the rows
 * left are emitted (missing rows of the last batch are all padding), then an END_OF_DATA batch:
 * flags set, n_docs = n_real_tokens = 0, every row one padding segment, epoch = epochs.
 * Returns 0, or 1 after writing an END_OF_DATA batch when epochs are exhausted (again on every
 * later call), <0 on error: I/O or tokenizer failure, or an epoch without a single valid document
 * when more epochs follow (BT_ERR_FORMAT; an endless job would otherwise spin). Errors are
 * sticky. Must not be called concurrently on the same pipeline. */
int ld_pipeline_next(ld_pipeline *p, bt_batch_view *v, uint32_t job_id);
/* Stop and join all threads, free everything (NULL is fine). */
void ld_pipeline_free(ld_pipeline *p);

#endif
