/* loaderd job: what a job asks for (the job spec: its datasets, formats, lengths, seed) and what
 * it counts (the reasons a line is skipped, the live counters). The vocabulary every floor of the
 * data plane shares — pipeline (loaderd/pipeline.h), stream, format, token cache — so that it
 * sits below all of them and none reaches up for it. Parsing: loaderd/job.c. */
#ifndef LD_JOB_H
#define LD_JOB_H
#include <stdatomic.h>
#include <stddef.h>
#include <stdint.h>
#include <stdio.h>

#include "common/keytab.h"

/* LD_FMT_PREFERENCE / LD_FMT_KTO are read by ld_format_pref (loaderd/format.h), not ld_format_line. */
typedef enum { LD_FMT_TEXT = 0, LD_FMT_CHAT = 1, LD_FMT_ALPACA = 2, LD_FMT_PREFERENCE = 3, LD_FMT_KTO = 4 } ld_format;

typedef enum {
    LD_BAD_JSON = 0,      /* not valid JSON / not an object */
    LD_BAD_UTF8,          /* invalid UTF-8 in the line */
    LD_BAD_FIELD,         /* missing or wrongly typed field */
    LD_BAD_EMPTY,         /* document renders to no trainable tokens */
    LD_BAD_TOO_LONG,      /* line longer than the limit (16 MiB) */
    LD_BAD_ZSTD,          /* corrupt or truncated zstd data (rest of that shard skipped) */
    LD_BAD_IO,            /* shard unreadable, missing at run time, or shrank while being read */
    LD_BAD_OVERLONG,      /* chat/alpaca document longer than T dropped (overlong: "drop") */
    LD_BAD_MEMORY,        /* the document (its line, or its tokens) needed more memory than loaderd
                             could get: skipped, never an abort (issue 22 §4) */
    LD_BAD_N
} ld_bad_reason;
/* Static name of a reason: "json", "utf8", "field", "empty", "too_long", "zstd", "io", "overlong",
 * "memory";
 * "unknown" outside [0, LD_BAD_N). */
const char *ld_bad_reason_name(int reason);

#define LD_MAX_DATASETS 16

/* Chat templates (loaderd/format.h): ChatML, Llama-3 and the SentencePiece families' (common/chat.h). */
typedef enum {
    LD_TPL_AUTO = -1,
    LD_TPL_CHATML = 0,
    LD_TPL_LLAMA3 = 1,
    LD_TPL_GEMMA = 2,
    LD_TPL_LLAMA2 = 3,
    LD_TPL_MISTRAL = 4,
    LD_TPL_MISTRAL_V3 = 5,
    LD_TPL_PHI3 = 6,
} ld_chat_tpl;

/* One dataset of a job (key "datasets"). */
typedef struct {
    char **shards;      /* glob patterns, expanded and sorted at pipeline creation */
    int n_shards;
    ld_format format;
    char *text_field;   /* for LD_FMT_TEXT, default "text" */
    double weight;      /* > 0, relative mixing weight (default 1) */
} ld_dataset_spec;

typedef struct {
    char *name;
    /* Datasets: when n_datasets > 0 they are used and the four single-dataset fields below are
     * ignored; otherwise shards/format/text_field form one dataset of weight 1 (the old keys). */
    ld_dataset_spec *datasets;
    int n_datasets;
    char **shards;
    int n_shards;
    ld_format format;
    char *text_field;
    char *tokenizer;    /* path of the .gguf holding the vocabulary */
    ld_chat_tpl chat_template; /* LD_TPL_AUTO (what the parser defaults to): from the tokenizer,
                                  see format.h; a zeroed spec means LD_TPL_CHATML */
    int overlong_drop;  /* chat/alpaca documents longer than T: 0 truncate (default), 1 drop */
    uint32_t max_prompt_length, max_length; /* preference / kto truncation (format.h), 0 = none */
    uint32_t T, B;
    uint64_t seed;
    uint32_t rank, world_size;
    uint32_t resume_world; /* the world size a resume state was written by (0: world_size): a state of
                              rank 0 of another world size continues at the same row (pipeline.h) */
    uint32_t epochs;    /* 0 = endless */
    uint32_t n_threads; /* tokenizer workers, >= 1 */
    char *ref_base;     /* preference / kto with a token cache: the reference model's identifier (1..128 of
                           [A-Za-z0-9._:+-]); batches then carry its cached log-probs (loaderd/refstore.h).
                           NULL: none */
    uint32_t ref_uid;   /* set by the server (never from JSON): the attaching trainer's uid, a key part */
} ld_job_spec;

/* Parse a job spec JSON object text into *spec (owned; free with ld_job_spec_free). Its keys,
 * their ranges and defaults: the key tables of loaderd/job.c (`loaderd --job-keys`; PROTOCOL.md
 * "attach" names the same keys, tests/py/test_loaderd_cli.py checks it); the rules between keys:
 * either shards + format (one dataset; text_field with format "text" only) or datasets (1..16,
 * not together with shards/format/text_field); B x T <= 2^24. Strings are safe text (no control
 * characters). rank = 0, world_size = 1 (the caller sets them from the attach request). BT_OK, or BT_ERR_INVALID with "job spec: ..." in
 * bt_last_error() naming the key (e.g. "datasets[1].weight") for unknown keys / wrong types /
 * bad values, and *bad (may be NULL) = that key's path; *spec is zeroed on error. */
int ld_job_spec_parse(ld_job_spec *spec, const char *json_text, bt_keypath *bad);
void ld_job_spec_free(ld_job_spec *spec);
/* The job spec's key tables as Markdown (key, accepted values, default, meaning) on f. */
void ld_job_print_keys(FILE *f);

/* Live counters, updated by the pipeline (relaxed atomics), read by status/metrics. */
typedef struct {
    _Atomic uint64_t docs;          /* documents accepted (all ranks' documents: every rank
                                       parses every line; per rank see batch header n_docs) */
    _Atomic uint64_t tokens;        /* tokens produced into rows (real, non-padding) */
    _Atomic uint64_t slot_tokens;   /* B*T per emitted batch */
    _Atomic uint64_t labelled;      /* tokens with loss */
    _Atomic uint64_t batches;
    _Atomic uint64_t truncated;     /* documents truncated to T (overlong: "truncate") */
    _Atomic uint64_t split;         /* text documents longer than T split into pieces */
    _Atomic uint64_t pad_rows;      /* all-padding rows emitted by this rank (window rows padded
                                       to a multiple of world_size, the last batch's tail) */
    _Atomic uint64_t windows;       /* packing windows built */
    _Atomic uint64_t lines;         /* lines read (all ranks' lines: every rank reads every shard) */
    _Atomic uint64_t blank;         /* blank (whitespace-only) lines skipped; they get no index */
    _Atomic uint64_t bad[LD_BAD_N];
    _Atomic uint64_t dataset_docs[LD_MAX_DATASETS];  /* documents accepted per dataset */
    _Atomic uint32_t dataset_pass[LD_MAX_DATASETS];  /* current pass (epoch) of each dataset */
    _Atomic uint32_t epoch;
} ld_stats;

#endif
