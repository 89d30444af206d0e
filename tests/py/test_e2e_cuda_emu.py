"""End to end with device "cuda" on the CPU emulator: loaderd -> trainer --device cuda.

$BT_EMU_TRAINER is build/emu/trainer (`make test-emu` builds it and runs this file): the real
trainer/loop/train.c CUDA paths (model and LoRA upload, the GPU step, clip + AdamW on the device,
held-out evaluation, adapter download and save) with every kernels/cuda and trainer/cuda kernel
running on the emulator of tests/emu. The same job runs on the CPU trainer (build/trainer), and
the GPU run must follow it: per-step and held-out losses within 0.2% (bf16 activations vs fp32;
about 2e-5 seen), and a PEFT adapter of the same layout whose lora_A agree within rel_l2 1e-2
(2.4e-3 seen) and lora_B, trained from zero, within 1e-1 (4.7e-2 seen). Both kernel sets run: the
defaults (wmma attention, dequantise + cuBLAS) and cuda.attention "mma" + cuda.nf4_matmul "fused".
The tiny model has head_dim 64 (the GPU attention supports 64 and 128): hidden 128, 2 heads, 1 KV
head, the real SmolLM2 vocabulary.

Data-parallel (trainer/parallel/dist.h, trainer/cuda/cuda_dist.cu, NCCL emulated across processes by
tests/emu/nccl_emu.cpp): two trainer processes (RANK/WORLD_SIZE, micro-batch 1 each) meet at a
TCP rendezvous and all-reduce their gradients; loaderd deals rank r the plan rows 2i + r, which
are the rows of batch i of one process with micro-batch 2. So the pair must reproduce the single
process: the same losses, held-out losses and adapter up to fp32 summation order. A rank started
with a different config is refused by the rendezvous on both sides.

Collected only when $BT_EMU_TRAINER is set (conftest.py)."""
import json
import os
import re
import signal
import socket
import subprocess
import time

import pytest

from conftest import BUILD, chat_line, ckpt_step, read_safetensors, rel_l2, tiny_model_hd64, write_shard

EMU_TRAINER = os.environ.get("BT_EMU_TRAINER", "")
JOB_SECRET = os.urandom(16).hex()  # the per-job secret a launcher hands every rank (trainer/parallel/dist.h)


@pytest.fixture
def env(tmp_path, trainer_stack):
    if not EMU_TRAINER or not os.access(EMU_TRAINER, os.X_OK):
        pytest.skip(f"BT_EMU_TRAINER={EMU_TRAINER!r} is not an executable (make test-emu builds it)")
    data = tmp_path / "data"
    data.mkdir()
    good = [chat_line(f"What is item {i}?", f"Item {i} is a thing with number {i * 7}.") for i in range(40)]
    write_shard(data / "train-000.jsonl.zst", good)
    write_shard(data / "eval.jsonl.zst", good[:8])
    model = tiny_model_hd64(tmp_path / "tiny64.gguf", 11)
    ld = trainer_stack(data)
    return {"tmp": tmp_path, "data": data, "model": model, "sock": ld.sock, "loaderd": ld}


def job_config(env, name, device, extra=None):
    tmp = env["tmp"]
    out = tmp / f"adapter-{name}"
    job = {
        "name": name,
        "model": str(env["model"]),
        "base_dtype": "nf4",
        "socket": str(env["sock"]),
        "data": {"shards": [str(env["data"] / "train-*.jsonl.zst")], "format": "chat",
                 "seq_len": 64, "micro_batch_size": 2, "seed": 5},
        "eval": {"shards": [str(env["data"] / "eval.jsonl.zst")], "max_batches": 2},
        "lora": {"r": 4, "lora_alpha": 8, "lora_dropout": 0.0},
        "optim": {"lr": 1e-3, "warmup_steps": 1},
        "steps": 3, "grad_accum": 1, "threads": 1, "device": device,
        "out_dir": str(out),
    }
    if extra:
        job.update(extra)
    (tmp / f"{name}.json").write_text(json.dumps(job))
    return tmp / f"{name}.json", out


def parse_run(text, out):
    losses = [float(l) for _, l in re.findall(r"step (\d+)/3 \| loss ([0-9.]+) \| lr ", text)]
    assert len(losses) == 3, text
    m = re.search(r"held-out loss: before ([0-9.]+) -> after ([0-9.]+)", text)
    assert m, text
    return {"text": text, "losses": losses, "before": float(m.group(1)), "after": float(m.group(2)),
            "adapter": read_safetensors(out / "adapter_model.safetensors")}


