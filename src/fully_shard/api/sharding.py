"""`fully_shard` and `replicate`: validate everything, then manage the parameters and install
the hooks (thin adapters to `FSDPState`)."""

from __future__ import annotations

import functools
from typing import Any, Callable, Optional, Union

import torch
import torch.nn as nn
from torch.distributed.device_mesh import DeviceMesh

from .discovery import (
    check_params,
    find_params,
    is_sharded_module,
    move_buffers,
    shard_choice_for,
    warn_uneven_complex,
)
from ..layouts.mesh import check_reshard_after_forward, mesh_info, replicate_info
from ..runtime.param import FSDPParam
from ..runtime.param_group import FSDPParamGroup
from ..features.offload import offload_chooser
from .spmd import as_dp_mesh_dims, dp_mesh, localize_params, restore
from ..layouts.policy import MixedPrecisionPolicy, OffloadPolicy, as_mp_policy
from ..runtime.registry import register_original
from ..features.traps import install_optimizer_check, register_ignored
from ..features import finite
from ..features import schedule
from ..runtime.state import FSDPState, RootContext

from .module import _replicated_class, _sharded_class


def fully_shard(
    module: Union[nn.Module, list[nn.Module]],
    *,
    mesh: Optional[DeviceMesh] = None,
    reshard_after_forward: Union[bool, int, None] = None,
    mp_policy: MixedPrecisionPolicy = MixedPrecisionPolicy(),
    offload_policy: Any = OffloadPolicy(),  # a policy, {name pattern: policy}, or param -> policy
    ignored_params: Optional[set[nn.Parameter]] = None,
    shard_placement_fn: Optional[Callable[[nn.Parameter], Any]] = None,
    dp_mesh_dims: Any = None,
) -> Union[nn.Module, list[nn.Module]]:
    """Shard ``module``'s parameters across the ranks of ``mesh`` (dim-0, one group per call).

    Apply it bottom-up: each block first, then the root. Parameters already managed by an inner
    call are left to it. A list of modules forms one group that communicates together.

    Args:
        mesh: a 1-D ``DeviceMesh`` (FSDP) or a 2-D ``(replicate, shard)`` one (HSDP: parameters
            are ``(Replicate(), Shard(0))``; gradients are reduce-scattered within the shard
            group, then all-reduced across replicas). Default: every rank of the default process
            group, on the current accelerator if there is one, else CPU.
        reshard_after_forward: free the unsharded parameters after forward (and all-gather again
            for backward). ``None``: ``True``, except for the root, which keeps them. An ``int``
            ``k`` dividing the shard world size: after forward keep the parameters sharded over
            groups of ``k`` consecutive ranks (e.g. one node), so backward all-gathers within them.
        mp_policy / offload_policy: see `MixedPrecisionPolicy` / `CPUOffloadPolicy` (PyTorch's
            FSDP2 policy objects are accepted and converted; shards,
            gradients and optimizer state on the host; each all-gather copies the shard to the
            device; on a CPU mesh it changes nothing). ``offload_policy`` may also choose per
            parameter: a mapping from name patterns to policies, or a callable ``param -> policy``
            such as `fully_shard.offload_by_budget(model, bytes)` (see offload.py).
        ignored_params: parameters left alone entirely (not sharded, not synchronised).
        shard_placement_fn: ``param -> Shard(d) | None``: shard that parameter on dim ``d``
            (any size: chunks follow ``torch.chunk``) instead of dim 0; ``None`` keeps dim 0.
            ``ShardPlacement(Shard(d) or None, mesh=other)`` also puts it on another mesh (MoE
            experts on an expert-parallel mesh): the call's parameters on each mesh form one group
            that communicates over that mesh (PyTorch's ``ShardPlacementResult`` is read too).
        dp_mesh_dims: with ``mesh`` a full SPMD mesh (data-parallel and e.g. tensor-parallel dims),
            `DataParallelMeshDims(shard=..., replicate=...)` names the data-parallel dims;
            parameters already DTensors on that mesh keep their other dims' placements (spmd.py).

    Returns the module (or list), whose class now also derives from `FSDPModule`.
    """
    modules = _as_module_list(module)
    changes: list = []
    if dp_mesh_dims is not None:
        dims = as_dp_mesh_dims(dp_mesh_dims)
        full = mesh
        mesh, others = dp_mesh(full, dims)
        names = dims.replicate_names + dims.shard_names
        changes = localize_params(modules, full, names, others)  # type: ignore[arg-type]
    try:
        info = mesh_info(mesh)
        checked = check_reshard_after_forward(reshard_after_forward, info)
        reshard_after_forward = checked  # type: ignore[assignment]
        _apply(
            modules,
            info,
            reshard_after_forward,
            mp_policy,
            offload_policy,
            ignored_params,
            shard_placement_fn,
            _sharded_class,
        )
    except BaseException:
        restore(changes)  # a refused call leaves the parameters as they were
        raise
    return module


