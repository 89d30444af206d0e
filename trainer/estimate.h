/* `trainer estimate`: the memory bill of a training job, computed from the model's
 * hyper-parameters (GGUF header or HF config.json only; no weights are read) and the job config.
 *
 * The step context's buffers (activations, loss chunk, backward workspace, batch arrays; on CUDA
 * also the LoRA state and optimiser scratch) are not re-derived here: the bill walks the step's
 * memory plan (trainer/backend/plan.h bt_plan_step), the list bt_step_ctx_new and the GPU trainer
 * allocate from, so those rows are exactly what a run allocates (b->step is their sum).
 *
 * CPU backend (fp32 reference, the layout trainer/model/model.c, lora.c and step.c allocate):
 *   base linears   NF4: n/2 packed + n/64 absmax codes + ceil(n/64/256) fp32 nested absmax bytes
 *                  per linear of n weights (bitsandbytes double quantisation, kernels.h); fp32: 4n;
 *                  GGUF (base_dtype gguf, or auto with a .gguf model): the linears' tensor bytes
 *                  in the file, read from its tensor table (their real bits per weight)
 *   embed/lm_head  fp32 [vocab, d_model] (x2 when untied)
 *   norms          fp32 (2 * n_layer + 1) * d_model
 *   LoRA           params + grads + AdamW m + v: 16 bytes per LoRA parameter
 *   LoRA+ dense    trainable embed_tokens / norms (lora.h): a trainable copy + grad + m + v,
 *                  16 bytes per parameter
 *   activations    plan group BT_PG_ACTS: (n_layer + 1) layer inputs of M x d_model, and per layer
 *                  kept (all n_layer, or 1 with activation checkpointing): normed inputs, q, k, v,
 *                  attention output + lse, residual, gate, up, LoRA branch outputs
 *   loss chunk     plan group BT_PG_LOSS: the bt_linear_ce workspace, 256 rows x vocab fp32
 *   other          plan groups BT_PG_WORK + BT_PG_BATCH (backward scratch, dropout copy, NF4 /
 *                  ggml dequantisation tiles per thread, targets) + the run's batch copies
 *   adapter save   the safetensors writer copies every tensor it writes (common/safetensors.h):
 *                  LoRA + dense parameters (+ the lm_head copy of a tied trainable embedding),
 *                  while the training buffers are still allocated
 *   attention      kernels/cpu/attention.c scratch: per-thread score tiles (128 x 256 floats,
 *                  twice in backward) and, with GQA, per-query-head dK/dV accumulators
 *                  (2 x M x n_head x head_dim floats) during backward; S^2-Attn uses the same
 *                  tiled kernel, so it changes the work, not the memory
 *   eval           a held-out length longer than the micro-batch (eval.lengths) gets its own
 *                  checkpointed step context of that many tokens (its plan's total)
 *   runtime        libraries, OpenMP/OpenBLAS per-thread buffers: a measured constant
 *                  (BT_EST_RUNTIME_MIB + BT_EST_THREAD_MIB per thread)
 * The CPU peak is max(training, load): while a GGUF loads, the file's tensor bytes are mapped
 * and touched (counted in RSS) on top of the model being built, plus one fp32 matrix in flight.
 *
 * CUDA backend (docs/ARCHITECTURE.md §Numerics: bf16, fp32 LoRA masters and optimiser state;
 * kernels/cuda/kernels_cuda.h): base NF4 / GGUF blocks as above (a GGUF's F16/BF16/F32 linears
 * as bf16: 2 bytes per weight); embedding / lm_head bf16; norms fp32 (trainer/cuda/cuda_model.cu);
 * LoRA and LoRA+ dense: plan group BT_PG_LORA, fp32 master + grad + m + v plus a bf16 compute
 * copy (18 bytes per parameter; the frozen bf16 embedding and fp32 norms stay on the device);
 * activations as on CPU but 2 bytes per element (the attention lse and RMSNorm rstd stay fp32),
 * with cuda.offload_checkpoints the n_layer + 1 layer inputs move to pinned host memory
 * (BT_PG_HOST) and three device buffers remain; loss chunk = min(M, 1024) rows x vocab fp32
 * logits + bf16 dlogits + the per-row losses; other = BT_PG_WORK + BT_PG_BATCH + BT_PG_OPTIM (the
 * backward scratch, one dequantised bf16 base linear unless cuda.base_matmul is "fused", the
 * attention's fp32 delta [M, n_head], the device batch arrays, the gradient-norm scratch); the
 * attention kernels are tiled (no T x T memory, S^2 or not); runtime = CUDA context + cuBLAS
 * workspace (BT_EST_CUDA_CONTEXT_MIB, typical for an H100; not device-exact); the adapter save
 * buffer is host memory (the LoRA state is copied back first), 0 in the device bill.
 * dist.shard_base with cfg->world_size W > 1 (`trainer estimate --world-size W`): the CUDA bill is
 * one rank's: base = its shard of every linear (plan.h's cut: ceil(units / W) NF4 groups or rows),
 * gather = plan group BT_PG_GATHER (two copies of the largest layer's linears as all-gathered, the
 * padding included); embedding, lm_head, norms, LoRA state and activations stay per rank. */
