/* loaderd's data pipeline for one (job, rank): shards -> documents -> tokens -> packed batches.
 * mmap -> zstd streaming decode (plain .jsonl also accepted) -> lines -> jansson parse ->
 * format (chat template / alpaca / text) -> tokenize on n_threads workers (results
 * re-sequenced by document index) -> pack rows of T with document boundaries -> batches of B.
 * Documents are assigned to ranks by global document index % world_size == rank.
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
const char *ld_bad_reason_name(int reason); /* "json", "utf8", "field", "empty", "too_long", "zstd", "io" */

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
 * ld_job_spec_free). BT_ERR_INVALID naming the key for unknown keys / wrong types / bad values. */
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
    _Atomic uint64_t lines;         /* lines read */
    _Atomic uint64_t bad[LD_BAD_N];
    _Atomic uint32_t epoch;
} ld_stats;

typedef struct ld_pipeline ld_pipeline;

/* Create (spawns the worker threads). tok is borrowed (must outlive the pipeline).
 * resume_state: NULL to start from the beginning, else the state from a batch header.
 * stats is borrowed and updated live. BT_ERR_* with message in bt_last_error. */
int ld_pipeline_new(ld_pipeline **out, const ld_job_spec *spec, const bt_tokenizer *tok,
                    const uint8_t *resume_state, ld_stats *stats);
/* Fill the next batch into v (a view over a slot of bt_batch_slot_bytes(B,T)): all header
 * fields (magic, version, step, counts, checksum, resume_state; job_id/rank as given) and arrays.
 * Returns 0, or 1 after writing an END_OF_DATA batch when epochs are exhausted, <0 on error. */
int ld_pipeline_next(ld_pipeline *p, bt_batch_view *v, uint32_t job_id);
/* Stop the workers and free. */
void ld_pipeline_free(ld_pipeline *p);

#endif
