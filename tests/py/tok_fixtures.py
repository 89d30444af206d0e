"""Readers of the committed tokenizer fixtures (tests/fixtures/tokenizer/, written by
tests/reference/gen_tokenizer_fixtures.py and gen_tokenizer_spm_fixtures.py), shared by the tests
that compare a tokenizer with them (test_llamacpp.py, test_export_spm_tokenizer.py)."""
import struct
import subprocess


def zstd_bytes(path):
    """The decompressed bytes of a .zst file (the zstd tool, installed by scripts/setup.sh)."""
    return subprocess.run(["zstd", "-dc", str(path)], capture_output=True, check=True).stdout


def read_corpus(path):
    """[(parse_special, raw bytes)] of a BTTKCORP file (gen_tokenizer_fixtures.py write_corpus)."""
    b = zstd_bytes(path)
    assert b[:8] == b"BTTKCORP"
    (n,), off, docs = struct.unpack_from("<I", b, 8), 12, []
    for _ in range(n):
        (ln,) = struct.unpack_from("<I", b, off + 1)
        docs.append((bool(b[off] & 1), b[off + 5:off + 5 + ln]))
        off += 5 + ln
    assert off == len(b)
    return docs


def read_ids(path):
    """[(FNV-1a-64 of the reference decode, ids)] of a BTTKIDS1 file: per document a u64 hash, a
    varint count and varint ids (gen_tokenizer_spm_fixtures.py)."""
    b = zstd_bytes(path)
    assert b[:8] == b"BTTKIDS1"
    (n,), off, out = struct.unpack_from("<I", b, 8), 12, []

    def varint():
        nonlocal off
        v = shift = 0
        while True:
            c = b[off]
            off += 1
            v |= (c & 0x7F) << shift
            shift += 7
            if not c & 0x80:
                return v
    for _ in range(n):
        (h,) = struct.unpack_from("<Q", b, off)
        off += 8
        out.append((h, [varint() for _ in range(varint())]))
    assert off == len(b)
    return out


def fnv1a64(b):
    """FNV-1a, 64-bit, of bytes (the fixtures' hash of a decode)."""
    h = 0xCBF29CE484222325
    for c in b:
        h = ((h ^ c) * 0x100000001B3) & 0xFFFFFFFFFFFFFFFF
    return h
