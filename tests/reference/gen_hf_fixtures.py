#!/usr/bin/env python3
"""Hugging Face reference fixtures for the C model / LoRA / loss / optimiser / loader tests.

Uses the REAL reference libraries (transformers, peft, torch, bitsandbytes, gguf, safetensors;
pinned in tests/reference/requirements-hf.txt) on the CPU in fp32 and writes small fixtures under
tests/fixtures/hf/ that the C tests read with common/safetensors.h (they never need torch).
See tests/reference/README.md for every file, key, layout and tolerance.

Usage (from the repo root; `make fixtures` runs it):
    python3 tests/reference/gen_hf_fixtures.py [--out tests/fixtures/hf]
            [--gguf models/SmolLM2-135M-Instruct.Q4_1.gguf] [--only tiny,lora,smollm2,nf4]
The script creates .venv-hf/ (gitignored), installs the pins there (only when the requirements file
changed) and re-executes itself inside it. `--no-venv` runs in the current interpreter instead.

Deterministic: fixed seeds, fp32, CPU only, 1 thread, torch.use_deterministic_algorithms(True).
"""
import hashlib
import os
import subprocess
import sys
from pathlib import Path

HERE = Path(__file__).resolve().parent
REPO = HERE.parents[1]
VENV = REPO / ".venv-hf"
REQS = HERE / "requirements-hf.txt"


def bootstrap():
    """Create/refresh .venv-hf with the pins and re-exec this script inside it."""
    if os.environ.get("BT_HF_IN_VENV") == "1":
        return
    if "--no-venv" in sys.argv:
        if os.environ.get("PYTHONHASHSEED") != "0":  # set order (e.g. PEFT target_modules)
            env = dict(os.environ, PYTHONHASHSEED="0", BT_HF_IN_VENV="1")
            os.execve(sys.executable, [sys.executable, str(Path(__file__).resolve())] + sys.argv[1:],
                      env)
        return
    py = VENV / "bin" / "python"
    if not py.exists():
        print(f"[gen_hf] creating {VENV}", flush=True)
        subprocess.check_call([sys.executable, "-m", "venv", str(VENV)])
    want = hashlib.sha256(REQS.read_bytes()).hexdigest()
    stamp = VENV / ".bt-requirements.sha256"
    if not stamp.exists() or stamp.read_text().strip() != want:
        print(f"[gen_hf] installing {REQS.name} into {VENV} (PyPI; torch pulls ~3 GB of CUDA wheels)",
              flush=True)
        subprocess.check_call([str(py), "-m", "pip", "install", "-q", "--disable-pip-version-check",
                               "-r", str(REQS)])
        stamp.write_text(want + "\n")
    env = dict(os.environ, BT_HF_IN_VENV="1", PYTHONHASHSEED="0")
    os.execve(str(py), [str(py), str(Path(__file__).resolve())] + sys.argv[1:], env)


bootstrap()

# ---------------------------------------------------------------- inside the venv from here on
os.environ.setdefault("CUDA_VISIBLE_DEVICES", "")
os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TRANSFORMERS_OFFLINE", "1")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
os.environ.setdefault("OMP_NUM_THREADS", "1")
os.environ.setdefault("CUBLAS_WORKSPACE_CONFIG", ":4096:8")

import argparse  # noqa: E402
import json  # noqa: E402
import math  # noqa: E402
import shutil  # noqa: E402
import time  # noqa: E402
import warnings  # noqa: E402

import numpy as np  # noqa: E402
import torch  # noqa: E402
from safetensors.torch import save_file, safe_open  # noqa: E402

warnings.filterwarnings("ignore")
torch.set_num_threads(1)
torch.use_deterministic_algorithms(True)
torch.set_default_dtype(torch.float32)

import transformers  # noqa: E402
from transformers import LlamaConfig, LlamaForCausalLM  # noqa: E402

transformers.logging.set_verbosity_error()
transformers.logging.disable_progress_bar()

