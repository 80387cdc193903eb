"""`FullyShardedDataParallel`: FSDP1's wrapper class, running on this package's per-parameter
engine. Constructing one applies ``fully_shard`` (or ``replicate``, or HSDP) to the wrapper, after
wrapping the submodules the auto-wrap policy chose as nested instances (bottom up, the root last).

The wrapped module is the child ``_fsdp_wrapped_module`` (as in FSDP1), so ``model.modules()``
still finds it and ``apply_activation_checkpointing`` can wrap it; state dicts drop that segment
from their keys (FSDP1's names with ``use_orig_params=True``). There is no flat parameter: the
optimizer sees the original parameters as sharded DTensors, whatever ``use_orig_params`` says.
"""

from __future__ import annotations

import contextlib
import dataclasses
import functools
import os
import warnings
from typing import Any, Callable, Iterable, Iterator, Optional, Union

import torch
import torch.distributed as dist
import torch.nn as nn
from torch.distributed.device_mesh import DeviceMesh, init_device_mesh
from torch.distributed.tensor import DTensor
from torch.utils._pytree import tree_flatten, tree_map_only

from ..api.module import FSDPModule, engine_state
from ..api.sharding import fully_shard, replicate
from ..api.clip import clip_grad_norm_ as _clip_grad_norm
from ..layouts.mesh import default_device_type
from ..layouts.policy import CPUOffloadPolicy, MixedPrecisionPolicy, OffloadPolicy
from ..api.unsharded import unsharded
from ..runtime import traced
from ..features.traps import register_rebindable
from . import state_dict as sd
from . import summon
from .summon import WRAPPED
from .comm_hooks import comm_hook_dtype
from .config import (
    BackwardPrefetch,
    CPUOffload,
    FullOptimStateDictConfig,
    FullStateDictConfig,
    MixedPrecision,
    OptimStateDictConfig,
    OptimStateKeyType,
    ShardedOptimStateDictConfig,
    ShardedStateDictConfig,
    ShardingStrategy,
    StateDictConfig,
    StateDictSettings,
    StateDictType,
    as_ours,
)
from .wrap import targets_of

_HYBRID = (ShardingStrategy.HYBRID_SHARD, ShardingStrategy._HYBRID_SHARD_ZERO2)


@dataclasses.dataclass
class _Arguments:
    """The constructor's arguments that nested instances (the auto-wrap policy's) are built with too,
    under the constructor's names; checked and converted to ours on creation."""

    sharding_strategy: ShardingStrategy
    cpu_offload: CPUOffload
    backward_prefetch: Optional[BackwardPrefetch]
    mixed_precision: Optional[MixedPrecision]
    param_init_fn: Optional[Callable[[nn.Module], None]]
    device_id: Union[int, torch.device, None]
    sync_module_states: bool
    forward_prefetch: bool
    limit_all_gathers: bool
    use_orig_params: bool

    def __post_init__(self) -> None:
        self.sharding_strategy = (
            as_ours(self.sharding_strategy, ShardingStrategy, "sharding_strategy")
            or ShardingStrategy.FULL_SHARD
        )
        self.cpu_offload = as_ours(self.cpu_offload, CPUOffload, "cpu_offload") or CPUOffload()
        self.backward_prefetch = as_ours(self.backward_prefetch, BackwardPrefetch, "backward_prefetch")
        mp = self.mixed_precision = as_ours(self.mixed_precision, MixedPrecision, "mixed_precision")
        if mp is not None and mp.keep_low_precision_grads and not hasattr(torch.Tensor, "grad_dtype"):
            raise ValueError(
                "FullyShardedDataParallel(mixed_precision=MixedPrecision(keep_low_precision_grads=True)) "
                "needs a torch with Tensor.grad_dtype (a gradient in another dtype than its parameter), "
                f"which this torch {torch.__version__} lacks. Fix: drop keep_low_precision_grads "
                "(reduce_dtype still sets the dtype of the reduction), or use a newer torch."
            )

    def nested_kwargs(self, mesh: DeviceMesh, ignored_params: set[nn.Parameter]) -> dict[str, Any]:
        """What a nested instance is built with unless the policy says otherwise: these arguments,
        this instance's mesh and its ignored parameters."""
        own = {f.name: getattr(self, f.name) for f in dataclasses.fields(self)}
        return {
            "process_group": None,
            **own,
            "device_mesh": mesh,
            "ignored_states": list(ignored_params) or None,
        }


