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

Sharding on another dim (``shard_placement_fn`` returning ``Shard(d)``, any size): the shard
is this rank's ``torch.chunk`` of dim ``d``, a plain contiguous tensor. Collectives still move
dim 0: the all-gather input is the shard with dim ``d`` moved to the front and padded to
``rows`` (a temporary), and the gathered rows are moved back into a contiguous unsharded
tensor with its own storage. Gradients go the other way: dim ``d`` to the front, chunked by
``torch._chunk_cat``, reduced rows moved back.

Tensor parallelism: a parameter that is already a ``DTensor`` on a TP mesh is sharded as its
TP-local tensor; the sharded parameter is a DTensor on the joint (dp, tp) mesh, and the
unsharded one a DTensor on the TP mesh again, as the TP-parallelised module expects (`tp.py`).

Why ``unsharded_param`` has its own version counter: it is built with ``set_`` on the shared
storage rather than as a view of ``padded_unsharded``, so the copy-out writes into the storage
do not bump the version autograd recorded when it saved the parameter.
"""

from __future__ import annotations

import copy
from dataclasses import dataclass
from typing import Any, Optional, Protocol

import torch
import torch.nn as nn
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.tensor import DTensor
from torch.distributed.tensor.placement_types import Placement

from .copying import copy_fields, refuse_busy
from .extension import EXTENSION_METHODS, ExtensionState, hooks_of
from .host import allocating, host_device, to_device
from ..layouts.layout import ShardLayout
from .lifecycle import ShardedState
from ..layouts.mesh import MeshInfo
from ..layouts.policy import CPUOffloadPolicy, MixedPrecisionPolicy
from .registry import manager_of, register_places, register_sharded
from .settings import Settings
from ..layouts.tp import TPSpec


class GroupView(Protocol):
    """What a parameter reads of the group that owns it (`FSDPParamGroup`)."""

    fqn: str
    sharded_state: ShardedState
    settings: Settings


@dataclass(frozen=True)
class ParamPlace:
    """One place a parameter is registered: ``module.<name>``, known to the user as ``fqn``."""

    module: nn.Module
    name: str
    fqn: str

    def get(self) -> object:
        return self.module._parameters.get(self.name, _MISSING)

    def set(self, tensor: torch.Tensor) -> None:
        # Straight into _parameters: nn.Module.__setattr__ costs too much on the per-step path,
        # and the module already holds a parameter under this name.
        self.module._parameters[self.name] = tensor  # type: ignore[assignment]


@dataclass(frozen=True)
class Where:
    """Where one parameter's shard lives and how it is laid out (fixed at construction)."""

    info: MeshInfo
    layout: ShardLayout  # what this library shards (the TP-local shape under TP): pure arithmetic
    tp: Optional[TPSpec]
    # CPUOffloadPolicy: the shard and its .grad live on the host; each all-gather copies the shard
    # to the device first, each reduction copies the gradient back. On a CPU mesh the same code
    # runs and the copies are no-ops.
    offload: bool
    pin_memory: bool
    shard_device: torch.device

    @staticmethod
    def of(
        info: MeshInfo, layout: ShardLayout, tp: Optional[TPSpec], offload: Optional[CPUOffloadPolicy]
    ) -> "Where":
        pin = offload is not None and offload.pin_memory and info.device.type not in ("cpu", "meta")
        device = host_device(info.device) if offload is not None else info.device
        return Where(info, layout, tp, offload is not None, pin, device)


@dataclass(frozen=True)
class Dtypes:
    """The original dtype (the shard's, the optimizer's, the sharded .grad's) and, from it and the
    policy (and a reduce dtype the settings may fix), the dtype it is all-gathered and computed in
    and the one gradients are reduced in."""

    policy: MixedPrecisionPolicy
    orig: torch.dtype
    param: torch.dtype
    reduce: torch.dtype

    @staticmethod
    def derive(
        dtype: torch.dtype, mp: MixedPrecisionPolicy, reduce_override: Optional[torch.dtype]
    ) -> "Dtypes":
        cast = dtype.is_floating_point
        param = mp.param_dtype if cast and mp.param_dtype is not None else dtype
        reduce = mp.reduce_dtype if cast and mp.reduce_dtype is not None else param
        if cast and reduce_override is not None:  # FSDP1's fp16/bf16 compress hooks
            reduce = reduce_override
        return Dtypes(mp, dtype, param, reduce)


