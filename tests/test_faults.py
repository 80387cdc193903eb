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


def test_a_rank_killed_in_backward_restarts_and_resumes_bit_identically(tmp_path):
    whole, hurt = str(tmp_path / "whole"), str(tmp_path / "hurt")
    _run(2, whole, "--steps", "8", "--ckpt-every", "3")
    done = _with_restarts(hurt, "--steps", "8", "--ckpt-every", "3", "--kill-at-step", "5", "--kill-rank", "1")
    text = done.stdout + done.stderr
    assert "fault: rank 1 killed in the backward of step 5" in text, text[-3000:]
    assert re.search(r"resumed from .*step_00000003 at t=[0-9.]+ \(restart 1 by torchrun\)", text), text[-3000:]
    a, b = _losses(whole), _losses(hurt)
    assert len(a) == len(b) == 8 and a == b, (a, b)


def test_a_rank_killed_while_saving_never_loads_the_half_written_checkpoint(tmp_path):
    whole, hurt = str(tmp_path / "whole"), str(tmp_path / "hurt")
    _run(2, whole, "--steps", "8", "--ckpt-every", "3")
    done = _with_restarts(hurt, "--steps", "8", "--ckpt-every", "3", "--kill-in-save", "6", "--kill-rank", "1")
    text = done.stdout + done.stderr
    assert "fault: rank 1 killed while saving the checkpoint of step 6" in text, text[-3000:]
    assert re.search(r"resumed from .*step_00000003 at", text), text[-3000:]  # not the half-written step 6
    a, b = _losses(whole), _losses(hurt)
    assert a == b, (a, b)
    ckpt = os.path.join(hurt, "ckpt")
    assert sorted(os.listdir(ckpt)) == ["latest", "step_00000006", "step_00000008"], os.listdir(ckpt)
