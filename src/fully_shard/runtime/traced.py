"""The traced path: what ``torch.compile`` sees of a model sharded with ``fully_shard``.

When dynamo traces a forward with no eager FSDP step around it (``torch.compile(model)``, the whole
model or a training-step function: `traced_here`), the hooks run nothing eager. Each managed
parameter, read as ``module.<name>``, is a property of the module's class (`traced_class`): while
tracing it is the parameter's group gathered *in the graph* (`gather_group`: the group's local
shards, cast to ``param_dtype`` and padded as the eager all-gather lays them out, through one
functional all-gather) by the module's pre-forward hook where dynamo inlines it (else at the
first read), the module's post-forward hook drops what it gathered; otherwise the property is the
registered parameter. The gather's backward is the
eager reduction, op for op: the gradients cast to ``reduce_dtype`` and laid out by
``torch._chunk_cat``, divided by the pre-factor, one functional reduce-scatter (sum), the HSDP
all-reduce, the post-division; each rank's slice lands in its shard's ``.grad``, the DTensor the
optimizer sees in eager. ``reshard_after_forward`` (True, and a nested call's default ``None``:
`FSDPState.nested`; the root's keeps, as eager's) wraps the gather in a selective
activation-checkpoint region whose every op is recomputed: the backward gathers again, the gathered
parameters are not saved between forward and backward; an int ``k`` gathers in two stages and
recomputes only the second, within ``k`` ranks (`gather_group`). A tensor-parallel parameter's
TP-local tensor is gathered and wrapped as the DTensor the TP module expects (`TPSpec.unsharded`); a
shard dim other than 0 is moved to the front, as eager does. An offloaded (``CPUOffloadPolicy``)
shard is copied to the mesh's device in the gather, its gradient back to the host in the reduction.
An all-gather extension (a tensor subclass's ``fsdp_pre_all_gather`` / ``fsdp_post_all_gather``,
e.g. torchao's float8 weights, or a codec from ``set_all_gather_codec``) runs in the graph: its pre
hook encodes each shard (`_encode`), the group's row travels as bytes (`_gather_encoded`), its post
hook rebuilds the parameter (`_decode`); the gradient passes straight through, as eager's.
The user's own communication code (the all-reduce hook, custom collectives) runs as opaque custom
ops (`opaque`), called at run time with what the group's settings hold.

Gradient accumulation without sync (``set_requires_gradient_sync(False)``, a second graph: dynamo
guards on the setting) accumulates where eager does: the gather's backward hands each gradient,
unreduced, to the parameter's unsharded ``nn.Parameter`` (an extra input of the gather; its
storage stays freed), whose ``.grad`` autograd sums. The next synced forward takes those ``.grad``
(and clears them) as inputs, and its backward adds them before the reduction, as eager's
accumulated unsharded gradient; a group whose parameters that forward never reads (a branch not
taken) or never gathers (a block not called) still has them reduced (`traced_post_forward`), as
eager's end of backward does. Eager and compiled micro-batches mix in either order. HSDP with the
all-reduce deferred (``set_requires_all_reduce(False)``) likewise: the backward reduce-scatters
and hands each slot to the parameter's partial leaf (`FSDPParam.partial_leaf`), the next
all-reducing one adds what the leaves hold before its all-reduce.

A block compiled on its own while the eager engine drives the step (per-block compile; a
recompute in an eager backward) keeps the eager hooks: ``module.<name>`` is what they installed.
"""

from __future__ import annotations

import functools
import threading
import weakref
from typing import Any, Optional

import torch
import torch.distributed._functional_collectives as funcol
from torch import nn
from torch.distributed.tensor import DTensor
from torch.utils._pytree import tree_flatten, tree_unflatten

from ..layouts.layout import contiguous_stride
from ..layouts.mesh import is_across_group
from .extension import _pad_rows, _unpack, bound_functions, class_hooks, instance_methods, rebind
from . import opaque
from .lifecycle import ShardedState
from .registry import BY_KEY, key_of, managed_by_id
from .state import _cast_floats, fsdp_states

# what a further input of a traced gather is (`gather_group`'s slots); the sums backward adds are
# saved; `_ONCE`, a flag that backward adds them once (`_sums_once`)
_ACCUMULATOR, _PENDING, _LEAF, _PARTIAL, _ONCE, _APART = range(6)
_SAVED = (_PENDING, _PARTIAL)
_C10D = torch.ops._c10d_functional
_MARKED = threading.local()  # .states: the states whose modules `_set_functional` marked in this thread


def traced_here(state: Any) -> bool:
    """Whether a compiled call runs this module's forward with no eager step around it: no eager
    root forward is running (per-block compile) and no eager backward (a recompute)."""
    ctx = state.ctx
    return ctx is None or not ctx.eager_around


# -- the module side: hooks and parameter properties


def traced_pre_forward(
    state: Any, module: nn.Module, args: tuple, kwargs: dict, inlined: bool = False
) -> tuple[tuple, dict]:
    """Refuse what the traced path lacks; cast the inputs as the eager hook does. ``inlined`` (traced
    in the forward's frame): gather the groups this forward reads here, before the forward: a
    forward run inside an activation checkpoint (transformers' gradient checkpointing,
    ``checkpoint_wrapper``) is a region where dynamo allows no write to an object from outside it,
    so the reads there only look the gathered parameters up. Otherwise (dynamo runs a compiled
    module's own hooks as frames of their own, outside its forward's graph) the groups are gathered
    where their parameters are first read (`traced_param`)."""
    refuse_untraceable(state)
    if not _members_continue(state):
        state._traced = None  # (what a forward that raised gathered: not this one's)
    if not state.nested:  # (handles and gathers of a forward the root's post-forward did not end)
        for under in state._traced_tree:
            under._traced_handles = under._traced = None
    if not torch.compiler.is_compiling():  # dynamo left this frame eager: the forward may run eager too
        _set_functional(state, True)
    elif inlined:
        for entry in state._traced_entries:
            _gathered(state, entry.group_key)
    mp = state.mp_policy
    if mp.cast_forward_inputs and mp.param_dtype is not None:
        args, kwargs = _cast_floats((args, kwargs), mp.param_dtype)
    return args, kwargs


def _members_continue(state: Any) -> bool:
    """Whether a forward of a member of a list-form call (``fully_shard([a, b])``) under a root
    continues the members' forward under way (until each member has run once, or the root's
    forward returns): they read the group gathered once, as eager's. (A list-form root's members
    gather each: docs/compile.md.)"""
    gathered = state._traced
    return gathered is not None and state.nested and "members" in gathered


def traced_post_forward(
    state: Any, module: nn.Module, args: tuple, output: Any, inlined: bool = False
) -> Any:
    """Drop what this module's forward gathered; cast the output. A gather that took the sums of
    earlier backwards (gradients accumulated without sync, deferred HSDP sums) reduces them in its
    backward, which must run even where this forward read none of its parameters (a branch not
    taken) or its output reaches no loss: it left a handle (`_Handle`, empty), kept here for the
    root. The root ties every handle of the states under it to its output (`_carry`), with those
    of a reduction of each group whose sums no gather of this forward took (its module did not
    run), as eager's end of backward reduces them (`_left_over`)."""
    gathered = state._traced
    handles = gathered.pop("carrying", []) if gathered is not None else []
    if gathered is not None and len(state.modules) > 1 and state.nested:  # a list-form call: its group
        members = (*gathered.get("members", ()), state._member_index(module))  # gathered once for all
        gathered["members"] = members
        if len(set(members)) == len(state.modules):
            state._traced = None
    else:
        state._traced = None  # the next forward makes a new dict (`traced_param`)
    if not torch.compiler.is_compiling():
        _set_functional(state, False)
    dtype = state.mp_policy.output_dtype
    output = _cast_floats(output, dtype) if dtype is not None else output
    if handles:
        state._traced_handles = (state._traced_handles or []) + handles
    if state.nested:
        return output
    handles = _left_over(state)
    return _carry(state, output, handles) if handles else output


