/* The GPU trainer's preference passes (trainer/cuda/cuda_trainer.h bt_cuda_trainer_logprobs /
 * _backward_logprobs): trainer/loop/step.c bt_forward_logprobs / bt_backward_logprobs on the
 * device. The forward is the step's (cuda_step.cu btc_step_forward) with the reference pass run
 * adapter-off; the lm_head pass is the fused chunked linear + cross-entropy of kernels/cuda/loss.cu
 * returning the label log-probs (bt_cuda_linear_logprob; Liger Kernel's chunking, so no
 * [tokens x vocab] logits tensor exists); the per-token gradient d logp / d xf is kept with unit
 * upstream and scaled by dlogp once the preference loss knows it (a row's gradient is linear in
 * its upstream), then the step's backward runs (btc_step_backward). */
#include "trainer/cuda/cuda_trainer_internal.h"


namespace {

/* Run fn(t) with t's profile (as bt_cuda_trainer_step does): the launches are timed into
 * t->prof once fn has synchronised. */
template <typename F>
int profiled(bt_cuda_trainer *t, F fn)
{
    btc_prof_state ps;
    ps.stream = t->stream;
    if (t->prof)
        btc_prof_cur = &ps;
    const int rc = fn();
    if (!t->prof)
        return rc;
    btc_prof_cur = nullptr;
    if (rc == 0) {
        btc_prof_resolve(t, &ps);
        return 0;
    }
    for (btc_prof_rec &r : ps.recs) {
        if (r.a)
            cudaEventDestroy(r.a);
        if (r.b)
            cudaEventDestroy(r.b);
    }
    return rc;
}

} // namespace

extern "C" int bt_cuda_trainer_logprobs(bt_cuda_trainer *t, const bt_microbatch *mb, int policy,
                                        int backward, uint64_t drop_key, float *logp, int *n_valid)
{
    if (!t || !mb || !logp || (backward && !policy))
        return bt_fail(BT_ERR_INVALID, "cuda log-probs: %s", !t || !mb || !logp ? "NULL argument"
                       : "a training pass needs the adapter (policy)");
    t->lp_mb = nullptr;
    if ((int64_t)mb->B * mb->T > t->max_M)
        return bt_fail(BT_ERR_RANGE, "cuda step: micro-batch of %d x %d tokens exceeds the workspace (%d)",
                       mb->B, mb->T, t->max_M);
    const int nv = bt_shift_targets(t->h_tgt.data(), mb, t->V);
    if (nv < 0)
        return nv;
    const int M = mb->B * mb->T;
    t->adapter_off = policy ? 0 : 1;
    const int rc = profiled(t, [&]() -> int {
        cudaStream_t s = t->stream;
        bt_cuda_attn_params ap;
        BTC_TRY(btc_step_forward(t, mb, backward, drop_key, M, &ap));
        /* logp into row_loss; with backward, d logp / d xf (unit upstream) into t->dtmp */
        BTC_TRY(BTC_L(bt_cuda_linear_logprob(t->blas, s, t->row_loss, backward ? t->dtmp : nullptr,
                                             nullptr, t->xf, btc_head16(t), t->d_tgt, nullptr, M,
                                             t->D, t->V, t->ce_chunk, t->ce_ws)));
        BTC_TRY(BTC_CUDA(cudaMemcpyAsync(logp, t->row_loss, (size_t)M * sizeof(float),
                                         cudaMemcpyDeviceToHost, s)));
        return btc_step_sync(t, backward);
    });
    t->adapter_off = 0;
    if (rc)
        return rc;
    if (n_valid)
        *n_valid = nv;
    if (backward)
        t->lp_mb = mb;
    return 0;
}

extern "C" int bt_cuda_trainer_backward_logprobs(bt_cuda_trainer *t, const bt_microbatch *mb,
                                                 const float *dlogp, uint64_t drop_key)
{
    if (!t || !mb || !dlogp || t->lp_mb != mb)
        return bt_fail(BT_ERR_INVALID, "cuda: bt_cuda_trainer_backward_logprobs must follow "
                       "bt_cuda_trainer_logprobs with backward on the same micro-batch, and needs dlogp");
    t->lp_mb = nullptr;
    if (!t->d_roww)
        return bt_fail(BT_ERR_INVALID, "cuda: the trainer was created without opts.preference: no "
                       "room for the log-prob backward's dlogp");
    const int M = mb->B * mb->T;
    return profiled(t, [&]() -> int {
        cudaStream_t s = t->stream;
        BTC_TRY(BTC_CUDA(cudaMemcpyAsync(t->d_roww, dlogp, (size_t)M * sizeof(float),
                                         cudaMemcpyHostToDevice, s)));
        float *dW = btc_dhead(t);
        if (dW) /* a trainable tied lm_head needs dlogp inside the vocabulary pass: one more */
            BTC_TRY(BTC_L(bt_cuda_linear_logprob(t->blas, s, t->row_loss, t->dtmp, dW, t->xf,
                                                 btc_head16(t), t->d_tgt, t->d_roww, M, t->D, t->V,
                                                 t->ce_chunk, t->ce_ws)));
        else
            BTC_TRY(BTC_L(bt_cuda_scale_rows_bf16(t->dtmp, t->d_roww, M, t->D, s)));
        bt_cuda_attn_params ap;
        BTC_TRY(btc_step_attn(t, mb, 1, M, &ap));
        BTC_TRY(btc_step_backward(t, M, &ap, drop_key));
        return btc_step_sync(t, 1);
    });
}
