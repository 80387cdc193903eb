"""The main job (examples/train.py, issue #25) as users run it, through ``torchrun``: checkpoints
that resume bit for bit (and at another world size, in float64, within the float64 tolerance),
a SIGTERM from the launcher that ends in a checkpoint, a clear error for a missing checkpoint,
and the data split and sharding rules of examples/textdata.py."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys

import torch

from _parity import TOL64

HERE = os.path.dirname(os.path.abspath(__file__))
TRAIN = os.path.join(HERE, "..", "examples", "train.py")
SMALL = ["--max-bytes", "400000", "--dim", "32", "--layers", "2", "--heads", "2", "--seq-len", "32", "--batch", "8",
         "--eval-every", "3", "--eval-batches", "2", "--ckpt-every", "100", "--samples", "0", "--log-every", "1"]


def _run(world: int, out: str, *extra: str, check: bool = True) -> subprocess.CompletedProcess:
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc-per-node={world}", TRAIN,
           "--out", out, *SMALL, *extra]
    done = subprocess.run(cmd, capture_output=True, text=True, timeout=300)
    if check:
        assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    return done


def _losses(out: str) -> list[float]:
    with open(os.path.join(out, "metrics.json")) as f:
        return [c["loss"] for c in json.load(f)["curve"]]


def test_resume_is_bit_identical_to_an_uninterrupted_run(tmp_path):
    whole, parts = str(tmp_path / "whole"), str(tmp_path / "parts")
    _run(2, whole, "--steps", "6")
    first = _run(2, parts, "--steps", "6", "--stop-after", "3")
    assert "stopped after step 3 (--stop-after)" in first.stdout, first.stdout
    resumed = _run(2, parts, "--steps", "6", "--resume")
    assert "resumed from" in resumed.stdout and "step_00000003" in resumed.stdout, resumed.stdout
    a, b = _losses(whole), _losses(parts)
    assert len(a) == len(b) == 6
    assert a == b, (a, b)  # bit for bit: the same floats, every step after the resume too
    assert sorted(os.listdir(os.path.join(parts, "ckpt"))) == ["latest", "step_00000003", "step_00000006"]


def test_resume_at_another_world_size(tmp_path):
    """Saved at world 2, resumed at world 1, in float64: the global batch of a step does not depend
    on the world size, only the order of the gradient sum does (within float64 rounding)."""
    whole, parts = str(tmp_path / "whole"), str(tmp_path / "parts")
    _run(2, whole, "--steps", "6", "--fp64")
    _run(2, parts, "--steps", "6", "--fp64", "--stop-after", "3")
    _run(1, parts, "--steps", "6", "--fp64", "--resume")
    a, b = _losses(whole), _losses(parts)
    assert a[:3] == b[:3]
    assert max(abs(x - y) for x, y in zip(a, b)) <= TOL64, (a, b)


def test_resume_without_a_checkpoint_says_so(tmp_path):
    done = _run(2, str(tmp_path / "none"), "--steps", "2", "--resume", check=False)
    assert done.returncode != 0
    assert f"--resume: no checkpoint at {tmp_path / 'none' / 'ckpt'}" in done.stderr + done.stdout
    text = done.stdout + done.stderr
    assert text.count("--resume: no checkpoint") == 1  # rank 0 says it; nothing from the job traces back
    assert 'train.py", line' not in text and "torch/distributed/checkpoint" not in text, text[-3000:]


def test_sigterm_from_the_launcher_ends_in_a_checkpoint(tmp_path):
    out = str(tmp_path / "run")
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node=2", TRAIN,
           "--out", out, *SMALL, "--steps", "100000"]
    proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    lines = []
    for line in proc.stdout:  # wait until training runs, then stop the launcher as a scheduler would
        lines.append(line)
        if line.startswith("step     3/"):
            proc.send_signal(signal.SIGTERM)
            break
    rest, _ = proc.communicate(timeout=120)
    text = "".join(lines) + rest
    assert "stopped after step" in text and "(a signal)" in text, text[-3000:]
    ckpt = os.path.join(out, "ckpt")
    latest = open(os.path.join(ckpt, "latest")).read().strip()
    step = int(latest.split("_")[1])
    assert step >= 3 and os.path.exists(os.path.join(ckpt, latest, "meta.json")), os.listdir(ckpt)
    assert not [p for p in os.listdir(ckpt) if p.endswith(".partial")]
    resumed = _run(2, out, "--steps", str(step + 2), "--resume")
    assert len(_losses(out)) == step + 2, resumed.stdout[-2000:]


def test_the_corpus_is_split_by_file_and_sharded_by_rank():
    sys.path.insert(0, os.path.join(HERE, "..", "examples"))
    import textdata

    corpus = textdata.load_corpus(None, max_bytes=2_000_000)
    assert corpus.files[0] > 0 and corpus.files[1] > 0
    again = textdata.load_corpus(None, max_bytes=2_000_000)  # deterministic
    assert torch.equal(corpus.train, again.train) and torch.equal(corpus.val, again.val)
    batches = textdata.Batches(corpus.train, 32, 8, seed=0)
    for step in (0, 1, batches.steps_per_epoch + 2):
        whole = batches.global_indices(step)
        assert len(set(whole.tolist())) == 8  # no sequence twice in a step
        for world in (1, 2, 4):  # every rank its own slice; together the global batch, whatever the world
            parts = [batches.global_indices(step).chunk(world)[r] for r in range(world)]
            assert torch.equal(torch.cat(parts), whole)
            x = torch.cat([batches.rank_batch(step, r, world)[0] for r in range(world)])
            assert torch.equal(x, batches.sequences_at(whole)[0])
    x, y = batches.sequences_at(torch.tensor([0]))
    assert torch.equal(x[0, 1:], y[0, :-1])  # targets are the inputs shifted by one byte
    assert 3.0 < corpus.unigram_bits_per_byte() < 8.0


def test_the_summary_reports_speed_and_memory_and_deterministic_mode_runs(tmp_path):
    out = str(tmp_path / "run")
    _run(1, out, "--steps", "3", "--deterministic")
    with open(os.path.join(out, "summary.json")) as f:
        summary = json.load(f)
    assert summary["steps"] == 3 and summary["world"] == 1 and summary["device"] == "cpu"
    assert summary["tokens"] == 3 * 8 * 32
    assert summary["tokens_per_s"] > 0 and summary["step_tokens_per_s"] > 0
    assert summary["mfu"] is None  # only bf16 on a GPU of known peak
    assert summary["memory"].startswith("params+grads+optim MiB/rank ")


def test_mfu_counts_matmul_weights_and_attention_over_the_bf16_peak(monkeypatch):
    import argparse

    sys.path.insert(0, os.path.join(HERE, "..", "examples"))
    import train

    model = torch.nn.Sequential(torch.nn.Linear(4, 8), torch.nn.LayerNorm(8))  # 32 matmul weights; 1-D ones not
    args = argparse.Namespace(bf16=True, layers=2, dim=4, seq_len=16)
    monkeypatch.setattr(torch.cuda, "get_device_name", lambda device=None: "NVIDIA H200")
    per_token = 6 * 32 + 12 * 2 * 4 * 16
    assert train.mfu(args, model, 1e9, torch.device("cuda")) == per_token * 1e9 / 989e12
    monkeypatch.setattr(torch.cuda, "get_device_name", lambda device=None: "NVIDIA H100 PCIe")
    assert train.mfu(args, model, 1e9, torch.device("cuda")) == per_token * 1e9 / 756e12
    monkeypatch.setattr(torch.cuda, "get_device_name", lambda device=None: "Some GPU")
    assert train.mfu(args, model, 1e9, torch.device("cuda")) is None
    assert train.mfu(args, model, 1e9, torch.device("cpu")) is None
    assert train.mfu(argparse.Namespace(bf16=False, layers=2, dim=4, seq_len=16), model, 1e9,
                     torch.device("cuda")) is None
