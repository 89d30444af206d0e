/* The step's memory plan. See plan.h. */
#include "trainer/backend/plan.h"

#include <string.h>

#include "common/bt_common.h"
#include "kernels/cuda/sizes.h"
#include "kernels/kernels.h"

size_t bt_dtype_size(int t) {
    switch (t) {
    case BT_DT_BF16: return 2;
    case BT_DT_F64: return 8;
    case BT_DT_U8: return 1;
    default: return 4; /* F32, I32 */
    }
}

int bt_plan_ce_chunk(const bt_plan_opts *o) {
    if (o->ce_chunk_rows > 0) return o->ce_chunk_rows;
    return o->max_M < 1024 ? o->max_M : 1024;
}

static void add(bt_plan *p, int id, const char *name, int dtype, int group, int copies,
                int64_t count) {
    bt_plan_buf *b = &p->buf[p->n++];
    b->id = id;
    b->name = name;
    b->dtype = dtype;
    b->group = group;
    b->copies = copies;
    b->count = count;
}

int bt_plan_step(bt_plan *p, const bt_dims *d, const bt_plan_opts *o) {
    memset(p, 0, sizeof *p);
    const int cuda = o->backend == BT_PLAN_CUDA;
    if (o->backend != BT_PLAN_CPU && !cuda)
        return bt_fail(BT_ERR_INVALID, "plan: unknown backend %d", o->backend);
    if (o->max_M < 1) return bt_fail(BT_ERR_INVALID, "plan: max_M %d < 1", o->max_M);
    if (o->r < (cuda ? 1 : 0))
        return bt_fail(BT_ERR_INVALID, "plan: LoRA rank %d < %d", o->r, cuda ? 1 : 0);
    if (cuda && o->n_params < 1)
        return bt_fail(BT_ERR_INVALID, "plan: %lld trainable parameters", (long long)o->n_params);
    if (o->gather_bytes < 0 || (!cuda && o->gather_bytes > 0))
        return bt_fail(BT_ERR_INVALID, "plan: a sharded base (%lld gathered bytes) is for the CUDA "
                       "backend only", (long long)o->gather_bytes);
    if (cuda && o->offload && !o->checkpointing)
        return bt_fail(BT_ERR_INVALID, "plan: offloading the checkpointed layer inputs needs "
                       "activation checkpointing");
    const int64_t M = o->max_M, D = d->D, F = d->F, Dq = d->Dq, Dkv = d->Dkv, L = d->L;
    const int64_t r = o->r > 0 ? o->r : 1; /* a 1-wide dXA without LoRA (CPU) */
    const int A = cuda ? BT_DT_BF16 : BT_DT_F32; /* activations */
    const int kept = o->checkpointing ? 1 : d->L;
    const int64_t wide = bt_dims_max_cols(d);

    if (cuda) {
        const int64_t np = o->n_params;
        add(p, BT_BUF_LORA_P, "LoRA parameters", BT_DT_F32, BT_PG_LORA, 1, np);
        add(p, BT_BUF_LORA_G, "LoRA gradients", BT_DT_F32, BT_PG_LORA, 1, np);
        add(p, BT_BUF_LORA_M, "AdamW m", BT_DT_F32, BT_PG_LORA, 1, np);
        add(p, BT_BUF_LORA_V, "AdamW v", BT_DT_F32, BT_PG_LORA, 1, np);
        add(p, BT_BUF_LORA_P16, "LoRA bf16 copy", BT_DT_BF16, BT_PG_LORA, 1, np);
        add(p, BT_BUF_ADAM_DESC, "AdamW descriptors", BT_DT_U8, BT_PG_OPTIM, 1,
            2 * BT_CUDA_ADAMW_DESC_BYTES);
        add(p, BT_BUF_GNORM, "grad norm", BT_DT_F64, BT_PG_OPTIM, 1, 1);
        add(p, BT_BUF_GNORM_PARTIAL, "grad norm scratch", BT_DT_F64, BT_PG_OPTIM, 1,
            (int64_t)bt_cuda_sumsq_scratch(np));
        add(p, BT_BUF_LOSS_SUM, "loss", BT_DT_F64, BT_PG_OPTIM, 1, 1);
        add(p, BT_BUF_LOSS_COUNT, "loss", BT_DT_I32, BT_PG_OPTIM, 1, 1);
    }
    /* activations */
    if (cuda && o->offload) {
        add(p, BT_BUF_X_HOST, "offloaded layer inputs", A, BT_PG_HOST, 1, (L + 1) * M * D);
        add(p, BT_BUF_XBUF, "layer inputs in flight (offload)", A, BT_PG_ACTS, 3, M * D);
    } else {
        add(p, BT_BUF_X_IN, "layer inputs", A, BT_PG_ACTS, (int)L + 1, M * D);
    }
    add(p, BT_BUF_XN1, "input_layernorm output", A, BT_PG_ACTS, kept, M * D);
    add(p, BT_BUF_RSTD1, "input_layernorm rstd", BT_DT_F32, BT_PG_ACTS, kept, M);
    add(p, BT_BUF_Q, "q", A, BT_PG_ACTS, kept, M * Dq);
    add(p, BT_BUF_K, "k", A, BT_PG_ACTS, kept, M * Dkv);
    add(p, BT_BUF_V, "v", A, BT_PG_ACTS, kept, M * Dkv);
    add(p, BT_BUF_ATT, "attention output", A, BT_PG_ACTS, kept, M * Dq);
    add(p, BT_BUF_LSE, "attention lse", BT_DT_F32, BT_PG_ACTS, kept, M * d->Hq);
    add(p, BT_BUF_X2, "attention residual", A, BT_PG_ACTS, kept, M * D);
    add(p, BT_BUF_XN2, "post_attention_layernorm output", A, BT_PG_ACTS, kept, M * D);
    add(p, BT_BUF_RSTD2, "post_attention_layernorm rstd", BT_DT_F32, BT_PG_ACTS, kept, M);
    add(p, BT_BUF_G, "gate", A, BT_PG_ACTS, kept, M * F);
    add(p, BT_BUF_U, "up", A, BT_PG_ACTS, kept, M * F);
    if (o->qk_norm) {
        add(p, BT_BUF_QR, "q before QK-norm", A, BT_PG_ACTS, kept, M * Dq);
        add(p, BT_BUF_KR, "k before QK-norm", A, BT_PG_ACTS, kept, M * Dkv);
        add(p, BT_BUF_RQ, "QK-norm rstd of q", BT_DT_F32, BT_PG_ACTS, kept, M * d->Hq);
        add(p, BT_BUF_RK, "QK-norm rstd of k", BT_DT_F32, BT_PG_ACTS, kept, M * d->Hkv);
    }
    if (o->sandwich_norm) {
        add(p, BT_BUF_AO, "attention output before its norm", A, BT_PG_ACTS, kept, M * D);
        add(p, BT_BUF_RPA, "post_attention_layernorm rstd", BT_DT_F32, BT_PG_ACTS, kept, M);
        add(p, BT_BUF_FO, "MLP output before its norm", A, BT_PG_ACTS, kept, M * D);
        add(p, BT_BUF_RPF, "post_feedforward_layernorm rstd", BT_DT_F32, BT_PG_ACTS, kept, M);
    }
    if (o->r > 0)
        for (int mod = 0; mod < BT_MOD_N; mod++)
            if (o->target_mask & (1u << mod))
                add(p, BT_BUF_XA + mod, "LoRA activations (X A^T)", A, BT_PG_ACTS, kept, M * r);
    /* workspace */
    add(p, BT_BUF_XF, "final norm output", A, BT_PG_WORK, 1, M * D);
    add(p, BT_BUF_RSTDF, "final norm rstd", BT_DT_F32, BT_PG_WORK, 1, M);
    add(p, BT_BUF_H, "SwiGLU output", A, BT_PG_WORK, 1, M * F);
    add(p, BT_BUF_DX, "dx", A, BT_PG_WORK, 1, M * D);
    add(p, BT_BUF_DX2, "dx2", A, BT_PG_WORK, 1, M * D);
    add(p, BT_BUF_DXN, "dxn", A, BT_PG_WORK, 1, M * D);
    add(p, BT_BUF_DTMP, "dtmp", A, BT_PG_WORK, 1, M * D);
    add(p, BT_BUF_DQ, "dq", A, BT_PG_WORK, 1, M * Dq);
    add(p, BT_BUF_DK, "dk", A, BT_PG_WORK, 1, M * Dkv);
    add(p, BT_BUF_DV, "dv", A, BT_PG_WORK, 1, M * Dkv);
    add(p, BT_BUF_DATT, "datt", A, BT_PG_WORK, 1, M * Dq);
    add(p, BT_BUF_DG, "dgate", A, BT_PG_WORK, 1, M * F);
    add(p, BT_BUF_DU, "dup", A, BT_PG_WORK, 1, M * F);
    add(p, BT_BUF_DH, "dh", A, BT_PG_WORK, 1, M * F);
    add(p, BT_BUF_DXA, "LoRA dXA", A, BT_PG_WORK, 1, M * r);
    add(p, BT_BUF_XD, "dropout workspace", A, BT_PG_WORK, 1, M * wide);
    if (!cuda) {
        add(p, BT_BUF_TILES, "dequantisation tiles", BT_DT_F32, BT_PG_WORK, 1,
            o->quant_base ? (int64_t)bt_tile_scratch_floats(o->threads, (int)wide) : 0);
        add(p, BT_BUF_ROPE, "RoPE table", BT_DT_F32, BT_PG_WORK, 1, d->hd / 2);
        add(p, BT_BUF_CE_WS, "CE workspace", BT_DT_F32, BT_PG_LOSS, 1,
            (int64_t)bt_linear_ce_workspace_floats(BT_PLAN_CPU_CE_ROWS, d->V));
        add(p, BT_BUF_TARGETS, "targets", BT_DT_I32, BT_PG_BATCH, 1, M);
        return 0;
    }
    if (o->quant_base && !o->fused_quant)
        add(p, BT_BUF_DEQUANT, "dequantisation buffer", BT_DT_BF16, BT_PG_WORK, 1, o->max_linear);
    if (o->rope_table) {
        add(p, BT_BUF_ROPE, "RoPE table", BT_DT_F32, BT_PG_WORK, 1, d->hd / 2);
        if (o->rope_dynamic)
            add(p, BT_BUF_ROPE_DYN, "RoPE table (dynamic)", BT_DT_F32, BT_PG_WORK, 1, d->hd / 2);
    }
    add(p, BT_BUF_DELTA, "attention delta", BT_DT_F32, BT_PG_WORK, 1, M * d->Hq);
    if (o->trainable_norms)
        add(p, BT_BUF_RMS_SCRATCH, "RMSNorm dW scratch", BT_DT_F32, BT_PG_WORK, 1,
            (int64_t)bt_cuda_rmsnorm_bwd_scratch_floats(o->max_M, d->D));
    add(p, BT_BUF_CE_WS, "CE workspace", BT_DT_U8, BT_PG_LOSS, 1,
        (int64_t)bt_cuda_linear_ce_workspace_bytes(bt_plan_ce_chunk(o), d->V));
    add(p, BT_BUF_ROW_LOSS, "per-row loss", BT_DT_F32, BT_PG_LOSS, 1, M);
    if (o->preference)
        add(p, BT_BUF_ROW_W, "per-row dlogp (preference)", BT_DT_F32, BT_PG_LOSS, 1, M);
    add(p, BT_BUF_TARGETS, "targets", BT_DT_I32, BT_PG_BATCH, 1, M);
    add(p, BT_BUF_IDS, "input_ids", BT_DT_I32, BT_PG_BATCH, 1, M);
    add(p, BT_BUF_POS, "position_ids", BT_DT_I32, BT_PG_BATCH, 1, M);
    add(p, BT_BUF_CU, "cu_seqlens", BT_DT_I32, BT_PG_BATCH, 1, M + 1);
    if (o->gather_bytes > 0) /* the layer that runs and the next one, gathered ahead of it */
        add(p, BT_BUF_GATHER, "all-gathered base layers (dist.shard_base)", BT_DT_U8, BT_PG_GATHER, 2,
            o->gather_bytes);
    return 0;
}