class FullyShardedDataParallel(FSDPModule, nn.Module):
    """FSDP1's ``FullyShardedDataParallel``, same arguments and defaults (PyTorch 2.13), on the
    per-parameter engine. See docs/migrating_from_fsdp1.md for how each argument maps.

    It carries `FSDPModule`'s methods itself, so ``fully_shard`` keeps its class: ``type(m) is
    FullyShardedDataParallel`` holds, as scripts (and accelerate) check."""

    def __new__(cls, *args: Any, **kwargs: Any) -> "FullyShardedDataParallel":
        return nn.Module.__new__(cls)

    def __init__(
        self,
        module: nn.Module,
        process_group: Any = None,
        sharding_strategy: Optional[ShardingStrategy] = None,
        cpu_offload: Optional[CPUOffload] = None,
        auto_wrap_policy: Any = None,
        backward_prefetch: Optional[BackwardPrefetch] = BackwardPrefetch.BACKWARD_PRE,
        mixed_precision: Optional[MixedPrecision] = None,
        ignored_modules: Optional[Iterable[nn.Module]] = None,
        param_init_fn: Optional[Callable[[nn.Module], None]] = None,
        device_id: Union[int, torch.device, None] = None,
        sync_module_states: bool = False,
        forward_prefetch: bool = False,
        limit_all_gathers: bool = True,
        use_orig_params: bool = False,
        ignored_states: Any = None,
        device_mesh: Optional[DeviceMesh] = None,
    ) -> None:
        # Every argument is checked before anything changes.
        _check_module(module, auto_wrap_policy)
        args = _Arguments(
            sharding_strategy=sharding_strategy,
            cpu_offload=cpu_offload,
            backward_prefetch=backward_prefetch,
            mixed_precision=mixed_precision,
            param_init_fn=param_init_fn,
            device_id=device_id,
            sync_module_states=sync_module_states,
            forward_prefetch=forward_prefetch,
            limit_all_gathers=limit_all_gathers,
            use_orig_params=use_orig_params,
        )
        ignored_mods, ignored_params = _ignored(ignored_modules, ignored_states)
        device = _device(device_id, module)
        mesh = _mesh(args.sharding_strategy, process_group, device_mesh, device)
        if mesh.size() == 1 and args.sharding_strategy is not ShardingStrategy.NO_SHARD:
            warnings.warn(  # FSDP1's words and rule: plain parameters, as NO_SHARD exposes them
                f"FSDP is switching to use `NO_SHARD` instead of {args.sharding_strategy} since the world "
                "size is 1.",
                stacklevel=2,
            )
            args.sharding_strategy = ShardingStrategy.NO_SHARD
        super().__init__()
        self._build(module, args, auto_wrap_policy, device, mesh, ignored_mods, ignored_params)

    def _build(
        self,
        module: nn.Module,
        args: _Arguments,
        auto_wrap_policy: Any,
        device: torch.device,
        mesh: DeviceMesh,
        ignored_mods: set[nn.Module],
        ignored_params: set[nn.Parameter],
    ) -> None:
        """The constructor's work once every argument is checked: the nested instances first (bottom
        up), then this one's module initialised, moved and sharded."""
        self._init_attributes(args)
        if auto_wrap_policy is not None:
            root_kwargs = args.nested_kwargs(mesh, ignored_params)
            _auto_wrap(
                module, auto_wrap_policy, root_kwargs, args.mixed_precision, ignored_mods, ignored_params
            )
        _materialize(module, args.param_init_fn, device, ignored_mods)
        if device.type != "cpu":
            _to_device(module, device, ignored_params, ignored_mods)
        if args.sync_module_states:
            _broadcast_from_rank0(module, mesh, ignored_params, ignored_mods)
        self._fsdp_wrapped_module = module
        for m in module.modules():  # nested instances are not roots
            if isinstance(m, FullyShardedDataParallel):
                m._fsdp1_nested = True
        mp = args.mixed_precision
        if mp is not None and mp.buffer_dtype is not None:
            self._fsdp1_buffer_dtypes = _cast_buffers(self, mp.buffer_dtype)
        self._shard(args, mesh, ignored_params)
        self._set_backward_prefetch(args.backward_prefetch)
        if mp is not None and mp.keep_low_precision_grads and mp.param_dtype is not None:
            self._get_fsdp_state().update_settings(keep_low_precision_grads=True)
        # no_sync sums the unsharded gradients in the param dtype (FSDP2 sums them in the reduce dtype)
        self._get_fsdp_state().update_settings(accumulate_in_reduce_dtype=False)
        # State dicts at any depth (a root inside a container too): names first, then values.
        self._register_state_dict_hook(_strip_wrapped_prefix)
        self._register_state_dict_hook(_convert_state_dict)
        self._register_load_state_dict_pre_hook(_convert_loaded, with_module=True)
        self._register_load_state_dict_pre_hook(_add_wrapped_prefix, with_module=True)

    def _init_attributes(self, args: _Arguments) -> None:
        """This instance's own state, set before any nested instance is built."""
        self._fsdp1_nested = False  # set when an enclosing FullyShardedDataParallel is built around this one
        self._fsdp1_summoning = False  # inside summon_full_params (summon.py)
        self._fsdp1_strategy = args.sharding_strategy
        self._fsdp1_mp = args.mixed_precision
        self._fsdp1_cpu_offload = args.cpu_offload
        self._fsdp1_use_orig_params = args.use_orig_params
        self._fsdp1_settings = StateDictSettings(
            StateDictType.FULL_STATE_DICT,
            sd.default_config(StateDictType.FULL_STATE_DICT),
            sd.default_optim_config(StateDictType.FULL_STATE_DICT),
        )
        self._fsdp1_comm_hook: Any = None
        # forward_prefetch: this instance all-gathers the one that ran after it in the first forward
        # (FSDP1's rule); the root records that order once (`_record_forward_order`).
        self._fsdp1_forward_prefetch = bool(args.forward_prefetch)
        self._fsdp1_forward_order: Optional[list[FullyShardedDataParallel]] = None
        self._fsdp1_prefetch_set = False
        self._fsdp1_buffer_dtypes: dict[str, torch.dtype] = {}

    def _shard(self, args: _Arguments, mesh: DeviceMesh, ignored_params: set[nn.Parameter]) -> None:
        """The engine on this instance: ``replicate`` for NO_SHARD, else ``fully_shard``, with the
        policies FSDP1's arguments map to."""
        mp, strategy = args.mixed_precision, args.sharding_strategy
        policy = MixedPrecisionPolicy(
            param_dtype=mp.param_dtype if mp else None,
            reduce_dtype=mp.reduce_dtype if mp else None,
            cast_forward_inputs=False,  # FSDP1's input casting (root / every instance) happens in forward
        )
        offload = CPUOffloadPolicy() if args.cpu_offload.offload_params else OffloadPolicy()
        if args.use_orig_params:  # FSDP1 keeps these objects: an optimizer built before keeps working
            register_rebindable(p for p in self.parameters() if p not in ignored_params)
        if strategy is ShardingStrategy.NO_SHARD:
            replicate(  # plain tensors, as FSDP1's NO_SHARD exposes them
                self,
                mesh=mesh,
                mp_policy=policy,
                offload_policy=offload,
                ignored_params=ignored_params or None,
                plain_params=True,
            )
        else:
            reshard = (
                None if strategy in (ShardingStrategy.FULL_SHARD, ShardingStrategy.HYBRID_SHARD) else False
            )
            fully_shard(
                self,
                mesh=mesh,
                reshard_after_forward=reshard,
                mp_policy=policy,
                offload_policy=offload,
                ignored_params=ignored_params or None,
            )

    def _set_backward_prefetch(self, backward_prefetch: Optional[BackwardPrefetch]) -> None:
        """``None`` turns backward prefetching off; BACKWARD_POST runs as BACKWARD_PRE (the engine's own)."""
        if backward_prefetch is None:
            self.set_modules_to_backward_prefetch([])  # type: ignore[attr-defined]
        elif backward_prefetch is BackwardPrefetch.BACKWARD_POST:
            warnings.warn(
                "FullyShardedDataParallel(backward_prefetch=BACKWARD_POST) runs as BACKWARD_PRE here: the "
                "next module's all-gather is issued when this module's backward starts (results are the "
                "same).",
                stacklevel=4,  # the constructor's caller
            )

    # -- module plumbing --------------------------------------------------------------------------

    @property
    def sharding_strategy(self) -> ShardingStrategy:
        return self._fsdp1_strategy

    @property
    def cpu_offload(self) -> CPUOffload:
        return self._fsdp1_cpu_offload

    @property
    def mixed_precision(self) -> MixedPrecision:
        return self._fsdp1_mp or MixedPrecision()

    @property
    def module(self) -> nn.Module:
        """The wrapped module."""
        return self._modules[WRAPPED]  # type: ignore[return-value]

    def __getattr__(self, name: str) -> Any:
        try:
            return super().__getattr__(name)
        except AttributeError:
            modules = self.__dict__.get("_modules")
            if not modules or WRAPPED not in modules:  # still being built
                raise
            return getattr(modules[WRAPPED], name)

    def __getitem__(self, key: int) -> Any:
        return self._modules[WRAPPED].__getitem__(key)  # type: ignore[operator]

    def forward(self, *args: Any, **kwargs: Any) -> Any:
        root = self._record_forward_order()
        mp = self._fsdp1_mp
        if (
            mp is not None
            and mp.param_dtype is not None
            and (mp.cast_forward_inputs or (mp.cast_root_forward_inputs and self.check_is_root()))
        ):
            dtype = mp.param_dtype
            args, kwargs = tree_map_only(
                torch.Tensor, lambda t: t.to(dtype) if t.is_floating_point() else t, (args, kwargs)
            )
        output = self._modules[WRAPPED](*args, **kwargs)
        if root is self and self._fsdp1_forward_order is not None:
            _set_forward_prefetch(self._fsdp1_forward_order)
            self._fsdp1_forward_order, self._fsdp1_prefetch_set = None, True
        if torch.compiler.is_compiling():  # (as the class fully_shard gives a module: `api.module`)
            traced.forward_returned(engine_state(self))
        return output

    def _record_forward_order(self) -> "Optional[FullyShardedDataParallel]":
        """forward_prefetch: during the root's first forward, note the order instances run in.
        Returns the root while it records."""
        state = engine_state(self)
        assert state is not None
        root = state.ctx.root.modules[0] if state.ctx is not None else None
        if not isinstance(root, FullyShardedDataParallel) or root._fsdp1_prefetch_set:
            return None
        if root is self:
            if not any(m._fsdp1_forward_prefetch for m in FullyShardedDataParallel.fsdp_modules(root)):
                root._fsdp1_prefetch_set = True  # nothing to record, ever
                return None
            root._fsdp1_forward_order = [self]
        elif root._fsdp1_forward_order is not None:
            root._fsdp1_forward_order.append(self)
        return root

    def check_is_root(self) -> bool:
        """Whether this instance is the root (no enclosing FullyShardedDataParallel)."""
        state = engine_state(self)
        assert state is not None
        return state.is_root if state.ctx is not None else not self._fsdp1_nested

    @staticmethod
    def fsdp_modules(module: nn.Module, root_only: bool = False) -> list["FullyShardedDataParallel"]:
        found = [m for m in module.modules() if isinstance(m, FullyShardedDataParallel)]
        return [m for m in found if m.check_is_root()] if root_only else found

    def apply(self, fn: Callable[[nn.Module], None]) -> "FullyShardedDataParallel":
        """``fn`` on every submodule and this one, with the full parameters in place (written back)."""
        summon.refuse_unless_idle(self, "apply")
        with torch.no_grad(), unsharded(self, writeback=True, recurse=False):
            return super().apply(fn)  # type: ignore[return-value]

    # -- training-loop controls -------------------------------------------------------------------

    @contextlib.contextmanager
    def no_sync(self) -> Iterator[None]:
        """Backwards inside accumulate unsharded gradients; the first backward after reduces them."""
        self.set_requires_gradient_sync(False, recurse=True)  # type: ignore[attr-defined]
        try:
            yield
        finally:
            self.set_requires_gradient_sync(True, recurse=True)  # type: ignore[attr-defined]

    def clip_grad_norm_(
        self, max_norm: Union[float, int], norm_type: Union[float, int] = 2.0
    ) -> torch.Tensor:
        """Clip every gradient under this module by their global norm; return that norm (a plain tensor)."""
        if not self.check_is_root():
            raise RuntimeError(
                "`clip_grad_norm_()` should only be called on the root FSDP instance: the norm is over every "
                "gradient of the model. Fix: call it on the outermost FullyShardedDataParallel."
            )
        summon.refuse_unless_idle(self, "clip_grad_norm_")
        total = _clip_grad_norm(self.parameters(), max_norm, norm_type)
        total = total.full_tensor() if isinstance(total, DTensor) else total
        dtypes = {p.grad.dtype for p in self.parameters() if p.grad is not None}
        if not dtypes:  # FSDP1's warning, in its words
            warnings.warn(
                f"Called FSDP.clip_grad_norm_() on rank {dist.get_rank()} with no gradients -- returning the "
                f"total norm in the default dtype {total.dtype}",
                stacklevel=2,
            )
            return total
        return total.to(functools.reduce(torch.promote_types, dtypes))  # the gradients' dtype, as FSDP1

    @staticmethod
    @contextlib.contextmanager
    def summon_full_params(
        module: nn.Module,
        recurse: bool = True,
        writeback: bool = True,
        rank0_only: bool = False,
        offload_to_cpu: bool = False,
        with_grads: bool = False,
    ) -> Iterator[None]:
        """The full parameters in place inside the block (FSDP1's semantics; see the docs)."""
        with summon.summon_full_params(module, recurse, writeback, rank0_only, offload_to_cpu, with_grads):
            yield

    def named_parameters(self, *args: Any, **kwargs: Any) -> Iterator[tuple[str, nn.Parameter]]:
        """``nn.Module``'s; inside summon_full_params without the ``_fsdp_wrapped_module.`` segments."""
        return summon.clean_names(self, super().named_parameters(*args, **kwargs))

    def named_buffers(self, *args: Any, **kwargs: Any) -> Iterator[tuple[str, torch.Tensor]]:
        return summon.clean_names(self, super().named_buffers(*args, **kwargs))

    # -- state dicts --------------------------------------------------------------------------------

    @staticmethod
    def set_state_dict_type(
        module: nn.Module,
        state_dict_type: StateDictType,
        state_dict_config: Optional[StateDictConfig] = None,
        optim_state_dict_config: Optional[OptimStateDictConfig] = None,
    ) -> StateDictSettings:
        """Set the state-dict type of every instance under ``module``; return the previous settings."""
        return sd.set_type(
            FullyShardedDataParallel.fsdp_modules(module),
            state_dict_type,
            state_dict_config,
            optim_state_dict_config,
        )

    @staticmethod
    def get_state_dict_type(module: nn.Module) -> StateDictSettings:
        return sd.get_type(FullyShardedDataParallel.fsdp_modules(module))

    @staticmethod
    @contextlib.contextmanager
    def state_dict_type(
        module: nn.Module,
        state_dict_type: StateDictType,
        state_dict_config: Optional[StateDictConfig] = None,
        optim_state_dict_config: Optional[OptimStateDictConfig] = None,
    ) -> Iterator[None]:
        modules = FullyShardedDataParallel.fsdp_modules(module)
        previous = sd.set_type(modules, state_dict_type, state_dict_config, optim_state_dict_config)
        try:
            yield
        finally:
            sd.set_type(
                modules,
                previous.state_dict_type,
                previous.state_dict_config,
                previous.optim_state_dict_config,
            )

    @staticmethod
    def optim_state_dict(
        model: nn.Module,
        optim: torch.optim.Optimizer,
        optim_state_dict: Optional[dict[str, Any]] = None,
        group: Any = None,
    ) -> dict[str, Any]:
        """The optimizer's state keyed by parameter names, in the model's state-dict type."""
        _default_group_only(group, "optim_state_dict")
        return sd.optim_state_dict(model, optim, optim_state_dict, _model_settings(model))

    @staticmethod
    def optim_state_dict_to_load(
        model: nn.Module,
        optim: torch.optim.Optimizer,
        optim_state_dict: dict[str, Any],
        is_named_optimizer: bool = False,
        load_directly: bool = False,
        group: Any = None,
    ) -> dict[str, Any]:
        """A state dict ``optim.load_state_dict`` takes, from one `optim_state_dict` returned."""
        _default_group_only(group, "optim_state_dict_to_load")
        settings = _model_settings(model)
        kind = settings.state_dict_type
        rank0 = kind is StateDictType.FULL_STATE_DICT and getattr(
            settings.optim_state_dict_config, "rank0_only", False
        )
        out = sd.optim_state_dict_to_load(model, optim, optim_state_dict, kind, from_rank0=rank0)
        if load_directly:
            optim.load_state_dict(out)
        return out

    # FSDP1's older optimizer state-dict functions, on the same conversions.

    @staticmethod
    def full_optim_state_dict(
        model: nn.Module,
        optim: torch.optim.Optimizer,
        optim_input: Any = None,
        rank0_only: bool = True,
        group: Any = None,
    ) -> dict[str, Any]:
        """The full optimizer state keyed by parameter name (on CPU; on rank 0 only with ``rank0_only``)."""
        _no_optim_input(optim_input)
        _default_group_only(group, "full_optim_state_dict")
        settings = StateDictSettings(
            StateDictType.FULL_STATE_DICT,
            FullStateDictConfig(),
            FullOptimStateDictConfig(offload_to_cpu=True, rank0_only=rank0_only),
        )
        return sd.optim_state_dict(model, optim, None, settings)

    @staticmethod
    def sharded_optim_state_dict(
        model: nn.Module, optim: torch.optim.Optimizer, group: Any = None
    ) -> dict[str, Any]:
        """The optimizer state keyed by parameter name, each value this rank's DTensor shard."""
        _default_group_only(group, "sharded_optim_state_dict")
        settings = StateDictSettings(
            StateDictType.SHARDED_STATE_DICT,
            ShardedStateDictConfig(),
            ShardedOptimStateDictConfig(offload_to_cpu=False),
        )
        return sd.optim_state_dict(model, optim, None, settings)

    @staticmethod
    def shard_full_optim_state_dict(
        full_optim_state_dict: dict[str, Any],
        model: nn.Module,
        optim_input: Any = None,
        optim: Optional[torch.optim.Optimizer] = None,
    ) -> dict[str, Any]:
        """A full optimizer state dict (keyed by name or position) as this rank's optimizer loads it."""
        _no_optim_input(optim_input)
        return sd.optim_state_dict_to_load(model, optim, full_optim_state_dict, StateDictType.FULL_STATE_DICT)

    @staticmethod
    def scatter_full_optim_state_dict(
        full_optim_state_dict: Optional[dict[str, Any]],
        model: nn.Module,
        optim_input: Any = None,
        optim: Optional[torch.optim.Optimizer] = None,
        group: Any = None,
    ) -> dict[str, Any]:
        """`shard_full_optim_state_dict` of rank 0's full dict (the other ranks pass None)."""
        _no_optim_input(optim_input)
        _default_group_only(group, "scatter_full_optim_state_dict")
        full = sd.broadcast_from_rank0(full_optim_state_dict)
        return sd.optim_state_dict_to_load(model, optim, full, StateDictType.FULL_STATE_DICT)

    @staticmethod
    def flatten_sharded_optim_state_dict(
        sharded_optim_state_dict: dict[str, Any], model: nn.Module, optim: torch.optim.Optimizer
    ) -> dict[str, Any]:
        """A `sharded_optim_state_dict` as this rank's optimizer loads it (no flattening here)."""
        return sd.optim_state_dict_to_load(
            model, optim, sharded_optim_state_dict, StateDictType.SHARDED_STATE_DICT
        )

    @staticmethod
    def rekey_optim_state_dict(
        optim_state_dict: dict[str, Any],
        optim_state_key_type: OptimStateKeyType,
        model: nn.Module,
        optim_input: Any = None,
        optim: Optional[torch.optim.Optimizer] = None,
    ) -> dict[str, Any]:
        """Keys by parameter name (``PARAM_NAME``) or by position in ``optim`` (or ``model.parameters()``)."""
        _no_optim_input(optim_input)
        key_type = as_ours(optim_state_key_type, OptimStateKeyType, "optim_state_key_type")
        params, names = sd.model_params_and_names(model, optim)
        return sd.rekey(
            optim_state_dict, "name" if key_type is OptimStateKeyType.PARAM_NAME else "id", params, names
        )

    # -- communication hooks ------------------------------------------------------------------------

    def register_comm_hook(self, state: object, hook: Callable) -> None:
        """FSDP1's default hooks: ``allreduce_hook`` / ``reduce_scatter_hook`` (the default reduction)
        and ``fp16_compress_hook`` / ``bf16_compress_hook`` (reduce in that dtype). Other hooks are
        refused with the alternatives."""
        if not self.check_is_root():
            raise AssertionError("register_comm_hook can only be called on a root instance.")
        dtype = comm_hook_dtype(hook)
        modules = FullyShardedDataParallel.fsdp_modules(self)
        if any(m._fsdp1_comm_hook is not None for m in modules):
            raise AssertionError("A communication hook is already registered")
        for m in modules:
            m._fsdp1_comm_hook = hook
            if dtype is not None:
                state = engine_state(m)
                assert state is not None
                state.update_settings(reduce_dtype=dtype)


