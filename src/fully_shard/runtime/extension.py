"""All-gather extensions (PyTorch's ``fsdp_pre_all_gather`` / ``fsdp_post_all_gather`` protocol):
the local shard's own methods (a tensor subclass such as torchao's float8, or methods set on the
instance), else a codec (``FSDPModule.set_all_gather_codec``) called with the local shard first.

* ``pre(mesh)`` or ``pre(mesh, outer_size, outer_stride, module, mp_policy)`` returns ``(inputs,
  metadata)``: tensors of any dtype to gather over the 1-D shard mesh. An input with this rank's own
  row count is zero-padded to the padded count (PyTorch makes the extension pad).
* Outputs live as long as the parameter; reshard resizes their storage to 0.
* ``post(outputs, metadata, param_dtype)`` first returns ``(unsharded, to_free)``; later all-gathers
  give ``to_free`` its memory back and call ``post(..., out=unsharded_param)`` to rebuild in place.
"""

from __future__ import annotations

import contextlib
import functools
import inspect
import weakref
from dataclasses import dataclass, field, replace
from typing import Any, Callable, Optional, Sequence

import torch

_PRE, _POST = "fsdp_pre_all_gather", "fsdp_post_all_gather"
EXTENSION_METHODS = (_PRE, _POST)
# The pre hook's function -> its parameter count (inspect is slow); forgets functions that die.
_ARITY: "weakref.WeakKeyDictionary[Any, int]" = weakref.WeakKeyDictionary()


@dataclass(frozen=True)
class Hooks:
    """The two calls of one parameter's extension, bound to its local shard."""

    pre: Callable[..., Any]
    post: Callable[..., Any]
    full_signature: bool  # pre takes (mesh, outer_size, outer_stride, module, mp_policy)
    source: Any  # the codec, or the local tensor's class: what builds the unsharded parameter


def hooks_of(local: torch.Tensor, codec: Any, fqn: str | Callable[[], str]) -> Optional[Hooks]:
    """The hooks for local shard ``local``: its own methods, else the codec's, else None (plain)."""
    pre, post = getattr(local, _PRE, None), getattr(local, _POST, None)
    if pre is None and post is None:
        if codec is None:
            return None
        pre_fn, post_fn = codec.pre_all_gather, codec.post_all_gather
        return Hooks(functools.partial(pre_fn, local), functools.partial(post_fn, local), True, codec)
    return _checked(pre, post, local, fqn, _arity(pre) if pre is not None else 0)


@dataclass(frozen=True)
class InstanceMethods:
    """Extension methods set on a local tensor, bound to it (``fn.__get__(local)``), kept as their
    functions for the traced path (`bound_functions`, read outside the trace), which binds them to
    the traced shard."""

    pre: Callable[..., Any]
    post: Callable[..., Any]
    arity: int  # the pre hook's parameters after self, as eager counts them (`_arity`)


def bound_functions(local: torch.Tensor) -> Optional[InstanceMethods]:
    """The functions of the extension methods set on ``local``, when both are bound to it."""
    pre, post = (local.__dict__.get(name) for name in EXTENSION_METHODS)
    if getattr(pre, "__self__", None) is local and getattr(post, "__self__", None) is local:
        return InstanceMethods(pre.__func__, post.__func__, _arity(pre))  # type: ignore[union-attr]
    return None


def class_hooks(
    local: torch.Tensor, codec: Any, fqn: Callable[[], str], instance: Optional[InstanceMethods] = None
) -> Optional[Hooks]:
    """`hooks_of` as the traced path reads it: the methods set on the instance (``instance``, found
    by `bound_functions` outside the trace: dynamo sees only a traced tensor's class), else those
    of the local tensor's *class*, bound to ``local``, else the codec's. ``fqn`` gives the
    parameter's path, called only for a message (the traced path spares reading it)."""
    if instance is not None:
        pre, post = functools.partial(instance.pre, local), functools.partial(instance.post, local)
        return replace(_checked(pre, post, local, fqn, instance.arity), source=instance)
    cls = type(local)
    if not (hasattr(cls, _PRE) or hasattr(cls, _POST)):  # (dynamo: getattr's default is not heeded)
        return hooks_of(local, codec, fqn) if codec is not None else None
    pre, post = getattr(cls, _PRE, None), getattr(cls, _POST, None)
    if pre is None or post is None:
        return _checked(pre, post, local, fqn, 0)  # raises: one of the two is missing
    code = getattr(pre, "__code__", None)  # (no inspect in a trace): the parameters after self
    arity = code.co_argcount - 1 if code is not None else _arity(functools.partial(pre, local))
    return _checked(functools.partial(pre, local), functools.partial(post, local), local, fqn, arity)


