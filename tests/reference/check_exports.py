#!/usr/bin/env python3
"""Cross-check `trainer export` against the real reference libraries (transformers, peft, gguf-py).

Run inside .venv-hf (torch 2.5.1, transformers 4.46.3, peft 0.13.2, gguf 0.17.1; see
requirements-hf.txt), from the repository root, after `make build/trainer`:

    .venv-hf/bin/python tests/reference/check_exports.py --base-hf HF_DIR --adapter PEFT_DIR \
        [--base-model BASE.gguf|HF_DIR] [--work DIR]
    .venv-hf/bin/python tests/reference/check_exports.py --demo [--work DIR] [--steps 30]

`check_peft_adapter(base_hf_dir, adapter_dir, base_model=None)`:
  1. peft.PeftModel.from_pretrained(LlamaForCausalLM(base_hf_dir), adapter_dir) gives the
     reference logits on a fixed token sequence (fp32, CPU); every LoRA weight PEFT loaded is
     compared with the file (nothing silently dropped).
  2. `trainer export --format peft`: PEFT loads the normalised copy; logits vs the reference.
  3. `--format safetensors --dtype f32|f16|bf16`: transformers loads the merged directory;
     logits vs the reference; f32 weights vs PeftModel.merge_and_unload().
  4. `--format gguf --dtype f32|q8_0`: gguf-py reads it; tensors un-permuted with transformers'
     own GGUF reverse-permutation equal the merge_and_unload weights (f32) / their Q8_0 rounding;
     and transformers loads the f32 GGUF (from_pretrained(gguf_file=...)) with the reference logits.
  5. `--format gguf-lora --dtype f32`: gguf-py reads it; general.type / adapter.type / alpha;
     lora_a == A; lora_b == LlamaModel.permute(B) for q/k (convert_lora_to_gguf.py's layout).
Returns a dict of the measured differences and raises AssertionError past the tolerances.

`--demo` makes everything itself: a tiny random Llama GGUF with the SmolLM2 tokenizer
(build/tools/mk_tiny_gguf), trains a LoRA on it with OUR trainer through loaderd (fp32 base, all 7
modules, lr 1e-2), converts the GGUF to a Hugging Face directory with transformers' own GGUF loader
(independent of our code), then runs check_peft_adapter on the trained adapter.

`--context-extension` (issue 12): for each method (linear, yarn, dynamic), OUR trainer trains a
LoRA on the tiny GGUF (trained context 128) with context_extension {target_length 256, method}
on 256-token text rows; then, at positions 200..223 (beyond the original context):
  1. BarqTrain's logits (build/tools/bt_logits: base + adapter, which applies the extension the
     adapter records) against transformers' on `trainer export --format safetensors --dtype f32`
     (config.json rope_scaling / max_position_embeddings as written), and visibly not those of
     the same weights without the scaling;
  2. `--format gguf --dtype f32`: gguf-py reads llama.rope.scaling.{type, factor,
     original_context_length, attn_factor} and llama.context_length; transformers' GGUF loader
     does not map those keys to rope_scaling, so they are given to from_pretrained(gguf_file=...)
     as the rope_scaling they describe (llama.cpp semantics: attn_factor x (1 + 0.1 ln factor) is
     YaRN's attention factor) and the logits must match; dynamic NTK is refused (llama.cpp has no
     equivalent) with a message;
  3. `--format gguf-lora`: the same keys, recorded as notes for the base;
  4. the adapter's adapter_config.json records the extension (barqtrain_context_extension).
Run it in .venv-hf (transformers 4.46) and with the newest transformers: the exported configs are
written so that both read the same positions.
"""
import argparse
import json
import os
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]
TRAINER = REPO / "build" / "trainer"
MODS = ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]
GGUF_LIN = ["attn_q", "attn_k", "attn_v", "attn_output", "ffn_gate", "ffn_up", "ffn_down"]


def export(base_model, adapter, fmt, out, dtype=None):
    cmd = [str(TRAINER), "export", "--model", str(base_model), "--adapter", str(adapter),
           "--format", fmt, "--out", str(out)]
    if dtype:
        cmd += ["--dtype", dtype]
    r = subprocess.run(cmd, capture_output=True, text=True, cwd=REPO)
    if r.returncode != 0:
        raise AssertionError(f"{' '.join(cmd)} -> {r.returncode}\n{r.stdout}{r.stderr}")