# ---------------------------------------------------------------- constants of the fixtures
TINY = dict(vocab_size=384, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
            num_attention_heads=4, num_key_value_heads=2, rope_theta=10000.0, rms_norm_eps=1e-5,
            max_position_embeddings=256, hidden_act="silu", attention_bias=False, mlp_bias=False,
            initializer_range=0.02, pad_token_id=0, bos_token_id=1, eos_token_id=2)
B, T = 2, 32
# documents per row (lengths); "pad" marks a trailing padding segment (own segment, labels -100)
ROWS = [[("doc", 10), ("doc", 14), ("doc", 8)],
        [("doc", 17), ("doc", 11), ("pad", 4)]]
PROMPT_MASK = {(0, 1): 3, (1, 0): 5}  # (row, doc index) -> number of leading prompt tokens (-100)
PAD_ID = 0
LORA_TARGETS = ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]
LORA_R, LORA_ALPHA = 4, 8
ADAMW = dict(lr=1e-3, betas=(0.9, 0.999), eps=1e-8, weight_decay=0.01)
SMOL_PROMPTS = [
    [{"role": "user", "content": "What is the capital of France?"}],
    [{"role": "system", "content": "You are a concise assistant."},
     {"role": "user", "content": "Write a haiku about the sea."}],
    [{"role": "user", "content": "Hi!"},
     {"role": "assistant", "content": "Hello! How can I help you today?"},
     {"role": "user", "content": "Count from 1 to 5."}],
]
SMOL_NEW_TOKENS = 32
SMOL_TOPK = 8


def log(msg):
    print(f"[gen_hf] {msg}", flush=True)


def f32(x):
    """Python float of a float32 value (exact in JSON)."""
    return float(np.float32(x))


def save_st(path, tensors, meta=None):
    """safetensors with contiguous CPU tensors; metadata values must be str."""
    out = {k: v.detach().to("cpu").contiguous() for k, v in tensors.items()}
    save_file(out, str(path), metadata={"format": "pt", **(meta or {})})


# ---------------------------------------------------------------- 1. tiny Llama
def init_tiny_params(model, gen, untied_head):
    """Overwrite every parameter with seeded values of useful size (HF's 0.02-std init makes the
    logits ~0 and the test blind). Linear W ~ N(0, 1/in); embeddings ~ N(0, 0.25^2); RMSNorm
    weights ~ 1 + N(0, 0.1^2); untied lm_head ~ N(0, 0.25^2)."""
    with torch.no_grad():
        for name, p in model.named_parameters():
            if name == "lm_head.weight":
                continue  # tied: same tensor as the embedding; untied: below
            if "embed_tokens" in name:
                p.copy_(torch.randn(p.shape, generator=gen) * 0.25)
            elif "norm" in name:
                p.copy_(1.0 + 0.1 * torch.randn(p.shape, generator=gen))
            else:
                p.copy_(torch.randn(p.shape, generator=gen) / math.sqrt(p.shape[1]))
        if untied_head:
            model.lm_head.weight.copy_(torch.randn(model.lm_head.weight.shape, generator=gen) * 0.25)


def make_tiny(out_dir, tied):
    cfg = LlamaConfig(**TINY, tie_word_embeddings=tied, torch_dtype="float32")
    torch.manual_seed(1234)
    model = LlamaForCausalLM(cfg).float().eval()
    gen = torch.Generator().manual_seed(20240601)
    init_tiny_params(model, gen, untied_head=not tied)
    if tied:
        assert model.lm_head.weight.data_ptr() == model.model.embed_tokens.weight.data_ptr()
    d = out_dir / ("tiny-llama-tied" if tied else "tiny-llama-untied")
    if d.exists():
        shutil.rmtree(d)
    model.save_pretrained(d, safe_serialization=True, max_shard_size="150KB")
    assert (d / "model.safetensors.index.json").exists(), "expected a sharded checkpoint"
    return d


