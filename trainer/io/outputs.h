/* The trainer's output destinations (common/out_dir.h): the kinds of directory each writer
 * leaves, how an earlier BarqTrain's directory (before the BT_OUT_MARKER marker) is recognised,
 * and the up-front check of every destination of a command (issue 21 §1, §2).
 *
 *   adapter     out_dir, `export --format peft --out`: adapter_model.safetensors,
 *               adapter_config.json (trainer/io/adapter.h); replaced as a whole. An out_dir that
 *               once held a checkpoint (same files + trainer_state.bin, config.json) is ours too.
 *   checkpoint  checkpoint_dir: the adapter files, trainer_state.bin, config.json
 *               (trainer/io/checkpoint.h); replaced as a whole.
 *   export      `export --format safetensors --out`: config.json, generation_config.json, the
 *               tokenizer files, model.safetensors or model-NNNNN-of-NNNNN.safetensors +
 *               model.safetensors.index.json (trainer/io/export.h); written into.
 *   report      report.dir, `trainer report DIR`: metrics.jsonl, report.png, profile.json,
 *               events.out.tfevents.* and the plot's ".plot-<pid>*" temporaries
 *               (trainer/report/report.h); written into.
 * Legacy (no marker): an adapter or checkpoint directory whose adapter_config.json has exactly
 * the keys our writer writes (bt_adapter_config_keys) with peft_type "LORA", or whose
 * trainer_state.bin starts with the checkpoint magic; a report directory whose metrics.jsonl
 * starts with one of our metrics lines. A merged export without the marker is never assumed
 * ours (it looks like any Hugging Face model directory). */
#ifndef BT_TRAINER_OUTPUTS_H
#define BT_TRAINER_OUTPUTS_H

#include "common/out_dir.h"
#include "trainer/config.h"

extern const bt_out_kind bt_out_adapter, bt_out_checkpoint, bt_out_export, bt_out_report;

/* Whether the file `path` is a GGUF this trainer's exports wrote (the KV "barqtrain.export", or
 * general.name "BarqTrain LoRA" of a LoRA GGUF from before it): `trainer export --format gguf /
 * gguf-lora` replaces only such a file (common/out_dir.h bt_out_file_check). */
int bt_out_gguf_is_ours(const char *path);

/* `trainer train`, before the model loads (rank 0): every directory the run may write checked
 * with bt_out_dir_check: out_dir (adapter), checkpoint_dir (checkpoint; when it differs from
 * out_dir: saved every checkpoint_every steps and when a run stops early), report.dir (report).
 * Returns 0, or the first refusal (BT_ERR_INVALID / BT_ERR_IO, message naming the config key,
 * the path and the reason, e.g. "out_dir: adapter: /home/me holds 12 entries that BarqTrain did
 * not write (\"notes.txt\", ...): refusing to replace it ..."). */
int bt_train_check_outputs(const bt_train_config *cfg);

#endif