#ifndef BT_TRAINER_ESTIMATE_H
#define BT_TRAINER_ESTIMATE_H
#include <stdint.h>
#include <stdio.h>

#include "trainer/config.h"
#include "trainer/mem_limits.h"
#include "trainer/model/model.h"

#define BT_EST_RUNTIME_MIB 24.0
#define BT_EST_THREAD_MIB 4.0
#define BT_EST_CUDA_CONTEXT_MIB 600.0
#define BT_EST_MAX_LAYERS 512 /* layers whose GGUF row sizes the estimate records (sharding) */
#define BT_EST_MAX_WORLD 64   /* `trainer estimate --gpus-for` tries W = 1 .. this */

/* What the estimate needs to know about a model (no weights). */
typedef struct {
    bt_llama_hparams hp;
    int tied;                  /* lm_head shares the embedding */
    uint64_t file_tensor_bytes; /* bytes of tensor data in the file(s) (touched while loading) */
    int64_t max_linear;        /* elements of the largest base linear */
    /* GGUF files: the base linears as the file holds them (for base_dtype gguf) */
    int gguf;                  /* the model is a GGUF file */
    int gguf_quant;            /* some base linear is in quantised ggml blocks (not F16/BF16/F32) */
    int64_t lin_weights;       /* elements of all n_layer * 7 base linears */
    uint64_t gguf_lin_bytes;   /* their tensor bytes in the file */
    uint64_t gguf_lin_bytes_cuda; /* as the GPU trainer holds them (F16/BF16/F32 as bf16) */
    char gguf_types[64];       /* their ggml types, most weights first ("Q4_K+Q6_K") */
    /* dist.shard_base on CUDA: bytes of one row of each base linear as the GPU holds it (ggml
     * blocks; F16/BF16/F32 as bf16), layers past BT_EST_MAX_LAYERS not recorded (gguf_rows 0) */
    int gguf_rows;             /* 1: gguf_row_bytes holds every layer */
    uint32_t gguf_row_bytes[BT_EST_MAX_LAYERS][BT_MOD_N];
} bt_est_model;

/* Read the hyper-parameters of a llama-architecture .gguf (header and tensor table only: also the
 * base linears' bytes and types, blk.N.{attn_q,attn_k,attn_v,attn_output,ffn_gate,ffn_up,
 * ffn_down}.weight, missing ones counted at the fp32 size) or a
 * Hugging Face model directory (config.json: hidden_size, num_hidden_layers,
 * num_attention_heads, num_key_value_heads, intermediate_size, vocab_size, tie_word_embeddings;
 * file_tensor_bytes = the size of its *.safetensors files).
 * Errors: BT_ERR_IO, BT_ERR_FORMAT, BT_ERR_NOTFOUND (missing key), with a message naming it. */
int bt_est_model_read(bt_est_model *em, const char *path);

enum { BT_EST_CPU = 0, BT_EST_CUDA = 1 };