def make_packed_batch():
    """input_ids/labels/position_ids [B,T] int, cu_seqlens over the flattened B*T tokens, the
    additive block-diagonal causal mask [B,1,T,T] (0 allowed, finfo.min masked) and doc spans."""
    g = torch.Generator().manual_seed(777)
    ids = torch.randint(3, TINY["vocab_size"], (B, T), generator=g)
    labels = ids.clone()
    pos = torch.zeros(B, T, dtype=torch.long)
    seg = torch.zeros(B, T, dtype=torch.long)
    cu = [0]
    docs = []  # (row, start, end, kind)
    for r, row in enumerate(ROWS):
        assert sum(n for _, n in row) == T
        s = 0
        for di, (kind, n) in enumerate(row):
            e = s + n
            pos[r, s:e] = torch.arange(n)
            seg[r, s:e] = di
            labels[r, s] = -100  # first token of each segment is never a target
            if kind == "pad":
                ids[r, s:e] = PAD_ID
                labels[r, s:e] = -100
            npm = PROMPT_MASK.get((r, di), 0)
            labels[r, s:s + npm] = -100
            docs.append((r, s, e, kind))
            cu.append(r * T + e)
            s = e
    allowed = (seg[:, :, None] == seg[:, None, :]) & torch.tril(torch.ones(T, T, dtype=torch.bool))
    mask = torch.zeros(B, 1, T, T, dtype=torch.float32)
    mask.masked_fill_(~allowed[:, None], torch.finfo(torch.float32).min)
    return dict(input_ids=ids, labels=labels, position_ids=pos,
                cu_seqlens=torch.tensor(cu, dtype=torch.int32), mask=mask, allowed=allowed, docs=docs)


def token_nll(logits, labels):
    """nll[b,t] = CE(logits[b,t], labels[b,t+1]) (HF shift), 0 where the target is -100 or t=T-1."""
    Bn, Tn, V = logits.shape
    nll = torch.zeros(Bn, Tn, dtype=torch.float32)
    tgt = labels[:, 1:]
    ce = torch.nn.functional.cross_entropy(logits[:, :-1].reshape(-1, V), tgt.reshape(-1).clamp_min(0),
                                           reduction="none").view(Bn, Tn - 1)
    nll[:, :-1] = torch.where(tgt != -100, ce, torch.zeros_like(ce))
    return nll, (tgt != -100)


def doc_losses(nll, valid, docs):
    """Mean nll over the labelled targets of each real document (targets at t+1 in [s+1, e)),
    in document order; padding segments are skipped."""
    out = []
    for r, s, e, kind in docs:
        if kind != "doc":
            continue
        v = valid[r, s:e - 1]  # prediction positions s..e-2 predict s+1..e-1
        n = int(v.sum())
        assert n > 0, (r, s, e)
        out.append(float(nll[r, s:e - 1][v].sum() / n))
    return out


def tiny_reference(model_dir, batch, out_dir):
    model = LlamaForCausalLM.from_pretrained(model_dir, torch_dtype=torch.float32,
                                             attn_implementation="eager").eval()
    with torch.no_grad():
        o = model(input_ids=batch["input_ids"], attention_mask=batch["mask"],
                  position_ids=batch["position_ids"], labels=batch["labels"], output_hidden_states=True)
    logits = o.logits.float()
    nll, valid = token_nll(logits, batch["labels"])
    n_lab = int(valid.sum())
    loss_manual = float(nll.sum() / n_lab)
    assert abs(loss_manual - float(o.loss)) < 1e-5, (loss_manual, float(o.loss))
    # sanity: the 4D mask really isolates documents -> equal to running each segment alone
    worst = 0.0
    with torch.no_grad():
        for r, s, e, kind in batch["docs"]:
            lo = model(input_ids=batch["input_ids"][r:r + 1, s:e]).logits[0]
            worst = max(worst, float((lo - logits[r, s:e]).abs().max()))
    assert worst < 1e-4, f"4D mask did not isolate documents (max diff {worst})"
    dl = doc_losses(nll, valid, batch["docs"])
    name = model_dir.name
    hs = torch.stack(o.hidden_states)  # [L+1, B, T, H]
    save_st(out_dir / f"{name}.ref.safetensors", {
        "logits": logits, "loss": torch.tensor([o.loss.item()]),
        "token_nll": nll, "doc_loss": torch.tensor(dl, dtype=torch.float32),
        "hidden_states": hs,
    })
    return dict(loss=f32(o.loss.item()), doc_loss=[f32(x) for x in dl], n_labelled=n_lab,
                per_doc_isolation_max_abs_diff=worst)