def run_job(env, name, binary, device, extra=None, args=()):
    cfg, out = job_config(env, name, device, extra)
    r = subprocess.run([binary, "train", "--config", str(cfg), *args], capture_output=True,
                       text=True, timeout=600)
    text = r.stdout + r.stderr
    assert r.returncode == 0, text
    return parse_run(text, out)


def free_port():
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def start_ranks(cfgs, port, world=2, args=(), extra_env=None, logs=None):
    """One emulated trainer per config, rank r from cfgs[r], with torchrun's environment and the
    job secret; its output to logs[r] (a path) or to a pipe (text)."""
    base = {k: v for k, v in os.environ.items()
            if k not in ("SLURM_PROCID", "SLURM_NTASKS", "SLURM_LOCALID", "MASTER_ADDR")}
    procs = []
    for rank, cfg in enumerate(cfgs):
        e = {**base, "RANK": str(rank), "WORLD_SIZE": str(world), "LOCAL_RANK": str(rank),
             "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(port), "NCCL_EMU_TIMEOUT_S": "60",
             "BT_DIST_SECRET": JOB_SECRET, **(extra_env or {})}
        out = open(logs[rank], "wb") if logs else subprocess.PIPE
        procs.append(subprocess.Popen([EMU_TRAINER, "train", "--config", str(cfg), "--set", "dist.timeout_s=60",
                                       *args], env=e, stdout=out, stderr=subprocess.STDOUT, text=not logs))
    return procs


def launch_ranks(cfgs, port, world=2, args=(), extra_env=None):
    """start_ranks, then wait for all: [(exit status, output)]."""
    procs = start_ranks(cfgs, port, world, args, extra_env)
    outs = []
    for p in procs:
        try:
            outs.append(p.communicate(timeout=600)[0])
        except subprocess.TimeoutExpired:
            for q in procs:
                q.kill()
            raise
    return [(p.returncode, o) for p, o in zip(procs, outs)]


def wait_for_line(procs, log, pattern, timeout=600):
    """Until rank 0's log has a line matching pattern, every rank still running."""
    deadline = time.time() + timeout
    while not re.search(pattern, log.read_text(errors="replace"), re.M):
        assert all(p.poll() is None for p in procs), [p.returncode for p in procs]
        assert time.time() < deadline, log.read_text()
        time.sleep(0.1)


def end_all(procs):
    """Kill what still runs (stopped ones too) and reap everything."""
    for p in procs:
        if p.poll() is None:
            p.send_signal(signal.SIGKILL)
            p.send_signal(signal.SIGCONT)
            p.wait()


def test_two_ranks_reproduce_one_process_with_both_rows(env):
    one = run_job(env, "dp-one", EMU_TRAINER, "cuda")
    cfg, out = job_config(env, "dp-two", "cuda", {"data": {
        "shards": [str(env["data"] / "train-*.jsonl.zst")], "format": "chat", "seq_len": 64,
        "micro_batch_size": 1, "seed": 5}})
    res = launch_ranks([cfg, cfg], free_port())
    for rank, (rc, text) in enumerate(res):
        assert rc == 0, f"rank {rank}:\n{text}"
        assert f"NCCL: rank {rank} of 2" in text, text
    two = parse_run(res[0][1], out)
    assert "step 1/3" not in res[1][1], "only rank 0 prints progress:\n" + res[1][1]
    print(f"\ndata-parallel: losses one {one['losses']} two {two['losses']}; held-out "
          f"{one['before']}/{two['before']} -> {one['after']}/{two['after']}")
    for step, (a, b) in enumerate(zip(one["losses"], two["losses"]), 1):
        assert abs(a - b) <= 1e-4 * a, f"step {step}: one process {a}, two ranks {b}"
    assert abs(one["before"] - two["before"]) <= 1e-4 * one["before"]
    assert abs(one["after"] - two["after"]) <= 1e-4 * one["after"]
    assert set(one["adapter"]) == set(two["adapter"])
    ea, eb = rel_l2(two["adapter"], one["adapter"], "lora_A"), rel_l2(two["adapter"], one["adapter"], "lora_B")
    print(f"data-parallel: adapter rel_l2 lora_A {ea:.3e} lora_B {eb:.3e}")
    assert ea <= 1e-4 and eb <= 1e-3, (ea, eb)


