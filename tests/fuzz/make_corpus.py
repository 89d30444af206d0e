#!/usr/bin/env python3
"""Writes the committed seed corpus of the libFuzzer targets (tests/fuzz/corpus/<target>/),
from which `make fuzz` and the short pass of `make test` start (tests/fuzz/run.sh).

Run from the repository root after changing a target's input format:
    python3 tests/fuzz/make_corpus.py
Needs numpy and gguf (gguf-py, pinned in scripts/setup.sh) for the GGUF seeds; everything else
is the standard library. Seeds are small, valid (or deliberately near-valid) inputs in each
target's input format (see the target's header comment): the fuzzer mutates from there.
"""
import json
import os
import struct
import subprocess
import sys
import tempfile

ROOT = os.path.abspath(os.path.join(os.path.dirname(__file__), "..", ".."))
OUT = os.path.join(ROOT, "tests", "fuzz", "corpus")
BOM = b"\xef\xbb\xbf"


def put(target, name, data):
    d = os.path.join(OUT, target)
    os.makedirs(d, exist_ok=True)
    with open(os.path.join(d, "seed-" + name), "wb") as f:
        f.write(data if isinstance(data, bytes) else data.encode())


def chat(*turns):
    return json.dumps({"messages": [{"role": r, "content": c} for r, c in turns]}, ensure_ascii=False)


def control():
    put("fuzz_control", "status", b'\x20{"v":1,"op":"status"}\n{"v":1,"op":"jobs"}')
    put("fuzz_control", "attach", b'\x20{"v":1,"op":"attach","rank":1,"world_size":2,"resume":null,'
                                  b'"job":{"name":"x","shards":["/d/*.jsonl"]}}')
    put("fuzz_control", "report", b'\x20{"v":1,"op":"report","job_id":3,"step":9,"loss":1.5,"tokens_per_s":null}\n'
                                  b'{"v":1,"op":"detach"}')
    put("fuzz_control", "dup", b'\x20{"v":1,"op":"status","op":"drain"}\n\n   \n{"v":1,"op":"hello"}')
    put("fuzz_control", "controls", b'\x20{"v":1,"op":"attach","job":{"name":"x\\u001b]0;t\\u0007\\n",'
                                    b'"shards":["/d/\xe2\x80\xae.jsonl"],"na\\u009bme":1}}\n'
                                    b'{"v":1,"op":"status\x1b[2J"}\n{"v":1,"op":"hello","n":"\xc2\x9b\xff"}')


def jsonl_sample():
    put("fuzz_jsonl_sample", "chat", b"\x01" + chat(("system", "Be brief."), ("user", "Hi?"),
                                                    ("assistant", "Hello!")).encode())
    put("fuzz_jsonl_sample", "alpaca", b'\x42{"instruction":"Add","input":"2 and 3","output":"5"}')
    put("fuzz_jsonl_sample", "text", b'\x00{"text":"Plain text \\u00e9\\u4e2d 123 <|im_end|>"}')
    put("fuzz_jsonl_sample", "bom", b"\x01" + BOM + chat(("user", "q"), ("assistant", "a")).encode())
    put("fuzz_jsonl_sample", "dupkey", b'\x00{"text":"a","text":"b"}')


def tokenizer():
    put("fuzz_tokenizer", "mixed", b"\x01Hello <|im_start|>user\nw\xc3\xb6rld 12345 \xf0\x9f\x98\x80  \t end")
    put("fuzz_tokenizer", "bad", b"\x00\xff\xfe\xc3( \xe2\x82 tail")


def tokenizer_spm():
    # byte 0: bit 0 parse_special, bit 1 the tokenizer.json (else the GGUF vocabulary)
    put("fuzz_tokenizer_spm", "gguf", b"\x00Hello  world\n\ttab \xf0\x9f\x98\x80 \xff\xfe end")
    put("fuzz_tokenizer_spm", "gguf-special", b"\x01<s>[INST] hi [/INST] ok</s>\n\n  x")
    put("fuzz_tokenizer_spm", "json", b"\x02caf\xc3\xa9 \xf0\x9f\xa6\x99  spaces\n")
    put("fuzz_tokenizer_spm", "json-special", b"\x03<s> x </s>\xff")


def yaml_config():
    put("fuzz_yaml_config", "job", b"model: m.gguf\ndata:\n  shards: &s [a/*.jsonl]\n  seq_len: 0x200\neval: {shards: *s}\n"
                                   b"optim:\n  lr: 1e-3\n")