# ---------------------------------------------------------------- 3/4. PEFT LoRA
def lora_fixtures(model_dir, batch, out_dir):
    from peft import LoraConfig, get_peft_model, get_peft_model_state_dict

    base = LlamaForCausalLM.from_pretrained(model_dir, torch_dtype=torch.float32,
                                            attn_implementation="eager")
    cfg = LoraConfig(r=LORA_R, lora_alpha=LORA_ALPHA, lora_dropout=0.0, target_modules=LORA_TARGETS,
                     bias="none", task_type="CAUSAL_LM", init_lora_weights=True)
    pm = get_peft_model(base, cfg)
    pm.eval()  # dropout is 0 anyway; eval keeps it deterministic
    pm.peft_config["default"].base_model_name_or_path = "tests/fixtures/hf/" + model_dir.name
    # seeded non-zero init: A ~ U(-1/sqrt(in), 1/sqrt(in)) (kaiming_uniform(a=sqrt(5)) bound),
    # B ~ N(0, 0.2^2) so gradients to A are non-zero and the adapter changes the output
    g = torch.Generator().manual_seed(4242)
    with torch.no_grad():
        for n, p in sorted(pm.named_parameters()):
            if "lora_A" in n:
                bound = 1.0 / math.sqrt(p.shape[1])
                p.copy_((torch.rand(p.shape, generator=g) * 2 - 1) * bound)
            elif "lora_B" in n:
                p.copy_(torch.randn(p.shape, generator=g) * 0.2)
    d = out_dir / "lora"
    if d.exists():
        shutil.rmtree(d)
    d.mkdir(parents=True)
    pm.save_pretrained(d / "adapter-init")
    (d / "adapter-init" / "README.md").unlink(missing_ok=True)  # PEFT's model-card boilerplate

    # map live parameter names -> PEFT state-dict keys (".default" stripped)
    trainable = [(n, p) for n, p in pm.named_parameters() if p.requires_grad]
    key = {n: n.replace(".default", "") for n, _ in trainable}
    sd_keys = set(get_peft_model_state_dict(pm).keys())
    assert set(key.values()) == sd_keys, (sorted(set(key.values()) ^ sd_keys))[:4]
    assert len(trainable) == 2 * 7 * TINY["num_hidden_layers"]
    init = {key[n]: p.detach().clone() for n, p in trainable}

    kw = dict(input_ids=batch["input_ids"], attention_mask=batch["mask"],
              position_ids=batch["position_ids"])
    # full batch: HF mean over labelled targets
    pm.zero_grad(set_to_none=True)
    o = pm(**kw, labels=batch["labels"])
    o.loss.backward()
    full_loss = o.loss.item()
    grads = {key[n]: p.grad.detach().clone() for n, p in trainable}
    assert all(float(v.abs().max()) > 0 for v in grads.values()), "a LoRA gradient is all zero"
    logits = o.logits.detach().float()
    nll, valid = token_nll(logits, batch["labels"])
    dl = doc_losses(nll, valid, batch["docs"])

    # one AdamW step on the LoRA parameters only
    opt = torch.optim.AdamW([p for _, p in trainable], foreach=False, **ADAMW)
    opt.step()
    after = {key[n]: p.detach().clone() for n, p in trainable}
    st = {}
    for n, p in trainable:
        s = opt.state[p]
        st["exp_avg." + key[n]] = s["exp_avg"].clone()
        st["exp_avg_sq." + key[n]] = s["exp_avg_sq"].clone()
    # check our documented formula reproduces torch's AdamW (step 1)
    lr, (b1, b2), eps, wd = ADAMW["lr"], ADAMW["betas"], ADAMW["eps"], ADAMW["weight_decay"]
    worst_adam = 0.0
    for k in init:
        gk = grads[k].double()
        m = (1 - b1) * gk
        v = (1 - b2) * gk * gk
        p1 = init[k].double() * (1 - lr * wd) - (lr / (1 - b1)) * m / (v.sqrt() / math.sqrt(1 - b2) + eps)
        worst_adam = max(worst_adam, float((p1 - after[k].double()).abs().max()))
    assert worst_adam < 1e-6, worst_adam

    save_st(d / "lora_ref.safetensors", {"loss": torch.tensor([full_loss]), "logits": logits,
                                         "token_nll": nll, "doc_loss": torch.tensor(dl)})
    save_st(d / "lora_grads.safetensors", grads)
    save_st(d / "lora_after_adamw.safetensors", after)
    save_st(d / "lora_adamw_state.safetensors", st)

    # 4. gradient accumulation: micro-batch k = row k; sum of CE over its labelled targets,
    # normalised by the labelled-target count of the WHOLE batch (HF num_items_in_batch)
    pm.zero_grad(set_to_none=True)
    for n, p in trainable:
        p.data.copy_(init[key[n]])
    n_tot = int((batch["labels"][:, 1:] != -100).sum())
    mb_counts, mb_losses, mb_grads = [], [], []
    for r in range(B):
        lab = batch["labels"][r:r + 1]
        cnt = int((lab[:, 1:] != -100).sum())
        mb_counts.append(cnt)
        o = pm(input_ids=batch["input_ids"][r:r + 1], attention_mask=batch["mask"][r:r + 1],
               position_ids=batch["position_ids"][r:r + 1], labels=lab, num_items_in_batch=n_tot)
        before = {key[n]: (p.grad.detach().clone() if p.grad is not None else torch.zeros_like(p))
                  for n, p in trainable}
        o.loss.backward()
        mb_losses.append(o.loss.item())
        mb_grads.append({k: (p.grad.detach() - before[key[n]]).clone()
                         for n, p in trainable for k in [key[n]]})
    acc = {key[n]: p.grad.detach().clone() for n, p in trainable}
    worst_acc = max(float(((acc[k] - grads[k]).abs() / (grads[k].abs().max() + 1e-30)).max())
                    for k in grads)
    assert worst_acc < 1e-5, worst_acc
    assert abs(sum(mb_losses) - full_loss) < 1e-5
    ga = {"mb_labelled_tokens": torch.tensor(mb_counts, dtype=torch.int32),
          "total_labelled_tokens": torch.tensor([n_tot], dtype=torch.int32),
          "mb_loss": torch.tensor(mb_losses, dtype=torch.float32),
          "full_loss": torch.tensor([full_loss])}
    for i, gd in enumerate(mb_grads):
        for k, v in gd.items():
            ga[f"mb{i}.{k}"] = v
    for k, v in grads.items():
        ga[f"full.{k}"] = v
    save_st(d / "grad_accum.safetensors", ga)
    naive = sum(mb_losses[i] * n_tot / mb_counts[i] for i in range(B)) / B
    return dict(loss=f32(full_loss), doc_loss=[f32(x) for x in dl], n_labelled=n_tot,
                n_lora_tensors=len(grads), adamw_formula_max_abs_diff=worst_adam,
                grad_accum=dict(mb_labelled_tokens=mb_counts, total_labelled_tokens=n_tot,
                                mb_loss=[f32(x) for x in mb_losses],
                                naive_mean_of_means_loss=f32(naive),
                                accumulated_vs_full_max_rel_diff=worst_acc))


