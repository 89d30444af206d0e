/* Resumable training checkpoints.
 *
 * A checkpoint is a directory, replaced atomically as a whole (written to "<dir>.tmp-<pid>",
 * every file fsync'ed, then swapped in with renameat2(RENAME_EXCHANGE) or rename, and the parent
 * directory fsync'ed), holding:
 *   adapter_model.safetensors, adapter_config.json   the PEFT adapter at that step (adapter.h),
 *                                                    so a checkpoint is also a usable adapter;
 *   trainer_state.bin                                everything needed to continue exactly;
 *   config.json                                      the effective config (for people; unused).
 *
 * trainer_state.bin (little-endian; version 2):
 *   bt_ckpt_header (fixed size, see checkpoint.c)   magic "BTCKPT\0\1", version, header size,
 *       step (optimiser steps done), the identity fields below, n_params, the loader's
 *       resume_state of rank 0's last consumed training batch (proto/batch.h, 256 bytes),
 *       world (number of data-parallel ranks, trainer/parallel/dist.h);
 *   resume_state[world - 1][256]                     ranks 1 .. world-1 (each rank has its own
 *                                                    loader stream);
 *   params[n_params], m[n_params], v[n_params]       fp32: LoRA (+ LoRA+ dense) parameters and the
 *                                                    AdamW moments, bt_lora's buffer order;
 *   checksum                                         u64 FNV-1a 64 of every preceding byte.
 * Version 1 (one rank, no world field, header 368 bytes) still loads as world 1.
 * Identity (a checkpoint is refused unless all match the running job): the model fingerprint
 * (bt_model_fingerprint), base dtype, lora r / alpha / dropout / target modules, trainable
 * modules, seq_len, micro_batch_size, grad_accum, data seed and shard/format fingerprint, and the
 * trainer seed. RNG state: dropout masks are counter-based (a hash of seed, step, micro-batch,
 * layer, module: lora.h), and LoRA init happens only at step 0, so (seed, step) is the whole RNG
 * state. The eval stream is not saved: it restarts from its beginning at every evaluation.
 * `steps` may differ on resume (extending a run); the schedule then follows the new value. */
#ifndef BT_TRAINER_CHECKPOINT_H
#define BT_TRAINER_CHECKPOINT_H
#include <stdint.h>

#include "proto/batch.h"
#include "trainer/config.h"
#include "trainer/model/lora.h"
#include "trainer/model/model.h"

/* The first 8 bytes of trainer_state.bin. */
#define BT_CKPT_MAGIC "BTCKPT\0\1"

/* 64-bit fingerprint of the loaded base model: FNV-1a over its hyper-parameters, base dtype, tying,
 * every norm weight, and a strided sample (every 4093rd float plus the last row) of the token
 * embedding and, if untied, lm_head. Cheap (well under a millisecond per MB of model) and
 * independent of the file format or path the model came from. */
uint64_t bt_model_fingerprint(const bt_model *m);

/* The reference model's identity for loaderd's reference log-prob cache (job key "ref_base",
 * proto/PROTOCOL.md; issue 25): "btm1-" + 32 hex digits, NUL-terminated in out. The first 16
 * digits are bt_model_fingerprint; the next 16 an FNV-1a 64 chain over it and every frozen linear
 * of every layer (shape, storage: fp32 / NF4 / GGUF type; a 32-byte window every 2048 bytes of its
 * stored values or blocks, 1/64 of them, plus its last 256 bytes; biases, Qwen3 q_norm / k_norm in
 * full). Content-derived (the file's path and format do not enter), so the same weights loaded
 * from a copy give the same id; cheap: it reads 1/64 of the weights in memory (about 60 MiB of a
 * 4 GiB 7B GGUF), no file I/O. Strength: any change to the hyper-parameters, a norm, a bias, or
 * one weight in a sampled window changes it, and so does a LoRA merge or a fine-tune, which
 * change every element of the matrices they touch; a change confined to unsampled bytes (a few
 * hand-edited weights) would not: a non-cryptographic identity, not a defence against a forged
 * model (loaderd keys the values by the trainer's uid too, so a user only fools himself). */
