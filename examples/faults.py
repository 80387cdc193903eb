"""Faults on purpose, for drills and tests of the main job's restart path (docs/fault_tolerance.md).

``--kill-at-step N --kill-rank R`` makes rank R kill itself with SIGKILL (nothing is flushed, no
handler runs: a machine or process lost) in the middle of step N's backward, after the later half
of the blocks' gradients were computed and reduced. ``--kill-in-save N`` does it while the
checkpoint of step N is being written: after this rank wrote its shards, before the checkpoint is
published. Only the first attempt is killed: when ``torchrun --max-restarts`` relaunches the job
(``TORCHELASTIC_RESTART_COUNT`` > 0), nothing is armed, so the restarted job runs through.
"""

from __future__ import annotations

import os
import signal
import sys
import time
from typing import Callable, Optional

import torch


def restart_count() -> int:
    """How many times torchrun has relaunched this job's workers (0: the first attempt)."""
    return int(os.environ.get("TORCHELASTIC_RESTART_COUNT", "0"))


def _die(what: str) -> None:
    print(f"fault: rank {os.environ.get('RANK', '?')} killed {what} at t={time.time():.3f}", file=sys.stderr,
          flush=True)
    os.kill(os.getpid(), signal.SIGKILL)


class Faults:
    def __init__(self, kill_at_step: Optional[int], kill_in_save: Optional[int], kill_rank: int, rank: int) -> None:
        armed = restart_count() == 0 and rank == kill_rank
        self.kill_at_step = kill_at_step if armed else None
        self.kill_in_save = kill_in_save if armed else None

    def arm_backward(self, model: torch.nn.Module, step: int) -> None:
        """Before step ``step``'s forward: if it is the one to die in, hook the output of the middle
        block so that its gradient's arrival (half-way through backward) kills this rank."""
        if self.kill_at_step is None or step + 1 != self.kill_at_step:
            return
        blocks = list(model.layers)
        middle = blocks[len(blocks) // 2]

        def on_output(module, args, output):
            output.register_hook(lambda grad: _die(f"in the backward of step {step + 1}"))
            handle.remove()

        handle = middle.register_forward_hook(on_output)

    def in_save(self, step: int) -> Callable[[], None] | None:
        """What the checkpoint writer calls once this rank's shards of step ``step`` are written."""
        if self.kill_in_save is None or step != self.kill_in_save:
            return None
        return lambda: _die(f"while saving the checkpoint of step {step}")
