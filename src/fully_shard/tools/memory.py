"""Live tensor bytes on one rank as the step runs, the same counter for a simulated (meta) step and
a real one. A storage counts from creation until it dies (a weak reference) or is resized
(``UntypedStorage.resize_``, how the engine frees unsharded parameters, is wrapped while counting).
Host memory (``CPUOffloadPolicy``) is counted apart: storages tracked as the host's, those made
under `runtime.host.allocating`, and what ops make from host storages only. Wrapper subclasses count
by their inner tensors; sparse tensors not at all. The engine's release thread frees too: a lock.
"""

from __future__ import annotations

import functools
import threading
import weakref
from dataclasses import dataclass, field
from typing import Any, Callable, Iterable, Optional

import torch
from torch.distributed.tensor import DTensor
from torch.utils._python_dispatch import TorchDispatchMode, is_traceable_wrapper_subclass
from torch.utils._pytree import tree_flatten, tree_map_only

from ..layouts.mesh import default_device_type
from ..runtime.host import is_allocating

CATEGORIES = (
    "sharded_params",
    "gradients",
    "optimizer_state",
    "unsharded_params",
    "communication",
    "buffers",
    "activations",
)

_RESIZES = (torch.ops.aten.resize_.default, torch.ops.aten.resize_as_.default)


@dataclass
class Snapshot:
    """Live bytes at one point of the step, by category (device), and on the host."""

    label: str
    total: int
    by_category: dict[str, int] = field(default_factory=dict)
    host: int = 0


def _local(t: torch.Tensor) -> torch.Tensor:
    return t._local_tensor if isinstance(t, DTensor) else t  # type: ignore[attr-defined]


class LiveBytes(TorchDispatchMode):
    """Counts live storages on ``device_type`` (see the module docstring)."""

    def __init__(self, device_type: str, categories: Optional[Callable[[], dict[int, str]]] = None) -> None:
        super().__init__()
        self.device_type = device_type
        self.categories = categories
        self.sizes: dict[int, int] = {}  # device storages
        self.host_sizes: dict[int, int] = {}
        self._refs: dict[int, Any] = {}
        self.current = 0
        self.peak = 0
        self.host_current = 0
        self.host_peak = 0
        self.timeline: list[Snapshot] = []
        self._orig_resize: Any = None
        # Reentrant: a garbage collection inside a counted block may free a storage (_freed).
        self._lock = threading.RLock()

    def track(self, tensors: Iterable[Any], host: bool = False) -> None:
        """Count tensors that exist already (parameters, optimizer state); ``host=True``: as the host's."""
        for t in tensors:
            if isinstance(t, torch.Tensor):
                self._add(t, host)

    def _add(self, t: torch.Tensor, host: bool = False) -> None:
        t = _local(t)
        if type(t) not in (torch.Tensor, torch.nn.Parameter):
            if is_traceable_wrapper_subclass(t):  # its storage is empty: count what it wraps
                for name in t.__tensor_flatten__()[0]:
                    self._add(getattr(t, name), host)
            return
        if t.layout != torch.strided:
            return  # sparse or other layouts: no storage of their own to count
        # Host bytes live on the CPU (meta when simulating): a copy of a host tensor to the
        # accelerator is device memory, whatever its inputs.
        host = host and t.device.type == ("meta" if self.device_type == "meta" else "cpu")
        if t.device.type not in (self.device_type, "cpu") or (t.device.type != self.device_type and not host):
            return  # another device (or CPU memory that is not this run's host)
        storage = t.untyped_storage()
        key = storage._cdata
        if key in self.sizes or key in self.host_sizes:
            return
        nbytes = storage.nbytes()
        with self._lock:
            self._refs[key] = weakref.ref(storage, functools.partial(self._freed, key))
            self._set(key, nbytes, host)

    def _set(self, key: int, nbytes: int, host: bool) -> None:
        """A storage's new size (0 before it was counted); the caller holds the lock."""
        if host:
            self.host_current += nbytes - self.host_sizes.get(key, 0)
            self.host_sizes[key] = nbytes
            self.host_peak = max(self.host_peak, self.host_current)
        else:
            self.current += nbytes - self.sizes.get(key, 0)
            self.sizes[key] = nbytes
            self.peak = max(self.peak, self.current)

    def _freed(self, key: int, _ref: Any) -> None:
        with self._lock:
            self.current -= self.sizes.pop(key, 0)
            self.host_current -= self.host_sizes.pop(key, 0)
            self._refs.pop(key, None)

    def _resized(self, storage: torch.UntypedStorage, nbytes: int) -> None:
        key = storage._cdata
        with self._lock:
            if key in self.sizes or key in self.host_sizes:
                self._set(key, nbytes, key not in self.sizes)

    def _from_host(self, args: Any, kwargs: Any) -> bool:
        """Whether an op's outputs may be the host's: the engine allocates for the host, or every
        input with storage is a host storage (and there is one)."""
        if is_allocating():
            return True
        if not self.host_sizes:
            return False
        seen = False
        for t in tree_flatten((args, kwargs))[0]:
            if not isinstance(t, torch.Tensor):
                continue
            local = _local(t)
            if local.layout != torch.strided or type(local) not in (torch.Tensor, torch.nn.Parameter):
                return False  # sparse, nested or another subclass: not the engine's
            storage = local.untyped_storage()
            if storage._cdata in self.host_sizes:
                seen = True
            elif storage.nbytes() > 0:
                return False
        return seen

    def __torch_dispatch__(self, func: Any, types: Any, args: Any = (), kwargs: Any = None) -> Any:
        host = self._from_host(args, kwargs)
        out = func(*args, **(kwargs or {}))
        if func in _RESIZES and type(args[0]) in (torch.Tensor, torch.nn.Parameter):
            storage = args[0].untyped_storage()
            self._resized(storage, storage.nbytes())
        tree_map_only(torch.Tensor, functools.partial(self._add, host=host), out)
        return out

    def __enter__(self) -> "LiveBytes":
        if self._orig_resize is not None:
            raise RuntimeError("LiveBytes is already counting; enter it once at a time.")
        result = super().__enter__()
        self._orig_resize = orig = torch.UntypedStorage.resize_
        counter = self

        @functools.wraps(orig)
        def resize_(storage: torch.UntypedStorage, size: int) -> Any:
            out = orig(storage, size)
            counter._resized(storage, size)
            return out

        torch.UntypedStorage.resize_ = resize_  # type: ignore[method-assign]
        return result

    def __exit__(self, *exc: Any) -> Any:
        torch.UntypedStorage.resize_ = self._orig_resize  # type: ignore[method-assign]
        self._orig_resize = None
        return super().__exit__(*exc)

    def snapshot(self, label: str, staging: int = 0) -> None:
        """Live bytes now by category; ``staging``: bytes a collective backend holds besides (counted
        as "communication", in the peak too)."""
        known = self.categories() if self.categories is not None else {}
        split = dict.fromkeys(CATEGORIES, 0)
        with self._lock:
            sizes, total, host = list(self.sizes.items()), self.current + staging, self.host_current
            self.peak = max(self.peak, total)
        for key, nbytes in sizes:
            split[known.get(key, "activations")] += nbytes
        split["communication"] += staging
        self.timeline.append(Snapshot(label, total, split, host))


