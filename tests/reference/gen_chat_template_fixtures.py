#!/usr/bin/env python3
"""Reference fixtures for the SentencePiece-family chat templates of loaderd (common/chat.c:
"gemma", "llama2", "mistral", "mistral-v3", "phi3"), read by tests/unit/loaderd/test_chat_spm.c.

For every (template, conversation) the fixture holds what transformers' apply_chat_template
gives with the model's own Jinja template:
  text  apply_chat_template(messages, tokenize=False) (transformers 4.46.3, jinja2 3.1.6), i.e.
        the model's template rendered by transformers' own sandboxed Jinja environment;
  ids   that text tokenized as transformers does for tokenize=True (tokenizer(text,
        add_special_tokens=False): special-token strings in the text become their ids):
          tokenizer.json families (Mistral v0.1 / v0.3, tests/fixtures/tokenizer/*-tokenizer.json.zst)
            apply_chat_template(tokenize=True) itself, PreTrainedTokenizerFast over that file;
          GGUF vocabularies (Llama 2, Phi-3, Gemma 3: the files scripts/fetch-tokenizers fetches)
            llama.cpp b4965's llama_tokenize(text, add_special=false, parse_special=true) (the same
            reference the SentencePiece tokenizer parity uses: tests/py/llamacpp_ref.py);
  mask  1 on the tokens the loss is on, computed here from character spans (independently of
        the C code, which counts token lengths): a token is trained iff its source span overlaps
        the text an assistant message put into the rendering (located by rendering again with
        that message's content replaced by a unique marker), plus the first end-of-turn token
        (</s>, <end_of_turn>, <|end|>) after each assistant message;
  error the template's raise_exception message when the template refuses the conversation
        (loaderd must refuse it as a bad line too).
Conversations whose contents hold special-token strings are left out of the bit-exact set:
loaderd tokenizes message contents without special-token parsing (data cannot inject control
tokens), which is where it differs from tokenizer(text) on purpose.

The templates, verbatim (no Hugging Face Hub access from the machine that made the fixtures, so
the Hub revisions are not pinned; each string's sha256 is recorded in the header line):
  gemma       google/gemma-3-*-it tokenizer_config.json chat_template (Gemma 3 instruction-tuned,
              gemma-3-270m-it included); cross-check: llama.cpp b4965
              models/templates/google-gemma-2-2b-it.jinja (Gemma 1/2) renders the system-less
              conversations identically (checked below)
  llama2      meta-llama/Llama-2-7b-chat-hf tokenizer_config.json chat_template
  mistral     Mistral-7B-Instruct-v0.1 / v0.2 tokenizer_config.json 'v1' template (optional system
              message folded into the first user turn), as llama.cpp b4965 tests/
              test-chat-template.cpp quotes it ("mistralai/Mistral-7B-Instruct-v0.2 (mistralai 'v1'
              template with a system prompt)")
  mistral-v3  Mistral-7B-Instruct-v0.3's 'v3' template (system message in the LAST user turn,
              so it is dropped from conversations that end with an assistant turn; tools unused),
              as llama.cpp b4965 tests/test-chat-template.cpp quotes it
  phi3        microsoft/Phi-3.5-mini-instruct tokenizer_config.json chat_template, llama.cpp b4965
              models/templates/microsoft-Phi-3.5-mini-instruct.jinja (Phi-3-mini-4k-instruct's
              differs only in keeping a system message with empty content)

Writes tests/fixtures/chat/spm_chat.jsonl: a header line ({"versions", "templates": {name:
{"source", "sha256", "tokenizer"}}}) then one line per case {"template", "case", "messages",
"text", "ids", "mask"} or {"template", "case", "messages", "error"}.

Usage (repo root; .venv-ref from requirements-tokenizer.txt; make llamacpp-ref;
scripts/fetch-tokenizers; the llama.cpp templates come from llama-cpp-python 0.3.8's sdist,
downloaded sha256-checked, or from an unpacked llama.cpp b4965 tree named by BT_LLAMACPP_DIR):
  .venv-ref/bin/python tests/reference/gen_chat_template_fixtures.py
"""
import hashlib
import json
import os
import subprocess
import sys
import tempfile

HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.abspath(os.path.join(HERE, "..", ".."))
sys.path.insert(0, os.path.join(ROOT, "tests", "py"))
import llamacpp_ref  # noqa: E402