def _check_module(module: nn.Module, auto_wrap_policy: Any) -> None:
    if isinstance(module, FullyShardedDataParallel):
        raise ValueError(
            "FullyShardedDataParallel got a module that is already a FullyShardedDataParallel; wrap it once."
        )
    if auto_wrap_policy is None:
        return
    for name, m in module.named_modules():
        if isinstance(m, FullyShardedDataParallel):  # PyTorch's FSDP refuses this too, in these words
            raise ValueError(
                f"FSDP auto wrapping requires modules to not already have FSDP applied but found '{name}' in "
                f"{type(module).__name__}: it was wrapped by hand before this auto_wrap_policy call. Nothing "
                "was changed. Fix: let the policy wrap it (do not wrap it yourself), or wrap the parent "
                "without auto_wrap_policy."
            )


def _model_settings(model: nn.Module) -> StateDictSettings:
    """The state-dict settings every instance under ``model`` shares (one `state_dict_type`)."""
    return sd.get_type(FullyShardedDataParallel.fsdp_modules(model))


def _set_forward_prefetch(order: list["FullyShardedDataParallel"]) -> None:
    """Each instance with forward_prefetch all-gathers the next one (in the first forward's order)
    while it computes. The root is skipped: its parameters are gathered first, before any block."""
    blocks = order[1:]
    for current, following in zip(blocks, blocks[1:]):
        if current._fsdp1_forward_prefetch and following is not current:
            current.set_modules_to_forward_prefetch([following])  # type: ignore[attr-defined]