# ---------------------------------------------------------------- 5. SmolLM2 from GGUF
def smollm2_fixtures(gguf_path, out_dir):
    from transformers import AutoModelForCausalLM, AutoTokenizer

    gdir, gfile = str(gguf_path.parent), gguf_path.name
    tok = AutoTokenizer.from_pretrained(gdir, gguf_file=gfile)
    assert tok.chat_template, "GGUF carries no chat template"
    # transformers 4.46 reads tie_word_embeddings=False from a GGUF that has no output.weight and
    # would leave lm_head RANDOM; SmolLM2 ties it to token_embd, so force the tie.
    model = AutoModelForCausalLM.from_pretrained(gdir, gguf_file=gfile, torch_dtype=torch.float32,
                                                 attn_implementation="eager",
                                                 tie_word_embeddings=True).eval()
    assert model.lm_head.weight.data_ptr() == model.model.embed_tokens.weight.data_ptr()
    d = out_dir / "smollm2"
    if d.exists():
        shutil.rmtree(d)
    d.mkdir(parents=True)
    sd = model.state_dict()
    save_st(d / "layer0_qk.safetensors", {
        "model.layers.0.self_attn.q_proj.weight": sd["model.layers.0.self_attn.q_proj.weight"],
        "model.layers.0.self_attn.k_proj.weight": sd["model.layers.0.self_attn.k_proj.weight"],
        "model.norm.weight": sd["model.norm.weight"],
        "model.embed_tokens.weight.rows_0_4": sd["model.embed_tokens.weight"][:4],
    })
    tensors, meta = {}, []
    # transformers 4.46's GGUF GPT2 converter sets eos_token = tokens[bos_token_id] (a bug): take the
    # ids from the GGUF metadata instead (SmolLM2: bos 1 <|im_start|>, eos 2 <|im_end|>).
    import gguf
    rd = gguf.GGUFReader(str(gguf_path))
    eos = int(rd.fields["tokenizer.ggml.eos_token_id"].contents())
    bos = int(rd.fields["tokenizer.ggml.bos_token_id"].contents())
    # cross-check HF's GGUF tokenizer against the exact SmolLM2 tokenizer.json configuration that
    # tests/reference/gen_tokenizer_fixtures.py builds from the same GGUF metadata
    sys.path.insert(0, str(HERE))
    from gen_tokenizer_fixtures import build_tokenizers
    ref_tok = build_tokenizers(str(gguf_path))[0]
    model.generation_config.eos_token_id = None  # always exactly SMOL_NEW_TOKENS new tokens
    for i, msgs in enumerate(SMOL_PROMPTS):
        text = tok.apply_chat_template(msgs, tokenize=False, add_generation_prompt=True)
        ids = tok(text, add_special_tokens=False, return_tensors="pt").input_ids
        ref_ids = ref_tok.encode(text, add_special_tokens=False).ids
        assert ids[0].tolist() == ref_ids, (text, ids[0].tolist(), ref_ids)
        with torch.no_grad():
            gen = model.generate(ids, attention_mask=torch.ones_like(ids), do_sample=False,
                                 max_new_tokens=SMOL_NEW_TOKENS, min_new_tokens=None,
                                 pad_token_id=eos, eos_token_id=None,
                                 num_beams=1, repetition_penalty=1.0, temperature=None, top_p=None,
                                 top_k=None)
            full = gen[0]
            logits = model(full[None]).logits[0].float()
        P = ids.shape[1]
        new = full[P:]
        top_v, top_i = torch.topk(logits, SMOL_TOPK, dim=-1)
        lse = torch.logsumexp(logits, dim=-1)
        # greedy tokens must be the argmax of the full-sequence forward except at near-ties
        am = top_i[P - 1:P - 1 + len(new), 0]
        margin = (top_v[P - 1:P - 1 + len(new), 0] - top_v[P - 1:P - 1 + len(new), 1])
        bad = [(j, float(margin[j])) for j in range(len(new)) if int(am[j]) != int(new[j])]
        assert all(m < 1e-3 for _, m in bad), bad
        tensors[f"p{i}.ids"] = full.to(torch.int32)
        tensors[f"p{i}.top8_ids"] = top_i.to(torch.int32)
        tensors[f"p{i}.top8_logits"] = top_v
        tensors[f"p{i}.logsumexp"] = lse
        tensors[f"p{i}.greedy_margin"] = margin
        assert len(new) == SMOL_NEW_TOKENS
        first_eos = [j for j in range(len(new)) if int(new[j]) == eos]
        meta.append(dict(messages=msgs, rendered=text, prompt_len=P, n_new=int(len(new)),
                         first_eos_in_new=(first_eos[0] if first_eos else None),
                         continuation=tok.decode(new, skip_special_tokens=False),
                         min_greedy_margin=f32(margin.min()) if len(new) else None))
        log(f"smollm2 p{i}: {P} prompt + {len(new)} new tokens: {meta[-1]['continuation']!r}")
    save_st(d / "smollm2_ref.safetensors", tensors)
    (d / "prompts.json").write_text(json.dumps(dict(
        gguf=str(gguf_path.relative_to(REPO)) if gguf_path.is_relative_to(REPO) else str(gguf_path),
        gguf_sha256=sha256_file(gguf_path), eos_token_id=eos, bos_token_id=bos,
        chat_template=tok.chat_template, prompts=meta), indent=1, ensure_ascii=False) + "\n")
    return dict(prompts=[dict(prompt_len=m["prompt_len"], n_new=m["n_new"]) for m in meta])


