"""Consumer side of loaderd's single-producer / single-consumer batch ring (proto/ring.h,
proto/PROTOCOL.md §3), in pure Python: mmap of the memfd loaderd passed over the socket,
C11-style atomics on the shared counters, futex(2) waits.

Atomics: with libatomic (Debian libatomic1, present wherever gcc is) every shared access is a
sequentially consistent __atomic_load/store/fetch_add, as the protocol asks. Without it, on
x86-64 only, plain aligned loads and stores are used: x86-TSO gives them acquire/release order,
and the one store-then-load pair that needs more (raise the waiting flag, re-check the counter)
is covered by the futex word check in the kernel and by waits cut into PEEK_SLICE_S slices, so
a lost wake-up costs at most one slice, never a hang. Other architectures need libatomic.

Trust: like proto/ring.c, the geometry is read once from a private copy of the header, checked
against the fd size and the layout, and kept privately; the consumer's own counter (tail) is
private too; the producer's head is sanity-checked on every read (tail <= head <= tail +
n_slots), a violation is LoaderdProtocolError. The fd must be sealed against shrinking
(F_SEAL_SHRINK), so loaderd cannot truncate it under the mapping (SIGBUS).
"""
import ctypes
import ctypes.util
import errno
import fcntl
import mmap
import os
import platform
import stat
import time

from . import layout as L
from .errors import LoaderdClosed, LoaderdError, LoaderdProtocolError, LoaderdTimeout

_SEQ_CST = 5
_FUTEX_WAIT, _FUTEX_WAKE = 0, 1
_SYS_FUTEX = {"x86_64": 202, "amd64": 202, "aarch64": 98, "arm64": 98}
_F_GET_SEALS = getattr(fcntl, "F_GET_SEALS", 1034)
_F_SEAL_SHRINK = getattr(fcntl, "F_SEAL_SHRINK", 0x0002)


class _Timespec(ctypes.Structure):
    _fields_ = [("tv_sec", ctypes.c_long), ("tv_nsec", ctypes.c_long)]


class _Atomics:
    """load64/store64/load32/store32/add32 at raw addresses, and futex wait/wake."""

    def __init__(self):
        machine = platform.machine().lower()
        self.sys_futex = _SYS_FUTEX.get(machine)
        if self.sys_futex is None:
            raise LoaderdError(f"barq_loaderd: unsupported architecture {machine!r} (x86-64 and aarch64 only)")
        self.libc = ctypes.CDLL(None, use_errno=True)
        self.libc.syscall.restype = ctypes.c_long
        name = ctypes.util.find_library("atomic")
        lib = None
        if name:
            try:
                lib = ctypes.CDLL(name)
            except OSError:
                lib = None
        self.native = lib is not None
        if lib is not None:
            def fn(name, restype, *argtypes):  # getattr: a "__name" attribute would be mangled here
                f = getattr(lib, name)
                f.restype, f.argtypes = restype, list(argtypes)
                return f
            vp, u64, u32, i = ctypes.c_void_p, ctypes.c_uint64, ctypes.c_uint32, ctypes.c_int
            ld8, st8 = fn("__atomic_load_8", u64, vp, i), fn("__atomic_store_8", None, vp, u64, i)
            ld4, st4 = fn("__atomic_load_4", u32, vp, i), fn("__atomic_store_4", None, vp, u32, i)
            add4 = fn("__atomic_fetch_add_4", u32, vp, u32, i)
            self.load64 = lambda a: ld8(a, _SEQ_CST)
            self.store64 = lambda a, v: st8(a, v, _SEQ_CST)
            self.load32 = lambda a: ld4(a, _SEQ_CST)
            self.store32 = lambda a, v: st4(a, v, _SEQ_CST)
            self.add32 = lambda a, v: add4(a, v, _SEQ_CST)
        elif self.sys_futex == 202:
            u64, u32 = ctypes.c_uint64, ctypes.c_uint32
            self.load64 = lambda a: u64.from_address(a).value
            self.store64 = lambda a, v: setattr(u64.from_address(a), "value", v)
            self.load32 = lambda a: u32.from_address(a).value
            self.store32 = lambda a, v: setattr(u32.from_address(a), "value", v)

            def add32(a, v):  # each sequence word has a single writer (this side)
                w = u32.from_address(a)
                old = w.value
                w.value = (old + v) & 0xFFFFFFFF
                return old
            self.add32 = add32
        else:
            raise LoaderdError("barq_loaderd: libatomic.so.1 not found; on this architecture the ring needs "
                               "it for ordered shared-memory access (Debian: apt-get install libatomic1)")

    def futex_wait(self, addr, expected, timeout_s):
        """Sleep while *addr == expected, up to timeout_s. True when woken or the value changed
        (re-check), False on timeout. EINTR is a re-check."""
        ts = _Timespec(int(timeout_s), int((timeout_s - int(timeout_s)) * 1e9))
        r = self.libc.syscall(self.sys_futex, ctypes.c_void_p(addr), _FUTEX_WAIT, ctypes.c_uint32(expected),
                              ctypes.byref(ts), None, 0)
        if r != 0 and ctypes.get_errno() == errno.ETIMEDOUT:
            return False
        return True

    def futex_wake(self, addr):
        self.libc.syscall(self.sys_futex, ctypes.c_void_p(addr), _FUTEX_WAKE, 0x7FFFFFFF, None, None, 0)


