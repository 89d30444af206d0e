"""llama.cpp itself, as a reference for the tests: a ctypes loader of the llama.cpp library inside
the pinned PyPI wheel `xllamacpp` (scripts/llamacpp-ref.sh downloads it, checks its sha256 and
extracts that one library into .llamacpp/). No fork of llama.cpp and nothing of it in the
repository; the wheel's own Python layer is never imported.

Which llama.cpp: xllamacpp 2026.4.8929's `xllamacpp/xllamacpp.abi3.so` is llama.cpp build b8929
(April 2026; the wheel's version is the build number, and xllamacpp's commit 98c241b "Updata
llama.cpp to b8929" pins its thirdparty/llama.cpp submodule at 9d34231b), statically linked into
one CPU library (its only dependencies libstdc++ and libgomp). The library does not carry its
version (its LLAMA_BUILD_NUMBER is 0, LLAMA_COMMIT "unknown"), so `LlamaCpp()` checks the file's
sha256 against the pin in scripts/llamacpp-ref.sh instead: the struct layouts and prototypes below
are those of that build's include/llama.h (the copy at xllamacpp 98c241b
src/llama.cpp/include/llama.h) and hold for that build only. tests/py/test_llamacpp.py checks
the layouts against the library itself (llama_*_default_params write exactly sizeof(struct)
bytes, and the fields hold llama.cpp's documented defaults).

Loading: dlopen with RTLD_LAZY | RTLD_LOCAL. The library is a Python extension module (Cython):
its Python symbols resolve against the running interpreter, so it is loaded from Python (any
CPython 3), never from a C program.

Usage:
    lc = LlamaCpp.from_env()                            # or LlamaCpp(path of the .so)
    m = lc.load_model("base.gguf")                      # Model; vocab_only=True for tokenizing
    ids = m.tokenize(b"Hello", parse_special=True)      # [int]
    ctx = m.context(n_ctx=256, adapter=m.lora("a.gguf")) # F32 KV cache unless kv_type given
    logits = ctx.logits(ids)                            # numpy float32 [len(ids), n_vocab]
    out = ctx.greedy(ids, 32)                           # argmax decoding, 32 new ids
    text = m.detokenize(out)                            # bytes
Every object frees its llama.cpp handle on close() / garbage collection. Errors raise
LlamaCppError with llama.cpp's own log lines (warnings and errors) attached. Not thread-safe.
"""
import ctypes
import hashlib
import os
import re
import weakref

import numpy as np

BUILD_NUMBER = 8929
COMMIT = "9d34231b"  # llama.cpp's, as xllamacpp 98c241b's thirdparty/llama.cpp submodule names it

# enum ggml_log_level (ggml.h); CONT continues the previous line at its level
LOG_NONE, LOG_DEBUG, LOG_INFO, LOG_WARN, LOG_ERROR, LOG_CONT = range(6)
# enum ggml_type values used here (ggml.h)
GGML_TYPE_F32, GGML_TYPE_F16 = 0, 1
# enum llama_flash_attn_type (llama.h)
FLASH_ATTN_AUTO, FLASH_ATTN_DISABLED, FLASH_ATTN_ENABLED = -1, 0, 1

c_i32, c_u32, c_f32, c_bool, c_vp = (ctypes.c_int32, ctypes.c_uint32, ctypes.c_float,
                                     ctypes.c_bool, ctypes.c_void_p)
c_enum = ctypes.c_int  # C enums with small values: int on x86-64 SysV


class llama_model_params(ctypes.Structure):
    """struct llama_model_params (llama.h, b8929): 72 bytes."""
    _fields_ = [
        ("devices", c_vp),                      # ggml_backend_dev_t *, NULL = all
        ("tensor_buft_overrides", c_vp),        # const struct llama_model_tensor_buft_override *
        ("n_gpu_layers", c_i32),
        ("split_mode", c_enum),                 # enum llama_split_mode
        ("main_gpu", c_i32),
        ("tensor_split", ctypes.POINTER(c_f32)),
        ("progress_callback", c_vp),            # llama_progress_callback
        ("progress_callback_user_data", c_vp),
        ("kv_overrides", c_vp),                 # const struct llama_model_kv_override *
        ("vocab_only", c_bool),
        ("use_mmap", c_bool),
        ("use_direct_io", c_bool),
        ("use_mlock", c_bool),
        ("check_tensors", c_bool),
        ("use_extra_bufts", c_bool),            # weight repacking (e.g. Q4_K -> q4_K_8x8 on AVX2)
        ("no_host", c_bool),
        ("no_alloc", c_bool),
    ]