def rebind(hooks: Hooks, local: torch.Tensor) -> Hooks:
    """``hooks`` (a codec's or a class's) called on ``local`` instead: the traced shard."""
    src = hooks.source
    if isinstance(src, InstanceMethods):
        pre, post = src.pre, src.post
    elif isinstance(src, type):
        pre, post = getattr(src, _PRE), getattr(src, _POST)
    else:
        pre, post = src.pre_all_gather, src.post_all_gather
    return Hooks(functools.partial(pre, local), functools.partial(post, local), hooks.full_signature, src)


def instance_methods(local: torch.Tensor) -> bool:
    """Whether extension methods were set on the tensor instance (not its class)."""
    for name in EXTENSION_METHODS:
        if name in getattr(local, "__dict__", {}):
            return True
    return False


def _arity(pre: Callable[..., Any]) -> int:
    key = getattr(pre, "__func__", pre)
    try:
        return _ARITY[key]
    except (KeyError, TypeError):  # not seen yet, or not weak-referenceable (a builtin)
        arity = len(inspect.signature(pre).parameters)
        with contextlib.suppress(TypeError):
            _ARITY[key] = arity
        return arity


def _checked(pre: Any, post: Any, local: torch.Tensor, fqn: str | Callable[[], str], arity: int) -> Hooks:
    if pre is not None and post is not None and arity in (1, 5):
        return Hooks(pre, post, arity == 5, type(local))
    fqn = fqn if isinstance(fqn, str) else fqn()  # (the path, read only for the message)
    if pre is None or post is None:
        raise TypeError(
            f"parameter {fqn}: its local tensor ({type(local).__name__}) defines {_PRE if pre else _POST} "
            f"but not {_POST if pre else _PRE}. An all-gather extension needs both: one chooses what is "
            "gathered, the other rebuilds the unsharded parameter from it. Fix: define the missing method "
            "(PyTorch's signatures)."
        )
    raise TypeError(
        f"parameter {fqn}: {type(local).__name__}.{_PRE}{inspect.signature(pre)} has {arity} parameters; "
        f"fully_shard calls it as {_PRE}(mesh) or {_PRE}(mesh, outer_size, outer_stride, module, "
        "mp_policy). Fix: use one of these two signatures."
    )


