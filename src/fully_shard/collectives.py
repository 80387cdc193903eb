"""Pure functions over flat buffers: copy-in, all-gather, copy-out, reduce-scatter.

Layout shared by both directions, for a group whose parameters contribute ``s_1 .. s_k`` elements
per rank (padding included) and ``S = sum(s_i)``: a flat buffer of ``W * S`` elements is viewed
as ``(W, S)``; row ``r`` is rank ``r``'s slot, and inside it parameter ``i`` occupies columns
``[s_1 + .. + s_{i-1}, .. + s_i)``. All-gather fills every row; reduce-scatter leaves rank ``r``
with the sum of row ``r``.
"""

from __future__ import annotations

from typing import Optional, Sequence

import torch
import torch.distributed as dist

# torch 2.13 renamed the flat-tensor collectives; 2.11 only has the old names.
_all_gather_flat = getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor
_reduce_scatter_flat = getattr(dist, "reduce_scatter_single", None) or dist.reduce_scatter_tensor


def all_gather_copy_in(
    inputs: Sequence[torch.Tensor], world_size: int, rank: int, dtype: torch.dtype, device: torch.device
) -> tuple[torch.Tensor, torch.Tensor]:
    """Allocate the all-gather output (``W * S`` elements of ``dtype``, held as bytes) and copy
    this rank's inputs into its own slot, casting them to ``dtype`` on the way (no temporaries).

    Returns ``(input, output)`` as byte tensors; the input is a view of the output (an in-place
    all-gather), so copy-in costs one buffer, not two.
    """
    slot = sum(t.numel() for t in inputs)
    nbytes = slot * dtype.itemsize
    output = torch.empty(world_size * nbytes, dtype=torch.uint8, device=device)
    ag_input = output.narrow(0, rank * nbytes, nbytes)
    views = ag_input.view(dtype).split([t.numel() for t in inputs])
    torch._foreach_copy_(list(views), [t.reshape(-1) for t in inputs])
    return ag_input, output


def all_gather(
    output: torch.Tensor, ag_input: torch.Tensor, group: dist.ProcessGroup, async_op: bool
) -> Optional[dist.Work]:
    return _all_gather_flat(output, ag_input, group=group, async_op=async_op)


def all_gather_copy_out(output: torch.Tensor, world_size: int, outs: Sequence[torch.Tensor]) -> None:
    """Scatter the ``(W, S)`` all-gather output into each parameter's ``(W, s_i)`` buffer."""
    split_sizes = [out.shape[1] for out in outs]
    torch.split_with_sizes_copy(output.view(world_size, -1), split_sizes, dim=1, out=list(outs))


def reduce_scatter_copy_in(
    grads: Sequence[torch.Tensor], world_size: int, slot: int, dtype: torch.dtype, device: torch.device
) -> torch.Tensor:
    """Pad each gradient's dim 0 to a multiple of ``W`` and lay the ranks' chunks out as ``(W, S)``.

    ``slot`` is ``S``: the padded shard sizes of these gradients' parameters, summed.
    """
    flat = torch.empty(world_size, slot, dtype=dtype, device=device)
    torch._chunk_cat(list(grads), dim=0, num_chunks=world_size, out=flat)  # casts into ``dtype``
    return flat.view(-1)


def reduce_scatter(
    output: torch.Tensor, rs_input: torch.Tensor, group: dist.ProcessGroup, async_op: bool
) -> Optional[dist.Work]:
    # SUM, then divide by the world size ourselves: gloo has no AVG for every dtype, and the
    # division point is where low-precision reductions will need control.
    return _reduce_scatter_flat(output, rs_input, op=dist.ReduceOp.SUM, group=group, async_op=async_op)


def all_reduce(tensor: torch.Tensor, group: dist.ProcessGroup) -> None:
    """HSDP: sum the replicas' reduce-scatter outputs. Synchronous on CPU (it runs when the
    reduce-scatter is waited for); stream-ordered on accelerators."""
    dist.all_reduce(tensor, op=dist.ReduceOp.SUM, group=group)