def hf_permute(w, n_head):
    """convert_hf_to_gguf.py LlamaModel.permute (HF -> GGUF row order)."""
    return (w.reshape(n_head, 2, w.shape[0] // n_head // 2, *w.shape[1:])
            .swapaxes(1, 2).reshape(w.shape))


def check_peft_adapter(base_hf_dir, adapter_dir, base_model=None, work=None, seq_len=48, seed=0):
    import numpy as np
    import torch
    import gguf
    from peft import PeftModel
    from safetensors.torch import load_file
    from transformers import AutoModelForCausalLM
    from transformers.integrations.ggml import GGUF_CONFIG_MAPPING  # noqa: F401 (gguf support present)
    from transformers.modeling_gguf_pytorch_utils import reverse_permute_weights

    torch.manual_seed(seed)
    torch.use_deterministic_algorithms(True)
    base_model = base_model or base_hf_dir
    work = Path(work or tempfile.mkdtemp(prefix="bt-check-exports-"))
    work.mkdir(parents=True, exist_ok=True)
    res = {}

    def base():
        return AutoModelForCausalLM.from_pretrained(base_hf_dir, torch_dtype=torch.float32).eval()

    cfg = base().config
    nh, nkv = cfg.num_attention_heads, cfg.num_key_value_heads
    ids = torch.randint(0, cfg.vocab_size, (2, seq_len), generator=torch.Generator().manual_seed(seed))

    def logits(model):
        with torch.no_grad():
            return model(input_ids=ids).logits.float()

    # 1. the reference: PEFT on the base
    pm = PeftModel.from_pretrained(base(), adapter_dir).eval()
    ref = logits(pm)
    res["logits_absmax"] = float(ref.abs().max())
    sd = load_file(str(Path(adapter_dir) / "adapter_model.safetensors"))
    loaded = {n.replace(".default", ""): p for n, p in pm.named_parameters() if "lora_" in n}
    assert set(loaded) == set(sd), f"PEFT loaded {len(loaded)} LoRA tensors, file has {len(sd)}"
    for k, v in sd.items():
        assert torch.equal(loaded[k].detach(), v.float()), k
    with open(Path(adapter_dir) / "adapter_config.json") as f:
        acfg = json.load(f)
    r, alpha = acfg["r"], float(acfg["lora_alpha"])
    scale = alpha / (r ** 0.5 if acfg.get("use_rslora") else r)
    res["base_vs_adapter_logits_maxdiff"] = float((logits(base()) - ref).abs().max())
    merged_sd = {k: v.detach().clone() for k, v in pm.merge_and_unload().state_dict().items()}

    # 2. peft -> peft
    export(base_model, adapter_dir, "peft", work / "peft")
    d = float((logits(PeftModel.from_pretrained(base(), work / "peft").eval()) - ref).abs().max())
    res["peft_export_logits_maxdiff"] = d
    assert d <= 1e-5 * max(1.0, res["logits_absmax"]), d

    # 3. merged safetensors
    for dt, tol in (("f32", 1e-4), ("f16", 5e-2), ("bf16", 2e-1)):
        out = work / f"merged-st-{dt}"
        export(base_model, adapter_dir, "safetensors", out, dt)
        m = AutoModelForCausalLM.from_pretrained(out, torch_dtype=torch.float32).eval()
        d = float((logits(m) - ref).abs().max())
        res[f"safetensors_{dt}_logits_maxdiff"] = d
        assert d <= tol * max(1.0, res["logits_absmax"]), (dt, d)
        if dt == "f32":
            wd = max(float((v - merged_sd[k]).abs().max()) for k, v in m.state_dict().items()
                     if k in merged_sd)
            res["safetensors_f32_weights_vs_merge_and_unload_maxdiff"] = wd
            assert wd <= 1e-5, wd

    # 4. merged GGUF
    lin = {}
    for layer in range(cfg.num_hidden_layers):
        for mname, g in zip(MODS, GGUF_LIN):
            blk = "self_attn" if mname in MODS[:4] else "mlp"
            lin[f"blk.{layer}.{g}.weight"] = (f"model.layers.{layer}.{blk}.{mname}.weight", mname)
    for dt in ("f32", "q8_0"):
        out = work / f"merged-{dt}.gguf"
        export(base_model, adapter_dir, "gguf", out, dt)
        rd = gguf.GGUFReader(str(out))
        worst = 0.0
        for t in rd.tensors:
            if t.name not in lin:
                continue
            key, mname = lin[t.name]
            w = gguf.quants.dequantize(t.data, t.tensor_type).reshape(merged_sd[key].shape)
            if mname in ("q_proj", "k_proj"):  # transformers' own GGUF un-permutation
                w = reverse_permute_weights(w, nh, nh if mname == "q_proj" else nkv)
            want = merged_sd[key].numpy()
            if dt == "q8_0":
                want = gguf.quants.dequantize(gguf.quants.quantize(
                    hf_permute(want, nh if mname == "q_proj" else nkv) if mname in ("q_proj", "k_proj")
                    else want, gguf.GGMLQuantizationType.Q8_0), gguf.GGMLQuantizationType.Q8_0)
                if mname in ("q_proj", "k_proj"):
                    want = reverse_permute_weights(want, nh, nh if mname == "q_proj" else nkv)
            worst = max(worst, float(np.abs(w - want).max()))
        res[f"gguf_{dt}_weights_maxdiff"] = worst
        assert worst <= 1e-5, (dt, worst)
        if dt == "f32":
            try:
                m = AutoModelForCausalLM.from_pretrained(str(work), gguf_file=out.name,
                                                         torch_dtype=torch.float32).eval()
                if cfg.tie_word_embeddings:
                    m.lm_head.weight = m.model.embed_tokens.weight
                d = float((logits(m) - ref).abs().max())
                res["gguf_f32_transformers_logits_maxdiff"] = d
                assert d <= 1e-4 * max(1.0, res["logits_absmax"]), d
            except (ValueError, KeyError, NotImplementedError, OSError) as e:
                res["gguf_f32_transformers_load"] = f"skipped: {type(e).__name__}: {e}"[:200]

    # 5. llama.cpp LoRA GGUF
    out = work / "lora-f32.gguf"
    export(base_model, adapter_dir, "gguf-lora", out, "f32")
    rd = gguf.GGUFReader(str(out))

    def kv(key):
        f = rd.fields[key]
        v = f.parts[f.data[0]]
        return bytes(v).decode() if f.types[0] == gguf.GGUFValueType.STRING else v[0].item()
    assert kv("general.architecture") == "llama" and kv("general.type") == "adapter"
    assert kv("adapter.type") == "lora"
    assert rd.fields["adapter.lora.alpha"].types[0] == gguf.GGUFValueType.FLOAT32
    assert abs(kv("adapter.lora.alpha") / r - scale) <= 1e-6 * scale
    tens = {t.name: t for t in rd.tensors}
    worst = 0.0
    for gname, (key, mname) in lin.items():
        pa = "base_model.model." + key.replace(".weight", ".lora_A.weight")
        if pa not in sd:
            assert gname + ".lora_a" not in tens
            continue
        A, B = sd[pa].float().numpy(), sd[pa.replace("lora_A", "lora_B")].float().numpy()
        a, b = tens[gname + ".lora_a"], tens[gname + ".lora_b"]
        assert list(a.shape) == [A.shape[1], A.shape[0]] and list(b.shape) == [B.shape[1], B.shape[0]]
        if mname in ("q_proj", "k_proj"):
            B = hf_permute(B, nh if mname == "q_proj" else nkv)
        worst = max(worst, float(np.abs(np.asarray(a.data).reshape(A.shape) - A).max()),
                    float(np.abs(np.asarray(b.data).reshape(B.shape) - B).max()))
    res["gguf_lora_f32_vs_adapter_maxdiff"] = worst
    assert worst == 0.0, worst
    return res


# ---- --demo: an adapter trained by our trainer ----

def make_trained_adapter(work, steps, ctx=2048, job_extra=None, text=False):
    import gguf  # noqa: F401
    smol = REPO / "models" / "SmolLM2-135M-Instruct.Q4_1.gguf"
    tiny = work / "tiny.gguf"
    subprocess.run([str(REPO / "build" / "tools" / "mk_tiny_gguf"), "--out", str(tiny),
                    "--tokenizer-from", str(smol), "--layers", "2", "--hidden", "64", "--heads", "4",
                    "--kv-heads", "2", "--ffn", "128", "--seed", "7", "--ctx", str(ctx)], check=True)
    data = work / "data"
    data.mkdir(exist_ok=True)
    if text:  # long documents: rows of consecutive text, positions up to seq_len - 1
        lines = [json.dumps({"text": " ".join(f"item {i * 97 + j} is {(i * 97 + j) * 7}."
                                              for j in range(300))}) for i in range(8)]
    else:
        lines = [json.dumps({"messages": [{"role": "user", "content": f"What is item {i}?"},
                                          {"role": "assistant", "content": f"Item {i} is {i * 7}."}]})
                 for i in range(64)]
    (data / "train.jsonl").write_text("\n".join(lines) + "\n")
    sock = work / "ld.sock"
    (work / "loaderd.json").write_text(json.dumps({"socket": str(sock), "data_roots": [str(data)],
                                                   "model_roots": [str(work), str(smol.parent)]}))
    log = open(work / "loaderd.log", "wb")
    ld = subprocess.Popen([str(REPO / "build" / "loaderd"), "--config", str(work / "loaderd.json"),
                           "--foreground"], stderr=log)
    try:
        for _ in range(200):
            if sock.exists():
                break
            time.sleep(0.05)
        job = {"model": str(tiny), "base_dtype": "fp32", "socket": str(sock),
               "data": {"shards": [str(data / "train.jsonl")], "format": "chat", "seq_len": 64,
                        "micro_batch_size": 2, "seed": 5},
               "lora": {"r": 4, "lora_alpha": 8, "lora_dropout": 0.0},
               "optim": {"lr": 1e-2, "warmup_steps": 1}, "steps": steps, "threads": 1,
               "out_dir": str(work / "adapter")}
        if text:
            job["data"]["format"] = "text"
        job.update(job_extra or {})
        (work / "job.json").write_text(json.dumps(job))
        subprocess.run([str(TRAINER), "train", "--config", str(work / "job.json")], check=True,
                       cwd=REPO)
    finally:
        ld.send_signal(signal.SIGTERM)
        ld.wait(timeout=20)
        log.close()
    return tiny, work / "adapter"


def gguf_to_hf(gguf_path, out_dir):
    """The GGUF base as a HF directory, converted by transformers' own GGUF loader."""
    import torch
    from transformers import AutoModelForCausalLM
    gguf_path = Path(gguf_path)
    import gguf
    m = AutoModelForCausalLM.from_pretrained(str(gguf_path.parent), gguf_file=gguf_path.name,
                                             torch_dtype=torch.float32)
    # transformers 4.46 leaves lm_head random when the GGUF has no output.weight (tied)
    if not any(t.name == "output.weight" for t in gguf.GGUFReader(str(gguf_path)).tensors):
        m.config.tie_word_embeddings = True
        m.tie_weights()
        assert m.lm_head.weight.data_ptr() == m.model.embed_tokens.weight.data_ptr()
    m.save_pretrained(out_dir, safe_serialization=True)
    return out_dir


# ---- --hf-dir: the merged directory as transformers users load it (tokenizer, sharding, pipeline) ----

SMOL = REPO / "models" / "SmolLM2-135M-Instruct.Q4_1.gguf"
TOKFIX = REPO / "tests" / "fixtures" / "tokenizer"
PROMPTS = ["What is the capital of France?", "Write a Python function that adds two numbers."]


def zstd_bytes(path):
    return subprocess.run(["zstd", "-dc", str(path)], capture_output=True, check=True).stdout


def read_corpus():
    """tests/fixtures/tokenizer/corpus.bin.zst: [(parse_special, text)] (gen_tokenizer_fixtures.py
    write_corpus; invalid UTF-8 replaced as the HF ids were made)."""
    import struct
    b = zstd_bytes(TOKFIX / "corpus.bin.zst")
    assert b[:8] == b"BTTKCORP"
    n, off, docs = struct.unpack_from("<I", b, 8)[0], 12, []
    for _ in range(n):
        f, ln = struct.unpack_from("<BI", b, off)
        off += 5
        docs.append((f & 1, b[off:off + ln].decode("utf-8", errors="replace")))
        off += ln
    return docs


def read_ids(name):
    """<name>_ids.bin.zst: the HF `tokenizers` ids of every corpus document (write_family_fixtures)."""
    import struct
    b = zstd_bytes(TOKFIX / f"{name}_ids.bin.zst")
    assert b[:8] == b"BTTKIDS1"
    n, off, out = struct.unpack_from("<I", b, 8)[0], 12, []

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
        off += 8  # decode hash
        out.append([varint() for _ in range(varint())])
    return out


def autotok_mismatches(tok_dir, docs, want, **kw):
    """Documents whose AutoTokenizer ids (add_special_tokens=False; special-token strings parsed
    only where the corpus says so, split_special_tokens=True otherwise) differ from `want`."""
    from transformers import AutoTokenizer
    sp = AutoTokenizer.from_pretrained(str(tok_dir), **kw)
    plain = AutoTokenizer.from_pretrained(str(tok_dir), split_special_tokens=True, **kw)
    bad = []
    for i, (f, text) in enumerate(docs):
        ids = (sp if f else plain)(text, add_special_tokens=False)["input_ids"]
        if ids != want[i]:
            bad.append(i)
    return bad, sp


def write_random_adapter(out, cfg, r=4, seed=3, b_std=0.003, mods=MODS):
    """A PEFT LoRA adapter with random A and small random B for a model of HF config `cfg`."""
    import numpy as np
    from safetensors.numpy import save_file
    H, F = cfg["hidden_size"], cfg["intermediate_size"]
    hd = cfg.get("head_dim") or H // cfg["num_attention_heads"]
    q, kv = cfg["num_attention_heads"] * hd, cfg["num_key_value_heads"] * hd
    shapes = {"q_proj": (q, H), "k_proj": (kv, H), "v_proj": (kv, H), "o_proj": (H, q),
              "gate_proj": (F, H), "up_proj": (F, H), "down_proj": (H, F)}
    rng, t = np.random.default_rng(seed), {}
    for layer in range(cfg["num_hidden_layers"]):
        for m in mods:
            o, i = shapes[m]
            blk = "self_attn" if m in MODS[:4] else "mlp"
            p = f"base_model.model.model.layers.{layer}.{blk}.{m}"
            t[p + ".lora_A.weight"] = rng.normal(0, 1 / np.sqrt(i), (r, i)).astype(np.float32)
            t[p + ".lora_B.weight"] = rng.normal(0, b_std, (o, r)).astype(np.float32)
    Path(out).mkdir(parents=True, exist_ok=True)
    save_file(t, str(Path(out) / "adapter_model.safetensors"), metadata={"format": "pt"})
    (Path(out) / "adapter_config.json").write_text(json.dumps(
        {"peft_type": "LORA", "task_type": "CAUSAL_LM", "r": r, "lora_alpha": 2 * r,
         "lora_dropout": 0.0, "target_modules": list(mods), "bias": "none",
         "base_model_name_or_path": "base"}))
    return out


def gguf_config(path):
    """The llama.* hyper-parameters of a GGUF as HF config keys (for write_random_adapter)."""
    import gguf
    rd = gguf.GGUFReader(str(path))

    def v(k):
        f = rd.fields[k]
        return int(f.parts[f.data[0]][0])
    h, nh = v("llama.embedding_length"), v("llama.attention.head_count")
    return {"hidden_size": h, "intermediate_size": v("llama.feed_forward_length"),
            "num_attention_heads": nh, "num_key_value_heads": v("llama.attention.head_count_kv"),
            "num_hidden_layers": v("llama.block_count"), "head_dim": h // nh}


def tokenizer_gguf(tok_json, out, pre, add_bos):
    """A tokenizer-only GGUF from a tokenizer.json as llama.cpp's convert_hf_to_gguf.py writes
    one (tokens in id order, added tokens typed CONTROL when special, else USER_DEFINED, merges
    "a b", pre name)."""
    import gguf
    j = json.loads(tok_json)
    vocab = dict(j["model"]["vocab"])
    special, user = {}, set()
    for a in j["added_tokens"]:
        vocab[a["content"]] = a["id"]
        if a["special"]:
            special[a["id"]] = a["content"]
        else:
            user.add(a["id"])
    n = max(vocab.values()) + 1
    toks = [f"[PAD{i}]" for i in range(n)]
    for t_, i in vocab.items():
        toks[i] = t_
    types = [gguf.TokenType.CONTROL if i in special else gguf.TokenType.USER_DEFINED if i in user
             else gguf.TokenType.NORMAL for i in range(n)]
    merges = [m if isinstance(m, str) else " ".join(m) for m in j["model"]["merges"]]
    w = gguf.GGUFWriter(str(out), "llama")
    w.add_tokenizer_model("gpt2")
    w.add_tokenizer_pre(pre)
    w.add_token_list(toks)
    w.add_token_types(types)
    w.add_token_merges(merges)
    names = list(special.values())
    bos = next((i for i, c in special.items() if c in ("<|begin_of_text|>", "<|im_start|>")), None)
    eos = next((i for i, c in special.items() if c in ("<|end_of_text|>", "<|endoftext|>")), None)
    if bos is not None:
        w.add_bos_token_id(bos)
    if eos is not None:
        w.add_eos_token_id(eos)
    w.add_add_bos_token(add_bos)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    return names


def check_hf_dir(work, shard="200MB"):
    """The merged `--format safetensors` directory as a transformers user meets it:
      1. SmolLM2 (the real GGUF) + a random adapter, exported f32 with --max-shard-size: the files
         are there; AutoTokenizer encodes the tokenizer parity corpus exactly as HF `tokenizers`
         did on SmolLM2's tokenizer.json (tests/fixtures/tokenizer/smollm2_ids; transformers' own
         GGUF tokenizer conversion is measured beside it); the shards are cut exactly as
         save_pretrained(max_shard_size=...) cuts the same model; pipeline("text-generation")
         greedy output on chat prompts equals `trainer generate` on GGUF + adapter.
      2. Llama 3 and Qwen2 tokenizers (the fixture tokenizer.json of each family as a GGUF, the way
         convert_hf_to_gguf.py writes it, on a tiny random model): AutoTokenizer on the export
         equals the family's HF ids on the corpus, and the default encode (add_special_tokens)
         adds BOS exactly as the original tokenizer.json does."""
    import torch
    from tokenizers import Tokenizer
    from transformers import AutoModelForCausalLM, AutoTokenizer, pipeline
    torch.manual_seed(0)
    work = Path(work)
    work.mkdir(parents=True, exist_ok=True)
    res = {}
    docs = read_corpus()

    # 1. SmolLM2
    adapter = write_random_adapter(work / "smol-adapter", gguf_config(SMOL))
    out = work / "smol-hf"
    cmd = [str(TRAINER), "export", "--model", str(SMOL), "--adapter", str(adapter), "--format",
           "safetensors", "--dtype", "f32", "--max-shard-size", shard, "--out", str(out)]
    subprocess.run(cmd, check=True, capture_output=True, cwd=REPO)
    files = sorted(p.name for p in out.iterdir())
    res["smollm2_files"] = files
    for f in ("config.json", "generation_config.json", "tokenizer.json", "tokenizer_config.json",
              "special_tokens_map.json", "model.safetensors.index.json"):
        assert f in files, f
    want = read_ids("smollm2")
    bad, tok = autotok_mismatches(out, docs, want)
    res["smollm2_tokenizer"] = {"documents": len(docs), "tokens": sum(map(len, want)),
                                "mismatching_documents": len(bad), "class": type(tok).__name__}
    assert not bad, f"AutoTokenizer differs from HF tokenizers on {len(bad)} documents: {bad[:5]}"
    assert tok.eos_token == "<|im_end|>" and tok.bos_token == "<|im_start|>" and tok.chat_template
    try:  # transformers' own GGUF tokenizer conversion, for comparison
        gbad, _ = autotok_mismatches(SMOL.parent, docs, want, gguf_file=SMOL.name)
        res["smollm2_tokenizer"]["transformers_gguf_conversion_mismatching_documents"] = len(gbad)
    except Exception as e:  # noqa: BLE001 (reported, not checked)
        res["smollm2_tokenizer"]["transformers_gguf_conversion"] = f"failed: {type(e).__name__}: {e}"[:200]
    model = AutoModelForCausalLM.from_pretrained(str(out), torch_dtype=torch.float32).eval()
    ref = work / "smol-save-pretrained"
    model.save_pretrained(str(ref), max_shard_size=shard, safe_serialization=True)
    ours = json.loads((out / "model.safetensors.index.json").read_text())
    theirs = json.loads((ref / "model.safetensors.index.json").read_text())
    assert ours["weight_map"] == theirs["weight_map"], "shards differ from save_pretrained's"
    assert ours["metadata"]["total_size"] == theirs["metadata"]["total_size"]
    res["smollm2_shards"] = {"max_shard_size": shard, "files": len(set(ours["weight_map"].values())),
                             "weight_map_equals_save_pretrained": True}
    gen = pipeline("text-generation", model=model, tokenizer=tok, device="cpu")
    res["smollm2_pipeline_greedy"] = []
    for prompt in PROMPTS:
        msgs = [{"role": "user", "content": prompt}]
        # return_dict=True: transformers 5 returns a dict by default (4.x a list of ids)
        n_prompt = len(tok.apply_chat_template(msgs, add_generation_prompt=True, tokenize=True,
                                               return_dict=True)["input_ids"])
        o = gen(msgs, max_new_tokens=24, do_sample=False, return_tensors=True)
        new = o[0]["generated_token_ids"][n_prompt:]
        theirs_text = tok.decode(new, skip_special_tokens=False)
        r = subprocess.run([str(TRAINER), "generate", "--model", str(SMOL), "--adapter", str(adapter),
                            "--base-dtype", "fp32", "--chat", prompt, "--max-new-tokens", "24",
                            "--show-special"], capture_output=True, text=True, check=True, cwd=REPO)
        ours_text = r.stdout[:-1] if r.stdout.endswith("\n") else r.stdout
        res["smollm2_pipeline_greedy"].append({"prompt": prompt, "new_tokens": len(new),
                                               "text": theirs_text, "equal": ours_text == theirs_text})
        assert ours_text == theirs_text, (prompt, ours_text, theirs_text)

    # 2. Llama 3 / Qwen2 tokenizers through GGUF
    for fam, pre, add_bos in (("llama3", "llama-bpe", True), ("qwen2", "qwen2", False)):
        tj = zstd_bytes(TOKFIX / f"{fam}-tokenizer.json.zst").decode()
        tg = work / f"{fam}-tok.gguf"
        tokenizer_gguf(tj, tg, pre, add_bos)
        tiny = work / f"{fam}-tiny.gguf"
        subprocess.run([str(REPO / "build" / "tools" / "mk_tiny_gguf"), "--out", str(tiny),
                        "--tokenizer-from", str(tg), "--layers", "1", "--hidden", "32", "--heads",
                        "2", "--kv-heads", "1", "--ffn", "64"], check=True, capture_output=True)
        ad = write_random_adapter(work / f"{fam}-adapter", gguf_config(tiny), r=1, mods=["q_proj"])
        d = work / f"{fam}-hf"
        subprocess.run([str(TRAINER), "export", "--model", str(tiny), "--adapter", str(ad), "--format",
                        "safetensors", "--out", str(d)], check=True, capture_output=True, cwd=REPO)
        want = read_ids(fam)
        bad, tok = autotok_mismatches(d, docs, want)
        orig = Tokenizer.from_str(tj)
        sample = [t for _, t in docs[:200]]
        with_bos = sum(tok(t)["input_ids"] == orig.encode(t).ids for t in sample)
        res[f"{fam}_tokenizer"] = {"documents": len(docs), "tokens": sum(map(len, want)),
                                   "mismatching_documents": len(bad),
                                   "default_encode_equal_to_tokenizer_json": f"{with_bos}/{len(sample)}"}
        assert not bad, (fam, len(bad), bad[:5])
        assert with_bos == len(sample), (fam, with_bos)
    return res


def check_context_extension(work):
    import numpy as np
    import torch
    import gguf
    from transformers import AutoModelForCausalLM

    res = {}
    ids = torch.randint(0, 49152, (1, 24), generator=torch.Generator().manual_seed(3))
    pos = torch.arange(200, 224).view(1, -1)
    for method in ("linear", "yarn", "dynamic"):
        w = work / method
        w.mkdir(parents=True, exist_ok=True)
        tiny, adapter = make_trained_adapter(
            w, 2, ctx=128, text=True,
            job_extra={"context_extension": {"target_length": 256, "method": method},
                       "data": {"shards": [str(w / "data" / "train.jsonl")], "format": "text",
                                "seq_len": 256, "micro_batch_size": 1, "seed": 5},
                       "lora": {"r": 4, "lora_alpha": 8, "lora_dropout": 0.0,
                                "target_modules": ["q_proj", "k_proj", "v_proj", "o_proj"]}})
        note = json.loads((adapter / "adapter_config.json").read_text())["barqtrain_context_extension"]
        assert note["method"] == method and note["target_length"] == 256, note
        out = w / "ours.f32"
        r = subprocess.run([str(REPO / "build" / "tools" / "bt_logits"), "--model", str(tiny),
                            "--adapter", str(adapter), "--ids", ",".join(map(str, ids[0].tolist())),
                            "--pos0", "200", "--out", str(out)], capture_output=True, text=True)
        assert r.returncode == 0, r.stderr
        n, V, ctx = map(int, r.stdout.split())
        assert ctx == 256
        ours = torch.from_numpy(np.fromfile(out, dtype=np.float32).reshape(n, V))
        amax = float(ours.abs().max())

        def logits(m):
            with torch.no_grad():
                return m(input_ids=ids, position_ids=pos).logits[0].float()

        # 1. merged safetensors: config.json carries the extension
        st = w / "merged-st"
        export(tiny, adapter, "safetensors", st, "f32")
        cfg = json.loads((st / "config.json").read_text())
        m = AutoModelForCausalLM.from_pretrained(st, torch_dtype=torch.float32).eval()
        d = float((logits(m) - ours).abs().max())
        # the same weights unscaled (transformers 5 keeps rope_theta inside rope_parameters)
        unscaled = {"rope_type": "default", "rope_theta": cfg["rope_theta"]}
        plain = AutoModelForCausalLM.from_pretrained(st, torch_dtype=torch.float32,
                                                     rope_scaling=unscaled,
                                                     max_position_embeddings=256).eval()
        d0 = float((logits(plain) - ours).abs().max())
        res[f"{method}_safetensors_logits_maxdiff"] = d
        res[f"{method}_safetensors_rope_scaling"] = cfg["rope_scaling"]
        res[f"{method}_vs_unscaled_logits_maxdiff"] = d0
        assert d <= 1e-4 * max(1.0, amax), (method, d)
        assert d0 > 100 * d, (method, d0, d)
        # 2. merged GGUF: llama.cpp's keys
        g = w / "merged.gguf"
        r = subprocess.run([str(TRAINER), "export", "--model", str(tiny), "--adapter", str(adapter),
                            "--format", "gguf", "--out", str(g), "--dtype", "f32"],
                           capture_output=True, text=True, cwd=REPO)
        if method == "dynamic":
            assert r.returncode != 0 and "dynamic" in r.stderr, r.stderr
            res["dynamic_gguf"] = "refused: " + r.stderr.strip().splitlines()[-1][:160]
        else:
            assert r.returncode == 0, r.stderr
            rd = gguf.GGUFReader(str(g))

            def kv(key):
                f = rd.fields[key]
                v = f.parts[f.data[0]]
                return bytes(v).decode() if f.types[0] == gguf.GGUFValueType.STRING else v[0].item()
            assert kv("llama.rope.scaling.type") == method and kv("llama.context_length") == 256
            factor, orig = kv("llama.rope.scaling.factor"), kv("llama.rope.scaling.original_context_length")
            assert factor == 2.0 and orig == 128
            rs = {"rope_type": method, "factor": factor, "rope_theta": cfg["rope_theta"]}
            over = {}
            if method == "yarn":
                rs["attention_factor"] = kv("llama.rope.scaling.attn_factor") * (0.1 * np.log(factor) + 1)
                rs["original_max_position_embeddings"] = orig
                over["max_position_embeddings"] = orig  # transformers 4.4x reads the range from it
            mg = AutoModelForCausalLM.from_pretrained(str(w), gguf_file=g.name, torch_dtype=torch.float32,
                                                      rope_scaling=rs, **over).eval()
            if json.loads((st / "config.json").read_text()).get("tie_word_embeddings"):
                mg.lm_head.weight = mg.model.embed_tokens.weight
            d = float((logits(mg) - ours).abs().max())
            res[f"{method}_gguf_logits_maxdiff"] = d
            assert d <= 1e-4 * max(1.0, amax), (method, d)
        # 3. the LoRA GGUF records the same keys
        lg = w / "lora.gguf"
        export(tiny, adapter, "gguf-lora", lg, "f32")
        rd = gguf.GGUFReader(str(lg))
        f = rd.fields["llama.rope.scaling.type"]
        assert bytes(f.parts[f.data[0]]).decode() == method
    return res


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--base-hf")
    ap.add_argument("--adapter")
    ap.add_argument("--base-model", help="what `trainer export --model` gets (default: --base-hf)")
    ap.add_argument("--work", help="scratch directory (default: a new temp dir)")
    ap.add_argument("--demo", action="store_true")
    ap.add_argument("--hf-dir", action="store_true",
                    help="check the merged directory with AutoTokenizer / pipeline (check_hf_dir)")
    ap.add_argument("--record", help="also write the results (JSON) to this file")
    ap.add_argument("--context-extension", action="store_true",
                    help="check exports of extended models (check_context_extension)")
    ap.add_argument("--steps", type=int, default=30)
    a = ap.parse_args()
    work = Path(a.work or tempfile.mkdtemp(prefix="bt-check-exports-"))
    work.mkdir(parents=True, exist_ok=True)
    if a.hf_dir:
        results = check_hf_dir(work)
    elif a.context_extension:
        results = check_context_extension(work)
    elif a.demo:
        tiny, adapter = make_trained_adapter(work, a.steps)
        base_hf = gguf_to_hf(tiny, work / "base-hf")
        results = {"with_gguf_base": check_peft_adapter(base_hf, adapter, tiny, work / "from-gguf"),
                   "with_hf_base": check_peft_adapter(base_hf, adapter, base_hf, work / "from-hf")}
    else:
        if not (a.base_hf and a.adapter):
            ap.error("--base-hf and --adapter are required (or --demo)")
        results = check_peft_adapter(a.base_hf, a.adapter, a.base_model, work)
    print(json.dumps(results, indent=2))
    if a.record:
        import tokenizers
        import torch
        import transformers
        results = {"generator": "tests/reference/check_exports.py " + " ".join(sys.argv[1:]),
                   "versions": {"torch": torch.__version__, "transformers": transformers.__version__,
                                "tokenizers": tokenizers.__version__}, "results": results}
        Path(a.record).write_text(json.dumps(results, indent=2, ensure_ascii=False) + "\n")
    if not a.work:
        shutil.rmtree(work, ignore_errors=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
