"""Issue #26 item 1: a rank killed with SIGKILL (in a backward, or while a checkpoint is being
written) under ``torchrun --max-restarts 1``: the job restarts on its own, resumes from the last
complete checkpoint, and its losses are bit for bit an uninterrupted run's."""

from __future__ import annotations

import os
import re
import subprocess
import sys

from test_main_job import SMALL, TRAIN, _losses, _run


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