FIX_TOK = os.path.join(ROOT, "tests", "fixtures", "tokenizer")
OUT = os.path.join(ROOT, "tests", "fixtures", "chat", "spm_chat.jsonl")
TOKDIR = os.environ.get("BT_TOKENIZERS_DIR", os.path.join(ROOT, "models", "tokenizers"))
GEMMA = os.environ.get("BT_GEMMA", os.path.join(ROOT, "models", "gemma-3-270m-q4_k_m.gguf"))

GEMMA3 = (
    "{{ bos_token }}\n{%- if messages[0]['role'] == 'system' -%}\n    {%- if messages[0]['content'] is string -%}\n"
    "        {%- set first_user_prefix = messages[0]['content'] + '\\n\\n' -%}\n    {%- else -%}\n"
    "        {%- set first_user_prefix = messages[0]['content'][0]['text'] + '\\n\\n' -%}\n    {%- endif -%}\n"
    "    {%- set loop_messages = messages[1:] -%}\n{%- else -%}\n    {%- set first_user_prefix = \"\" -%}\n"
    "    {%- set loop_messages = messages -%}\n{%- endif -%}\n{%- for message in loop_messages -%}\n"
    "    {%- if (message['role'] == 'user') != (loop.index0 % 2 == 0) -%}\n"
    "        {{ raise_exception(\"Conversation roles must alternate user/assistant/user/assistant/...\") }}\n"
    "    {%- endif -%}\n    {%- if (message['role'] == 'assistant') -%}\n        {%- set role = \"model\" -%}\n"
    "    {%- else -%}\n        {%- set role = message['role'] -%}\n    {%- endif -%}\n"
    "    {{ '<start_of_turn>' + role + '\\n' + (first_user_prefix if loop.first else \"\") }}\n"
    "    {%- if message['content'] is string -%}\n        {{ message['content'] | trim }}\n"
    "    {%- elif message['content'] is iterable -%}\n        {%- for item in message['content'] -%}\n"
    "            {%- if item['type'] == 'image' -%}\n                {{ '<start_of_image>' }}\n"
    "            {%- elif item['type'] == 'text' -%}\n                {{ item['text'] | trim }}\n"
    "            {%- endif -%}\n        {%- endfor -%}\n    {%- else -%}\n"
    "        {{ raise_exception(\"Invalid content type\") }}\n    {%- endif -%}\n    {{ '<end_of_turn>\\n' }}\n"
    "{%- endfor -%}\n{%- if add_generation_prompt -%}\n    {{'<start_of_turn>model\\n'}}\n{%- endif -%}\n")

LLAMA2 = (
    "{% if messages[0]['role'] == 'system' %}{% set loop_messages = messages[1:] %}{% set system_message = "
    "messages[0]['content'] %}{% else %}{% set loop_messages = messages %}{% set system_message = false %}"
    "{% endif %}{% for message in loop_messages %}{% if (message['role'] == 'user') != (loop.index0 % 2 == 0) %}"
    "{{ raise_exception('Conversation roles must alternate user/assistant/user/assistant/...') }}{% endif %}"
    "{% if loop.index0 == 0 and system_message != false %}{% set content = '<<SYS>>\\n' + system_message + "
    "'\\n<</SYS>>\\n\\n' + message['content'] %}{% else %}{% set content = message['content'] %}{% endif %}"
    "{% if message['role'] == 'user' %}{{ bos_token + '[INST] ' + content.strip() + ' [/INST]' }}"
    "{% elif message['role'] == 'assistant' %}{{ ' '  + content.strip() + ' ' + eos_token }}{% endif %}"
    "{% endfor %}")


SDIST_SPEC = "llama-cpp-python==0.3.8"
SDIST_FILE = "llama_cpp_python-0.3.8.tar.gz"
SDIST_SHA = "31c91323b555c025a76a30923cead9f5695da103dd68c15cdbb4509b17f0ed77"  # as scripts/fetch-tokenizers
SDIST_LLAMA = "llama_cpp_python-0.3.8/vendor/llama.cpp/"
_sdist = {}


def sdist_member(member):
    """A file of llama.cpp b4965 as llama-cpp-python 0.3.8's sdist vendors it (pip download,
    sha256-checked, once per run); BT_LLAMACPP_DIR = an unpacked llama.cpp tree instead."""
    d = os.environ.get("BT_LLAMACPP_DIR")
    if d:
        return open(os.path.join(d, member), encoding="utf-8").read()
    if "tar" not in _sdist:
        import tarfile
        tmp = tempfile.mkdtemp(prefix="btsdist.")
        req = os.path.join(tmp, "req.txt")
        open(req, "w").write(f"{SDIST_SPEC} --hash=sha256:{SDIST_SHA}\n")
        subprocess.run([sys.executable, "-m", "pip", "download", "-q", "--no-deps", "--no-binary", ":all:",
                        "--require-hashes", "-r", req, "-d", tmp], check=True)
        _sdist["tar"] = tarfile.open(os.path.join(tmp, SDIST_FILE))
    return _sdist["tar"].extractfile(SDIST_LLAMA + member).read().decode("utf-8")


