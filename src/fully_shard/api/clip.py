"""``clip_grad_norm_`` over gradients sharded on any number of meshes.

torch's version stacks per-parameter norms, which fails for DTensors on two meshes (dense layers
and experts); this one reduces each gradient's local part over the mesh dims that shard it.
"""

from __future__ import annotations

from typing import Iterable, Optional, Union

import torch
import torch.distributed as dist
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.tensor import DTensor, Partial, Replicate

from ..layouts.mesh import mesh_device

_Params = Union[torch.Tensor, Iterable[torch.Tensor]]


def _sharded_dims(grad: DTensor, fqn: str) -> tuple[int, ...]:
    dims = []
    for i, p in enumerate(grad.placements):
        if isinstance(p, Partial):
            raise ValueError(
                f"gradient {fqn} has a Partial placement on mesh dim {i}; reduce it first (its parameter's "
                "gradients should be Shard or Replicate after fully_shard's reduction)."
            )
        if not isinstance(p, Replicate):
            dims.append(i)
    return tuple(dims)


def _local_power_sum(tensors: list[torch.Tensor], norm_type: float) -> torch.Tensor:
    """Sum of |x|^p over the local elements (max |x| for the inf-norm), in fp32 or wider."""
    norms = torch.stack(
        [
            torch.linalg.vector_norm(t, norm_type, dtype=torch.promote_types(t.dtype, torch.float32))
            for t in tensors
        ]
    )
    if norm_type == float("inf"):
        return norms.max()
    return (norms**norm_type).sum()


def total_norm(grads: list[torch.Tensor], norm_type: float = 2.0) -> torch.Tensor:
    """The global ``norm_type``-norm of ``grads`` (DTensors on any meshes and plain tensors)."""
    is_inf = norm_type == float("inf")
    by_reduction: dict[tuple[DeviceMesh, tuple[int, ...]], list[torch.Tensor]] = {}
    plain: list[torch.Tensor] = []
    for i, g in enumerate(grads):
        if isinstance(g, DTensor):
            key = (g.device_mesh, _sharded_dims(g, f"#{i}"))
            by_reduction.setdefault(key, []).append(g._local_tensor)  # type: ignore[attr-defined]
        else:
            plain.append(g)  # not sharded: the same on every rank, counted once
    device = grads[0].device if grads else torch.device("cpu")
    parts = [_local_power_sum(plain, norm_type).to(device)] if plain else []
    for (mesh, dims), locals_ in by_reduction.items():
        # offloaded gradients live on the host, but NCCL reduces device tensors
        part = _local_power_sum(locals_, norm_type).to(mesh_device(mesh))
        for dim in dims:
            if mesh.size(dim) > 1:
                op = dist.ReduceOp.MAX if is_inf else dist.ReduceOp.SUM
                dist.all_reduce(part, op=op, group=mesh.get_group(dim))
        parts.append(part.to(device))
    if not parts:
        return torch.zeros((), device=device)
    stacked = torch.stack(parts)
    return stacked.max() if is_inf else stacked.sum() ** (1.0 / norm_type)


def clip_grad_norm_(
    parameters: _Params,
    max_norm: float,
    norm_type: float = 2.0,
    error_if_nonfinite: bool = False,
    foreach: Optional[bool] = None,
) -> torch.Tensor:
    """Clip gradients so their global norm is at most ``max_norm``; return the norm before clipping.

    ``torch.nn.utils.clip_grad_norm_``'s contract, for gradients on any meshes. ``foreach`` is
    accepted for parity (scaling always uses ``torch._foreach_mul_`` per device and dtype).
    """
    params = [parameters] if isinstance(parameters, torch.Tensor) else list(parameters)
    grads = [p.grad for p in params if p.grad is not None]
    norm_type = float(norm_type)
    total = total_norm(grads, norm_type)
    if error_if_nonfinite and not torch.isfinite(total):
        raise RuntimeError(
            f"The total norm of order {norm_type} for gradients from `parameters` is non-finite, so it "
            "cannot be clipped. Fix: find the non-finite gradient, or pass error_if_nonfinite=False."
        )
    coef = torch.clamp(max_norm / (total + 1e-6), max=1.0)
    locals_ = [g._local_tensor if isinstance(g, DTensor) else g for g in grads]  # type: ignore[attr-defined]
    buckets: dict[tuple[torch.device, torch.dtype], list[torch.Tensor]] = {}
    for t in locals_:
        buckets.setdefault((t.device, t.dtype), []).append(t)
    with torch.no_grad():
        for (device, _), tensors in buckets.items():
            torch._foreach_mul_(tensors, coef.to(device))
    return total
