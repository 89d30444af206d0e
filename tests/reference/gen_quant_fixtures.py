#!/usr/bin/env python3
"""Reference fixtures for common/quant.c (ggml block dequantisation and 16-bit float conversion).

The reference is gguf-py's numpy implementation (gguf/quants.py, gguf==0.17.1), which mirrors
ggml/src/ggml-quants.c dequantize_row_* and ggml-impl.h ggml_compute_fp32_to_bf16.

For every type T in F32 F16 BF16 Q4_0 Q4_1 Q5_0 Q5_1 Q8_0 Q4_K Q5_K Q6_K Q2_K Q3_K it writes into
tests/fixtures/quant/:
  T.blocks   raw block bytes (as stored in a GGUF tensor)
  T.f32      float32 little-endian: gguf.quants.dequantize(blocks, T)
(Q2_K and Q3_K were added later and draw from their own random stream, seed + 1, so the files of
the other types stay byte-identical.)
Blocks come from gguf.quants.quantize (Q4_0..Q8_0, BF16, F16: normal-distributed data with
outliers, an all-zero block and a constant block) followed by random raw blocks (every bit
pattern of the quant fields; the fp16 scales are forced finite). gguf-py has no quantizer for the
K-quants, so their blocks are random raw bytes with finite fp16 d/dmin.

Encoders (common/quant_encode.c bt_ggml_quantize), for T in F16 BF16 Q4_0 Q4_1 Q5_0 Q5_1 Q8_0,
from a third random stream (seed + 2):
  T.enc.in.f32   float32 inputs (normal data with outliers, an all-zero block, a constant block,
                 a block of exact ties for the rounding)
  T.enc.blocks   gguf.quants.quantize(inputs, T)

Conversions (float -> 16-bit, round-to-nearest-even):
  fp32_conv.in.f32        the float32 inputs
  fp32_to_fp16.out.u16    numpy astype(float16)
  fp32_to_bf16.out.u16    gguf.quants.quantize(x, BF16)
Inputs include subnormals of both formats, halfway cases, overflow to inf, inf, and quiet NaN.

Usage (from the repo root; .venv-ref/ is gitignored and shared with the tokenizer fixtures):
  python3 -m venv .venv-ref && .venv-ref/bin/pip install gguf==0.17.1 numpy==1.26.4
  .venv-ref/bin/python tests/reference/gen_quant_fixtures.py [--out tests/fixtures/quant]
"""
import argparse
import os
import sys

import numpy as np

try:
    import gguf
    from gguf import GGMLQuantizationType as T
    from gguf import quants
except ImportError:
    sys.exit("gguf-py missing: .venv-ref/bin/pip install gguf==0.17.1 numpy==1.26.4")

PINNED = {"gguf": "0.17.1", "numpy": "1.26.4"}

# (type, elements per block, bytes per block, offsets of fp16 scale fields inside a block)
TYPES = [
    (T.F32, 1, 4, []),
    (T.F16, 1, 2, []),
    (T.BF16, 1, 2, []),
    (T.Q4_0, 32, 18, [0]),
    (T.Q4_1, 32, 20, [0, 2]),
    (T.Q5_0, 32, 22, [0]),
    (T.Q5_1, 32, 24, [0, 2]),
    (T.Q8_0, 32, 34, [0]),
    (T.Q4_K, 256, 144, [0, 2]),
    (T.Q5_K, 256, 176, [0, 2]),
    (T.Q6_K, 256, 210, [208]),
]
# added later, generated from their own random stream (seed + 1)
TYPES_LATER = [
    (T.Q2_K, 256, 84, [80, 82]),
    (T.Q3_K, 256, 110, [108]),
]
# encoders checked against gguf-py's quantize (random stream seed + 2)
ENCODED = [T.F16, T.BF16, T.Q4_0, T.Q4_1, T.Q5_0, T.Q5_1, T.Q8_0]
QUANTIZABLE = {T.F16, T.BF16, T.Q4_0, T.Q4_1, T.Q5_0, T.Q5_1, T.Q8_0}


