"""`FSDPParam`: one parameter's life between its sharded and unsharded forms.

The tensors one parameter passes through, on rank ``r`` of a shard world of size ``W``, for a
parameter of global shape ``(n, *rest)``, with ``rows = ceil(n / W)`` rows per rank:

* ``padded_shard`` — ``(rows, *rest)``, owned by us. This rank's rows ``[r*rows, (r+1)*rows)``
  of the parameter, zero-padded past ``n``. It is the all-gather input, so every rank sends the
  same number of elements and any dim-0 size works.
* ``sharded_param`` — the ``nn.Parameter`` the module, optimizer and state dict see between
  steps: a ``DTensor`` with placement ``Shard(0)`` whose local tensor is the first
  ``local_rows`` rows of ``padded_shard`` (a view, so optimizer updates land in the all-gather
  input with no copy). ``local_rows`` matches ``torch.chunk``, which is what ``Shard(0)`` means:
  ranks past the end hold empty shards.
* ``padded_unsharded`` — flat ``W * rows * prod(rest)`` elements, the all-gather output for this
  parameter: rank ``i``'s padded shard is its ``i``-th row when viewed as ``(W, -1)``.
* ``unsharded_param`` — an ``nn.Parameter`` of the global shape over the first ``n`` rows of
  ``padded_unsharded``. The module computes with it between unshard and reshard; autograd puts
  its gradient in ``.grad``.

Why storage is resized instead of replaced: autograd saves ``unsharded_param`` for backward, and
``torch.compile`` guards on its identity. Resharding frees memory by resizing the storage of
``padded_unsharded`` to zero bytes; unsharding resizes it back and copies into it. The tensor
objects never change, so saved tensors see the new data when backward comes.

Why ``unsharded_param`` has its own version counter: it is built with ``set_`` on the shared
storage rather than as a view of ``padded_unsharded``, so the copy-out writes into the storage
do not bump the version autograd recorded when it saved the parameter.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Optional

import torch
import torch.nn as nn
from torch.distributed.tensor import DTensor, Shard

from .lifecycle import PARAM_STATES, ShardedState, advance
from .mesh import MeshInfo
from .policy import MixedPrecisionPolicy


@dataclass(frozen=True)
class ParamPlace:
    """One place a parameter is registered: ``module.<name>``, known to the user as ``fqn``."""

    module: nn.Module
    name: str
    fqn: str

    def set(self, tensor: torch.Tensor) -> None:
        # Straight into _parameters: nn.Module.__setattr__ costs too much on the per-step path,
        # and the module already holds a parameter under this name.
        self.module._parameters[self.name] = tensor  # type: ignore[assignment]


def rows_per_rank(dim0: int, world_size: int) -> int:
    return -(-dim0 // world_size)


def local_rows(dim0: int, world_size: int, rank: int) -> int:
    """Rows of dim 0 that rank ``rank`` holds under ``Shard(0)`` (``torch.chunk`` semantics)."""
    rows = rows_per_rank(dim0, world_size)
    return max(0, min(rows, dim0 - rank * rows))


class FSDPParam:
    """Owns one managed parameter: its shard, its unsharded form and the swap between them."""

    def __init__(
        self, param: nn.Parameter, places: list[ParamPlace], info: MeshInfo, mp: MixedPrecisionPolicy = MixedPrecisionPolicy()
    ) -> None:
        self.places = places
        self.fqn = places[0].fqn
        self.info = info
        self.requires_grad = param.requires_grad
        self.shape = param.shape
        self.dtype = param.dtype  # original dtype: the shard, the optimizer, the sharded .grad
        cast = param.is_floating_point()
        # all-gathered and computed in this dtype; gradients are reduced in reduce_dtype
        self.param_dtype = mp.param_dtype if cast and mp.param_dtype is not None else self.dtype
        self.reduce_dtype = mp.reduce_dtype if cast and mp.reduce_dtype is not None else self.param_dtype
        self.rows = rows_per_rank(self.shape[0], info.world_size)
        self.row_numel = _numel(self.shape[1:])
        self.padded_shard = self._make_padded_shard(param.detach())
        self.sharded_param = self._make_sharded_param()
        self.padded_unsharded = torch.empty(0, dtype=self.param_dtype, device=info.device)
        self.unsharded_param: Optional[nn.Parameter] = None
        self.state = ShardedState.SHARDED
        for place in places:
            place.set(self.sharded_param)

    # -- construction -------------------------------------------------------------------------

    def _make_padded_shard(self, full: torch.Tensor) -> torch.Tensor:
        start = self.info.rank * self.rows
        n_local = local_rows(self.shape[0], self.info.world_size, self.info.rank)
        if full.is_meta:  # meta-device init: shapes only; `to_empty` + init fill it later
            return torch.empty((self.rows, *self.shape[1:]), dtype=self.dtype, device="meta")
        padded = torch.empty((self.rows, *self.shape[1:]), dtype=self.dtype, device=self.info.device)
        # Copy only this rank's rows, so a CPU-initialised model never lands whole on the device.
        padded[:n_local].copy_(full[start : start + n_local])
        padded[n_local:].zero_()
        return padded

    def _make_sharded_param(self) -> nn.Parameter:
        n_local = local_rows(self.shape[0], self.info.world_size, self.info.rank)
        local = self.padded_shard[:n_local]
        dtensor = DTensor.from_local(
            local,
            self.info.mesh,
            [Shard(0)],
            run_check=False,
            shape=self.shape,
            stride=_contiguous_stride(self.shape),
        )
        return nn.Parameter(dtensor, requires_grad=self.requires_grad)

    # -- sizes -----------------------------------------------------------------------------------

    @property
    def shard_numel(self) -> int:
        """Elements this parameter contributes to each rank's all-gather input (padding included)."""
        return self.rows * self.row_numel

    @property
    def local_shard(self) -> torch.Tensor:
        return self.sharded_param._local_tensor  # type: ignore[attr-defined]

    # -- all-gather side -------------------------------------------------------------------------

    def all_gather_input(self) -> torch.Tensor:
        """This rank's padded shard, flat, in its original dtype: copy-in casts it to the group's
        all-gather dtype in place."""
        return self.padded_shard.view(-1)

    def all_gather_input_bytes(self) -> torch.Tensor:
        """The same in ``param_dtype`` as bytes, for a group whose parameters have several
        all-gather dtypes: one byte all-gather carries them all (a cast here costs a temporary)."""
        shard = self.padded_shard.view(-1)
        if self.param_dtype != self.dtype:
            shard = shard.to(self.param_dtype)
        return shard.view(torch.uint8)


    @property
    def shard_version(self) -> int:
        """Grows whenever the shard is written in place.

        DTensor runs an in-place op on its local tensor below autograd, so the local tensor's own
        counter misses optimizer steps and ``load_state_dict``; the outer DTensor's counter sees
        those. The local tensor's counter sees direct writes through ``to_local()``.
        """
        return self.sharded_param._version + self.local_shard._version

    def alloc_all_gather_output(self) -> torch.Tensor:
        """Give ``padded_unsharded`` its memory back; return it viewed as ``(W, shard_numel)``
        (callers view it as bytes for the copy-out)."""
        numel = self.info.world_size * self.shard_numel
        storage = self.padded_unsharded.untyped_storage()
        nbytes = numel * self.padded_unsharded.element_size()
        if storage.size() != nbytes:
            if self.padded_unsharded.numel() == 0:
                self.padded_unsharded = torch.empty(numel, dtype=self.param_dtype, device=self.info.device)
            else:
                storage.resize_(nbytes)
        return self.padded_unsharded.view(self.info.world_size, self.shard_numel)

    def free_unsharded(self) -> None:
        self.padded_unsharded.untyped_storage().resize_(0)

    def _ensure_unsharded_param(self) -> nn.Parameter:
        if self.unsharded_param is None:
            tensor = torch.empty(0, dtype=self.param_dtype, device=self.info.device)
            tensor.set_(self.padded_unsharded.untyped_storage(), 0, self.shape, _contiguous_stride(self.shape))
            self.unsharded_param = nn.Parameter(tensor, requires_grad=self.requires_grad)
        return self.unsharded_param

    # -- state transitions -----------------------------------------------------------------------

    def _transition(self, to: ShardedState) -> None:
        self.state = advance(PARAM_STATES, self.state, to, f"parameter {self.fqn}")

    def to_unsharded(self) -> None:
        """Point the module at the unsharded parameter (its data must already be copied out)."""
        if self.state is ShardedState.UNSHARDED:
            return
        self._transition(ShardedState.UNSHARDED)
        unsharded = self._ensure_unsharded_param()
        for place in self.places:
            place.set(unsharded)

    def to_sharded(self) -> None:
        """Point the module back at the sharded DTensor parameter and free the unsharded memory."""
        if self.state is ShardedState.SHARDED:
            return
        self._transition(ShardedState.SHARDED)
        for place in self.places:
            place.set(self.sharded_param)
        self.free_unsharded()

    # -- gradients -------------------------------------------------------------------------------

    def take_unsharded_grad(self) -> Optional[torch.Tensor]:
        """Remove and return the gradient autograd accumulated on the unsharded parameter."""
        if self.unsharded_param is None or self.unsharded_param.grad is None:
            return None
        grad = self.unsharded_param.grad
        self.unsharded_param.grad = None
        if grad.shape != self.shape:
            raise RuntimeError(f"gradient of {self.fqn} has shape {tuple(grad.shape)}, expected {tuple(self.shape)}")
        return grad.contiguous()

    def accumulate_sharded_grad(self, padded_grad_shard: torch.Tensor) -> None:
        """Add this rank's reduced gradient (``shard_numel`` elements, padding included) to ``.grad``."""
        n_local = self.local_shard.shape[0]
        grad = padded_grad_shard.view(self.rows, *self.shape[1:])[:n_local]
        if grad.dtype != self.dtype:
            grad = grad.to(self.dtype)
        existing = self.sharded_param.grad
        if existing is None:
            self.sharded_param.grad = DTensor(  # type: ignore[call-arg]
                grad, self.sharded_param._spec, requires_grad=False  # type: ignore[attr-defined]
            )
        else:
            existing._local_tensor.add_(grad)  # type: ignore[attr-defined]

    # -- integrity -------------------------------------------------------------------------------

    def check_shard_is_ours(self) -> None:
        """Re-pad if something replaced the DTensor's local tensor (``module.to_empty``, ``_apply``).

        The all-gather reads ``padded_shard``; a local tensor living elsewhere would be silently
        ignored, so adopt its values into fresh padded storage and point the DTensor at it.
        """
        local = self.local_shard
        if local.is_meta or (
            not self.padded_shard.is_meta
            and local.untyped_storage().data_ptr() == self.padded_shard.untyped_storage().data_ptr()
        ):
            return
        if local.device != self.info.device:
            raise RuntimeError(
                f"parameter {self.fqn} is on {local.device} after fully_shard, but its mesh computes on "
                f"{self.info.device}. Fix: move the module before fully_shard, or to_empty(device="
                f"'{self.info.device}') a meta-initialised one."
            )
        padded = torch.zeros((self.rows, *self.shape[1:]), dtype=local.dtype, device=local.device)
        padded[: local.shape[0]].copy_(local)
        self.padded_shard = padded
        self.sharded_param._local_tensor = padded[: local.shape[0]]  # type: ignore[attr-defined]


def _numel(shape: torch.Size) -> int:
    out = 1
    for s in shape:
        out *= s
    return out


def _contiguous_stride(shape: torch.Size) -> tuple[int, ...]:
    stride: list[int] = []
    acc = 1
    for size in reversed(shape):
        stride.append(acc)
        acc *= max(size, 1)
    return tuple(reversed(stride))