int bt_plan_pref(bt_plan *p, int max_M, int kl_batch) {
    memset(p, 0, sizeof *p);
    if (max_M < 1) return bt_fail(BT_ERR_INVALID, "plan: max_M %d < 1", max_M);
    const int64_t M = max_M;
    const int G = BT_PG_PREF;
    add(p, BT_BUF_PREF_TG, "preference targets", BT_DT_I32, G, 1, M);
    add(p, BT_BUF_PREF_TG2, "preference targets (ORPO / KL)", BT_DT_I32, G, 1, M);
    add(p, BT_BUF_PREF_LAB2, "ORPO labels", BT_DT_I32, G, 1, M);
    add(p, BT_BUF_PREF_LOGP, "log-probs", BT_DT_F32, G, 1, M);
    add(p, BT_BUF_PREF_DLOGP, "dlogp", BT_DT_F32, G, 1, M);
    add(p, BT_BUF_PREF_RESP, "response mask", BT_DT_U8, G, 1, M);
    add(p, BT_BUF_PREF_SEG_SUM, "segment sums", BT_DT_F64, G, 1, M);
    add(p, BT_BUF_PREF_SEG_ALL, "segment sums (all targets)", BT_DT_F64, G, 1, M);
    add(p, BT_BUF_PREF_SEG_REF, "segment reference sums", BT_DT_F64, G, 1, M);
    add(p, BT_BUF_PREF_SEG_CNT, "segment targets", BT_DT_I32, G, 1, M);
    add(p, BT_BUF_PREF_SEG_CNTA, "segment targets (all)", BT_DT_I32, G, 1, M);
    add(p, BT_BUF_PREF_REC_C, "record chosen segment", BT_DT_I32, G, 1, M);
    add(p, BT_BUF_PREF_REC_R, "record rejected segment", BT_DT_I32, G, 1, M);
    add(p, BT_BUF_PREF_MPC, "record policy chosen", BT_DT_F64, G, 1, M);
    add(p, BT_BUF_PREF_MPR, "record policy rejected", BT_DT_F64, G, 1, M);
    add(p, BT_BUF_PREF_MRC, "record reference chosen", BT_DT_F64, G, 1, M);
    add(p, BT_BUF_PREF_MRR, "record reference rejected", BT_DT_F64, G, 1, M);
    add(p, BT_BUF_PREF_DC, "record dloss/dchosen", BT_DT_F64, G, 1, M);
    add(p, BT_BUF_PREF_DR, "record dloss/drejected", BT_DT_F64, G, 1, M);
    add(p, BT_BUF_PREF_MNC, "record chosen targets", BT_DT_I32, G, 1, M);
    add(p, BT_BUF_PREF_MNR, "record rejected targets", BT_DT_I32, G, 1, M);
    add(p, BT_BUF_PREF_MDES, "record desirable (KTO)", BT_DT_U8, G, 1, M);
    if (kl_batch) {
        add(p, BT_BUF_PREF_KID, "KL input_ids", BT_DT_I32, G, 1, M);
        add(p, BT_BUF_PREF_KLAB, "KL labels", BT_DT_I32, G, 1, M);
        add(p, BT_BUF_PREF_KPOS, "KL position_ids", BT_DT_I32, G, 1, M);
        add(p, BT_BUF_PREF_KCU, "KL cu_seqlens", BT_DT_I32, G, 1, M + 1);
    }
    return 0;
}