#define BT_MODEL_REF_ID_LEN 37
void bt_model_ref_id(const bt_model *m, char out[BT_MODEL_REF_ID_LEN + 1]);

/* 64-bit fingerprint of the training data stream's definition: shards (as written), format,
 * text_field, seq_len, micro_batch_size and data seed, and max_prompt_length / max_length when
 * either is set (preference / kto truncation). */
uint64_t bt_config_data_fingerprint(const bt_train_config *cfg);

/* Write a checkpoint of `lo` (params and AdamW moments) after `step` optimiser steps to `dir`
 * (atomically, see above; parents created). resume_state: BT_RESUME_STATE_BYTES bytes from the
 * header of the last training batch consumed (NULL: none, i.e. step 0). cfg supplies the
 * identity fields and base_model_name_or_path for the adapter files.
 * Data parallel: resume_states is NULL or world x BT_RESUME_STATE_BYTES (rank r's state at
 * r * BT_RESUME_STATE_BYTES, as gathered from every rank); world in [1, BT_CKPT_MAX_WORLD] (1: one
 * process). Only one rank (rank 0) writes.
 * Errors: BT_ERR_IO (names the path), BT_ERR_NOMEM, BT_ERR_INVALID (world out of range). */
#define BT_CKPT_MAX_WORLD 65536
int bt_checkpoint_save(const char *dir, const bt_train_config *cfg, const bt_model *m,
                       const bt_lora *lo, int64_t step, const uint8_t *resume_states,
                       int world);

/* Load a checkpoint into an initialised `lo` (same shapes: bt_lora_init with cfg's settings):
 * overwrites params, m, v; *step = optimiser steps done; resume_state[BT_RESUME_STATE_BYTES] =
 * the loader state to attach with; *has_resume = 0 when the checkpoint has none (step 0).
 * *ckpt_steps (may be NULL) = the `steps` the writing run had configured.
 * Errors (nothing is modified): BT_ERR_IO (missing / unreadable file), BT_ERR_FORMAT (bad magic,
 * version, size, or checksum: "corrupt"), BT_ERR_INVALID (identity mismatch; the message names
 * the field and both values, e.g. "lora.r: checkpoint 8, config 4").
 * Data parallel (rank of world; 0 of 1 for one process): every rank loads the same checkpoint and
 * receives its own loader state in resume_state. A checkpoint with a loader position written by a
 * different number of ranks is BT_ERR_INVALID ("world size: checkpoint written by 4 rank(s), this
 * run has 2"): every rank's stream depends on the world size. */
int bt_checkpoint_load(const char *dir, const bt_train_config *cfg, const bt_model *m,
                       bt_lora *lo, int64_t *step, uint8_t *resume_state, int *has_resume,
                       int *ckpt_steps, int rank, int world);
/* bt_checkpoint_load that also takes a checkpoint written by another number of ranks (resume_world
 * not NULL): the adapter and AdamW moments are the same on every rank whatever W, and the data
 * continue at the same row when the global batch is kept: micro_batch_size equal (checked as
 * before) and world x grad_accum equal (else BT_ERR_INVALID "global batch: checkpoint written by 2
 * rank(s) x grad_accum 1, this run has 1 x 1 (...)"). Then *resume_world = the writing run's world
 * size and resume_state = its rank 0's state on every rank, to attach with bt_client_attach_from
 * (proto/client.h; loaderd continues rank r at that row + r); else *resume_world = 0 and each rank
 * gets its own state as with bt_checkpoint_load. */
int bt_checkpoint_load_from(const char *dir, const bt_train_config *cfg, const bt_model *m,
                            bt_lora *lo, int64_t *step, uint8_t *resume_state, int *has_resume,
                            int *ckpt_steps, int rank, int world, int *resume_world);

#endif
