"""A loaderd micro-batch as NumPy arrays (proto/batch.h, proto/PROTOCOL.md §4), its structural
validation (the rules of proto/batch.c bt_batch_validate, vectorised), the FNV-1a checksum, and
the padding-free flattened form transformers' DataCollatorWithFlattening produces.

Layout of the rows: B rows of T tokens. input_ids, labels, position_ids are int32 [B, T];
labels are unshifted (labels[t] is the target of the prediction made at t - 1, -100 = no loss:
prompt tokens, padding, the first token of every packed document); position_ids restart at 0 per
document; cu_seqlens (int32 [n_cu]) are the flat segment boundaries over the B*T tokens, every
row start is one, and the unused tail of a row is a padding segment of its own. Per segment k
(layout 2, issue 25): seg_kind[k] (int32 [n_cu - 1], layout.SEG_*: 0 plain / padding, 1 chosen,
2 rejected, 3 kto desirable, 4 kto undesirable) and seg_pair[k] (int32 [n_cu - 1]: the
preference record's index within the batch, from 0 in order; -1 for plain segments). A pair is
two adjacent segments of one row, chosen then rejected, with the same seg_pair.
Layout 3 (issue 25 §2, reference log-probs in loaderd's token cache), per segment: seg_src /
seg_line (int32: the record's shard index in the job and 1-based line; -1 for plain segments, line
-1 past 2^31-1), seg_ref_ok (int32 0/1) and seg_ref_logp (float64: the reference model's summed
log-prob in nats over the segment's labelled tokens, as cached for the job's ref_base; 0.0 when
seg_ref_ok is 0). Hand computed values back with LoaderdClient.ref_put.
"""
import math

import numpy as np

from . import layout as L
from .errors import LoaderdProtocolError


class Batch:
    """One micro-batch. Arrays are read-only int32 NumPy arrays: zero-copy views into the ring
    slot while the batch is held (valid until LoaderdClient.release() or the next next(): after
    that loaderd reuses the slot), or private copies after copy().

    Header fields: step (index in this rank's stream, from 0), job_id, rank, B, T,
    n_real_tokens, n_labelled_tokens (labels != -100), n_docs, epoch, flags, checksum,
    resume_state (bytes, 256: the loader state after this batch; opaque).
    """

    __slots__ = ("step", "job_id", "rank", "B", "T", "n_real_tokens", "n_labelled_tokens", "n_cu",
                 "n_docs", "flags", "epoch", "checksum", "resume_state", "input_ids", "labels",
                 "position_ids", "cu_seqlens", "seg_pair", "seg_kind", "seg_src", "seg_line", "seg_ref_ok",
                 "seg_ref_logp", "_owned")

    @property
    def end_of_data(self):
        return bool(self.flags & L.F_END_OF_DATA)

    def copy(self):
        """A Batch owning its arrays (safe to keep after the slot is released)."""
        b = Batch.__new__(Batch)
        for k in Batch.__slots__:
            v = getattr(self, k)
            if isinstance(v, np.ndarray):
                v = v.copy()
                v.flags.writeable = False
            setattr(b, k, v)
        b._owned = True
        return b

    @property
    def owned(self):
        """False while the arrays are views into the ring slot."""
        return self._owned

    def segments(self):
        """(start, end) pairs of every segment over the flattened B*T tokens."""
        cu = self.cu_seqlens
        return list(zip(cu[:-1].tolist(), cu[1:].tolist()))

    def __repr__(self):
        return (f"Batch(step={self.step}, job_id={self.job_id}, rank={self.rank}, B={self.B}, T={self.T}, "
                f"docs={self.n_docs}, real={self.n_real_tokens}, labelled={self.n_labelled_tokens}, "
                f"epoch={self.epoch}{', END_OF_DATA' if self.end_of_data else ''})")


def fnv1a64(chunks, h=L.FNV64_INIT):
    """FNV-1a 64 over the bytes of each chunk in turn (common/bt_common.h bt_fnv1a64; FNV spec:
    www.isthe.com/chongo/tech/comp/fnv). Pure Python: a few MB/s."""
    p, m = L.FNV64_PRIME, 0xFFFFFFFFFFFFFFFF
    for c in chunks:
        for byte in memoryview(c).cast("B"):
            h = ((h ^ byte) * p) & m
    return h


def batch_checksum(b):
    """bt_batch_checksum: FNV-1a 64 over input_ids, labels, position_ids (B*T int32 each, in
    that order), cu_seqlens[0..n_cu), then seg_pair, seg_kind, seg_src, seg_line, seg_ref_ok and
    seg_ref_logp [0..n_cu-1) (the float64 values as their little-endian bytes)."""
    return fnv1a64(np.ascontiguousarray(a) for a in (
        b.input_ids, b.labels, b.position_ids, b.cu_seqlens, b.seg_pair, b.seg_kind, b.seg_src, b.seg_line,
        b.seg_ref_ok, b.seg_ref_logp))


