/* Upload of a bt_model (trainer/model/model.h) to the device: NF4 linears as NF4 (bt_cuda_nf4_upload),
 * GGUF-native linears as their ggml blocks (bt_cuda_ggml_upload: Q4_0, Q4_1, Q8_0, Q4_K, Q5_K,
 * Q6_K; F16 / BF16 / F32 tensors as bf16, the value the decoders would give; other types are
 * refused naming the supported ones and the base_dtype that converts them), fp32 linears /
 * embedding / lm_head as bf16 (round to nearest even), norms and biases fp32.
 * Also the random-weight variant used by the benchmarks (no host weights needed). */
#include "common/rng.h"
#include "trainer/cuda/cuda_trainer_internal.h"
extern "C" {
#include "common/gguf.h"
#include "common/quant.h"
}

#include <cstring>

namespace {

__global__ void fill_rand_bf16_kernel(bt_bf16 *out, int64_t n, uint64_t seed, float scale)
{
    for (int64_t i = (int64_t)blockIdx.x * blockDim.x + threadIdx.x; i < n;
         i += (int64_t)gridDim.x * blockDim.x) {
        /* splitmix64 finaliser of seed + i * golden (a counter-based generator) */
        const uint64_t x = bt_hash64(seed + (uint64_t)i * BT_GOLDEN64 - BT_GOLDEN64);
        /* sum of 4 uniforms in [-1, 1): roughly normal, sd ~ 1.15 */
        float s = 0.f;
        for (int j = 0; j < 4; j++)
            s += (float)((x >> (16 * j)) & 0xffffu) * (2.0f / 65536.0f) - 1.0f;
        out[i] = __float2bfloat16_rn(s * scale);
    }
}

__global__ void add_bias_kernel(bt_bf16 *y, const float *bias, int64_t n, int N)
{
    for (int64_t i = (int64_t)blockIdx.x * blockDim.x + threadIdx.x; i < n;
         i += (int64_t)gridDim.x * blockDim.x)
        y[i] = __float2bfloat16_rn(__bfloat162float(y[i]) + bias[i % N]);
}

unsigned grid_of(int64_t n, int threads)
{
    int64_t b = (n + threads - 1) / threads;
    if (b > 65535LL * 16)
        b = 65535LL * 16;
    return (unsigned)(b < 1 ? 1 : b);
}

int dmalloc(btc_model *dm, void **p, size_t bytes, const char *what)
{
    cudaError_t e = cudaMalloc(p, bytes ? bytes : 1);
    if (e != cudaSuccess) {
        *p = nullptr;
        cudaGetLastError();
        size_t fr = 0, tot = 0;
        cudaMemGetInfo(&fr, &tot);
        return bt_fail(BT_ERR_NOMEM, "cuda: out of device memory for %s (%zu MiB; %zu MiB free of "
                       "%zu MiB, model so far %zu MiB)", what, bytes >> 20, fr >> 20, tot >> 20,
                       dm->bytes >> 20);
    }
    dm->bytes += bytes;
    return 0;
}

/* host fp32 -> device bf16, in chunks (bounded host staging memory) */
int upload_bf16(bt_bf16 *dst, const float *src, int64_t n)
{
    const int64_t CH = 1 << 22;
    std::vector<bt_bf16> st((size_t)(n < CH ? n : CH));
    for (int64_t i0 = 0; i0 < n; i0 += CH) {
        const int64_t c = n - i0 < CH ? n - i0 : CH;
        for (int64_t i = 0; i < c; i++)
            st[(size_t)i] = __float2bfloat16_rn(src[i0 + i]);
        BTC_TRY(BTC_CUDA(cudaMemcpy(dst + i0, st.data(), (size_t)c * sizeof(bt_bf16),
                                    cudaMemcpyHostToDevice)));
    }
    return 0;
}

/* A GGUF-native linear: its blocks when the type has a device decoder; F16 / BF16 / F32 as bf16
 * (exactly bf16(dequantised value), what a decoder would produce); otherwise refused. */
int upload_gguf_linear(btc_model *dm, btc_linear *d, const bt_base_linear *bl, int l, int mod)
{
    const int t = bl->g.type;
    const int64_t n = (int64_t)bl->rows * bl->cols;
    if (bt_cuda_ggml_supported(t)) {
        d->is_gguf = 1;
        int rc = bt_cuda_ggml_upload(&d->g, t, bl->rows, bl->cols, bl->g.data);
        if (rc)
            return bt_fail(rc == BT_ERR_NOMEM ? BT_ERR_NOMEM : rc, "cuda: upload of layer %d %s "
                           "(%s blocks, %zu MiB) failed%s", l, bt_module_name(mod),
                           bt_ggml_type_name(t), bt_ggml_mat_bytes(&bl->g) >> 20,
                           rc == BT_ERR_NOMEM ? ": out of device memory" : "");
        dm->bytes += bt_ggml_mat_bytes(&bl->g);
        return 0;
    }
    if (t != BT_GGML_F32 && t != BT_GGML_F16 && t != BT_GGML_BF16)
        return bt_fail(BT_ERR_UNSUPPORTED, "cuda: layer %d %s is %s, which has no CUDA kernel for "
                       "the GGUF-native base (on the GPU: Q4_0, Q4_1, Q8_0, Q4_K, Q5_K, Q6_K, and "
                       "F16/BF16/F32 held as bf16): set base_dtype \"nf4\" to re-quantise the base "
                       "to NF4 (or \"fp32\"), or train on the CPU (device \"cpu\" supports every "
                       "type)", l, bt_module_name(mod), bt_ggml_type_name(t));
    std::vector<float> f((size_t)n);
    int rc = bt_ggml_mat_dequantize_rows(&bl->g, 0, bl->rows, f.data());
    if (rc)
        return rc;
    rc = dmalloc(dm, (void **)&d->w16, (size_t)n * sizeof(bt_bf16), "a linear");
    return rc ? rc : upload_bf16(d->w16, f.data(), n);
}

int fill_random(bt_bf16 *dst, int64_t n, uint64_t seed, float scale)
{
    fill_rand_bf16_kernel<<<grid_of(n, 256), 256>>>(dst, n, seed, scale);
    return BTC_CUDA(cudaGetLastError());
}

} // namespace

