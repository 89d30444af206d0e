/* JSON input as BarqTrain reads it everywhere (jansson): every JSON text that comes from a user
 * — loaderd's config and job specs, control requests, the trainer's job configs, Hugging Face
 * config.json / tokenizer.json / tokenizer_config.json / model.safetensors.index.json,
 * adapter_config.json, shard lines — goes through these two functions, so the rules hold for all:
 *   - a UTF-8 byte-order mark (EF BB BF) at the very start is skipped, as Python's
 *     json.load(open(..., encoding="utf-8-sig")) and most editors' "UTF-8 with BOM" expect;
 *   - a key that appears twice in one object is refused, naming the key and where it is
 *     (JSON_REJECT_DUPLICATES: "last one wins" would silently drop a setting; RFC 8259 §4
 *     leaves duplicate names undefined);
 *   - error messages are "<origin>:<line>:<column>: <what>".
 * Issue 10 §5. */
#ifndef BT_JSON_H
#define BT_JSON_H
#include <jansson.h>
#include <stddef.h>

/* Number of bytes of a UTF-8 byte-order mark at the start of p[0..n): 3 or 0. */
size_t bt_utf8_bom_len(const void *p, size_t n);

/* Parse p[0..n) (need not be NUL-terminated; a leading BOM is skipped). `flags` are extra
 * jansson decoding flags (e.g. JSON_ALLOW_NUL, JSON_DECODE_ANY); JSON_REJECT_DUPLICATES is
 * always added. `origin` names the text in messages (a path, "job spec", ...). On success *out
 * is a new reference. Errors: BT_ERR_FORMAT with "<origin>:<line>:<col>: duplicate key \"k\"
 * (each key may appear only once in an object)" or "<origin>:<line>:<col>: invalid JSON: ...";
 * *out = NULL. */
int bt_json_loadb(json_t **out, const void *p, size_t n, size_t flags, const char *origin);

/* Read `path` whole (bt_read_file: at most max_bytes, which must be > 0, checked before reading;
 * refuses a file that changes while being read) and parse it as bt_json_loadb does (origin =
 * path). Errors: those of bt_read_file (BT_ERR_IO / BT_ERR_RANGE / BT_ERR_NOMEM / BT_ERR_INVALID
 * for max_bytes 0) and of bt_json_loadb. */
int bt_json_load_file(json_t **out, const char *path, size_t flags, size_t max_bytes);

#endif