def read_batch(buf, off, B, T):
    """Parse the slot at byte offset `off` of `buf` (the ring mapping) for a B x T ring: the
    header from a private copy, the arrays as read-only zero-copy views. The END_OF_DATA batch
    has no arrays (they are None). Raises LoaderdProtocolError for a header whose n_cu cannot
    be addressed; the full check is validate()."""
    hdr = bytes(buf[off:off + L.BATCH_HEADER_BYTES])
    b = Batch.__new__(Batch)
    for k, v in zip(L.BATCH_FIELDS, L.BATCH_HEADER.unpack_from(hdr, 0)):
        if k not in ("magic", "layout_version", "B", "T"):
            setattr(b, k, v)
    magic, version, hB, hT = (L.BATCH_HEADER.unpack_from(hdr, 0)[i] for i in (0, 1, 5, 6))
    if magic != L.BATCH_MAGIC:
        raise LoaderdProtocolError(f"batch: bad magic 0x{magic:08x} (want 0x{L.BATCH_MAGIC:08x})")
    if version != L.BATCH_LAYOUT_VERSION:
        raise LoaderdProtocolError(f"batch: layout version {version} (want {L.BATCH_LAYOUT_VERSION})")
    if (hB, hT) != (B, T):
        raise LoaderdProtocolError(f"batch step {b.step}: shape {hB}x{hT} (want {B}x{T})")
    b.B, b.T = B, T
    b.resume_state = hdr[L.BATCH_OFF["resume_state"]:L.BATCH_OFF["resume_state"] + L.RESUME_STATE_BYTES]
    b._owned = False
    if b.flags & ~L.F_END_OF_DATA:
        raise LoaderdProtocolError(f"batch step {b.step}: unknown flags 0x{b.flags:x}")
    if b.flags & L.F_END_OF_DATA:
        b.input_ids = b.labels = b.position_ids = b.cu_seqlens = b.seg_pair = b.seg_kind = None
        b.seg_src = b.seg_line = b.seg_ref_ok = b.seg_ref_logp = None
        return b
    n = B * T
    if not B + 1 <= b.n_cu <= n + 1:
        raise LoaderdProtocolError(f"batch step {b.step}: n_cu {b.n_cu} outside [{B + 1}, {n + 1}]")
    o_ids, o_lab, o_pos, o_cu, o_sp, o_sk, o_src, o_line, o_ok, o_lp = (off + x for x in L.array_offsets(B, T))

    def view(o, count, shape, dtype="<i4"):
        a = np.frombuffer(buf, dtype=dtype, count=count, offset=o).reshape(shape)
        a.flags.writeable = False
        return a

    b.input_ids = view(o_ids, n, (B, T))
    b.labels = view(o_lab, n, (B, T))
    b.position_ids = view(o_pos, n, (B, T))
    b.cu_seqlens = view(o_cu, b.n_cu, (b.n_cu,))
    b.seg_pair = view(o_sp, b.n_cu - 1, (b.n_cu - 1,))
    b.seg_kind = view(o_sk, b.n_cu - 1, (b.n_cu - 1,))
    b.seg_src = view(o_src, b.n_cu - 1, (b.n_cu - 1,))
    b.seg_line = view(o_line, b.n_cu - 1, (b.n_cu - 1,))
    b.seg_ref_ok = view(o_ok, b.n_cu - 1, (b.n_cu - 1,))
    b.seg_ref_logp = view(o_lp, b.n_cu - 1, (b.n_cu - 1,), "<f8")
    return b