def forward_returned(state: Any) -> None:
    """A traced forward of ``state``'s module returned (`api.module._ending_traced_forward`): a
    root's gathered parameters are dropped in its frame, the handles kept for its post-forward
    hook (which may run in a frame of its own). A nested module's post-forward hook runs in the
    frame of its call (and its forward may be a checkpointed region, which must not write the
    state): nothing done."""
    gathered = state._traced
    if gathered is not None and not state.nested:
        state._traced = {"carrying": gathered["carrying"]} if "carrying" in gathered else None
    if not state.nested:  # what a list-form group under it gathered for members that did not run
        for under in state._traced_tree:
            if under is not state:
                under._traced = None


def _left_over(root: Any) -> list[torch.Tensor]:
    """At the end of the root's forward, for the states under it (`install`'s ``tree``): the
    handles their gathers left, and with gradient sync, per group still holding sums of earlier
    backwards, a reduction of them in backward (`gather_group`, ``reduce_only``: nothing gathered)."""
    out: list[torch.Tensor] = []
    grad = torch.is_grad_enabled()
    for under in root._traced_tree:
        out += under._traced_handles or []
        under._traced_handles = None
        for entry in under._traced_entries if grad else ():
            group = BY_KEY[entry.group_key]()
            if _holds_sums(group):
                out += gather_group(group, False, reduce_only=True)[0]
    return out


def _holds_sums(group: Any) -> bool:
    """Whether a gather of ``group`` in a forward with gradient sync takes sums (`gather_group`)."""
    settings, info = group.settings, group.info
    if not settings.requires_gradient_sync:
        return False
    all_reducing = settings.requires_all_reduce and info.is_hsdp and info.replicate_size > 1  # (as `_Plan`)
    for fp in group.params:
        unsharded = fp.unsharded_param
        if (unsharded is not None and unsharded.grad is not None) or fp.unsynced_grad is not None:
            return True
        if all_reducing and fp.partial_reduce is not None:
            return True
    return False


def _carry(state: Any, output: Any, carried: list[torch.Tensor]) -> Any:
    """``output`` with each tensor of it that requires grad passed through `_Carry`, whose backward
    reaches the ``carried`` handles (their gathers' backwards run)."""
    leaves, spec = tree_flatten(output)
    at = [i for i, t in enumerate(leaves) if isinstance(t, torch.Tensor) and t.requires_grad]
    if not at:
        raise RuntimeError(
            f"fully_shard: under torch.compile, the forward of {state.name()} took gradients that earlier "
            "backwards accumulated without sync (set_requires_gradient_sync(False)) or HSDP sums they "
            "deferred, for this backward to reduce, but its output holds no tensor that requires grad, "
            "so no backward reaches them: they are lost. Fix: return the output with its autograd graph "
            "(not detached), or call module.reduce_grads() before this micro-batch, or run it eagerly "
            '(torch.compiler.set_stance("force_eager")).'
        )
    tied = _Carry.apply(len(at), *(leaves[i] for i in at), *carried)
    for i, t in zip(at, tied):
        leaves[i] = t
    return tree_unflatten(leaves, spec)


class _Handle(torch.autograd.Function):
    """An empty tensor whose backward reaches ``full`` (a gathered parameter; a TP parameter's local
    view; an extension's rebuilt tensor subclass) without keeping it, handing it a plain zero of its
    shape made from the handle's gradient (`_Carry`: an empty view of the root output's): the
    gather's backward then has a gradient of that backward to read its flag with
    (`_first_backward`), even where the forward did not use the parameter. (A subclass's gradient
    goes to its gather's stand-in as it is: `_Rebuilt`.)"""

    @staticmethod
    def forward(ctx: Any, full: torch.Tensor) -> torch.Tensor:
        ctx.shape, ctx.dtype = full.shape, full.dtype
        return torch.empty(0, device=full.device)  # (plain: ``full`` may be an extension's subclass)

    @staticmethod
    def backward(ctx: Any, grad: Optional[torch.Tensor]) -> Optional[torch.Tensor]:
        if grad is None:  # (`_Carry` hands plain or None)
            return None
        return grad.sum().to(ctx.dtype).expand(ctx.shape)  # (the sum of an empty tensor: 0, no memory)


class _Carry(torch.autograd.Function):
    """Forward: the first ``count`` tensors, passed through. Backward: their gradients, and for the
    rest (handles, reduce-only stand-ins: empty) an empty view of one of them, so their gathers'
    backwards run, once their other uses' have, with a gradient of this backward."""

    @staticmethod
    def forward(ctx: Any, count: int, *tensors: torch.Tensor) -> tuple[torch.Tensor, ...]:
        ctx.set_materialize_grads(False)
        ctx.rest = [(t.device, t.dtype) for t in tensors[count:]]  # (empty: handles, reduce-only stand-ins)
        return tuple(t.view_as(t) for t in tensors[:count])

    @staticmethod
    def backward(ctx: Any, *grads: Optional[torch.Tensor]) -> tuple[Optional[torch.Tensor], ...]:
        # the carried get an empty view of an output's gradient: a gradient of this backward (a
        # plain one: a DTensor output's, e.g. loss-parallel logits, by its local tensor)
        token = next((t for t in map(_plain_or_none, grads) if t is not None), None)
        if token is None:
            return (None, *grads, *[None] * len(ctx.rest))
        empty = (token.narrow(0, 0, 0) if token.dim() else token.reshape(1)[:0]).reshape(0)
        return (None, *grads, *(empty.to(device, dtype) for device, dtype in ctx.rest))


# torch 2.11's dynamo cannot trace a subclass's ``__tensor_flatten__`` (2.13's can, off the class)
_UNWRAPS_SUBCLASSES = tuple(int(v) for v in torch.__version__.split("+")[0].split(".")[:2]) >= (2, 13)


def _plain_or_none(grad: Optional[torch.Tensor]) -> Optional[torch.Tensor]:
    """``grad`` if plain, else a plain tensor it holds: a DTensor's local tensor, another traceable
    subclass's first inner tensor (a `TwoTensor`'s, a nested tensor's values), each unwrapped in
    turn; None if it holds none. (``__tensor_flatten__`` read off the class: dynamo's ``hasattr``
    on a traced subclass instance does not see it, and torch 2.11's dynamo traces neither form:
    there, None.)"""
    while grad is not None and type(grad) is not torch.Tensor:
        if isinstance(grad, DTensor):
            grad = grad.to_local()
        elif _UNWRAPS_SUBCLASSES and getattr(type(grad), "__tensor_flatten__", None) is not None:
            names = type(grad).__tensor_flatten__(grad)[0]
            grad = getattr(grad, names[0]) if names else None
        else:
            return None
    return grad


def _set_functional(state: Any, on: bool) -> None:
    """Mark the modules of ``state``'s parameters: their forward gathers through `gather_group`
    outside a graph too. A compiled call whose hooks dynamo ran eagerly took the traced route, but
    dynamo may still run the forward eagerly (a fallback, ``set_stance("force_eager")``, a
    dispatch mode): its parameters are sharded then, and must be gathered the same way."""
    for module in state.__dict__.get("_traced_modules", ()):
        module.__dict__["_fsdp_functional"] = on
    marked = _marked()
    if on:
        marked.add(state)
    else:
        marked.discard(state)


def _marked() -> "weakref.WeakSet[Any]":
    if not hasattr(_MARKED, "states"):
        _MARKED.states = weakref.WeakSet()
    return _MARKED.states


def _abandon_functional() -> None:
    """A gather refused in a forward run eagerly on the traced route: that forward is over. Every
    module this thread's hooks marked reads its registered (sharded) parameter again, and nothing
    gathered is kept (its post-forward hooks will not run)."""
    for state in list(_marked()):
        _set_functional(state, False)
        state._traced = None


