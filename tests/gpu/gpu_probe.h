/* The one-kernel probe shared by the GPU test binaries (tests/gpu/gpu_test.h, --probe-only) and the
 * GPU benchmarks (tests/bench/gpu/bench_*_gpu.cu, --probe-only): allocate device memory, upload 4096 floats,
 * launch one kernel of ours (bt_cuda_f32_to_bf16, kernels/cuda/elementwise.cu), read the result
 * back and compare it with the host's bf16 rounding (round to nearest even, as __float2bfloat16).
 * Under compute-sanitizer this is what tests/gpu/run.sh and scripts/gpu-run run to learn whether
 * the tool works on the runtime at all (on gVisor it refuses the device and the first allocation
 * fails). */
#ifndef BT_TESTS_GPU_PROBE_H
#define BT_TESTS_GPU_PROBE_H
#include <cstdio>
#include <vector>

#include "kernels/cuda/kernels_cuda.h"

/* Prints "probe: one kernel ran on <device>: ok" and returns true, or "probe: FAILED: <what>" and
 * returns false. Leaves no allocation behind. */
static inline bool bt_gpu_probe_kernel(void)
{
    const int n = 4096;
    std::vector<float> h(n);
    for (int i = 0; i < n; i++)
        h[i] = (float)i * 0.37f - 700.0f;
    float *din = nullptr;
    bt_bf16 *dout = nullptr;
    cudaError_t e = cudaMalloc(&din, n * sizeof(float));
    if (e == cudaSuccess)
        e = cudaMalloc(&dout, n * sizeof(bt_bf16));
    if (e == cudaSuccess)
        e = cudaMemcpy(din, h.data(), n * sizeof(float), cudaMemcpyHostToDevice);
    const int rc = e == cudaSuccess ? bt_cuda_f32_to_bf16(dout, din, n, 0) : -1;
    if (e == cudaSuccess && rc == 0)
        e = cudaDeviceSynchronize();
    std::vector<bt_bf16> g(n);
    if (e == cudaSuccess && rc == 0)
        e = cudaMemcpy(g.data(), dout, n * sizeof(bt_bf16), cudaMemcpyDeviceToHost);
    size_t bad = 0;
    for (int i = 0; e == cudaSuccess && rc == 0 && i < n; i++)
        bad += __bfloat162float(g[i]) != __bfloat162float(__float2bfloat16(h[i]));
    cudaFree(din);
    cudaFree(dout);
    if (e != cudaSuccess || rc != 0 || bad) {
        printf("probe: FAILED: %s%s (launcher %d, %zu wrong values)\n",
               e != cudaSuccess ? "CUDA error: " : "", e != cudaSuccess ? cudaGetErrorString(e) : "",
               rc, bad);
        return false;
    }
    cudaDeviceProp prop;
    if (cudaGetDeviceProperties(&prop, 0) != cudaSuccess)
        snprintf(prop.name, sizeof prop.name, "device 0");
    printf("probe: one kernel ran on %s: ok\n", prop.name);
    return true;
}
#endif
