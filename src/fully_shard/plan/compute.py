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
    from .simulate import _tokens, call

    if repeats < 1:
        raise ValueError(f"measure_flops(repeats={repeats}): time at least one pass.")
    tokens = _tokens(sample_inputs)
    if tokens == 0:
        raise ValueError(
            "measure_flops: sample_inputs holds no tensor to count tokens from (token ids, or embeddings "
            "whose last dim is the hidden size). Fix: pass one rank's batch as a tensor, tuple or dict of "
            "tensors."
        )
    where = torch.device(device) if device is not None else _device()
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
    stepped = params if fp32 else [torch.zeros_like(p, dtype=torch.float32).requires_grad_() for p in params]

    def sync() -> None:
        if where.type != "cpu":
            torch.accelerator.synchronize(where)

    optimizer = torch.optim.AdamW(stepped, lr=1e-4)

    def one() -> tuple[float, float]:
        sync()
        start = time.perf_counter()
        out = call(model, inputs)
        loss = loss_fn(out) if loss_fn is not None else out.float().sum()
        loss.backward()
        sync()
        middle = time.perf_counter()
        if stepped is not params:
            for copy, p in zip(stepped, params):
                copy.grad = p.grad.float() if p.grad is not None else None
            sync()
            middle = time.perf_counter()
        optimizer.step()
        sync()
        end = time.perf_counter()
        optimizer.zero_grad()
        for p in params:
            p.grad = None
        return middle - start, end - middle

    one()  # warm-up: allocator, kernels' first-call costs, the optimizer's state
    runs = [one() for _ in range(repeats)]
    seconds = statistics.median(r[0] for r in runs)
    step = statistics.median(r[1] for r in runs)
    n = sum(p.numel() for p in model.parameters())
    elements = sum(p.numel() for p in stepped)
    return ComputeRate(
        6 * n * tokens / seconds,
        seconds,
        n,
        tokens,
        str(where),
        dtype,
        step,
        elements / step,
        _copy_rate(where, sync, repeats),
    )


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
