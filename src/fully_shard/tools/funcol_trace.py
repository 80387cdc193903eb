"""DTensor's own collectives in a trace (``fully_shard.debug.trace(dtensor=True)``; the planner too).

Tensor/sequence parallel and other redistributes run PyTorch's functional collectives, which our
comm layer never sees. This dispatch mode reports each to a `debug.Trace` with phase
``dtensor_forward`` or ``dtensor_backward``, the innermost module running (PyTorch's
``ModuleTracker``: exact to the block in backward, approximate below it) and our byte convention.
It sees every op, so it is off unless asked for.
"""

from __future__ import annotations

from typing import Any, Protocol

import torch
import torch.distributed as dist
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils.module_tracker import ModuleTracker


class RecordSink(Protocol):
    """Where records go (a `fully_shard.debug.Trace`)."""

    def add_record(
        self,
        phase: str,
        module: str,
        op: str,
        dtype: torch.dtype,
        nbytes: int,
        group_size: int,
        group_name: str,
        *,
        rank_span: tuple[int, int],
    ) -> None: ...


def _nbytes(tensors: Any) -> int:
    if isinstance(tensors, torch.Tensor):
        return tensors.numel() * tensors.element_size()
    return sum(t.numel() * t.element_size() for t in tensors)


def _first(tensors: Any) -> torch.Tensor:
    return tensors if isinstance(tensors, torch.Tensor) else tensors[0]


def _ops() -> dict[Any, str]:
    """Functional collective -> our op name."""
    import torch.distributed._functional_collectives  # noqa: F401  (registers the ops)

    f = torch.ops._c10d_functional
    return {
        f.all_gather_into_tensor.default: "all_gather",
        f.all_gather_into_tensor_coalesced.default: "all_gather",
        f.reduce_scatter_tensor.default: "reduce_scatter",
        f.reduce_scatter_tensor_coalesced.default: "reduce_scatter",
        f.all_reduce.default: "all_reduce",
        f.all_reduce_coalesced.default: "all_reduce",
        f.all_to_all_single.default: "all_to_all",
    }


class FunctionalCollectiveTrace(TorchDispatchMode):
    """Report each functional collective run inside it to ``trace``."""

    def __init__(self, trace: RecordSink) -> None:
        super().__init__()
        self.trace = trace
        self.ops = _ops()
        self.modules = ModuleTracker()
        self._groups: dict[str, tuple[int, tuple[int, int]]] = {}

    def __enter__(self) -> "FunctionalCollectiveTrace":
        self.modules.__enter__()
        try:
            return super().__enter__()
        except BaseException:
            self.modules.__exit__(None, None, None)
            raise

    def __exit__(self, *exc: Any) -> Any:
        try:
            return super().__exit__(*exc)
        finally:
            self.modules.__exit__(*exc)

    def _group(self, name: str) -> tuple[int, tuple[int, int]]:
        """A group's size and the lowest and highest global rank in it, once per group."""
        if name not in self._groups:
            from torch.distributed.distributed_c10d import _resolve_process_group

            group = _resolve_process_group(name)
            ranks = dist.get_process_group_ranks(group)
            self._groups[name] = (group.size(), (min(ranks), max(ranks)))
        return self._groups[name]

    def _module(self) -> str:
        # Deepest first, then by name: ``parents`` is a set, and in backward it may hold siblings.
        inner = max(
            (p for p in self.modules.parents if p != "Global"), key=lambda p: (p.count("."), p), default=""
        )
        return inner.partition(".")[2] or "<root>"  # drop the root's class name

    def __torch_dispatch__(self, func: Any, types: Any, args: Any = (), kwargs: Any = None) -> Any:
        out = func(*args, **(kwargs or {}))
        op = self.ops.get(func)
        if op is not None:
            name = kwargs["group_name"] if kwargs and "group_name" in kwargs else args[-1]
            size, span = self._group(name)
            phase = "dtensor_backward" if torch._C._current_graph_task_id() != -1 else "dtensor_forward"
            # Our byte convention: an all-gather's output, the input of every other collective.
            nbytes = _nbytes(out if op == "all_gather" else args[0])
            dtype = _first(args[0]).dtype
            self.trace.add_record(phase, self._module(), op, dtype, nbytes, size, name, rank_span=span)
        return out