def test_two_ranks_resume_bit_identically(env):
    """Two ranks with dist.shard_base (issue 26: each holds half of every NF4 base linear) stop after
    2 of 3 steps with a checkpoint (every rank's loader state gathered to rank 0); both resume: step
    3 is bit-identical to the uninterrupted run's. The checkpoint is one PEFT adapter + AdamW state,
    whatever W: one process resumes it with grad_accum 2, the same global batch of 2 rows (rank r of
    W takes window rows r, r + W, ..., so step k is rows 2k - 2 and 2k - 1 either way; loaderd
    continues rank 0's state at the same row, proto/PROTOCOL.md "resume_world"): step 3's loss
    equals the uninterrupted run's to every printed digit and the adapter is within rel_l2 1e-4
    (lora_A) / 1e-3 (lora_B), the data-parallel tolerance above (fp32 summation order; 0 seen). One
    process with grad_accum 1 (half the global batch) is refused, naming it."""
    data = {"shards": [str(env["data"] / "train-*.jsonl.zst")], "format": "chat", "seq_len": 64,
            "micro_batch_size": 1, "seed": 5}
    shard = {"data": data, "dist": {"shard_base": True}}
    full, out_full = job_config(env, "dp-full", "cuda", shard)
    ck = env["tmp"] / "dp-ckpt"
    part, out_part = job_config(env, "dp-part", "cuda", {**shard, "checkpoint_every": 1,
                                                         "checkpoint_dir": str(ck), "stop_at_step": 2})
    dbg = {"BT_LOG_LEVEL": "debug"}
    exact = re.compile(r"step (\d+) loss ([0-9.e+-]+) grad norm ([0-9.e+-]+)")
    a = launch_ranks([full, full], free_port(), extra_env=dbg)
    b = launch_ranks([part, part], free_port(), extra_env=dbg)
    c = launch_ranks([part, part], free_port(), args=("--set", "stop_at_step=0", "--resume", str(ck)),
                     extra_env=dbg)
    for name, res in (("full", a), ("stopped", b), ("resumed", c)):
        for rank, (rc, text) in enumerate(res):
            assert rc == 0, f"{name} rank {rank}:\n{text}"
    assert "dist.shard_base: rank 1 holds " in a[1][1], a[1][1]
    want = dict((int(n), (l, g)) for n, l, g in exact.findall(a[0][1]))
    got_b = dict((int(n), (l, g)) for n, l, g in exact.findall(b[0][1]))
    got_c = dict((int(n), (l, g)) for n, l, g in exact.findall(c[0][1]))
    assert sorted(want) == [1, 2, 3] and sorted(got_b) == [1, 2] and sorted(got_c) == [3], (a, b, c)
    assert got_b[1] == want[1] and got_b[2] == want[2]
    assert got_c[3] == want[3], f"resumed step 3 {got_c[3]} vs uninterrupted {want[3]}"
    assert "resumed from" in c[1][1], c[1][1]
    # the same checkpoint on one process (W = 1: the whole base) with twice the grad_accum
    one_env = {k: v for k, v in os.environ.items() if k not in ("RANK", "WORLD_SIZE", "SLURM_PROCID", "SLURM_NTASKS")}
    r = subprocess.run([EMU_TRAINER, "train", "--config", str(part), "--set", "stop_at_step=0", "--set",
                        "grad_accum=2", "--resume", str(ck)], capture_output=True, text=True, timeout=600,
                       env={**one_env, **dbg})
    assert r.returncode == 0, r.stdout + r.stderr
    assert "written by 2 rank(s), this run has 1: the data continue at the same row" in r.stderr, r.stderr
    printed = re.compile(r"step (\d+)/3 \| loss ([0-9.]+) \| lr ")
    want_p, got_1 = dict(printed.findall(a[0][1])), dict(printed.findall(r.stdout + r.stderr))
    got_exact = dict((int(n), (l, g)) for n, l, g in exact.findall(r.stdout + r.stderr))
    print(f"\nresume W=2 -> W=1: uninterrupted step 3 {want[3]}, resumed on one process {got_exact.get(3)}")
    assert sorted(got_1) == ["3"] and got_1["3"] == want_p["3"], (got_1, want_p)
    fa = read_safetensors(out_full / "adapter_model.safetensors")
    fc = read_safetensors(out_part / "adapter_model.safetensors")
    ea, eb = rel_l2(fc, fa, "lora_A"), rel_l2(fc, fa, "lora_B")
    print(f"resume W=2 -> W=1: adapter rel_l2 lora_A {ea:.3e} lora_B {eb:.3e}")
    assert set(fc) == set(fa) and ea <= 1e-4 and eb <= 1e-3, (ea, eb)
    r = subprocess.run([EMU_TRAINER, "train", "--config", str(part), "--set", "stop_at_step=0",
                        "--resume", str(ck)], capture_output=True, text=True, timeout=600, env=one_env)
    assert r.returncode != 0 and "global batch: checkpoint written by 2 rank(s) x grad_accum 1, this run has 1 x 1" \
        in r.stderr, r.stderr


