"""The shared stages of the tiny-model family fixture generators (gen_qwen_fixtures.py,
gen_phi3_fixtures.py, gen_gemma3_fixtures.py): what every family's fixture holds the same way.

- The vocabulary: a 260-token byte-level BPE (the 256 GPT-2 byte symbols with id = byte, three
  merges, an end-of-text control token), so the trainer's `generate` can run on the GGUFs; the
  GGUF tokenizer keys for it (gguf_add_vocab).
- The packed batch (make_batch): B = 2 rows of T = 24 tokens, row 0 two documents (10 + 14), row 1
  one of 24, position_ids restarting per document, the first N_PROMPT = 3 labels of row 0 masked
  with -100; the loss (hf_loss): mean cross-entropy over the labelled targets, labels shifted
  within each document.
- The reference run (reference): each cu_seqlens document alone through the model (so it does not
  depend on how a transformers version masks packed rows), logits concatenated; greedy tokens of
  PROMPT; a PEFT LoRA with a seeded non-zero init saved as adapter-init/; logits, loss and the
  gradient of every LoRA tensor under its PEFT key into ref.safetensors.
- GGUF tensors (gguf_add_tensors): names from gguf-py's TensorNameMap, 2-D weights BF16, 1-D F32.

Import it after venv_torch.reexec_in_venv_torch (it imports torch). Deterministic: fixed seeds,
fp32, CPU, 1 thread, torch.use_deterministic_algorithms(True); the generators that use it are
byte-identical on a rerun (tests/reference/README.md).
"""
import json
import math
import re
import warnings

import gguf
import numpy as np
import peft
import torch
import transformers
from peft import LoraConfig, get_peft_model, get_peft_model_state_dict
from safetensors.torch import save_file

warnings.filterwarnings("ignore")
torch.set_num_threads(1)
torch.use_deterministic_algorithms(True)
transformers.logging.set_verbosity_error()

GGUF_VERSION = "0.19.0"  # python/requirements-torch.txt's pin (gguf-py has no __version__)

# a byte-level BPE vocabulary for `trainer generate` on the GGUFs: the 256 GPT-2 byte symbols
# (id = byte), three merges and an end-of-text control token
MERGES = ["Ġ t", "h e", "Ġt he"]
EOT = "<|endoftext|>"
PROMPT = "hello the cat"
GEN_TOKENS = 8


def bytes_to_unicode():
    """GPT-2's byte -> printable symbol map (openai/gpt-2 encoder.py), as byte-level BPE uses."""
    bs = list(range(ord("!"), ord("~") + 1)) + list(range(ord("¡"), ord("¬") + 1)) + \
        list(range(ord("®"), ord("ÿ") + 1))
    cs = bs[:]
    n = 0
    for b in range(256):
        if b not in bs:
            bs.append(b)
            cs.append(256 + n)
            n += 1
    return dict(zip(bs, map(chr, cs)))


BU = bytes_to_unicode()
TOKENS = [BU[b] for b in range(256)] + [m.replace(" ", "") for m in MERGES] + [EOT]

B, T = 2, 24
DOCS = [[10, 14], [24]]
N_PROMPT = 3  # leading tokens of row 0's first document masked with -100
LORA_R, LORA_ALPHA = 4, 8


def make_batch():
    """The packed batch: input_ids / labels / position_ids [B, T] int64, cu_seqlens [4] int32."""
    g = torch.Generator().manual_seed(7)
    ids = torch.randint(3, len(TOKENS) - 1, (B, T), generator=g, dtype=torch.int64)
    pos = torch.zeros(B, T, dtype=torch.int64)
    cu = [0]
    for r, docs in enumerate(DOCS):
        s = 0
        for n in docs:
            pos[r, s:s + n] = torch.arange(n)
            s += n
            cu.append(r * T + s)
    labels = ids.clone()
    labels[0, :N_PROMPT] = -100
    return dict(input_ids=ids, labels=labels, position_ids=pos,
                cu_seqlens=torch.tensor(cu, dtype=torch.int32))


def save_batch(batch, path):
    """batch.safetensors: every batch tensor as int32."""
    save_file({k: v.to(torch.int32).contiguous() for k, v in batch.items()}, str(path))


