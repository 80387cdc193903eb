"""The user's own communication code in a compiled graph: the all-reduce hook
(``set_all_reduce_hook``, e.g. torchft's ``Manager.allreduce``) and custom collectives
(``set_custom_all_gather`` / ``set_custom_reduce_scatter``, PyTorch's comm interface) run as opaque
custom ops. Dynamo and Inductor see an op with a known output, not its Python: no graph break, and
at run time each op calls what the group's settings hold then, as the eager engine does. The
compiler cannot reorder or bucket what happens inside (the op returns when its work is done).

Each op takes a key: the ``id`` of the group's first `FSDPParam` (`registry.managed_by_id`: every
manager, a deep copy's too), whose group holds the settings.
"""

from __future__ import annotations

from typing import Any, Callable

import torch
import torch.distributed as dist

from . import collectives
from .registry import managed_by_id


def _group(key: int, what: str, read: Callable[[Any], Any]) -> tuple[Any, Any]:
    fp: Any = managed_by_id(key)
    found = read(fp.group.settings) if fp is not None and fp.group is not None else None
    if found is None:  # dynamo guards on the settings: a graph runs with what it was traced for
        raise RuntimeError(
            f"fully_shard: a compiled graph calls the {what} of a parameter group that no longer has "
            "one (the model was freed or the setting cleared without a recompile). Fix: compile again "
            "after changing it (torch._dynamo.reset())."
        )
    return fp.group, found


@torch.library.custom_op("fully_shard::all_reduce_hook", mutates_args=("output",))
def all_reduce_hook(output: torch.Tensor, key: int) -> None:
    """The group's ``set_all_reduce_hook`` on its reduced shard, in place (on its stream, if set)."""
    group, _ = _group(key, "all-reduce hook", lambda s: s.all_reduce_hook)
    group._run_all_reduce_hook(output)


@all_reduce_hook.register_fake
def _(output: torch.Tensor, key: int) -> None:
    return None


@torch.library.custom_op("fully_shard::custom_all_gather", mutates_args=())
def custom_all_gather(flat_in: torch.Tensor, key: int, world: int) -> torch.Tensor:
    """Every rank's ``flat_in`` end to end, by the group's custom all-gather, through eager's own
    copy-in and call (bytes, in a buffer from the comm's ``allocate``, this rank's row copied in)."""
    group, comm = _group(key, "custom all-gather", lambda s: s.custom_all_gather)
    info = group.info
    ag_input, output = collectives.all_gather_copy_in(
        [flat_in], world, info.rank, flat_in.dtype, flat_in.device, comm
    )
    _wait(collectives.all_gather(output, ag_input, info.group, False, comm))
    return output.view(flat_in.dtype)


@custom_all_gather.register_fake
def _(flat_in: torch.Tensor, key: int, world: int) -> torch.Tensor:
    return flat_in.new_empty((world * flat_in.numel(),))


@torch.library.custom_op("fully_shard::custom_reduce_scatter", mutates_args=())
def custom_reduce_scatter(rs_input: torch.Tensor, key: int, world: int) -> torch.Tensor:
    """This rank's slot of the sum over ranks of ``rs_input``, by the group's custom reduce-scatter
    (SUM: the traced reduction divides around it), its buffers from the comm's ``allocate``."""
    group, comm = _group(key, "custom reduce-scatter", lambda s: s.custom_reduce_scatter)
    n, dtype, device = rs_input.numel(), rs_input.dtype, rs_input.device
    flat = collectives.empty_buffer(n, dtype, device, comm)
    flat.copy_(rs_input.reshape(-1))
    output = collectives.empty_buffer(n // world, dtype, device, comm)
    _wait(
        collectives.reduce_scatter(output, flat, group.reduce_scatter_group, False, dist.ReduceOp.SUM, comm)
    )
    return output


@torch.library.custom_op("fully_shard::kept_rows", mutates_args=())
def kept_rows(whole: torch.Tensor, size: int, pos: int) -> torch.Tensor:
    """A custom all-gather's rows (``whole``: one per rank) that ``reshard_after_forward=size``
    keeps at this rank's position ``pos``: those of ranks ``pos, pos + size, ...``, a tensor of
    their own (the traced path saves this op's output for backward, `traced._recompute`)."""
    return whole.view(whole.shape[0] // size, size, -1)[:, pos].clone()


@kept_rows.register_fake
def _(whole: torch.Tensor, size: int, pos: int) -> torch.Tensor:
    return whole.new_empty((whole.shape[0] // size, *whole.shape[1:]))


def _wait(work: Any) -> None:
    if work is not None:
        work.wait()


@custom_reduce_scatter.register_fake
def _(rs_input: torch.Tensor, key: int, world: int) -> torch.Tensor:
    return rs_input.new_empty((rs_input.numel() // world,))
