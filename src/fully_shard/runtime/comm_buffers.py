"""Where the staging buffers of a group's collectives come from, when not from the caching allocator:
``FSDPModule.set_allocate_memory_from_process_group_for_comm`` (the process group backend's own
allocator, where it has one: NCCL's, for zero-copy transfers) and ``set_symm_mem_for_comm`` (NCCL
symmetric memory, registered with every rank of the group). Each kind is a pair of PyTorch's comm
interfaces (``allocate`` and ``__call__``, as ``set_custom_all_gather`` takes), so the eager engine
runs them as it runs a custom collective. Compiled graphs allocate through Inductor (docs/compile.md).
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any, Optional

import torch
import torch.distributed as dist

from . import collectives


class _Comm:
    """A collective over ``group`` whose buffers come from ``allocate`` (`_BackendAlloc`, `_Symmetric`)."""

    def __init__(self, group: dist.ProcessGroup) -> None:
        self.group = group

    def __deepcopy__(self, memo: dict[int, Any]) -> "_Comm":
        return self  # holds a process group: a deep-copied module shares it

    def register(self, group: dist.ProcessGroup, *tensors: torch.Tensor) -> None:
        """Before a collective over ``group``: what its buffers need (symmetric memory's rendezvous)."""


class _AllGather(_Comm):
    def __call__(
        self, output_tensor: torch.Tensor, input_tensor: torch.Tensor, group: Any, async_op: bool = False
    ) -> Optional[dist.Work]:
        self.register(group, output_tensor)
        return collectives.all_gather(output_tensor, input_tensor, group, async_op)


class _ReduceScatter(_Comm):
    def __call__(
        self,
        output_tensor: torch.Tensor,
        input_tensor: torch.Tensor,
        group: Any,
        op: Any,
        async_op: bool = False,
    ) -> Optional[dist.Work]:
        self.register(group, input_tensor, output_tensor)
        return collectives.reduce_scatter(output_tensor, input_tensor, group, async_op, op)


class _BackendAlloc(_Comm):
    def allocate(self, size: Sequence[int], *, dtype: torch.dtype, device: torch.device) -> torch.Tensor:
        backend = self.group._get_backend(device)
        if backend.supports_tensor_alloc(device):
            flat = backend.allocate_tensor(math.prod(int(s) for s in size), dtype=dtype, device=device)
            return flat.view(*size)
        return torch.empty(*size, dtype=dtype, device=device)


class _Symmetric(_Comm):
    def allocate(self, size: Sequence[int], *, dtype: torch.dtype, device: torch.device) -> torch.Tensor:
        import torch.distributed._symmetric_memory as symm_mem

        # One pool per device: buffers are reused without a new rendezvous each time.
        with torch.get_device_module(device).use_mem_pool(symm_mem.get_mem_pool(device)):
            return torch.empty(*size, dtype=dtype, device=device)

    def register(self, group: dist.ProcessGroup, *tensors: torch.Tensor) -> None:
        import torch.distributed._symmetric_memory as symm_mem

        for t in tensors:
            symm_mem.rendezvous(t, group=group.group_name)


class BackendAllGather(_BackendAlloc, _AllGather):
    pass


class BackendReduceScatter(_BackendAlloc, _ReduceScatter):
    pass


class SymmetricAllGather(_Symmetric, _AllGather):
    pass


class SymmetricReduceScatter(_Symmetric, _ReduceScatter):
    pass


@dataclass(frozen=True)
class CommBuffers:
    """A group's buffer source: ``kind`` ("process_group" or "symm_mem") and its comms, the
    reduce-scatter's None where it keeps the caching allocator."""

    kind: str
    all_gather: Any
    reduce_scatter: Any

    def __deepcopy__(self, memo: dict[int, Any]) -> "CommBuffers":
        return self


def from_process_group(group: dist.ProcessGroup, rs_group: dist.ProcessGroup) -> CommBuffers:
    """Buffers from the backend allocator of the group each collective runs on (``rs_group``: the
    reduce-scatter's, which `set_separate_reduce_scatter_group` may make a group of its own)."""
    return CommBuffers("process_group", BackendAllGather(group), BackendReduceScatter(rs_group))


def has_allocator(group: dist.ProcessGroup, device: torch.device) -> bool:
    """Whether ``group``'s backend allocates tensors on ``device`` itself (NCCL can; gloo cannot)."""
    return bool(group._get_backend(device).supports_tensor_alloc(device))


def symmetric(group: dist.ProcessGroup, rs_group: dist.ProcessGroup, sum_only: bool) -> CommBuffers:
    """NCCL symmetric memory for the all-gather and, where every reduction is a SUM
    (``set_force_sum_reduction_for_comms``: NCCL's symmetric reduce-scatter sums only), the
    reduce-scatter (on ``rs_group``). Collective: every rank of the groups makes it (a barrier on
    each, so each communicator exists before its first rendezvous)."""
    import torch.distributed._symmetric_memory as symm_mem

    symm_mem.set_backend("NCCL")
    dist.barrier(group=group)
    if sum_only and rs_group is not group:
        dist.barrier(group=rs_group)
    return CommBuffers(
        "symm_mem", SymmetricAllGather(group), SymmetricReduceScatter(rs_group) if sum_only else None
    )


def remake(buffers: CommBuffers, group: dist.ProcessGroup, rs_group: dist.ProcessGroup) -> CommBuffers:
    """``buffers`` for a group whose reduce-scatter moved to ``rs_group``
    (`set_separate_reduce_scatter_group` after a buffer source was set)."""
    if buffers.kind == "process_group":
        return from_process_group(group, rs_group)
    return symmetric(group, rs_group, buffers.reduce_scatter is not None)
