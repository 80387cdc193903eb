"""`fully_shard` and `replicate`: validate everything, then manage the parameters and install
the hooks (thin adapters to `FSDPState`)."""

from __future__ import annotations

import functools
from typing import Any, Callable, Optional, Union

import torch
import torch.nn as nn
from torch._C._dynamo.eval_frame import get_eval_frame_callback
from torch.distributed.device_mesh import DeviceMesh

from .discovery import (
    Found,
    check_param,
    find_params,
    is_sharded_module,
    move_buffers,
    shard_choice_for,
    warn_uneven_complex,
)
from ..layouts.mesh import check_reshard_after_forward, mesh_info, post_forward_groups, replicate_info
from ..runtime.param import FSDPParam, ParamPlace
from ..runtime.param_group import FSDPParamGroup
from ..features.offload import offload_chooser
from .spmd import restore, to_dp_mesh
from ..layouts.policy import MixedPrecisionPolicy, OffloadPolicy, as_mp_policy
from ..runtime.registry import register_original
from ..features.traps import install_optimizer_check, register_ignored
from ..features import finite
from ..features import schedule
from ..runtime.state import FSDPState, RootContext, fsdp_states
from ..runtime import traced

from .module import ReplicateModule, _replicated_class, _sharded_class


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
    """Shard ``module``'s parameters on dim 0 over ``mesh``: one group per call, applied bottom-up
    (blocks, then the root). An inner call's parameters stay its own; a list forms one group.

    Args:
        mesh: 1-D (FSDP) or 2-D ``(replicate, shard)`` (HSDP) mesh; default: every rank, accelerator or CPU.
        reshard_after_forward: free params after forward; None: not the root; int k: regather within k ranks.
        mp_policy / offload_policy: `MixedPrecisionPolicy` / `CPUOffloadPolicy` (PyTorch's accepted).
        offload_policy may also choose per parameter: ``{name pattern: policy}`` or ``param -> policy``.
        ignored_params: parameters left alone entirely (not sharded, not synchronised).
        shard_placement_fn: ``param -> Shard(d) | ShardPlacement(Shard(d), mesh=) | None`` (None: dim 0).
        dp_mesh_dims: `DataParallelMeshDims` naming the data-parallel dims when ``mesh`` is a full SPMD mesh.

    Returns the module (or list); its class now also derives from `FSDPModule`.
    """
    modules = _as_module_list(module, "fully_shard")
    mesh, changes = to_dp_mesh(modules, mesh, dp_mesh_dims)
    try:
        info = mesh_info(mesh)
        checked = check_reshard_after_forward(reshard_after_forward, info)
        args = (mp_policy, offload_policy, ignored_params, shard_placement_fn)
        _apply(modules, info, checked, *args, _sharded_class)
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
    plain_params: bool = False,
) -> Union[nn.Module, list[nn.Module]]:
    """Data parallelism without sharding (PyTorch's ``replicate``), on `fully_shard`'s engine and
    controls: whole parameters as ``Replicate()`` DTensors on the 1-D ``mesh``, gradients averaged
    by an all-reduce per backward. Composes with ``fully_shard`` in one model, applied bottom-up.

    ``plain_params=True``: the parameters and their gradients are plain tensors instead (every rank
    holds the whole of each), as DDP and FSDP1's ``NO_SHARD`` expose them: code that mixes them with
    plain tensors (``p.grad.allclose(ref)``, ``p.data = t``) works unchanged. The engine, controls and
    numerics are the same; ``torch.distributed.checkpoint`` saves them as replicated tensors.

    Returns the module (or list); its class now also derives from `ReplicateModule` (an `FSDPModule`).
    """
    modules = _as_module_list(module, "replicate")
    info = replicate_info(mesh, plain=plain_params)
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
    found, choices = _check(
        modules, info, reshard_after_forward, offload_policy, ignored_params, shard_placement_fn
    )
    # Every check has passed; from here on nothing raises on user input.
    install_optimizer_check()
    register_ignored(ignored_params)
    group, extra = _groups_by_mesh(_manage(found.own, choices, mp_policy), info)
    lent = [(owner, place) for owner, places in found.borrowed for place in places]
    borrowed = _borrow(found.borrowed)
    move_buffers(modules, info.device)
    state = FSDPState(modules, group, info, reshard_after_forward, mp_policy, borrowed, extra)
    state.setup_root = _setup_root
    if type(reshard_after_forward) is int:  # made now: a compiled graph cannot make process groups
        for g in state.own:
            g.post_forward = post_forward_groups(g.info, reshard_after_forward)
    for m in modules:
        _install(m, state, make_class)
    tree = fsdp_states(modules)  # this call's and the earlier ones under it
    places = [(fp, place) for g in state.own for fp in g.params for place in fp.places] + lent
    traced.install(places, state, list(tree))
    for under, path in tree.items():
        under.nested = under is not state  # (`FSDPState.resolved_reshard` in a trace)
        if under.ctx is None:  # (lazy init names them from its root; a trace before it, from these)
            under.take_path(path)