def traced_param(module: nn.Module, name: str) -> Any:
    """``module.<name>`` of a managed parameter: while tracing (or in a forward that took the traced
    route but runs eagerly: `_set_functional`), its group gathered by `gather_group` (once per
    forward of the module whose forward reads it); otherwise the registered parameter."""
    if torch.compiler.is_compiling() or module.__dict__.get("_fsdp_functional"):
        entry = module.__dict__.get("_fsdp_traced_params", {}).get(name)
        if entry is not None and traced_here(entry.state):  # (per block: no key read, one graph
            gathered = _gathered(entry.state, entry.group_key)  # for every block alike)
            if gathered is not None:
                return gathered[entry.index]
    return module._parameters[name]


def _gathered(state: Any, key: int) -> Optional[list[torch.Tensor]]:
    """The group ``key``'s parameters gathered in ``state``'s forward: by `gather_group` once per
    forward; None while that gather runs (an extension's pre hook reading the module: the sharded
    parameter, as in eager)."""
    gathered = state._traced
    if gathered is None:  # made inside the graph: a dict from before it, written here,
        gathered = state._traced = {}  # would make every gathered parameter a graph output
    if key in gathered:
        return gathered[key]
    if gathered.get("gathering") == key:
        return None
    group = BY_KEY[key]()  # (by key: `_Entry`)
    reshard = state.resolved_reshard(root=not state.nested)
    gathered["gathering"], done = key, False
    try:  # (a refusal in a forward run eagerly must not leave the mark: the next forward
        # would read the sharded parameter). Each parameter a view outside the gather's recompute
        # region: read first inside an activation checkpoint, the region's own output would be
        # saved for backward (AOTAutograd saves what one recomputed region hands the next).
        fulls, carries = gather_group(group, reshard)
        gathered[key] = [p.view_as(p) for p in fulls]
        # its backward must run: a handle for the root, on a parameter holding sums (not one frozen
        # since: the reduction drops its sums, as eager's)
        holder = next((fulls[i] for i in carries if fulls[i].requires_grad), None)
        if holder is not None:  # (a TP parameter's by its local view: a plain zero reaches it)
            holder = holder.to_local() if isinstance(holder, DTensor) else holder
            gathered.setdefault("carrying", []).append(_Handle.apply(holder))
        done = True
    finally:
        gathered["gathering"] = None
        if not done and not torch.compiler.is_compiling():
            _abandon_functional()
    return gathered[key]


class _Entry:
    """A managed parameter's entry in its module's ``_fsdp_traced_params``: the state whose
    forward gathers it, its group and its index there. A trace reads the group only by its key
    (`registry.BY_KEY`: one path to it); the state it reads directly, to learn first whether an
    eager step runs around it (per-block compile), where a key, a constant to dynamo, would make a
    graph per block. A copy (``copy.deepcopy``, pickling) keys its own copies."""

    __slots__ = ("state", "group", "index", "group_key")

    def __init__(self, state: Any, group: Any, index: int) -> None:
        self.state, self.group, self.index = state, group, index
        self.group_key = key_of(group)
        key_of(state)  # (`refuse_untraceable` finds it by its id)

    def __getstate__(self) -> tuple[Any, Any, int]:
        return self.state, self.group, self.index

    def __setstate__(self, held: tuple[Any, Any, int]) -> None:
        self.__init__(*held)  # type: ignore[misc]


@functools.cache
def traced_class(cls: type, names: tuple[str, ...]) -> type:
    """``cls`` with a property per managed parameter name (`traced_param`)."""

    def prop(name: str) -> property:
        return property(lambda self: traced_param(self, name))

    attrs = {name: prop(name) for name in names}
    attrs.update({"__module__": cls.__module__, "_fsdp_traced_names": names})
    return type(cls.__name__, (cls,), attrs)


def install(places: list[tuple[Any, Any]], state: Any, tree: list[Any]) -> None:
    """Give every module holding a managed parameter the traced properties: ``places`` are
    ``(FSDPParam, ParamPlace)`` pairs whose module's forward is ``state``'s (its pre-forward gathers).
    ``tree``: ``state`` and the states under its modules, whose sums it reduces as a root (`_left_over`)."""
    key_of(state)  # (`refuse_untraceable` finds it by its id: a state without parameters too)
    state._traced_tree = tree
    state._traced_handles = None  # what this module's gathers left for the root (`traced_post_forward`)
    by_module: dict[int, tuple[nn.Module, dict[str, _Entry]]] = {}
    groups = {id(fp.group): fp.group for fp, _ in places}
    index = {id(p): i for g in groups.values() for i, p in enumerate(g.params)}  # in its group
    for fp, place in places:
        entry = _Entry(state, fp.group, index[id(fp)])
        by_module.setdefault(id(place.module), (place.module, {}))[1][place.name] = entry
    state._traced = None  # a group's key -> its gathered parameters, in one forward (`traced_param`)
    # one entry per group this state's forward gathers (`traced_pre_forward`); entries, not keys:
    # a copy's entries key its own groups
    firsts = {id(e.group): e for _, owned in by_module.values() for e in owned.values()}
    state._traced_entries = list(firsts.values())
    modules = state.__dict__.setdefault("_traced_modules", [])
    for module, owned in by_module.values():
        if not any(m is module for m in modules):
            modules.append(module)
        table = module.__dict__.setdefault("_fsdp_traced_params", {})
        table.update(owned)
        cls = type(module)
        base = cls.__bases__[0] if "_fsdp_traced_names" in cls.__dict__ else cls
        module.__class__ = traced_class(base, tuple(sorted(table)))


@torch.compiler.disable  # plain Python, its callees too: dynamo would compile each as a frame
def refuse_untraceable_tree(state: Any) -> None:
    """`refuse_untraceable` for every state under ``state``'s modules, outside any trace (the
    root's hook objects of ``torch.compile(model)``, ``FSDPModule.compile``'s calls of a whole
    model): inside a trace, dynamo reports only "Observed exception", without the message. Once
    per state and grad mode (with grad it looks for more); a setting changed later is refused
    inside the next trace, where the state's own modules are looked at again."""
    grad = torch.is_grad_enabled()  # (without grad no composable checkpoint is looked for)
    checked = state.__dict__.get("_tree_traceable")
    if checked == "grad" or (checked == "no_grad" and not grad):
        return
    for s in fsdp_states(state.modules):  # ``state``'s and those below it (``state`` may be a block)
        message = _untraceable(s, walk=s is state)  # (``state``'s walk covers the modules below)
        if message:
            raise RuntimeError(message)
    state._tree_traceable = "grad" if grad else "no_grad"


def _keep_instance_methods(fp: Any) -> bool:
    """Whether the parameter's shard has extension methods set on the instance that are not both
    bound to it; those that are are kept as ``fp.traced_methods`` (`extension.bound_functions`) for
    `_extension_calls`. Read outside any trace: a traced tensor's ``__dict__`` is out of dynamo's
    reach."""
    local = fp.local_shard
    set_on_instance = instance_methods(local)
    kept = bound_functions(local) if set_on_instance else None
    if kept != fp.traced_methods:  # (the same object while unchanged: dynamo guards on it)
        fp.traced_methods = kept
    return set_on_instance and kept is None


def refuse_untraceable(state: Any) -> None:
    """Raise, while tracing, for what the traced path does not do: all-gather extension methods
    set on a tensor instance but not bound to it (dynamo sees only a traced tensor's class, and
    methods bound to the shard are called on the traced one), naming the fix. In a trace, read
    outside it (`_untraceable_of`): the trace reads only the state's id, not its parameters (a
    second path to each, see `registry.BY_KEY`)."""
    if torch.compiler.is_compiling():
        message = _untraceable_of(id(state))  # (torch 2.11 passes only constants to such calls)
    else:  # (a hook run eagerly each step: its tree was walked once, `refuse_untraceable_tree`)
        message = _untraceable(state, walk=False)
    if message:
        raise RuntimeError(message)