class llama_context_params(ctypes.Structure):
    """struct llama_context_params (llama.h, b8929): 136 bytes."""
    _fields_ = [
        ("n_ctx", c_u32),
        ("n_batch", c_u32),
        ("n_ubatch", c_u32),
        ("n_seq_max", c_u32),
        ("n_threads", c_i32),
        ("n_threads_batch", c_i32),
        ("rope_scaling_type", c_enum),
        ("pooling_type", c_enum),
        ("attention_type", c_enum),
        ("flash_attn_type", c_enum),            # enum llama_flash_attn_type
        ("rope_freq_base", c_f32),
        ("rope_freq_scale", c_f32),
        ("yarn_ext_factor", c_f32),
        ("yarn_attn_factor", c_f32),
        ("yarn_beta_fast", c_f32),
        ("yarn_beta_slow", c_f32),
        ("yarn_orig_ctx", c_u32),
        ("defrag_thold", c_f32),
        ("cb_eval", c_vp),                      # ggml_backend_sched_eval_callback
        ("cb_eval_user_data", c_vp),
        ("type_k", c_enum),                     # enum ggml_type of the K cache
        ("type_v", c_enum),
        ("abort_callback", c_vp),               # ggml_abort_callback
        ("abort_callback_data", c_vp),
        ("embeddings", c_bool),
        ("offload_kqv", c_bool),
        ("no_perf", c_bool),
        ("op_offload", c_bool),
        ("swa_full", c_bool),
        ("kv_unified", c_bool),
        ("samplers", c_vp),                     # struct llama_sampler_seq_config *
        ("n_samplers", ctypes.c_size_t),
    ]


class llama_batch(ctypes.Structure):
    """struct llama_batch (llama.h, b8929): 56 bytes; arrays of n_tokens entries."""
    _fields_ = [
        ("n_tokens", c_i32),
        ("token", ctypes.POINTER(c_i32)),
        ("embd", ctypes.POINTER(c_f32)),
        ("pos", ctypes.POINTER(c_i32)),
        ("n_seq_id", ctypes.POINTER(c_i32)),
        ("seq_id", ctypes.POINTER(ctypes.POINTER(c_i32))),
        ("logits", ctypes.POINTER(ctypes.c_int8)),  # nonzero: output this token's logits
    ]


# ggml_log_callback: void (*)(enum ggml_log_level level, const char * text, void * user_data)
LOG_CB_ARGS = (c_enum, ctypes.c_char_p, c_vp)
LOG_CB = ctypes.CFUNCTYPE(None, *LOG_CB_ARGS)