def source_data(rng, n):
    x = rng.standard_normal(n).astype(np.float32) * np.float32(0.05)
    x[rng.integers(0, n, n // 50)] *= np.float32(40.0)  # outliers
    return x


def finite_f16(rng, n, lo=1e-4, hi=0.05):
    mag = np.exp(rng.uniform(np.log(lo), np.log(hi), n)).astype(np.float16)
    sign = np.where(rng.integers(0, 2, n) == 1, -1, 1).astype(np.float16)
    return (mag * sign).astype(np.float16)


def make_blocks(rng, qtype, blck, bsize, scale_offs):
    if qtype == T.F32:
        x = source_data(rng, 1024)
        x[:8] = np.array([0.0, -0.0, np.inf, -np.inf, np.nan, 1e-45, -3.4e38, 1.0], np.float32)
        return x.view(np.uint8)
    if qtype == T.F16:
        raw = rng.integers(0, 1 << 16, 1024, dtype=np.uint32).astype(np.uint16)
        # keep NaNs quiet: signalling-NaN conversion differs between numpy builds (F16C)
        nan = ((raw & 0x7C00) == 0x7C00) & ((raw & 0x3FF) != 0)
        raw[nan] |= 0x0200
        raw[:6] = [0x0000, 0x8000, 0x0001, 0x03FF, 0x7C00, 0xFE00]
        return raw.view(np.uint8)
    if qtype == T.BF16:
        q = quants.quantize(source_data(rng, 512), qtype).view(np.uint16)
        raw = rng.integers(0, 1 << 16, 512, dtype=np.uint32).astype(np.uint16)
        return np.concatenate([q, raw]).view(np.uint8)
    parts = []
    if qtype in QUANTIZABLE:
        x = source_data(rng, 48 * blck)
        x[:blck] = 0.0
        x[blck:2 * blck] = 0.25
        parts.append(quants.quantize(x.reshape(-1, blck), qtype).reshape(-1))
    n_raw = 16 if blck == 32 else 8
    raw = rng.integers(0, 256, (n_raw, bsize), dtype=np.uint32).astype(np.uint8)
    for off in scale_offs:
        raw[:, off:off + 2] = finite_f16(rng, n_raw).view(np.uint8).reshape(n_raw, 2)
    parts.append(raw.reshape(-1))
    return np.concatenate(parts).astype(np.uint8)


def encoder_inputs(rng, n_blocks=64, blck=32):
    x = source_data(rng, n_blocks * blck).reshape(n_blocks, blck)
    x[0] = 0.0
    x[1] = 0.3
    # exact ties of the rounding: multiples of half a step of a block whose extreme is 8 / -8
    x[2] = (np.arange(blck, dtype=np.float32) - blck / 2) * np.float32(0.5)
    x[3] = np.linspace(-1, 1, blck, dtype=np.float32)
    return x.reshape(-1)


def write_dequant(rng, args, qtype, blck, bsize, scale_offs):
    blocks = make_blocks(rng, qtype, blck, bsize, scale_offs)
    assert blocks.size % bsize == 0
    with np.errstate(all="ignore"):
        y = quants.dequantize(blocks, qtype).astype(np.float32).reshape(-1)
    assert y.size == blocks.size // bsize * blck
    total = 0
    for suffix, arr in ((".blocks", blocks), (".f32", y)):
        path = os.path.join(args.out, qtype.name + suffix)
        arr.astype(arr.dtype.newbyteorder("<")).tofile(path)
        total += os.path.getsize(path)
    print(f"{qtype.name}: {blocks.size // bsize} blocks, {y.size} values")
    return total


def conversion_inputs(rng):
    special = np.array([
        0.0, -0.0, 1.0, -1.0, 65504.0, 65519.99, 65520.0, -65520.0, 1e6, np.inf, -np.inf, np.nan,
        6.103515625e-05, 6.0975552e-05, 5.960464477539063e-08, 2.9802322387695312e-08,
        2.98023259e-08, 4.470348358154297e-08, 1e-10, -1e-10, 3.3895314e38, 3.4028235e38,
        1.17549435e-38, 1e-45, 1.0009765625, 1.00048828125, 1.00146484375, 1.0000000596,
    ], dtype=np.float32)
    rnd = source_data(rng, 2000)
    bits = rng.integers(0, 1 << 32, 2000, dtype=np.uint64).astype(np.uint32)
    # halfway cases for bf16 (low 16 bits exactly 0x8000) and for fp16 (low 13 bits 0x1000)
    half_bf = (rng.integers(0, 1 << 16, 200, dtype=np.uint32) << 16 | 0x8000).astype(np.uint32)
    e = rng.integers(103, 143, 200, dtype=np.uint32)  # fp16 subnormal..normal exponents
    half_f16 = (e << 23 | (rng.integers(0, 1 << 10, 200, dtype=np.uint32) << 13) | 0x1000)
    small = np.exp(rng.uniform(np.log(1e-9), np.log(1e-4), 500)).astype(np.float32)
    x = np.concatenate([special, rnd, bits.view(np.float32), half_bf.view(np.float32),
                        half_f16.astype(np.uint32).view(np.float32), small, -small])
    u = x.view(np.uint32)
    u[np.isnan(x)] |= np.uint32(0x00400000)  # quiet NaNs only (sNaN handling is platform-specific)
    return x


def main():
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out", default="tests/fixtures/quant")
    ap.add_argument("--seed", type=int, default=20240611)
    args = ap.parse_args()
    for mod, want in PINNED.items():
        got = sys.modules[mod].__version__ if mod == "numpy" else gguf.__version__ \
            if hasattr(gguf, "__version__") else None
        if got is not None and got != want:
            print(f"warning: {mod} {got} installed, fixtures are pinned to {want}", file=sys.stderr)
    os.makedirs(args.out, exist_ok=True)
    rng = np.random.default_rng(args.seed)
    total = 0
    for qtype, blck, bsize, scale_offs in TYPES:
        total += write_dequant(rng, args, qtype, blck, bsize, scale_offs)
    x = conversion_inputs(rng)
    with np.errstate(all="ignore"):
        f16 = x.astype(np.float16).view(np.uint16)
        bf16 = quants.quantize(x, T.BF16).view(np.uint16)
    for name, arr in (("fp32_conv.in.f32", x), ("fp32_to_fp16.out.u16", f16),
                      ("fp32_to_bf16.out.u16", bf16)):
        path = os.path.join(args.out, name)
        arr.tofile(path)
        total += os.path.getsize(path)
    rng_later = np.random.default_rng(args.seed + 1)
    for qtype, blck, bsize, scale_offs in TYPES_LATER:
        total += write_dequant(rng_later, args, qtype, blck, bsize, scale_offs)
    rng_enc = np.random.default_rng(args.seed + 2)
    for qtype in ENCODED:
        blck = 32 if qtype not in (T.F16, T.BF16) else 1
        x = encoder_inputs(rng_enc)
        blocks = quants.quantize(x.reshape(-1, blck) if blck > 1 else x, qtype).reshape(-1)
        for suffix, arr in ((".enc.in.f32", x), (".enc.blocks", blocks.view(np.uint8))):
            path = os.path.join(args.out, qtype.name + suffix)
            arr.tofile(path)
            total += os.path.getsize(path)
        print(f"{qtype.name} encoder: {x.size} values")
    print(f"conversions: {x.size} values; total {total} bytes in {args.out}")


if __name__ == "__main__":
    main()
