/* The GPU trainer's optimiser side: gradient norm + clipping (torch clip_grad_norm_ as
 * trainer/loop/optim.c bt_clip_grad_norm) and AdamW over every trainable parameter in one launch
 * (bt_cuda_adamw_multi; two descriptors: [0, n_decay) with weight decay, the LoRA+ norm weights
 * after it without, as trainer/loop/backend_cpu.c), plus LoRA state transfers. */
#include "trainer/cuda/cuda_trainer_internal.h"

#include <cmath>

int btc_optim_init(bt_cuda_trainer *t)
{
    const int64_t nd = t->n_decay, nr = t->n_params - t->n_decay;
    t->n_adam = 0;
    t->adam_max_n = 0;
    if (nd > 0) {
        bt_cuda_adamw_tensor &d = t->h_desc[t->n_adam++];
        d.p = t->p;
        d.g = t->g;
        d.m = t->m;
        d.v = t->v;
        d.p16 = t->p16;
        d.n = nd;
        d.weight_decay = 0.f;
        t->adam_max_n = nd;
    }
    if (nr > 0) {
        bt_cuda_adamw_tensor &d = t->h_desc[t->n_adam++];
        d.p = t->p + nd;
        d.g = t->g + nd;
        d.m = t->m + nd;
        d.v = t->v + nd;
        d.p16 = t->p16 + nd;
        d.n = nr;
        d.weight_decay = 0.f; /* norm weights: never decayed */
        if (nr > t->adam_max_n)
            t->adam_max_n = nr;
    }
    t->desc_wd = -1.f;
    return 0;
}

extern "C" int bt_cuda_trainer_zero_grad(bt_cuda_trainer *t)
{
    return BTC_CUDA(cudaMemsetAsync(t->g, 0, (size_t)t->n_params * sizeof(float), t->stream));
}

extern "C" int bt_cuda_trainer_grad_norm(bt_cuda_trainer *t, double *norm)
{
    BTC_TRY(BTC_L(bt_cuda_sumsq(t->d_norm, t->g, t->n_params, t->d_partial, 0, t->stream)));
    double ss = 0;
    BTC_TRY(BTC_CUDA(cudaMemcpyAsync(t->h_loss, t->d_norm, sizeof(double), cudaMemcpyDeviceToHost,
                                     t->stream)));
    BTC_TRY(BTC_CUDA(cudaStreamSynchronize(t->stream)));
    ss = *t->h_loss;
    *norm = sqrt(ss);
    return 0;
}

extern "C" int bt_cuda_trainer_optimizer_step(bt_cuda_trainer *t, float lr, float beta1, float beta2,
                                              float eps, float weight_decay, float grad_scale,
                                              int64_t step)
{
    if (t->n_adam == 0)
        return 0;
    if (t->desc_wd != weight_decay) {
        if (t->n_decay > 0)
            t->h_desc[0].weight_decay = weight_decay;
        /* On t->stream: a cudaMemcpy from pageable memory (legacy stream) may return before its DMA
         * lands, and the non-blocking stream would not wait for it. The pageable source is staged
         * before cudaMemcpyAsync returns, so h_desc may change afterwards. */
        BTC_TRY(BTC_CUDA(cudaStreamSynchronize(t->stream)));
        BTC_TRY(BTC_CUDA(cudaMemcpyAsync(t->adam_desc, t->h_desc,
                                         (size_t)t->n_adam * sizeof(bt_cuda_adamw_tensor),
                                         cudaMemcpyHostToDevice, t->stream)));
        t->desc_wd = weight_decay;
    }
    return BTC_L(bt_cuda_adamw_multi(t->adam_desc, t->n_adam, t->adam_max_n, lr, beta1, beta2, eps,
                                     grad_scale, step, t->stream));
}

extern "C" int bt_cuda_trainer_clip_and_step(bt_cuda_trainer *t, double max_norm, float lr,
                                             float beta1, float beta2, float eps, float weight_decay,
                                             int64_t step, int skip, double *grad_norm, int *applied)
{
    double norm = 0;
    if (applied)
        *applied = 0;
    BTC_TRY(bt_cuda_trainer_grad_norm(t, &norm));
    if (grad_norm)
        *grad_norm = norm;
    if (skip || !std::isfinite(norm))
        return 0;
    /* trainer/loop/optim.c: g *= (float)(max_norm / (total + 1e-6)); the AdamW kernel multiplies each
     * gradient by grad_scale in fp32 (__fmul_rn) before use: the same product */
    const float f = (max_norm > 0 && norm > max_norm) ? (float)(max_norm / (norm + 1e-6)) : 1.0f;
    BTC_TRY(bt_cuda_trainer_optimizer_step(t, lr, beta1, beta2, eps, weight_decay, f, step));
    if (applied)
        *applied = 1;
    return 0;
}

extern "C" int bt_cuda_trainer_download_lora(bt_cuda_trainer *t, bt_lora *lo, unsigned what)
{
    if (!lo || lo->n_params != t->n_params)
        return bt_fail(BT_ERR_INVALID, "cuda: LoRA layout mismatch on download");
    const size_t b = (size_t)t->n_params * sizeof(float);
    BTC_TRY(BTC_CUDA(cudaStreamSynchronize(t->stream)));
    if (what & BT_CUDA_DL_PARAMS)
        BTC_TRY(BTC_CUDA(cudaMemcpy(lo->params, t->p, b, cudaMemcpyDeviceToHost)));
    if (what & BT_CUDA_DL_MOMENTS) {
        BTC_TRY(BTC_CUDA(cudaMemcpy(lo->m, t->m, b, cudaMemcpyDeviceToHost)));
        BTC_TRY(BTC_CUDA(cudaMemcpy(lo->v, t->v, b, cudaMemcpyDeviceToHost)));
    }
    if (what & BT_CUDA_DL_GRADS)
        BTC_TRY(BTC_CUDA(cudaMemcpy(lo->grads, t->g, b, cudaMemcpyDeviceToHost)));
    return 0;
}

extern "C" int bt_cuda_trainer_upload_lora(bt_cuda_trainer *t, const bt_lora *lo)
{
    if (!lo || lo->n_params != t->n_params)
        return bt_fail(BT_ERR_INVALID, "cuda: LoRA layout mismatch on upload");
    const size_t b = (size_t)t->n_params * sizeof(float);
    BTC_TRY(BTC_CUDA(cudaStreamSynchronize(t->stream)));
    /* on t->stream, so the bf16 refresh below is ordered after the copies (a legacy-stream
     * cudaMemcpy from pageable memory may return before its DMA completes) */
    BTC_TRY(BTC_CUDA(cudaMemcpyAsync(t->p, lo->params, b, cudaMemcpyHostToDevice, t->stream)));
    BTC_TRY(BTC_CUDA(cudaMemcpyAsync(t->m, lo->m, b, cudaMemcpyHostToDevice, t->stream)));
    BTC_TRY(BTC_CUDA(cudaMemcpyAsync(t->v, lo->v, b, cudaMemcpyHostToDevice, t->stream)));
    BTC_TRY(BTC_L(bt_cuda_f32_to_bf16(t->p16, t->p, t->n_params, t->stream)));
    return BTC_CUDA(cudaStreamSynchronize(t->stream));
}
