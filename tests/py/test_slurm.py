"""scripts/train.sbatch under a real one-node Slurm (tests/py/slurm_cluster.py: Debian's
slurmctld + slurmd + munge, private directory, no slurmdbd), submitted exactly as the README's
"Trainers under Slurm" says: its command lines are read from README.md and run with bash, as they
are, from a scratch directory (the script must work from anywhere), with the variables the README
names in the environment: $BARQTRAIN (this clone), $LOADERD_SOCKET (a private loaderd: the job
configs here have no "socket", so the trainer's own rule finds it), $JOBID, and $TRAINER for the
emulated-CUDA trainer.

- one CPU task runs to completion and writes its adapter;
- SET's words reach the trainer as written (no glob expansion), and the messages follow out_dir;
- two emulated-CUDA ranks (build/emu/trainer, NCCL emulated across processes) train to completion
  and end with the adapter of one process with twice the micro-batch (losses to 4 digits, adapter
  rel_l2 as in test_e2e_cuda_emu.py), their rendezvous authenticated by the script's per-job
  secret;
- scancel of a job whose steps are longer than Slurm's kill grace period (KillWait 3 s here):
  the trainer stops mid-step and keeps the last completed step (adapter + checkpoint), before the
  SIGKILL;
- the early warning (the SIGUSR1 that --signal sends before a time limit, sent here with scancel
  --signal): the same, and the job ends with exit status 75 (FAILED, ExitCode 75:0).
Results are read with `scontrol show job` and from the job's output file.

Run by `make test-slurm` (BT_SLURM=1; part of `make test`, after test-emu). Skips, saying why,
only where Slurm cannot be installed or run at all (slurm_cluster.py)."""
import json
import os
import re
import subprocess

import pytest

from conftest import ROOT, chat_line, ckpt_step, read_safetensors, rel_l2, tiny_model_hd64, write_shard
from slurm_cluster import SlurmCluster, wait_for

EMU_TRAINER = os.environ.get("BT_EMU_TRAINER", "")
KILL_WAIT = 3


def readme_lines():
    """The command lines of the README's Slurm section (its first ```sh block)."""
    text = open(os.path.join(ROOT, "README.md")).read()
    sec = text[text.index("## Trainers under Slurm"):]
    block = sec[sec.index("```sh\n") + 6:]
    block = block[:block.index("```")]
    return [l for l in block.splitlines() if l.strip()]


def readme_line(prefix):
    lines = [l for l in readme_lines() if l.startswith(prefix)]
    assert len(lines) == 1, f"the README's Slurm section must have one line starting {prefix!r}: {readme_lines()}"
    return lines[0]


ONE_TASK = "sbatch --export=ALL,JOB=job.json "
TWO_GPUS = "sbatch --ntasks-per-node=2 --gpus-per-task=1 "
CANCEL = "scancel "


def test_every_readme_line_is_run_here():
    assert sorted(readme_line(p) for p in (ONE_TASK, TWO_GPUS, CANCEL)) == sorted(readme_lines())


@pytest.fixture(scope="module")
def slurm():
    c = SlurmCluster(kill_wait=KILL_WAIT)
    try:
        yield c.start()
    finally:
        c.stop()


@pytest.fixture
def site(tmp_path, trainer_stack, slurm):
    """A tiny model, shards, a private loaderd, and a scratch directory to submit from."""
    data = tmp_path / "data"
    data.mkdir()
    lines = [chat_line(f"What is item {i}?", f"Item {i} is a thing with number {i * 7}.") for i in range(200)]
    write_shard(data / "train.jsonl", lines)
    model = tiny_model_hd64(tmp_path / "tiny64.gguf", 11)
    ld = trainer_stack(data)
    work = tmp_path / "work"
    work.mkdir()
    return {"tmp": tmp_path, "data": data, "model": model, "loaderd": ld, "work": work, "slurm": slurm}


def write_job(site, **over):
    job = {"model": str(site["model"]), "base_dtype": "nf4",
           "data": {"shards": [str(site["data"] / "train.jsonl")], "format": "chat", "seq_len": 64,
                    "micro_batch_size": 2, "seed": 5, "tokenizer_threads": 1},
           "lora": {"r": 4, "lora_alpha": 8, "lora_dropout": 0.0},
           "optim": {"lr": 1e-3, "warmup_steps": 1}, "steps": 3, "grad_accum": 1}
    for k, v in over.items():
        if isinstance(v, dict) and isinstance(job.get(k), dict):
            job[k] = {**job[k], **v}
        else:
            job[k] = v
    (site["work"] / "job.json").write_text(json.dumps(job))