def test_rendezvous_refuses_ranks_of_different_jobs(env):
    cfg0, _ = job_config(env, "dp-a", "cuda")
    cfg1, _ = job_config(env, "dp-b", "cuda", {"lora": {"r": 8, "lora_alpha": 8, "lora_dropout": 0.0}})
    res = launch_ranks([cfg0, cfg1], free_port())
    for rank, (rc, text) in enumerate(res):
        assert rc != 0, f"rank {rank} should have refused:\n{text}"
        assert "config digest" in text and "differs from rank 0" in text, f"rank {rank}:\n{text}"


@pytest.mark.parametrize("kernels", [None, {"attention": "mma", "nf4_matmul": "fused"}],
                         ids=["wmma+dequant", "mma+fused"])
def test_cuda_trainer_on_emulator_follows_cpu(env, kernels):
    # --profile (one step's per-op times; CUDA events on the GPU trainer) in the default run
    prof = ("--profile",) if kernels is None else ()
    cpu = run_job(env, "cpu", os.path.join(BUILD, "trainer"), "cpu", args=prof)
    tag = "gpu-" + ("default" if kernels is None else "mma-fused")
    gpu = run_job(env, tag, EMU_TRAINER, "cuda", {"cuda": kernels} if kernels else None, args=prof)
    if prof:
        for run, ops in ((cpu, ("attention fwd", "q_proj lora bwd", "adamw")),
                         (gpu, ("nf4_linear_fwd", "attn_fwd (wmma)", "attn_bwd (wmma)", "rmsnorm_fwd",
                                 "lora_bwd", "linear_ce"))):
            t = run["text"]
            assert "profile: step 2, 2 x 64 tokens" in t, t
            for op in ops:
                assert re.search(rf"\n{re.escape(op)} +\d+ +[0-9.]+ ", t), \
                    (op, t[t.index("profile:"):][:4000])
        assert "(CUDA events)" in gpu["text"] and "device " in gpu["text"]
    assert "CUDA device CPU emulator" in gpu["text"], gpu["text"]
    want = "attention mma, NF4 matmul fused" if kernels else "attention wmma, NF4 matmul dequant+cuBLAS"
    assert want in gpu["text"], gpu["text"]
    print(f"\n{tag}: losses cpu {cpu['losses']} gpu {gpu['losses']}; held-out before "
          f"{cpu['before']}/{gpu['before']} after {cpu['after']}/{gpu['after']}")
    for step, (c, g) in enumerate(zip(cpu["losses"], gpu["losses"]), 1):
        assert abs(g - c) <= 2e-3 * c, f"step {step}: cpu {c} gpu {g}\n{gpu['text']}"
    assert abs(gpu["before"] - cpu["before"]) <= 2e-3 * cpu["before"], (cpu["before"], gpu["before"])
    assert abs(gpu["after"] - cpu["after"]) <= 2e-3 * cpu["after"], (cpu["after"], gpu["after"])
    # the adapter saved from the device: same tensors and shapes, values close to the CPU run's
    assert set(gpu["adapter"]) == set(cpu["adapter"]) and len(cpu["adapter"]) == 2 * 7 * 2
    # lora_A starts random and moves little; lora_B starts at zero and is all training: judged apart
    err = {part: rel_l2(gpu["adapter"], cpu["adapter"], part) for part in ("lora_A", "lora_B")}
    print(f"{tag}: adapter rel_l2 lora_A {err['lora_A']:.3e} lora_B {err['lora_B']:.3e}")
    assert err["lora_A"] <= 1e-2 and err["lora_B"] <= 1e-1, err


