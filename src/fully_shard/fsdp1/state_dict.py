"""FSDP1's state-dict types on the per-parameter engine.

The engine's own state dict holds each parameter as a DTensor shard under its original name
(SHARDED_STATE_DICT). The other types convert at the top-level call:

* FULL_STATE_DICT: every DTensor gathered (``full_tensor``, a collective every rank joins),
  optionally moved to CPU, optionally kept on rank 0 only; loading takes full tensors and keeps
  each rank's chunk.
* LOCAL_STATE_DICT: each rank's local shard as a plain tensor (not FSDP1's flat parameter).

Optimizer state dicts (``optim_state_dict``) are keyed by parameter name, as FSDP1's are, with
the same conversions; ``optim_state_dict_to_load`` turns one back into what
``optimizer.load_state_dict`` takes.
"""

from __future__ import annotations

import copy
from typing import Any, Callable, Optional

import torch
import torch.distributed as dist
import torch.nn as nn
from torch.distributed.tensor import DTensor, distribute_tensor

from ..features.traps import rebind
from ..layouts.mesh import dtensor_in_place
from .config import (
    FullOptimStateDictConfig,
    FullStateDictConfig,
    LocalOptimStateDictConfig,
    LocalStateDictConfig,
    OptimStateDictConfig,
    ShardedOptimStateDictConfig,
    ShardedStateDictConfig,
    StateDictConfig,
    StateDictSettings,
    StateDictType,
    as_ours,
)


WRAPPED = "_fsdp_wrapped_module."
_CONFIGS = {
    StateDictType.FULL_STATE_DICT: (FullStateDictConfig, FullOptimStateDictConfig),
    StateDictType.SHARDED_STATE_DICT: (ShardedStateDictConfig, ShardedOptimStateDictConfig),
    StateDictType.LOCAL_STATE_DICT: (LocalStateDictConfig, LocalOptimStateDictConfig),
}


def default_config(kind: StateDictType) -> StateDictConfig:
    return _CONFIGS[kind][0]()


def default_optim_config(kind: StateDictType) -> OptimStateDictConfig:
    return _CONFIGS[kind][1]()


def clean(name: str) -> str:
    """A parameter's name as state dicts show it: without the wrappers' segments."""
    return name.replace(WRAPPED, "").replace("_checkpoint_wrapped_module.", "")


def set_type(modules: list[nn.Module], kind: Any, config: Any, optim_config: Any) -> StateDictSettings:
    kind = as_ours(kind, StateDictType, "state_dict_type")
    config_cls, optim_cls = _CONFIGS[kind]
    config = as_ours(config, config_cls, "state_dict_config") if config is not None else config_cls()
    optim_config = (
        as_ours(optim_config, optim_cls, "optim_state_dict_config")
        if optim_config is not None
        else optim_cls()
    )
    if not modules:
        raise ValueError("state_dict_type got a module with no FullyShardedDataParallel inside.")
    previous = get_type(modules)
    for m in modules:
        m._fsdp1_settings = StateDictSettings(kind, config, optim_config)
    return previous


def get_type(modules: list[nn.Module]) -> StateDictSettings:
    if not modules:
        raise ValueError("get_state_dict_type got a module with no FullyShardedDataParallel inside.")
    first = modules[0]._fsdp1_settings
    for m in modules[1:]:
        if m._fsdp1_settings != first:
            raise ValueError("All FSDP modules must have the same state_dict settings.")
    return copy.copy(first)


def convert_out(module: nn.Module, state_dict: dict[str, Any], prefix: str) -> None:
    """State-dict post hook of each instance: its entries (under ``prefix``; nested instances'
    already converted) from the engine's DTensor shards to its state-dict type, in place."""
    settings = module._fsdp1_settings
    kind, config = settings.state_dict_type, settings.state_dict_config
    offload = config.offload_to_cpu
    keys = [k for k in state_dict if k.startswith(prefix)]
    for key in keys:
        value = state_dict[key]
        if isinstance(value, DTensor):
            value = _as_kind(value, kind, offload)
        else:
            original = module._fsdp1_buffer_dtypes.get(key[len(prefix) :])
            if original is not None and isinstance(value, torch.Tensor):
                value = value.to(original)
        if offload and isinstance(value, torch.Tensor) and not isinstance(value, DTensor):
            value = value.cpu()
        state_dict[key] = value
    if (
        kind is StateDictType.FULL_STATE_DICT
        and getattr(config, "rank0_only", False)
        and dist.get_rank() != 0
    ):
        for key in keys:
            del state_dict[key]