def _default_group_only(group: Any, method: str) -> None:
    if (
        group is not None
        and group is not dist.group.WORLD
        and group != dist.distributed_c10d._get_default_group()
    ):
        raise ValueError(
            f"{method}(group=...) with a group other than the default one is not supported: the state is "
            "gathered and broadcast over every rank, from rank 0. Fix: leave group out."
        )


def _no_optim_input(optim_input: Any) -> None:
    if optim_input is not None:
        raise ValueError(
            "optim_input is deprecated in FSDP1 and not supported here. Fix: pass optim=the optimizer (or "
            "nothing: positions then follow model.parameters())."
        )


def _strip_wrapped_prefix(
    module: nn.Module, state_dict: dict[str, Any], prefix: str, local_metadata: Any
) -> None:
    inner = prefix + WRAPPED + "."
    for key in [k for k in state_dict if k.startswith(inner)]:
        state_dict[prefix + key[len(inner) :]] = state_dict.pop(key)


def _run_in_fp32(module: nn.Module) -> None:
    """FSDP1's treatment of modules kept out of mixed precision (BatchNorm): their floating inputs
    are cast to float32, their outputs back to the dtype the inputs came in."""

    def pre(m: nn.Module, args: tuple, kwargs: dict) -> tuple[tuple, dict]:
        floats = [
            t.dtype
            for t in tree_flatten((args, kwargs))[0]
            if isinstance(t, torch.Tensor) and t.is_floating_point()
        ]
        m.__dict__["_fsdp1_input_dtype"] = floats[0] if floats else None
        return tree_map_only(
            torch.Tensor, lambda t: t.float() if t.is_floating_point() else t, (args, kwargs)
        )

    def post(m: nn.Module, args: tuple, kwargs: dict, output: Any) -> Any:
        dtype = m.__dict__.pop("_fsdp1_input_dtype", None)
        if dtype is None or dtype == torch.float32:
            return output
        return tree_map_only(torch.Tensor, lambda t: t.to(dtype) if t.is_floating_point() else t, output)

    module.register_forward_pre_hook(pre, with_kwargs=True)
    module.register_forward_hook(post, with_kwargs=True)


