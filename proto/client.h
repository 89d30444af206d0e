/* Trainer-side client of loaderd's control socket (protocol: proto/PROTOCOL.md).
 * Newline-delimited JSON, every message carries "v": BT_PROTO_VERSION.
 * attach request:
 *   {"v":1,"op":"attach","job":{...job spec...},"rank":R,"world_size":W,"resume":"<hex>"?,
 *    "run":"<id>"?}
 * job spec keys: "name" (str), "shards" ([glob,...]), "format" ("chat"|"text"|"alpaca"),
 *   "text_field" (str, default "text"), "tokenizer" (path to .gguf), "seq_len" (T),
 *   "micro_batch_size" (B), "seed" (u64), "epochs" (0 = endless), "ring_slots" (optional).
 * reply: {"v":1,"ok":true,"job_id":N,"B":..,"T":..,"slots":..} with the ring memfd attached
 * (SCM_RIGHTS) to the same message; or {"v":1,"ok":false,"error":"..."}.
 * report: {"v":1,"op":"report","job_id":N,"step":S,"loss":L,"tokens_per_s":X} -> {"ok":true} */
#ifndef BT_PROTO_CLIENT_H
#define BT_PROTO_CLIENT_H
#include <stddef.h>
#include <stdint.h>

#include "batch.h"
#include "ring.h"

#define BT_PROTO_VERSION 1
#define BT_DEFAULT_SOCKET "/run/loaderd/loaderd.sock"

typedef struct bt_client bt_client;
/* Threading: next/release (the ring) and report (the socket) may run on two different threads;
 * close must not overlap any other call. Errors leave a message in bt_last_error. */

/* Connect to `socket_path` (NULL: $LOADERD_SOCKET, else BT_DEFAULT_SOCKET), send an attach with `job_json` (a JSON object text: the job spec),
 * rank/world, optional resume state (NULL = start; else BT_RESUME_STATE_BYTES bytes copied from
 * a batch header), receive the ring memfd (SCM_RIGHTS) and map it (bt_ring_attach checks it).
 * Relative "shards" patterns and "tokenizer" path are made absolute against the caller's cwd
 * (loaderd resolves them in its own cwd otherwise). Waits up to 120 s for the reply.
 * Errors: BT_ERR_IO (connect), BT_ERR_FORMAT (bad reply), BT_ERR_INVALID (loaderd refused:
 * its message is in bt_last_error). */
int bt_client_attach(bt_client **out, const char *socket_path, const char *job_json, int rank,
                     int world_size, const uint8_t *resume_state);
/* bt_client_attach that also names the training run the rank belongs to (the attach's "run",
 * PROTOCOL.md; NULL or "" = none), so that `loaderctl status` shows a run's ranks together and
 * marks one that falls behind: the same string on every rank of one run, 1..64 characters of
 * [A-Za-z0-9._:-] (loaderd refuses anything else). Re-attaches send it too. */
int bt_client_attach_run(bt_client **out, const char *socket_path, const char *job_json, int rank,
                         int world_size, const uint8_t *resume_state, const char *run);
/* bt_client_attach_run with a resume state written by a run of another world size: resume_world
 * (0 or world_size: the same) is that run's size and resume_state its rank 0's state; loaderd
 * continues this rank at the same row of the data (the attach's "resume_world", PROTOCOL.md; it
 * refuses when world_size does not divide the rows the old ranks took of the current window).
 * A re-attach before the first batch sends it again; after, the last batch's own state. */
int bt_client_attach_from(bt_client **out, const char *socket_path, const char *job_json, int rank,
                          int world_size, const uint8_t *resume_state, int resume_world, const char *run);
/* Wait for the next batch (timeout_ms, -1 forever). 0: *v points at it (valid until release;
 * a next without release releases the previous batch), already checked with bt_batch_validate
 * (against B, T and the vocabulary), job id and consecutive step numbers;
 * 1: end of data; <0: BT_ERR_TIMEOUT, BT_ERR_CLOSED (loaderd stopped the stream early and
 * stayed up, or did not come back), BT_ERR_FORMAT (invalid batch: the message names the
 * violation; also a re-attach that changed B or T).
 * Reconnection (transparent to the caller): when loaderd hangs up the control socket (killed,
 * restarted, stopped) the batches already in the ring are still handed out; once the ring is
 * empty the client connects again and re-attaches the same job spec, rank and world with the
 * resume_state of the last batch it returned (or the attach's resume state if none), so the
 * following batches are exactly those an uninterrupted run would have given (same steps, job id
 * updated). It retries with backoff (50 ms doubling to 1 s) for up to $LOADERD_RECONNECT_S
 * seconds (default 60; 0 disables reconnecting); this wait is not bounded by timeout_ms.
 * A producer-closed ring with the socket still open after 3 s is BT_ERR_CLOSED (job failed or
 * stopped by loaderd); its message carries loaderd's reason, asked with a `jobs` request on a
 * fresh connection before the caller detaches (after that the job is gone from loaderd's list):
 * "loaderd closed the stream of job 7 before its end: job failed: <loaderd's error>". Hang-ups are detected while waiting on an empty ring (every 200 ms). */
int bt_client_next(bt_client *c, bt_batch_view *v, int timeout_ms);
/* Release the batch returned by the last bt_client_next (its view must not be used afterwards);
 * a no-op when none is held. */