int btc_add_bias(bt_bf16 *y, const float *bias, int M, int N, cudaStream_t s)
{
    const int64_t n = (int64_t)M * N;
    if (n == 0)
        return 0;
    add_bias_kernel<<<grid_of(n, 256), 256, 0, s>>>(y, bias, n, N);
    return BTC_CUDA(cudaGetLastError());
}

void btc_model_free(btc_model *dm)
{
    if (!dm)
        return;
    if (dm->lin) {
        for (int i = 0; i < dm->hp.n_layer * BT_MOD_N; i++) {
            btc_linear *l = &dm->lin[i];
            if (l->is_nf4)
                bt_cuda_nf4_free(&l->q);
            if (l->is_gguf)
                bt_cuda_ggml_free(&l->g);
            cudaFree(l->w16);
            cudaFree(l->bias);
        }
        free(dm->lin);
    }
    if (dm->head16 != dm->embd16)
        cudaFree(dm->head16);
    cudaFree(dm->embd16);
    cudaFree(dm->norms);
    memset(dm, 0, sizeof *dm);
}

int btc_model_upload(btc_model *dm, const bt_model *m, int random_weights, uint64_t seed)
{
    memset(dm, 0, sizeof *dm);
    dm->hp = m->hp;
    dm->tied = m->tied;
    const bt_dims dims = bt_dims_of(&m->hp);
    const int L = dims.L, D = dims.D, V = dims.V;
    int rc = 0;
    float code8[256];
    for (int i = 0; i < 256; i++)
        code8[i] = bt_dynamic_code8(i);
    dm->lin = (btc_linear *)calloc((size_t)L * BT_MOD_N, sizeof(btc_linear));
    if (!dm->lin)
        return bt_fail(BT_ERR_NOMEM, "cuda: out of host memory");
    /* random NF4 content, shared by every linear of one shape (benchmarks only) */
    std::vector<uint8_t> rnd_packed, rnd_absq;
    std::vector<float> rnd_nested;
    for (int l = 0; l < L && !rc; l++)
        for (int mod = 0; mod < BT_MOD_N && !rc; mod++) {
            const bt_base_linear *bl = &m->layers[l].lin[mod];
            btc_linear *d = &dm->lin[l * BT_MOD_N + mod];
            d->rows = bl->rows;
            d->cols = bl->cols;
            d->is_nf4 = bl->is_nf4 || random_weights;
            const int64_t n = (int64_t)bl->rows * bl->cols;
            if (n > dm->max_nk)
                dm->max_nk = n;
            if (d->is_nf4 && (n % 64 != 0 || bl->cols % 64 != 0)) {
                rc = bt_fail(BT_ERR_UNSUPPORTED, "cuda: layer %d %s: NF4 needs in %% 64 == 0 (%d x %d)",
                             l, bt_module_name(mod), bl->rows, bl->cols);
                break;
            }
            if (random_weights) {
                const size_t nb = (size_t)(n / 64), nn = (nb + 255) / 256;
                if (rnd_packed.size() < (size_t)(n / 2)) {
                    bt_rng r;
                    bt_rng_seed(&r, seed ^ 0x5157ull);
                    rnd_packed.resize((size_t)(n / 2));
                    for (auto &b : rnd_packed)
                        b = (uint8_t)(bt_rng_next(&r) >> 56);
                }
                if (rnd_absq.size() < nb) {
                    bt_rng r;
                    bt_rng_seed(&r, seed ^ 0xab5ull);
                    rnd_absq.resize(nb);
                    for (auto &b : rnd_absq) /* absmax = code8[b] * 0.02: |w| <= 0.02 */
                        b = (uint8_t)(bt_rng_next(&r) >> 56);
                }
                if (rnd_nested.size() < nn)
                    rnd_nested.assign(nn, 0.02f);
                rc = bt_cuda_nf4_upload(&d->q, bl->rows, bl->cols, rnd_packed.data(), rnd_absq.data(),
                                        rnd_nested.data(), 0.0f, code8);
                if (rc)
                    rc = bt_fail(rc, "cuda: NF4 upload of layer %d %s failed", l, bt_module_name(mod));
            } else if (bl->is_nf4) {
                rc = bt_cuda_nf4_upload(&d->q, bl->rows, bl->cols, bl->q.packed, bl->q.absmax_q,
                                        bl->q.nested_absmax, bl->q.offset, code8);
                if (rc)
                    rc = bt_fail(rc, "cuda: NF4 upload of layer %d %s failed (out of device memory?)",
                                 l, bt_module_name(mod));
            } else if (bl->is_gguf) {
                rc = upload_gguf_linear(dm, d, bl, l, mod);
            } else {
                if (!(rc = dmalloc(dm, (void **)&d->w16, (size_t)n * sizeof(bt_bf16), "a linear")))
                    rc = upload_bf16(d->w16, bl->w, n);
            }
            if (!rc && d->is_nf4)
                dm->bytes += (size_t)n / 2 + (size_t)n / 64 + ((size_t)n / 64 / 256 + 1) * 4;
            if (!rc && bl->bias && !random_weights) {
                if (!(rc = dmalloc(dm, (void **)&d->bias, (size_t)bl->rows * sizeof(float), "a bias")))
                    rc = BTC_CUDA(cudaMemcpy(d->bias, bl->bias, (size_t)bl->rows * sizeof(float),
                                             cudaMemcpyHostToDevice));
            }
        }
    /* embedding, lm_head */
    const int64_t nVD = (int64_t)V * D;
    if (!rc && !(rc = dmalloc(dm, (void **)&dm->embd16, (size_t)nVD * sizeof(bt_bf16), "the embedding")))
        rc = random_weights ? fill_random(dm->embd16, nVD, seed ^ 0xe3bull, 0.02f)
                            : upload_bf16(dm->embd16, m->tok_embd, nVD);
    if (!rc) {
        if (m->tied) {
            dm->head16 = dm->embd16;
        } else if (!(rc = dmalloc(dm, (void **)&dm->head16, (size_t)nVD * sizeof(bt_bf16), "lm_head"))) {
            rc = random_weights ? fill_random(dm->head16, nVD, seed ^ 0x4eadull, 0.02f)
                                : upload_bf16(dm->head16, m->lm_head, nVD);
        }
    }
    /* norms */
    if (!rc && !(rc = dmalloc(dm, (void **)&dm->norms, (size_t)(2 * L + 1) * D * sizeof(float), "norms"))) {
        std::vector<float> h((size_t)(2 * L + 1) * D, 1.0f);
        if (!random_weights) {
            for (int l = 0; l < L; l++) {
                memcpy(&h[(size_t)(2 * l) * D], m->layers[l].attn_norm, (size_t)D * sizeof(float));
                memcpy(&h[(size_t)(2 * l + 1) * D], m->layers[l].ffn_norm, (size_t)D * sizeof(float));
            }
            memcpy(&h[(size_t)(2 * L) * D], m->output_norm, (size_t)D * sizeof(float));
        }
        rc = BTC_CUDA(cudaMemcpy(dm->norms, h.data(), h.size() * sizeof(float), cudaMemcpyHostToDevice));
    }
    if (!rc)
        rc = BTC_CUDA(cudaDeviceSynchronize());
    if (rc)
        btc_model_free(dm);
    return rc;
}