def _convert_state_dict(
    module: nn.Module, state_dict: dict[str, Any], prefix: str, local_metadata: Any
) -> None:
    sd.convert_out(module, state_dict, prefix)  # type: ignore[arg-type]


def _convert_loaded(module: nn.Module, state_dict: dict[str, Any], prefix: str, *args: Any) -> None:
    settings = module._fsdp1_settings
    sd.convert_in(module, state_dict, prefix, settings.state_dict_type)  # type: ignore[union-attr]


def _add_wrapped_prefix(module: nn.Module, state_dict: dict[str, Any], prefix: str, *args: Any) -> None:
    inner = prefix + WRAPPED + "."
    for key in [k for k in state_dict if k.startswith(prefix) and not k.startswith(inner)]:
        state_dict[inner + key[len(prefix) :]] = state_dict.pop(key)


def _ignored(ignored_modules: Any, ignored_states: Any) -> tuple[set[nn.Module], set[nn.Parameter]]:
    if ignored_modules is not None and ignored_states is not None:
        raise ValueError(
            "Cannot pass both ignored_modules and ignored_states at the same time. Please just pass "
            "ignored_states."
        )
    mods: set[nn.Module] = set()
    params: set[nn.Parameter] = set()
    for item in list(ignored_modules or ()) + list(ignored_states or ()):
        if isinstance(item, nn.Parameter):
            params.add(item)
        elif isinstance(item, nn.Module):
            if isinstance(item, FullyShardedDataParallel):
                raise ValueError("ignored_modules should not include FSDP modules")
            mods.update(item.modules())
        else:
            raise TypeError(
                f"ignored_modules / ignored_states take modules and parameters, got {type(item).__name__}."
            )
    for m in mods:
        params.update(m.parameters(recurse=False))
    return mods, params