def replicate(
    module: Union[nn.Module, list[nn.Module]],
    *,
    mesh: Optional[DeviceMesh] = None,
    mp_policy: MixedPrecisionPolicy = MixedPrecisionPolicy(),
    offload_policy: OffloadPolicy = OffloadPolicy(),
    ignored_params: Optional[set[nn.Parameter]] = None,
) -> Union[nn.Module, list[nn.Module]]:
    """Data parallelism without sharding, on the same engine and controls as `fully_shard`
    (PyTorch's ``replicate``): every rank keeps whole parameters, as ``Replicate()`` DTensors on
    the 1-D ``mesh``; each backward all-reduces (averages) the gradients across its ranks. Compose
    it with ``fully_shard`` in one model (e.g. small modules replicated, big ones sharded), bottom-up
    like ``fully_shard``; consecutive small replicated modules share one all-reduce (buckets).

    Returns the module (or list), whose class now also derives from `ReplicateModule` (an
    `FSDPModule`: ``set_requires_gradient_sync``, ``set_requires_all_reduce``, hooks, ...).
    """
    modules = _as_module_list(module)
    info = replicate_info(mesh)
    _apply(modules, info, False, mp_policy, offload_policy, ignored_params, None, _replicated_class)
    return module


def _apply(
    modules: list[nn.Module],
    info: Any,
    reshard_after_forward: Any,
    mp_policy: Any,
    offload_policy: Any,
    ignored_params: Optional[set[nn.Parameter]],
    shard_placement_fn: Any,
    make_class: Callable[[type], type],
) -> None:
    """Check everything, then manage the parameters of ``modules`` as one group on ``info``."""
    mp_policy = as_mp_policy(mp_policy)
    choose_offload = offload_chooser(offload_policy)
    names = [""] if len(modules) == 1 else [f"[{i}]" for i in range(len(modules))]
    found = find_params(modules, names, _ignored_ids(ignored_params))
    choices = [shard_choice_for(param, places[0].fqn, shard_placement_fn) for param, places in found.own]
    shard_dims = [dim for dim, _ in choices]
    infos = _param_meshes(info, [mesh for _, mesh in choices], reshard_after_forward)
    for one, param_info in zip(found.own, infos):
        check_params([one], param_info)
    warn_uneven_complex(found.own, shard_dims, infos)
    offloads = [
        choose_offload(param, places[0].fqn) for param, places in found.own
    ]  # a bad choice raises here
    # Every check has passed; from here on nothing raises on user input.
    install_optimizer_check()
    register_ignored(ignored_params)
    params = [
        FSDPParam(param, places, param_info, mp_policy, dim, offload)
        for (param, places), dim, offload, param_info in zip(found.own, shard_dims, offloads, infos)
    ]
    for (original, _), managed in zip(found.own, params):
        register_original(original, managed)
    group, extra = _groups_by_mesh(params, info)
    borrowed: list[FSDPParamGroup] = []
    for owner, places in found.borrowed:  # tied to a parameter an earlier call manages
        owner.add_places(places)
        if owner.group is not None and owner.group not in borrowed:
            borrowed.append(owner.group)
    move_buffers(modules, info.device)
    state = FSDPState(modules, group, info, reshard_after_forward, mp_policy, borrowed, extra)
    state.setup_root = _setup_root
    for m in modules:
        _install(m, state, make_class)


def _groups_by_mesh(params: list[FSDPParam], info: Any) -> tuple[Optional[FSDPParamGroup], list[Any]]:
    """One group per mesh, each communicating over its own ranks: the one on the call's mesh
    (None if no parameter stayed there) and the others, in the order their meshes appear."""
    by_mesh: dict[int, list[FSDPParam]] = {id(info): []}
    for p in params:
        by_mesh.setdefault(id(p.info), []).append(p)
    own = [FSDPParamGroup(ps, ps[0].info, fqn="") for ps in by_mesh.values() if ps]
    group = own[0] if own and own[0].info is info else None
    return group, own[1:] if group is not None else own


def _setup_root(ctx: RootContext) -> None:
    """What a root gets at lazy init beyond the runtime: the finite and schedule checks."""
    finite.configure(ctx)
    schedule.attach_to(ctx)


def _param_meshes(info: Any, meshes: list[Optional[DeviceMesh]], reshard_after_forward: Any) -> list[Any]:
    """Each parameter's mesh info: the call's, or the one ``shard_placement_fn`` chose (one
    `MeshInfo` per distinct mesh, so its parameters form one group), checked against the call."""
    made: list[tuple[DeviceMesh, Any]] = []  # equal meshes (mesh["ep"] sliced twice is two objects) are one
    out = []
    for mesh in meshes:
        if mesh is None or mesh is info.mesh or mesh == info.mesh:
            out.append(info)
            continue
        known = next((i for m, i in made if m is mesh or m == mesh), None)
        if known is None:
            other = mesh_info(mesh)
            if other.device.type != info.device.type:
                raise ValueError(
                    f"shard_placement_fn chose a mesh on {other.device.type}, but fully_shard's mesh "
                    f"computes on {info.device.type}. Fix: build every mesh of one call on the same device "
                    "type."
                )
            if info.replicate_only:
                raise ValueError(
                    "replicate() takes no per-parameter meshes; use fully_shard for those parameters."
                )
            if isinstance(reshard_after_forward, int) and not isinstance(reshard_after_forward, bool):
                try:
                    check_reshard_after_forward(reshard_after_forward, other)
                except ValueError as e:
                    raise ValueError(
                        f"{e} The call's reshard_after_forward applies to the parameters shard_placement_fn "
                        f"put on another mesh {mesh} too. Fix: choose an int dividing both meshes' shard "
                        "sizes, or True/False."
                    ) from None
            made.append((mesh, other))
            known = other
        out.append(known)
    return out