@torch.compiler.assume_constant_result
def _untraceable_of(key: int) -> str:
    ref = BY_KEY.get(key)
    state = ref() if ref is not None else None
    return _untraceable(state) if state is not None else ""  # (unkeyed: it manages nothing)


def _untraceable(state: Any, walk: bool = True) -> str:
    """The refusal's message for ``state``, else "". ``walk``: also look for torch's composable
    ``checkpoint()`` under its modules (with grad enabled: without, nothing is recomputed)."""
    for g in state.groups:
        for fp in g.params:
            if _keep_instance_methods(fp):
                return (
                    f"fully_shard: torch.compile traces {state.name()} as part of a whole compiled model, "
                    "but the all-gather extension methods set on the tensor instance of "
                    f"{fp.path} are not both bound to it: the traced path calls such methods on the traced "
                    "shard, so it needs their functions (methods bound to the shard, or defined on a tensor "
                    "subclass, are supported). "
                    "Fix: bind both to the local tensor (local.fsdp_pre_all_gather = fn.__get__(local)), "
                    "define them on a tensor subclass, or compile each block on its own instead (for block "
                    "in model.layers: block.compile()), where the eager engine drives the collectives "
                    "(docs/compile.md)."
                )
    path = _composable_checkpointed(state) if walk and torch.is_grad_enabled() else None
    if path is not None:
        return (
            f"fully_shard: torch.compile traces {state.name()} as part of a whole compiled model, "
            f"but torch's composable checkpoint() was applied to {path}: its recompute runs that "
            "module eagerly in backward and hands back what it saves by position, where the compiled "
            "forward saved other tensors (torch.utils.checkpoint.CheckpointError, without fully_shard "
            "too, whose check compares only shapes and dtypes). Fix: checkpoint inside the graph "
            "instead: checkpoint_wrapper(module) (from "
            "torch.distributed.algorithms._checkpoint.checkpoint_wrapper) before fully_shard or "
            "torch.utils.checkpoint.checkpoint(...) in its forward, or compile each block on its "
            "own (for block in model.layers: block.compile()), whose recompute runs compiled too "
            "(docs/compile.md)."
        )
    return ""


def _composable_checkpointed(state: Any) -> Optional[str]:
    """The name of the first module under ``state``'s modules that torch's composable
    ``checkpoint()`` was applied to, else None."""
    try:
        from torch.distributed._composable.contract import REGISTRY_KEY
    except ImportError:  # (a torch without composable APIs has no such checkpoint either)
        return None
    for module in state.modules:
        for path, sub in module.named_modules():
            if "checkpoint" in sub.__dict__.get(REGISTRY_KEY, ()):
                return f"its submodule '{path}'" if path else "it"
    return None


def explain_saved_state_failure(e: AssertionError, model: str) -> None:
    """torch 2.13's AOTAutograd, where activation checkpointing recomputes a random op
    (``scaled_dot_product_attention``, dropout) in a graph with DTensor inputs, saves the RNG state
    after the DeviceMesh it keeps for backward, and its runtime then finds the mesh among the
    saved tensors. Raise what happened and the fixes instead (docs/compile.md)."""
    message = str(e)
    if not (message.startswith("expected all tensors_saved") and "DeviceMesh" in message):
        return
    raise RuntimeError(
        f"fully_shard: torch {torch.__version__}'s AOTAutograd could not save the activations of {model} "
        "(compiled whole with model.compile()) for backward: its activation checkpointing recomputes a "
        "random op (scaled_dot_product_attention, dropout), and torch 2.13 then saves that op's RNG "
        "state out of place beside the DTensor parameters' DeviceMesh (a torch problem; torch 2.11 "
        "compiles it). "
        "The forward raised: nothing was trained by this call. Fix: keep those ops' outputs with a "
        "selective checkpoint policy (checkpoint_wrapper(block, context_fn=partial("
        "create_selective_checkpoint_contexts, policy)) where policy returns MUST_SAVE for "
        "torch.ops.aten._scaled_dot_product_*_attention* and dropout: docs/compile.md), or compile "
        "each block on its own (block.compile())."
    ) from e


# -- the collectives


def gather_group(
    group: Any, reshard: bool | int, reduce_only: bool = False
) -> tuple[list[torch.Tensor], tuple[int, ...]]:
    """The unsharded parameters of ``group``, gathered by one all-gather whose backward is the
    group's reduction (or, without gradient sync, the accumulation on the unsharded parameters),
    and the indices of the parameters whose sums of earlier backwards it took, which only its
    backward reduces. ``reduce_only``:
    nothing gathered (empty stand-ins, `_ReduceOnly`), the backward reduces only the sums taken.
    ``reshard``: recomputed in backward, not saved; an int ``k``: gathered in two stages, across
    the groups of ``k`` ranks then within one, the first stage's result saved and only the second
    recomputed (backward gathers within ``k`` ranks, as eager's `PostForwardGroup`)."""
    params = group.params
    post_forward = group.post_forward if type(reshard) is int and group.info.world_size > 1 else None
    _take_over_assigned(id(params[0]))
    _guard_places(group)
    plan = _Plan(params, group, post_forward)
    shards = [fp.sharded_param for fp in params]
    # The gather's further inputs, each named in ``slots`` by (what it is, whose: the parameter's
    # index), only those present: without sync, each trainable parameter's accumulator; with HSDP
    # and a backward deferring the all-reduce, each one's partial leaf, to which it adds its sums.
    # These are looked up first, as they may refuse the step; only then is anything taken: with
    # sync, what micro-batches without sync accumulated (once per forward, outside the recomputed
    # region, as eager's post-backward takes it) and, with HSDP all-reducing, what the partial
    # leaves hold (as eager's `FSDPParam.take_partial_reduce`).
    found: list[tuple[int, int, torch.Tensor]] = []
    for i, fp in zip(range(len(params)), params):  # (enumerate: a traced polyfill)
        if fp.requires_grad and not plan.sync:
            found.append((_APART if fp.accumulates_apart else _ACCUMULATOR, i, _accumulator(fp)))
        elif fp.requires_grad and plan.defer:
            found.append((_LEAF, i, _partial_leaf(fp, plan)))
    takes = plan.sync and torch.is_grad_enabled()
    takes_partial = takes and plan.replicate_group is not None and not plan.defer
    for i, fp in zip(range(len(params)), params):
        pending = _take_accumulated(fp) if takes else None
        if pending is not None:
            found.append((_PENDING, i, pending))
        partial = fp.take_partial_reduce() if takes_partial else None
        if partial is not None:
            found.append((_PARTIAL, i, partial))
    extra = [t for _, _, t in found]
    # The flag that backward adds those sums once, the last slot: not an input of the recomputed
    # region (the checkpoint run eagerly saves its inputs, and a second backward would find it
    # changed), but of the gather inside it.
    once = _sums_once(group) if any(kind in _SAVED for kind, _, _ in found) else None
    found += [(_ONCE, 0, once)] if once is not None else []
    n, plan.slots = len(params), tuple((kind, i) for kind, i, _ in found)

    def gather(*inputs: Any) -> list[torch.Tensor]:
        # to_local's backward makes each local gradient a DTensor shard (an accumulator's: a
        # DTensor on the TP mesh, as eager's unsharded gradient)
        local = [_local(t) for t in inputs] + ([once] if once is not None else [])
        if reduce_only:
            return list(_ReduceOnly.apply(plan, (), *local, *((None,) if len(local) == 2 else ())))
        encoded = _encode(plan, local[:n]) if plan.extended else []
        counts = tuple(len(spec[2]) if spec is not None else 0 for spec in encoded)
        sent = [t for spec in encoded if spec is not None for t in spec[2]]
        tail = (*sent, None) if len(local) + len(sent) == 2 else sent  # (see `_GatherGroup`)
        outputs = _GatherGroup.apply(plan, counts, *local, *tail)
        fulls = _decode(plan, outputs, encoded) if encoded else outputs
        return [fp.where.tp.unsharded(t) if fp.where.tp is not None else t for fp, t in zip(params, fulls)]

    inputs = (*shards, *extra)
    carries = tuple(i for kind, i in plan.slots if kind in _SAVED)
    if not reshard:
        return gather(*inputs), carries
    from torch.utils.checkpoint import checkpoint

    return checkpoint(
        gather,
        *inputs,
        use_reentrant=False,
        context_fn=_recompute,
        preserve_rng_state=False,
    ), carries