def _device(device_id: Any, module: nn.Module) -> torch.device:
    """Where the wrapped module computes: ``device_id`` (an int is an accelerator index), else a
    non-CPU device its parameters are on, else the current accelerator, else CPU."""
    if isinstance(device_id, int):
        return torch.device(default_device_type(), device_id)
    if device_id is not None:
        return torch.device(device_id)
    for p in module.parameters():
        if p.device.type not in ("cpu", "meta"):
            return p.device
    kind = default_device_type()
    if kind == "cpu":
        return torch.device("cpu")
    return torch.device(kind, torch.get_device_module(kind).current_device())


def _mesh(
    strategy: ShardingStrategy, process_group: Any, device_mesh: Optional[DeviceMesh], device: torch.device
) -> DeviceMesh:
    """The mesh this instance shards over: ``device_mesh``, else one from ``process_group`` (a pair
    of groups for HYBRID_SHARD), else one over the world (for HYBRID_SHARD, of nodes)."""
    if device_mesh is not None:
        return _checked_device_mesh(strategy, process_group, device_mesh)
    if not dist.is_initialized():
        raise RuntimeError(
            "FullyShardedDataParallel needs torch.distributed initialised (init_process_group) first."
        )
    if strategy in _HYBRID:
        return _hybrid_mesh(strategy, process_group, device)
    if process_group is not None:
        return DeviceMesh.from_group(process_group, device.type)
    return init_device_mesh(device.type, (dist.get_world_size(),))


