/* Trainer-side client of loaderd's control socket (protocol: proto/PROTOCOL.md).
 * Newline-delimited JSON, every message carries "v": BT_PROTO_VERSION.
 * attach request:
 *   {"v":1,"op":"attach","job":{...job spec...},"rank":R,"world_size":W,"resume":"<hex>"?}
 * job spec keys: "name" (str), "shards" ([glob,...]), "format" ("chat"|"text"|"alpaca"),
 *   "text_field" (str, default "text"), "tokenizer" (path to .gguf), "seq_len" (T),
 *   "micro_batch_size" (B), "seed" (u64), "epochs" (0 = endless), "ring_slots" (optional).
 * reply: {"v":1,"ok":true,"job_id":N,"B":..,"T":..,"slots":..} with the ring memfd attached
 * (SCM_RIGHTS) to the same message; or {"v":1,"ok":false,"error":"..."}.
 * report: {"v":1,"op":"report","job_id":N,"step":S,"loss":L,"tokens_per_s":X} -> {"ok":true} */
#ifndef BT_PROTO_CLIENT_H
#define BT_PROTO_CLIENT_H
#include <stdint.h>

#include "batch.h"
#include "ring.h"

#define BT_PROTO_VERSION 1
#define BT_DEFAULT_SOCKET "/run/loaderd/loaderd.sock"

typedef struct bt_client bt_client;

/* Connect to `socket_path`, send an attach with `job_json` (a JSON object text: the job spec),
 * rank/world, optional resume state (NULL = start), receive and map the ring.
 * Errors: BT_ERR_IO (connect), BT_ERR_FORMAT (bad reply), BT_ERR_INVALID (loaderd refused:
 * its message is in bt_last_error). */
int bt_client_attach(bt_client **out, const char *socket_path, const char *job_json, int rank,
                     int world_size, const uint8_t *resume_state);
/* Wait for the next batch (timeout_ms, -1 forever). 0: *v points at it (valid until release),
 * 1: end of data, <0 error (timeout, loaderd gone, invalid batch). */
int bt_client_next(bt_client *c, bt_batch_view *v, int timeout_ms);
void bt_client_release(bt_client *c);
/* Send a progress report (best-effort; errors are returned, not fatal). */
int bt_client_report(bt_client *c, uint64_t step, double loss, double tokens_per_s);
uint32_t bt_client_job_id(const bt_client *c);
uint32_t bt_client_B(const bt_client *c);
uint32_t bt_client_T(const bt_client *c);
/* Detach (closes the ring and the socket) and free. */
void bt_client_close(bt_client *c);

#endif