class FSDPParam:
    """Owns one managed parameter: its shard, its unsharded form and the swap between them."""

    def __init__(
        self,
        param: nn.Parameter,
        places: list[ParamPlace],
        info: MeshInfo,
        mp: MixedPrecisionPolicy = MixedPrecisionPolicy(),
        shard_dim: int = 0,
        offload: Optional[CPUOffloadPolicy] = None,
    ) -> None:
        self.places = places
        self.group: Optional[GroupView] = None  # set by the group that owns it
        self.requires_grad = param.requires_grad
        # All-gather extension (extension.py): its state while one is in use (None: plain
        # all-gathers so far); a codec comes from the group's settings (set_all_gather_codec).
        self.ext: Optional[ExtensionState] = None
        data = param.detach()
        tp = TPSpec.of(data) if isinstance(data, DTensor) else None
        if isinstance(data, DTensor):
            data = data.to_local()
        self.where = Where.of(
            info, ShardLayout(data.shape, shard_dim, info.world_size, info.rank), tp, offload
        )
        self.dtypes = Dtypes.derive(param.dtype, mp, None)
        # Dim 0: padded rows owned here, the DTensor's local tensor a view of them (no copy-in
        # temporary). Other dims: the local tensor is the shard itself; padding happens at copy-in.
        self.padded_shard: Optional[torch.Tensor] = None
        self.sharded_param = self._make_sharded_param(self._make_local_shard(data))
        self.padded_unsharded = torch.empty(0, dtype=self.dtypes.param, device=info.device)
        self.unsharded_param: Optional[nn.Parameter] = None
        self.partial_reduce: Optional[torch.Tensor] = None  # HSDP: reduced over shards, not yet replicas
        # The local tensor `sync_with_module` last took over: another one means something swapped
        # it (`FSDPParamGroup.notice_changes` compares them at each iteration's start).
        self._seen_local: Optional[torch.Tensor] = None
        register_sharded(self)
        register_places(self, places)
        for place in places:
            place.set(self.sharded_param)

    def note_assigned(self) -> None:
        """Something was registered at one of this parameter's places (``module.weight = ...``,
        ``load_state_dict(..., assign=True)``): the group takes it over before its next unshard."""
        if self.group is not None:
            self.group.needs_sync = True

    def live_buffers(self) -> list[tuple[str, Optional[torch.Tensor]]]:
        """The tensors this parameter holds, each with its category (`fully_shard.plan.CATEGORIES`):
        its unsharded storage and extension outputs, its shard, its gradients (sharded, unsharded,
        a deferred HSDP sum). Part of the engine interface the tools read (tools/memory.py)."""
        out: list[tuple[str, Optional[torch.Tensor]]] = [("unsharded_params", self.padded_unsharded)]
        if self.ext is not None:
            out += [("unsharded_params", t) for t in self.ext.outputs]
        shard = self.padded_shard if self.padded_shard is not None else self.local_shard
        out += [("sharded_params", shard), ("gradients", self.sharded_param.grad)]
        out.append(("gradients", self.partial_reduce))
        if self.unsharded_param is not None:
            out.append(("gradients", self.unsharded_param.grad))
        return out

    def precopy(self, memo: dict[int, Any]) -> None:
        """Deepcopy, first step: copy the sharded parameter (and its padded storage) into ``memo``
        before anything leads deepcopy to the modules holding it. Tensor.__deepcopy__ cannot copy
        it there: its .grad is a DTensor over a reduce-scatter output at an offset."""
        if id(self.sharded_param) in memo:
            return
        padded = self.padded_shard.clone() if self.padded_shard is not None else None
        local = padded[: self.where.layout.local_rows] if padded is not None else self.local_shard.clone()
        param = self._make_sharded_param(local)
        param.__dict__.update(copy.deepcopy(self.sharded_param.__dict__, memo))
        if self.sharded_param.grad is not None:
            param.grad = self.sharded_param.grad.clone()
        memo[id(self.sharded_param)] = param
        if self.padded_shard is not None:
            memo[id(self.padded_shard)] = padded

    def __deepcopy__(self, memo: dict[int, Any]) -> "FSDPParam":
        if self.is_unsharded:
            refuse_busy(f"parameter {self.path}", "is unsharded")
        self.precopy(memo)
        param = memo[id(self.sharded_param)]
        # The unsharded buffers are resized to nothing between steps (deepcopy cannot copy such a
        # tensor); the copy makes its own at its first unshard.
        new = copy_fields(
            self,
            memo,
            _seen_local=param._local_tensor,
            unsharded_param=None,
            ext=None,
            padded_unsharded=torch.empty(0, dtype=self.dtypes.param, device=self.where.info.device),
        )
        register_sharded(new)
        return new

    @property
    def shape(self) -> torch.Size:
        return self.where.layout.shape

    @property
    def shard_dim(self) -> int:
        return self.where.layout.dim

    def _path(self, fqn: str) -> str:
        """``fqn`` (relative to the fully_shard call's module) from the root, once lazy init named it."""
        prefix = self.group.fqn if self.group is not None else ""
        return f"{prefix}.{fqn}" if prefix else fqn

    @property
    def path(self) -> str:
        return self._path(self.fqn)

    def _set_dtype(self, dtype: torch.dtype) -> None:
        """A new original dtype: derive the others from it, the policy and the settings."""
        override = self.group.settings.reduce_dtype if self.group is not None else None
        self.dtypes = Dtypes.derive(dtype, self.dtypes.policy, override)

    # What the parameter is, for readers outside this class (inside it: the two values above).
    fqn = property(lambda self: self.places[0].fqn, doc="Its name relative to the fully_shard call's module.")
    info = property(lambda self: self.where.info)
    layout = property(lambda self: self.where.layout)
    tp = property(lambda self: self.where.tp)
    offload = property(lambda self: self.where.offload)
    pin_memory = property(lambda self: self.where.pin_memory)
    shard_device = property(lambda self: self.where.shard_device)
    mp = property(lambda self: self.dtypes.policy)
    dtype = property(lambda self: self.dtypes.orig)
    param_dtype = property(lambda self: self.dtypes.param)
    reduce_dtype = property(lambda self: self.dtypes.reduce)

    def derive_dtypes(self) -> None:
        """Derive ``param_dtype`` / ``reduce_dtype`` again (the group's settings changed)."""
        self._set_dtype(self.dtypes.orig)

    @property
    def codec(self) -> Any:
        """The all-gather codec the group's settings chose for this parameter (None: none)."""
        return self.group.settings.codec_for(self.fqn) if self.group is not None else None

    def add_places(self, places: list[ParamPlace]) -> None:
        """A later ``fully_shard`` call's modules use this parameter too (tied weights): swap it
        there as well, starting from its current form."""
        current = self.unsharded_param if self.is_unsharded else self.sharded_param
        register_places(self, places)
        for place in places:
            self.places.append(place)
            place.set(current)  # type: ignore[arg-type]

    # -- construction -------------------------------------------------------------------------

    def local_chunk(self, full: torch.Tensor) -> torch.Tensor:
        """This rank's chunk of a tensor of the unsharded shape (a view)."""
        return full.narrow(self.where.layout.dim, self.where.layout.start, self.where.layout.local_rows)

    def _empty_shard(self, shape: tuple[int, ...], like: torch.Tensor) -> torch.Tensor:
        """New shard storage shaped ``shape`` for data like ``like``. A tensor subclass (an
        all-gather extension's weights) makes its own, so the shard stays that subclass."""
        if like.is_meta:
            return (
                like.new_empty(shape)
                if _is_subclass(like)
                else torch.empty(shape, dtype=self.dtypes.orig, device="meta")
            )
        if _is_subclass(like):
            return like.new_zeros(shape, device=self.where.shard_device)
        return torch.empty(
            shape, dtype=self.dtypes.orig, device=self.where.shard_device, pin_memory=self.where.pin_memory
        )

    def _make_local_shard(self, full: torch.Tensor) -> torch.Tensor:
        if self.where.layout.dim != 0:
            local = self._empty_shard(tuple(self.where.layout.local_shape), full)
            if not full.is_meta:
                local.copy_(self.local_chunk(full))
            return local
        self.padded_shard = self._empty_shard(tuple(self.where.layout.padded_shape), full)
        if not full.is_meta:  # meta-device init: shapes only; `to_empty` + init fill it later
            # Copy only this rank's rows, so a CPU-initialised model never lands whole on the device.
            self.padded_shard[: self.where.layout.local_rows].copy_(self.local_chunk(full))
            self.padded_shard[self.where.layout.local_rows :].zero_()
        return self.padded_shard[: self.where.layout.local_rows]

    def _spec_mesh_and_placements(self) -> tuple[DeviceMesh, tuple[Placement, ...]]:
        placements = self.where.info.placements(self.where.layout.dim)
        if self.where.tp is None:
            return self.where.info.mesh, placements
        return self.where.tp.joint(self.where.info.mesh, placements, self.where.layout.dim)

    def _make_sharded_param(self, local: torch.Tensor) -> nn.Parameter:
        mesh, placements = self._spec_mesh_and_placements()
        shape = self.where.tp.shape if self.where.tp is not None else self.where.layout.shape
        dtensor = DTensor.from_local(
            local, mesh, placements, run_check=False, shape=shape, stride=_contiguous_stride(shape)
        )
        return nn.Parameter(dtensor, requires_grad=self.requires_grad)

    # -- sizes -----------------------------------------------------------------------------------

    @property
    def shard_numel(self) -> int:
        """Elements this parameter contributes to each rank's all-gather input (padding included)."""
        return self.where.layout.shard_numel

    @property
    def local_shard(self) -> torch.Tensor:
        return self.sharded_param._local_tensor  # type: ignore[attr-defined]

    # -- all-gather side -------------------------------------------------------------------------

    def all_gather_input(self) -> torch.Tensor:
        """This rank's padded shard, flat, in its original dtype: copy-in casts it to the group's
        all-gather dtype in place."""
        if self.padded_shard is not None:
            shard = self.padded_shard.view(-1)
        else:
            shard = _padded_rows(
                self.local_shard.movedim(self.where.layout.dim, 0), self.where.layout.rows, 0, 1
            ).view(-1)
        if self.where.offload:  # to the device (async from pinned memory)
            shard = to_device(shard, self.where.info.device, self.where.pin_memory)
        return shard

    def all_gather_input_bytes(self) -> torch.Tensor:
        """The same in ``param_dtype`` as bytes, for a group whose parameters have several
        all-gather dtypes: one byte all-gather carries them all (a cast here costs a temporary)."""
        shard = self.all_gather_input()
        if self.dtypes.param != self.dtypes.orig:
            shard = shard.to(self.dtypes.param)
        return shard.view(torch.uint8)

    # -- all-gather extensions (extension.py) ---------------------------------------------------

    def resolve_extension(self) -> bool:
        """Before each all-gather: does this parameter's all-gather go through an extension (its
        local tensor's fsdp_pre/post_all_gather, or a codec)? Switching between the two forms
        drops the unsharded parameter built by the other."""
        hooks = hooks_of(self.local_shard, self.codec, self.path)
        if hooks is not None and self.where.layout.dim != 0:
            raise ValueError(
                f"parameter {self.path} has an all-gather extension ({type(self.local_shard).__name__}) "
                f"and is sharded on dim {self.where.layout.dim}; extensions gather dim-0 shards. Fix: "
                "return Shard(0) (or None) for it from shard_placement_fn."
            )
        # Which extension: a codec object, or the local tensor's class (its own methods). Another one
        # (or none) than the unsharded parameter was built by: drop it, start afresh.
        source = (
            None
            if hooks is None
            else (
                self.codec
                if self.codec is not None and not hasattr(self.local_shard, "fsdp_pre_all_gather")
                else type(self.local_shard)
            )
        )
        if source is not (self.ext.source if self.ext is not None else None):
            if self.unsharded_param is not None:
                self._drop_unsharded()
            self.ext = ExtensionState(source=source) if hooks is not None else None
        if self.ext is not None:
            self.ext.hooks = hooks
        return hooks is not None

    def extension_inputs(self) -> list[torch.Tensor]:
        """What the extension chose to all-gather for this rank (each input padded to the rows
        every rank sends), flat, as bytes."""
        assert self.ext is not None and self.ext.hooks is not None
        local, hooks = self.local_shard, self.ext.hooks
        if self.where.offload:  # the hooks run on the device copy, as PyTorch's do
            local = to_device(local, self.where.info.device, self.where.pin_memory)
            if local is not self.local_shard:
                hooks = (
                    hooks_of(local, self.codec, self.path) or hooks
                )  # methods set on the host tensor stay bound to it
        shape = self.where.layout.shape  # under TP, the TP-local shape (what this library shards)
        inputs = self.ext.inputs(
            hooks,
            local,
            mesh=self.where.info.shard_mesh,
            outer_size=shape,
            outer_stride=_contiguous_stride(shape),
            module=self.places[0].module,
            mp_policy=self.dtypes.policy,
            local_rows=self.where.layout.local_rows,
            rows=self.where.layout.rows,
            fqn=self.path,
        )
        return [t.reshape(-1).view(torch.uint8) for t in inputs]

    @property
    def uses_extension(self) -> bool:
        return self.ext is not None and self.ext.hooks is not None

    def row_bytes(self) -> int:
        """Bytes this parameter puts in each rank's row of a full all-gather."""
        if self.ext is not None and self.ext.sizes:
            return self.ext.row_bytes()
        return self.where.layout.shard_numel * self.dtypes.param.itemsize

    def all_gather_targets(self) -> Optional[list[torch.Tensor]]:
        """Give the unsharded storage its memory back and return where the copy-out writes: one
        ``(W, bytes per rank)`` byte view per all-gather input. ``None`` (a dim other than 0): the
        storage is the unsharded tensor itself, not in that layout; `copy_out` fills it."""
        world = self.where.info.world_size
        if self.ext is not None and self.ext.hooks is not None:
            return self.ext.alloc_outputs(world, self.where.info.device)
        numel = (
            world * self.where.layout.shard_numel
            if self.where.layout.dim == 0
            else _numel(self.where.layout.shape)
        )
        storage = self.padded_unsharded.untyped_storage()
        nbytes = numel * self.padded_unsharded.element_size()
        if storage.size() != nbytes:
            if self.padded_unsharded.numel() == 0:
                self.padded_unsharded = torch.empty(
                    numel, dtype=self.dtypes.param, device=self.where.info.device
                )
            else:
                storage.resize_(nbytes)
        if self.where.layout.dim != 0:
            return None
        return [self.padded_unsharded.view(torch.uint8).view(world, -1)]

    def copy_out(self, gathered: torch.Tensor) -> None:
        """Fill the unsharded storage from this parameter's ``(W', k * shard_numel)`` slice of an
        all-gather output (``param_dtype``): ``W' * k`` padded chunks in shard-world order."""
        world, outer = self.where.info.world_size, gathered.shape[0]
        # (W', W / W' chunks, rows, ...) -> (W, rows, ...): a view for the full all-gather; a copy
        # only when gathering back from reshard_after_forward=int shares.
        rows, (n, *rest) = self.where.layout.rows, self.where.layout.moved_shape
        chunks = gathered.view(outer, world // outer, rows, *rest).flatten(0, 1)
        target = self._unsharded_view().movedim(self.where.layout.dim, 0)
        full = self.where.layout.full_chunks
        if full:
            target[: full * rows].view(full, rows, *rest).copy_(chunks[:full])
        if full * rows < n:
            target[full * rows :].copy_(chunks[full, : n - full * rows])

    def gathered_rows(self, first: int, count: int) -> torch.Tensor:
        """Shard-world rows ``[first, first + count)`` of the gathered parameter, as bytes in the
        all-gather layout (for ``reshard_after_forward=int``): per input, for an extension."""
        if self.uses_extension:
            assert self.ext is not None
            return torch.cat(self.ext.gathered_rows(first, count, self.where.info.world_size))
        if self.where.layout.dim == 0:
            rows = self.padded_unsharded.view(self.where.info.world_size, -1)[first : first + count]
            return rows.reshape(-1).view(torch.uint8)
        moved = self._unsharded_view().movedim(self.where.layout.dim, 0)
        return _padded_rows(moved, self.where.layout.rows, first, count).view(-1).view(torch.uint8)

    def _unsharded_view(self) -> torch.Tensor:
        tensor = torch.empty(0, dtype=self.dtypes.param, device=self.where.info.device)
        return tensor.set_(
            self.padded_unsharded.untyped_storage(),
            0,
            self.where.layout.shape,
            _contiguous_stride(self.where.layout.shape),
        )

    def _make_unsharded_param(self) -> nn.Parameter:
        tensor: torch.Tensor = self._unsharded_view()
        if self.where.tp is not None:
            tensor = self.where.tp.unsharded(tensor)
        self.unsharded_param = nn.Parameter(tensor, requires_grad=self.requires_grad)
        return self.unsharded_param

    def _rebuild_from_extension(self) -> nn.Parameter:
        assert self.ext is not None
        if self.unsharded_param is not None:
            param = self.unsharded_param
            out = param._local_tensor if self.where.tp is not None else param  # type: ignore[attr-defined]
            self.ext.rebuild_into(out, self.dtypes.param)
            return self.unsharded_param
        with torch.no_grad():
            tensor = self.ext.rebuild_first(self.dtypes.param, self.path)
            tensor = torch.as_strided(
                tensor, self.where.layout.shape, _contiguous_stride(self.where.layout.shape), 0
            )  # drops the padding rows
        if self.where.tp is not None:
            tensor = self.where.tp.unsharded(tensor)
        self.unsharded_param = nn.Parameter(tensor, requires_grad=self.requires_grad)
        return self.unsharded_param

    # -- state transitions -----------------------------------------------------------------------

    # The group's `sharded_state` is the one record of which form is in use: it calls these two on
    # its own transitions only (UNSHARDED <-> SHARDED / SHARDED_POST_FORWARD, where parameters are
    # sharded too).

    @property
    def is_unsharded(self) -> bool:
        return self.group is not None and self.group.sharded_state is ShardedState.UNSHARDED

    def to_unsharded(self) -> None:
        """Point the module at the unsharded parameter (its data must already be copied out; an
        extension's post hook rebuilds it from the outputs here)."""
        if self.ext is not None and self.ext.hooks is not None:
            unsharded = self._rebuild_from_extension()
        elif self.unsharded_param is None:
            unsharded = self._make_unsharded_param()
        else:
            unsharded = self.unsharded_param
        for place in self.places:  # straight into _parameters: see ParamPlace.set
            place.module._parameters[place.name] = unsharded

    def to_sharded(self) -> None:
        """Point the module back at the sharded DTensor parameter and free the unsharded memory."""
        for place in self.places:
            # A place holding something else was assigned by the user meanwhile: leave it for
            # `sync_with_module` to take over at the next unshard.
            params = place.module._parameters
            if params.get(place.name) is self.unsharded_param:
                params[place.name] = self.sharded_param
        if self.ext is not None:
            self.ext.free()
        self.padded_unsharded.untyped_storage().resize_(0)

    # -- gradients -------------------------------------------------------------------------------

    def take_unsharded_grad(self) -> Optional[torch.Tensor]:
        """Remove the gradient autograd accumulated on the unsharded parameter and return it with
        the shard dim in front (the layout the reduce-scatter chunks)."""
        if self.unsharded_param is None or self.unsharded_param.grad is None:
            return None
        grad = self.unsharded_param.grad
        self.unsharded_param.grad = None
        if self.where.tp is not None:
            grad = self.where.tp.local_grad(grad)
        shape = self.where.layout.shape
        if grad.shape != shape:
            raise RuntimeError(
                f"gradient of {self.fqn} has shape {tuple(grad.shape)}, expected {tuple(shape)}"
            )
        return grad.movedim(self.where.layout.dim, 0) if self.where.layout.dim else grad.contiguous()

    def accumulate_sharded_grad(self, padded_grad_shard: torch.Tensor) -> None:
        """Add this rank's reduced gradient (``shard_numel`` elements, padding included) to ``.grad``."""
        grad = padded_grad_shard.view(self.where.layout.rows, *self.where.layout.moved_shape[1:])[
            : self.where.layout.local_rows
        ]
        if self.where.layout.dim:
            grad = grad.movedim(0, self.where.layout.dim)
        if grad.dtype != self.dtypes.orig:
            grad = grad.to(self.dtypes.orig)
        existing = self.sharded_param.grad
        if self.where.offload and (
            grad.device != self.where.shard_device or grad.is_meta
        ):  # the gradient goes back to the host
            with allocating():
                host = torch.empty(
                    grad.shape,
                    dtype=self.dtypes.orig,
                    device=self.where.shard_device,
                    pin_memory=self.where.pin_memory,
                )
            # Asynchronous only into a fresh .grad: the host waits for it before the optimizer
            # (end of backward). Adding into an existing one needs the values now.
            host.copy_(grad, non_blocking=self.where.pin_memory and existing is None)
            grad = host
        if existing is None:
            self.sharded_param.grad = DTensor(  # type: ignore[call-arg]
                grad.contiguous(),
                self.sharded_param._spec,
                requires_grad=False,  # type: ignore[attr-defined]
            )
        else:
            existing._local_tensor.add_(grad)  # type: ignore[attr-defined]
        # Autograd accumulates into the unsharded parameter, so hooks registered on the sharded
        # one (register_post_accumulate_grad_hook) would never fire: fire them here, once per
        # reduction into .grad (not for backwards without gradient sync, which reduce nothing).
        hooks = self.sharded_param._post_accumulate_grad_hooks  # type: ignore[attr-defined]
        if hooks:
            for hook in list(hooks.values()):
                hook(self.sharded_param)

    def add_partial_reduce(self, reduced: torch.Tensor) -> None:
        """HSDP with the all-reduce deferred: keep this backward's shard-group sum."""
        if self.partial_reduce is None:
            self.partial_reduce = reduced.clone()
        else:
            self.partial_reduce.add_(reduced)

    def take_partial_reduce(self) -> Optional[torch.Tensor]:
        """The deferred partial sum, handed to the reduction that is about to include it (so a
        later backward, or the end of this one, does not send it again)."""
        partial, self.partial_reduce = self.partial_reduce, None
        return partial

    def zero_grad_if_partial(self) -> Optional[torch.Tensor]:
        """A zero gradient (shard dim in front) when a deferred partial sum waits for a backward
        that did not touch this parameter: it still has to join the reduction."""
        if self.partial_reduce is None:
            return None
        return torch.zeros(
            self.where.layout.moved_shape, dtype=self.dtypes.param, device=self.where.info.device
        )

    # -- picking up changes made behind our back --------------------------------------------------

    def sync_with_module(self, adopt_device: bool = False) -> bool:
        """Take over whatever replaced or converted this parameter while it was sharded; return
        whether anything changed (the group then refreshes what it derives from its parameters).

        * A new parameter at one of its places (``load_state_dict(..., assign=True)``, attribute
          assignment, ``set_model_state_dict`` on a meta model) becomes the sharded parameter;
          one of another global shape or placement is refused, naming it.
        * A new local tensor (``to_empty``, ``module.to(...)``) moves back into padded storage the
          all-gather reads (a local tensor living elsewhere would be silently ignored), in its new
          dtype; offloaded shards go back to (pinned) host memory when ``adopt_device``
          (``module.to(device)`` moved them), else a shard in the wrong place is refused.

        * ``requires_grad`` set on the sharded parameter (freezing or unfreezing after
          ``fully_shard``, e.g. ``block.requires_grad_(False)``) carries over to the unsharded one,
          so a frozen parameter gets no gradient and an unfrozen one trains.

        Runs only when something reported a change (`FSDPParamGroup.needs_sync`), and after
        ``_apply``; cheap when nothing changed: one identity check per place and one for the local
        tensor.
        """
        changed = self._adopt_assigned()
        frozen_or_thawed = self.sharded_param.requires_grad != self.requires_grad
        if frozen_or_thawed:
            self.requires_grad = self.sharded_param.requires_grad
            if self.unsharded_param is not None:
                self.unsharded_param.requires_grad_(self.requires_grad)
        local = self.local_shard
        if local is self._seen_local and not changed:
            return frozen_or_thawed
        self._rehome(local, adopt_device)
        # A meta shard stays unseen: every iteration looks again (and refuses it) until it is real
        # (on a meta mesh, a simulation, it is what there is).
        unseen = local.is_meta and self.where.info.device.type != "meta"
        self._seen_local = None if unseen else self.local_shard
        return True

    def _adopt_assigned(self) -> bool:
        for place in self.places:
            current = place.get()
            if current is not self.sharded_param:
                break
        else:
            return False
        self.sharded_param = self._accept_replacement(current, self._path(place.fqn))
        self.requires_grad = self.sharded_param.requires_grad
        if self.unsharded_param is not None:
            self.unsharded_param.requires_grad_(self.requires_grad)
        register_sharded(self)
        for p in self.places:  # tied places stay tied: they all get the new parameter
            p.set(self.sharded_param)
        return True

    def _accept_replacement(self, new: object, fqn: str) -> nn.Parameter:
        mesh, placements = self._spec_mesh_and_placements()
        shape = self.where.tp.shape if self.where.tp is not None else self.where.layout.shape
        expected = f"a DTensor of global shape {tuple(shape)} with placements {placements} on mesh {mesh}"
        owner = manager_of(new) if isinstance(new, nn.Parameter) else None
        if owner is not None and owner is not self:
            raise ValueError(
                f"parameter '{fqn}' was assigned the parameter '{owner.path}', which another fully_shard "
                "call manages (tying weights after fully_shard). Two groups cannot share one sharded "
                "parameter. Fix: tie the weights before fully_shard (e.g. model.tie_weights() first); "
                "fully_shard then manages them as one."
            )
        if isinstance(new, DTensor):
            if new.shape == shape and new.device_mesh == mesh and tuple(new.placements) == placements:
                keep = isinstance(new, nn.Parameter)
                return new if keep else nn.Parameter(new, requires_grad=self.requires_grad)
            got = (
                f"a DTensor of global shape {tuple(new.shape)} with placements {tuple(new.placements)} on "
                f"mesh {new.device_mesh}"
            )
        elif isinstance(new, torch.Tensor) and self.where.tp is None and new.shape == shape:
            # A plain full tensor: keep this rank's chunk, as fully_shard itself does.
            self._set_dtype(new.dtype)
            self._drop_unsharded()
            self.requires_grad = new.requires_grad
            return self._make_sharded_param(self._make_local_shard(new.detach()))
        else:
            got = (
                "nothing (it was deleted)"
                if new is _MISSING or new is None
                else f"a {type(new).__name__} of shape {tuple(getattr(new, 'shape', ()))}"
            )
        raise ValueError(
            f"parameter '{fqn}' was replaced after fully_shard by {got}; fully_shard manages it as "
            f"{expected}. Fix: assign a tensor of that global shape and layout (a state dict taken from a "
            "model sharded the same way, or distribute_tensor(full, mesh, placements)), or a plain tensor "
            f"of the full shape {tuple(shape)} (each rank keeps its chunk)."
        )

    def _rehome(self, local: torch.Tensor, adopt_device: bool) -> None:
        if local.dtype != self.dtypes.orig:  # module.to(dtype), .double(), .half(), or an assigned tensor
            self._set_dtype(local.dtype)
            self._drop_unsharded()
        if local.is_meta:
            return  # meta-device init: shapes only until to_empty; unshard refuses to gather it
        if local.device != self.where.shard_device and not (adopt_device and self.where.offload):
            self._refuse_device(local)
        padded = self.padded_shard
        if (
            padded is not None
            and not padded.is_meta
            and padded.dtype == local.dtype
            and _views(local, padded)
        ):
            return
        in_place = local.device == self.where.shard_device and (
            not self.where.pin_memory or local.is_pinned()
        )
        if self.where.layout.dim != 0:
            if not in_place:
                host = self._empty_shard(tuple(local.shape), local)
                host.copy_(local)
                self._set_local(local, host)
            return  # the all-gather reads the local tensor itself
        if in_place and tuple(local.shape) == tuple(self.where.layout.padded_shape) and local.is_contiguous():
            self.padded_shard = local  # no padding on this rank: the new tensor is the padded shard
            return
        padded = self._empty_shard(tuple(self.where.layout.padded_shape), local)
        padded[: local.shape[0]].copy_(local)
        padded[local.shape[0] :].zero_()
        self.padded_shard = padded
        self._set_local(local, padded[: local.shape[0]])

    def _refuse_device(self, local: torch.Tensor) -> None:
        where = (
            "CPUOffloadPolicy keeps its shard on cpu"
            if self.where.offload
            else f"its mesh computes on {self.where.info.device}"
        )
        raise RuntimeError(
            f"parameter {self.path} is on {local.device} after fully_shard, but {where}. Fix: move the "
            f"module before fully_shard, or to_empty(device='{self.where.info.device}') a "
            "meta-initialised one (fully_shard keeps offloaded shards on the host)."
        )

    def _set_local(self, old: torch.Tensor, new: torch.Tensor) -> None:
        """Make ``new`` the sharded parameter's local tensor in place of ``old``. All-gather
        extension methods set on ``old`` itself (PyTorch allows instance methods) move with it."""
        for name in EXTENSION_METHODS:
            method = old.__dict__.get(name)
            if method is not None:
                bound_to_old = getattr(method, "__self__", None) is old
                setattr(new, name, method.__func__.__get__(new) if bound_to_old else method)
        self.sharded_param._local_tensor = new  # type: ignore[attr-defined]

    def _drop_unsharded(self) -> None:
        """Forget the unsharded buffers (their dtype changed); the next unshard makes new ones."""
        assert not self.is_unsharded, f"parameter {self.fqn} changed while unsharded"
        self.padded_unsharded = torch.empty(0, dtype=self.dtypes.param, device=self.where.info.device)
        self.unsharded_param = None


_MISSING = object()


def _is_subclass(t: torch.Tensor) -> bool:
    return type(t) not in (torch.Tensor, nn.Parameter)


def _views(local: torch.Tensor, padded: torch.Tensor) -> bool:
    """Whether ``local`` is still a view of ``padded`` (the shard storage we own)."""
    if local is padded:
        return True
    if _is_subclass(padded):  # wrapper subclasses have no storage of their own to compare
        return local._base is padded
    return local.untyped_storage().data_ptr() == padded.untyped_storage().data_ptr()


def _padded_rows(moved: torch.Tensor, rows: int, first: int, count: int) -> torch.Tensor:
    """Chunks ``[first, first + count)`` of ``moved`` (chunked by ``rows`` on dim 0), each padded
    with zeros to ``rows``: a new contiguous ``(count * rows, *rest)`` tensor."""
    out = moved.new_zeros((count * rows, *moved.shape[1:]))
    start = min(first * rows, moved.shape[0])
    stop = min((first + count) * rows, moved.shape[0])
    out[: stop - start].copy_(moved[start:stop])
    return out


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
