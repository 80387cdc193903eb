"""Opt-in finite check: which parameters' gradients went NaN/Inf, on which ranks. Each rank's own
gradient is flagged on the device *before* the reduction (after it, the source is lost); the last
backward before the step all-gathers the flags, so every rank gets the same report.
"""

from __future__ import annotations

import os
from dataclasses import dataclass
from typing import Optional, Sequence

import torch
import torch.distributed as dist

from ..runtime.collectives import all_gather_flat
from ..runtime.param import FSDPParam
from ..runtime.state import RootContext, StepVerdict

MODES = ("raise", "report")
ENV = "FULLY_SHARD_CHECK_FINITE"


def mode_from_env() -> Optional[str]:
    value = os.environ.get(ENV, "").strip().lower()
    if value in ("", "0", "off", "none"):
        return None
    if value not in MODES:
        raise ValueError(f"{ENV}={value!r}: expected one of {MODES} (or unset / off).")
    return value


@dataclass(frozen=True)
class NonFinite:
    """A parameter whose gradient had a NaN or Inf, and the ranks where it did (before reduction)."""

    param: str
    ranks: tuple[int, ...]


class NonFiniteGradients(StepVerdict):
    """Raised from ``backward()`` on every rank by the finite check in ``raise`` mode."""

    def __init__(self, report: Sequence[NonFinite]) -> None:
        self.report = list(report)
        listed = "; ".join(f"'{r.param}' on rank(s) {list(r.ranks)}" for r in self.report[:8])
        more = f" (and {len(self.report) - 8} more)" if len(self.report) > 8 else ""
        super().__init__(
            f"fully_shard: non-finite gradients (NaN/Inf) before the reduction: {listed}{more}. The "
            "optimizer step would write them into the shards. Fix: find what overflows on those ranks "
            "(learning rate, loss scaling, fp16 -> bf16), or skip such steps: "
            "model.set_grad_finite_check('report'), then `if model.nonfinite_grads(): "
            "optimizer.zero_grad()` instead of `optimizer.step()`."
        )


class FiniteCheck:
    """The flags of one root's trainable parameters, gathered once per step."""

    def __init__(self, mode: str, params: Sequence[FSDPParam], device: torch.device) -> None:
        self.mode = mode
        self.params = list(params)
        self._index = {id(p): i for i, p in enumerate(self.params)}
        self.flags = torch.zeros(len(self.params), dtype=torch.uint8, device=device)
        self.report: list[NonFinite] = []

    def observe(self, p: FSDPParam, grad: torch.Tensor) -> None:
        """Flag ``p`` if this rank's gradient, before its reduction, is not finite."""
        i = self._index.get(id(p))
        if i is not None and grad.numel():
            self.flags[i] |= (~torch.isfinite(grad).all()).to(torch.uint8)

    def conclude(self) -> None:
        """End of the last backward before the step: gather the report; ``raise`` mode raises it."""
        if self.gather() and self.mode == "raise":
            raise NonFiniteGradients(self.report)

    def gather(self) -> list[NonFinite]:
        """This step's report from every rank's flags (one all-gather over all ranks); resets them."""
        world = dist.get_world_size() if dist.is_initialized() else 1
        if world > 1:
            gathered = torch.empty(world * len(self.params), dtype=torch.uint8, device=self.flags.device)
            all_gather_flat(gathered, self.flags)
            table = gathered.view(world, -1).cpu()
        else:
            table = self.flags.view(1, -1).to("cpu", copy=True)  # a copy: the flags are reset below
        self.flags.zero_()
        self.report = [
            NonFinite(p.path, tuple(int(r) for r in torch.nonzero(table[:, i]).flatten()))
            for i, p in enumerate(self.params)
            if bool(table[:, i].any())
        ]
        return self.report


def configure(ctx: RootContext) -> None:
    """Turn the check on or off for every group under the root ``ctx`` (lazy init, and
    ``set_grad_finite_check``)."""
    setting = ctx.root.settings.grad_finite_check
    mode = mode_from_env() if setting == "env" else None if setting == "off" else setting
    params = [p for s in ctx.states for g in s.own for p in g.params]
    check = FiniteCheck(mode, params, ctx.root.info.device) if mode is not None else None
    ctx.gradient_check = check
    for s in ctx.states:
        for g in s.own:
            g.grad_observer = check.observe if check is not None else None
