/* Upload of a bt_model (trainer/model/model.h) to the device: NF4 linears as NF4 (bt_cuda_nf4_upload),
 * GGUF-native linears as their ggml blocks (bt_cuda_ggml_upload: Q4_0, Q4_1, Q5_0, Q5_1, Q8_0,
 * Q4_K, Q5_K, Q6_K; F16 / BF16 / F32 tensors as bf16, the value the decoders would give; other types are
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
                       "the GGUF-native base (on the GPU: Q4_0, Q4_1, Q5_0, Q5_1, Q8_0, Q4_K, Q5_K, "
                       "Q6_K, and F16/BF16/F32 held as bf16): set base_dtype \"nf4\" to re-quantise "
                       "the base to NF4 (or \"fp32\"), or train on the CPU (device \"cpu\" supports every "
                       "type)", l, bt_module_name(mod), bt_ggml_type_name(t));
    std::vector<float> f((size_t)n);
    int rc = bt_ggml_mat_dequantize_rows(&bl->g, 0, bl->rows, f.data());
    if (rc)
        return rc;
    rc = dmalloc(dm, (void **)&d->w16, (size_t)n * sizeof(bt_bf16), "a linear");
    return rc ? rc : upload_bf16(d->w16, f.data(), n);
}

/* Copy bytes [k0, k1) of src (n bytes in all; past n: zeros) to dst. */
void slice_bytes(uint8_t *dst, const uint8_t *src, int64_t n, int64_t k0, int64_t k1)
{
    const int64_t e = k1 < n ? k1 : n;
    if (e > k0)
        memcpy(dst, src + k0, (size_t)(e - k0));
    if (k1 > (e > k0 ? e : k0))
        memset(dst + (e > k0 ? e - k0 : 0), 0, (size_t)(k1 - (e > k0 ? e : k0)));
}

/* dist.shard_base: rank `rank`'s shard of one linear (plan.h bt_shard_cut), its segments one after
 * another in one device allocation; the bytes are the host model's own (NF4 codes and absmax, the
 * GGUF file's blocks), never re-quantised; F16/BF16/F32 GGUF rows and fp32 rows as bf16 (what the
 * whole-base upload holds). A host linear cut at load (model.h bt_model_load_gguf_shard:
 * bl->shard_world == W) holds exactly this rank's rows [bl->shard_r0, + g.rows); one cut for
 * another rank or W is refused (BT_ERR_INVALID). *goff: the running offset in a gathered layer
 * buffer. */