int64_t bt_shard_units(int64_t units, int W) {
    if (W < 1) W = 1;
    return (units + W - 1) / W;
}

int64_t bt_shard_nf4_units(int64_t n) { return (n + BT_SHARD_NF4_WEIGHTS - 1) / BT_SHARD_NF4_WEIGHTS; }

uint64_t bt_plan_buf_bytes(const bt_plan_buf *b) {
    return (uint64_t)b->copies * (uint64_t)b->count * bt_dtype_size(b->dtype);
}

uint64_t bt_plan_bytes(const bt_plan *p, int g) {
    uint64_t s = 0;
    for (int i = 0; i < p->n; i++)
        if (g < 0 ? p->buf[i].group != BT_PG_HOST : p->buf[i].group == g)
            s += bt_plan_buf_bytes(&p->buf[i]);
    return s;
}

const bt_plan_buf *bt_plan_find(const bt_plan *p, int id) {
    for (int i = 0; i < p->n; i++)
        if (p->buf[i].id == id) return &p->buf[i];
    return NULL;
}

void bt_shard_cut_nf4(bt_shard_cut *c, int64_t n, int W) {
    memset(c, 0, sizeof *c);
    c->nseg = 3;
    c->units = bt_shard_nf4_units(n);
    c->per = bt_shard_units(c->units, W);
    c->unit[0] = BT_SHARD_NF4_WEIGHTS / 2; /* packed: two weights a byte */
    c->unit[1] = BT_SHARD_NF4_WEIGHTS / 64; /* one absmax code per block of 64 */
    c->unit[2] = 4;                         /* one fp32 nested absmax per 256 blocks */
}

void bt_shard_cut_rows(bt_shard_cut *c, int64_t rows, int64_t row_bytes, int W) {
    memset(c, 0, sizeof *c);
    c->nseg = 1;
    c->units = rows;
    c->per = bt_shard_units(rows, W);
    c->unit[0] = row_bytes;
}

int64_t bt_shard_region(int64_t bytes) { return (bytes + 255) / 256 * 256; }

int64_t bt_shard_cut_bytes(const bt_shard_cut *c) {
    int64_t s = 0;
    for (int i = 0; i < c->nseg; i++) s += c->per * c->unit[i];
    return s;
}

int64_t bt_shard_cut_gathered(const bt_shard_cut *c, int W) {
    int64_t s = 0;
    for (int i = 0; i < c->nseg; i++) s += bt_shard_region((int64_t)W * c->per * c->unit[i]);
    return s;
}