def sha256_file(p):
    h = hashlib.sha256()
    with open(p, "rb") as f:
        for chunk in iter(lambda: f.read(1 << 20), b""):
            h.update(chunk)
    return h.hexdigest()


# ---------------------------------------------------------------- 6. bitsandbytes NF4 + DQ
def nf4_fixtures(tiny_dir, out_dir):
    import bitsandbytes
    import bitsandbytes.functional as BF

    g = torch.Generator().manual_seed(99)
    idx = json.loads((tiny_dir / "model.safetensors.index.json").read_text())
    k_real = "model.layers.1.mlp.gate_proj.weight"
    with safe_open(str(tiny_dir / idx["weight_map"][k_real]), "pt") as f:
        w_real = f.get_tensor(k_real)
    cases = {"rand_64x128": torch.randn(64, 128, generator=g),
             "rand_96x576": torch.randn(96, 576, generator=g),
             "tiny_gate_proj_l1": w_real}
    fresh_code8 = BF.create_dynamic_map(signed=True).float()
    d = out_dir / "nf4"
    if d.exists():
        shutil.rmtree(d)
    d.mkdir(parents=True)
    tensors, info = {}, {}
    for name, w in cases.items():
        w = w.float().contiguous()
        q, qs = BF.quantize_4bit(w, blocksize=64, quant_type="nf4", compress_statistics=True,
                                 quant_storage=torch.uint8)
        # bnb's CPU C++ quantize_blockwise writes code[0] = -1.0 into the cached dynamic map; real
        # (CUDA-made) checkpoints carry the untouched map (code[0] = -0.99296875). Use that one.
        qs.state2.code = fresh_code8.clone()
        deq = BF.dequantize_4bit(q, qs, quant_type="nf4").float()
        # independent check of the documented formula
        nf4 = qs.code.float()
        am = fresh_code8[qs.absmax.long()] * qs.state2.absmax.repeat_interleave(256)[:qs.absmax.numel()] \
            + qs.offset
        qb = q.view(-1)
        nib = torch.stack([(qb >> 4) & 15, qb & 15], dim=1).view(-1).long()
        mine = (nf4[nib] * am.repeat_interleave(64)[:nib.numel()]).view(w.shape)
        diff = float((mine - deq).abs().max())
        assert diff <= 1e-6 * float(deq.abs().max()), (name, diff)
        for k, v in qs.as_dict(packed=True).items():
            tensors[f"{name}.weight.{k}"] = v
        tensors[f"{name}.weight"] = q
        tensors[f"{name}.input"] = w
        tensors[f"{name}.dequant"] = deq
        tensors[f"{name}.offset"] = torch.tensor([float(qs.offset)], dtype=torch.float32)
        info[name] = dict(shape=list(w.shape), nblocks=int(qs.absmax.numel()),
                          nnested=int(qs.state2.absmax.numel()), offset=f32(qs.offset),
                          absmax_code0_used=bool((qs.absmax == 0).any()),
                          max_abs_err_vs_input=f32((deq - w).abs().max()))
    save_st(d / "nf4_dq.safetensors", tensors)
    return dict(bitsandbytes=bitsandbytes.__version__, cases=info)