def llamacpp_test_template(name):
    """A template string from llama.cpp b4965 tests/test-chat-template.cpp (the sdist of
    llama-cpp-python 0.3.8 vendors it), by its test-case name."""
    text = sdist_member("tests/test-chat-template.cpp")
    i = text.index('/* .name= */ "' + name)
    j = text.index('/* .template_str= */ ', i) + len('/* .template_str= */ ')
    # a C string literal: decode its escapes as Python would a JSON string
    assert text[j] == '"'
    k = j + 1
    while text[k] != '"':
        k += 2 if text[k] == "\\" else 1
    return json.loads(text[j:k + 1])


def llamacpp_template_file(name):
    """llama.cpp b4965 models/templates/<name> (the official template files it keeps)."""
    return sdist_member("models/templates/" + name)


# (template name, reference tokenizer, bos, eos, end-of-turn token trained after an assistant turn)
FAMILIES = {
    "gemma": ("gemma3", "<bos>", "<eos>", "<end_of_turn>"),
    "llama2": ("llama-spm", "<s>", "</s>", "</s>"),
    "mistral": ("mistral-v0.1", "<s>", "</s>", "</s>"),
    "mistral-v3": ("mistral-v0.3", "<s>", "</s>", "</s>"),
    "phi3": ("phi-3", "<s>", "<|endoftext|>", "<|end|>"),
}

SYS = {"role": "system", "content": "You are a helpful assistant."}
U = lambda c: {"role": "user", "content": c}  # noqa: E731
A = lambda c: {"role": "assistant", "content": c}  # noqa: E731
CASES = [
    ("single", [U("Hello"), A("Hi there!")]),
    ("system", [SYS, U("What is 2+2?"), A("4.")]),
    ("multi", [U("Who are you?"), A("I am an assistant."), U("Another question"), A("Sure, go ahead.")]),
    ("system-multi", [SYS, U("a"), A("b"), U("c"), A("d"), U("e"), A("f")]),
    ("spaces", [U("   padded user   "), A("   I am an assistant   "), U("\n\nnewlines\n\n"), A("\tTabbed\t\n")]),
    ("unicode", [U("Grüße, 世界! 🚀 𝔘𝔫𝔦𝔠𝔬𝔡𝔢"), A("Ça va — très bien. ☕️ 日本語で答えます。𐍈")]),
    ("unicode-ws", [U("\u3000ideographic space\u3000"), A("\u00a0no-break\u00a0\u2003em\u2003"), U("x"),
                    A("\u2028line sep\u2029")]),
    ("empty-user", [U(""), A("Nothing asked, nothing said.")]),
    ("empty-assistant", [U("Say nothing."), A(""), U("Now say something."), A("Something.")]),
    ("long", [SYS, U("Explain tokenization in detail. " * 6), A("Tokenization splits text into pieces. " * 8)]),
    ("code", [U("Write f(x)."), A("```python\ndef f(x):\n    return x * 2\n```\n")]),
    ("system-ws", [{"role": "system", "content": "  Be terse.  \n"}, U("Hi"), A("Hello.")]),
    ("ends-user", [U("q1"), A("a1"), U("q2")]),
    # U+2581 is SentencePiece's escaped space: literal ones in the text tokenize like spaces
    ("u2581", [U("a\u2581b \u2581\u2581c"), A("\u2581Hello \u2581 world\u2581"), U("x"), A(" \u2581\u2581")]),
    # refused by the templates (raise_exception), or, for phi3, rendered
    ("not-alternating", [U("a"), U("b"), A("c")]),
    ("starts-assistant", [A("I speak first."), U("ok")]),
    ("system-late", [U("a"), A("b"), SYS, U("c"), A("d")]),
]


def sha256s(s):
    return hashlib.sha256(s.encode()).hexdigest()