def _as_param_layout(value: Any, current: Any, kind: StateDictType) -> Any:
    """A loaded value in the layout of the parameter it goes into (a DTensor shard)."""
    if not isinstance(current, DTensor) or not isinstance(value, torch.Tensor) or isinstance(value, DTensor):
        return value
    value = value.to(current.device)
    if kind is StateDictType.LOCAL_STATE_DICT:
        local = current.to_local()
        if tuple(value.shape) != tuple(local.shape):
            raise ValueError(
                f"loading a LOCAL_STATE_DICT: a shard of shape {tuple(value.shape)} where this rank holds "
                f"{tuple(local.shape)}. A local state dict loads only at the world size and layout that "
                "saved it. Fix: save and load a SHARDED_STATE_DICT (with torch.distributed.checkpoint) to "
                "change them."
            )
        return dtensor_in_place(
            value, current.device_mesh, current.placements, current.shape, current.stride()
        )
    if tuple(value.shape) != tuple(current.shape):
        raise ValueError(
            f"loading a full state dict: a value of shape {tuple(value.shape)} for a parameter of shape "
            f"{tuple(current.shape)}. Fix: load a FULL_STATE_DICT of this model (or set the state-dict type "
            "the checkpoint was saved with)."
        )
    return distribute_tensor(value, current.device_mesh, current.placements, src_data_rank=None)


def convert_in(module: nn.Module, state_dict: dict[str, Any], prefix: str, kind: StateDictType) -> None:
    """Load pre hook of each instance: entries under ``prefix`` of ``kind`` (full or local
    tensors) turned into the DTensor shards the engine loads, in place (an enclosing instance
    already converted its nested ones: DTensors are left as they are)."""
    if kind is StateDictType.SHARDED_STATE_DICT:
        return
    targets = {clean(n): p for n, p in module.named_parameters()}
    for key in [k for k in state_dict if k.startswith(prefix)]:
        current = targets.get(clean(key[len(prefix) :]))
        if current is not None:
            state_dict[key] = _as_param_layout(state_dict[key], current, kind)


# -- optimizer state dicts -------------------------------------------------------------------------


def _ordered_params(optim: torch.optim.Optimizer) -> list[torch.Tensor]:
    rebind(optim)  # built before wrapping (use_orig_params=True): the parameters the model holds now
    return [p for group in optim.param_groups for p in group["params"]]


def _names(model: nn.Module) -> dict[int, str]:
    return {id(p): clean(n) for n, p in model.named_parameters()}


def _init_state(optim: torch.optim.Optimizer) -> None:
    """As FSDP1 does: an optimizer with no state yet (built, never stepped) gets its state made by
    one step with zero gradients and a learning rate of 0, so its state dict is a template a
    checkpoint can be loaded into (accelerate's ``load_state`` does so). Nothing else changes."""
    params = _ordered_params(optim)
    if any(optim.state.values()) or any(p.grad is not None for p in params):
        return
    lrs = []
    for group in optim.param_groups:
        lrs.append(group.get("lr"))
        if "lr" in group:
            group["lr"] = torch.zeros_like(group["lr"]) if isinstance(group["lr"], torch.Tensor) else 0.0
    for p in params:
        if p.requires_grad:
            p.grad = torch.zeros_like(p)
    try:
        optim.step()
    finally:
        for group, lr in zip(optim.param_groups, lrs):
            if lr is not None:
                group["lr"] = lr
        optim.zero_grad(set_to_none=True)


def optim_state_dict(
    model: nn.Module,
    optim: torch.optim.Optimizer,
    osd: Optional[dict[str, Any]],
    settings: StateDictSettings,
) -> dict[str, Any]:
    """``optim``'s state (``osd``, default ``optim.state_dict()``) keyed by parameter name, in the
    state-dict type of ``settings`` (the model's, or one a legacy function fixes)."""
    kind, config = settings.state_dict_type, settings.optim_state_dict_config
    if osd is None:
        _init_state(optim)
    raw = optim.state_dict() if osd is None else osd
    names = _names(model)
    params = _ordered_params(optim)
    missing = [i for i, p in enumerate(params) if id(p) not in names]
    if missing:
        raise ValueError(
            f"optim_state_dict: the optimizer holds {len(missing)} parameter(s) that are not the model's."
        )
    state = {}
    for index in sorted(raw["state"]):  # the same order on every rank: the gathers line up
        entry = raw["state"][index]
        state[names[id(params[index])]] = {k: _optim_value(v, kind, config) for k, v in entry.items()}
    groups = []
    for group in raw["param_groups"]:
        groups.append({**group, "params": [names[id(params[i])] for i in group["params"]]})
    if (
        kind is StateDictType.FULL_STATE_DICT
        and getattr(config, "rank0_only", False)
        and dist.get_rank() != 0
    ):
        return {}
    return {"state": state, "param_groups": groups}


def _optim_value(value: Any, kind: StateDictType, config: OptimStateDictConfig) -> Any:
    """One value of an optimizer state as a ``kind`` state dict holds it (a sharded DTensor gathered,
    or its local shard), on the CPU if ``config`` says so."""
    if isinstance(value, DTensor):
        value = _as_kind(value, kind, config.offload_to_cpu)
    if config.offload_to_cpu and isinstance(value, torch.Tensor) and not isinstance(value, DTensor):
        value = value.cpu()
    return value