@torch.compiler.assume_constant_result
def _take_over_assigned(key: int) -> bool:
    """At trace time (a plain call when run eagerly): what was written into a place of the group's
    parameters without ``module.<name> = ...`` (``module._parameters[name] = p``, as accelerate's
    ``set_module_tensor_to_device`` does) is taken over (or refused) now, as eager's next
    all-gather would, so that the graph reads it; a parameter frozen or thawed since is noticed. A
    write after a graph was made fails that graph's place guard (`_guard_places`) and brings the
    trace back here (docs/compile.md)."""
    fp: Any = managed_by_id(key)
    if fp is None or fp.group is None or fp.is_unsharded:  # (the places hold the engine's own
        return True  # unsharded parameters: one written meanwhile is taken over at the reshard)
    for p in fp.group.params:
        if p._adopt_assigned():
            fp.group.needs_sync = True  # eager's next all-gather moves its local tensor in
    # Frozen or thawed since (``requires_grad_`` on the sharded parameter; dynamo guards on it, so
    # the flip brings the trace back here): what the graph differentiates and reduces follows it, as
    # eager's next iteration does (`FSDPParamGroup.notice_changes`).
    if any(p.sharded_param.requires_grad != p.requires_grad for p in fp.group.params):
        fp.group.sync_params()
    return True


def _guard_places(group: Any) -> None:
    """Compare what each place of ``group``'s parameters holds with the parameter the engine put there (the
    sharded one, or the unsharded one while the group is unsharded: ``unshard()``): dynamo guards on
    the answers, so a parameter written there later without ``module.<name> = ...``
    (``module._parameters[name] = p``) fails the guard and retraces, and the retrace takes it over
    (`_take_over_assigned`); so does an unshard or reshard between compiled calls (a graph each)."""
    unsharded = group.sharded_state is ShardedState.UNSHARDED  # (`FSDPParam.is_unsharded`, read once)
    for fp in group.params:
        held = fp.unsharded_param if unsharded else fp.sharded_param
        for place in fp.places:
            _ = id(place.get()) == id(held)  # (no answer needed: dynamo guards on both ids, in C++)


def _local(t: Optional[torch.Tensor]) -> Optional[torch.Tensor]:
    return t.to_local() if isinstance(t, DTensor) else t


def _accumulator(fp: Any) -> torch.Tensor:
    """The unsharded parameter whose ``.grad`` sums a parameter's gradients without sync (made,
    storage freed, by ``set_requires_gradient_sync(False)``: a graph cannot make one), or the leaf
    that sums them apart in the reduce dtype (`FSDPParam.accumulates_apart`)."""
    if fp.accumulates_apart:
        leaf = fp._unsynced
        if isinstance(leaf, DTensor) and leaf.grad is not None:
            raise RuntimeError(
                f"fully_shard: {fp.path} holds a tensor-parallel gradient sum of another placement "
                "than the parameter's (e.g. Partial, sequence parallel) from an eager micro-batch "
                "without sync (a DTensor, redistributed once when reduced, as PyTorch's); a compiled "
                "micro-batch without sync adds TP-local gradients and cannot add to it. Fix: run the "
                "micro-batches of one accumulation all compiled or all eager (a compiled synced one may "
                "follow eager ones), reduce the sum first (a synced backward, or module.reduce_grads()), "
                "or drop it (module.zero_grad())."
            )
        wanted = (torch.Tensor, fp.dtypes.reduce, fp.where.shape)
        if leaf is None or (type(leaf), leaf.dtype, leaf.shape) != wanted:
            raise RuntimeError(
                f"fully_shard: {fp.path} has no place in its reduce dtype to accumulate gradients "
                "without sync under torch.compile (set_requires_gradient_sync(False) makes one; the "
                "module's dtype changed since, or the module is a copy, or a sum of another dtype or "
                "shape is held). Fix: call module.set_requires_gradient_sync(False) again just before "
                "the compiled micro-batch; where a sum is still held, reduce it first (a synced "
                "backward, or module.reduce_grads()) or drop it (module.zero_grad())."
            )
        return leaf
    unsharded = fp.unsharded_param
    if unsharded is None or unsharded.dtype != fp.dtypes.param:
        raise RuntimeError(
            f"fully_shard: {fp.path} has no unsharded parameter in its param dtype to accumulate "
            "gradients without sync under torch.compile (set_requires_gradient_sync(False) makes one; "
            "the module's dtype changed since, or the module is a copy). Fix: call "
            "module.set_requires_gradient_sync(False) again just before the compiled micro-batch."
        )
    return unsharded


def _partial_leaf(fp: Any, plan: "_Plan") -> torch.Tensor:
    """The leaf whose ``.grad`` sums a parameter's HSDP sums while the all-reduce is deferred
    (made by ``set_requires_all_reduce(False)``: a graph cannot make one)."""
    leaf = fp._partial
    if leaf is None or leaf.dtype != plan.reduce_dtype or leaf.numel() != fp.where.layout.shard_numel:
        raise RuntimeError(
            f"fully_shard: {fp.path} has no place for its deferred HSDP sums under torch.compile "
            "(set_requires_all_reduce(False) makes one; the module's dtype changed since, or the module "
            "is a copy). Fix: call module.set_requires_all_reduce(False) again just before the "
            "compiled micro-batch."
        )
    return leaf


def prepare_deferred_all_reduce(state: Any) -> None:
    """Before a compiled backward that defers the HSDP all-reduce: every trainable parameter of
    ``state`` has its partial leaf (`FSDPParam.partial_leaf`, no memory)."""
    for group in state.own:
        _ensure_once(group)
        for fp in group.params:
            if fp.requires_grad:
                fp.partial_leaf(fp.dtypes.reduce)


def _new_once(group: Any) -> torch.Tensor:
    return torch.ones((), dtype=torch.bool, device=group.info.device)


def _ensure_once(group: Any) -> None:
    if group.traced_once is None:
        group.traced_once = _new_once(group)


def _sums_once(group: Any) -> torch.Tensor:
    """The flag by which a gather's backward adds the sums it took once: True until that backward
    clears it, so a second backward through the same graph (``retain_graph=True``: several losses)
    reduces only its own gradients, as eager's. Each forward that takes sums takes the group's flag
    and leaves a new one for the next: a graph's output, read by the next graph as an input, whose
    clearing in backward lasts (a flag made in the graph that reads it would be cleared in that
    graph only). The first is made outside any graph (`prepare_no_sync`,
    `prepare_deferred_all_reduce`)."""
    once = group.traced_once
    if once is None:  # (sums taken without either call made: not reached by the public methods)
        once = _new_once(group)
    group.traced_once = _new_once(group)
    return once


def _take_accumulated(fp: Any) -> Optional[torch.Tensor]:
    return fp.take_accumulated(in_place=False)  # as eager's take (a new tensor: no input mutated)


def prepare_no_sync(state: Any) -> None:
    """Before a compiled micro-batch without gradient sync: every trainable parameter of ``state``
    has its unsharded ``nn.Parameter`` (a view of the freed gather buffer: no memory)."""
    for group in state.own:
        _ensure_once(group)
        for fp in group.params:
            if fp.requires_grad:
                fp.ensure_unsharded_param()
                if fp.accumulates_apart:
                    fp.unsynced_leaf(fp.dtypes.reduce)