class GGUFRef:
    """llama.cpp tokenization of a GGUF vocabulary plus a token -> source span alignment."""

    def __init__(self, lc, path):
        import gguf
        self.m = lc.load_model(path, vocab_only=True)
        r = gguf.GGUFReader(path)
        f = r.fields["tokenizer.ggml.tokens"]
        self.pieces = [bytes(f.parts[i]) for i in f.data]
        f = r.fields["tokenizer.ggml.token_type"]
        self.types = [int(f.parts[i][0]) for i in f.data]
        f = r.fields.get("tokenizer.ggml.add_space_prefix")
        self.prefix = True if f is None else bool(f.parts[f.data[0]][0])
        name = bytes(r.fields["general.name"].parts[r.fields["general.name"].data[0]]).decode().lower()
        self.phi3 = "phi-3" in name or "phi3" in name

    def rstrip(self, i):
        """llama.cpp b4965 llama-vocab.cpp: for phi-3 every special token (control, user-defined,
        unknown) gets RSTRIP, and "</s>", except <unk>, <s>, <|endoftext|>."""
        if not self.phi3:
            return False
        p = self.pieces[i]
        if p in (b"<unk>", b"<s>", b"<|endoftext|>"):
            return False
        return self.types[i] in (2, 3, 4) or p == b"</s>"

    def text_bytes(self, i):
        p = self.pieces[i]
        if self.types[i] == 6 and len(p) == 6 and p.startswith(b"<0x"):
            return bytes([int(p[3:5], 16)])
        return p.replace("\u2581".encode(), b" ")

    def encode(self, text):
        b = text.encode()
        ids = self.m.tokenize(b, parse_special=True)
        spans, cur, prev_special, prev_rstrip = [], 0, True, False
        for i in ids:
            p = self.pieces[i]
            if self.types[i] in (2, 3, 4) and b.startswith(p, cur + (self._ws(b, cur) if prev_rstrip else 0)):
                if prev_rstrip:
                    cur += self._ws(b, cur)
                spans.append((cur, cur + len(p)))
                cur += len(p)
                prev_special, prev_rstrip = True, self.rstrip(i)
                continue
            if prev_rstrip:
                cur += self._ws(b, cur)
                prev_rstrip = False
            t = self.text_bytes(i)
            if prev_special and self.prefix:
                assert t.startswith(b" "), (text, ids, i)
                t = t[1:]
            end = self._match(b, cur, t)
            assert end is not None, ("alignment", text, ids, i, cur)
            spans.append((cur, end))
            cur = end
            prev_special = False
        if prev_rstrip:
            cur += self._ws(b, cur)
        assert cur == len(b), ("alignment end", text, cur, len(b))
        return ids, spans

    @staticmethod
    def _match(b, cur, t):
        """End of t matched at b[cur:], a decoded " " standing for " " or a literal U+2581
        (SentencePiece escapes both alike); None if it does not match."""
        for ch in t:
            if cur < len(b) and b[cur] == ch:
                cur += 1
            elif ch == 0x20 and b.startswith("\u2581".encode(), cur):
                cur += 3
            else:
                return None
        return cur

    @staticmethod
    def _ws(b, cur):
        n = 0
        while cur + n < len(b) and b[cur + n] in b" \t\n\v\f\r":
            n += 1
        return n


class HFRef:
    def __init__(self, tj_zst, bos, eos):
        from transformers import PreTrainedTokenizerFast
        js = subprocess.run(["zstd", "-dc", tj_zst], capture_output=True, check=True).stdout
        self.dir = tempfile.mkdtemp(prefix="btchat.")
        p = os.path.join(self.dir, "tokenizer.json")
        open(p, "wb").write(js)
        self.tok = PreTrainedTokenizerFast(tokenizer_file=p, bos_token=bos, eos_token=eos, unk_token="<unk>")

    def encode(self, text):
        enc = self.tok(text, add_special_tokens=False, return_offsets_mapping=True)
        # char offsets -> byte offsets
        cum = [0]
        for ch in text:
            cum.append(cum[-1] + len(ch.encode()))
        return enc["input_ids"], [(cum[a], cum[b]) for a, b in enc["offset_mapping"]]


def render(tok, template, messages):
    return tok.apply_chat_template(messages, chat_template=template, tokenize=False)


