"""`FSDPParam`: one parameter's life between its sharded and unsharded forms.

For global shape ``(n, *rest)`` on rank ``r`` of ``W``, with ``rows = ceil(n / W)``:

* ``padded_shard``: ``(rows, *rest)``, rows ``[r*rows, (r+1)*rows)`` zero-padded past ``n``: the
  all-gather input, the same size on every rank.
* ``sharded_param``: the ``Shard(0)`` DTensor the module, optimizer and state dict see between
  steps; its local tensor is a view of the first ``local_rows`` rows of ``padded_shard``, so
  optimizer updates land in the all-gather input.
* ``padded_unsharded``: the flat all-gather output; as ``(W, -1)``, row ``i`` is rank ``i``'s shard.
* ``unsharded_param``: the global shape over its first ``n`` rows, used between unshard and reshard.

Storage is resized, never replaced: autograd saves ``unsharded_param`` and ``torch.compile`` guards
on its identity. It is built with ``set_`` (not as a view) so the copy-out does not bump the version
counter autograd recorded. ``Shard(d > 0)``: the shard is a plain ``torch.chunk``; collectives move
dim ``d`` to the front. Under TP the TP-local tensor is sharded (sharded on the joint mesh).
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
from ..layouts.layout import FLAT, ShardLayout, contiguous_stride as _contiguous_stride
from .lifecycle import ShardedState
from ..layouts.mesh import MeshInfo, dtensor_in_place
from ..layouts.policy import CPUOffloadPolicy, MixedPrecisionPolicy
from .registry import manager_of, register_places, register_sharded, register_unsharded
from .settings import Settings
from ..layouts.tp import TPSpec


class GroupView(Protocol):
    """What a parameter reads of the group that owns it (`FSDPParamGroup`)."""

    fqn: str
    sharded_state: ShardedState
    settings: Settings
    needs_sync: bool


@dataclass(frozen=True)
class ParamPlace:
    """One place a parameter is registered: ``module.<name>``, known to the user as ``fqn``."""

    module: nn.Module
    name: str
    fqn: str

    def get(self) -> object:
        return self.module._parameters.get(self.name, _MISSING)

    def set(self, tensor: torch.Tensor) -> None:
        # nn.Module.__setattr__ is too slow for the per-step path; the name is already a parameter.
        self.module._parameters[self.name] = tensor  # type: ignore[assignment]


@dataclass(frozen=True)
class Where:
    """Where one parameter's shard lives and how it is laid out (fixed at construction)."""

    info: MeshInfo
    layout: ShardLayout  # what this library shards (the TP-local shape under TP)
    tp: Optional[TPSpec]
    offload: bool  # shard and .grad on the host; on a CPU mesh the copies are no-ops
    pin_memory: bool
    shard_device: torch.device
    view: Optional[torch.Size] = None  # `FLAT`: the parameter's shape (``layout`` shards it flattened)

    @staticmethod
    def of(
        info: MeshInfo,
        layout: ShardLayout,
        tp: Optional[TPSpec],
        offload: Optional[CPUOffloadPolicy],
        view: Optional[torch.Size] = None,
    ) -> "Where":
        pin = offload is not None and offload.pin_memory and info.device.type not in ("cpu", "meta")
        device = host_device(info.device) if offload is not None else info.device
        return Where(info, layout, tp, offload is not None, pin, device, view)

    @property
    def shape(self) -> torch.Size:
        """The (TP-local) parameter's shape: what the module computes with."""
        return self.view if self.view is not None else self.layout.shape