def _recompute() -> Any:
    """Every op of the gather recomputed in backward, except, with a `PostForwardGroup`, the
    first stage's all-gather (over its ``across`` group; its wait is a no-op when recomputed)."""
    from torch.utils.checkpoint import CheckpointPolicy, create_selective_checkpoint_contexts

    def policy(ctx: Any, op: Any, *args: Any, **kwargs: Any) -> CheckpointPolicy:
        if op is _C10D.all_gather_into_tensor.default and is_across_group(args[2]):
            return CheckpointPolicy.MUST_SAVE
        if op is torch.ops.fully_shard.kept_rows.default:  # a custom all-gather's, as the above
            return CheckpointPolicy.MUST_SAVE
        return CheckpointPolicy.MUST_RECOMPUTE

    return create_selective_checkpoint_contexts(policy)


class _Plan:
    """What one traced gather needs, read from the group's parameters and settings."""

    def __init__(self, params: list[Any], group: Any, post_forward: Any) -> None:
        info, s = group.info, group.settings
        self.layouts = [fp.where.layout for fp in params]
        self.views = [fp.where.view for fp in params]  # `FLAT`: the parameter's shape
        self.params = params  # (their paths, for messages only: read where one is needed)
        self.slots: tuple[tuple[int, int], ...] = ()  # the gather's further inputs (`gather_group`)
        self.post_forward = post_forward
        self.param_dtype = params[0].dtypes.param  # one per group, as the eager all-gather's buffer
        self.device = info.device  # where the gather runs; an offloaded shard lives on the host:
        self.hosts = [fp.where.shard_device if fp.where.offload else None for fp in params]  # (grads too)
        self.reduce_dtype = params[0].dtypes.reduce
        self.world = info.world_size
        self.group = info.group
        self.rs_group = group.reduce_scatter_group  # (set_separate_reduce_scatter_group)
        self.replicate_group = info.replicate_group if info.is_hsdp and info.replicate_size > 1 else None
        factor = s.gradient_divide_factor if s.gradient_divide_factor is not None else info.data_parallel_size
        from .collectives import split_divide_factor

        self.before, self.after = split_divide_factor(factor, self.reduce_dtype)
        self.requires_grad = [fp.requires_grad for fp in params]
        self.frozen = [i for i, fp in enumerate(params) if not fp.requires_grad]
        self.sync = s.requires_gradient_sync
        self.reduce_unused = s.reduce_unused  # the eager layout: every trainable one, used-counts
        # per parameter, its all-gather extension's hooks (a tensor subclass's, or a codec's)
        self.extensions = [_extension_calls(fp, s) for fp in params]
        self.extended = any(e is not None for e in self.extensions)
        self.defer = self.sync and self.replicate_group is not None and not s.requires_all_reduce
        # the user's communication code, run by opaque ops (`opaque`) that look the group up by key
        key = id(params[0])
        self.hook = key if s.all_reduce_hook is not None else None
        self.custom_all_gather = key if s.custom_all_gather is not None else None
        self.custom_reduce_scatter = key if s.custom_reduce_scatter is not None else None


def _extension_calls(fp: Any, settings: Any) -> Optional[tuple[Any, tuple[Any, ...]]]:
    """A parameter's all-gather extension (`extension.class_hooks`: its local tensor's class's
    ``fsdp_pre_all_gather`` / ``fsdp_post_all_gather``, else its codec) and the arguments after the
    shard its pre hook takes (as eager's `FSDPParam.extension_inputs`), or None."""
    codec = settings.codec_for(fp.fqn)  # (`FSDPParam.codec`, from its group's settings: ``settings``)
    hooks = class_hooks(fp.local_shard, codec, lambda: fp.path, fp.traced_methods)
    if hooks is None:
        return None
    fp.refuse_extension_off_dim0()
    layout = fp.where.layout
    pre_args = (fp.where.info.shard_mesh, layout.shape, contiguous_stride(layout.shape), fp.places[0].module)
    return hooks, (*pre_args, fp.dtypes.policy) if hooks.full_signature else pre_args[:1]


def _landed(t: torch.Tensor) -> torch.Tensor:
    """A functional collective's result, waited on once. Under tracing funcol has already put its
    ``wait_tensor`` in the graph: a second one made Inductor copy the whole result (a gathered
    bucket, a reduced shard) before waiting on the copy. In eager it hands an
    ``AsyncCollectiveTensor``, waited on here."""
    return t.wait() if isinstance(t, funcol.AsyncCollectiveTensor) else t


