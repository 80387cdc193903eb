"""Issue #26 item 1: a rank killed with SIGKILL (in a backward, or while a checkpoint is being
written) under ``torchrun --max-restarts 1``: the job restarts on its own, resumes from the last
complete checkpoint, and its losses are bit for bit an uninterrupted run's."""

from __future__ import annotations

import os
import re
import subprocess
import sys

import pytest
import torch

from _parity import TOL64
from test_main_job import SMALL, TRAIN, _losses, _run

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "examples"))


def _with_restarts(out: str, *extra: str) -> subprocess.CompletedProcess:
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node=2", "--max-restarts=1",
           "--monitor-interval=0.1", TRAIN, "--out", out, *SMALL, *extra]
    done = subprocess.run(cmd, capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    return done


def _drill(tmp_path, *fault: str) -> tuple[str, list[float], list[float]]:
    """An uninterrupted run and one with ``fault`` (checkpoints every 3 of 8 steps): the faulty
    run's output and both runs' losses."""
    whole, hurt = str(tmp_path / "whole"), str(tmp_path / "hurt")
    _run(2, whole, "--steps", "8", "--ckpt-every", "3")
    done = _with_restarts(hurt, "--steps", "8", "--ckpt-every", "3", *fault, "--kill-rank", "1")
    return done.stdout + done.stderr, _losses(whole), _losses(hurt)


def test_a_rank_killed_in_backward_restarts_and_resumes_bit_identically(tmp_path):
    text, a, b = _drill(tmp_path, "--kill-at-step", "5")
    assert "fault: rank 1 killed in the backward of step 5" in text, text[-3000:]
    assert re.search(r"resumed from .*step_00000003 at t=[0-9.]+ \(restart 1 by torchrun\)", text), text[-3000:]
    assert len(a) == len(b) == 8 and a == b, (a, b)


def test_a_rank_killed_while_saving_never_loads_the_half_written_checkpoint(tmp_path):
    text, a, b = _drill(tmp_path, "--kill-in-save", "6")
    assert "fault: rank 1 killed while saving the checkpoint of step 6" in text, text[-3000:]
    assert re.search(r"resumed from .*step_00000003 at", text), text[-3000:]  # not the half-written step 6
    assert a == b, (a, b)
    ckpt = os.path.join(str(tmp_path / "hurt"), "ckpt")
    assert sorted(os.listdir(ckpt)) == ["latest", "step_00000006", "step_00000008"], os.listdir(ckpt)


def test_a_lost_replica_group_rejoins_and_training_equals_the_float64_reference(tmp_path):
    """Issue #26 item 2: torchft replica groups (2 x 2 ranks). Rank 1 of group 1 is SIGKILLed in a
    backward, the group is relaunched 2 s later; group 0 trains alone meanwhile, group 1 copies its
    state and rejoins. Both groups end identical, and equal to one float64 process that trained
    each step on the batches of the groups that took part in it (group 0's log says which).
    Group 1 is launched 3 s before group 0: the first step still waits for both (it once trained
    alone until killed, then group 0 trained the same steps again on its own)."""
    pytest.importorskip("torchft")
    import ft_drill
    import textdata
    import train
    from llama_model import Llama, LlamaConfig, loss_fn

    steps = 100
    r = ft_drill.drill(steps, kill_at=10, fp64=True, out=str(tmp_path), away=2.0, head_start=3.0,
                       step_seconds=0.15)  # group 0 outlasts group 1's relaunch under load
    assert r["exit"] == [0, 0], {k: v[-3000:] for k, v in r["logs"].items()}
    assert r["identical"]
    assert r["back"] is not None, "group 1 never came back before group 0 finished"
    history = r["history"]  # step -> the groups whose batches it was computed on
    assert list(history) == list(range(1, steps + 1))  # every step trained once
    assert all(history[s] == [0, 1] for s in range(1, 10))  # together from the first step
    back = r["back"][0]
    assert history[10] == [0] and history[back] == [0, 1] and history[steps] == [0, 1]
    assert all(history[s] == [0] for s in range(10, back))  # group 0 alone while group 1 was away

    args = train.parse_args([*ft_drill.SMALL, "--steps", str(steps), "--fp64"])
    for key, value in train.PRESETS["cpu"].items():
        if getattr(args, key) is None:
            setattr(args, key, value)
    batches = textdata.Batches(textdata.load_corpus(None, args.max_bytes).train, args.seq_len, args.batch, args.seed)
    torch.manual_seed(args.seed)
    model = Llama(LlamaConfig(vocab_size=256, dim=args.dim, n_layers=args.layers, n_heads=args.heads,
                              hidden_dim=int(args.dim * 8 / 3), max_seq_len=args.seq_len)).double()
    optimizer = torch.optim.AdamW(model.parameters(), lr=args.lr, betas=(0.9, 0.95), weight_decay=0.1)
    for step in range(steps):
        for group in optimizer.param_groups:
            group["lr"] = train.lr_at(step, args)
        slots = [2 * g + r for g in history[step + 1] for r in (0, 1)]  # group g, rank r: slot 2g + r of 4
        x, y = (torch.cat(t) for t in zip(*(batches.rank_batch(step, s, 4) for s in slots)))
        loss_fn(model(x), y).backward()
        optimizer.step()
        optimizer.zero_grad()
    want = model.state_dict()
    assert r["weights"].keys() == want.keys()
    for k, v in want.items():
        assert r["weights"][k].dtype == torch.float64
        assert (r["weights"][k] - v).abs().max().item() <= TOL64, k