@dataclass(frozen=True)
class Dtypes:
    """The original dtype (shard, optimizer, sharded .grad) and, from the policy and settings, the
    ``param`` dtype (all-gather and compute) and the ``reduce`` dtype (gradient reduction)."""

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

    # extension methods bound to the shard's instance, as the traced path calls them (`traced`)
    traced_methods: Any = None

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
        self.ext: Optional[ExtensionState] = None  # while an all-gather extension is in use
        data, tp = param.detach(), None
        if isinstance(data, DTensor):
            tp, data = TPSpec.of(data), data.to_local()
        view = None
        if shard_dim == FLAT:  # one contiguous range of the flattened parameter per rank
            view, data, shard_dim = data.shape, data.reshape(-1), 0
        layout = ShardLayout(data.shape, shard_dim, info.world_size, info.rank)
        self.where = Where.of(info, layout, tp, offload, view)
        self.dtypes = Dtypes.derive(param.dtype, mp, None)
        self.padded_shard: Optional[torch.Tensor] = None  # dim 0 only; other dims pad at copy-in
        self.sharded_param = self._make_sharded_param(self._make_local_shard(data))
        self.padded_unsharded = torch.empty(0, dtype=self.dtypes.param, device=info.device)
        self.unsharded_param: Optional[nn.Parameter] = None
        self._partial: Optional[torch.Tensor] = None  # HSDP: `partial_leaf`
        self._unsynced: Optional[torch.Tensor] = None  # gradients without sync held apart: `unsynced_leaf`
        # The local tensor last taken over and its wrapper's storage (`wrapper_key`): another local
        # tensor means something swapped it, another storage a ``p.data = t`` (notice_changes).
        self._seen: Optional[tuple[torch.Tensor, int]] = None
        self._mark_seen()
        register_sharded(self)
        register_places(self, places)
        for place in places:
            place.set(self.sharded_param)

    def note_assigned(self, module: nn.Module, name: str, new: object) -> Optional[nn.Parameter]:
        """``new`` is being registered at one of its places (`registry`): the sharded parameter to
        register instead, taken over now so that ``model.parameters()`` (an optimizer built next)
        sees it; one it cannot take raises here, before anything changed. While unsharded (or not
        yet in a group) the next unshard takes it over."""
        if self.group is None or self.is_unsharded:
            if self.group is not None:
                self.group.needs_sync = True
            return None
        place = next(p for p in self.places if p.module is module and p.name == name)
        self._take_over(new, place)
        self.group.needs_sync = True  # the new local tensor moves into the all-gather's storage
        return self.sharded_param

    def live_buffers(self) -> list[tuple[str, Optional[torch.Tensor]]]:
        """The tensors it holds, each with its category (`fully_shard.plan.CATEGORIES`), for tools."""
        out: list[tuple[str, Optional[torch.Tensor]]] = [("unsharded_params", self.padded_unsharded)]
        if self.ext is not None:
            out += [("unsharded_params", t) for t in self.ext.outputs]
        shard = self.padded_shard if self.padded_shard is not None else self.local_shard
        out += [("sharded_params", shard), ("gradients", self.sharded_param.grad)]
        out += [("gradients", self.partial_reduce), ("gradients", self.unsynced_grad)]
        if self.unsharded_param is not None:
            out.append(("gradients", self.unsharded_param.grad))
        return out

    def precopy(self, memo: dict[int, Any]) -> None:
        """Copy the sharded parameter and its padded storage into ``memo`` first: Tensor.__deepcopy__
        cannot (its .grad is a DTensor over a buffer at an offset)."""
        if id(self.sharded_param) in memo:
            return
        padded = self.padded_shard.clone() if self.padded_shard is not None else None
        local = padded[: self.where.layout.local_rows] if padded is not None else self.local_shard.clone()
        param = self._make_sharded_param(local)
        state = {k: v for k, v in self.sharded_param.__dict__.items() if k != "_local_tensor"}  # plain ones'
        param.__dict__.update(copy.deepcopy(state, memo))
        if self.sharded_param.grad is not None:
            if hasattr(param, "grad_dtype"):  # keep_low_precision_grads: a .grad in another dtype
                param.grad_dtype = self.sharded_param.grad_dtype  # type: ignore[attr-defined]
            param.grad = self.sharded_param.grad.clone()
        memo[id(self.sharded_param)] = param
        if self.padded_shard is not None:
            memo[id(self.padded_shard)] = padded

    def __deepcopy__(self, memo: dict[int, Any]) -> "FSDPParam":
        if self.is_unsharded:
            refuse_busy(f"parameter {self.path}", "is unsharded")
        self.precopy(memo)
        param = memo[id(self.sharded_param)]
        # Deepcopy cannot copy storage resized to 0; the copy makes its own at its first unshard.
        empty = torch.empty(0, dtype=self.dtypes.param, device=self.where.info.device)
        new = copy_fields(
            self,
            memo,
            _seen=(param._local_tensor, wrapper_key(param)),
            unsharded_param=None,
            ext=None,
            padded_unsharded=empty,
            _unsynced=None,  # (sums accumulated without sync stay with the original, as its unsharded .grad)
        )
        register_sharded(new)
        register_places(new, new.places)  # (what is assigned at the copy's places is handed to it)
        new.lower_grads_once_accumulated(self._keeps_low_precision_grads())  # (the copy's group: mid-copy)
        return new

    def _path(self, fqn: str) -> str:
        """``fqn`` (relative to the fully_shard call's module) from the root, once lazy init knows it."""
        prefix = self.group.fqn if self.group is not None else ""
        return f"{prefix}.{fqn}" if prefix else fqn

    @property
    def path(self) -> str:
        return self._path(self.fqn)

    # For readers outside this class; inside it, read `where` and `dtypes`.
    fqn = property(lambda self: self.places[0].fqn, doc="Its name relative to the fully_shard call's module.")
    shape = property(lambda self: self.where.shape)
    shard_dim = property(lambda self: self.where.layout.dim if self.where.view is None else FLAT)
    info = property(lambda self: self.where.info)
    layout = property(lambda self: self.where.layout)
    tp = property(lambda self: self.where.tp)
    offload = property(lambda self: self.where.offload)
    pin_memory = property(lambda self: self.where.pin_memory)
    dtype = property(lambda self: self.dtypes.orig)
    param_dtype = property(lambda self: self.dtypes.param)
    shard_numel = property(lambda self: self.where.layout.shard_numel, doc="Per rank, padding included.")

    @property
    def local_shard(self) -> torch.Tensor:
        return self.sharded_param._local_tensor  # type: ignore[attr-defined]

    def _set_dtype(self, dtype: torch.dtype) -> None:
        override = self.group.settings.reduce_dtype if self.group is not None else None
        self.dtypes = Dtypes.derive(dtype, self.dtypes.policy, override)

    def derive_dtypes(self) -> None:
        """Derive ``param_dtype`` / ``reduce_dtype`` again (the group's settings changed)."""
        self._set_dtype(self.dtypes.orig)

    @property
    def codec(self) -> Any:
        """The all-gather codec the group's settings chose for it (None: none)."""
        return self.group.settings.codec_for(self.fqn) if self.group is not None else None

    def add_places(self, places: list[ParamPlace]) -> None:
        """A later ``fully_shard`` call's modules use this parameter too (tied weights)."""
        current = self.unsharded_param if self.is_unsharded else self.sharded_param
        register_places(self, places)
        for place in places:
            self.places.append(place)
            place.set(current)  # type: ignore[arg-type]

    def local_chunk(self, full: torch.Tensor) -> torch.Tensor:
        """This rank's chunk of a tensor of the unsharded shape (a view)."""
        layout = self.where.layout
        full = full.reshape(layout.shape) if self.where.view is not None else full
        return full.narrow(layout.dim, layout.start, layout.local_rows)

    def _empty_shard(self, shape: tuple[int, ...], like: torch.Tensor) -> torch.Tensor:
        """New shard storage; a tensor subclass (an extension's weights) makes its own, so stays one."""
        meta = like.is_meta
        if _is_subclass(like):
            return like.new_empty(shape) if meta else like.new_zeros(shape, device=self.where.shard_device)
        device, pin = ("meta", False) if meta else (self.where.shard_device, self.where.pin_memory)
        return torch.empty(shape, dtype=self.dtypes.orig, device=device, pin_memory=pin)

    def _make_local_shard(self, full: torch.Tensor) -> torch.Tensor:
        layout = self.where.layout
        if layout.dim != 0:
            local = self._empty_shard(tuple(layout.local_shape), full)
            if not full.is_meta:
                local.copy_(self.local_chunk(full))
            return local
        self.padded_shard = self._empty_shard(tuple(layout.padded_shape), full)
        if not full.is_meta:  # this rank's rows only: a CPU-initialised model never goes whole to the device
            self.padded_shard[: layout.local_rows].copy_(self.local_chunk(full))
            self.padded_shard[layout.local_rows :].zero_()
        return self.padded_shard[: layout.local_rows]

    def _spec(self) -> tuple[DeviceMesh, tuple[Placement, ...], torch.Size]:
        """The sharded parameter's mesh, placements and global shape."""
        where = self.where
        placements = where.info.placements(where.layout.dim)
        if where.tp is None:
            return where.info.mesh, placements, where.layout.shape
        return (*where.tp.joint(where.info.mesh, placements, where.layout.dim), where.tp.shape)

    def _make_sharded_param(self, local: torch.Tensor) -> nn.Parameter:
        if self.where.info.plain:  # the whole tensor (a shard world of 1), carrying its local alias
            return _plain_param(local, self.requires_grad)
        mesh, placements, shape = self._spec()
        dtensor = dtensor_in_place(local, mesh, placements, shape, _contiguous_stride(shape))
        return nn.Parameter(dtensor, requires_grad=self.requires_grad)

    def all_gather_input(self) -> torch.Tensor:
        """This rank's padded shard, flat, in its original dtype (copy-in casts it)."""
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
        """The same in ``param_dtype`` as bytes, for a group gathering several dtypes at once."""
        shard = self.all_gather_input()
        if self.dtypes.param != self.dtypes.orig:
            shard = shard.to(self.dtypes.param)
        return shard.view(torch.uint8)

    def resolve_extension(self) -> bool:
        """Before each all-gather: whether it goes through an extension (`extension.hooks_of`).
        Another extension than the one that built the unsharded parameter drops it."""
        hooks = hooks_of(self.local_shard, self.codec, self.path)
        if hooks is not None:
            self.refuse_extension_off_dim0()
        source = hooks.source if hooks is not None else None
        if source is not (self.ext.source if self.ext is not None else None):
            if self.unsharded_param is not None:
                self._drop_unsharded()
            self.ext = ExtensionState(source=source) if hooks is not None else None
        if self.ext is not None:
            self.ext.hooks = hooks
        return hooks is not None

    def refuse_extension_off_dim0(self) -> None:
        """An all-gather extension gathers dim-0 shards: raise, naming the fix, for any other."""
        if self.shard_dim != 0:
            where = "flat (FlatShard)" if self.shard_dim == FLAT else f"on dim {self.shard_dim}"
            raise ValueError(
                f"parameter {self.path} has an all-gather extension ({type(self.local_shard).__name__}) "
                f"and is sharded {where}; extensions gather dim-0 shards. Fix: "
                "return Shard(0) (or None) for it from shard_placement_fn."
            )

    def extension_inputs(self) -> list[torch.Tensor]:
        """What the extension gathers for this rank (each input padded to ``rows``), flat, as bytes."""
        assert self.ext is not None and self.ext.hooks is not None
        local, hooks = self.local_shard, self.ext.hooks
        if self.where.offload:  # the hooks run on the device copy, as PyTorch's do
            local = to_device(local, self.where.info.device, self.where.pin_memory)
            if local is not self.local_shard:  # methods set on the host tensor stay bound to it
                hooks = hooks_of(local, self.codec, self.path) or hooks
        layout, mesh = self.where.layout, self.where.info.shard_mesh
        stride = _contiguous_stride(layout.shape)
        pre_args = (mesh, layout.shape, stride, self.places[0].module, self.dtypes.policy)
        inputs = self.ext.inputs(hooks, pre_args, layout.local_rows, layout.rows, self.path)
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
        """Give the unsharded storage its memory back; return one ``(W, bytes per rank)`` byte view per
        all-gather input, or None for dims other than 0 (`copy_out` fills the unsharded tensor)."""
        info, layout = self.where.info, self.where.layout
        world = info.world_size
        if self.ext is not None and self.ext.hooks is not None:
            return self.ext.alloc_outputs(world, info.device)
        numel = world * layout.shard_numel if layout.dim == 0 else layout.shape.numel()
        storage = self.padded_unsharded.untyped_storage()
        nbytes = numel * self.padded_unsharded.element_size()
        if storage.size() != nbytes:
            if self.padded_unsharded.numel() == 0:
                self.padded_unsharded = torch.empty(numel, dtype=self.dtypes.param, device=info.device)
            else:
                storage.resize_(nbytes)
        if layout.dim != 0:
            return None
        return [self.padded_unsharded.view(torch.uint8).view(world, -1)]

    def copy_out(self, gathered: torch.Tensor) -> None:
        """Fill the unsharded storage from this parameter's ``(W', k * shard_numel)`` slice of an
        all-gather output (``param_dtype``): ``W' * k`` padded chunks in shard-world order."""
        layout, world, outer = self.where.layout, self.where.info.world_size, gathered.shape[0]
        # A view for the full all-gather; a copy only when gathering from reshard_after_forward=int.
        rows, (n, *rest) = layout.rows, layout.moved_shape
        chunks = gathered.view(outer, world // outer, rows, *rest).flatten(0, 1)
        target = self._gather_view().movedim(layout.dim, 0)
        full = layout.full_chunks
        if full:
            target[: full * rows].view(full, rows, *rest).copy_(chunks[:full])
        if full * rows < n:
            target[full * rows :].copy_(chunks[full, : n - full * rows])

    def gathered_rows(self, first: int, count: int) -> torch.Tensor:
        """Shard-world rows ``[first, first + count)`` as all-gather bytes (reshard_after_forward=int)."""
        if self.uses_extension:
            assert self.ext is not None
            return torch.cat(self.ext.gathered_rows(first, count, self.where.info.world_size))
        if self.where.layout.dim == 0:
            rows = self.padded_unsharded.view(self.where.info.world_size, -1)[first : first + count]
            return rows.reshape(-1).view(torch.uint8)
        moved = self._gather_view().movedim(self.where.layout.dim, 0)
        return _padded_rows(moved, self.where.layout.rows, first, count).view(-1).view(torch.uint8)

    def _unsharded_view(self) -> torch.Tensor:
        """The unsharded parameter's shape over the gathered storage."""
        return self._gather_view(self.where.shape)

    def _gather_view(self, shape: Optional[torch.Size] = None) -> torch.Tensor:
        """The gathered storage in the layout's shape (flattened for `FLAT`), or in ``shape``."""
        shape = self.where.layout.shape if shape is None else shape
        tensor = torch.empty(0, dtype=self.dtypes.param, device=self.where.info.device)
        return tensor.set_(self.padded_unsharded.untyped_storage(), 0, shape, _contiguous_stride(shape))

    def _make_unsharded_param(self) -> nn.Parameter:
        """The unsharded parameter over the gathered storage, or as the extension's post hook built it."""
        if self.ext is not None and self.ext.hooks is not None:
            shape = self.where.layout.shape
            with torch.no_grad():
                tensor = self.ext.rebuild_first(self.dtypes.param, self.path)
                tensor = torch.as_strided(tensor, shape, _contiguous_stride(shape), 0)  # no padding rows
        else:
            tensor = self._unsharded_view()
        if self.where.tp is not None:
            tensor = self.where.tp.unsharded(tensor)
        self.unsharded_param = nn.Parameter(tensor, requires_grad=self.requires_grad)
        register_unsharded(self, self.unsharded_param)
        return self.unsharded_param

    def ensure_unsharded_param(self) -> nn.Parameter:
        """The unsharded parameter, made now (over its gather buffer, storage freed) where no
        unshard made it yet: what gradients without sync accumulate on, compiled too."""
        if self.unsharded_param is None:
            if self.padded_unsharded.numel() == 0:
                numel = self.where.info.world_size * self.where.layout.shard_numel
                self.padded_unsharded = torch.empty(
                    numel, dtype=self.dtypes.param, device=self.where.info.device
                )
                self.padded_unsharded.untyped_storage().resize_(0)
            self._make_unsharded_param()
        return self.unsharded_param

    # The group's `sharded_state` records which form is in use; it calls these two on its transitions.

    @property
    def is_unsharded(self) -> bool:
        return self.group is not None and self.group.sharded_state is ShardedState.UNSHARDED

    def to_unsharded(self) -> None:
        """Point the module at the unsharded parameter (copied out, or rebuilt here by an extension)."""
        unsharded = self.unsharded_param
        if unsharded is None:
            unsharded = self._make_unsharded_param()
        elif self.ext is not None and self.ext.hooks is not None:
            on_tp = self.where.tp is not None
            out = unsharded._local_tensor if on_tp else unsharded  # type: ignore[attr-defined]
            self.ext.rebuild_into(out, self.dtypes.param)
        for place in self.places:  # straight into _parameters: see ParamPlace.set
            place.module._parameters[place.name] = unsharded

    def to_sharded(self) -> None:
        """Point the module back at the sharded parameter and free the unsharded memory."""
        for place in self.places:
            # A place holding something else was assigned meanwhile: `sync_with_module` takes it over.
            params = place.module._parameters
            if params.get(place.name) is self.unsharded_param:
                params[place.name] = self.sharded_param
        if self.ext is not None:
            self.ext.free()
        self.padded_unsharded.untyped_storage().resize_(0)

    def take_accumulated(self, in_place: bool = True) -> Optional[torch.Tensor]:
        """Remove the gradients accumulated since the last reduction: those held apart, with the
        unsharded parameter's ``.grad`` added (``in_place``: into the held sum, as PyTorch's
        accumulated gradient, fp32 += bf16), TP-local."""
        held, grad = self.take_unsynced(), self._take_raw_unsharded_grad()
        if held is not None and grad is not None:
            held, grad = self._one_form(held, grad)
            grad = held.add_(grad) if in_place else held + grad
        return self._local_grad(held if grad is None else grad)

    def discard_accumulated(self) -> bool:
        """Drop the gradients accumulated since the last reduction (no TP redistribution: no
        collective); whether there were any."""
        held, grad = self.take_unsynced(), self._take_raw_unsharded_grad()
        return held is not None or grad is not None

    def take_unsharded_grad(self) -> Optional[torch.Tensor]:
        """`take_accumulated`, with the shard dim in front."""
        grad = self.take_accumulated()
        if grad is None:
            return None
        if self.where.view is not None:
            return grad.reshape(-1)
        return grad.movedim(self.where.layout.dim, 0) if self.where.layout.dim else grad.contiguous()

    def _take_raw_unsharded_grad(self) -> Optional[torch.Tensor]:
        """The unsharded parameter's ``.grad`` (with TP, the DTensor autograd made), removed."""
        if self.unsharded_param is None or self.unsharded_param.grad is None:
            return None
        grad, self.unsharded_param.grad = self.unsharded_param.grad, None
        return grad

    def _local_grad(self, grad: Optional[torch.Tensor]) -> Optional[torch.Tensor]:
        """``grad`` TP-local (a Partial TP gradient redistributed first), its shape checked."""
        if grad is None:
            return None
        grad = self.where.tp.local_grad(grad) if self.where.tp is not None else grad
        self._check_grad_shape(grad.shape, self.where.shape)
        return grad

    def _check_grad_shape(self, shape: torch.Size, expected: torch.Size) -> None:
        if shape != expected:  # (before it is added to anything: no broadcast)
            raise RuntimeError(
                f"fully_shard: the gradient of {self.path} has shape {tuple(shape)}, expected "
                f"{tuple(expected)}: something assigned the unsharded parameter's .grad. Fix: "
                "leave the unsharded parameters' .grad to autograd (change the sharded .grad after the "
                "step's backward)."
            )

    def _one_form(self, held: torch.Tensor, grad: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """A held sum and a gradient to add to it, both as autograd made them where both are TP
        DTensors of one placement (a Partial gradient summed before its one redistribution, as
        PyTorch's accumulated gradient), else both TP-local (a compiled micro-batch's sum)."""
        if isinstance(held, DTensor) and isinstance(grad, DTensor) and held.placements == grad.placements:
            self._check_grad_shape(grad.to_local().shape, held.to_local().shape)
            return held, grad
        return self._local_grad(held), self._local_grad(grad)  # type: ignore[return-value]

    def accumulate_sharded_grad(self, padded_grad_shard: torch.Tensor) -> None:
        """Add this rank's reduced gradient (``shard_numel`` elements, padding included) to ``.grad``."""
        where, layout, param, dtype = self.where, self.where.layout, self.sharded_param, self.dtypes.orig
        grad = padded_grad_shard.view(layout.rows, *layout.moved_shape[1:])[: layout.local_rows]
        if layout.dim:
            grad = grad.movedim(0, layout.dim)
        if grad.dtype != dtype:
            grad = grad.to(dtype)
        existing = param.grad
        if where.offload and (grad.device != where.shard_device or grad.is_meta):  # back to the host
            with allocating():
                host = torch.empty(
                    grad.shape, dtype=dtype, device=where.shard_device, pin_memory=where.pin_memory
                )
            # Async only into a fresh .grad (the host waits before the optimizer); adding needs values.
            host.copy_(grad, non_blocking=where.pin_memory and existing is None)
            grad = host
        plain = where.info.plain
        if existing is not None:
            (existing if plain else existing._local_tensor).add_(grad)  # type: ignore[attr-defined]
        elif plain:
            param.grad = grad.contiguous()
        else:
            spec = param._spec  # type: ignore[attr-defined]
            param.grad = DTensor(grad.contiguous(), spec, requires_grad=False)  # type: ignore[call-arg]
        # Autograd accumulates into the unsharded parameter: fire the sharded one's hooks here.
        hooks = param._post_accumulate_grad_hooks  # type: ignore[attr-defined]
        if hooks:
            for hook in list(hooks.values()):
                if not isinstance(hook, LowerGradHook):  # lowered at the end of backward here
                    hook(param)

    def _keeps_low_precision_grads(self) -> bool:
        return self.group is not None and self.group.settings.keep_low_precision_grads

    def lower_grads_once_accumulated(self, on: bool) -> None:
        """``keep_low_precision_grads`` where autograd accumulates ``.grad`` (`LowerGradHook`):
        add or remove the hook on the sharded parameter (a replacement or a copy gets it again:
        tensor hooks are not copied)."""
        param = self.sharded_param
        hooks = param._post_accumulate_grad_hooks  # type: ignore[attr-defined]
        ours = [k for k, h in (hooks or {}).items() if isinstance(h, LowerGradHook)]
        if on and not ours:
            param.register_post_accumulate_grad_hook(LowerGradHook())
        for k in ours if not on else ():
            del hooks[k]

    def lower_grad(self) -> None:
        """``keep_low_precision_grads``: ``.grad`` in ``param_dtype`` (accumulated in the
        parameter's dtype until now), for an optimizer that steps with low-precision gradients."""
        param, low = self.sharded_param, self.dtypes.param
        grad = param.grad
        if grad is None or grad.dtype == low:
            return
        mesh, placements, shape = self._spec()
        plain = self.where.info.plain
        local = (grad if plain else grad._local_tensor).to(low)  # type: ignore[attr-defined]
        param.grad = None
        param.grad_dtype = None  # type: ignore[attr-defined]  # any dtype: the next step's starts in ours
        param.grad = local if plain else dtensor_in_place(local, mesh, placements, shape, grad.stride())

    # HSDP with the all-reduce deferred (``set_requires_all_reduce(False)``): each backward's
    # shard-group sum waits, not yet summed over the replicas, as the ``.grad`` of a leaf of the
    # padded shard's size that holds no memory, so that a compiled backward adds to it as autograd
    # adds any gradient (runtime/traced.py) and an eager one by hand, in either order.

    def partial_leaf(self, dtype: torch.dtype) -> torch.Tensor:
        """The leaf whose ``.grad`` holds the deferred sum (made when missing or stale)."""
        leaf, numel, device = self._partial, self.where.layout.shard_numel, self.where.info.device
        if leaf is None or (
            leaf.grad is None and (leaf.dtype, leaf.device, leaf.numel()) != (dtype, device, numel)
        ):
            leaf = self._partial = torch.zeros((), dtype=dtype, device=device).expand(numel).requires_grad_()
        return leaf

    @property
    def partial_reduce(self) -> Optional[torch.Tensor]:
        return None if self._partial is None else self._partial.grad

    def add_partial_reduce(self, reduced: torch.Tensor) -> None:
        """Keep this backward's shard-group sum."""
        leaf = self.partial_leaf(reduced.dtype)
        if leaf.grad is None:
            leaf.grad = reduced.clone()
        else:
            leaf.grad.add_(reduced)

    def take_partial_reduce(self) -> Optional[torch.Tensor]:
        """Hand the deferred sum to the reduction about to include it, so it is not sent twice."""
        return _take_leaf_grad(self._partial)

    def zero_grad_if_partial(self) -> Optional[torch.Tensor]:
        """A zero gradient (shard dim in front) when a deferred sum must join a reduction this
        backward gave it no gradient for."""
        if self.partial_reduce is None:
            return None
        where = self.where
        return torch.zeros(where.layout.moved_shape, dtype=self.dtypes.param, device=where.info.device)

    # Gradients accumulated without sync (``set_requires_gradient_sync(False)``) stay on the unsharded
    # parameter's ``.grad``, where autograd adds each backward's, except where they are held apart as
    # the ``.grad`` of a leaf that holds no memory (`unsynced_leaf`): in the reduce dtype where it
    # differs from the param dtype (`accumulates_apart`: PyTorch's FSDP2 rule, each micro-batch's bf16
    # gradient cast once and summed in float32), and across an unsharded parameter dropped
    # (`_drop_unsharded`). A compiled backward adds to the leaf as autograd adds any gradient
    # (runtime/traced.py), an eager one by hand (`hold_unsynced`); the reduction takes both.

    @property
    def accumulates_apart(self) -> bool:
        """Whether gradients without sync are summed in the reduce dtype, apart from the unsharded
        parameter (where it differs from the param dtype; FSDP1's rule sums them in the param dtype)."""
        dtypes, group = self.dtypes, self.group
        return (
            dtypes.reduce != dtypes.param and group is not None and group.settings.accumulate_in_reduce_dtype
        )

    def unsynced_leaf(self, dtype: torch.dtype, like: Optional[torch.Tensor] = None) -> torch.Tensor:
        """The leaf whose ``.grad`` holds gradients accumulated apart (made when missing or stale): a
        plain TP-local tensor as a compiled backward adds to, or, to hold a TP gradient ``like`` of
        another placement than the parameter's, a DTensor of its spec."""
        leaf = self._unsynced
        if isinstance(like, DTensor):
            if isinstance(leaf, DTensor) and (leaf.dtype, leaf.placements) == (dtype, like.placements):
                return leaf
            local = torch.zeros((), dtype=dtype, device=like.device).expand(like.to_local().shape)
            spec = (like.device_mesh, like.placements)
            leaf = DTensor.from_local(local, *spec, run_check=False, shape=like.shape, stride=like.stride())
            self._unsynced = leaf.requires_grad_()
            return leaf
        shape, device = self.where.shape, self.where.info.device
        if leaf is None or (
            leaf.grad is None
            and (type(leaf), leaf.dtype, leaf.device, leaf.shape) != (torch.Tensor, dtype, device, shape)
        ):
            leaf = self._unsynced = torch.zeros((), dtype=dtype, device=device).expand(shape).requires_grad_()
        return leaf

    @property
    def unsynced_grad(self) -> Optional[torch.Tensor]:
        return None if self._unsynced is None else self._unsynced.grad

    def take_unsynced(self) -> Optional[torch.Tensor]:
        return _take_leaf_grad(self._unsynced)

    def hold_unsynced(self) -> None:
        """After a backward without sync: where gradients accumulate apart, this backward's moves
        from the unsharded parameter to the leaf (cast to the reduce dtype, added to what is there)."""
        if self.accumulates_apart:
            self._hold(self._take_raw_unsharded_grad())

    def _hold(self, grad: Optional[torch.Tensor]) -> None:
        # A TP gradient of another placement than the parameter's (a Partial one) is held as the
        # DTensor autograd made, on a DTensor leaf of its spec: redistributed once, by the
        # reduction, in the reduce dtype (PyTorch's numerics). Others are held TP-local (exact).
        if grad is None:
            return
        tp = self.where.tp
        if not (isinstance(grad, DTensor) and tp is not None and tuple(grad.placements) != tp.placements):
            grad = self._local_grad(grad)  # (its shape checked before anything is held)
        held = self.take_unsynced()
        if held is not None:
            held, grad = self._one_form(held, grad)
            grad = held.add_(grad)
        dtype = self.dtypes.reduce if self.accumulates_apart else grad.dtype
        grad = grad.to(dtype) if grad.dtype != dtype else grad
        self.unsynced_leaf(dtype, like=grad).grad = grad

    def sync_with_module(self, adopt_device: bool = False) -> bool:
        """Take over what replaced or converted this parameter while sharded; return whether anything
        changed. A parameter assigned at a place becomes the sharded one (refused if its global shape
        or placement differs); a new local tensor (``to_empty``, ``module.to``) moves back into the
        storage the all-gather reads (offloaded ones to the host when ``adopt_device``).
        Runs when something reported a change (`FSDPParamGroup.needs_sync`) and after ``_apply``."""
        changed = self._adopt_assigned()
        frozen_or_thawed = self.sharded_param.requires_grad != self.requires_grad
        if frozen_or_thawed:
            self.requires_grad = self.sharded_param.requires_grad
            if self.unsharded_param is not None:
                self.unsharded_param.requires_grad_(self.requires_grad)
        local, seen = self.local_shard, self._seen
        if seen is not None and local is seen[0] and not changed:
            return frozen_or_thawed
        self._rehome(local, adopt_device)
        self._mark_seen()
        return True

    def _mark_seen(self) -> None:
        # A meta shard stays unseen, refused each iteration until real (on a meta mesh: a simulation).
        local = self.local_shard
        unseen = local.is_meta and self.where.info.device.type != "meta"
        self._seen = None if unseen else (local, wrapper_key(self.sharded_param))

    def data_assigned(self) -> None:
        """``p.data = t`` on the sharded parameter. A plain parameter (`replicate(plain_params=True)`)
        computes with its own storage: take the new one over (`sync_with_module`). A DTensor's
        replaced only its wrapper's metadata, not the shard DTensor computes with: put the wrapper
        back and say so."""
        param = self.sharded_param
        if self.where.info.plain:
            param._local_tensor = param.detach()  # type: ignore[attr-defined]
            return
        param.data = self._make_sharded_param(self.local_shard).detach()
        self._mark_seen()
        raise ValueError(
            f"parameter {self.path}: '.data' was assigned a new tensor after fully_shard sharded it. The "
            "parameter is a DTensor over this rank's shard, and 'p.data = t' replaces only its wrapper, so "
            "the new values would be silently ignored (as PyTorch's fully_shard ignores them); nothing was "
            "changed. Fix: copy the values in, 'with torch.no_grad(): p.copy_(distribute_tensor(t, "
            "p.device_mesh, p.placements))', or assign a new parameter ('module.weight = nn.Parameter(t)' "
            "or load_state_dict(..., assign=True)), which fully_shard takes over."
        )

    def _adopt_assigned(self) -> bool:
        for place in self.places:
            current = place.get()
            if current is not self.sharded_param:
                break
        else:
            return False
        self._take_over(current, place)
        return True

    def _take_over(self, new: object, place: ParamPlace) -> None:
        """Make what was assigned at ``place`` the sharded parameter (refused if it cannot be)."""
        self.sharded_param = self._accept_replacement(new, self._path(place.fqn))
        register_sharded(self)
        self.lower_grads_once_accumulated(self._keeps_low_precision_grads())
        for p in self.places:  # tied places stay tied
            p.set(self.sharded_param)

    def _accept_replacement(self, new: object, fqn: str) -> nn.Parameter:
        mesh, placements, shape = self._spec()
        expected = f"a DTensor of global shape {tuple(shape)} with placements {placements} on mesh {mesh}"
        owner = manager_of(new) if isinstance(new, nn.Parameter) else None
        if owner is not None and owner is not self:
            raise ValueError(
                f"parameter '{fqn}' was assigned the parameter '{owner.path}', which another fully_shard "
                "call manages (tying weights after fully_shard). Two groups cannot share one sharded "
                "parameter. Fix: tie the weights before fully_shard (e.g. model.tie_weights() first); "
                "fully_shard then manages them as one."
            )
        if self.where.info.plain and type(new) is nn.Parameter and new.shape == shape:
            self.requires_grad = new.requires_grad  # kept as it is: its storage moves into ours at sync
            return _plain_param(new, new.requires_grad, keep=True)
        if isinstance(new, DTensor):
            if new.shape == shape and new.device_mesh == mesh and tuple(new.placements) == placements:
                keep = isinstance(new, nn.Parameter)
                return new if keep else nn.Parameter(new, requires_grad=self.requires_grad)
            got = (
                f"a DTensor of global shape {tuple(new.shape)} with placements {tuple(new.placements)} on "
                f"mesh {new.device_mesh}"
            )
        elif (
            isinstance(new, torch.Tensor) and self.where.tp is None and new.shape in (shape, self.where.shape)
        ):
            # A plain full tensor: keep this rank's chunk, as fully_shard itself does.
            self._set_dtype(new.dtype)
            self._drop_unsharded()
            self.requires_grad = new.requires_grad
            return self._make_sharded_param(self._make_local_shard(new.detach().reshape(shape)))
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
        """Move a new local tensor into storage the all-gather reads (elsewhere it would be ignored)."""
        if local.dtype != self.dtypes.orig:  # module.to(dtype), .half(), or an assigned tensor
            self._set_dtype(local.dtype)
            self._drop_unsharded()
        if local.is_meta:
            return  # shapes only until to_empty; unshard refuses to gather it
        where, padded = self.where, self.padded_shard
        if local.device != where.shard_device and not (adopt_device and where.offload):
            self._refuse_device(local)
        same_dtype = padded is not None and not padded.is_meta and padded.dtype == local.dtype
        if same_dtype and _views(local, padded):  # type: ignore[arg-type]
            return
        in_place = local.device == where.shard_device and (not where.pin_memory or local.is_pinned())
        if where.layout.dim != 0:
            if not in_place:
                host = self._empty_shard(tuple(local.shape), local)
                host.copy_(local)
                self._set_local(local, host)
            return  # the all-gather reads the local tensor itself
        if in_place and tuple(local.shape) == tuple(where.layout.padded_shape) and local.is_contiguous():
            self.padded_shard = local  # no padding on this rank: it is the padded shard
            return
        padded = self._empty_shard(tuple(where.layout.padded_shape), local)
        padded[: local.shape[0]].copy_(local)
        padded[local.shape[0] :].zero_()
        self.padded_shard = padded
        self._set_local(local, padded[: local.shape[0]])

    def _refuse_device(self, local: torch.Tensor) -> None:
        device = self.where.info.device
        where = (
            "CPUOffloadPolicy keeps its shard on cpu"
            if self.where.offload
            else f"its mesh computes on {device}"
        )
        raise RuntimeError(
            f"parameter {self.path} is on {local.device} after fully_shard, but {where}. Fix: move the "
            f"module before fully_shard, or to_empty(device='{device}') a "
            "meta-initialised one (fully_shard keeps offloaded shards on the host)."
        )

    def _set_local(self, old: torch.Tensor, new: torch.Tensor) -> None:
        """Make ``new`` the local tensor in place of ``old``; extension methods set on ``old`` move too."""
        for name in EXTENSION_METHODS:
            method = old.__dict__.get(name)
            if method is not None:
                bound_to_old = getattr(method, "__self__", None) is old
                setattr(new, name, method.__func__.__get__(new) if bound_to_old else method)
        param = self.sharded_param
        if self.where.info.plain:  # the parameter is the whole tensor: it moves into the new storage too
            param.data = new
        if param.device == new.device or self.where.info.plain:
            param._local_tensor = new  # type: ignore[attr-defined]
            return
        # The wrapper moved without its shard (module.cuda() on offloaded shards): a DTensor's device
        # is fixed when it is made, so make it again where the shard is; the Parameter object stays.
        mesh, placements, shape = self._spec()
        fresh = nn.Parameter(
            dtensor_in_place(new, mesh, placements, shape, param.stride()), param.requires_grad
        )
        grad = param.grad
        if grad is not None:  # moved along by module.cuda(): back where the shard is too
            local = grad._local_tensor.to(new.device)  # type: ignore[attr-defined]
            fresh.grad = dtensor_in_place(local, mesh, placements, shape, grad.stride())
        torch.utils.swap_tensors(param, fresh)

    def _drop_unsharded(self) -> None:
        """Forget the unsharded buffers (their dtype changed, or an extension builds them now); the
        next unshard makes new ones. A gradient accumulated without sync is held apart meanwhile."""
        assert not self.is_unsharded, f"parameter {self.fqn} changed while unsharded"
        self._hold(self._take_raw_unsharded_grad())
        self.padded_unsharded = torch.empty(0, dtype=self.dtypes.param, device=self.where.info.device)
        self.unsharded_param = None


_MISSING = object()


def _take_leaf_grad(leaf: Optional[torch.Tensor]) -> Optional[torch.Tensor]:
    """A held sum (`FSDPParam.partial_leaf`, `FSDPParam.unsynced_leaf`), removed from its leaf."""
    if leaf is None or leaf.grad is None:
        return None
    held, leaf.grad = leaf.grad, None
    return held


class LowerGradHook:
    """``keep_low_precision_grads`` when autograd accumulates the sharded parameter's ``.grad``
    itself (a compiled backward, runtime/traced.py): lowered once accumulated, as the eager engine
    lowers it at the end of backward (`FSDPParam.lower_grad`; its own hook loop skips this one).
    Stateless, found by type: a deepcopied parameter's copy reaches its own manager. Not in a
    backward without gradient sync (torch 2.11's compiled one hands the shard a zero gradient
    there: kept in the parameter's dtype, a later trace can read the parameter)."""

    def __call__(self, param: torch.Tensor) -> None:
        fp = manager_of(param)  # type: ignore[arg-type]
        if isinstance(fp, FSDPParam) and (fp.group is None or fp.group.settings.requires_gradient_sync):
            fp.lower_grad()


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
    """Chunks ``[first, first + count)`` of ``moved`` (``rows`` each on dim 0), zero-padded."""
    out = moved.new_zeros((count * rows, *moved.shape[1:]))
    start = min(first * rows, moved.shape[0])
    stop = min((first + count) * rows, moved.shape[0])
    out[: stop - start].copy_(moved[start:stop])
    return out


def wrapper_key(param: torch.Tensor) -> int:
    """The storage of a DTensor's wrapper: ``p.data = t`` replaces it (and nothing DTensor reads);
    of a plain parameter, its storage: ``p.data = t`` replaces it."""
    return param.untyped_storage()._cdata


def _plain_param(local: torch.Tensor, requires_grad: bool, keep: bool = False) -> nn.Parameter:
    """A plain parameter over ``local``'s storage (``keep``: ``local`` is one already), with a
    non-autograd alias of itself under the name DTensor keeps its local tensor (``_local_tensor``),
    so the engine reads a plain parameter's storage and a DTensor's shard the same way. The alias
    shares the parameter's version counter: writes through either are seen."""
    param = local if keep else nn.Parameter(local, requires_grad=requires_grad)
    param._local_tensor = param.detach()  # type: ignore[attr-defined]
    return param