def _check(
    modules: list[nn.Module],
    info: Any,
    reshard_after_forward: Any,
    offload_policy: Any,
    ignored_params: Optional[set[nn.Parameter]],
    shard_placement_fn: Any,
) -> tuple[Found, list[tuple[int, Any, Any]]]:
    """The parameters the call manages, each one's (shard dim, mesh info, offload); raises on bad
    input before anything changes."""
    choose_offload = offload_chooser(offload_policy)
    names = [""] if len(modules) == 1 else [f"[{i}]" for i in range(len(modules))]
    found = find_params(modules, names, _ignored_ids(ignored_params))
    choices = [shard_choice_for(param, places[0].fqn, shard_placement_fn) for param, places in found.own]
    dims = [dim for dim, _ in choices]
    infos = _param_meshes(info, [mesh for _, mesh in choices], reshard_after_forward)
    for (param, places), param_info in zip(found.own, infos):
        check_param(param, places[0].fqn, param_info)
    warn_uneven_complex(found.own, dims, infos)
    offloads = [choose_offload(param, places[0].fqn) for param, places in found.own]
    return found, list(zip(dims, infos, offloads))


def _manage(
    own: list[tuple[nn.Parameter, list[ParamPlace]]], choices: list[tuple[int, Any, Any]], mp_policy: Any
) -> list[FSDPParam]:
    """An `FSDPParam` for each parameter, registered as the manager of the original."""
    params = [
        FSDPParam(param, places, param_info, mp_policy, dim, offload)
        for (param, places), (dim, param_info, offload) in zip(own, choices)
    ]
    for (original, _), managed in zip(own, params):
        register_original(original, managed)
    return params


def _borrow(borrowed: list[tuple[FSDPParam, list[ParamPlace]]]) -> list[FSDPParamGroup]:
    """Add the places of parameters tied to ones earlier calls manage; return those calls' groups."""
    groups: list[FSDPParamGroup] = []
    for owner, places in borrowed:
        owner.add_places(places)
        if owner.group is not None and owner.group not in groups:
            groups.append(owner.group)
    return groups


def _groups_by_mesh(params: list[FSDPParam], info: Any) -> tuple[Optional[FSDPParamGroup], list[Any]]:
    """One group per mesh: the one on the call's mesh (None if no parameter stayed there) and the
    others, in the order their meshes appear."""
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
    """Each parameter's mesh info: the call's, or one `MeshInfo` per distinct mesh
    ``shard_placement_fn`` chose (so its parameters form one group), checked against the call."""
    made: list[tuple[DeviceMesh, Any]] = [(info.mesh, info)]  # mesh["ep"] sliced twice is 2 equal objects
    out = []
    for mesh in meshes:
        known = info if mesh is None else next((i for m, i in made if m is mesh or m == mesh), None)
        if known is None:
            known = mesh_info(mesh)
            if known.device.type != info.device.type:
                raise ValueError(
                    f"shard_placement_fn chose a mesh on {known.device.type}, but fully_shard's mesh "
                    f"computes on {info.device.type}. Fix: build every mesh of one call on the same device "
                    "type."
                )
            if info.replicate_only:
                raise ValueError(
                    "replicate() takes no per-parameter meshes; use fully_shard for those parameters."
                )
            if isinstance(reshard_after_forward, int) and not isinstance(reshard_after_forward, bool):
                try:
                    check_reshard_after_forward(reshard_after_forward, known)
                except ValueError as e:
                    raise ValueError(
                        f"{e} The call's reshard_after_forward applies to the parameters shard_placement_fn "
                        f"put on another mesh {mesh} too. Fix: choose an int dividing both meshes' shard "
                        "sizes, or True/False."
                    ) from None
            made.append((mesh, known))
        out.append(known)
    return out


