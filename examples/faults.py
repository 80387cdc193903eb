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
        self.step = -1  # the step being computed (`arm_backward`)

    def arm_backward(self, model: torch.nn.Module, step: int, compiled: bool = False) -> None:
        """Before step ``step``'s forward: if it is the one to die in, hook the output of the middle
        block so that its gradient's arrival (half-way through backward) kills this rank.
        ``compiled`` (the step compiled whole: dynamo would trace a forward hook): `arm_compiled`
        did it once, before the first step."""
        self.step = step
        if self.kill_at_step is None or step + 1 != self.kill_at_step or compiled:
            return
        blocks = list(model.layers)
        middle = blocks[len(blocks) // 2]

        def on_output(module, args, output):
            output.register_hook(lambda grad: _die(f"in the backward of step {step + 1}"))
            handle.remove()

        handle = middle.register_forward_hook(on_output)

    def arm_compiled(self, model: torch.nn.Module, inner: Optional[Callable[[torch.Tensor], None]] = None) -> None:
        """For a step compiled whole, before its first compile: the middle block's all-reduce hook
        (an op of the compiled backward graph, run once that block's gradients are reduced in the
        group) kills this rank in the step to die in; otherwise it calls ``inner`` (torchft's
        all-reduce across the replica groups, with ``--ft``)."""
        if self.kill_at_step is None:
            return
        blocks = list(model.layers)
        what = f"in the backward of step {self.kill_at_step}"

        def hook(reduced: torch.Tensor) -> None:
            if self.step + 1 == self.kill_at_step:
                _die(what)
            if inner is not None:
                inner(reduced)

        blocks[len(blocks) // 2].set_all_reduce_hook(hook)

    def in_save(self, step: int) -> Callable[[], None] | None:
        """What the checkpoint writer calls once this rank's shards of step ``step`` are written."""
        if self.kill_in_save is None or step != self.kill_in_save:
            return None
        return lambda: _die(f"while saving the checkpoint of step {step}")
