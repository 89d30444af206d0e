"""Where the trainer writes, tried as a user and as an attacker would (issue 21 §1, §2):

- `trainer train` with out_dir, checkpoint_dir or report.dir set to a directory holding a user's
  files (out_dir "." or the home directory included), and `trainer export --out` onto such a
  directory or over a file BarqTrain did not write, refuse with the key, the path and the reason,
  before the model is loaded, and change nothing; `trainer report DIR` likewise;
- a destination that cannot be written (an existing file in its place, a read-only filesystem)
  is found before the model is loaded, not at the first save;
- BarqTrain's own outputs carry a marker, and a run or export over its own earlier outputs (and
  over those of an earlier version, without the marker) works, as `make demo` run twice does.
Set BT_TRAINER_ASAN=1 to run the ASan+UBSan trainer."""
import json
import os
import shutil
import struct
import subprocess

import numpy as np
import pytest

from conftest import BUILD, MODEL, SAN_ENV, write_shard

ASAN = os.environ.get("BT_TRAINER_ASAN") == "1"
TRAINER = os.path.join(BUILD, "asan", "trainer") if ASAN else os.path.join(BUILD, "trainer")


def tiny(path, seed=7):
    subprocess.run([os.path.join(BUILD, "tools", "mk_tiny_gguf"), "--out", str(path), "--tokenizer-from", MODEL,
                    "--layers", "2", "--hidden", "64", "--heads", "4", "--kv-heads", "2", "--ffn", "128",
                    "--seed", str(seed), "--tied", "1"], check=True)
    return path


def trainer(*args, cwd=None, env=None, timeout=600):
    e = dict(os.environ)
    e.update(SAN_ENV)
    e.update(env or {})
    return subprocess.run([TRAINER, *[str(a) for a in args]], capture_output=True, text=True, env=e,
                          cwd=cwd, timeout=timeout)


def write_job(tmp, **over):
    j = {"model": str(tmp / "missing.gguf"), "base_dtype": "fp32", "socket": str(tmp / "no.sock"),
         "data": {"shards": [str(tmp / "data" / "*.jsonl")], "format": "text", "seq_len": 32,
                  "micro_batch_size": 2, "seed": 5, "tokenizer_threads": 1},
         "lora": {"r": 4, "lora_alpha": 8, "lora_dropout": 0.0}, "optim": {"lr": 1e-3},
         "steps": 4, "threads": 1, "timeout_s": 120, "out_dir": str(tmp / "adapter"),
         "checkpoint_dir": str(tmp / "ckpt"), "report": {"dir": str(tmp / "report"), "plot": False}}
    for k, v in over.items():
        if isinstance(v, dict) and isinstance(j.get(k), dict):
            j[k].update(v)
        else:
            j[k] = v
    p = tmp / "job.json"
    p.write_text(json.dumps(j))
    return p


def last_line(stderr):
    lines = [l for l in stderr.splitlines() if l.strip()]
    return lines[-1] if lines else ""


def user_dir(path):
    """A directory as a user has it: files and a subdirectory BarqTrain never wrote."""
    path.mkdir(parents=True, exist_ok=True)
    (path / "thesis.tex").write_text("years of work")
    (path / "photos").mkdir(exist_ok=True)
    (path / "photos" / "cat.jpg").write_bytes(b"\xff\xd8 a cat")
    return path


def snapshot(path):
    return sorted((str(p.relative_to(path)), p.read_bytes() if p.is_file() else None) for p in path.rglob("*"))


# ---------------------------------------------------------------- §1 and §2: before anything loads

@pytest.mark.parametrize("key", ["out_dir", "checkpoint_dir", "report.dir", "out_dir=."])
def test_train_refuses_a_users_directory_before_loading(tmp_path, key):
    """The issue's case: a destination holding a user's files is refused by name before the model
    (here a missing file: its error never shows) is loaded; nothing in it changes."""
    home = user_dir(tmp_path / "home")
    before = snapshot(home)
    cwd = None
    if key == "out_dir=.":  # out_dir "." run from the home directory
        cfg = write_job(tmp_path, out_dir=".", checkpoint_dir=str(tmp_path / "ckpt"))
        cwd, key = home, "out_dir"
    elif key == "report.dir":
        cfg = write_job(tmp_path, report={"dir": str(home)})
    else:
        cfg = write_job(tmp_path, **{key: str(home)})
    r = trainer("train", "--config", cfg, cwd=cwd)
    assert r.returncode == 1, (r.returncode, r.stderr[-3000:])
    # the run's error is the refusal: the model (a missing file here) was never opened
    assert last_line(r.stderr).startswith(f"trainer: {key}: "), r.stderr[-3000:]
    assert "that BarqTrain did not write" in r.stderr and "No such file" not in r.stderr, r.stderr[-3000:]
    assert snapshot(home) == before


