/* loaderd's data pipeline for one (job, rank): datasets of shards -> documents -> tokens ->
 * packed batches. read(2) -> zstd streaming decode (plain .jsonl also accepted) -> lines ->
 * jansson parse -> format (chat template / alpaca / text) -> tokenize on n_threads workers
 * (results re-sequenced by position) -> pack rows of T with document boundaries -> batches of B.
 *
 * Datasets and mixing. A job has 1..LD_MAX_DATASETS datasets, each a sorted list of shards with
 * its own format, text field and weight. Their lines are merged into one stream by smooth weighted
 * round robin (nginx's SWRR: every pick adds each weight to its dataset's credit and takes the
 * dataset with the largest credit, ties to the lowest index, which then pays the total weight):
 * deterministic, exact proportions over every W = sum of integer weights picks, and the schedule
 * restarts with each epoch. Weights are relative; they are rounded to integers 1..1000 relative
 * to the largest (a weight below 1/2000 of the largest counts as 1/1000).
 * Epochs are those of the FIRST dataset: an epoch ends when dataset 0 has given all its lines;
 * the other datasets meanwhile continue where they are and wrap around (a new pass with its own
 * pass number) whenever they run out, so a small secondary dataset is repeated and a large one is
 * only partly seen per epoch. Put the dataset that defines an epoch first.
 *
 * Ranks. Documents are gathered in windows (a pure function of the window's start), each window
 * is packed once with best-fit decreasing and its shuffled rows are dealt round robin: rank r
 * gets rows r, r + W, r + 2W, ... A window's row count is padded up to a multiple of W with
 * all-padding rows, so every rank gets the same number of rows from every window, hence the same
 * number of batches per epoch and overall; every document lands in exactly one rank's rows.
 * One pipeline per job per node: the ranks of a job attached to the same loaderd share one
 * stream (reader, tokenizer workers, windows) through an ld_hub and each takes its own rows, so a
 * node reads and tokenizes every line once, not once per rank (loaderd/stream.h). Nodes do not
 * talk to each other: each builds every window and deals the rows of the ranks attached to it;
 * a token cache shared by the nodes (loaderd/tcache.h) makes the tokenizing happen once per
 * cluster. Batch i of rank r does not depend on any of this.
 *
 * Bad lines (malformed JSON, invalid UTF-8, missing/wrongly typed fields, empty documents,
 * over-long lines, dropped over-long documents, corrupt or truncated zstd frames, unreadable or
 * shrinking shards) are skipped, counted by reason and logged with file and line (rate-limited).
 * Deterministic: batch i of rank r is a pure function of (spec, tokenizer, seed, W, T, B, i). */
#ifndef LD_PIPELINE_H
#define LD_PIPELINE_H
#include <stdatomic.h>
#include <stdint.h>

#include "common/tokenizer.h"
#include "loaderd/job.h"
#include "proto/batch.h"
#include "loaderd/refstore.h"

typedef struct ld_pipeline ld_pipeline;
typedef struct ld_hub ld_hub;
struct ld_tcache;

/* A hub: where the pipelines of one loaderd find each other's streams (one per job and start
 * position), and the token cache they use (borrowed, NULL: none). Free it after every pipeline
 * attached through it. */
int ld_hub_new(ld_hub **out, struct ld_tcache *cache);
void ld_hub_free(ld_hub *h);
/* Windows a shared stream keeps at most (default 16, about 16 x 256 x T tokens; streams started
 * after the call): a rank that falls further behind the others of its job continues on a
 * stream of its own (same batches, its own reading and tokenizing). */
void ld_hub_set_max_windows(ld_hub *h, uint32_t n);
/* Streams alive in the hub and the pipelines using them (for status). */
void ld_hub_counts(ld_hub *h, uint32_t *streams, uint32_t *cursors);

/* Create a pipeline with a stream of its own (spawns one reader thread and spec->n_threads
 * tokenize threads; no token cache). tok is borrowed (must
 * outlive the pipeline). Shard globs are expanded with glob(3), sorted and deduplicated per
 * dataset; a pattern matching nothing is BT_ERR_NOTFOUND naming the pattern. The chat template
 * (chat/alpaca datasets) is resolved here (BT_ERR_UNSUPPORTED if the tokenizer has none of the
 * template's special tokens); BOS insertion follows the GGUF key tokenizer.ggml.add_bos_token of
 * spec->tokenizer when that names a readable .gguf (else no BOS is added; see format.h).
 * resume_state: NULL to start from the beginning, else the state from a batch header
 * (BT_RESUME_STATE_BYTES): the next batches are exactly those that followed that batch in the
 * original run, whatever the thread count. BT_ERR_INVALID if it was written for another spec
 * (datasets, shards, formats, text fields, weights, template, overlong policy, T, B, seed, rank
 * or world size differ). A world-size change: with spec->resume_world = W0 (not 0, not the spec's
 * world size W), resume_state is rank 0's state of the same spec run with W0 ranks, and rank r
 * continues at the same row: rank r of W ranks takes rows r, r + W, ... of each window (ceil(rows/W)
 * of them, the tail padded), so W0 ranks that each emitted k rows of the window consumed its rows
 * [0, k W0) and rank r goes on at row k W0 + r; BT_ERR_INVALID when W does not divide k W0. A
 * training step of micro_batch_size B and grad_accum A consumes B A W consecutive rows whatever
 * the split, so keeping B and W x A gives the uninterrupted run's steps up to the end of the window
 * (windows after it are padded to a multiple of W instead of W0). Resuming reopens every dataset at its recorded pass and line, decoding
 * but not parsing the lines before them, and rebuilds the window that holds the next row.
 * stats is borrowed and updated live (NULL: internal counters). BT_ERR_* with message in
 * bt_last_error. */