int upload_shard(btc_model *dm, btc_shard *sh, const bt_base_linear *bl, int l, int mod, int rank,
                 int W, int64_t *goff)
{
    const int64_t rows = bl->rows, cols = bl->cols, n = rows * cols;
    const bool cut = bl->shard_world > 1; /* the host holds my rows only, row 0 = row shard_r0 */
    if (cut && (bl->shard_world != W || bl->shard_rank != rank || !(bl->is_gguf || bl->is_nf4)))
        return bt_fail(BT_ERR_INVALID, "cuda: layer %d %s was loaded as rank %d's shard of %d, but "
                       "this trainer is rank %d of %d (dist.shard_base)", l, bt_module_name(mod),
                       bl->shard_rank, bl->shard_world, rank, W);
    const int64_t hr0 = cut ? bl->shard_r0 : 0;          /* first row (NF4: unit) the host holds */
    const int64_t hrows = cut && bl->is_gguf ? bl->g.rows : rows; /* rows it holds (GGUF) */
    sh->gtype = -1;
    if (bl->is_nf4) {
        bt_shard_cut_nf4(&sh->cut, n, W);
        sh->offset = bl->q.offset;
    } else if (bl->is_gguf && bt_cuda_ggml_supported(bl->g.type)) {
        sh->gtype = bl->g.type;
        bt_shard_cut_rows(&sh->cut, rows, (int64_t)bl->g.row_bytes, W);
    } else if (bl->is_gguf && bl->g.type != BT_GGML_F32 && bl->g.type != BT_GGML_F16 &&
               bl->g.type != BT_GGML_BF16) {
        btc_linear tmp;
        memset(&tmp, 0, sizeof tmp);
        return upload_gguf_linear(dm, &tmp, bl, l, mod); /* refuses the type, naming it */
    } else {
        bt_shard_cut_rows(&sh->cut, rows, cols * 2, W); /* bf16 */
    }
    const bt_shard_cut &c = sh->cut;
    const int64_t bytes = bt_shard_cut_bytes(&c);
    std::vector<uint8_t> h((size_t)bytes, 0);
    uint8_t *o = h.data();
    const int64_t u0 = (int64_t)rank * c.per, u1 = u0 + c.per; /* my units [u0, u1) */
    if (bl->is_nf4) { /* a cut (bt_model_nf4_cut) holds units [shard_r0, ...): q.n weights */
        const int64_t hn = cut ? bl->q.n : n, hu = cut ? (hn + BT_SHARD_NF4_WEIGHTS - 1) / BT_SHARD_NF4_WEIGHTS
                                                      : c.units;
        slice_bytes(o, bl->q.packed, hn / 2, (u0 - hr0) * c.unit[0], (u1 - hr0) * c.unit[0]);
        o += c.per * c.unit[0];
        slice_bytes(o, bl->q.absmax_q, hn / 64, (u0 - hr0) * c.unit[1], (u1 - hr0) * c.unit[1]);
        o += c.per * c.unit[1];
        slice_bytes(o, (const uint8_t *)bl->q.nested_absmax, hu * 4, (u0 - hr0) * 4, (u1 - hr0) * 4);
    } else if (sh->gtype >= 0) {
        slice_bytes(o, bl->g.data, hrows * c.unit[0], (u0 - hr0) * c.unit[0],
                    (u1 - hr0) * c.unit[0]);
    } else { /* bf16 rows of my units */
        const int64_t r1 = u1 < rows ? u1 : rows, nr = r1 > u0 ? r1 - u0 : 0;
        std::vector<float> f((size_t)(nr * cols));
        if (nr > 0 && bl->is_gguf) {
            int rc = bt_ggml_mat_dequantize_rows(&bl->g, u0 - hr0, nr, f.data());
            if (rc)
                return rc;
        } else if (nr > 0) {
            memcpy(f.data(), bl->w + u0 * cols, (size_t)(nr * cols) * sizeof(float));
        }
        bt_bf16 *b16 = reinterpret_cast<bt_bf16 *>(o);
        for (int64_t i = 0; i < nr * cols; i++)
            b16[i] = __float2bfloat16_rn(f[(size_t)i]);
    }
    for (int i = 0; i < c.nseg; i++) {
        sh->goff[i] = *goff;
        *goff += bt_shard_region((int64_t)W * c.per * c.unit[i]);
    }
    BTC_TRY(dmalloc(dm, (void **)&sh->data, (size_t)bytes, "a base shard"));
    dm->shard_bytes += (size_t)bytes;
    return BTC_CUDA(cudaMemcpy(sh->data, h.data(), (size_t)bytes, cudaMemcpyHostToDevice));
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
    if (dm->shards) {
        for (int i = 0; i < dm->hp.n_layer * BT_MOD_N; i++)
            cudaFree(dm->shards[i].data);
        free(dm->shards);
    }
    cudaFree(dm->code8);
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
    cudaFree(dm->qk_norms);
    cudaFree(dm->post_norms);
    cudaFree(dm->inv_local);
    memset(dm, 0, sizeof *dm);
}

void btc_shard_view(const btc_model *dm, int l, int mod, uint8_t *buf, btc_linear *out)
{
    const int i = l * BT_MOD_N + mod;
    const btc_shard &sh = dm->shards[i];
    *out = dm->lin[i]; /* shape, flags, bias */
    if (out->is_nf4) {
        out->q.n = (int64_t)out->rows * out->cols;
        out->q.rows = out->rows;
        out->q.cols = out->cols;
        out->q.packed = buf + sh.goff[0];
        out->q.absmax_q = buf + sh.goff[1];
        out->q.nested_absmax = reinterpret_cast<const float *>(buf + sh.goff[2]);
        out->q.code8 = dm->code8;
        out->q.offset = sh.offset;
    } else if (out->is_gguf) {
        out->g.type = sh.gtype;
        out->g.rows = out->rows;
        out->g.cols = out->cols;
        out->g.row_bytes = sh.cut.unit[0];
        out->g.data = buf + sh.goff[0];
    } else {
        out->w16 = reinterpret_cast<bt_bf16 *>(buf + sh.goff[0]);
    }
}