class _OutsideCompile:
    """A module hook that runs outside ``torch.compile``'s graphs.

    ``block.compile()`` / ``model.compile()`` (in place) compile ``Module._call_impl``, hooks
    included. Dynamo skips torch's own files (``_call_impl`` itself) but would compile a hook frame
    of ours, breaking the graph at every collective (and failing ``fullgraph=True``). Calling the
    hook through ``torch._dynamo.disable`` (a torch frame, so skipped too) runs it eagerly, and the
    module's ``forward`` is still compiled as one graph. An object rather than a closure, so a
    deepcopy of the model gets hooks bound to the copy's state.
    """

    def __init__(self, hook: Callable[..., Any]) -> None:
        self.hook = hook

    def run(self, *args: Any, **kwargs: Any) -> Any:
        return self.hook(*args, **kwargs)


class _Hook:
    """A plain hook object (torch marks some hooks with attributes, which a bound method refuses;
    a deepcopy of the model rebinds it to the copy's state)."""

    def __init__(self, hook: Callable[..., Any]) -> None:
        self.hook = hook

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        return self.hook(*args, **kwargs)


@functools.cache
def _outside_compile_type() -> type:
    # Made at the first fully_shard call, not at import: importing torch._dynamo costs ~1 s.
    disabled = torch._dynamo.disable(_OutsideCompile.run, recursive=True)
    return type("OutsideCompileHook", (_OutsideCompile,), {"__call__": disabled, "__module__": __name__})


def _install(module: nn.Module, state: FSDPState, make_class: Callable[[type], type]) -> None:
    module.__dict__["_fsdp_state"] = state
    hook = _outside_compile_type()
    module.register_forward_pre_hook(hook(state.pre_forward), prepend=True, with_kwargs=True)
    module.register_forward_hook(hook(state.post_forward))
    # A state dict holds sharded DTensors only, also while the parameters are unsharded.
    module.register_state_dict_pre_hook(_Hook(state.show_sharded))
    module.register_state_dict_post_hook(_Hook(state.show_unsharded))
    module.register_load_state_dict_pre_hook(_Hook(state.show_sharded))
    module.register_load_state_dict_post_hook(_Hook(state.after_load))
    module.__class__ = make_class(type(module))


def _as_module_list(module: Union[nn.Module, list[nn.Module]]) -> list[nn.Module]:
    modules = list(module) if isinstance(module, (list, tuple)) else [module]
    if not modules:
        raise ValueError("fully_shard got an empty list of modules; pass at least one nn.Module.")
    for m in modules:
        if not isinstance(m, nn.Module):
            raise TypeError(f"fully_shard expects an nn.Module or a list of them, got {type(m).__name__}.")
        if isinstance(m, torch.jit.ScriptModule):
            raise ValueError(
                f"fully_shard got a TorchScript module ({type(m).__name__} from torch.jit.script / trace): "
                "it keeps its parameters and forward in C++ where they cannot be swapped for shards or "
                "hooked. Fix: apply fully_shard to the eager module, and use torch.compile for speed."
            )
        if is_sharded_module(m):
            original = type(m).__bases__[-1].__name__
            raise ValueError(
                f"fully_shard was already applied to this {original}; a module can be sharded once. Fix: "
                "remove the second call (to change options, rebuild the module)."
            )
        if (
            type(m).forward is nn.Module.forward and "forward" not in m.__dict__
        ):  # torch.compile sets it on the instance
            raise ValueError(
                f"fully_shard got a {type(m).__name__}, which has no forward of its own: its hooks would "
                "never run, so its parameters would never be all-gathered. Fix: shard its children (for "
                "block in model.layers: fully_shard(block)), or pass them as one group: "
                "fully_shard(list(model.layers))."
            )
    if len({id(m) for m in modules}) != len(modules):
        raise ValueError("fully_shard got the same module twice in one list; pass each module once.")
    return modules


def _ignored_ids(ignored_params: Optional[set[nn.Parameter]]) -> set[int]:
    if ignored_params is None:
        return set()
    ids = set()
    for p in ignored_params:
        if not isinstance(p, nn.Parameter):
            raise TypeError(f"ignored_params must hold nn.Parameter objects, got {type(p).__name__}.")
        ids.add(id(p))
    return ids