class _OutsideCompile:
    """A module hook: eager outside ``torch.compile``'s graphs, traced when the compiler traces
    the whole model.

    When dynamo inlines the hook into a traced frame (the whole model compiled: ``model.compile()``,
    a compiled training step) and no eager step runs around it, the traced hook runs and the
    collectives go into the graph (`traced`). As a frame of its own (dynamo runs the hooks of a
    compiled module outside its forward's frame) the hook is never traced (``skip_code``): it runs
    eagerly, either the eager hook (a block compiled while the eager engine drives the step) or
    the traced hook (the root's under ``torch.compile(model)``), which dynamo compiles as a frame of
    its own, or with ``eager_frame`` (the post-forward) runs eagerly: its ties to the output
    (`traced._carry`) would otherwise make a graph of their own. The eager hook runs through
    ``torch._dynamo.disable`` there, so nothing of it is compiled. An object, not a closure, so a
    deepcopy rebinds it to the copy.
    """

    def __init__(
        self, hook: Callable[..., Any], traced_hook: Callable[..., Any], eager_frame: bool = False
    ) -> None:
        self.hook = hook
        self.traced_hook = traced_hook
        self.eager_frame = eager_frame  # as a frame of its own, the traced hook runs eagerly (not compiled)

    def run(self, *args: Any, **kwargs: Any) -> Any:
        return self.hook(*args, **kwargs)

    def run_traced(self, *args: Any, **kwargs: Any) -> Any:
        return self.traced_hook(self.hook.__self__, *args, inlined=False, **kwargs)

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        compiling = torch.compiler.is_compiling()
        if not compiling and not _compile_active():
            return self.hook(*args, **kwargs)  # plain eager
        state = self.hook.__self__
        if traced.traced_here(state):
            if not compiling:  # a frame of its own, run eagerly: refuse here, where the message survives
                traced.refuse_untraceable_tree(state)
                if self.eager_frame:
                    return self.run_traced_eagerly(*args, **kwargs)
            return self.traced_hook(state, *args, inlined=compiling, **kwargs)
        return self.run_eagerly(*args, **kwargs)


def _compile_active() -> bool:
    """A compiled call is running (this frame was left to run eagerly) and may trace the forward:
    not under a user's dispatch mode (a FLOP counter, a debug mode), where dynamo traces nothing
    and the eager engine reshards as usual (the traced route run with no graph would not)."""
    if get_eval_frame_callback() in (None, False):
        return False
    from torch.utils._python_dispatch import is_in_torch_dispatch_mode

    return not is_in_torch_dispatch_mode(include_infra_modes=False)


class _Hook:
    """A plain hook object: torch marks some hooks with attributes, which a bound method refuses;
    a deepcopy rebinds it to the copy's state."""

    def __init__(self, hook: Callable[..., Any]) -> None:
        self.hook = hook

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        return self.hook(*args, **kwargs)


