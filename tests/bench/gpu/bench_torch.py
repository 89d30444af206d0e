#!/usr/bin/env python3
"""PyTorch equivalents of tests/bench/gpu/bench_kernels_gpu.cu, same operands (Llama-2-7B shapes,
T tokens) and the same markdown rows:
  | kernel | shape | impl | ms | throughput | % of ceiling | card |
Median of 20 runs after 3 warm-ups (CUDA events). Rows that cannot run print 'skipped: reason'.
Usage: bench_torch.py [--T 4096] [--ceiling-tflops X --ceiling-gbs Y]
The ceilings are the card's MEASURED bf16 GEMM TFLOP/s and device-to-device copy GB/s (read +
write), not datasheet peaks: tests/bench/gpu/run.sh passes those bench_kernels_gpu measured in the
same run; without them this script measures them itself the same way (an 8192^3 bf16 matmul and a
2 GiB copy, median of 10 after 3 warm-ups)."""
import argparse
import sys

try:
    import torch
    import torch.nn.functional as F
except Exception as e:  # noqa: BLE001
    print(f"bench_torch: skipped: torch not importable ({e})")
    sys.exit(0)

def timed(fn, iters=20):
    for _ in range(3):
        fn()
    ts = []
    for _ in range(iters):
        a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        a.record()
        fn()
        b.record()
        b.synchronize()
        ts.append(a.elapsed_time(b))
    ts.sort()
    return ts[len(ts) // 2]


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--T", type=int, default=4096)
    ap.add_argument("--ceiling-tflops", type=float, default=0)
    ap.add_argument("--ceiling-gbs", type=float, default=0)
    a = ap.parse_args()
    if not torch.cuda.is_available():
        print("bench_torch: skipped: torch.cuda.is_available() is False")
        return
    name = torch.cuda.get_device_name(0)
    ptf, pgb = a.ceiling_tflops, a.ceiling_gbs
    if not ptf or not pgb:
        n, nb = 8192, 2 << 30
        x = torch.randn(n, n, device="cuda", dtype=torch.bfloat16)
        ptf = ptf or 2.0 * n ** 3 / (timed(lambda: x @ x, 10) * 1e-3) / 1e12
        del x
        src = torch.empty(nb, device="cuda", dtype=torch.uint8)
        dst = torch.empty_like(src)
        pgb = pgb or 2.0 * nb / (timed(lambda: dst.copy_(src), 10) * 1e-3) / 1e9
        del src, dst
        print(f"bench_torch: ceilings measured here: {ptf:.0f} bf16 TFLOP/s, {pgb:.0f} GB/s", file=sys.stderr)
    print(f"torch {torch.__version__} on {name}; ceilings {ptf:.0f} TFLOP/s, {pgb:.0f} GB/s (measured)")

    def rf(k, shape, impl, ms, flops):
        tf = flops / (ms * 1e-3) / 1e12
        print(f"| {k} | {shape} | {impl} | {ms:.3f} | {tf:.1f} TFLOP/s | {100 * tf / ptf:.1f}% | {name} |", flush=True)

    def rb(k, shape, impl, ms, nbytes):
        gbs = nbytes / (ms * 1e-3) / 1e9
        print(f"| {k} | {shape} | {impl} | {ms:.3f} | {gbs:.0f} GB/s | {100 * gbs / pgb:.1f}% | {name} |", flush=True)

    def skip(k, why):
        print(f"| {k} | | torch | skipped: {why} | | | {name} |", flush=True)

    dev, bf = "cuda", torch.bfloat16
    M, D, Fd, H, HD, V, R = a.T, 4096, 11008, 32, 128, 32000, 16
    torch.manual_seed(0)
    # NF4 via bitsandbytes
    X = torch.randn(M, D, device=dev, dtype=bf)
    W = torch.randn(Fd, D, device=dev, dtype=bf) * 0.02
    try:
        import bitsandbytes as bnb
        import bitsandbytes.functional as bnbf
        q, st = bnbf.quantize_4bit(W, blocksize=64, quant_type="nf4", compress_statistics=True)
        n = Fd * D
        ms = timed(lambda: bnbf.dequantize_4bit(q, st, quant_type="nf4"))
        rb("nf4_dequant", f"{Fd}x{D}", f"bitsandbytes {bnb.__version__}", ms, n / 2 + n / 64 + 2 * n)
        ms = timed(lambda: bnb.matmul_4bit(X, q.t(), quant_state=st))
        rf("nf4_linear_fwd (dequant+gemm)", f"M{M} K{D} N{Fd}", "bnb.matmul_4bit", ms, 2.0 * M * Fd * D)
    except Exception as e:  # noqa: BLE001
        skip("nf4_dequant / nf4_linear_fwd", f"bitsandbytes unavailable ({type(e).__name__}: {e})")
    ms = timed(lambda: X @ W.t())
    rf("gemm bf16 (cuBLAS)", f"M{M} K{D} N{Fd}", "torch.matmul", ms, 2.0 * M * Fd * D)
    A = torch.randn(R, D, device=dev, dtype=bf) * 0.02
    Bm = torch.randn(Fd, R, device=dev, dtype=bf) * 0.02
    Y = torch.empty(M, Fd, device=dev, dtype=bf)
    ms = timed(lambda: Y.add_((X @ A.t()) @ Bm.t(), alpha=2.0))
    rf("lora_fwd", f"M{M} K{D} N{Fd} r{R}", "torch (x@A^T@B^T)", ms, 2.0 * M * R * (D + Fd))
    # RMSNorm
    x = torch.randn(M, D, device=dev, dtype=bf, requires_grad=True)
    w = torch.ones(D, device=dev, dtype=bf)
    if hasattr(F, "rms_norm"):
        ms = timed(lambda: F.rms_norm(x, (D,), w, 1e-5))
        rb("rmsnorm_fwd", f"M{M} D{D}", "F.rms_norm", ms, 4.0 * M * D)
        y = F.rms_norm(x, (D,), w, 1e-5)
        gy = torch.randn_like(y)
        ms = timed(lambda: torch.autograd.grad(y, x, gy, retain_graph=True))
        rb("rmsnorm_bwd", f"M{M} D{D}", "F.rms_norm autograd", ms, 6.0 * M * D)
    else:
        skip("rmsnorm", "F.rms_norm needs torch >= 2.4")
    # SwiGLU
    g = torch.randn(M, Fd, device=dev, dtype=bf, requires_grad=True)
    u = torch.randn(M, Fd, device=dev, dtype=bf, requires_grad=True)
    n = M * Fd
    ms = timed(lambda: F.silu(g) * u)
    rb("swiglu_fwd", f"M{M} F{Fd}", "F.silu(g)*u", ms, 6.0 * n)
    h = F.silu(g) * u
    gh = torch.randn_like(h)
    ms = timed(lambda: torch.autograd.grad(h, (g, u), gh, retain_graph=True))
    rb("swiglu_bwd", f"M{M} F{Fd}", "autograd", ms, 10.0 * n)
    del g, u, h, gh
    # attention (flash backend), causal, [1, H, T, D]; RoPE not included
    q = torch.randn(1, H, M, HD, device=dev, dtype=bf, requires_grad=True)
    k = torch.randn(1, H, M, HD, device=dev, dtype=bf, requires_grad=True)
    v = torch.randn(1, H, M, HD, device=dev, dtype=bf, requires_grad=True)
    fl = 4.0 * M * M * H * HD / 2
    try:
        from torch.nn.attention import SDPBackend, sdpa_kernel
        with sdpa_kernel(SDPBackend.FLASH_ATTENTION):
            ms = timed(lambda: F.scaled_dot_product_attention(q, k, v, is_causal=True))
            rf("attn_fwd (no RoPE)", f"T{M} H{H} D{HD} causal", "SDPA flash", ms, fl)
            o = F.scaled_dot_product_attention(q, k, v, is_causal=True)
            go = torch.randn_like(o)
            ms = timed(lambda: torch.autograd.grad(o, (q, k, v), go, retain_graph=True))
            rf("attn_bwd (no RoPE)", f"T{M} H{H} D{HD} causal", "SDPA flash", ms, 2.5 * fl)
    except Exception as e:  # noqa: BLE001
        skip("attn", f"SDPA flash backend unavailable ({type(e).__name__}: {e})")
    del q, k, v
    # linear + CE (forward + dX), logits materialised as torch does
    xs = torch.randn(M, D, device=dev, dtype=bf, requires_grad=True)
    Wv = torch.randn(V, D, device=dev, dtype=bf) * 0.02
    tg = torch.randint(0, V, (M,), device=dev)

    def ce():
        loss = F.cross_entropy((xs @ Wv.t()).float(), tg)
        torch.autograd.grad(loss, xs)
    ms = timed(ce)
    rf("linear_ce fwd+dX", f"M{M} D{D} V{V}", "matmul + F.cross_entropy", ms, 4.0 * M * D * V)
    # AdamW fused over 40M fp32 params
    n = 39976960
    p = torch.zeros(n, device=dev, requires_grad=True)
    p.grad = torch.zeros_like(p)
    try:
        opt = torch.optim.AdamW([p], lr=1e-4, fused=True)
        impl = "AdamW(fused=True)"
    except Exception:  # noqa: BLE001
        opt = torch.optim.AdamW([p], lr=1e-4, foreach=True)
        impl = "AdamW(foreach=True)"
    ms = timed(opt.step)
    rb("adamw_multi", f"n={n}", impl, ms, 28.0 * n)


if __name__ == "__main__":
    main()
