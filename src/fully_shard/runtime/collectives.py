"""Pure functions over flat buffers: copy-in, all-gather, copy-out, reduce-scatter.

The layout both directions share, for a group whose parameters put ``s_1 .. s_k`` elements (padding
included) in each rank's slot of ``S = sum(s_i)``: a flat ``W * S`` buffer viewed as ``(W, S)``,
row ``r`` rank ``r``'s slot, parameter ``i`` in columns ``[s_1 + .. + s_{i-1}, .. + s_i)``.
All-gather fills every row; reduce-scatter leaves rank ``r`` with the sum of row ``r``.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist

# torch 2.13 renamed the flat-tensor collectives; 2.11 only has the old names.
all_gather_flat = getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor
reduce_scatter_flat = getattr(dist, "reduce_scatter_single", None) or dist.reduce_scatter_tensor


def empty_buffer(size: int, dtype: torch.dtype, device: torch.device, comm: Any) -> torch.Tensor:
    """From a custom comm's ``allocate`` when there is one, else the caching allocator."""
    if comm is None:
        return torch.empty(size, dtype=dtype, device=device)
    return comm.allocate((size,), dtype=dtype, device=device)


def all_gather_copy_in(
    inputs: Sequence[torch.Tensor],
    world_size: int,
    rank: int,
    dtype: torch.dtype,
    device: torch.device,
    comm: Any = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Allocate the ``(W, S)`` output (as bytes) and cast this rank's inputs into its own row.

    Returns ``(input, output)``: the input is a view of the output (an in-place all-gather), so
    copy-in costs one buffer, not two.
    """
    numels, flats = [], []
    for t in inputs:
        numels.append(t.numel())
        flats.append(t.reshape(-1))
    nbytes = sum(numels) * dtype.itemsize
    output = empty_buffer(world_size * nbytes, torch.uint8, device, comm)
    ag_input = output.narrow(0, rank * nbytes, nbytes)
    torch._foreach_copy_(list(ag_input.view(dtype).split(numels)), flats)
    return ag_input, output


def all_gather(
    output: torch.Tensor, ag_input: torch.Tensor, group: dist.ProcessGroup, async_op: bool, comm: Any = None
) -> dist.Work | None:
    if comm is not None:  # a custom AllGather: PyTorch's interface, called by keyword as PyTorch does
        return comm(output_tensor=output, input_tensor=ag_input, group=group, async_op=async_op)
    return all_gather_flat(output, ag_input, group=group, async_op=async_op)


def all_gather_copy_out(output: torch.Tensor, world_size: int, outs: Sequence[torch.Tensor]) -> None:
    """Scatter the ``(W, S)`` output into each parameter's ``(W, s_i)`` buffer."""
    split_sizes = []
    for out in outs:
        split_sizes.append(out.shape[1])
    torch.split_with_sizes_copy(output.view(world_size, -1), split_sizes, dim=1, out=list(outs))


def reduce_scatter_copy_in(
    grads: Sequence[torch.Tensor],
    world_size: int,
    slot: int,
    dtype: torch.dtype,
    device: torch.device,
    comm: Any = None,
) -> torch.Tensor:
    """Pad each gradient's dim 0 to a multiple of ``W`` and lay the chunks out as ``(W, slot)``."""
    flat = empty_buffer(world_size * slot, dtype, device, comm).view(world_size, slot)
    torch._chunk_cat(list(grads), dim=0, num_chunks=world_size, out=flat)  # casts into ``dtype``
    return flat.view(-1)


@dataclass(frozen=True)
class Reduction:
    """Divide by ``before``, reduce-scatter with ``op``, all-reduce across HSDP replicas with
    ``all_reduce_op``, divide by ``after``. ``name`` is what traces show."""

    before: float
    op: Any
    all_reduce_op: Any
    after: float
    name: str


def split_divide_factor(factor: float, dtype: torch.dtype) -> tuple[float, float]:
    """(before, after) the sum. fp16/bf16 divide first by the smallest power of two ``p`` with
    ``factor / p <= p`` (about sqrt(factor), exact; as PyTorch's FSDPs do): at 2 ranks by 2, so two
    gradients below the dtype's max cannot sum past it; the rest after, so small values do not
    underflow."""
    if dtype not in (torch.float16, torch.bfloat16) or factor <= 1:
        return 1.0, factor
    before = 1.0
    while factor % before == 0 and factor / before > before:
        before *= 2
    return before, factor / before


def plan_reduction(
    factor: float, dtype: torch.dtype, rs_size: int, dp_size: int, native_avg: bool, force_sum: bool
) -> Reduction:
    """The reduction dividing by ``factor``. With in-kernel averaging (``native_avg``: NCCL), fp32
    and bf16 use AVG or PreMulSum(1 / factor): no division kernels. Otherwise, or with
    ``force_sum``: SUM, dividing around it (`split_divide_factor`)."""
    sum_op = dist.ReduceOp.SUM
    # rs_size > 1: with one shard rank the reduce-scatter is skipped, and its division with it.
    if native_avg and not force_sum and dtype in (torch.float32, torch.bfloat16) and rs_size > 1:
        if factor == dp_size:
            return Reduction(1.0, dist.ReduceOp.AVG, dist.ReduceOp.AVG, 1.0, "avg")
        if factor == rs_size:
            return Reduction(1.0, dist.ReduceOp.AVG, sum_op, 1.0, "avg")
        return Reduction(1.0, dist._make_nccl_premul_sum(1.0 / factor), sum_op, 1.0, "premul_sum")
    before, after = split_divide_factor(factor, dtype)
    return Reduction(before, sum_op, sum_op, after, "sum")


def reduce_scatter(
    output: torch.Tensor,
    rs_input: torch.Tensor,
    group: dist.ProcessGroup,
    async_op: bool,
    op: Any,
    comm: Any = None,
) -> dist.Work | None:
    if rs_input.is_complex():  # summed as (real, imag) pairs: each rank's chunk stays whole
        output, rs_input = torch.view_as_real(output).view(-1), torch.view_as_real(rs_input).view(-1)
    if comm is not None:  # a custom ReduceScatter: PyTorch's interface, called by keyword
        return comm(output_tensor=output, input_tensor=rs_input, group=group, op=op, async_op=async_op)
    return reduce_scatter_flat(output, rs_input, op=op, group=group, async_op=async_op)
