"""Compute rate measured on this machine: the time model's ``flops`` for a given model, from a
real forward and backward of it here (the alternative to a preset's number)."""

from __future__ import annotations

import dataclasses
import statistics
import time
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Callable, Optional

import torch
import torch.nn as nn
from torch.utils._pytree import tree_map_only

if TYPE_CHECKING:
    from .timing import Cluster


@dataclass(frozen=True)
class ComputeRate:
    """What one measurement found: ``flops`` (per second) = ``6 * parameters * tokens / seconds``,
    the count `timing.estimate` prices compute with, so a one-rank plan of the same model and
    batch estimates ``seconds`` of compute again; and AdamW's step over the same parameters
    (``optimizer_elements_per_s``, the rate `timing.estimate` prices the device's step with)."""

    flops: float
    seconds: float  # median forward + backward time
    parameters: int
    tokens: int
    device: str
    dtype: Optional[torch.dtype]
    optimizer_seconds: float = 0.0  # median AdamW step
    optimizer_elements_per_s: float = 0.0
    memory_bytes_per_s: float = 0.0  # a large copy's bytes read and written per second

    def on(self, cluster: "Cluster") -> "Cluster":
        """``cluster`` computing, stepping the optimizer and copying at these rates."""
        return dataclasses.replace(
            cluster,
            flops=self.flops,
            optimizer_elements_per_s=self.optimizer_elements_per_s,
            memory_bytes_per_s=self.memory_bytes_per_s,
        )


def _device() -> torch.device:
    accelerator = torch.accelerator.current_accelerator() if torch.accelerator.is_available() else None
    return accelerator if accelerator is not None else torch.device("cpu")


def measure_flops(
    build_model: Callable[[], nn.Module],
    sample_inputs: Any,
    *,
    device: Any = None,
    dtype: Optional[torch.dtype] = None,
    repeats: int = 3,
    loss_fn: Optional[Callable[[Any], torch.Tensor]] = None,
) -> ComputeRate:
    """Build the model on ``device`` (default: this machine's accelerator, else the CPU) for real,
    optionally cast to ``dtype`` (e.g. bfloat16, to price mixed-precision compute), and time
    ``repeats`` forward + backward passes of ``sample_inputs`` (one rank's batch), and AdamW's
    step after each (on fp32 parameters, as a mixed-precision run's shards are), after one warm-up.
    It allocates the whole model, its gradients and activations: for a model that does not fit here,
    measure a builder with fewer layers of the same shape (the rate carries over)."""
    tokens = _checked_tokens(sample_inputs, repeats)
    where = torch.device(device) if device is not None else _device()
    bench = _Bench.build(build_model, sample_inputs, where, dtype, loss_fn)
    bench.one()  # warm-up: allocator, kernels' first-call costs, the optimizer's state
    runs = [bench.one() for _ in range(repeats)]
    seconds = statistics.median(r[0] for r in runs)
    step = statistics.median(r[1] for r in runs)
    n = sum(p.numel() for p in bench.model.parameters())
    elements = sum(p.numel() for p in bench.stepped)
    return ComputeRate(
        6 * n * tokens / seconds,
        seconds,
        n,
        tokens,
        str(where),
        dtype,
        step,
        elements / step,
        _copy_rate(where, bench.sync, repeats),
    )


def _checked_tokens(sample_inputs: Any, repeats: int) -> int:
    """The tokens in one rank's batch, once ``measure_flops``' arguments are checked."""
    from .simulate import _tokens

    if repeats < 1:
        raise ValueError(f"measure_flops(repeats={repeats}): time at least one pass.")
    tokens = _tokens(sample_inputs)
    if tokens == 0:
        raise ValueError(
            "measure_flops: sample_inputs holds no tensor to count tokens from (token ids, or embeddings "
            "whose last dim is the hidden size). Fix: pass one rank's batch as a tensor, tuple or dict of "
            "tensors."
        )
    return tokens


@dataclass
class _Bench:
    """The model built here with its inputs, and AdamW over what it steps: ``one`` times a forward
    + backward and an optimizer step."""

    model: nn.Module
    inputs: Any
    where: torch.device
    params: list[nn.Parameter]
    stepped: list[torch.Tensor]  # ``params``, or fp32 copies of them
    optimizer: torch.optim.Optimizer
    loss_fn: Optional[Callable[[Any], torch.Tensor]]

    @classmethod
    def build(
        cls,
        build_model: Callable[[], nn.Module],
        sample_inputs: Any,
        where: torch.device,
        dtype: Optional[torch.dtype],
        loss_fn: Optional[Callable[[Any], torch.Tensor]],
    ) -> _Bench:
        with torch.device(where):
            model = build_model()
        if dtype is not None:
            model.to(dtype)
        cast = dtype if dtype is not None and dtype.is_floating_point else None
        inputs = tree_map_only(
            torch.Tensor,
            lambda t: t.to(where, dtype=cast if cast is not None and t.is_floating_point() else t.dtype),
            sample_inputs,
        )
        params = [p for p in model.parameters() if p.requires_grad]
        # The optimizer steps the shards in the model's own dtype (fp32 here) whatever the compute
        # dtype (MixedPrecisionPolicy keeps them so): time it on fp32 copies when computing in another.
        fp32 = dtype in (None, torch.float32)
        stepped = (
            params if fp32 else [torch.zeros_like(p, dtype=torch.float32).requires_grad_() for p in params]
        )
        return cls(model, inputs, where, params, stepped, torch.optim.AdamW(stepped, lr=1e-4), loss_fn)

    def sync(self) -> None:
        if self.where.type != "cpu":
            torch.accelerator.synchronize(self.where)

    def one(self) -> tuple[float, float]:
        """Seconds of one forward + backward, and of the optimizer step after it."""
        from .simulate import call

        self.sync()
        start = time.perf_counter()
        out = call(self.model, self.inputs)
        loss = self.loss_fn(out) if self.loss_fn is not None else out.float().sum()
        loss.backward()
        self.sync()
        middle = time.perf_counter()
        if self.stepped is not self.params:
            for copy, p in zip(self.stepped, self.params):
                copy.grad = p.grad.float() if p.grad is not None else None
            self.sync()
            middle = time.perf_counter()
        self.optimizer.step()
        self.sync()
        end = time.perf_counter()
        self.optimizer.zero_grad()
        for p in self.params:
            p.grad = None
        return middle - start, end - middle


def _copy_rate(
    where: torch.device, sync: Callable[[], None], repeats: int, nbytes: int = 64 * 2**20
) -> float:
    """Bytes read and written per second by a large device-to-device copy (fully_shard's copies)."""
    src = torch.empty(nbytes, dtype=torch.uint8, device=where)
    dst = torch.empty_like(src)
    times = []
    for _ in range(repeats + 1):  # the first warms up
        sync()
        start = time.perf_counter()
        dst.copy_(src)
        sync()
        times.append(time.perf_counter() - start)
    return 2 * nbytes / statistics.median(times[1:])
