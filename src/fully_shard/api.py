"""The public entry points: `fully_shard`, `FSDPModule` and `UnshardHandle`."""

from __future__ import annotations

import functools
from typing import Optional, Union

import torch.nn as nn
from torch.distributed.device_mesh import DeviceMesh

from .discovery import check_params, claim_originals, find_params, is_sharded_module, move_buffers
from .mesh import MeshInfo, mesh_info
from .param import FSDPParam
from .param_group import FSDPParamGroup
from .policy import CPUOffloadPolicy, MixedPrecisionPolicy, OffloadPolicy
from .state import FSDPState


class UnshardHandle:
    """Returned by ``unshard(async_op=True)``: ``wait()`` makes the unsharded parameters usable."""

    def __init__(self, group: Optional[FSDPParamGroup]) -> None:
        self._group = group

    def wait(self) -> None:
        if self._group is not None:
            self._group.wait_for_unshard()
            self._group = None


class FSDPModule:
    """Mixed into the class of every module ``fully_shard`` was applied to.

    ``isinstance(m, FSDPModule)`` tells a sharded module; ``isinstance(m, OriginalClass)`` still holds.
    """

    def _fsdp_state(self) -> FSDPState:
        return self.__dict__["_fsdp_state"]  # type: ignore[no-any-return]

    def unshard(self, async_op: bool = False) -> Optional[UnshardHandle]:
        """All-gather this module's parameters now. With ``async_op`` return a handle to wait on."""
        state = self._fsdp_state()
        state._ctx()  # lazy init, so the group knows its streams
        group = state.group
        if group is not None:
            group.unshard()
        handle = UnshardHandle(group)
        if async_op:
            return handle
        handle.wait()
        return None

    def reshard(self) -> None:
        """Free this module's unsharded parameters and point it back at its shards."""
        group = self._fsdp_state().group
        if group is not None:
            group.reshard()


@functools.cache
def _sharded_class(cls: type) -> type:
    return type(f"FSDP{cls.__name__}", (FSDPModule, cls), {"__module__": cls.__module__})


def fully_shard(
    module: Union[nn.Module, list[nn.Module]],
    *,
    mesh: Optional[DeviceMesh] = None,
    reshard_after_forward: Optional[bool] = None,
    mp_policy: MixedPrecisionPolicy = MixedPrecisionPolicy(),
    offload_policy: OffloadPolicy = OffloadPolicy(),
    ignored_params: Optional[set[nn.Parameter]] = None,
) -> Union[nn.Module, list[nn.Module]]:
    """Shard ``module``'s parameters across the ranks of ``mesh`` (dim-0, one group per call).

    Apply it bottom-up: each block first, then the root. Parameters already managed by an inner
    call are left to it. A list of modules forms one group that communicates together.

    Args:
        mesh: a 1-D ``DeviceMesh``; default: every rank of the default process group, on the
            current accelerator if there is one, else CPU.
        reshard_after_forward: free the unsharded parameters after forward (and all-gather again
            for backward). ``None``: ``True``, except for the root, which keeps them.
        mp_policy / offload_policy: see `MixedPrecisionPolicy` / `CPUOffloadPolicy`.
        ignored_params: parameters left alone entirely (not sharded, not synchronised).

    Returns the module (or list), whose class now also derives from `FSDPModule`.
    """
    modules = _as_module_list(module)
    _check_options(reshard_after_forward, mp_policy, offload_policy)
    info = mesh_info(mesh)
    _check_offload(offload_policy, info)
    names = [""] if len(modules) == 1 else [f"[{i}]" for i in range(len(modules))]
    found = find_params(modules, names, _ignored_ids(ignored_params))
    check_params(found, info)
    # Every check has passed; from here on nothing raises on user input.
    claim_originals(found)
    params = [FSDPParam(param, places, info) for param, places in found]
    group = FSDPParamGroup(params, info, fqn="") if params else None
    move_buffers(modules, info.device)
    state = FSDPState(modules, group, info, reshard_after_forward)
    for m in modules:
        _install(m, state)
    return module


def _install(module: nn.Module, state: FSDPState) -> None:
    module.__dict__["_fsdp_state"] = state
    module.register_forward_pre_hook(state.pre_forward, prepend=True, with_kwargs=True)
    module.register_forward_hook(state.post_forward)
    module.__class__ = _sharded_class(type(module))


def _as_module_list(module: Union[nn.Module, list[nn.Module]]) -> list[nn.Module]:
    modules = list(module) if isinstance(module, (list, tuple)) else [module]
    if not modules:
        raise ValueError("fully_shard got an empty list of modules; pass at least one nn.Module.")
    for m in modules:
        if not isinstance(m, nn.Module):
            raise TypeError(f"fully_shard expects an nn.Module or a list of them, got {type(m).__name__}.")
        if is_sharded_module(m):
            original = type(m).__bases__[-1].__name__
            raise ValueError(
                f"fully_shard was already applied to this {original}; a module can be sharded once. "
                "Fix: remove the second call (to change options, rebuild the module)."
            )
    if len({id(m) for m in modules}) != len(modules):
        raise ValueError("fully_shard got the same module twice in one list; pass each module once.")
    return modules


def _check_options(
    reshard_after_forward: Optional[bool], mp_policy: MixedPrecisionPolicy, offload_policy: OffloadPolicy
) -> None:
    if reshard_after_forward is not None and not isinstance(reshard_after_forward, bool):
        raise ValueError(
            f"reshard_after_forward must be True, False or None, got {reshard_after_forward!r}."
        )
    if not isinstance(mp_policy, MixedPrecisionPolicy):
        raise TypeError(f"mp_policy must be a MixedPrecisionPolicy, got {type(mp_policy).__name__}.")
    if not isinstance(offload_policy, OffloadPolicy):
        raise TypeError(f"offload_policy must be an OffloadPolicy, got {type(offload_policy).__name__}.")
    if not mp_policy.is_noop:
        raise NotImplementedError(
            f"{mp_policy} is valid, but this version of fully_shard computes in the parameters' own dtype "
            "and does not apply mixed precision yet. Fix: pass MixedPrecisionPolicy() (or none), or cast the "
            "model to the dtype you want before fully_shard."
        )


def _check_offload(offload_policy: OffloadPolicy, info: MeshInfo) -> None:
    if isinstance(offload_policy, CPUOffloadPolicy) and info.device.type != "cpu":
        raise NotImplementedError(
            f"CPUOffloadPolicy on a {info.device.type} mesh is not applied by this version of fully_shard. "
            "Fix: pass OffloadPolicy() (no offload). On a CPU mesh the policy is accepted: everything is on CPU already."
        )


def _ignored_ids(ignored_params: Optional[set[nn.Parameter]]) -> set[int]:
    if ignored_params is None:
        return set()
    ids = set()
    for p in ignored_params:
        if not isinstance(p, nn.Parameter):
            raise TypeError(f"ignored_params must hold nn.Parameter objects, got {type(p).__name__}.")
        ids.add(id(p))
    return ids