def _checked_device_mesh(
    strategy: ShardingStrategy, process_group: Any, device_mesh: DeviceMesh
) -> DeviceMesh:
    """``device_mesh`` as given, once checked: alone, and of the strategy's dims."""
    hybrid = strategy in _HYBRID
    if process_group is not None:
        raise ValueError(
            "Cannot pass both process_group and device_mesh at the same time. Please just pass only one "
            "of them."
        )
    if device_mesh.ndim != (2 if hybrid else 1):
        raise ValueError(
            f"sharding_strategy={strategy.name} needs a {'2-D (replicate, shard)' if hybrid else '1-D'} "
            f"device_mesh, got a {device_mesh.ndim}-D one."
        )
    return device_mesh


def _hybrid_mesh(strategy: ShardingStrategy, process_group: Any, device: torch.device) -> DeviceMesh:
    """HYBRID_SHARD's (replicate, shard) mesh: from FSDP1's pair of groups, else one shard group per
    node (``LOCAL_WORLD_SIZE`` ranks, else this node's accelerators)."""
    if process_group is not None:
        if not (isinstance(process_group, tuple) and len(process_group) == 2):
            raise ValueError(
                f"sharding_strategy={strategy.name} takes process_group=(intra_node_group, "
                f"inter_node_group), got {process_group!r}."
            )
        return _mesh_from_groups(*process_group, device)
    world = dist.get_world_size()
    local = int(os.environ.get("LOCAL_WORLD_SIZE", 0)) or (
        torch.accelerator.device_count() if device.type != "cpu" else world
    )
    if world % local:
        raise ValueError(
            f"HYBRID_SHARD: the node size {local} does not divide the world size {world}; pass device_mesh."
        )
    return init_device_mesh(device.type, (world // local, local), mesh_dim_names=("replicate", "shard"))


def _mesh_from_groups(intra: Any, inter: Any, device: torch.device) -> DeviceMesh:
    """A (replicate, shard) mesh from FSDP1's (intra-node, inter-node) group pair."""
    rows: list[Any] = [None] * dist.get_world_size()
    dist.all_gather_object(rows, dist.get_process_group_ranks(intra))
    table: dict[int, list[int]] = {}
    for row in rows:
        table[row[0]] = row  # one row per shard group, keyed by its first rank
    ordered = [table[k] for k in sorted(table)]
    return DeviceMesh.from_group(
        [inter, intra], device.type, mesh=torch.tensor(ordered), mesh_dim_names=("replicate", "shard")
    )


def _auto_wrap(
    module: nn.Module,
    policy: Any,
    root_kwargs: dict[str, Any],
    mp: Optional[MixedPrecision],
    ignored_mods: set[nn.Module],
    ignored_params: set[nn.Parameter],
) -> None:
    """Replace the submodules ``policy`` chooses with nested instances (bottom up), built with
    ``root_kwargs`` unless the policy says otherwise."""
    chosen = targets_of(policy, module, ignored_mods, {id(p) for p in ignored_params}, root_kwargs)
    if mp is not None:  # FSDP1: modules of these classes get their own instance, in full precision
        overridden = _keep_full_precision(module, mp, chosen, root_kwargs, ignored_mods)
        if overridden:
            warnings.warn(
                "Both mixed precision and an auto_wrap_policy were specified to FSDP, where the "
                f"wrapped module has submodules of type: {sorted(overridden)}. These modules will be "
                "wrapped as separate FSDP instances with mixed precision disabled.",
                stacklevel=4,  # the constructor's caller
            )
    for kwargs in chosen.values():  # a policy that names a group of its own drops the inherited mesh
        if kwargs.get("process_group") is not None:
            kwargs.pop("device_mesh", None)
    _wrap_post_order(module, chosen)


def _keep_full_precision(
    module: nn.Module,
    mp: MixedPrecision,
    chosen: dict[nn.Module, dict[str, Any]],
    root_kwargs: dict[str, Any],
    ignored_mods: set[nn.Module],
) -> set[str]:
    """Choose each submodule of ``mp``'s ignored classes (BatchNorm) for an instance of its own
    without mixed precision, computing in float32; return the names of their classes."""
    overridden = set()
    for m in module.modules():
        if m is not module and m not in ignored_mods and isinstance(m, tuple(mp._module_classes_to_ignore)):
            chosen[m] = {**chosen.get(m, root_kwargs), "mixed_precision": None}
            _run_in_fp32(m)
            overridden.add(type(m).__name__)
    return overridden


def _wrap_post_order(root: nn.Module, chosen: dict[nn.Module, dict[str, Any]]) -> None:
    """Replace each chosen module (children first) with a nested instance built with its kwargs."""
    visited: set[nn.Module] = {root}

    def visit(module: nn.Module) -> None:
        for name, child in list(module.named_children()):
            if child in visited:
                continue
            visited.add(child)
            visit(child)
            if child in chosen and not isinstance(child, FullyShardedDataParallel):
                setattr(module, name, FullyShardedDataParallel(child, **chosen[child]))

    visit(root)


def _materialize(
    module: nn.Module, param_init_fn: Any, device: torch.device, ignored: set[nn.Module]
) -> None:
    """Meta-device modules (not yet under a nested instance): ``param_init_fn(m)`` on each, else
    ``to_empty`` + ``reset_parameters`` (FSDP1's rule)."""
    todo, queue = [], [module]
    while queue:
        m = queue.pop(0)
        if m in ignored or isinstance(m, FullyShardedDataParallel):
            continue
        todo.append(m)
        queue.extend(m.children())
    on_meta = any(t.is_meta for m in todo for t in (*m.parameters(recurse=False), *m.buffers(recurse=False)))
    if not on_meta:
        return
    stateful = [
        m for m in todo if any(True for _ in (*m.parameters(recurse=False), *m.buffers(recurse=False)))
    ]
    if param_init_fn is None:
        missing = [type(m).__name__ for m in stateful if not hasattr(m, "reset_parameters")]
        if missing:
            raise ValueError(
                f"{missing[0]} has meta-device parameters and no reset_parameters(); pass param_init_fn to "
                "initialise them."
            )
    with torch.no_grad():
        for m in todo if param_init_fn is not None else stateful:
            if param_init_fn is not None:
                param_init_fn(m)
            else:
                m.to_empty(device=device, recurse=False)
                m.reset_parameters()


def _to_device(
    module: nn.Module, device: torch.device, ignored: set[nn.Parameter], ignored_mods: set[nn.Module]
) -> None:
    """Move what this instance manages to ``device``; a tensor registered in several places (tied
    weights) becomes one moved tensor everywhere."""
    moved: dict[int, torch.Tensor] = {}
    with torch.no_grad():
        for m in module.modules():
            if isinstance(m, FullyShardedDataParallel) or m in ignored_mods:
                continue
            for name, p in list(m._parameters.items()):
                if p is not None and p not in ignored and not isinstance(p, DTensor) and p.device != device:
                    if id(p) not in moved:
                        moved[id(p)] = nn.Parameter(p.to(device), requires_grad=p.requires_grad)
                    m._parameters[name] = moved[id(p)]  # type: ignore[assignment]
            for name, b in list(m._buffers.items()):
                if b is not None and b.device != device:
                    if id(b) not in moved:
                        moved[id(b)] = b.to(device)
                    m._buffers[name] = moved[id(b)]


def _broadcast_from_rank0(
    module: nn.Module, mesh: DeviceMesh, ignored: set[nn.Parameter], ignored_mods: set[nn.Module]
) -> None:
    """sync_module_states: every rank takes the first mesh rank's parameters and buffers (not the
    ignored ones, nor those nested instances already own)."""
    tensors = [p.detach() for p in module.parameters() if p not in ignored and not isinstance(p, DTensor)]
    tensors += [
        b
        for m in module.modules()
        if m not in ignored_mods and not isinstance(m, FullyShardedDataParallel)
        for b in m.buffers(recurse=False)
    ]
    with torch.no_grad():
        for dim in reversed(range(mesh.ndim)):  # shard dim first, then across replicas
            group = mesh.get_group(dim)
            src = dist.get_global_rank(group, 0)
            for t in tensors:
                dist.broadcast(t, src=src, group=group)


def own_modules(root: nn.Module, prefix: str = "") -> Iterator[tuple[str, nn.Module]]:
    """``root``'s modules (with their state-dict prefixes) that no nested instance manages."""
    yield prefix, root
    for name, child in root.named_children():
        if isinstance(child, FullyShardedDataParallel):
            continue
        yield from own_modules(child, prefix if name == WRAPPED else f"{prefix}{name}.")


def _cast_buffers(root: nn.Module, dtype: torch.dtype) -> dict[str, torch.dtype]:
    """MixedPrecision(buffer_dtype=...): this instance's buffers are computed with in ``dtype``;
    returns their original dtypes, by state-dict name relative to ``root``, so state dicts hold
    them as before."""
    original = {}
    for prefix, m in own_modules(root):
        for bname, buf in list(m._buffers.items()):
            if buf is not None and buf.is_floating_point() and buf.dtype != dtype:
                original[prefix + bname] = buf.dtype
                m._buffers[bname] = buf.to(dtype)
    return original