def zstd_source():
    put("fuzz_zstd_source", "plain", b'\x24\x00\x00{"text":"a"}\r\n\n{"text":"b"}\nlast')
    put("fuzz_zstd_source", "zstd", b'\x25\x00\x00{"text":"a"}\n{"text":"bb"}\n{"text":"ccc"}\n')
    put("fuzz_zstd_source", "cut", b'\x26\x80\x11{"text":"a"}\n{"text":"bb"}\n{"text":"ccc"}\n')
    put("fuzz_zstd_source", "bom", b"\x24\x00\x00" + BOM + b'{"text":"a"}\n{"text":"b"}\n')


def tcache_entry():
    put("fuzz_tcache_entry", "doc", b"\x01\x00\x05\x00\x01\x03\x01\x02\x03\x02\x01\x02")
    put("fuzz_tcache_entry", "bad", b"\x02\x01\x02\x00\x02\x05\x00\x01\x01\x04\x02\x00\x05oops!")


def config():
    with open(os.path.join(ROOT, "scripts", "loaderd.example.json"), "rb") as f:
        put("fuzz_config", "loaderd-example", b"\x00" + f.read())
    put("fuzz_config", "loaderd-keys", b"\x00" + json.dumps({
        "socket": "/tmp/x.sock", "socket_mode": "0600", "max_clients": 8, "max_clients_per_uid": 2,
        "operator_groups": [0, "root"], "memory_budget_bytes": 1 << 30, "client_timeout_s": 5,
        "allowed_users": ["root", 65534], "data_roots": ["/tmp"], "model_roots": ["/nonexistent"]}).encode())
    put("fuzz_config", "loaderd-dup", b"\x00" + BOM + b'{"max_jobs": 1, "max_jobs": 2}')
    spec = {"name": "j", "shards": ["/d/a-*.jsonl.zst"], "format": "chat", "tokenizer": "/m/t.gguf",
            "seq_len": 512, "micro_batch_size": 4, "seed": 7, "epochs": 1, "tokenizer_threads": 2,
            "chat_template": "auto", "overlong": "drop", "ring_slots": 8}
    put("fuzz_config", "jobspec", b"\x01" + json.dumps(spec).encode())
    multi = {"tokenizer": "/m/t.gguf", "seq_len": 64, "micro_batch_size": 2,
             "datasets": [{"shards": ["/d/x.jsonl"], "format": "text", "text_field": "body", "weight": 3},
                          {"shards": ["/d/y.jsonl"], "format": "alpaca", "weight": 0.5}]}
    put("fuzz_config", "jobspec-datasets", b"\x01" + json.dumps(multi).encode())
    put("fuzz_config", "jobspec-dup", b'\x01{"tokenizer":"/t","seq_len":64,"seq_len":32,"micro_batch_size":1}')
    trainer = os.path.join(ROOT, "build", "trainer")
    for name in ("default", "qlora", "long-context"):
        r = subprocess.run([trainer, "config", "--template", name], capture_output=True, check=True)
        text = json.dumps(json.loads(r.stdout), separators=(",", ":")).encode()
        put("fuzz_config", "trainer-" + name, b"\x02" + text)
    put("fuzz_config", "trainer-sets", b'\x02{"model":"m.gguf","data":{"shards":["d/*.jsonl"]}}\n'
                                       b"optim.lr=1e-3\nlora.r=8\nsteps=20\noptim.warmup_steps=5")
    put("fuzz_config", "trainer-dup", b'\x02{"model":"m.gguf","data":{"shards":["a"]},"steps":3,"steps":4}')