def submit(site, line, extra_env=None):
    """Run one README line in the scratch directory; the job id it printed."""
    env = dict(site["slurm"].env, BARQTRAIN=ROOT, LOADERD_SOCKET=site["loaderd"].sock)
    env.pop("TRAINER", None)
    env.update(extra_env or {})
    r = subprocess.run(["bash", "-c", line], cwd=site["work"], env=env, capture_output=True, text=True, timeout=60)
    assert r.returncode == 0, f"{line}\n{r.stdout}{r.stderr}"
    m = re.search(r"Submitted batch job (\d+)", r.stdout)
    assert m, r.stdout + r.stderr
    return m.group(1)


def output(site, job_id):
    p = site["work"] / f"slurm-{job_id}.out"
    return p.read_text(errors="replace") if p.exists() else ""


def finished(site, job_id, timeout=300):
    j = site["slurm"].wait_job(job_id, timeout)
    return j, output(site, job_id)


def progress(text):
    return [(int(s), float(l)) for s, l in re.findall(r"^step (\d+)/\d+ \| loss ([0-9.]+) \|", text, re.M)]


def test_one_cpu_task_to_completion(site):
    write_job(site)
    job_id = submit(site, readme_line(ONE_TASK))
    j, text = finished(site, job_id)
    assert j["JobState"] == "COMPLETED" and j["ExitCode"] == "0:0", f"{j}\n{text}"
    assert [s for s, _ in progress(text)] == [1, 2, 3], text
    assert f"train.sbatch: done: adapter in runs/slurm-{job_id}/adapter" in text, text
    assert f"checkpoints runs/slurm-{job_id}/checkpoint" in text, text
    adapter = site["work"] / "runs" / f"slurm-{job_id}" / "adapter"
    assert len(read_safetensors(adapter / "adapter_model.safetensors")) == 2 * 7 * 2
    assert (adapter / "adapter_config.json").exists()
    assert f"loaderd {site['loaderd'].sock}" in text, text  # found through $LOADERD_SOCKET


def test_set_words_reach_the_trainer_as_written(site):
    """SET is split on blanks only: a word with a glob character is not expanded against the files of
    the submit directory (the decoy "out_dir=outX" would match "out_dir=out*"), and the script's
    messages name the outputs where SET moved them."""
    write_job(site)
    (site["work"] / "out_dir=outX").write_text("decoy")
    job_id = submit(site, readme_line(ONE_TASK), {"SET": "steps=2 out_dir=out* checkpoint_dir=ck"})
    j, text = finished(site, job_id)
    assert j["JobState"] == "COMPLETED" and j["ExitCode"] == "0:0", f"{j}\n{text}"
    assert [s for s, _ in progress(text)] == [1, 2], text
    assert "adapter out*; checkpoints ck" in text and "train.sbatch: done: adapter in out*" in text, text
    assert (site["work"] / "out*" / "adapter_model.safetensors").exists(), text
    assert not (site["work"] / "outX").exists()