# name: (restype, argtypes), as declared in llama.h (b8929); `const` has no ctypes spelling
PROTOTYPES = {
    "llama_backend_init": (None, []),
    "llama_log_set": (None, [LOG_CB, c_vp]),
    "llama_model_default_params": (llama_model_params, []),
    "llama_context_default_params": (llama_context_params, []),
    "llama_model_load_from_file": (c_vp, [ctypes.c_char_p, llama_model_params]),
    "llama_model_free": (None, [c_vp]),
    "llama_init_from_model": (c_vp, [c_vp, llama_context_params]),
    "llama_free": (None, [c_vp]),
    "llama_model_get_vocab": (c_vp, [c_vp]),
    "llama_model_meta_val_str": (c_i32, [c_vp, ctypes.c_char_p, ctypes.c_char_p, ctypes.c_size_t]),
    "llama_vocab_n_tokens": (c_i32, [c_vp]),
    "llama_tokenize": (c_i32, [c_vp, ctypes.c_char_p, c_i32, ctypes.POINTER(c_i32), c_i32, c_bool,
                               c_bool]),
    "llama_detokenize": (c_i32, [c_vp, ctypes.POINTER(c_i32), c_i32, ctypes.c_char_p, c_i32,
                                 c_bool, c_bool]),
    "llama_batch_init": (llama_batch, [c_i32, c_i32, c_i32]),
    "llama_batch_free": (None, [llama_batch]),
    "llama_decode": (c_i32, [c_vp, llama_batch]),
    "llama_get_logits_ith": (ctypes.POINTER(c_f32), [c_vp, c_i32]),
    # llama_memory_t llama_get_memory(const struct llama_context *); the KV cache's handle
    "llama_get_memory": (c_vp, [c_vp]),
    # void llama_memory_clear(llama_memory_t mem, bool data): data = also zero the buffers
    "llama_memory_clear": (None, [c_vp, c_bool]),
    "llama_adapter_lora_init": (c_vp, [c_vp, ctypes.c_char_p]),
    "llama_adapter_lora_free": (None, [c_vp]),
    # int32_t llama_set_adapters_lora(struct llama_context *, struct llama_adapter_lora **
    # adapters, size_t n_adapters, float * scales): replaces the context's set of adapters
    "llama_set_adapters_lora": (c_i32, [c_vp, ctypes.POINTER(c_vp), ctypes.c_size_t,
                                        ctypes.POINTER(c_f32)]),
}

LIB_NAME = "xllamacpp.abi3.so"


def pinned_sha256():
    """The sha256 of the library as scripts/llamacpp-ref.sh pins it (its MEMBER_SHA256 line): the
    one source of the version, since the library does not carry it."""
    script = os.path.join(os.path.dirname(__file__), "..", "..", "scripts", "llamacpp-ref.sh")
    m = re.search(r'^MEMBER_SHA256="([0-9a-f]{64})"$', open(script).read(), re.M)
    if not m:
        raise LlamaCppError(f"{script}: no MEMBER_SHA256=\"<64 hex>\" line")
    return m.group(1)


class LlamaCppError(RuntimeError):
    pass


def default_dir():
    """Where scripts/llamacpp-ref.sh puts the library: $BT_LLAMACPP_DIR or <repo>/.llamacpp."""
    root = os.path.abspath(os.path.join(os.path.dirname(__file__), "..", ".."))
    return os.environ.get("BT_LLAMACPP_DIR") or os.path.join(root, ".llamacpp")


class LlamaCpp:
    """The loaded library (one per process is enough; loading twice shares the same image)."""

    def __init__(self, lib_path):
        self.path = os.path.abspath(lib_path)
        h = hashlib.sha256()
        with open(self.path, "rb") as f:
            for chunk in iter(lambda: f.read(1 << 20), b""):
                h.update(chunk)
        if h.hexdigest() != pinned_sha256():
            raise LlamaCppError(f"{self.path} has sha256 {h.hexdigest()}, not the pinned "
                                f"{pinned_sha256()} of llama.cpp b{BUILD_NUMBER} (run `make "
                                f"llamacpp-ref`): this loader's struct layouts are for that build")
        self.build_number, self.commit = BUILD_NUMBER, COMMIT
        self.lib = ctypes.CDLL(self.path, mode=os.RTLD_LAZY | os.RTLD_LOCAL)
        for name, (res, args) in PROTOTYPES.items():
            f = getattr(self.lib, name)
            f.restype, f.argtypes = res, args
        self.log = []  # [(level, text)] of everything llama.cpp logged, CONT lines joined
        self._cb = LOG_CB(self._on_log)  # kept alive as long as the library
        self.lib.llama_log_set(self._cb, None)
        self.lib.llama_backend_init()

    @classmethod
    def from_env(cls):
        return cls(os.path.join(default_dir(), LIB_NAME))

    def _on_log(self, level, text, _ud):
        t = text.decode("utf-8", "replace") if text else ""
        if level == LOG_CONT and self.log:
            lv, prev = self.log[-1]
            self.log[-1] = (lv, prev + t)
        else:
            self.log.append((level, t))

    def problems(self, since=0):
        """Warning and error lines logged since log index `since`."""
        return [t.rstrip() for lv, t in self.log[since:] if lv in (LOG_WARN, LOG_ERROR)]

    def _fail(self, what, since):
        msg = "\n".join(self.problems(since)) or "(llama.cpp logged no warning or error)"
        raise LlamaCppError(f"{what}\nllama.cpp said:\n{msg}")

    def load_model(self, path, vocab_only=False, repack=True):
        """llama_model_load_from_file on the CPU; repack: llama.cpp's default of repacking
        quantised weights into its CPU "extra" buffer types (use_extra_bufts, e.g. Q4_K into
        q4_K_8x8 on AVX2 machines), as a user's llama.cpp does."""
        p = self.lib.llama_model_default_params()
        p.n_gpu_layers = 0
        p.vocab_only = vocab_only
        p.use_extra_bufts = repack
        since = len(self.log)
        h = self.lib.llama_model_load_from_file(os.fsencode(path), p)
        if not h:
            self._fail(f"llama_model_load_from_file({path}) failed", since)
        return Model(self, h, path, since)