void bt_client_release(bt_client *c);
/* Send a progress report and wait (up to 5 s) for loaderd's answer (best-effort; errors are
 * returned, not fatal). Non-finite loss / tokens_per_s are sent as null. While bt_client_next is
 * reconnecting to loaderd it fails at once with BT_ERR_CLOSED. */
int bt_client_report(bt_client *c, uint64_t step, double loss, double tokens_per_s);
/* What the trainer holds as its frozen base, sent as the "base" object of every later report
 * (loaderd shows it in `status` and `loaderctl status`): dtype ("gguf", "nf4", "fp32"), types
 * (the GGUF's ggml types, e.g. "Q4_K+Q6_K"; the dtype otherwise), bits_per_weight (of the base
 * linears as held), bytes (those linears' bytes). Strings are copied, cut to
 * BT_CLIENT_BASE_DTYPE_MAX / BT_CLIENT_BASE_TYPES_MAX bytes, and any byte outside
 * [A-Za-z0-9_+.-] becomes '?' (loaderd refuses others). Not thread-safe with bt_client_report:
 * call it before reporting starts. */
#define BT_CLIENT_BASE_DTYPE_MAX 15
#define BT_CLIENT_BASE_TYPES_MAX 63
void bt_client_set_base(bt_client *c, const char *dtype, const char *types,
                        double bits_per_weight, uint64_t bytes);
/* ---- reference log-probs kept in loaderd's token cache (issue 25 §2; loaderd/refstore.h) ----
 * A preference / kto job whose spec has "ref_base" (the reference model's identifier, e.g. the hex
 * SHA-256 of the base model's weights plus anything else that changes its outputs; 1..128 of
 * [A-Za-z0-9._:+-]) and a loaderd with token_cache_dir gets, per segment, seg_ref_ok / seg_ref_logp
 * (proto/batch.h layout 3): the reference log-prob some trainer computed earlier for the same shard
 * content, tokenizer, format, ref_base, seq_len, max_prompt_length, max_length and uid. For every
 * non-plain segment with seg_ref_ok 0 the trainer computes the value itself (the base with the
 * adapter disabled) and hands it back here, keyed by the record (seg_src, seg_line) and the side
 * (bt_seg_ref_side); once every value of a shard is known loaderd writes it to the cache, where
 * later epochs, later jobs and the other ranks' and nodes' loaderds find it. */
#define BT_REF_PUT_MAX 4096 /* values per ref_put request (bt_client_ref_put splits larger calls) */

typedef struct {
    int32_t src;  /* the segment's seg_src: shard index in the job */
    int32_t line; /* its seg_line: 1-based line in that shard (segments with -1 cannot be kept) */
    int32_t side; /* bt_seg_ref_side(seg_kind): 0 chosen or kto, 1 rejected */
    double logp;  /* summed log-prob in nats over the segment's labelled tokens under the reference
                     model (proto/batch.h seg_ref_logp): finite, in [-1e9, 0] */
} bt_ref_value;

/* side of a non-plain segment for bt_ref_value: 1 for BT_SEG_REJECTED, else 0 */
static inline int32_t bt_seg_ref_side(int32_t seg_kind) { return seg_kind == BT_SEG_REJECTED ? 1 : 0; }

/* Hand n computed reference values back to loaderd (op "ref_put", PROTOCOL.md), in requests of at
 * most BT_REF_PUT_MAX values each, and wait (up to 5 s each) for the answers. base: the job's
 * ref_base (loaderd refuses values for another). v[0..n) (borrowed) need not be sorted; a value
 * already stored is accepted again when equal (relative 1e-6), refused when it differs (the first
 * stays). *accepted / *rejected (either may be NULL): values loaderd kept / refused (a refused value
 * is not an error: it is counted in loaderd's token_cache.ref_rejected and logged there with its
 * reason; the first reasons come back in the reply and, when *rejected > 0, in bt_last_error()).
 * Returns BT_OK; BT_ERR_INVALID when loaderd refused the request (no ref_base in the job, another
 * base: the message says which), BT_ERR_CLOSED while bt_client_next is reconnecting, BT_ERR_IO /
 * BT_ERR_TIMEOUT / BT_ERR_FORMAT on socket trouble. Thread-safe with bt_client_next / release (the
 * socket is shared with bt_client_report under the client's lock). n = 0 is a no-op. */
int bt_client_ref_put(bt_client *c, const char *base, const bt_ref_value *v, size_t n, size_t *accepted,
                      size_t *rejected);
/* Number of successful re-attaches after loaderd went away. */
uint64_t bt_client_reconnects(const bt_client *c);
/* Job id of the current attachment (changes after a re-attach). */
uint32_t bt_client_job_id(const bt_client *c);
uint32_t bt_client_B(const bt_client *c);
uint32_t bt_client_T(const bt_client *c);
/* Vocabulary size loaderd's tokenizer reported at attach (token ids are checked against it);
 * 0 when unknown. */
int32_t bt_client_vocab(const bt_client *c);
/* Detach (sets the ring's consumer-closed flag, sends detach, closes the ring and the socket)
 * and free. NULL is a no-op. */
void bt_client_close(bt_client *c);

#endif