int btc_model_upload(btc_model *dm, const bt_model *m, int random_weights, uint64_t seed,
                     int shard_rank, int shard_world)
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
    const bool shard = shard_world > 1;
    if (shard && random_weights)
        return bt_fail(BT_ERR_INVALID, "cuda: a sharded base needs the model's weights");
    if (shard) {
        dm->shard_rank = shard_rank;
        dm->shard_world = shard_world;
        dm->shards = (btc_shard *)calloc((size_t)L * BT_MOD_N, sizeof(btc_shard));
        if (!dm->shards)
            return bt_fail(BT_ERR_NOMEM, "cuda: out of host memory");
        if (!(rc = dmalloc(dm, (void **)&dm->code8, sizeof code8, "the NF4 code map")))
            rc = BTC_CUDA(cudaMemcpy(dm->code8, code8, sizeof code8, cudaMemcpyHostToDevice));
    }
    /* random NF4 content, shared by every linear of one shape (benchmarks only) */
    std::vector<uint8_t> rnd_packed, rnd_absq;
    std::vector<float> rnd_nested;
    const size_t bytes0 = dm->bytes;
    for (int l = 0; l < L && !rc; l++) {
        int64_t goff = 0; /* this layer's gathered buffer, linear after linear */
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
            if (!shard && bl->shard_world > 1) {
                rc = bt_fail(BT_ERR_INVALID, "cuda: layer %d %s holds only rank %d's shard of %d "
                             "(bt_model_load_gguf_shard), but this trainer keeps the whole base: "
                             "set dist.shard_base with the same world size, or load it whole", l,
                             bt_module_name(mod), bl->shard_rank, bl->shard_world);
                break;
            }
            if (shard) {
                d->is_gguf = bl->is_gguf && bt_cuda_ggml_supported(bl->g.type);
                rc = upload_shard(dm, &dm->shards[l * BT_MOD_N + mod], bl, l, mod, shard_rank,
                                  shard_world, &goff);
                if (!rc && goff > dm->gather_bytes)
                    dm->gather_bytes = goff;
            } else if (random_weights) {
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
            if (!rc && d->is_nf4 && !shard)
                dm->bytes += (size_t)n / 2 + (size_t)n / 64 + ((size_t)n / 64 / 256 + 1) * 4;
            if (!rc && bl->bias && !random_weights) {
                if (!(rc = dmalloc(dm, (void **)&d->bias, (size_t)bl->rows * sizeof(float), "a bias")))
                    rc = BTC_CUDA(cudaMemcpy(d->bias, bl->bias, (size_t)bl->rows * sizeof(float),
                                             cudaMemcpyHostToDevice));
            }
        }
    }
    dm->lin_bytes = dm->bytes - bytes0;
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
    /* QK-norm and sandwich norm weights (1 with random weights, as the norms above), the local
     * layers' RoPE table */
    const int hd = dims.hd;
    if (!rc && m->hp.qk_norm && !(rc = dmalloc(dm, (void **)&dm->qk_norms,
                                               (size_t)2 * L * hd * sizeof(float), "QK-norm weights"))) {
        std::vector<float> h((size_t)2 * L * hd, 1.0f);
        for (int l = 0; l < L && !random_weights; l++) {
            memcpy(&h[(size_t)(2 * l) * hd], m->layers[l].q_norm, (size_t)hd * sizeof(float));
            memcpy(&h[(size_t)(2 * l + 1) * hd], m->layers[l].k_norm, (size_t)hd * sizeof(float));
        }
        rc = BTC_CUDA(cudaMemcpy(dm->qk_norms, h.data(), h.size() * sizeof(float),
                                 cudaMemcpyHostToDevice));
    }
    if (!rc && m->hp.sandwich_norm && !(rc = dmalloc(dm, (void **)&dm->post_norms,
                                                     (size_t)2 * L * D * sizeof(float), "post-norms"))) {
        std::vector<float> h((size_t)2 * L * D, 1.0f);
        for (int l = 0; l < L && !random_weights; l++) {
            memcpy(&h[(size_t)(2 * l) * D], m->layers[l].post_attn_norm, (size_t)D * 4);
            memcpy(&h[(size_t)(2 * l + 1) * D], m->layers[l].post_ffn_norm, (size_t)D * 4);
        }
        rc = BTC_CUDA(cudaMemcpy(dm->post_norms, h.data(), h.size() * sizeof(float),
                                 cudaMemcpyHostToDevice));
    }
    if (!rc && m->inv_freq_local &&
        !(rc = dmalloc(dm, (void **)&dm->inv_local, (size_t)(hd / 2) * sizeof(float), "RoPE table")))
        rc = BTC_CUDA(cudaMemcpy(dm->inv_local, m->inv_freq_local, (size_t)(hd / 2) * sizeof(float),
                                 cudaMemcpyHostToDevice));
    if (!rc)
        rc = BTC_CUDA(cudaDeviceSynchronize());
    if (rc)
        btc_model_free(dm);
    return rc;
}