def test_two_emulated_cuda_ranks_match_one_process_with_twice_the_batch(site):
    if not EMU_TRAINER or not os.access(EMU_TRAINER, os.X_OK):
        pytest.skip(f"BT_EMU_TRAINER={EMU_TRAINER!r} is not built (make test-emu builds build/emu/trainer)")
    # the reference: one emulated process with micro-batch 2
    write_job(site, device="cuda", out_dir=str(site["tmp"] / "one"))
    r = subprocess.run([EMU_TRAINER, "train", "--config", str(site["work"] / "job.json")], capture_output=True,
                       text=True, timeout=600, env=dict(os.environ, LOADERD_SOCKET=site["loaderd"].sock))
    assert r.returncode == 0, r.stdout + r.stderr
    one = progress(r.stdout)
    # two ranks with micro-batch 1 each, submitted as the README says
    write_job(site, data={"micro_batch_size": 1})
    job_id = submit(site, readme_line(TWO_GPUS), {"TRAINER": EMU_TRAINER})
    j, text = finished(site, job_id)
    assert j["JobState"] == "COMPLETED" and j["ExitCode"] == "0:0", f"{j}\n{text}"
    assert "NCCL: rank 0 of 2" in text and "NCCL: rank 1 of 2" in text, text
    assert "job secret from BT_DIST_SECRET" in text and "(authenticated)" in text, text
    two = progress(text)
    assert [s for s, _ in two] == [1, 2, 3], text
    for (s, a), (_, b) in zip(one, two):
        assert abs(a - b) <= 1e-4 * a, f"step {s}: one process {a}, two ranks {b}"
    got = read_safetensors(site["work"] / "runs" / f"slurm-{job_id}" / "adapter" / "adapter_model.safetensors")
    want = read_safetensors(site["tmp"] / "one" / "adapter_model.safetensors")
    assert set(got) == set(want)
    ea, eb = rel_l2(got, want, "lora_A"), rel_l2(got, want, "lora_B")
    print(f"\nslurm data-parallel: losses one {one} two {two}; adapter rel_l2 lora_A {ea:.3e} lora_B {eb:.3e}")
    assert ea <= 1e-4 and eb <= 1e-3, (ea, eb)


def interrupted_run(site, stop, grad_accum=150):
    """Submit a job whose steps take far longer than KillWait; once step 1 is done, stop(job_id);
    then: the job record, its output, the step it stopped in, and its checkpoint's step."""
    write_job(site, steps=1000, grad_accum=grad_accum, threads=1)
    job_id = submit(site, readme_line(ONE_TASK))
    slurm = site["slurm"]
    wait_for(f"job {job_id} to finish step 1", lambda: re.search(r"^step 1/1000 ", output(site, job_id), re.M)
               or slurm.job(job_id).get("JobState") in ("FAILED", "COMPLETED", "CANCELLED"), 600, 0.2)
    text = output(site, job_id)
    m = re.search(r"^step 1/1000 .* elapsed (\d+)m(\d+)s", text, re.M)
    assert m, text
    # the point of the test: a step is longer than the grace between SIGTERM and SIGKILL
    step_s = int(m.group(1)) * 60 + int(m.group(2))
    print(f"\njob {job_id}: step 1 took {step_s} s (KillWait {KILL_WAIT} s)")
    assert step_s > KILL_WAIT, f"steps too short to prove anything:\n{text}"
    stop(job_id)
    j, text = finished(site, job_id)
    m = re.search(r"stopping mid-step 2 \(in micro-batch (\d+) of (\d+)\)", text)
    assert m and int(m.group(1)) < int(m.group(2)), text
    ck = site["work"] / "runs" / f"slurm-{job_id}" / "checkpoint"
    assert (site["work"] / "runs" / f"slurm-{job_id}" / "adapter" / "adapter_model.safetensors").exists(), text
    return j, text, ckpt_step(ck), job_id


def test_scancel_keeps_the_last_completed_step(site):
    line = readme_line(CANCEL)

    def cancel(job_id):
        env = dict(site["slurm"].env, JOBID=job_id)
        r = subprocess.run(["bash", "-c", line], cwd=site["work"], env=env, capture_output=True, text=True,
                           timeout=60)
        assert r.returncode == 0, r.stdout + r.stderr

    j, text, step, job_id = interrupted_run(site, cancel)
    print(f"job {job_id}: {j['JobState']} ExitCode {j['ExitCode']}")
    assert j["JobState"] == "CANCELLED", f"{j}\n{text}"
    assert "interrupted by SIGTERM" in text, text
    assert step == 1, text
    assert f"checkpoint to runs/slurm-{job_id}/checkpoint" in text, text


def test_early_warning_stops_with_status_75(site):
    def warn(job_id):  # what #SBATCH --signal=USR1@120 does before the time limit
        r = site["slurm"].run(["scancel", "--signal=USR1", job_id])
        assert r.returncode == 0, r.stdout + r.stderr

    j, text, step, job_id = interrupted_run(site, warn)
    assert j["JobState"] == "FAILED" and j["ExitCode"] == "75:0", f"{j}\n{text}"
    assert "interrupted by SIGUSR1" in text and "train.sbatch: interrupted (exit 75)" in text, text
    assert step == 1, text