def track_model(counter: LiveBytes, states: list[Any], optimizers: list[torch.optim.Optimizer]) -> None:
    """Count what exists before counting starts: these states' parameters, buffers and gradients and
    the optimizers' state; offloaded shards, their gradients and optimizer state as the host's."""
    offloaded = [p.sharded_param for s in states for g in s.own for p in g.params if p.offload]
    host_ids = {id(p) for p in offloaded}
    params = {id(p): p for s in states for m in s.modules for p in m.parameters()}
    counter.track(offloaded, host=True)
    counter.track((p.grad for p in offloaded), host=True)
    counter.track(p for i, p in params.items() if i not in host_ids)
    counter.track(b for s in states for m in s.modules for b in m.buffers())
    counter.track(p.grad for i, p in params.items() if i not in host_ids)
    for opt in optimizers:  # state from earlier steps (or a checkpoint) is live from the start
        for param, entry in opt.state.items():
            if id(param) in params:
                counter.track(entry.values(), host=id(param) in host_ids)


class TraceMemory:
    """Live bytes over a traced run (``debug.trace(memory=True)``): a `LiveBytes` counter that learns
    each root's model when it first works under the trace, snapshotted at every collective."""

    def __init__(self, optimizers: Iterable[torch.optim.Optimizer] = ()) -> None:
        self.optimizers = list(optimizers)
        # (op, bytes) -> bytes the collective backend stages while it runs (`plan.staging`); none by default
        self.staging: Optional[Callable[[str, int], int]] = None
        self.states: list[Any] = []
        self.mesh_shape: tuple[int, ...] = ()
        self.counter = LiveBytes(
            default_device_type(), lambda: engine_categories(self.states, self.optimizers)
        )

    def attach(self, states: list[Any]) -> None:
        new = [s for s in states if all(s is not known for known in self.states)]
        if not new:
            return
        if not self.states:  # the first root decides the device (meta in a simulation)
            info = new[0].root_context().root.info
            self.counter.device_type = info.device.type
            self.mesh_shape = tuple(info.mesh.shape)
        self.states += new
        track_model(self.counter, new, self.optimizers)

    def snapshot(self, label: str, op: str = "", nbytes: int = 0) -> None:
        """Live bytes now; at a collective (``op`` of ``nbytes``), with what the backend stages."""
        staged = self.staging(op, nbytes) if self.staging is not None and op else 0
        self.counter.snapshot(label, staged)

    def new_step(self) -> None:
        """Forget the timeline and peaks so far (a step's own)."""
        self.counter.timeline.clear()
        self.counter.peak, self.counter.host_peak = self.counter.current, self.counter.host_current


def engine_categories(states: list[Any], optimizers: list[torch.optim.Optimizer]) -> dict[int, str]:
    """Storage -> category of what these `FSDPState` s hold (`FSDPState.live_buffers`) and of the
    optimizers' state."""
    out: dict[int, str] = {}

    def put(t: Any, category: str) -> None:
        if isinstance(t, torch.Tensor):
            storage = _local(t).untyped_storage()
            if storage.nbytes() > 0:
                out.setdefault(storage._cdata, category)

    for opt in optimizers:
        for entry in opt.state.values():
            for v in entry.values():
                put(v, "optimizer_state")
    for state in states:
        for category, t in state.live_buffers():
            put(t, category)
    return out