def _all_gather(plan: "_Plan", flat_in: torch.Tensor) -> torch.Tensor:
    """Every rank's ``flat_in``, one row each (in two stages with a `PostForwardGroup`)."""
    pf = plan.post_forward
    if plan.world == 1:
        return flat_in.view(1, -1)
    if pf is None and plan.custom_all_gather is not None:
        return opaque.custom_all_gather(flat_in, plan.custom_all_gather, plan.world).view(plan.world, -1)
    if pf is None:
        return _landed(funcol.all_gather_tensor(flat_in, 0, plan.group)).view(plan.world, -1)
    # the shards of ranks pos, pos + k, ...; then those of each position, in rank order
    if plan.custom_all_gather is not None:  # the first stage as eager's forward: the whole group
        # through the custom comm, the rows kept picked (the second stage, recomputed in backward,
        # gathers within the k ranks with the default comm, as eager's backward does)
        whole = opaque.custom_all_gather(flat_in, plan.custom_all_gather, plan.world).view(plan.world, -1)
        kept = opaque.kept_rows(whole, pf.size, pf.rank).view(-1)
    else:
        kept = _landed(funcol.all_gather_tensor(flat_in, 0, pf.across))
    out = _landed(funcol.all_gather_tensor(kept, 0, pf.group))
    return out.view(pf.size, plan.world // pf.size, -1).transpose(0, 1).reshape(plan.world, -1)


_ALIGN = 16  # bytes: each piece of an encoded row starts aligned for any dtype's view


def _encode(plan: "_Plan", shards: list[torch.Tensor]) -> list[Optional[tuple[Any, Any, list[torch.Tensor]]]]:
    """Per parameter, None or, with an extension (`_extension_calls`): its hooks bound to the traced
    shard (on the device, as eager's), the pre hook's metadata and what it sends, rows padded as
    eager's. Outside `_GatherGroup`, as `_decode`: what the hooks make carries no gradient, and a
    tensor subclass leaving the function would make dynamo trace its backward on that subclass."""
    encoded: list[Optional[tuple[Any, Any, list[torch.Tensor]]]] = []
    for local, layout, host, calls, fp in zip(shards, plan.layouts, plan.hosts, plan.extensions, plan.params):
        if calls is None:
            encoded.append(None)
            continue
        path = fp.path
        hooks, pre_args = calls
        hooks = rebind(hooks, local.to(plan.device) if host is not None else local)
        returned, metadata = _unpack(hooks.pre(*pre_args), path)
        sent = [_pad_rows(t, layout.local_rows, layout.rows, path) for t in returned]
        # the shard itself, sent as it is: an autograd function takes each tensor once (dynamo)
        encoded.append((hooks, metadata, [t.view_as(t) if t is local else t for t in sent]))
    return encoded


def _gather_encoded(
    plan: "_Plan", shards: list[torch.Tensor], counts: tuple[int, ...], sent: tuple[torch.Tensor, ...]
) -> tuple[torch.Tensor, ...]:
    """A group with extensions: each rank's row holds, per parameter, what its extension sends
    (`_encode`) or its shard cast and padded, as bytes; one all-gather. Returns per parameter its
    unsharded tensor, or for an extension's a zero-stride stand-in whose gradient is the rebuilt
    parameter's (`_decode`); then every extension's gathered outputs, in `_encode`'s order."""
    pieces: list[torch.Tensor] = []
    received: list[list[tuple[torch.Size, torch.dtype]]] = []
    it = iter(sent)
    for local, layout, calls, count in zip(shards, plan.layouts, plan.extensions, counts):
        if calls is None:  # as `_GatherGroup.forward`'s buffer
            t = local.to(plan.param_dtype).movedim(layout.dim, 0)
            if layout.rows > layout.local_rows:
                t = torch.cat([t, t.new_zeros((layout.rows - layout.local_rows, *layout.moved_shape[1:]))])
            inputs = [t]
        else:
            inputs = [next(it) for _ in range(count)]
        received.append([(t.shape, t.dtype) for t in inputs])
        for t in inputs:
            b = t.reshape(-1).view(torch.uint8)
            pad = -b.numel() % _ALIGN
            pieces.append(torch.cat([b, b.new_zeros(pad)]) if pad else b)
    per_rank = _all_gather(plan, torch.cat(pieces))
    fulls, gathered, offset = [], [], 0
    for local, layout, view, calls, sizes in zip(shards, plan.layouts, plan.views, plan.extensions, received):
        outputs = []
        for shape, dtype in sizes:  # each piece's bytes of every rank, as its dtype, ranks' rows stacked
            nbytes = shape.numel() * dtype.itemsize
            outputs.append(per_rank[:, offset : offset + nbytes].reshape(-1).view(dtype).view(-1, *shape[1:]))
            offset += nbytes + (-nbytes % _ALIGN)
        if calls is None:
            full = outputs[0][: layout.moved_shape[0]]
            full = full.view(view) if view is not None else full
            fulls.append(full.movedim(0, layout.dim).contiguous() if layout.dim else full.clone())
        else:
            fulls.append(local.new_zeros((), dtype=plan.param_dtype).expand(layout.shape))
            gathered += [o.clone() for o in outputs]  # each its own storage, as eager's outputs
    return (*fulls, *gathered)


def _decode(plan: "_Plan", outputs: tuple[torch.Tensor, ...], encoded: list[Any]) -> list[torch.Tensor]:
    """Each extension's post hook rebuilds its parameter from the gathered outputs (dim 0 only:
    `_extension_calls`); its gradient goes straight to the stand-in `_gather_encoded` returned."""
    n = len(encoded)
    fulls, gathered = list(outputs[:n]), iter(outputs[n:])
    for i, (spec, layout) in enumerate(zip(encoded, plan.layouts)):
        if spec is not None:
            hooks, metadata, sent = spec
            full, _ = hooks.post(tuple(next(gathered) for _ in sent), metadata, plan.param_dtype)
            if full.shape != layout.shape:  # the padding rows cut off (as eager's, by as_strided)
                full = torch.as_strided(full, layout.shape, contiguous_stride(layout.shape), 0)
            if type(full) is torch.Tensor:  # a codec's: the stand-in's zeros added, its gradient the
                fulls[i] = full.detach() + fulls[i]  # sum's (an identity function's output would be
            else:  # saved for backward, not recomputed: gathered weights kept alive between passes)
                fulls[i] = _Rebuilt.apply(fulls[i], full)
    return fulls


class _Rebuilt(torch.autograd.Function):
    """A tensor subclass rebuilt by its post hook, its gradient passed to the stand-in, untouched
    (adding the stand-in would dispatch on the subclass)."""

    @staticmethod
    def forward(ctx: Any, stand_in: torch.Tensor, rebuilt: torch.Tensor) -> torch.Tensor:
        return rebuilt

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple[torch.Tensor, None]:
        return grad, None


def _keep_for_backward(ctx: Any, plan: "_Plan", inputs: tuple, reduce_only: bool) -> None:
    """What a gather's backward reads: the plan, how many tensors extensions sent, whether it only
    reduces (`_ReduceOnly`), the sums it adds (saved, in slot order). An unused output's gradient
    stays None (see backward)."""
    n, slots = len(plan.layouts), plan.slots
    ctx.plan, ctx.sent, ctx.reduce_only = plan, len(inputs) - n - len(slots), reduce_only
    further = inputs[n : n + len(slots)]
    ctx.save_for_backward(*(t for (kind, _), t in zip(slots, further) if kind in _SAVED))
    # not saved: its clearing in backward would fail the saved-tensor version check of a second one
    ctx.once = next((t for (kind, _), t in zip(slots, further) if kind == _ONCE), None)
    ctx.set_materialize_grads(False)


def _gather_plain(plan: "_Plan", shards: tuple) -> tuple[torch.Tensor, ...]:
    """The eager all-gather's layout (each rank's padded shards, cast, end to end), one functional
    all-gather, each parameter cut out."""
    shards = [local.to(plan.device, plan.param_dtype, non_blocking=True) for local in shards]
    if plan.world == 1:  # each shard is its whole parameter: no buffer whose views would alias
        return tuple(  # (torch 2.11 refuses those)
            local if view is None else local.reshape(view).clone() for local, view in zip(shards, plan.views)
        )
    flat = []
    for local, layout in zip(shards, plan.layouts):  # the sharded dim in front (`moved_shape`)
        local = local.movedim(layout.dim, 0)
        missing = layout.rows - layout.local_rows
        if missing:
            local = torch.cat([local, local.new_zeros((missing, *layout.moved_shape[1:]))])
        flat.append(local.reshape(-1))
    flat_in = torch.cat(flat) if len(flat) > 1 else flat[0]
    per_rank = _all_gather(plan, flat_in)
    fulls, offset = [], 0
    for layout, view in zip(plan.layouts, plan.views):
        numel = layout.shard_numel
        rows = per_rank[:, offset : offset + numel].reshape(plan.world * layout.rows, *layout.moved_shape[1:])
        full = rows[: layout.moved_shape[0]]
        if view is not None:
            full = full.view(view)
        fulls.append(full.movedim(0, layout.dim).contiguous() if layout.dim else full.clone())
        offset += numel
    return tuple(fulls)


class _GatherGroup(torch.autograd.Function):
    """Forward: the eager all-gather's layout (each rank's padded shards, cast, end to end), one
    functional all-gather, each parameter cut out. Backward: the eager reduction.

    Never called with exactly two tensors: where no input requires grad or grad mode is off,
    dynamo (2.13) calls ``forward`` without its context if the arguments number its parameters
    (``*inputs`` counted as one), and the plan would land in ``ctx``; a trailing None pads that case
    (`gather_group`; `test_a_two_tensor_gather_compiles_frozen_and_under_no_grad`)."""

    @staticmethod
    def forward(
        ctx: Any, plan: _Plan, counts: tuple[int, ...], *inputs: Optional[torch.Tensor]
    ) -> tuple[torch.Tensor, ...]:
        # inputs: the n local shards; the further inputs named by ``plan.slots`` (`gather_group`);
        # what extensions send (`_encode`). What backward adds (pending sums) is saved, in slot order.
        n = len(plan.layouts)
        shards = inputs[:n]
        _keep_for_backward(ctx, plan, inputs, reduce_only=False)
        # an offloaded shard copied to the device (CPU mesh: no copy), cast to param_dtype
        if plan.extended:
            local = [t.to(plan.device, non_blocking=True) for t in shards]
            outputs = _gather_encoded(plan, local, counts, inputs[n + len(plan.slots) :])
            ctx.mark_non_differentiable(*outputs[n:], *(outputs[i] for i in plan.frozen))
            return outputs
        outputs = _gather_plain(plan, inputs[:n])
        if plan.frozen:  # no gradient computed for a frozen parameter, none reduced: as eager
            ctx.mark_non_differentiable(*(outputs[i] for i in plan.frozen))
        return outputs

    @staticmethod
    def backward(ctx: Any, *grads: Optional[torch.Tensor]) -> tuple[Optional[torch.Tensor], ...]:
        plan = ctx.plan
        slots = plan.slots
        n = len(plan.layouts)
        head, none, sent = (None, None), [None] * n, [None] * ctx.sent  # (the plan, the counts)
        seen = grads  # (`_ReduceOnly`: its stand-ins' empty gradients, from `_Carry`, only seen)
        if ctx.reduce_only:
            grads = (None,) * n
        if not plan.sync:  # to the accumulators' .grad, unreduced (autograd sums them; apart: cast)
            kept = (
                grads[i] if kind != _APART or grads[i] is None else grads[i].to(plan.reduce_dtype)
                for kind, i in slots
            )
            return (*head, *none, *kept, *sent)
        saved = iter(ctx.saved_tensors)
        pending: list[Optional[torch.Tensor]] = [None] * n
        partials: list[Optional[torch.Tensor]] = [None] * n
        for kind, i in slots:
            if kind == _PENDING:
                pending[i] = next(saved)
            elif kind == _PARTIAL:
                partials[i] = next(saved)
        once = _first_backward(ctx.once, seen)  # (None: nothing taken)
        grads = tuple(
            g if p is None else torch.where(once, p, 0) if g is None else torch.where(once, p + g, g)
            for g, p in zip(grads, pending)
        )
        partials = [p if p is None else torch.where(once, p, 0) for p in partials]
        if all(g is None for g in grads) and not any(p is not None for p in partials):
            return (None,) * (2 + n + len(slots) + ctx.sent)
        dtype = plan.reduce_dtype
        device = next(t.device for t in (*grads, *partials) if t is not None)
        # The eager reduce-scatter's layout (`FSDPParamGroup.post_backward`): every trainable
        # parameter with a shard (or, without reduce_unused, only those with a gradient here), zeros
        # for a missing gradient, then one used-count each; at 3+ ranks the summation order of an
        # element depends on where it lies, so the same layout gives eager's bits.
        had = [grads[i] is not None or partials[i] is not None for i in range(n)]
        members = [
            i
            for i in range(n)
            if plan.requires_grad[i] and plan.layouts[i].shard_numel and (plan.reduce_unused or had[i])
        ]
        if not members:  # size-0 parameters only: an empty gradient each, as eager's
            return (*head, *_empty_grads(plan, had, dtype, device), *[None] * len(slots), *sent)
        inputs = [
            torch.zeros(plan.layouts[i].moved_shape, dtype=dtype, device=device)
            if grads[i] is None
            else grads[i].reshape(-1)
            if plan.views[i] is not None
            else grads[i].movedim(plan.layouts[i].dim, 0)
            for i in members
        ]
        if len({t.dtype for t in inputs}) > 1:  # (_chunk_cat takes one dtype: a sum held apart, a zero)
            inputs = [t.to(dtype) for t in inputs]
        sizes = [plan.layouts[i].shard_numel for i in members]
        slot = sum(sizes)
        if plan.reduce_unused:  # each rank's 0/1 per parameter, as eager's (every rank: the same)
            used = torch.ones(len(members), dtype=inputs[0].dtype, device=device)
            for j, i in enumerate(members):
                if not had[i]:
                    used[j] = 0
            inputs.append(used.expand(plan.world, len(members)))
            slot += len(members)
        # _chunk_cat pads each to world x rows rows, as the eager reduce-scatter's copy-in
        if plan.extended:  # an extension's gradient may be a subclass: into a plain tensor, as eager
            rs_input = torch.empty((plan.world, slot), dtype=dtype, device=device)
            torch._chunk_cat(inputs, dim=0, num_chunks=plan.world, out=rs_input)  # (returns the subclass)
            rs_input = rs_input.view(-1)
        else:
            rs_input = torch._chunk_cat(inputs, dim=0, num_chunks=plan.world).to(dtype).view(-1)
        if plan.before != 1:
            rs_input = rs_input / plan.before
        if plan.world > 1 and plan.custom_reduce_scatter is not None:
            out = opaque.custom_reduce_scatter(rs_input, plan.custom_reduce_scatter, plan.world)
        elif plan.world > 1:
            out = _landed(funcol.reduce_scatter_tensor(rs_input, "sum", 0, plan.rs_group))
        else:
            out = rs_input
        place = {i: j for j, i in enumerate(members)}  # a parameter's piece among the members'
        if plan.defer:  # each slot, as it is, added to the parameter's partial leaf (its slot's)
            pieces = out[: sum(sizes)].split(sizes)
            kept = [
                pieces[place[i]] if kind == _LEAF and grads[i] is not None and i in place else None
                for kind, i in slots
            ]
            return (*head, *none, *kept, *sent)
        if any(p is not None for p in partials):  # the sums deferred by earlier backwards, slot by slot
            held = [
                partials[i] if partials[i] is not None else out.new_zeros(k) for i, k in zip(members, sizes)
            ]
            out = out + torch.cat([*held, out.new_zeros(slot - sum(sizes))])
        if plan.replicate_group is not None:
            out = _landed(funcol.all_reduce(out, "sum", plan.replicate_group))
        if plan.hook is not None:  # as eager's: after the all-reduce, before the division
            opaque.all_reduce_hook(out, plan.hook)
        if plan.after != 1:
            out = out / plan.after
        result: list[Optional[torch.Tensor]] = [None] * n
        offset = 0
        for i, size in zip(members, sizes):
            layout = plan.layouts[i]
            piece = out[offset : offset + size].view(layout.rows, *layout.moved_shape[1:])
            piece = piece[: layout.local_rows]
            offset += size
            if layout.dim:
                piece = piece.movedim(0, layout.dim).contiguous()
            if plan.hosts[i] is not None:  # offloaded: the gradient goes to the host, as eager's
                piece = piece.to(plan.hosts[i])
            # Every rank runs the same graph: no gradient here is no gradient anywhere (eager's
            # used-counts keep such a .grad as it was; so does None).
            result[i] = piece if had[i] else None
        result = [
            r if i in place else e
            for i, (r, e) in enumerate(zip(result, _empty_grads(plan, had, dtype, device)))
        ]
        return (*head, *result, *[None] * len(slots), *sent)


def _empty_grads(
    plan: _Plan, had: list[bool], dtype: torch.dtype, device: torch.device
) -> list[Optional[torch.Tensor]]:
    """A size-0 parameter's gradient (it joins no reduce-scatter): empty, as eager's; None for the rest."""
    out: list[Optional[torch.Tensor]] = []
    for i, layout in enumerate(plan.layouts):
        if plan.requires_grad[i] and had[i] and not layout.shard_numel:
            empty = torch.zeros(layout.local_shape, dtype=dtype, device=device)
            out.append(empty.to(plan.hosts[i]) if plan.hosts[i] is not None else empty)
        else:
            out.append(None)
    return out


def _first_backward(once: Optional[torch.Tensor], grads: tuple) -> Optional[torch.Tensor]:
    """Whether this is the first backward through the gather, so the sums it took are added
    (`_sums_once`); the flag cleared for any later one. Read together with a gradient of this
    backward (an empty slice of it, summed: always True), so that the partitioner cannot compute
    the read in the forward graph, where the flag is always set. A group whose parameters the
    forward did not use, or `_ReduceOnly`'s, gets one through its handle or stand-ins (`_Carry`);
    without any (an extension's subclass parameter's handle) the read may land in the forward
    graph, and a second backward adds the sums again."""
    if once is None:
        return None
    # a plain gradient first (an extension's may be a subclass, which the flag would become)
    token = next(
        (g for g in grads if type(g) is torch.Tensor), next((g for g in grads if g is not None), None)
    )
    if token is None:
        first = once.clone()
    else:
        empty = token.narrow(0, 0, 0) if token.dim() else token.reshape(1)[:0]  # (a view: no copy)
        first = once & (empty.sum() == 0)
    once.fill_(False)
    return first


class _ReduceOnly(_GatherGroup):
    """`_GatherGroup` for a group whose forward did not run: its forward gathers nothing (an empty
    stand-in per parameter), its backward is the same reduction, of the taken sums alone."""

    @staticmethod
    def forward(
        ctx: Any, plan: _Plan, counts: tuple[int, ...], *inputs: Optional[torch.Tensor]
    ) -> tuple[torch.Tensor, ...]:
        _keep_for_backward(ctx, plan, inputs, reduce_only=True)  # (the stand-ins' gradients add nothing)
        n = len(plan.layouts)
        return tuple(torch.empty(0, dtype=plan.param_dtype, device=plan.device) for _ in range(n))  # (plain)
