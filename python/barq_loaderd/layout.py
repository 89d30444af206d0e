"""Byte layouts and constants of loaderd's public contract, in one place on the Python side.

Source of truth: proto/ring.h (ring header), proto/batch.h (batch slot), proto/client.h
(control socket), described in proto/PROTOCOL.md §1, §3 and §4. Everything is little-endian
(x86-64 and aarch64 hosts; the ring never crosses machines). tests/py/test_python_client.py
checks every offset and size here against the C headers (build/tools/proto_layout, which prints
offsetof / sizeof / bt_batch_slot_bytes), so a layout change in C without a change here fails.

Nothing here touches a ring: these are pure functions of (B, T, n_slots) and struct formats.
"""
import struct

# ---- control socket (proto/client.h, proto/PROTOCOL.md §1) ----
PROTO_VERSION = 1                       # "v" of every request and reply
DEFAULT_SOCKET = "/run/loaderd/loaderd.sock"
SOCKET_ENV = "LOADERD_SOCKET"           # clients: socket path when none is given
RECONNECT_ENV = "LOADERD_RECONNECT_S"   # clients: how long to re-attach after loaderd went away
RECONNECT_DEFAULT_S = 60.0
ATTACH_TIMEOUT_S = 120.0                # loaderd may be loading a large tokenizer
REPLY_TIMEOUT_S = 5.0
MAX_REPLY_BYTES = 1 << 20               # a longer reply line is a protocol error
PEEK_SLICE_S = 0.2                      # an idle wait looks at the socket this often
CLOSED_GRACE_S = 3.0                    # producer closed: wait this long for loaderd's hang-up

# ---- ring (proto/ring.h, proto/PROTOCOL.md §3) ----
RING_MAGIC = 0x3130474E49525442         # "BTRING01" as a little-endian u64
RING_VERSION = 1
RING_HEADER_BYTES = 4096
RING_MAX_SLOTS = 4096
# magic u64, version u32, n_slots u32, slot_bytes u64, B u32, T u32, total_bytes u64
RING_GEOMETRY = struct.Struct("<QIIQIIQ")
RING_OFF = {                            # byte offsets of the shared counters and flags
    "magic": 0, "version": 8, "n_slots": 12, "slot_bytes": 16, "B": 24, "T": 28,
    "total_bytes": 32,
    "head": 64,                         # u64, producer: batches committed
    "head_seq": 72,                     # u32 futex word, +1 per commit / close
    "consumer_waiting": 76,             # u32, consumer
    "tail": 128,                        # u64, consumer: batches released
    "tail_seq": 136,                    # u32 futex word, +1 per release / close
    "producer_waiting": 140,            # u32, producer
    "producer_closed": 192,             # u32, producer
    "consumer_closed": 196,             # u32, consumer
}

# ---- batch slot (proto/batch.h, proto/PROTOCOL.md §4) ----
BATCH_MAGIC = 0x41425442                # "BTBA" as a little-endian u32
BATCH_LAYOUT_VERSION = 3               # 2: seg_pair / seg_kind after cu_seqlens (issue 25);
                                        # 3: seg_src, seg_line, seg_ref_ok, seg_ref_logp after them
BATCH_HEADER_BYTES = 320
RESUME_STATE_BYTES = 256
LABEL_IGNORE = -100
F_END_OF_DATA = 1                       # flags bit 0: no rows, the stream has ended
BATCH_MAX_TOKENS = 1 << 28              # largest B*T the layout accepts
# magic, layout_version, job_id, rank (u32), step (u64), B, T, n_real_tokens,
# n_labelled_tokens, n_cu, n_docs, flags, epoch (u32), checksum (u64); resume_state follows
BATCH_HEADER = struct.Struct("<IIIIQIIIIIIIIQ")
BATCH_FIELDS = ("magic", "layout_version", "job_id", "rank", "step", "B", "T", "n_real_tokens",
                "n_labelled_tokens", "n_cu", "n_docs", "flags", "epoch", "checksum")
BATCH_OFF = {"magic": 0, "layout_version": 4, "job_id": 8, "rank": 12, "step": 16, "B": 24,
             "T": 28, "n_real_tokens": 32, "n_labelled_tokens": 36, "n_cu": 40, "n_docs": 44,
             "flags": 48, "epoch": 52, "checksum": 56, "resume_state": 64}

FNV64_INIT = 0xCBF29CE484222325         # FNV-1a 64 (common/bt_common.h bt_fnv1a64)
FNV64_PRIME = 0x100000001B3


# seg_kind values (proto/batch.h BT_SEG_*): what each segment of a layout-2 batch is
SEG_PLAIN, SEG_CHOSEN, SEG_REJECTED, SEG_KTO_DESIRABLE, SEG_KTO_UNDESIRABLE = 0, 1, 2, 3, 4
SEG_N = 5


def round64(n):
    """n rounded up to a multiple of 64 (every array of a slot starts 64-byte aligned)."""
    return (n + 63) & ~63


def slot_bytes(B, T):
    """Bytes of one batch slot for B rows of T tokens (proto/batch.c bt_batch_slot_bytes):
    header (320, rounded to 64) + 3 arrays of B*T int32 (each rounded to 64) + cu_seqlens of
    B*T+1 int32 (rounded to 64) + seg_pair, seg_kind, seg_src, seg_line, seg_ref_ok, B*T int32
    each, + seg_ref_logp, B*T float64 (each rounded to 64). 0 when B or T is 0 or B*T exceeds 2^28."""
    if B <= 0 or T <= 0 or B * T > BATCH_MAX_TOKENS:
        return 0
    return (round64(BATCH_HEADER_BYTES) + 8 * round64(4 * B * T) + round64(4 * (B * T + 1))
            + round64(8 * B * T))


def array_offsets(B, T):
    """Byte offsets within a slot of (input_ids, labels, position_ids, cu_seqlens, seg_pair,
    seg_kind, seg_src, seg_line, seg_ref_ok, seg_ref_logp) (proto/batch.c bt_batch_view_init)."""
    arr = round64(4 * B * T)
    base = round64(BATCH_HEADER_BYTES)
    cu = round64(4 * (B * T + 1))
    return (base, base + arr, base + 2 * arr, base + 3 * arr) + tuple(base + (3 + i) * arr + cu for i in range(6))


def ring_bytes(n_slots, B, T):
    """(slot_bytes, total file bytes) of a ring, or None when the geometry is invalid
    (proto/ring.c ring_total: n_slots in [1, 4096], a valid batch shape)."""
    sb = slot_bytes(B, T)
    if sb == 0 or not 1 <= n_slots <= RING_MAX_SLOTS:
        return None
    return sb, RING_HEADER_BYTES + n_slots * sb
