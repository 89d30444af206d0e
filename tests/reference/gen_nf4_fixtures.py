#!/usr/bin/env python3
"""Generate NF4 double-quantisation fixtures with the real bitsandbytes, for tests/unit/kernels/test_nf4.c.

Pinned: bitsandbytes==0.48.2, torch==2.15.0 (CPU; bitsandbytes 0.45.x has no CPU quantize_4bit).
Set up (from the repo root):
    python3 -m venv .venv-nf4 && .venv-nf4/bin/pip install bitsandbytes==0.48.2 torch==2.15.0
    .venv-nf4/bin/python tests/reference/gen_nf4_fixtures.py tests/fixtures/nf4

Each case file <name>.bin (little endian) is:
    magic   8 bytes  b"BTNF4FX1"
    rows    int64
    cols    int64
    offset  float32  (quant_state.offset)
    nnested int64    (len(state2.absmax))
    W       float32[rows*cols]          input
    packed  uint8[rows*cols/2]          quantize_4bit output (high nibble first)
    absmaxq uint8[rows*cols/64]         quant_state.absmax (8-bit codes)
    nested  float32[nnested]            quant_state.state2.absmax
    deq     float32[rows*cols]          dequantize_4bit(packed, quant_state)
scales_<nb>.bin exercises the offset (torch mean, cascade-summed) and the nested code on many
blocks with a compact input: W[b, :] = (am[b], 0, ..., 0), so absmax == am:
    magic   8 bytes  b"BTNF4SC1"
    nb      int64
    offset  float32
    nnested int64
    am      float32[nb]
    absmaxq uint8[nb]
    nested  float32[nnested]
code8.bin is float32[256]: create_dynamic_map(signed=True) (fresh, see the code[0] note below).

Notes on what the CPU path of bitsandbytes 0.48.2 does, versus the CUDA kernels that produce real
checkpoints: NF4 codes come from argmin |x*(1/absmax) - code| (ties to the lower code) instead of the
CUDA midpoint tree, and the nested 8-bit codes from the C++ CPU quantize_blockwise (division then
binary search) instead of dQuantize<0>, and that C++ function sets code[0] = -1.0 in the shared
cached map before searching (so nested codes of 0 dequantise to -1.0 on CPU but -0.99296875 on
CUDA; `deq` below uses the CUDA map). These agree with the CUDA rules except on values within an
ulp of a midpoint, which these random inputs do not hit (the C test compares every byte).
"""
import os
import struct
import sys

import torch
import bitsandbytes as bnb
import bitsandbytes.functional as F

assert bnb.__version__ == "0.48.2", bnb.__version__
assert torch.__version__.split("+")[0] == "2.15.0", torch.__version__


def case(name, W, outdir):
    W = W.contiguous().float()
    rows, cols = W.shape
    packed, st = F.quantize_4bit(W, blocksize=64, compress_statistics=True, quant_type="nf4")
    # The CPU quantize_blockwise of bitsandbytes (csrc/cpu_ops.cpp quantize_cpu) overwrites code[0]
    # of the cached dynamic map with -1.0 in place; the CUDA path (which makes real checkpoints) keeps
    # create_dynamic_map()'s -0.99296875. Dequantise with the pristine map, as CUDA does.
    assert float(st.state2.code[0]) == -1.0
    st.state2.code = F.create_dynamic_map(signed=True).float()
    deq = F.dequantize_4bit(packed, st)
    assert st.nested and st.state2.blocksize == 256 and st.blocksize == 64
    absq = st.absmax
    assert absq.dtype == torch.uint8
    nested = st.state2.absmax.float()
    with open(os.path.join(outdir, name + ".bin"), "wb") as f:
        f.write(b"BTNF4FX1")
        f.write(struct.pack("<qqfq", rows, cols, float(st.offset), nested.numel()))
        f.write(W.numpy().astype("<f4").tobytes())
        f.write(packed.reshape(-1).numpy().tobytes())
        f.write(absq.reshape(-1).numpy().tobytes())
        f.write(nested.numpy().astype("<f4").tobytes())
        f.write(deq.reshape(-1).float().numpy().astype("<f4").tobytes())
    return st


def scales_case(nb, g, outdir):
    am = torch.rand(nb, generator=g) * torch.rand(nb, generator=g) * 0.2 + 1e-4
    W = torch.zeros(nb, 64)
    W[:, 0] = am
    W[1::3, 0] = -am[1::3]  # sign must not matter
    packed, st = F.quantize_4bit(W, blocksize=64, compress_statistics=True, quant_type="nf4")
    nested = st.state2.absmax.float()
    with open(os.path.join(outdir, "scales_%d.bin" % nb), "wb") as f:
        f.write(b"BTNF4SC1")
        f.write(struct.pack("<qfq", nb, float(st.offset), nested.numel()))
        f.write(W[:, 0].numpy().astype("<f4").tobytes())
        f.write(st.absmax.reshape(-1).numpy().tobytes())
        f.write(nested.numpy().astype("<f4").tobytes())


def main():
    outdir = sys.argv[1] if len(sys.argv) > 1 else "tests/fixtures/nf4"
    os.makedirs(outdir, exist_ok=True)
    g = torch.Generator().manual_seed(1234)
    # small: 8 blocks, one nested block; includes an all-zero block and a constant block
    a = torch.randn(8, 64, generator=g) * 0.05
    a[2].zero_()
    a[5].fill_(-0.25)
    st = case("small_8x64", a, outdir)
    # SmolLM2-like rows (K=576): 180 blocks, one partial nested block; heavy-tailed scales
    b = torch.randn(20, 576, generator=g) * 0.02
    b *= torch.exp(torch.randn(20, 1, generator=g))
    case("rows_20x576", b, outdir)
    # 288 blocks: one full nested block of 256 and a partial one of 32
    c = torch.randn(12, 1536, generator=g) * 0.03
    c[3, 100] = 1.5  # outlier
    case("rows_12x1536", c, outdir)
    scales_case(5000, g, outdir)
    scales_case(13824, g, outdir)  # SmolLM2 FFN matrix: 1536*576/64 blocks
    code = F.create_dynamic_map(signed=True).float()
    assert float(code[0]) != -1.0 and code.numel() == 256
    with open(os.path.join(outdir, "code8.bin"), "wb") as f:
        f.write(code.numpy().astype("<f4").tobytes())


if __name__ == "__main__":
    main()