def validate(b, vocab=0, checksum=True):
    """Structural check of a received batch, the rules of bt_batch_validate (proto/batch.c):
    token counts within B*T, cu_seqlens strictly increasing from 0 to B*T with every row start
    present and no segment crossing a row end, position_ids restarting at 0 per segment, the
    first token of every segment unlabelled, ids and labels in [0, vocab) (vocab <= 0 skips
    that), n_labelled_tokens equal to the count of labels != -100, and (checksum=True) the
    FNV-1a checksum. Raises LoaderdProtocolError naming the first violation."""
    if b.end_of_data:
        return
    B, T, step = b.B, b.T, b.step
    n = B * T

    def bad(msg):
        raise LoaderdProtocolError(f"batch step {step}: {msg}")

    if b.n_real_tokens > n or b.n_labelled_tokens > n:
        bad(f"token counts {b.n_real_tokens}/{b.n_labelled_tokens} exceed B*T={n}")
    if checksum and batch_checksum(b) != b.checksum:
        bad("checksum mismatch")
    cu = b.cu_seqlens.astype(np.int64)
    if cu[0] != 0:
        bad(f"cu_seqlens[0]={cu[0]} (want 0)")
    if cu[-1] != n:
        bad(f"cu_seqlens[{len(cu) - 1}]={cu[-1]} (want B*T={n})")
    d = np.diff(cu)
    if (d <= 0).any():
        k = int(np.argmax(d <= 0))
        bad(f"cu_seqlens not increasing at {k} ({cu[k]} -> {cu[k + 1]})")
    row_starts = np.arange(0, n, T)
    missing = ~np.isin(row_starts, cu)
    if missing.any():
        bad(f"row start {int(row_starts[np.argmax(missing)])} is not a segment boundary")
    starts, ends = cu[:-1], cu[1:]
    cross = starts // T != (ends - 1) // T
    if cross.any():
        k = int(np.argmax(cross))
        bad(f"segment [{starts[k]},{ends[k]}) crosses a row end")
    ids, labels, pos = b.input_ids.reshape(-1), b.labels.reshape(-1), b.position_ids.reshape(-1)
    first_labelled = labels[starts] != L.LABEL_IGNORE
    if first_labelled.any():
        bad(f"first token of segment at {int(starts[np.argmax(first_labelled)])} has a label")
    want = np.arange(n, dtype=np.int64) - np.repeat(starts, d)
    wrong = pos != want
    if wrong.any():
        t = int(np.argmax(wrong))
        bad(f"position_ids[{t}]={int(pos[t])} (want {int(want[t])}: restart per segment)")
    hi = vocab if vocab and vocab > 0 else np.iinfo(np.int32).max
    out = (ids < 0) | (ids >= hi) if vocab and vocab > 0 else ids < 0
    if out.any():
        t = int(np.argmax(out))
        bad(f"input_ids[{t}]={int(ids[t])} outside [0,{vocab})")
    lab = labels != L.LABEL_IGNORE
    out = lab & ((labels < 0) | (labels >= hi))
    if out.any():
        t = int(np.argmax(out))
        bad(f"labels[{t}]={int(labels[t])} outside [0,{vocab})")
    if int(lab.sum()) != b.n_labelled_tokens:
        bad(f"n_labelled_tokens {b.n_labelled_tokens} but {int(lab.sum())} labels present")
    kind, pair = b.seg_kind.tolist(), b.seg_pair.tolist()
    src, line, ok, lp = b.seg_src.tolist(), b.seg_line.tolist(), b.seg_ref_ok.tolist(), b.seg_ref_logp.tolist()
    next_rec = 0
    for k, (kd, pr) in enumerate(zip(kind, pair)):
        if not 0 <= kd < L.SEG_N:
            bad(f"seg_kind[{k}]={kd} unknown")
        if ok[k] not in (0, 1):
            bad(f"seg_ref_ok[{k}]={ok[k]} (want 0 or 1)")
        if (not (math.isfinite(lp[k]) and lp[k] <= 0.0)) if ok[k] else lp[k] != 0.0:
            bad(f"seg_ref_logp[{k}]={lp[k]:g} with seg_ref_ok {ok[k]}")
        if kd == L.SEG_PLAIN:
            if pr != -1:
                bad(f"plain segment {k} has seg_pair {pr} (want -1)")
            if src[k] != -1 or line[k] != -1 or ok[k]:
                bad(f"plain segment {k} has seg_src {src[k]}, seg_line {line[k]}, seg_ref_ok {ok[k]} "
                    "(want -1, -1, 0)")
            continue
        if src[k] < 0 or (line[k] < 1 and line[k] != -1):
            bad(f"segment {k} has seg_src {src[k]}, seg_line {line[k]}")
        if kd == L.SEG_REJECTED:
            if (k == 0 or kind[k - 1] != L.SEG_CHOSEN or pair[k - 1] != pr or src[k - 1] != src[k]
                    or line[k - 1] != line[k]):
                bad(f"rejected segment {k} does not follow its chosen segment")
            continue
        if pr != next_rec:
            bad(f"segment {k} has seg_pair {pr} (want {next_rec})")
        next_rec += 1
        if kd == L.SEG_CHOSEN and (k + 1 >= len(kind) or kind[k + 1] != L.SEG_REJECTED
                                   or cu[k] // T != cu[k + 1] // T):
            bad(f"chosen segment {k} is not followed by its rejected segment in the same row")


def flatten(b):
    """The padding-free form of one batch, as transformers' DataCollatorWithFlattening
    (return_position_ids=True, separator_id=-100, return_flash_attn_kwargs=True) returns it for
    the batch's segments given as features {"input_ids", "labels"} in order (the padding tail of
    a row is a segment of its own, all labels -100): NumPy arrays

      input_ids, labels, position_ids   int64 [1, B*T]  (rows concatenated; positions restart
                                                         at 0 per segment, labels -100 at every
                                                         segment's first token)
      cu_seq_lens_q, cu_seq_lens_k      int32 [n_segments + 1]  (= cu_seqlens)
      max_length_q, max_length_k        int   (longest segment)

    Always private copies (nothing points into the ring)."""
    n = b.B * b.T
    cu = np.array(b.cu_seqlens, dtype=np.int32)
    longest = int(np.diff(cu).max())
    return {
        "input_ids": np.array(b.input_ids, dtype=np.int64).reshape(1, n),
        "labels": np.array(b.labels, dtype=np.int64).reshape(1, n),
        "position_ids": np.array(b.position_ids, dtype=np.int64).reshape(1, n),
        "cu_seq_lens_q": cu,
        "cu_seq_lens_k": cu.copy(),
        "max_length_q": longest,
        "max_length_k": longest,
    }