def gguf_seeds():
    import numpy as np
    import gguf
    with tempfile.TemporaryDirectory() as tmp:
        path = os.path.join(tmp, "t.gguf")
        w = gguf.GGUFWriter(path, "llama")
        w.add_uint32("llama.block_count", 1)
        w.add_float32("llama.attention.layer_norm_rms_epsilon", 1e-5)
        w.add_bool("tokenizer.ggml.add_bos_token", False)
        w.add_string("general.name", "fuzz seed")
        w.add_int64("seed.i64", -5)
        w.add_float64("seed.f64", 0.25)
        w.add_array("seed.u16s", [1, 2, 3])
        tokens = ["a", "b", "c", "ab", "abc", "\u0120", "<|im_start|>", "<|im_end|>"]
        w.add_tokenizer_model("gpt2")
        w.add_token_list(tokens)
        w.add_token_types([1, 1, 1, 1, 1, 1, 3, 3])
        w.add_token_merges(["a b", "ab c"])
        w.add_bos_token_id(6)
        w.add_eos_token_id(7)
        w.add_tensor("token_embd.weight", np.arange(8 * 4, dtype=np.float32).reshape(8, 4))
        w.add_tensor("output_norm.weight", np.ones(4, dtype=np.float16))
        q = np.zeros((1, 34), dtype=np.uint8)  # one Q8_0 block: f16 d then 32 int8
        q[0, 0:2] = np.frombuffer(np.float16(0.5).tobytes(), dtype=np.uint8)
        q[0, 2:] = np.arange(32, dtype=np.uint8)
        w.add_tensor("blk.0.q8.weight", q, raw_dtype=gguf.GGMLQuantizationType.Q8_0)
        w.write_header_to_file()
        w.write_kv_data_to_file()
        w.write_tensors_to_file()
        w.close()
        with open(path, "rb") as f:
            data = f.read()
    put("fuzz_gguf", "tokenizer-and-tensors", data)
    put("fuzz_gguf", "truncated", data[: len(data) // 2])
    put("fuzz_gguf", "header-only", b"GGUF" + struct.pack("<IQQ", 3, 0, 0))


def safetensors_seeds():
    def st(tensors, meta=None):
        header, blobs, off = {}, b"", 0
        if meta is not None:
            header["__metadata__"] = meta
        for name, dtype, shape, raw in tensors:
            header[name] = {"dtype": dtype, "shape": shape, "data_offsets": [off, off + len(raw)]}
            blobs += raw
            off += len(raw)
        h = json.dumps(header, separators=(",", ":")).encode()
        h += b" " * (-len(h) % 8)
        return struct.pack("<Q", len(h)) + h + blobs
    a = struct.pack("<8f", *[0.5 * i for i in range(8)])
    b = struct.pack("<4e", 1.0, -2.0, 0.25, 3.5)
    put("fuzz_safetensors", "two", st([("base_model.model.lora_A.weight", "F32", [2, 4], a),
                                       ("x.bias", "F16", [4], b)], {"format": "pt"}))
    put("fuzz_safetensors", "empty", st([]))
    put("fuzz_safetensors", "scalar-bool", st([("s", "F32", [], struct.pack("<f", 1.0)),
                                               ("m", "BOOL", [3], b"\x01\x00\x01")]))


def mem_limits():
    """fuzz_mem_limits: meminfo \0 cgroup \0 mountinfo \0 limit-file text ("<tmp>/cg" is the
    target's own cgroup mount; "/tmp/bt_fuzz_mem_*" stands for it in the seeds)."""
    meminfo = b"MemTotal:       16384000 kB\nMemFree:         1000 kB\nMemAvailable:    1048576 kB\n"
    put("fuzz_mem_limits", "v2", meminfo + b"\x00" + b"0::/a/b\n" + b"\x00" +
        b"30 25 0:26 / /tmp/bt_fuzz_mem_X/cg rw,nosuid - cgroup2 cgroup2 rw\n" + b"\x00" + b"2147483648\n")
    put("fuzz_mem_limits", "v1", meminfo + b"\x00" + b"4:memory:/a/b\n0::/\n" + b"\x00" +
        b"40 25 0:30 /a /tmp/a\\040b rw - cgroup cgroup rw,memory\n" + b"\x00" + b"9223372036854771712\n")
    put("fuzz_mem_limits", "max", b"MemAvailable: 1 kB\n\x000::/\n\x00" +
        b"1 1 0:1 / / rw - cgroup2 x rw\n\x00max\n")


def chat_template():
    rs, us = b"\x1e", b"\x1f"
    put("fuzz_chat_template", "chatml", b"\x00" + b"\x00" + us + b"Be brief." + rs + b"\x01" + us + b"Hi there?" +
        rs + b"\x02" + us + b"Hello!\n  How can I help?")
    put("fuzz_chat_template", "chatml-default-system", b"\x00" + b"\x01" + us + b"q <|im_end|> x" + rs + b"\x02" + us +
        b"a\xc3\xa9\xe4\xb8\xad")
    put("fuzz_chat_template", "llama3", b"\x01" + b"\x00" + us + b"  You are terse.\n" + rs + b"\x01" + us + b"2+2?" +
        rs + b"\x02" + us + b" 4 \n\t" + rs + b"\x02" + us + b"")
    put("fuzz_chat_template", "llama3-roles", b"\x01" + b"tool" + us + b"{}" + rs + b"\x02" + us + b"ok")
    # found by the fuzzer: bytes SmolLM2's vocabulary has no character for (0x1d) are dropped
    put("fuzz_chat_template", "dropped-bytes", b"to\xbc|pyt`on_tag|>\x1e\x02\x1f" + b"\x00" * 6 +
        b"\x1d\x89Y\x91G\x7f" + b"\x00" * 7 + b"a\xc3e\x89 ")


def main():
    control()
    jsonl_sample()
    tokenizer()
    tokenizer_spm()
    zstd_source()
    tcache_entry()
    yaml_config()
    config()
    gguf_seeds()
    safetensors_seeds()
    chat_template()
    mem_limits()
    n = sum(len(fs) for _, _, fs in os.walk(OUT))
    print(f"make_corpus: {n} seed files under {os.path.relpath(OUT, ROOT)}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
