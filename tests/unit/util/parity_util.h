/* Shared stages of the tiny-model parity tests against transformers + PEFT
 * (tests/unit/trainer/test_parity_{qwen,phi3,gemma3}.c; fixtures made by
 * tests/reference/gen_{qwen,phi3,gemma3}_fixtures.py, described in tests/reference/README.md).
 * Every fixture holds the same packed batch: TU_FIX_B rows of TU_FIX_T tokens, 3 documents, 45
 * targets of which 2 are masked prompt tokens (43 scored). Every function fails the running cmocka
 * test on any error; nothing here returns an error code. */
#ifndef BT_TEST_PARITY_UTIL_H
#define BT_TEST_PARITY_UTIL_H

#include <stdint.h>

#include "tests/unit/util/test_util.h"
#include "trainer/backend/microbatch.h"
#include "trainer/model/lora.h"
#include "trainer/model/model.h"

/* Scored targets of the fixtures' packed batch (48 tokens in 3 documents: 45 targets, 2 of them
 * masked prompt). */
enum { TU_FIX_NSCORED = 43 };

/* The fixture batch of family dir `fam` (batch.safetensors: input_ids, labels, position_ids
 * [TU_FIX_M] int32, cu_seqlens [4] int32) copied into *b; returns a bt_microbatch viewing *b
 * (b must outlive it). */
bt_microbatch tu_fix_load_batch(const char *fam, tu_fix_batch *b);

/* The CPU trainer on the fixture batch: logits [TU_FIX_M, vocab] fp32 into `logits` (caller's
 * buffer), then the training path's loss; returns the mean loss over the 43 scored targets
 * (asserted), the LoRA gradients (zeroed first) left in lo when lo != NULL. ckpt: activation
 * checkpointing (the layer forward recomputed in the backward). */
double tu_fix_forward(const bt_model *m, bt_lora *lo, const bt_microbatch *mb, float *logits,
                      int ckpt);

/* The inference path (KV cache, bt_infer): row 1's document fed in two chunks (10 + 14 tokens),
 * all logits; returns max |ours - ref row 1| where ref is the training path's logits
 * [TU_FIX_M, vocab]. */
double tu_fix_infer_err(const bt_model *m, const bt_lora *lo, const tu_fix_batch *b,
                        const float *ref);

/* Worst relative error of the LoRA gradients in lo against the fixture file f, tensor names as
 * PEFT writes them (bt_adapter_peft_key: fused Phi-3 groups as one lora_A / one fused lora_B),
 * each tensor's max |ours - ref| over its max |ref| (asserted nonzero). Every layer must have
 * at least one targeted module. */
double tu_fix_grads_rel_err(const bt_lora *lo, struct bt_st_file *f);

/* The whole parity check of one loaded model against its fixture file ref (ref.safetensors:
 * logits_base / loss_base without the adapter, logits / loss and the LoRA gradients with the PEFT
 * adapter lo, already loaded): the training path's logits and loss, the inference path (KV cache)
 * and the LoRA gradients, also with activation checkpointing; printed as "parity: <fam> from
 * <source>: ..." and asserted (logits 1e-4 absolute, loss 1e-5, gradients 1e-4 relative to their
 * max: tests/reference/README.md). logits: the caller's [TU_FIX_M, vocab] buffer (overwritten). */
void tu_fix_parity(const char *fam, const char *source, const bt_model *m, bt_lora *lo,
                   const bt_microbatch *mb, const tu_fix_batch *b, struct bt_st_file *ref, float *logits);

#endif
