/* The step's memory plan: every buffer a training step context holds, by name, element count and
 * dtype, computed once from the model's dimensions (bt_dims) and the run's options (tokens per
 * micro-batch, checkpointing, LoRA rank and targets, base dtype, CE chunk, offload ...). This is
 * llm.c's way (train_gpt2.cu fill_in_activation_sizes + malloc_and_point_activations): one list
 * that the allocators walk and the bill adds up, so what `trainer estimate` reports cannot drift
 * from what is allocated.
 *
 * Three readers walk the same plan:
 *   - the CPU step context (trainer/loop/step.c bt_step_ctx_new): every BT_PLAN_CPU buffer, fp32
 *     (int32 targets); bt_step_ctx_bytes is the plan's total;
 *   - the GPU trainer (trainer/cuda/cuda_step.cu): every BT_PLAN_CUDA buffer: its LoRA state and
 *     optimiser scratch, bf16 activations (fp32 lse / rstd), its workspace and batch arrays on the
 *     device, the offloaded layer inputs in pinned host memory (group BT_PG_HOST);
 *   - `trainer estimate` (trainer/estimate.c bt_estimate_bill): the bill's activation, loss,
 *     workspace (and on CUDA LoRA) rows are the plan's groups.
 * The frozen model's weights (trainer/model/), the CPU LoRA state (trainer/model/lora.c, optim.c),
 * the kernels' transient per-call scratch (CPU attention tiles), the RoPE cos/sin cache and the
 * NCCL all-reduce scratch are not step buffers and are not in the plan. */
#ifndef BT_TRAINER_BACKEND_PLAN_H
#define BT_TRAINER_BACKEND_PLAN_H
#include <stddef.h>
#include <stdint.h>

#include "trainer/model/model.h"

