"""Helpers that run inside rank processes: meshes, reference training, comparisons."""

from __future__ import annotations

import torch
import torch.distributed as dist
from torch.distributed.device_mesh import DeviceMesh, init_device_mesh
from torch.distributed.tensor import DTensor


def world() -> tuple[int, int]:
    return dist.get_rank(), dist.get_world_size()


def cpu_mesh() -> DeviceMesh:
    return init_device_mesh("cpu", (dist.get_world_size(),))


def full(t: torch.Tensor) -> torch.Tensor:
    return t.full_tensor() if isinstance(t, DTensor) else t


_WRAPPER_PREFIXES = ("_checkpoint_wrapped_module.", "_orig_mod.")


def _unwrapped(name: str) -> str:
    """The parameter's plain name: wrapper prefixes dropped, and a parametrized parameter
    (``torch.nn.utils.parametrize``: ``m.parametrizations.weight.original``) named ``m.weight``."""
    for prefix in _WRAPPER_PREFIXES:
        name = name.replace(prefix, "")
    if name.endswith(".original") and ".parametrizations." in name:
        module, _, param = name[: -len(".original")].rpartition(".parametrizations.")
        name = f"{module}.{param}"
    return name


def max_param_diff(model: torch.nn.Module, ref: torch.nn.Module) -> float:
    """Largest absolute difference between a sharded model's full parameters and a reference's
    (names matched without wrapper prefixes such as checkpoint_wrapper's)."""
    ours = {_unwrapped(n): p for n, p in model.named_parameters()}
    theirs = {_unwrapped(n): p for n, p in ref.named_parameters()}
    assert ours.keys() == theirs.keys(), (sorted(ours), sorted(theirs))
    diffs = []
    for k in ours:
        a = full(ours[k]).detach()
        b = theirs[k].detach().to(a.device)  # an offloaded shard gathers on the host
        assert a.shape == b.shape, (k, a.shape, b.shape)
        diffs.append((a - b).abs().max().item() if a.numel() else 0.0)  # a size-0 parameter: equal by shape
    return max(diffs)


def global_mean(x: torch.Tensor) -> float:
    """Mean over ranks of a per-rank scalar (the data-parallel loss on the global batch), summed in
    float64 so a float64 loss keeps its precision."""
    t = x.detach().clone().reshape(1).to(torch.float64)
    dist.all_reduce(t)
    return t.item() / dist.get_world_size()


class CollectiveLog(torch.utils._python_dispatch.TorchDispatchMode):
    """Records every c10d collective dispatched while active: ``(op name, input elements)``.

    Independent of fully_shard's own code: it watches the dispatcher, so it also sees collectives
    issued from autograd hooks during backward.
    """

    def __init__(self) -> None:
        super().__init__()
        self.calls: list[tuple[str, int]] = []

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        name = func._schema.name
        if name.startswith("c10d::"):
            op = name.split("::")[1]
            if "allgather" in op or "all_gather" in op:
                self.calls.append(("all_gather", args[1].numel()))
            elif "reduce_scatter" in op:
                self.calls.append(("reduce_scatter", args[1].numel()))
            else:
                self.calls.append((op, -1))
        return func(*args, **kwargs)

    def count(self, op: str) -> int:
        return sum(1 for name, _ in self.calls if name == op)

    def numel(self, op: str) -> int:
        return sum(n for name, n in self.calls if name == op)