# ---------------------------------------------------------------- manifest
def describe_safetensors(path):
    with open(path, "rb") as f:
        n = int.from_bytes(f.read(8), "little")
        hdr = json.loads(f.read(n))
    hdr.pop("__metadata__", None)
    return [dict(name=k, dtype=v["dtype"], shape=v["shape"], offset=8 + n + v["data_offsets"][0],
                 nbytes=v["data_offsets"][1] - v["data_offsets"][0]) for k, v in sorted(hdr.items())]


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--out", default=str(REPO / "tests" / "fixtures" / "hf"))
    ap.add_argument("--gguf", default=str(REPO / "models" / "SmolLM2-135M-Instruct.Q4_1.gguf"))
    ap.add_argument("--only", default="tiny,lora,smollm2,nf4")
    ap.add_argument("--no-venv", action="store_true")
    a = ap.parse_args()
    parts = set(a.only.split(","))
    out = Path(a.out).resolve()
    out.mkdir(parents=True, exist_ok=True)
    man_path = out / "manifest.json"
    man = json.loads(man_path.read_text()) if man_path.exists() else {}
    man["generator"] = "tests/reference/gen_hf_fixtures.py"
    from importlib.metadata import version
    man["versions"] = {m: version(m) for m in ["torch", "transformers", "peft", "safetensors", "gguf",
                                               "numpy", "tokenizers", "bitsandbytes", "accelerate"]}
    t0 = time.time()

    batch = make_packed_batch()
    tied_dir = out / "tiny-llama-tied"
    if "tiny" in parts:
        save_st(out / "packed_batch.safetensors", {
            "input_ids": batch["input_ids"].to(torch.int32), "labels": batch["labels"].to(torch.int32),
            "position_ids": batch["position_ids"].to(torch.int32), "cu_seqlens": batch["cu_seqlens"],
            "attn_allowed": batch["allowed"].to(torch.uint8)})
        res = {}
        for tied in (True, False):
            dd = make_tiny(out, tied)
            res[dd.name] = tiny_reference(dd, batch, out)
            log(f"{dd.name}: loss {res[dd.name]['loss']:.6f} ({time.time() - t0:.1f}s)")
        man["tiny"] = dict(config=TINY, rows=ROWS, prompt_mask={f"{k[0]},{k[1]}": v for k, v in
                                                               PROMPT_MASK.items()},
                           docs=[dict(row=r, start=s, end=e, kind=k) for r, s, e, k in batch["docs"]],
                           results=res)
    if "lora" in parts:
        man["lora"] = dict(r=LORA_R, lora_alpha=LORA_ALPHA, scale=LORA_ALPHA / LORA_R,
                           targets=LORA_TARGETS, adamw=dict(ADAMW, betas=list(ADAMW["betas"])),
                           results=lora_fixtures(tied_dir, batch, out))
        log(f"lora: loss {man['lora']['results']['loss']:.6f} ({time.time() - t0:.1f}s)")
    if "smollm2" in parts:
        gp = Path(a.gguf).resolve()
        if gp.exists():
            man["smollm2"] = smollm2_fixtures(gp, out)
            log(f"smollm2 done ({time.time() - t0:.1f}s)")
        else:
            log(f"WARNING: {gp} missing: SmolLM2 fixtures left as they are")
    if "nf4" in parts:
        man["nf4"] = nf4_fixtures(tied_dir, out)
        log(f"nf4 done ({time.time() - t0:.1f}s)")

    files = {}
    for p in sorted(out.rglob("*.safetensors")):
        files[str(p.relative_to(out))] = describe_safetensors(p)
    man["files"] = files
    man_path.write_text(json.dumps(man, indent=1, ensure_ascii=False) + "\n")
    total = sum(p.stat().st_size for p in out.rglob("*") if p.is_file())
    log(f"wrote {out} ({total / 1e6:.2f} MB) in {time.time() - t0:.1f}s")


if __name__ == "__main__":
    main()