@dataclass(eq=False)
class ExtensionState:
    """What one parameter's extension keeps from the pre hook to the frees."""

    hooks: Optional[Hooks] = None  # those of the all-gather in progress
    source: Any = None  # `Hooks.source` of the extension that built the unsharded parameter
    sizes: list[torch.Size] = field(default_factory=list)
    dtypes: list[torch.dtype] = field(default_factory=list)
    metadata: Any = None
    outputs: list[torch.Tensor] = field(default_factory=list)
    to_free: tuple[torch.Tensor, ...] = ()

    def row_bytes(self) -> int:
        """Bytes this parameter puts in each rank's row (exact once it has been gathered)."""
        return sum(s.numel() * d.itemsize for s, d in zip(self.sizes, self.dtypes))

    def inputs(
        self, hooks: Hooks, pre_args: tuple[Any, ...], local_rows: int, rows: int, fqn: str
    ) -> list[torch.Tensor]:
        """Call the pre hook with ``(mesh, outer_size, outer_stride, module, mp_policy)`` (or the mesh
        alone) and check, padding where allowed, what it returned."""
        returned = hooks.pre(*pre_args) if hooks.full_signature else hooks.pre(pre_args[0])
        inputs, self.metadata = _unpack(returned, fqn)
        out = [_pad_rows(t, local_rows, rows, fqn) for t in inputs]
        self.hooks = hooks
        self.sizes = [t.shape for t in out]
        self.dtypes = [t.dtype for t in out]
        return out

    def alloc_outputs(self, world: int, device: torch.device) -> list[torch.Tensor]:
        """The outputs with their memory back, as ``(world, bytes per rank)`` views."""
        numels = [world * s.numel() for s in self.sizes]
        same = len(self.outputs) == len(numels) and all(
            o.numel() == n and o.dtype == d for o, n, d in zip(self.outputs, numels, self.dtypes)
        )
        if not same:  # first gather, or the extension changed what it sends
            self.outputs = [torch.empty(n, dtype=d, device=device) for n, d in zip(numels, self.dtypes)]
        for o in self.outputs:
            _alloc(o)
        return [o.view(torch.uint8).view(world, -1) for o in self.outputs]

    def unflattened_outputs(self) -> tuple[torch.Tensor, ...]:
        return tuple(o.view(-1, *s[1:]) for o, s in zip(self.outputs, self.sizes))

    def rebuild_first(self, param_dtype: torch.dtype, fqn: str) -> torch.Tensor:
        """First all-gather: the post hook builds the unsharded tensor."""
        assert self.hooks is not None
        returned = self.hooks.post(self.unflattened_outputs(), self.metadata, param_dtype)
        if not (
            isinstance(returned, (tuple, list))
            and len(returned) == 2
            and isinstance(returned[0], torch.Tensor)
        ):
            raise TypeError(
                f"parameter {fqn}: {_POST} (called without out=) returned {type(returned).__name__}; it must "
                "return (unsharded_tensor, tensors_to_free). Fix: return the rebuilt tensor and the tensors "
                "whose memory fully_shard may free at reshard."
            )
        self.to_free = tuple(returned[1])
        return returned[0]

    def rebuild_into(self, out: torch.Tensor, param_dtype: torch.dtype) -> None:
        """Later all-gathers: give ``to_free`` its memory back, then rebuild in place."""
        assert self.hooks is not None
        for t in self.to_free:
            _alloc(t)
        self.hooks.post(self.unflattened_outputs(), self.metadata, param_dtype, out=out)

    def gathered_rows(self, first: int, count: int, world: int) -> list[torch.Tensor]:
        """Shard-world rows ``[first, first + count)`` of each output, as bytes."""
        return [o.view(torch.uint8).view(world, -1)[first : first + count].reshape(-1) for o in self.outputs]

    def free(self) -> None:
        for t in (*self.outputs, *self.to_free):
            t.untyped_storage().resize_(0)


def _unpack(returned: Any, fqn: str) -> tuple[Sequence[torch.Tensor], Any]:
    if isinstance(returned, (tuple, list)) and len(returned) == 2:
        inputs, metadata = returned
        if isinstance(inputs, torch.Tensor):
            inputs = (inputs,)
        if isinstance(inputs, (tuple, list)) and inputs and all(isinstance(t, torch.Tensor) for t in inputs):
            return inputs, metadata
    raise TypeError(
        f"parameter {fqn}: {_PRE} returned {type(returned).__name__}; it must return (inputs, metadata) with "
        "inputs a non-empty tuple of tensors. Fix: return e.g. ((data, scales), None)."
    )


def _pad_rows(t: torch.Tensor, local_rows: int, rows: int, fqn: str) -> torch.Tensor:
    if local_rows == rows or t.ndim == 0 or t.shape[0] == rows:
        return t
    if t.shape[0] == local_rows:  # this rank's rows only: pad to what every rank sends
        padded = t.new_zeros((rows, *t.shape[1:]))
        padded[:local_rows].copy_(t)
        return padded
    raise ValueError(
        f"parameter {fqn}: {_PRE} returned an input of shape {tuple(t.shape)} on a rank holding {local_rows} "
        f"of {rows} padded rows. Every rank must send the same sizes, so each input's dim 0 must be the "
        f"padded row count {rows} (or this rank's {local_rows}, which fully_shard pads). Fix: return inputs "
        f"with {rows} rows."
    )


def _alloc(t: torch.Tensor) -> None:
    nbytes = (t.storage_offset() + t.numel()) * t.element_size()
    storage = t.untyped_storage()
    if storage.size() < nbytes:
        storage.resize_(nbytes)