@functools.cache
def _outside_compile_type() -> type:
    # Made at the first call, not at import: importing torch._dynamo costs ~1 s.
    from torch._dynamo.eval_frame import skip_code

    skip_code(_OutsideCompile.__call__.__code__)  # traced when inlined, never as a frame of its own
    disabled = torch._dynamo.disable(_OutsideCompile.run, recursive=True)
    traced_eagerly = torch._dynamo.disable(_OutsideCompile.run_traced, recursive=True)
    attrs = {"run_eagerly": disabled, "run_traced_eagerly": traced_eagerly, "__module__": __name__}
    return type("OutsideCompileHook", (_OutsideCompile,), attrs)


def _store_in_call_order(hooks: dict[int, Any]) -> None:
    """Re-insert ``hooks`` (same dict, same keys: every hook's handle still removes it) so that its
    storage order is its call order. ``prepend=True`` moves a key to the front of the OrderedDict's
    order only; torch 2.11's dynamo finds a hook's position by one order and guards it by the other
    (a module that ``parallelize_module`` hooked first: "'function' object has no attribute 'hook'",
    the guard reading our hook's attribute off the TP hook)."""
    items = list(hooks.items())
    hooks.clear()
    hooks.update(items)


def _install(module: nn.Module, state: FSDPState, make_class: Callable[[type], type]) -> None:
    module.__dict__["_fsdp_state"] = state
    hook = _outside_compile_type()
    pre = hook(state.pre_forward, traced.traced_pre_forward)
    module.register_forward_pre_hook(pre, prepend=True, with_kwargs=True)
    _store_in_call_order(module._forward_pre_hooks)
    # (the root's post-forward, a frame of its own under torch.compile(model), ties what a gather
    # took to its output: eagerly, not as a graph of its own: `traced.traced_post_forward`)
    module.register_forward_hook(hook(state.post_forward, traced.traced_post_forward, eager_frame=True))
    _store_in_call_order(module._forward_hooks)  # (one registered earlier with prepend=True)
    # A state dict holds sharded DTensors only, also while the parameters are unsharded.
    module.register_state_dict_pre_hook(_Hook(state.show_sharded))
    module.register_state_dict_post_hook(_Hook(state.show_unsharded))
    module.register_load_state_dict_pre_hook(_Hook(state.before_load))
    module.register_load_state_dict_post_hook(_Hook(state.after_load))
    module.__class__ = make_class(type(module))


def _as_module_list(module: Union[nn.Module, list[nn.Module]], api: str) -> list[nn.Module]:
    modules = list(module) if isinstance(module, (list, tuple)) else [module]
    if not modules:
        raise ValueError(f"{api} got an empty list of modules; pass at least one nn.Module.")
    for m in modules:
        if not isinstance(m, nn.Module):
            raise TypeError(f"{api} expects an nn.Module or a list of them, got {type(m).__name__}.")
        if isinstance(m, torch.jit.ScriptModule):
            raise ValueError(
                f"{api} got a TorchScript module ({type(m).__name__} from torch.jit.script / trace): "
                "it keeps its parameters and forward in C++ where they cannot be swapped for shards or "
                f"hooked. Fix: apply {api} to the eager module, and use torch.compile for speed."
            )
        if is_sharded_module(m):
            original = getattr(type(m), "_fsdp_original_class", type(m)).__name__
            earlier = (
                "replicate"
                if isinstance(m, ReplicateModule)
                else "fully_shard"
                if hasattr(type(m), "_fsdp_original_class")
                else type(m).__name__
            )
            raise ValueError(
                f"{api}: {earlier} was already applied to this {original}; a module can be sharded or "
                "replicated once. Fix: remove the second call (to change options, rebuild the module)."
            )
        # torch.compile sets forward on the instance
        if type(m).forward is nn.Module.forward and "forward" not in m.__dict__:
            raise ValueError(
                f"{api} got a {type(m).__name__}, which has no forward of its own: its hooks would "
                f"never run, so its parameters would never be gathered or reduced. Fix: apply {api} to its "
                f"children (for block in model.layers: {api}(block)), or pass them as one group: "
                f"{api}(list(model.layers))."
            )
    if len({id(m) for m in modules}) != len(modules):
        raise ValueError(f"{api} got the same module twice in one list; pass each module once.")
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