@pytest.mark.parametrize("how", ["killed", "stopped"])
def test_a_lost_rank_ends_every_rank_naming_it(env, how):
    """Three ranks train; rank 1 is SIGKILLed, or SIGSTOPped, mid-run. The emulated NCCL is put in
    NCCL's own one-node behaviour (NCCL_EMU_PEER_LOSS=hang: nothing notices the lost peer, and no
    emulator timeout), so only the trainer's watchdog (trainer/parallel/dist_monitor.h) and its
    ncclCommAbort can end the others' waits: ranks 0 and 2 must both exit with a message naming
    rank 1 and its pid."""
    data = {"shards": [str(env["data"] / "train-*.jsonl.zst")], "format": "chat", "seq_len": 64,
            "micro_batch_size": 1, "seed": 5}
    cfg, _ = job_config(env, f"dp-lost-{how}", "cuda", {"data": data, "steps": 100000, "eval": {}})
    outs = [env["tmp"] / f"rank{r}-{how}.log" for r in range(3)]
    procs = start_ranks([cfg] * 3, free_port(), 3,
                        ("--set", "dist.timeout_s=600", "--set", "dist.heartbeat_timeout_s=3"),
                        {"NCCL_EMU_PEER_LOSS": "hang", "NCCL_EMU_TIMEOUT_S": "0"}, outs)
    try:
        wait_for_line(procs, outs[0], r"^step 2/100000 ")
        # loaderd sees one run (the attach's "run": the same id on every rank) of three ranks
        st = json.loads(env["loaderd"].ctl("status", "--json").stdout)
        mine = [j for j in st["jobs"] if j["name"] == f"dp-lost-{how}"]
        assert sorted(j["rank"] for j in mine) == [0, 1, 2], st
        assert len({j["run"] for j in mine}) == 1 and len(mine[0]["run"]) == 16, mine
        victim = procs[1]
        victim.send_signal(signal.SIGKILL if how == "killed" else signal.SIGSTOP)
        for r in (0, 2):
            procs[r].wait(timeout=180)  # the heartbeat timeout is 3 s: this is only a hang guard
    finally:
        end_all(procs)
    word = "died" if how == "killed" else "stopped responding"
    for r in (0, 2):
        text = outs[r].read_text(errors="replace")
        assert procs[r].returncode == 1, f"rank {r} exited {procs[r].returncode}:\n{text[-3000:]}"
        assert f"rank 1 (pid {victim.pid} on " in text and word in text, f"rank {r}:\n{text[-3000:]}"


def test_a_signal_on_one_rank_stops_every_rank_mid_step_and_keeps_the_last_step(env):
    """Two ranks, 2 steps of 2 micro-batches each. SIGTERM to rank 1 alone once step 1 is done:
    the watchdog relays the stop, both ranks drop step 2 mid-way and exit 75, rank 0 saves a
    checkpoint of step 1 holding both ranks' loader positions (gathered with the step, no
    collective after the stop), and resuming both ranks from it reproduces the uninterrupted
    run's step 2 bit for bit (the step that was dropped: every later step depends on it).
    An emulated micro-batch takes over a second, the signal follows the step-1 line within
    0.1 s: it lands in step 2."""
    data = {"shards": [str(env["data"] / "train-*.jsonl.zst")], "format": "chat", "seq_len": 64,
            "micro_batch_size": 1, "seed": 5}
    over = {"data": data, "grad_accum": 2, "steps": 2, "eval": {}}
    full, _ = job_config(env, "dp-sig-full", "cuda", over)
    ck = env["tmp"] / "dp-sig-ckpt"
    part, _ = job_config(env, "dp-sig-part", "cuda", {**over, "checkpoint_dir": str(ck)})
    dbg = {"BT_LOG_LEVEL": "debug"}
    exact = re.compile(r"step (\d+) loss ([0-9.e+-]+) grad norm ([0-9.e+-]+)")
    want = dict((int(n), (l, g)) for n, l, g in exact.findall(launch_ranks([full, full], free_port(),
                                                                          extra_env=dbg)[0][1]))
    assert sorted(want) == [1, 2], want
    outs = [env["tmp"] / f"sig-rank{r}.log" for r in range(2)]
    procs = start_ranks([part, part], free_port(), 2, extra_env=dbg, logs=outs)
    try:
        wait_for_line(procs, outs[0], r"^step 1/2 ")
        procs[1].send_signal(signal.SIGTERM)
        rcs = [p.wait(timeout=300) for p in procs]
    finally:
        end_all(procs)
    texts = [o.read_text(errors="replace") for o in outs]
    assert rcs == [75, 75], texts
    assert "interrupted by SIGTERM: stopping mid-step 2 (in micro-batch" in texts[1], texts[1]
    assert f"dist: rank 1 (pid {procs[1].pid} on " in texts[0] and "was interrupted (SIGTERM)" in texts[0], texts[0]
    assert re.search(r"stopping mid-step 2 \(in micro-batch \d+ of 2\)", texts[0]), texts[0]
    assert "stopped after step 1 of 2; adapter saved to" in texts[0] and f"checkpoint to {ck}" in texts[0], texts[0]
    assert ckpt_step(ck) == 1
    res = launch_ranks([part, part], free_port(), args=("--resume", str(ck)), extra_env=dbg)
    for rank, (rc, text) in enumerate(res):
        assert rc == 0, f"resumed rank {rank}:\n{text}"
    got = dict((int(n), (l, g)) for n, l, g in exact.findall(res[0][1]))
    assert got == {2: want[2]}, (got, want)