def _as_kind(value: DTensor, kind: StateDictType, offload: bool) -> torch.Tensor:
    """A sharded DTensor as a ``kind`` state dict holds it: gathered, its local shard, or itself
    (its shard on the CPU with ``offload``)."""
    if kind is StateDictType.FULL_STATE_DICT:
        return value.full_tensor()
    if kind is StateDictType.LOCAL_STATE_DICT:
        return value.to_local()
    if not offload:
        return value
    local = value.to_local().cpu()  # stays there: from_local would move it back to the mesh's device
    return dtensor_in_place(local, value.device_mesh, value.placements, value.shape, value.stride())


def optim_state_dict_to_load(
    model: nn.Module,
    optim: Optional[torch.optim.Optimizer],
    osd: dict[str, Any],
    kind: StateDictType,
    from_rank0: bool = False,
) -> dict[str, Any]:
    """A name-keyed optimizer state dict (ours or PyTorch FSDP1's; ID-keyed ones too) as
    ``optim.load_state_dict`` takes it: keyed by position in ``optim`` (or, without one, in
    ``model.parameters()``), each value in its parameter's layout. ``kind``: the layout of the
    values; ``from_rank0``: only rank 0 holds ``osd`` (a FULL one saved with ``rank0_only``)."""
    if from_rank0:
        osd = broadcast_from_rank0(osd)
    names = _names(model)
    params = _ordered_params(optim) if optim is not None else list(model.parameters())
    index = {names[id(p)]: i for i, p in enumerate(params)}
    osd = rekey(osd, "name", params, names)
    unknown = [n for n in osd["state"] if n not in index]
    if unknown:
        raise ValueError(
            "optim_state_dict_to_load: the state dict has state for "
            f"{unknown[:3]}{'...' if len(unknown) > 3 else ''}, which this optimizer does not hold. Fix: "
            "build the optimizer over the same parameters that were saved."
        )
    state = {}
    for name, entry in osd["state"].items():
        p = params[index[name]]
        state[index[name]] = {
            k: _as_param_layout(v, p, kind) if isinstance(v, torch.Tensor) and v.dim() else v
            for k, v in entry.items()
        }
    if optim is not None and len(osd["param_groups"]) != len(optim.param_groups):
        raise ValueError(
            f"optim_state_dict_to_load: {len(osd['param_groups'])} parameter groups saved, the optimizer has "
            f"{len(optim.param_groups)}. Fix: build the optimizer with the same groups."
        )
    groups = [{**group, "params": [index[n] for n in group["params"]]} for group in osd["param_groups"]]
    return {"state": state, "param_groups": groups}


def broadcast_from_rank0(obj: Any) -> Any:
    box = [obj if dist.get_rank() == 0 else None]
    dist.broadcast_object_list(box, src=0)
    return box[0]


def rekey(osd: dict[str, Any], to: str, params: list[torch.Tensor], names: dict[int, str]) -> dict[str, Any]:
    """``osd`` keyed by parameter name (``to="name"``) or by position in ``params`` (``"id"``),
    whichever it was keyed by (FSDP1's ``rekey_optim_state_dict``)."""
    by_id = {i: names[id(p)] for i, p in enumerate(params)}
    by_name = {n: i for i, n in by_id.items()}
    table: dict[Any, Any] = by_id if to == "name" else by_name

    def key(k: Any) -> Any:
        if (to == "name" and isinstance(k, str)) or (to == "id" and isinstance(k, int)):
            return k
        if k not in table:
            raise ValueError(f"rekey_optim_state_dict: no parameter {k!r} in this model (or optimizer).")
        return table[k]

    return {
        "state": {key(k): v for k, v in osd["state"].items()},
        "param_groups": [{**g, "params": [key(k) for k in g["params"]]} for g in osd["param_groups"]],
    }


def model_params_and_names(
    model: nn.Module, optim: Optional[torch.optim.Optimizer]
) -> tuple[list[torch.Tensor], dict[int, str]]:
    return (_ordered_params(optim) if optim is not None else list(model.parameters())), _names(model)


def show_full_grads(roots: list[nn.Module], writeback: bool) -> Callable[[], None]:
    """summon_full_params(with_grads=True): the unsharded parameters get the full gradients;
    returns what drops them again (with ``writeback``, after copying each rank's chunk of what the
    block left in them into its sharded gradient, as FSDP1 does)."""
    from ..runtime.state import fsdp_states

    shown = []
    for state in fsdp_states(roots):
        for group in state.own:
            for p in group.params:
                grad = p.sharded_param.grad
                if grad is not None and p.unsharded_param is not None and p.is_unsharded:
                    p.unsharded_param.grad = grad.full_tensor() if isinstance(grad, DTensor) else grad
                    shown.append(p)

    def hide() -> None:
        for p in shown:
            if p.unsharded_param is None:
                continue
            full, sharded = p.unsharded_param.grad, p.sharded_param.grad
            if writeback and full is not None and sharded is not None:
                local = sharded._local_tensor if isinstance(sharded, DTensor) else sharded
                with torch.no_grad():
                    local.copy_(p.local_chunk(full))
            p.unsharded_param.grad = None

    return hide
