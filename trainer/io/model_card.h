/* The adapter's model card: README.md next to adapter_config.json, as PEFT's `save_pretrained`
 * writes one (peft/utils/other.py, PEFT 0.17: a Hugging Face model card whose YAML front matter
 * has base_model, library_name "peft", pipeline_tag and the tags "base_model:adapter:<base>" and
 * "lora"), so that the Hub and a Hugging Face user recognise the directory.
 *
 * The card says what a reader needs to reuse the adapter: the base model (the job's
 * base_model_name_or_path, else the model file), the training data (shard globs, format, row
 * length), the hyper-parameters (LoRA r / alpha / dropout / targets, optimiser, schedule, steps,
 * effective batch, seed, how the base was held), the held-out loss before and after, and how to
 * load it in PEFT (`PeftModel.from_pretrained`) and in llama.cpp (`trainer export --format
 * gguf-lora`, then `llama-cli --lora`). It is BarqTrain's file: the first line after the front
 * matter is BT_MODEL_CARD_MARK, and an adapter directory (trainer/io/outputs.h bt_out_adapter)
 * counts README.md among its own files. */
#ifndef BT_TRAINER_MODEL_CARD_H
#define BT_TRAINER_MODEL_CARD_H
#include "trainer/config.h"

#define BT_MODEL_CARD_MARK "<!-- written by BarqTrain -->"

/* What the run measured so far. loss_before / loss_after: held-out mean loss per labelled target
 * (NAN = not evaluated), loss_before at before_step; eval_tokens: labelled held-out tokens of the last evaluation; step: the
 * optimiser steps the adapter has; world: data-parallel ranks. */
typedef struct {
    int step;
    int before_step; /* the step loss_before was measured at (0, or where a resumed run began) */
    int world;
    double last_train_loss;
    double loss_before, loss_after;
    long long eval_tokens;
} bt_model_card_result;

/* Write dir/README.md (atomically: common/atomic_io.h) for the adapter in `dir` (which must
 * exist: call it after bt_adapter_save_ex) trained by cfg. cfg and res are borrowed.
 * Errors: BT_ERR_IO ("model card: <path>: <reason>"), BT_ERR_NOMEM. */
int bt_model_card_write(const char *dir, const bt_train_config *cfg, const bt_model_card_result *res);

/* The card's text (malloc'ed, NUL-terminated; the caller frees it), as bt_model_card_write
 * writes it. NULL on out of memory. */
char *bt_model_card_text(const bt_train_config *cfg, const bt_model_card_result *res);

#endif