_ATOMICS = None


def _atomics():
    global _ATOMICS
    if _ATOMICS is None:
        _ATOMICS = _Atomics()
    return _ATOMICS


class Ring:
    """A mapped loaderd ring, consumer side. Owns the fd given to it (closed at once: the mapping
    keeps the memory) and the mapping (close()).

    Attributes (private copies, never re-read from the shared header): n_slots, slot_bytes,
    B, T, total_bytes; pos = batches released by this consumer (the ring's tail).
    """

    def __init__(self, fd):
        self._mm = None
        self._anchor = None
        try:
            self._map(fd)
        finally:
            os.close(fd)

    def _map(self, fd):
        st = os.fstat(fd)
        if not stat.S_ISREG(st.st_mode) or st.st_size < L.RING_HEADER_BYTES:
            raise LoaderdProtocolError(f"ring: fd is {st.st_size} bytes, smaller than the "
                                       f"{L.RING_HEADER_BYTES}-byte header")
        try:
            seals = fcntl.fcntl(fd, _F_GET_SEALS)
        except OSError:
            seals = -1
        if seals < 0 or not seals & _F_SEAL_SHRINK:
            raise LoaderdProtocolError(f"ring: fd is not a memfd sealed against shrinking (seals {seals})")
        head = os.pread(fd, L.RING_GEOMETRY.size, 0)
        if len(head) != L.RING_GEOMETRY.size:
            raise LoaderdProtocolError("ring: short read of the header")
        magic, version, n_slots, sb, B, T, total = L.RING_GEOMETRY.unpack(head)
        if magic != L.RING_MAGIC or version != L.RING_VERSION:
            raise LoaderdProtocolError(f"ring: bad magic/version (0x{magic:x}/{version}; want "
                                       f"0x{L.RING_MAGIC:x}/{L.RING_VERSION})")
        geo = L.ring_bytes(n_slots, B, T)
        if geo is None:
            raise LoaderdProtocolError(f"ring: header geometry invalid: {n_slots} slots of {B}x{T}")
        if sb != geo[0] or total != geo[1] or st.st_size != geo[1]:
            raise LoaderdProtocolError(
                f"ring: lying header: {n_slots} slots x {sb} bytes ({total} total) but the layout needs "
                f"{geo[0]} x {n_slots} ({geo[1]}) and the fd holds {st.st_size} bytes")
        self.n_slots, self.slot_bytes, self.B, self.T, self.total_bytes = n_slots, geo[0], B, T, geo[1]
        self._mm = mmap.mmap(fd, self.total_bytes, mmap.MAP_SHARED, mmap.PROT_READ | mmap.PROT_WRITE)
        self._anchor = ctypes.c_char.from_buffer(self._mm)  # pins the mapping; released in close()
        self._base = ctypes.addressof(self._anchor)
        self._a = _atomics()
        self.pos = self._a.load64(self._addr("tail"))

    def _addr(self, field):
        return self._base + L.RING_OFF[field]

    @property
    def buffer(self):
        """The whole mapping (an mmap object; slot k starts at slot_offset(k))."""
        return self._mm

    def slot_offset(self, index):
        return L.RING_HEADER_BYTES + (index % self.n_slots) * self.slot_bytes

    def _head(self):
        head = self._a.load64(self._addr("head"))
        if head < self.pos or head - self.pos > self.n_slots:
            raise LoaderdProtocolError(f"ring: producer wrote an impossible head {head} (tail {self.pos})")
        return head

    def peek(self, timeout_s):
        """Wait up to timeout_s (None: forever, 0: poll) for a filled slot; returns its byte
        offset in .buffer (valid until release()). Raises LoaderdTimeout, LoaderdClosed (the
        producer closed and the ring is empty), LoaderdProtocolError (impossible head)."""
        if self._mm is None:
            raise LoaderdClosed("ring: closed")
        a = self._a
        deadline = None if timeout_s is None else time.monotonic() + timeout_s
        while True:
            head = self._head()
            if head != self.pos:
                return self.slot_offset(self.pos)
            if a.load32(self._addr("producer_closed")):
                if self._head() != self.pos:  # closed is set after the last commit
                    continue
                raise LoaderdClosed("ring: producer closed")
            left = None if deadline is None else deadline - time.monotonic()
            if left is not None and left <= 0:
                raise LoaderdTimeout("ring: no batch ready" if timeout_s == 0 else
                                     f"ring: no batch within {timeout_s:.3g} s")
            seen = a.load32(self._addr("head_seq"))
            a.store32(self._addr("consumer_waiting"), 1)
            try:
                # re-check after raising the flag so a commit in between is not missed
                if a.load64(self._addr("head")) != head or a.load32(self._addr("producer_closed")):
                    continue
                a.futex_wait(self._addr("head_seq"), seen,
                             L.PEEK_SLICE_S if left is None else min(left, L.PEEK_SLICE_S))
            finally:
                a.store32(self._addr("consumer_waiting"), 0)

    def release(self):
        """Hand the slot of the last peek back (tail + 1; wakes a waiting producer)."""
        a = self._a
        self.pos += 1
        a.store64(self._addr("tail"), self.pos)
        a.add32(self._addr("tail_seq"), 1)
        if a.load32(self._addr("producer_waiting")):
            a.futex_wake(self._addr("tail_seq"))

    def fill(self):
        """Slots filled now (head - tail), clamped to [0, n_slots]."""
        head = self._a.load64(self._addr("head"))
        return 0 if head < self.pos else min(head - self.pos, self.n_slots)

    def producer_closed(self):
        return bool(self._a.load32(self._addr("producer_closed")))

    def close(self, consumer_close=True):
        """Set consumer_closed (the producer stops) when asked, then unmap. Idempotent."""
        if self._mm is None:
            return
        if consumer_close:
            a = self._a
            a.store32(self._addr("consumer_closed"), 1)
            a.add32(self._addr("tail_seq"), 1)
            a.futex_wake(self._addr("tail_seq"))
        self._anchor = None
        self._base = 0
        try:
            self._mm.close()
        except BufferError:
            # a zero-copy NumPy view of a batch is still alive: the mapping stays until it dies
            pass
        self._mm = None

    def __del__(self):
        try:
            self.close(consumer_close=False)
        except Exception:
            pass