/* The bill in bytes. */
typedef struct {
    double base, embed, norms, lora, dense, acts, loss_ws, other, save, runtime;
    double attn;      /* CPU attention scratch (score tiles; per-head dK/dV with GQA), transient */
    double eval;      /* CPU: a held-out length's own workspace (eval.lengths > the micro-batch) */
    double gather;    /* CUDA with dist.shard_base and W > 1: the two all-gathered layers' base
                       * linears (plan group BT_PG_GATHER); base is then this rank's shard */
    int world;        /* the ranks the bill is per rank of (cfg->world_size, at least 1) */
    int sharded;      /* the base is billed as 1/W shards (dist.shard_base, CUDA, W > 1) */
    double host;      /* CUDA with cuda.offload_checkpoints: pinned host memory of the layer inputs
                       * (not in total / peak, which are device bytes) */
    double pref;      /* a preference objective: the preference step's buffers (plan.h
                       * bt_plan_pref, exactly bt_pref_step_bytes), host memory on both backends
                       * (CPU: in total; CUDA: not in the device total; its device dlogp rows are
                       * in loss_ws) */
    double total;     /* sum of the above: steady state while training */
    double step;      /* the step context's plan (trainer/backend/plan.h), device bytes on CUDA:
                       * exactly bt_step_ctx_bytes / the GPU trainer's workspace bytes; it is
                       * acts + loss_ws + other (less the CPU's batch copies) (+ lora + dense on
                       * CUDA), not an extra row */
    double load_peak; /* CPU only: while loading (0 for CUDA) */
    double peak;      /* max(total, load_peak) */
    int64_t n_lora, n_dense;
} bt_mem_bill;

/* Fill *b for the job `cfg` on model `em` and backend `dev` (BT_EST_*). threads: the OpenMP
 * team size the CPU run will use (cfg->threads, or the machine's when 0). cfg->base_dtype
 * BT_BASE_AUTO is GGUF for a GGUF model (em->gguf), NF4 otherwise, as bt_model_load holds it. */
void bt_estimate_bill(const bt_est_model *em, const bt_train_config *cfg, int dev, int threads,
                      bt_mem_bill *b);

/* The longest data.seq_len (a multiple of 64) whose peak fits in `bytes` on backend `dev` for
 * this job (micro_batch_size, LoRA, checkpointing as configured, "auto" resolved per length,
 * offload), or 0 when not even 64 tokens fit. */
int bt_estimate_max_seq_len(const bt_est_model *em, const bt_train_config *cfg, int dev, int threads,
                            double bytes);

/* `trainer estimate`: read cfg->model's hyper-parameters and print both bills as a table to
 * `out`; fit_gib > 0 also answers "the longest seq_len that fits in fit_gib GiB" for the CPU and
 * a GPU (bt_estimate_max_seq_len). Returns 0 or the error of bt_est_model_read. */
int bt_estimate_print(const bt_train_config *cfg, double fit_gib, FILE *out);

/* `trainer estimate --gpus-for GiB`: the fewest data-parallel ranks W (1 .. BT_EST_MAX_WORLD)
 * whose per-rank CUDA bill with dist.shard_base (the base / W in shards + two all-gathered
 * layers + embedding, norms, LoRA state, activations and workspace, which stay per rank) fits in
 * `bytes` of device memory; 0 when none does. *b (may be NULL) gets that W's bill, or W =
 * BT_EST_MAX_WORLD's when none fits. */
int bt_estimate_gpus_for(const bt_est_model *em, const bt_train_config *cfg, int threads, double bytes,
                         bt_mem_bill *b);

/* Print the answer of bt_estimate_gpus_for for gpu_gib GiB cards to `out`: a row per W tried
 * with its shard, gathered layers and per-rank total, then "W GPUs of N GiB fit" or why none
 * does. Returns 0 or the error of bt_est_model_read. */
int bt_estimate_print_gpus_for(const bt_train_config *cfg, double gpu_gib, FILE *out);

/* `trainer train`'s check before it allocates (issue 21 §7): the job's memory plan (this bill:
 * the CPU peak on device "cpu"; on "cuda" the host side, i.e. the CPU load-time peak plus pinned
 * offload memory) against the limits `l` (trainer/mem_limits.h). threads as for bt_estimate_bill.
 * Returns 0 when it fits, when no limit is known, or when the model's header cannot be read (the
 * model loader then says why); else BT_ERR_NOMEM with the figures and what to change, e.g.
 * "memory: this run needs about 24.4 GiB (trainer estimate: LoRA r 4096 parameters, gradients and
 * AdamW moments 17.1 GiB, ...), more than the 15.0 GiB this process may use (RLIMIT_AS; ...):
 * lower lora.r (now 4096) ...; `trainer train --force` tries anyway". */
int bt_estimate_check_fits(const bt_train_config *cfg, int threads, const bt_mem_limits *l);

#endif