@pytest.mark.parametrize("case", ["file", "under_file", "link"])
def test_unwritable_destination_found_before_loading(tmp_path, case):
    """§2: an out_dir that is an existing file (or lies under one, or is a symbolic link) is refused
    before the first step, not at the first save after training."""
    f = tmp_path / "notes.txt"
    f.write_text("mine")
    target = user_dir(tmp_path / "elsewhere")
    if case == "link":
        out = tmp_path / "adapter"
        out.symlink_to(target)
    else:
        out = f if case == "file" else f / "adapter"
    cfg = write_job(tmp_path, out_dir=str(out))
    r = trainer("train", "--config", cfg)
    assert r.returncode == 1 and last_line(r.stderr).startswith("trainer: out_dir: "), r.stderr[-3000:]
    want = {"file": "exists and is not a directory", "under_file": "notes.txt is not a directory",
            "link": "is a symbolic link"}[case]
    assert f"trainer: out_dir: adapter: {out}" in r.stderr and want in r.stderr, r.stderr[-3000:]
    assert f.read_text() == "mine" and (target / "thesis.tex").exists()


def test_read_only_filesystem_found_before_loading(tmp_path):
    """§2: out_dir on a read-only filesystem (a tmpfs mounted read-only in a private mount
    namespace) is refused with the errno's words before the model loads."""
    ro = tmp_path / "ro"
    ro.mkdir()
    cfg = write_job(tmp_path, out_dir=str(ro / "adapter"))
    probe = subprocess.run(["unshare", "-rm", "sh", "-c", f"mount -t tmpfs -o ro tmpfs {ro}"],
                           capture_output=True, text=True)
    if probe.returncode != 0:
        pytest.skip(f"cannot mount a read-only tmpfs here (unshare -rm: {probe.stderr.strip()})")
    e = dict(os.environ)
    e.update(SAN_ENV)
    r = subprocess.run(["unshare", "-rm", "sh", "-c", f'mount -t tmpfs -o ro tmpfs "{ro}" && exec "$0" "$@"',
                        TRAINER, "train", "--config", str(cfg)], capture_output=True, text=True, env=e, timeout=300)
    assert r.returncode == 1, (r.returncode, r.stderr[-3000:])
    assert f"out_dir: adapter: {ro / 'adapter'}: cannot be created in {ro}: Read-only file system" in r.stderr, \
        r.stderr[-3000:]
    assert last_line(r.stderr).startswith("trainer: out_dir: ")


# ---------------------------------------------------------------- runs over their own outputs

def st_tensors(path):
    raw = open(path, "rb").read()
    n = struct.unpack_from("<Q", raw, 0)[0]
    header = json.loads(raw[8:8 + n])
    return {k: np.frombuffer(raw[8 + n + v["data_offsets"][0]:8 + n + v["data_offsets"][1]], dtype=np.float32)
            for k, v in header.items() if k != "__metadata__"}


def test_runs_over_their_own_outputs_and_never_a_users(tmp_path, trainer_stack):
    """A run marks out_dir, checkpoint_dir and the report directory; a second run (as `make demo`
    twice) replaces them; outputs of an earlier version (no marker) are replaced too; a user's
    file put into out_dir stops the next run before it loads the model, with the file kept."""
    data = tmp_path / "data"
    data.mkdir()
    write_shard(data / "a.jsonl", [json.dumps({"text": f"line {i} of the shard, with words"}) for i in range(200)])
    tiny(tmp_path / "tiny.gguf")
    ld = trainer_stack(data)
    cfg = write_job(tmp_path, model=str(tmp_path / "tiny.gguf"), socket=ld.sock, steps=4, save_every=2,
                    checkpoint_every=2, report={"plot": False, "tensorboard": True})
    for run in range(2):
        r = trainer("train", "--config", cfg)
        assert r.returncode == 0, (run, r.stderr[-3000:])
        for d in ("adapter", "ckpt", "report"):
            assert (tmp_path / d / ".barqtrain").is_file(), (run, d)
            assert json.loads((tmp_path / d / ".barqtrain").read_text())["written_by"] == "BarqTrain"
    assert sorted(p.name for p in (tmp_path / "adapter").iterdir()) == [
        ".barqtrain", "README.md", "adapter_config.json", "adapter_model.safetensors"]
    # an earlier version's outputs: no marker, only our files
    for d in ("adapter", "ckpt", "report"):
        (tmp_path / d / ".barqtrain").unlink()
    r = trainer("train", "--config", cfg)
    assert r.returncode == 0, r.stderr[-3000:]
    assert (tmp_path / "adapter" / ".barqtrain").is_file() and (tmp_path / "report" / ".barqtrain").is_file()
    # a user's file in out_dir: refused up front, kept, the adapter untouched
    (tmp_path / "adapter" / "notes.md").write_text("my notes on this adapter")
    before = snapshot(tmp_path / "adapter")
    r = trainer("train", "--config", cfg)
    assert r.returncode == 1 and '"notes.md"' in r.stderr and "refusing to replace it" in r.stderr, r.stderr[-3000:]
    assert last_line(r.stderr).startswith("trainer: out_dir: ") and "info trainer: model " not in r.stderr
    assert snapshot(tmp_path / "adapter") == before
    # ... and by `trainer report` on a report directory holding a user's file
    (tmp_path / "report" / "plot-notes.txt").write_text("mine")
    r = trainer("report", tmp_path / "report")
    assert r.returncode == 1 and "plot-notes.txt" in r.stderr, r.stderr[-3000:]
    assert not (tmp_path / "report" / "report.png").exists()