def main():
    import jinja2
    import tokenizers
    import transformers
    from transformers import PreTrainedTokenizerFast

    lc = llamacpp_ref.LlamaCpp.from_env()
    templates = {
        "gemma": (GEMMA3, "google/gemma-3-*-it tokenizer_config.json (Gemma 3 instruction-tuned)"),
        "llama2": (LLAMA2, "meta-llama/Llama-2-7b-chat-hf tokenizer_config.json"),
        "mistral": (llamacpp_test_template("mistralai/Mistral-7B-Instruct-v0.2 (mistralai 'v1' template with a system prompt)"),
                    "Mistral-7B-Instruct-v0.1/v0.2 'v1' template, llama.cpp b4965 tests/test-chat-template.cpp"),
        "mistral-v3": (llamacpp_test_template("Mistral-Large-Instruct-2407 (mistralai 'v3' template"),
                       "Mistral-7B-Instruct-v0.3 'v3' template, llama.cpp b4965 tests/test-chat-template.cpp"),
        "phi3": (llamacpp_template_file("microsoft-Phi-3.5-mini-instruct.jinja"),
                 "microsoft/Phi-3.5-mini-instruct, llama.cpp b4965 models/templates/microsoft-Phi-3.5-mini-instruct.jinja"),
    }
    gemma2 = llamacpp_template_file("google-gemma-2-2b-it.jinja")
    refs = {
        "gemma3": lambda: GGUFRef(lc, GEMMA),
        "llama-spm": lambda: GGUFRef(lc, os.path.join(TOKDIR, "ggml-vocab-llama-spm.gguf")),
        "phi-3": lambda: GGUFRef(lc, os.path.join(TOKDIR, "ggml-vocab-phi-3.gguf")),
    }
    header = {"versions": {"transformers": transformers.__version__, "jinja2": jinja2.__version__,
                           "tokenizers": tokenizers.__version__,
                           "llama.cpp": f"b{lc.build_number} ({lc.commit})"},
              "templates": {}}
    lines = []
    for name, (tmpl, source) in templates.items():
        fam, bos, eos, end = FAMILIES[name]
        header["templates"][name] = {"source": source, "sha256": sha256s(tmpl), "tokenizer": fam}
        if fam.startswith("mistral"):
            ref = HFRef(os.path.join(FIX_TOK, f"{fam}-tokenizer.json.zst"), bos, eos)
            tok = ref.tok
        else:
            ref = refs[fam]()
            # the rendering needs only bos_token / eos_token: any tokenizer object carrying them
            tok = PreTrainedTokenizerFast(tokenizer_object=tokenizers.Tokenizer(tokenizers.models.WordLevel(
                {"<unk>": 0}, unk_token="<unk>")), bos_token=bos, eos_token=eos)
        end_id = None
        for case, msgs in CASES:
            rec = {"template": name, "case": case, "messages": msgs}
            try:
                text = render(tok, tmpl, msgs)
            except Exception as e:  # jinja2 TemplateError from raise_exception
                rec["error"] = str(e)
                lines.append(rec)
                continue
            if name == "gemma" and msgs[0]["role"] != "system":
                assert render(tok, gemma2, msgs) == text, ("gemma 2 template differs", case)
            ids, spans = ref.encode(text)
            if fam.startswith("mistral"):
                direct = tok.apply_chat_template(msgs, chat_template=tmpl, tokenize=True)
                assert list(direct) == list(ids), (name, case)
            if end_id is None:
                end_id = (ref.tok.convert_tokens_to_ids(end) if fam.startswith("mistral")
                          else ref.pieces.index(end.encode()))
            # assistant spans: render with one assistant content replaced by a marker
            tb = text.encode()
            mask = [0] * len(ids)
            for k, m in enumerate(msgs):
                if m["role"] != "assistant":
                    continue
                marker = f"QQMARK{k}QQ"
                alt = [dict(x) for x in msgs]
                alt[k]["content"] = marker
                at = render(tok, tmpl, alt).encode()
                off = at.index(marker.encode())
                ins = len(tb) - len(at) + len(marker)
                a, b = off, off + ins
                assert tb[:a] == at[:a], (name, case, "prefix differs")
                for j, (s, e) in enumerate(spans):
                    if a < b and s < b and e > a:
                        mask[j] = 1
                for j, (s, e) in enumerate(spans):
                    if s >= b and ids[j] == end_id:
                        mask[j] = 1
                        break
            rec.update(text=text, ids=list(ids), mask=mask)
            lines.append(rec)
    os.makedirs(os.path.dirname(OUT), exist_ok=True)
    with open(OUT, "w", encoding="utf-8") as f:
        f.write(json.dumps(header, ensure_ascii=False) + "\n")
        for r in lines:
            f.write(json.dumps(r, ensure_ascii=False) + "\n")
    print(f"wrote {OUT}: {len(lines)} cases")


if __name__ == "__main__":
    main()