#ifdef __cplusplus
extern "C" {
#endif

/* Element types of plan buffers. */
typedef enum { BT_DT_F32, BT_DT_BF16, BT_DT_I32, BT_DT_F64, BT_DT_U8 } bt_dtype;
/* Bytes of one element of dtype t (4, 2, 4, 8, 1). */
size_t bt_dtype_size(int t);

/* Which backend's context the plan describes. */
enum { BT_PLAN_CPU = 0, BT_PLAN_CUDA = 1 };
/* Rows per chunk of the CPU step's fused lm_head + CE (kernels.h bt_linear_ce): the step passes
 * it, the plan sizes its workspace with it. */
#define BT_PLAN_CPU_CE_ROWS 256

/* The rows of `trainer estimate` a buffer is billed under. */
typedef enum {
    BT_PG_ACTS,  /* activations kept for backward: the layer inputs and each kept layer's */
    BT_PG_LOSS,  /* the chunked lm_head + CE workspace (CUDA: and the per-row losses) */
    BT_PG_WORK,  /* backward scratch, dropout copy, final norm, RoPE tables, dequantisation */
    BT_PG_BATCH, /* the micro-batch's arrays (targets; CUDA: input_ids, position_ids, cu_seqlens) */
    BT_PG_LORA,  /* CUDA: LoRA (+ LoRA+) fp32 master, gradient, AdamW m, v and the bf16 copy */
    BT_PG_OPTIM, /* CUDA: AdamW descriptors, gradient-norm partial sums, loss scalars */
    BT_PG_HOST,  /* CUDA offload: the checkpointed layer inputs in pinned host memory */
    BT_PG_GATHER, /* CUDA dist.shard_base: the all-gathered base linears of two layers */
    BT_PG_PREF,   /* the preference step's host buffers (bt_plan_pref; never in a step plan) */
    BT_PG_N
} bt_plan_group;

/* Buffer names. Per-layer buffers have `copies` = the kept layers; BT_BUF_XA + mod is the LoRA
 * branch's X @ A^T of module mod (BT_MOD_*). A plan holds each id at most once, in this order. */
typedef enum {
    BT_BUF_LORA_P, BT_BUF_LORA_G, BT_BUF_LORA_M, BT_BUF_LORA_V, BT_BUF_LORA_P16,
    BT_BUF_ADAM_DESC, BT_BUF_GNORM, BT_BUF_GNORM_PARTIAL, BT_BUF_LOSS_SUM, BT_BUF_LOSS_COUNT,
    BT_BUF_X_IN,   /* [L + 1] layer inputs (the last: the final hidden state before the norm) */
    BT_BUF_X_HOST, /* offload: the L + 1 layer inputs, one pinned host block */
    BT_BUF_XBUF,   /* offload: [3] device buffers of the layer inputs in flight */
    BT_BUF_XN1, BT_BUF_RSTD1, BT_BUF_Q, BT_BUF_K, BT_BUF_V, BT_BUF_ATT, BT_BUF_LSE, BT_BUF_X2,
    BT_BUF_XN2, BT_BUF_RSTD2, BT_BUF_G, BT_BUF_U,
    BT_BUF_QR, BT_BUF_KR, /* QK-norm (Qwen3): q and k before the per-head RMSNorm */
    BT_BUF_RQ, BT_BUF_RK, /* QK-norm: the per-head rstd of q and of k */
    BT_BUF_AO, BT_BUF_RPA, /* sandwich norms (Gemma 3): o_proj's output before its norm, rstd */
    BT_BUF_FO, BT_BUF_RPF, /* sandwich norms: down_proj's output before its norm, rstd */
    BT_BUF_XA, BT_BUF_XA_LAST = BT_BUF_XA + BT_MOD_N - 1,
    BT_BUF_XF, BT_BUF_RSTDF, BT_BUF_H, BT_BUF_DX, BT_BUF_DX2, BT_BUF_DXN, BT_BUF_DTMP, BT_BUF_DQ,
    BT_BUF_DK, BT_BUF_DV, BT_BUF_DATT, BT_BUF_DG, BT_BUF_DU, BT_BUF_DH, BT_BUF_DXA, BT_BUF_XD,
    BT_BUF_TILES,       /* CPU: NF4 / ggml dequantisation tiles, one per thread */
    BT_BUF_DEQUANT,     /* CUDA: one dequantised bf16 base linear (not with fused GEMMs) */
    BT_BUF_ROPE,        /* CPU: the pass's RoPE table; CUDA: the model's table on the device */
    BT_BUF_ROPE_DYN,    /* CUDA, dynamic NTK: the step's table */
    BT_BUF_DELTA,       /* CUDA: attention backward's rowsum(dO * O) per head */
    BT_BUF_RMS_SCRATCH, /* CUDA, trainable norms: RMSNorm dW partial sums */
    BT_BUF_CE_WS, BT_BUF_ROW_LOSS,
    BT_BUF_ROW_W,       /* CUDA, preference: the per-token dlogp of the log-prob backward */
    BT_BUF_TARGETS, BT_BUF_IDS, BT_BUF_POS, BT_BUF_CU,
    BT_BUF_GATHER,      /* CUDA dist.shard_base: [2] one layer's base linears, all-gathered */
    /* the preference step (bt_plan_pref, trainer/loop/pref_step.c): host buffers of M tokens */
    BT_BUF_PREF_TG, BT_BUF_PREF_TG2, BT_BUF_PREF_LAB2, BT_BUF_PREF_LOGP, BT_BUF_PREF_DLOGP,
    BT_BUF_PREF_RESP, BT_BUF_PREF_SEG_SUM, BT_BUF_PREF_SEG_ALL, BT_BUF_PREF_SEG_REF,
    BT_BUF_PREF_SEG_CNT, BT_BUF_PREF_SEG_CNTA, BT_BUF_PREF_REC_C, BT_BUF_PREF_REC_R,
    BT_BUF_PREF_MPC, BT_BUF_PREF_MPR, BT_BUF_PREF_MRC, BT_BUF_PREF_MRR, BT_BUF_PREF_DC,
    BT_BUF_PREF_DR, BT_BUF_PREF_MNC, BT_BUF_PREF_MNR, BT_BUF_PREF_MDES,
    BT_BUF_PREF_KID, BT_BUF_PREF_KLAB, BT_BUF_PREF_KPOS, BT_BUF_PREF_KCU,
    BT_BUF_N
} bt_buf_id;

/* One buffer: `copies` allocations of `count` elements of `dtype` each. */
typedef struct {
    int id;           /* bt_buf_id */
    const char *name; /* static string, for messages ("q", "LoRA gradients") */
    int dtype;        /* bt_dtype */
    int group;        /* bt_plan_group */
    int copies;       /* >= 1 */
    int64_t count;    /* elements per copy, >= 0 (0: the allocator still hands out a non-NULL
                       * pointer, billed as 0 bytes) */
} bt_plan_buf;

typedef struct {
    int n;
    bt_plan_buf buf[BT_BUF_N];
} bt_plan;

/* What sizes the plan beyond the model's dimensions. Zero-initialise, then set what applies. */
typedef struct {
    int backend;          /* BT_PLAN_CPU (fp32) or BT_PLAN_CUDA (bf16 activations; fp32 rstd,
                           * lse, LoRA state) */
    int max_M;            /* tokens per micro-batch (B * T), >= 1 */
    int checkpointing;    /* 1: one layer's activations kept, recomputed in backward; else L */
    int r;                /* LoRA rank (bt_lora.r); 0: no LoRA (CPU only: a 1-wide dXA) */
    unsigned target_mask; /* bits (1 << BT_MOD_*) of the LoRA-targeted linears */
    int quant_base;       /* the base linears are NF4 or ggml blocks (CPU: dequantisation tiles;
                           * CUDA: the dequantisation buffer unless fused_quant) */
    int threads;          /* CPU: OpenMP threads the tiles are sized for (omp_get_max_threads()) */
    int qk_norm;          /* the model normalises q and k per head (hp.qk_norm, Qwen3): their
                           * pre-norm values and rstd are kept per layer (billed on both
                           * backends; the GPU trainer itself refuses Qwen3 for now) */
    int sandwich_norm;    /* post-attention / post-FFN norms (hp.sandwich_norm, Gemma 3): the
                           * o_proj and down_proj outputs and their rstd are kept per layer */
    /* CUDA only */
    int64_t n_params;     /* trainable parameters (bt_lora.n_params: LoRA + LoRA+), >= 1 */
    int trainable_norms;  /* LoRA+ trains the RMSNorm weights (dW partial sums) */
    int fused_quant;      /* cuda.base_matmul "fused": dequantised in the GEMM, no buffer */
    int64_t max_linear;   /* elements of the largest base linear (bt_dims_max_linear) */
    int ce_chunk_rows;    /* rows per lm_head + CE chunk; 0: min(max_M, 1024) */
    int offload;          /* cuda.offload_checkpoints (needs checkpointing) */
    int rope_table;       /* the model has an inverse-frequency table (bt_model.inv_freq) */
    int rope_dynamic;     /* dynamic NTK scaling: a per-step table as well */
    int preference;       /* a preference objective (CUDA: the log-prob backward's dlogp rows) */
    int64_t gather_bytes; /* dist.shard_base: bytes of one layer's base linears as all-gathered
                           * (bt_shard_layer_bytes: the W shards, padded to equal size); 0: the
                           * base is not sharded */
} bt_plan_opts;

/* The rows of the GPU's lm_head + CE chunk for opts o: o->ce_chunk_rows, or min(max_M, 1024). */
int bt_plan_ce_chunk(const bt_plan_opts *o);

/* Fill *p with the buffers of a step context for the model dimensions d and options o (p is
 * caller-owned storage; nothing is allocated: the context that walks the plan owns and frees what
 * it allocates; names are static strings). Activations are fp32 on the CPU, bf16 on CUDA; sizes
 * (elements; M = max_M, r = o->r):
 *   ACTS  X_IN (L+1) x M*D (offload: XBUF 3 x M*D on the device, X_HOST (L+1)*M*D pinned host);
 *         per kept layer XN1, X2, XN2: M*D; Q, ATT: M*Dq; K, V: M*Dkv; G, U: M*F; RSTD1, RSTD2:
 *         M (fp32); LSE: M*Hq (fp32); XA + mod: M*r per targeted module; qk_norm: QR M*Dq,
 *         KR M*Dkv, RQ M*Hq, RK M*Hkv (fp32); sandwich_norm: AO, FO M*D, RPA, RPF M (fp32)
 *   WORK  XF, DX, DX2, DXN, DTMP: M*D; RSTDF: M (fp32); H, DG, DU, DH: M*F; DQ, DATT: M*Dq; DK, DV:
 *         M*Dkv; DXA: M*r; XD (dropout copy): M*max(D, F, Dq); CPU: TILES bt_tile_scratch_floats(
 *         threads, max cols) when quant_base (else 0), ROPE hd/2; CUDA: DEQUANT max_linear bf16
 *         (quant_base && !fused_quant), ROPE / ROPE_DYN hd/2, DELTA M*Hq fp32, RMS_SCRATCH
 *         bt_cuda_rmsnorm_bwd_scratch_floats(M, D) (trainable_norms)
 *   LOSS  CPU: CE_WS bt_linear_ce_workspace_floats(BT_PLAN_CPU_CE_ROWS, V); CUDA: CE_WS
 *         bt_cuda_linear_ce_workspace_bytes(bt_plan_ce_chunk(o), V) bytes, ROW_LOSS M fp32,
 *         preference: ROW_W M fp32
 *   BATCH TARGETS M int32; CUDA: IDS, POS M, CU M+1 int32
 *   LORA  CUDA: P, G, M, V n_params fp32, P16 n_params bf16
 *   OPTIM CUDA: ADAM_DESC 2 descriptors, GNORM 1 and GNORM_PARTIAL bt_cuda_sumsq_scratch(n_params)
 *         doubles, LOSS_SUM 1 double, LOSS_COUNT 1 int32
 *   GATHER CUDA, gather_bytes > 0 (dist.shard_base): GATHER 2 x gather_bytes bytes (the layer that
 *         runs and the next one, all-gathered ahead of it)
 * Returns 0, or BT_ERR_INVALID (bt_last_error names it): max_M < 1, r < 0 (or < 1 on CUDA),
 * n_params < 1 on CUDA, offload without checkpointing, gather_bytes < 0 or > 0 on the CPU, an
 * unknown backend (*p then empty). */
int bt_plan_step(bt_plan *p, const bt_dims *d, const bt_plan_opts *o);

/* The preference step's buffers (trainer/loop/pref_step.c, on the host with either backend) for
 * micro-batches of max_M tokens, with kl_batch != 0 for an objective that builds a KL micro-batch
 * (KTO: trainer/preference.h BT_PREF_KTO; the caller decides, this layer sits below it), group
 * BT_PG_PREF, one copy each (M = max_M):
 *   I32 M: TG (shifted targets), TG2 and LAB2 (ORPO's all-labels copy: its targets and labels;
 *     TG2 also the KL batch's targets), SEG_CNT, SEG_CNTA, REC_C, REC_R, MNC, MNR;
 *   F32 M: LOGP, DLOGP; U8 M: RESP, MDES;
 *   F64 M: SEG_SUM, SEG_ALL, SEG_REF (per segment), MPC, MPR, MRC, MRR, DC, DR (per record);
 *   kl_batch only: KID, KLAB, KPOS I32 M and KCU I32 M + 1 (the KL micro-batch).
 * (The records kept for the step's metrics grow with the step's records, not its tokens, and are
 * not in the plan.) Returns 0, or BT_ERR_INVALID for max_M < 1 (*p empty). */
int bt_plan_pref(bt_plan *p, int max_M, int kl_batch);

/* ---- dist.shard_base: how a frozen base linear is cut across W data-parallel ranks ----
 * A linear is cut at its storage format's block boundaries, never re-quantised: the unit is one
 * double-quantisation group of NF4 (256 blocks of 64 weights: 8192 packed bytes + 256 absmax
 * codes + one fp32 nested absmax = BT_SHARD_NF4_UNIT bytes; kernels.h bt_nf4_tensor, nested group
 * as bitsandbytes' blocksize 256), or one row of a GGUF tensor (its ggml blocks: every type's
 * blocks tile a row, gguf.h) or of a bf16 matrix. Rank k holds units [k c, (k + 1) c) with
 * c = ceil(units / W) (the last rank's tail and any rank past the end are padding), so every
 * rank's shard has the same size and NCCL all-gathers them into the whole matrix. */
#define BT_SHARD_NF4_WEIGHTS (256 * 64)
#define BT_SHARD_NF4_UNIT (BT_SHARD_NF4_WEIGHTS / 2 + 256 + 4)
/* Units per rank for `units` units over W ranks: ceil(units / W) (W >= 1; units >= 0). */
int64_t bt_shard_units(int64_t units, int W);
/* NF4 units of a linear of n weights: ceil(n / BT_SHARD_NF4_WEIGHTS). */
int64_t bt_shard_nf4_units(int64_t n);

/* One linear's cut over W ranks: nseg byte arrays cut at the same units (NF4: the packed weights
 * 8192 bytes a unit, the absmax codes 256, the nested fp32 absmax 4; GGUF / bf16: the rows,
 * row_bytes a unit). A rank's shard is the segments' [per x unit[s]] slices one after another;
 * gathered, segment s fills a region of bt_shard_region(W x per x unit[s]) bytes (256-byte
 * aligned, as cudaMalloc'd tensors are) whose first units x unit[s] bytes are the whole array. */
typedef struct {
    int nseg;
    int64_t units, per; /* units in all; per rank: bt_shard_units(units, W) */
    int64_t unit[3];    /* bytes a unit, per segment */
} bt_shard_cut;
void bt_shard_cut_nf4(bt_shard_cut *c, int64_t n, int W);
void bt_shard_cut_rows(bt_shard_cut *c, int64_t rows, int64_t row_bytes, int W);
/* Bytes rounded up to 256. */
int64_t bt_shard_region(int64_t bytes);
/* One rank's shard: per x the sum of the units' bytes. */
int64_t bt_shard_cut_bytes(const bt_shard_cut *c);
/* The gathered linear: the sum over segments of bt_shard_region(W x per x unit[s]). */
int64_t bt_shard_cut_gathered(const bt_shard_cut *c, int W);

/* Bytes of one buffer (copies x count x dtype size). */
uint64_t bt_plan_buf_bytes(const bt_plan_buf *b);
/* Bytes of the plan's buffers in group g (bt_plan_group), or in every group but BT_PG_HOST
 * (the device / process memory) when g < 0. */
uint64_t bt_plan_bytes(const bt_plan *p, int g);
/* The buffer with id `id`, or NULL when the plan has none. */
const bt_plan_buf *bt_plan_find(const bt_plan *p, int id);

#ifdef __cplusplus
}
#endif
#endif