class Model:
    def __init__(self, lc, handle, path, log_since):
        self.lc, self.h, self.path = lc, handle, path
        self.load_problems = lc.problems(log_since)
        self.vocab = lc.lib.llama_model_get_vocab(handle)
        self.n_vocab = lc.lib.llama_vocab_n_tokens(self.vocab)
        self._contexts, self._adapters = weakref.WeakSet(), weakref.WeakSet()

    def meta(self, key):
        """A GGUF metadata value as llama.cpp printed it (str), None when absent."""
        buf = ctypes.create_string_buffer(4096)
        n = self.lc.lib.llama_model_meta_val_str(self.h, key.encode(), buf, len(buf))
        return None if n < 0 else buf.value.decode("utf-8", "replace")

    def tokenize(self, text, add_special=False, parse_special=False):
        """llama_tokenize of text (bytes or str) -> [int]; add_special adds BOS/EOS per the
        vocabulary, parse_special matches special-token strings (the tokenizer's added tokens)."""
        b = text.encode() if isinstance(text, str) else bytes(text)
        cap = len(b) + 8
        while True:
            out = (c_i32 * cap)()
            n = self.lc.lib.llama_tokenize(self.vocab, b, len(b), out, cap, add_special,
                                           parse_special)
            if n >= 0:
                return out[:n]
            if -n <= cap:
                raise LlamaCppError(f"llama_tokenize returned {n} for {len(b)} bytes")
            cap = -n

    def detokenize(self, ids, special=False):
        """llama_detokenize of ids -> bytes (special: render control tokens too)."""
        arr = (c_i32 * len(ids))(*ids)
        cap = 16 * len(ids) + 16
        while True:
            buf = ctypes.create_string_buffer(cap)
            n = self.lc.lib.llama_detokenize(self.vocab, arr, len(ids), buf, cap, False, special)
            if n >= 0:
                return buf.raw[:n]
            cap = -n

    def lora(self, path):
        """llama_adapter_lora_init: a LoRA GGUF for this model (Adapter)."""
        since = len(self.lc.log)
        h = self.lc.lib.llama_adapter_lora_init(self.h, os.fsencode(path))
        if not h:
            self.lc._fail(f"llama_adapter_lora_init({path}) failed", since)
        a = Adapter(self, h, self.lc.problems(since))
        self._adapters.add(a)
        return a

    def context(self, n_ctx=512, adapter=None, scale=1.0, kv_type=GGML_TYPE_F32, n_threads=1):
        """A context of n_ctx positions (one sequence, no flash attention), the K/V cache in
        kv_type (F32 by default so that only the weights' and llama.cpp's own rounding remain;
        llama.cpp's default is F16), with `adapter` applied at `scale` (llama.cpp multiplies it by
        the file's alpha / rank, as PEFT does). n_threads defaults to 1: ggml's thread pool
        spin-waits at every op barrier, which on a shared 2-core machine made a tiny model's
        32-token greedy run 30x slower with 2 threads (7.9 s against 0.25 s, measured)."""
        p = self.lc.lib.llama_context_default_params()
        p.n_ctx = p.n_batch = p.n_ubatch = n_ctx
        p.n_seq_max = 1
        p.n_threads = p.n_threads_batch = n_threads
        p.type_k = p.type_v = kv_type
        p.flash_attn_type = FLASH_ATTN_DISABLED
        p.no_perf = True
        since = len(self.lc.log)
        h = self.lc.lib.llama_init_from_model(self.h, p)
        if not h:
            self.lc._fail("llama_init_from_model failed", since)
        ctx = Context(self, h, n_ctx)
        self._contexts.add(ctx)
        if adapter is not None:
            one, sc = (c_vp * 1)(adapter.h), (c_f32 * 1)(scale)
            if self.lc.lib.llama_set_adapters_lora(h, one, 1, sc) != 0:
                ctx.close()
                self.lc._fail("llama_set_adapters_lora failed", since)
            ctx.adapter = adapter
        return ctx

    def close(self):
        """Frees the contexts, then the adapters, then the model (children hold a reference to
        their model, so garbage collection alone frees them in that order too)."""
        for c in list(self._contexts):
            c.close()
        for a in list(self._adapters):
            a.close()
        if self.h:
            self.lc.lib.llama_model_free(self.h)
            self.h = None

    __del__ = close


