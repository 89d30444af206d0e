"""The metadata of a GGUF file (pure Python, header only): enough to say which model a GGUF is,
for the base_model_name_or_path an adapter records.

    meta = read_metadata("model.gguf")     # {"general.architecture": "llama", ...}
    source_model("model.gguf")             # "HuggingFaceTB/SmolLM2-135M-Instruct" or None

Format: ggml's docs/gguf.md (the GGUF v2 / v3 header: magic "GGUF", u32 version, u64 tensor
count, u64 metadata count, then per entry a u64-length key, a u32 value type and the value; all
little-endian). Arrays are skipped (their element count is read, not their elements); strings
must be valid UTF-8. A malformed or truncated header raises ValueError naming the file and what
is wrong; nothing past the metadata is read.
"""
import struct

# gguf.md GGUFValueType: scalar types and their struct codes
_SCALARS = {0: "B", 1: "b", 2: "H", 3: "h", 4: "I", 5: "i", 6: "f", 7: "?", 10: "Q", 11: "q", 12: "d"}
_STRING, _ARRAY = 8, 9
MAX_KV = 1 << 20          # metadata entries
MAX_STR = 1 << 24         # bytes of one key or string value
MAX_HEADER = 1 << 30      # bytes of metadata read before giving up


class _Reader:
    def __init__(self, f, path):
        self.f, self.path, self.n = f, path, 0

    def take(self, n):
        self.n += n
        if self.n > MAX_HEADER:
            raise ValueError(f"{self.path}: GGUF metadata larger than {MAX_HEADER} bytes")
        b = self.f.read(n)
        if len(b) != n:
            raise ValueError(f"{self.path}: truncated GGUF header")
        return b

    def unpack(self, code):
        s = struct.Struct("<" + code)
        return s.unpack(self.take(s.size))[0]

    def string(self, what):
        n = self.unpack("Q")
        if n > MAX_STR:
            raise ValueError(f"{self.path}: GGUF {what} of {n} bytes")
        try:
            return self.take(n).decode("utf-8")
        except UnicodeDecodeError:
            raise ValueError(f"{self.path}: GGUF {what} is not valid UTF-8") from None

    def skip_array(self, key):
        t, n = self.unpack("I"), self.unpack("Q")
        if t in _SCALARS:
            size = struct.calcsize("<" + _SCALARS[t])
            if n * size > MAX_HEADER:
                raise ValueError(f"{self.path}: GGUF array {key} of {n} entries")
            self.take(n * size)
        elif t == _STRING:
            if n > MAX_HEADER // 8:
                raise ValueError(f"{self.path}: GGUF array {key} of {n} strings")
            for _ in range(n):
                self.string(f"string in {key}")
        else:  # arrays of arrays are not used by any GGUF writer we know of
            raise ValueError(f"{self.path}: GGUF array {key} has element type {t}")


def read_metadata(path):
    """{key: value} of the GGUF metadata: numbers, bools and strings; arrays are left out."""
    out = {}
    with open(path, "rb") as f:
        r = _Reader(f, path)
        if r.take(4) != b"GGUF":
            raise ValueError(f"{path}: not a GGUF file")
        version = r.unpack("I")
        if version not in (2, 3):
            raise ValueError(f"{path}: GGUF version {version} (2 and 3 are known)")
        r.unpack("Q")  # tensor count
        n_kv = r.unpack("Q")
        if n_kv > MAX_KV:
            raise ValueError(f"{path}: {n_kv} GGUF metadata entries")
        for _ in range(n_kv):
            key = r.string("key")
            t = r.unpack("I")
            if t in _SCALARS:
                out[key] = r.unpack(_SCALARS[t])
            elif t == _STRING:
                out[key] = r.string(f"value of {key}")
            elif t == _ARRAY:
                r.skip_array(key)
            else:
                raise ValueError(f"{path}: GGUF key {key} has value type {t}")
    return out


HF_PREFIXES = ("https://huggingface.co/", "http://huggingface.co/", "https://hf.co/", "hf://")


def hf_repo_id(url):
    """"org/name" for a Hugging Face model URL (https://huggingface.co/org/name[/...]), else None."""
    for p in HF_PREFIXES:
        if url.startswith(p):
            parts = [x for x in url[len(p):].split("/") if x]
            if len(parts) >= 2 and parts[0] not in ("datasets", "spaces"):
                return f"{parts[0]}/{parts[1]}"
    return None


def source_model(path):
    """The model a GGUF file was converted from, as its metadata names it, or None:
    general.source.huggingface.repository (a repo id, older convert_hf_to_gguf.py), else
    general.source.repo_url or general.source.url (a Hugging Face URL becomes its repo id; another
    URL is returned as is). general.base_model.* is deliberately not used: it names the model this
    one was fine-tuned from (its parent), not this model's weights."""
    meta = read_metadata(path)
    repo = meta.get("general.source.huggingface.repository")
    if isinstance(repo, str) and repo.strip():
        return repo.strip()
    for key in ("general.source.repo_url", "general.source.url"):
        url = meta.get(key)
        if isinstance(url, str) and url.strip():
            return hf_repo_id(url.strip()) or url.strip()
    return None