def tiny_3l(env, name, base):
    """The 3-layer hidden-128 model of the shard_base tests: F32 linears (base "nf4": quantised at
    load), or "A+B": attention linears in GGUF type A, FFN ones in B (two block types in one file,
    as llama.cpp's _M mixes)."""
    model = env["tmp"] / f"tiny64-3l-{name}.gguf"
    types = ["--type", "F32"] if base == "nf4" else ["--type", base.split("+")[0], "--ffn-type", base.split("+")[-1]]
    subprocess.run([os.path.join(BUILD, "tools", "mk_tiny_gguf"), "--out", str(model), "--tokenizer-from",
                    str(env["model"]), "--layers", "3", "--hidden", "128", "--heads", "2", "--kv-heads", "1",
                    "--ffn", "256", "--seed", "11", *types], check=True)
    return model


@pytest.mark.parametrize("base,ckpt", [("nf4", False), ("Q8_0+Q4_0", True)])
def test_shard_base_reproduces_the_whole_base(env, base, ckpt):
    """dist.shard_base (issue 26): two ranks each holding half of every base linear (whole NF4
    double-quantisation groups, or the GGUF's own Q8_0 / Q4_0 rows; the latter with checkpointing,
    offloaded checkpoints and S²-Attn), all-gathered per layer in forward and
    again for backward / recompute (three layers and two gather slots: every step gathers in both
    directions, the next layer's gather in flight while one computes), train exactly as two ranks
    holding the whole base: the same gathered bytes feed the same kernels, so the losses (every
    printed digit; NF4: and the held-out losses, over 3 rows the ranks share 2 / 1) and the
    adapter are identical (tolerance 0). Each rank's counter shows its
    shard: half the whole base's bytes for GGUF (rows cut in two); for NF4, ceil(groups / 2) whole
    16384-weight groups of every linear (the last one padded)."""
    model = tiny_3l(env, base, base)
    data = {"shards": [str(env["data"] / "train-*.jsonl.zst")], "format": "chat", "seq_len": 64,
            "micro_batch_size": 1, "seed": 5}
    # held-out rows 3 (NF4): the ranks' shares are 2 and 1 batches, and every forward pass gathers,
    # so the rank with fewer runs a label-free pass to stay level (trainer/loop/eval.c)
    ev = {}
    if base == "nf4":
        write_shard(env["data"] / "eval3.jsonl.zst",
                    [chat_line(f"What is item {i}?", f"Item {i} is a thing with number {i * 7}.") for i in range(3)])
        ev = {"shards": [str(env["data"] / "eval3.jsonl.zst")], "max_batches": 0}
    # with checkpointing also the layer inputs offloaded to host memory and S²-Attn in training
    # (groups of 16 tokens), which the shards must not change either
    extra = {"cuda": {"offload_checkpoints": True}, "attention": {"s2": {"group_fraction": 0.25}}} if ckpt else {}
    runs = {}
    for shard in (False, True):
        cfg, out = job_config(env, f"shard-{base}-{int(shard)}", "cuda", {
            "model": str(model), "data": data, "eval": ev, "steps": 2,
            "base_dtype": "nf4" if base == "nf4" else "gguf", "activation_checkpointing": ckpt,
            "dist": {"shard_base": shard}, **extra})
        res = launch_ranks([cfg, cfg], free_port())
        held = []
        for rank, (rc, text) in enumerate(res):
            assert rc == 0, f"rank {rank}:\n{text}\nrank {1 - rank}:\n{res[1 - rank][1]}"
            m = re.search(r"dist.shard_base: rank \d holds (\d+) bytes of the base linears \(its 1/2 shard\) "
                          r"and gathers each layer into (\d+) bytes" if shard else
                          r"base linears: (\d+) bytes on this GPU", text)
            assert m, text
            # the base is cut at load: each rank reads only its GGUF rows, or quantises only its NF4
            # groups (with the whole matrix's offset: the same bytes), issue 26
            assert (f"dist.shard_base: rank {rank} read only its 1/2 cut of the base linears" in text) == shard, text
            held.append(int(m.group(1)))
            if shard and base == "nf4":  # what `trainer estimate` bills (plan.h bt_shard_cut): 7 linears
                # of 2 x 1 groups, packed + codes, and 2 nested absmax in a 256-byte region each
                assert int(m.group(2)) == 7 * (2 * (8192 + 256) + 256), text
        losses = [float(x) for x in re.findall(r"step \d/2 \| loss ([0-9.]+) \| lr ", res[0][1])]
        assert len(losses) == 2, res[0][1]
        losses += [float(x) for x in re.findall(r"held-out loss: before ([0-9.]+) -> after ([0-9.]+)",
                                                 res[0][1])[0]] if ev else []
        runs[shard] = (losses, read_safetensors(out / "adapter_model.safetensors"), held)
    (l0, a0, h0), (l1, a1, h1) = runs[False], runs[True]
    print(f"\nshard_base {base} ckpt={ckpt}: losses {l0} / {l1}; base bytes a rank {h0} -> {h1}")
    assert l1 == l0
    assert set(a1) == set(a0) and all(a1[k] == a0[k] for k in a0)
    assert h1[0] == h1[1]
    if base == "nf4":
        groups = [1, 1, 1, 1, 2, 2, 2]  # q, k, v, o (<= 16384 weights), gate, up, down (32768)
        assert h1[0] == 3 * sum((g + 1) // 2 for g in groups) * (8192 + 256 + 4)
    else:
        assert 2 * h1[0] == h0[0]


@pytest.mark.parametrize("base,ckpt", [("nf4", True), ("Q8_0+Q4_0", False)])
def test_shard_base_four_ranks_reproduce_one_process(env, base, ckpt):
    """dist.shard_base on W = 4 (issue 26; W = 2 above, with checkpointing the other way round): four
    ranks, micro-batch 1, each holding a quarter of every base linear, read alone from the file
    (GGUF: a quarter of the rows of Q8_0 attention and Q4_0 FFN linears; NF4: one whole 16384-weight
    group of every linear, quantised alone with the whole matrix's offset, the last ones padded) train as one process holding the whole base with
    grad_accum 4 (the same 4 rows a step: rank r of 4 takes rows r, r + 4, ...; loss the mean over all
    labelled tokens): the same loss to every printed digit, the adapter within rel_l2 1e-4 (lora_A)
    / 1e-3 (lora_B), the data-parallel tolerance above (fp32 summation order; 0 seen). Kept cheap for
    `make test`: one step (the adapter after it holds the gradients of the backward's gathers) of
    rows of 40 tokens (the emulated cross-entropy over the 49152-token vocabulary is most of the time)."""
    model = tiny_3l(env, f"w4-{base}", base)
    data = {"shards": [str(env["data"] / "train-*.jsonl.zst")], "format": "chat", "seq_len": 40,
            "micro_batch_size": 1, "seed": 5}
    over = {"model": str(model), "data": data, "eval": {}, "steps": 1, "activation_checkpointing": ckpt,
            "base_dtype": "nf4" if base == "nf4" else "gguf"}
    cfg4, out4 = job_config(env, f"w4-{base}", "cuda", {**over, "dist": {"shard_base": True}})
    cfg1, out1 = job_config(env, f"w1-{base}", "cuda", {**over, "grad_accum": 4})
    res = launch_ranks([cfg4] * 4, free_port(), 4)
    for rank, (rc, text) in enumerate(res):
        assert rc == 0, f"rank {rank}:\n{text}"
    one_env = {k: v for k, v in os.environ.items() if k not in ("RANK", "WORLD_SIZE", "SLURM_PROCID", "SLURM_NTASKS")}
    r = subprocess.run([EMU_TRAINER, "train", "--config", str(cfg1)], capture_output=True, text=True, timeout=600,
                       env=one_env)
    assert r.returncode == 0, r.stdout + r.stderr
    printed = re.compile(r"step \d/1 \| loss ([0-9.]+) \| lr ")
    l4, l1 = printed.findall(res[0][1]), printed.findall(r.stdout + r.stderr)
    whole = int(re.search(r"base linears: (\d+) bytes on this GPU", r.stdout + r.stderr).group(1))
    held = [int(re.search(r"dist.shard_base: rank \d holds (\d+) bytes of the base linears \(its 1/4 shard\)",
                          t).group(1)) for _, t in res]
    a4, a1 = read_safetensors(out4 / "adapter_model.safetensors"), read_safetensors(out1 / "adapter_model.safetensors")
    ea, eb = rel_l2(a4, a1, "lora_A"), rel_l2(a4, a1, "lora_B")
    print(f"\nshard_base W=4 {base} ckpt={ckpt}: losses {l4} / one process {l1}; base bytes a rank {held} "
          f"(whole {whole}); adapter rel_l2 lora_A {ea:.3e} lora_B {eb:.3e}")
    assert len(l4) == 1 and l4 == l1, (l4, l1)
    assert set(a4) == set(a1) and ea <= 1e-4 and eb <= 1e-3, (ea, eb)
    assert len(set(held)) == 1
    for rank, (_, text) in enumerate(res):
        assert f"dist.shard_base: rank {rank} read only its 1/4 cut of the base linears" in text, text
    if base == "nf4":  # one whole group of each of the 7 linears of 3 layers (1 or 2 groups: plan.h bt_shard_cut)
        assert held[0] == 3 * 7 * (8192 + 256 + 4)
    else:
        assert 4 * held[0] == whole


def test_shard_base_a_lost_rank_ends_the_gathering_ranks_naming_it(env):
    """dist.shard_base: rank 1 of two is SIGKILLed mid-run while the ranks all-gather a layer's base
    every few milliseconds (three layers, two slots: gathers in forward and backward of every
    step). NCCL's one-node behaviour (NCCL_EMU_PEER_LOSS=hang, no emulator timeout) leaves only the
    watchdog to end rank 0's wait, in a layer gather or the gradient all-reduce: it must exit 1
    naming rank 1 and its pid."""
    model = env["tmp"] / "tiny64-3l-lost.gguf"
    subprocess.run([os.path.join(BUILD, "tools", "mk_tiny_gguf"), "--out", str(model), "--tokenizer-from",
                    str(env["model"]), "--layers", "3", "--hidden", "128", "--heads", "2", "--kv-heads", "1",
                    "--ffn", "256", "--seed", "11", "--type", "Q8_0"], check=True)
    data = {"shards": [str(env["data"] / "train-*.jsonl.zst")], "format": "chat", "seq_len": 64,
            "micro_batch_size": 1, "seed": 5}
    cfg, _ = job_config(env, "shard-lost", "cuda", {"model": str(model), "data": data, "steps": 100000,
                                                    "eval": {}, "base_dtype": "gguf", "dist": {"shard_base": True}})
    outs = [env["tmp"] / f"shard-rank{r}.log" for r in range(2)]
    procs = start_ranks([cfg] * 2, free_port(), 2,
                        ("--set", "dist.timeout_s=600", "--set", "dist.heartbeat_timeout_s=3"),
                        {"NCCL_EMU_PEER_LOSS": "hang", "NCCL_EMU_TIMEOUT_S": "0"}, outs)
    try:
        wait_for_line(procs, outs[0], r"^step 2/100000 ")
        victim = procs[1]
        victim.send_signal(signal.SIGKILL)
        procs[0].wait(timeout=180)  # the heartbeat timeout is 3 s: this is only a hang guard
    finally:
        end_all(procs)
    text = outs[0].read_text(errors="replace")
    print("\n" + "\n".join(l for l in text.splitlines() if "rank 1 (pid" in l)[-400:])
    assert procs[0].returncode == 1, f"rank 0 exited {procs[0].returncode}:\n{text[-3000:]}"
    assert f"rank 1 (pid {victim.pid} on " in text and "died" in text, text[-3000:]