class Adapter:
    def __init__(self, model, handle, problems):
        self.model, self.h, self.load_problems = model, handle, problems

    def close(self):
        if self.h and self.model.h:
            self.model.lc.lib.llama_adapter_lora_free(self.h)
        self.h = None

    __del__ = close


class Context:
    def __init__(self, model, handle, n_ctx):
        self.model, self.h, self.n_ctx, self.adapter = model, handle, n_ctx, None

    def _decode(self, ids, pos0, want_all):
        lib = self.model.lc.lib
        n = len(ids)
        b = lib.llama_batch_init(n, 0, 1)
        try:
            for i, t in enumerate(ids):
                b.token[i] = t
                b.pos[i] = pos0 + i
                b.n_seq_id[i] = 1
                b.seq_id[i][0] = 0
                b.logits[i] = 1 if (want_all or i == n - 1) else 0
            b.n_tokens = n
            since = len(self.model.lc.log)
            rc = lib.llama_decode(self.h, b)
            if rc != 0:
                self.model.lc._fail(f"llama_decode of {n} tokens returned {rc}", since)
        finally:
            lib.llama_batch_free(b)

    def _row(self, i):
        p = self.model.lc.lib.llama_get_logits_ith(self.h, i)
        if not p:
            raise LlamaCppError(f"llama_get_logits_ith({i}) returned NULL")
        return np.ctypeslib.as_array(p, shape=(self.model.n_vocab,)).copy()

    def clear(self):
        """Empties the KV cache (llama_memory_clear of llama_get_memory, data too)."""
        lib = self.model.lc.lib
        lib.llama_memory_clear(lib.llama_get_memory(self.h), True)

    def logits(self, ids):
        """Logits of every position of ids (one sequence from position 0; the cache is cleared
        first): numpy float32 [len(ids), n_vocab]."""
        if not 0 < len(ids) <= self.n_ctx:
            raise LlamaCppError(f"{len(ids)} tokens for a context of {self.n_ctx}")
        self.clear()
        self._decode(list(ids), 0, True)
        return np.stack([self._row(i) for i in range(len(ids))])

    def greedy(self, prompt, n_new):
        """Greedy decoding: the prompt in one batch, then n_new tokens one at a time, each the
        argmax (lowest id on ties, as numpy.argmax and bt_argmax) of the last logits. Returns the
        new ids (no stop token: the caller compares fixed lengths)."""
        if len(prompt) + n_new > self.n_ctx:
            raise LlamaCppError(f"{len(prompt)} + {n_new} tokens for a context of {self.n_ctx}")
        self.clear()
        self._decode(list(prompt), 0, False)
        out, pos = [], len(prompt)
        for _ in range(n_new):
            t = int(np.argmax(self._row(-1)))
            out.append(t)
            if len(out) == n_new:
                break
            self._decode([t], pos, False)
            pos += 1
        return out

    def close(self):
        if self.h and self.model.h:
            self.model.lc.lib.llama_free(self.h)
            self.h = None

    __del__ = close