int ld_pipeline_new(ld_pipeline **out, const ld_job_spec *spec, const bt_tokenizer *tok,
                    const uint8_t *resume_state, ld_stats *stats);
/* ld_pipeline_new for one rank of a job through hub: the pipeline joins the stream of another
 * rank of the same job (same datasets, shards, formats, weights, template, overlong policy,
 * seq_len, micro_batch_size, seed, world size, epochs and tokenizer object) when that stream
 * still has, or builds next, the window this rank starts at and no pipeline of the same rank
 * uses it; otherwise it starts a stream (documents, lines and bad lines of a shared stream are
 * counted once and copied into each rank's stats). Shards come from the hub's token cache when
 * it has one. tok must outlive every pipeline of the hub that uses it. */
int ld_pipeline_attach(ld_pipeline **out, ld_hub *hub, const ld_job_spec *spec, const bt_tokenizer *tok,
                       const uint8_t *resume_state, ld_stats *stats);
/* Pipelines (ranks) on p's stream, p included; 0 when p has none (its data ended before it
 * started). Safe to call from any thread while p exists (status). */
int ld_pipeline_sharing(ld_pipeline *p);
/* Fill the next batch into v (a view over a slot of bt_batch_slot_bytes(B,T)): all header
 * fields (magic, version, step, counts, checksum, resume_state; job_id/rank as given) and arrays.
 * Blocks until the data is ready. Rows come from windows of about 256*T tokens (at most 2^22
 * tokens or 65536 documents; a window never spans epochs) packed with best-fit decreasing,
 * shuffled by (seed, epoch, window start) and dealt to ranks; when the last epoch ends, the rows
 * left are emitted (missing rows of the last batch are all padding), then an END_OF_DATA batch:
 * flags set, n_docs = n_real_tokens = 0, every row one padding segment, epoch = epochs.
 * Returns 0, or 1 after writing an END_OF_DATA batch when epochs are exhausted (again on every
 * later call), <0 on error: I/O or tokenizer failure, or an epoch without a single valid document
 * when more epochs follow (BT_ERR_FORMAT; an endless job would otherwise spin). Errors are
 * sticky. Must not be called concurrently on the same pipeline. */
int ld_pipeline_next(ld_pipeline *p, bt_batch_view *v, uint32_t job_id);
/* Stop and join all threads, free everything (NULL is fine). */
void ld_pipeline_free(ld_pipeline *p);
/* Make a blocked or later ld_pipeline_next(p) return soon with BT_ERR_CLOSED ("cancelled"), so a
 * job being torn down never waits for a window it will not use: called from any thread (the
 * server's loop, at detach and at SIGTERM) while another may be in ld_pipeline_next; p stays
 * valid until ld_pipeline_free. When every pipeline sharing p's stream is cancelled, the window
 * being built is abandoned (the stream is then offered to nobody: a rank attaching later starts a
 * fresh one); while another rank still uses the stream, a window p itself is building is finished
 * for that rank first (at most one window). Idempotent; NULL is a no-op. */
void ld_pipeline_cancel(ld_pipeline *p);

/* Bytes of buffers a pipeline for `spec` holds at its limits (loaderd's memory_budget_bytes
 * accounting, loaderd/config.h): the chunk queue (2 x n_threads + 2 chunks of up to 8 MiB of
 * line text, plus 2 bytes of token ids and mask per text byte: byte-level BPE gives at least
 * ~4 bytes of text per token on natural text, 8 bytes per token), the packing window
 * (win_tokens x 16 bytes: ids, mask, packer plan), one batch of private scratch
 * (bt_batch_slot_bytes) and per dataset a shard read block and a zstd output buffer. An
 * estimate of what the limits allow, not a measurement; 0 for a spec with B or T of 0. */
uint64_t ld_pipeline_mem_estimate(const ld_job_spec *spec);

/* A trainer's reference log-prob for the record at line `line` (1-based) of the job's shard `src`
 * (the batch's seg_src / seg_line), side 0 (chosen or kto) or 1 (rejected): stored in the job's
 * reference table (loaderd/refstore.h ld_reftab_set). BT_OK, or BT_ERR_INVALID with the reason in
 * why (cap bytes): no reference key, shard / line / side out of range, shard without a table, or
 * ld_reftab_set's reasons. Counted in the token cache's ref_accepted / ref_rejected. *done: the table whose last
 * value this was, for ld_reftab_complete off the event loop (ld_reftab_set), else NULL. Thread-safe. */
int ld_pipeline_ref_put(ld_pipeline *p, int64_t src, int64_t line, int64_t side, double v, char *why, size_t cap,
                        ld_reftab **done);

#endif