def hf_loss(logits, labels, cu):
    """Mean CE over labelled targets, labels shifted within each document (what the trainer's
    bt_shift_targets does and what HF computes for one document per row)."""
    flat_l = logits.reshape(-1, logits.shape[-1])
    lab = labels.reshape(-1)
    tgt = torch.full_like(lab, -100)
    for a, b in zip(cu[:-1], cu[1:]):
        tgt[a:b - 1] = lab[a + 1:b]
    return torch.nn.functional.cross_entropy(flat_l, tgt, ignore_index=-100, reduction="mean")


def encode(text):
    """Byte-level BPE of TOKENS / MERGES on the words of `text` (enough for PROMPT: ' ?word')."""
    ids = []
    for piece in re.findall(r" ?[a-z]+", text):
        sym = [BU[b] for b in piece.encode()]
        while True:
            pairs = [(MERGES.index(f"{a} {b}"), i) for i, (a, b) in enumerate(zip(sym, sym[1:]))
                     if f"{a} {b}" in MERGES]
            if not pairs:
                break
            _, i = min(pairs)
            sym[i:i + 2] = [sym[i] + sym[i + 1]]
        ids += [TOKENS.index(x) for x in sym]
    return ids


def greedy(model, ids, n):
    """n greedy tokens after ids (full forward each step); the top-1 margin must be clear of
    fp32 noise so that the trainer's greedy choice is the same."""
    ids = list(ids)
    out = []
    with torch.no_grad():
        for _ in range(n):
            z = model(input_ids=torch.tensor([ids])).logits[0, -1].float()
            top = torch.topk(z, 2).values
            assert float(top[0] - top[1]) > 1e-3, "greedy near-tie: pick another PROMPT"
            nxt = int(z.argmax())
            ids.append(nxt)
            out.append(nxt)
    return out


def gguf_add_vocab(w):
    """The tokenizer keys of the byte-level vocabulary (pre-tokeniser "qwen2", one loaderd
    serves), EOS = the end-of-text token, no BOS added."""
    w.add_tokenizer_model("gpt2")
    w.add_tokenizer_pre("qwen2")
    w.add_token_list(TOKENS)
    w.add_token_types([gguf.TokenType.NORMAL] * (len(TOKENS) - 1) + [gguf.TokenType.CONTROL])
    w.add_token_merges(MERGES)
    w.add_eos_token_id(len(TOKENS) - 1)
    w.add_add_bos_token(False)


def gguf_add_tensors(w, model, arch, n_layer, skip=(), transform=None):
    """Every tensor of model.state_dict() but `skip` under its gguf-py TensorNameMap name (as
    convert_hf_to_gguf.py's map_tensor_name); 2-D BF16, others F32; transform(hf_name, array)
    -> array applied first when given. Returns the set of GGUF names written."""
    tmap = gguf.get_tensor_name_map(arch, n_layer)
    names = set()
    for hf_name, t in model.state_dict().items():
        if hf_name in skip:
            continue
        new = tmap.get_name(hf_name, try_suffixes=(".weight", ".bias"))
        assert new is not None, hf_name
        names.add(new)
        a = t.detach().float().numpy()
        if transform is not None:
            a = transform(hf_name, a)
        if a.ndim == 2:
            w.add_tensor(new, gguf.quants.quantize(a, gguf.GGMLQuantizationType.BF16),
                         raw_dtype=gguf.GGMLQuantizationType.BF16)
        else:
            w.add_tensor(new, a.astype(np.float32))
    return names


def gguf_finish(w):
    """Header, key-values and tensors to the file; closes it."""
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()


def packed_logits_fn(batch):
    """f(model) -> logits [B, T, V] fp32: each cu_seqlens document alone, concatenated."""
    cu = batch["cu_seqlens"].tolist()
    flat_ids = batch["input_ids"].reshape(-1)

    def packed_logits(mdl):
        parts = [mdl(input_ids=flat_ids[a:b][None]).logits.float()[0]
                 for a, b in zip(cu[:-1], cu[1:])]
        return torch.cat(parts).reshape(B, T, -1)
    return packed_logits