# ---------------------------------------------------------------- exports

def write_adapter(d, layers=2, hidden=64, kv=32, r=2, alpha=4.0, value=0.01):
    """A PEFT adapter for the tiny model (q_proj and v_proj of every layer)."""
    d.mkdir(parents=True, exist_ok=True)
    (d / "adapter_config.json").write_text(json.dumps({
        "peft_type": "LORA", "r": r, "lora_alpha": alpha, "target_modules": ["q_proj", "v_proj"]}))
    tensors, blobs, off = {}, [], 0
    for l in range(layers):
        for mod, out in (("q_proj", hidden), ("v_proj", kv)):
            for ab, shape in (("A", [r, hidden]), ("B", [out, r])):
                a = np.full(shape, value, dtype=np.float32).tobytes()
                tensors[f"base_model.model.model.layers.{l}.self_attn.{mod}.lora_{ab}.weight"] = {
                    "dtype": "F32", "shape": shape, "data_offsets": [off, off + len(a)]}
                blobs.append(a)
                off += len(a)
    header = json.dumps(tensors).encode()
    header += b" " * (-len(header) % 8)
    (d / "adapter_model.safetensors").write_bytes(struct.pack("<Q", len(header)) + header + b"".join(blobs))
    return d


@pytest.mark.parametrize("fmt", ["peft", "safetensors", "gguf", "gguf-lora"])
def test_export_refuses_foreign_destinations_and_rewrites_its_own(tmp_path, bins, fmt):
    if not bins.have("tools/mk_tiny_gguf"):
        pytest.skip("tools/mk_tiny_gguf not built")
    base = tiny(tmp_path / "tiny.gguf")
    adapter = write_adapter(tmp_path / "adapter")
    is_dir = fmt in ("peft", "safetensors")
    # onto a user's directory / over a user's file (the base model itself among them)
    home = user_dir(tmp_path / "home")
    foreign = [home] if is_dir else [home / "thesis.tex", base]
    for out in foreign:
        before = out.read_bytes() if out.is_file() else snapshot(out)
        r = trainer("export", "--model", base, "--adapter", adapter, "--format", fmt, "--out", out)
        assert r.returncode == 2, (out, r.returncode, r.stderr[-2000:])
        assert "BarqTrain did not write" in r.stderr or "was not written by BarqTrain" in r.stderr, r.stderr[-2000:]
        assert "wrote" not in r.stderr
        assert (out.read_bytes() if out.is_file() else snapshot(out)) == before
    # a file where a directory goes, a directory where a file goes
    wrong = home / "thesis.tex" if is_dir else home
    r = trainer("export", "--model", base, "--adapter", adapter, "--format", fmt, "--out", wrong)
    assert r.returncode == 2 and ("is not a directory" in r.stderr or "is a directory" in r.stderr), r.stderr[-2000:]
    # its own output, twice: written, then rewritten
    out = tmp_path / ("out" if is_dir else "out.gguf")
    for _ in range(2):
        r = trainer("export", "--model", base, "--adapter", adapter, "--format", fmt, "--out", out)
        assert r.returncode == 0, r.stderr[-3000:]
    if is_dir:
        assert (out / ".barqtrain").is_file()
    else:
        import gguf  # gguf-py, as tests/py/test_export.py reads our files
        kv = gguf.GGUFReader(str(out)).fields["barqtrain.export"]
        assert bytes(kv.parts[kv.data[0]]).decode() == fmt


# ---------------------------------------------------------------- §11: bounded reads of our files

def test_huge_metrics_file_is_not_read_whole(tmp_path):
    """`trainer report` reads metrics.jsonl line by line with a bounded line: a 2 GiB file without
    a newline (sparse) costs no more than that line."""
    rep = tmp_path / "report"
    rep.mkdir()
    with open(rep / "metrics.jsonl", "wb") as f:
        f.write(b'{"type": "train", "step": 1, "loss": 2.0, "lr": 0.001, "tokens_per_s": 10}\n')
        f.truncate(2 << 30)
    p = subprocess.Popen([TRAINER, "report", str(rep)], stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    _, status, ru = os.wait4(p.pid, 0)
    err = p.stderr.read()
    assert os.waitstatus_to_exitcode(status) in (0, 1), err[-2000:]  # 1: no gnuplot here
    assert ru.ru_maxrss < 512 * 1024, (ru.ru_maxrss, err[-2000:])  # KiB: far below the file's 2 GiB
    assert "lines skipped (not a train or eval metrics object)" in err, err[-2000:]