def reference(model, d, batch, targets, base_name, lora_seed, log, check_base=None,
              check_peft=None):
    """The reference run of `model` (fp32, eval) on `batch` into directory d: logits / loss without
    the adapter, then a PEFT LoRA (r LORA_R, alpha LORA_ALPHA, on `targets`) whose lora_A is
    U(-1, 1) / sqrt(in) and lora_B N(0, 0.2^2) from torch.Generator seed `lora_seed`, saved as
    d/adapter-init (base_model_name_or_path = base_name), logits / loss with it and d loss / d
    each LoRA tensor; writes d/ref.safetensors (logits_base [M, V], loss_base [1], logits [M, V],
    loss [1], grads under their PEFT keys). check_base(packed_logits, base_logits) runs after the
    base logits, check_peft(peft_model) after the adapter is saved; log(text) gets the two losses. Returns the manifest entry
    (config, losses as float32 values, greedy tokens without / with the adapter)."""
    cu = batch["cu_seqlens"].tolist()
    packed_logits = packed_logits_fn(batch)
    with torch.no_grad():
        base_logits = packed_logits(model)
        if check_base is not None:
            check_base(packed_logits, base_logits)
    gen_base = greedy(model, encode(PROMPT), GEN_TOKENS)
    base_loss = hf_loss(base_logits, batch["labels"], cu)

    lcfg = LoraConfig(r=LORA_R, lora_alpha=LORA_ALPHA, lora_dropout=0.0,
                      target_modules=targets, bias="none", task_type="CAUSAL_LM")
    pm = get_peft_model(model, lcfg)
    pm.eval()
    pm.peft_config["default"].base_model_name_or_path = base_name
    g = torch.Generator().manual_seed(lora_seed)
    with torch.no_grad():
        for n, p in sorted(pm.named_parameters()):
            if "lora_A" in n:
                p.copy_((torch.rand(p.shape, generator=g) * 2 - 1) / math.sqrt(p.shape[1]))
            elif "lora_B" in n:
                p.copy_(torch.randn(p.shape, generator=g) * 0.2)
    pm.save_pretrained(d / "adapter-init")
    (d / "adapter-init" / "README.md").unlink(missing_ok=True)
    trainable = [(n, p) for n, p in pm.named_parameters() if p.requires_grad]
    key = {n: n.replace(".default", "") for n, _ in trainable}
    assert set(key.values()) == set(get_peft_model_state_dict(pm).keys())
    assert len(trainable) == 2 * len(targets) * model.config.num_hidden_layers
    if check_peft is not None:
        check_peft(pm)
    with torch.no_grad():
        gen_lora = greedy(pm, encode(PROMPT), GEN_TOKENS)
    out_logits = packed_logits(pm)
    loss = hf_loss(out_logits, batch["labels"], cu)
    loss.backward()
    grads = {key[n]: p.grad.detach().float().contiguous() for n, p in trainable}
    assert all(float(v.abs().max()) > 0 for v in grads.values()), "a LoRA gradient is all zero"
    ref = {"logits_base": base_logits.reshape(B * T, -1).contiguous(),
           "loss_base": base_loss.detach().reshape(1),
           "logits": out_logits.detach().reshape(B * T, -1).contiguous(),
           "loss": loss.detach().reshape(1)}
    ref.update(grads)
    save_file(ref, str(d / "ref.safetensors"))
    log(f"loss base {base_loss.item():.6f}, with LoRA {loss.item():.6f}")
    return dict(config=json.loads((d / "hf" / "config.json").read_text()),
                loss_base=float(np.float32(base_loss.item())), loss=float(np.float32(loss.item())),
                greedy_base=gen_base, greedy_lora=gen_lora)


def manifest(targets):
    """The manifest's shared part: pinned versions, batch layout, LoRA, generate prompt."""
    return {"versions": {"torch": torch.__version__.split("+")[0],
                         "transformers": transformers.__version__, "peft": peft.__version__,
                         "gguf": GGUF_VERSION, "numpy": np.__version__},
            "batch": {"B": B, "T": T, "docs": DOCS, "n_prompt_masked": N_PROMPT},
            "lora": {"r": LORA_R, "alpha": LORA_ALPHA, "targets": targets},
            "generate": {"prompt": PROMPT, "prompt_ids": encode(PROMPT), "new_tokens": GEN_TOKENS,
                         "tokens": TOKENS}}


def write_manifest(man, path):
    path.write_text(json.dumps(man, indent=1, sort_keys=True) + "\n")
