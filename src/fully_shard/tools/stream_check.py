"""The accelerator path's stream discipline, checked on CPU (``fully_shard.tools.stream_check``).

    with stream_check.checked() as checker:   # before the model's first forward
        train_step(model)                     # raises StreamHazards at exit if any was found

Inside, a `CommContext` made for a CPU mesh runs the accelerator branch (side streams, events,
waits, buffers dropped without ``record_stream``) with stand-in streams and events, the
collectives blocking so values stay right. A dispatch mode records which storages every op reads
and writes on which stream; PyTorch's CUDA sanitizer analysis (``torch.cuda._sanitizer``, vector
clocks over stream waits and event records) reports an access not ordered after the write before
it (or a write not ordered after the reads), and, what it does not check, a storage freed on the
host while another stream's access is not ordered before the next allocation on its own stream,
where the caching allocator may hand it out again. A model first run inside keeps its stand-ins.
"""

from __future__ import annotations

import collections
import contextlib
import itertools
import traceback
import weakref
from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any

import torch
from torch.cuda import _sanitizer as csan
from torch.distributed.tensor import DTensor
from torch.utils import _pytree as pytree
from torch.utils._python_dispatch import TorchDispatchMode

from ..runtime import comm

__all__ = ["Hazard", "StreamChecker", "StreamHazards", "checked"]

# c10d ops carry no alias annotations: these arguments are what they write.
_COLLECTIVE_OUTPUTS = {"output_tensor", "outputs", "output_tensors", "tensors"}


@dataclass(frozen=True)
class Hazard:
    """One unordered pair of accesses: ``op`` on ``stream`` against ``other_op`` on ``other_stream``."""

    kind: str  # "unordered access" or "freed while in use"
    op: str
    stream: str
    other_op: str
    other_stream: str
    where: str  # the innermost fully_shard frame of ``op`` (or of the free)

    def __str__(self) -> str:
        if self.kind == "unordered access":
            return (
                f"{self.op} on stream '{self.stream}' ({self.where}) is not ordered after {self.other_op} on "
                f"stream '{self.other_stream}' on the same buffer: a wait_event/wait_stream is missing"
            )
        return (
            f"a buffer freed at {self.where} may be handed out again on stream '{self.stream}' while "
            f"{self.other_op} on stream '{self.other_stream}' may still use it: keep it alive until "
            f"stream '{self.stream}' waits for '{self.other_stream}'"
        )


class StreamHazards(RuntimeError):
    def __init__(self, hazards: list[Hazard]) -> None:
        self.hazards = hazards
        super().__init__(f"{len(hazards)} stream hazard(s):\n" + "\n".join(f"  {h}" for h in hazards))


class _Stream:
    """A stand-in ``torch.Stream``: waits and event records go to the checker."""

    def __init__(self, checker: StreamChecker, name: str, sid: int) -> None:
        self.checker, self.name, self.id = checker, name, sid
        checker.names[sid] = name
        if sid != csan.DEFAULT_STREAM_ID:
            checker.events._handle_stream_creation(sid)

    def wait_event(self, event: _Event) -> None:
        self.checker.events._handle_event_wait(event.id, self.id)

    def wait_stream(self, other: _Stream) -> None:
        self.wait_event(other.record_event())

    def record_event(self, event: _Event | None = None) -> _Event:
        event = event or _Event(self.checker)
        event.record(self)
        return event

    def synchronize(self) -> None:
        self.checker.events._handle_stream_synchronization(self.id)

    def __enter__(self) -> _Stream:
        self.checker.stack.append(self)
        return self

    def __exit__(self, *exc: object) -> None:
        self.checker.stack.pop()


class _Event(torch.Event):
    """A stand-in ``torch.Event`` (a subclass, so ``set_post_optim_event`` takes it)."""

    def __new__(cls, checker: StreamChecker) -> _Event:
        return super().__new__(cls, device="cpu")

    def __init__(self, checker: StreamChecker) -> None:
        self.checker, self.id = checker, next(checker.ids)
        checker.events._handle_event_creation(self.id)

    def record(self, stream: _Stream | None = None) -> None:
        self.checker.events._handle_event_record(self.id, (stream or self.checker.current).id)

    def wait(self, stream: _Stream | None = None) -> None:
        (stream or self.checker.current).wait_event(self)

    def synchronize(self) -> None:
        self.checker.events._handle_event_synchronization(self.id)

    def query(self) -> bool:
        return True


class _Streams:
    """What `CommContext` asks for (`comm.DeviceStreams`' methods), answered with stand-ins."""

    def __init__(self, checker: StreamChecker) -> None:
        self.checker = checker

    def new_stream(self, name: str) -> _Stream:
        return _Stream(self.checker, name, next(self.checker.ids))

    def current(self) -> _Stream:
        return self.checker.current


@dataclass
class _Block:
    """A storage the checker has seen: its data pointer now and the stream it was allocated on."""

    key: int
    stream: int | None  # None: allocated where the checker did not see it (before it, or inside a collective)


class _Args(csan.ArgumentHandler):
    """CSAN's argument handler for CPU tensors, keyed by storage (views share their buffer's
    accesses); a DTensor counts as its local tensor."""

    def __init__(self, checker: StreamChecker) -> None:
        super().__init__()
        self.checker = checker

    def _handle_argument(
        self, value: Any, is_write: bool, metadata_only: bool, name: Any = None, is_output: bool = False
    ) -> None:
        if isinstance(value, DTensor):
            value = value._local_tensor
        if not isinstance(value, torch.Tensor) or value.is_meta or value.layout != torch.strided:
            return
        key = self.checker.block(value, fresh=is_output and not metadata_only)
        if key is None:
            return
        if is_write:
            self.dataptrs_written.add(key)
        elif not metadata_only:
            self.dataptrs_read.add(key)
        self.tensor_aliases.setdefault(key, [])
        if name is not None:
            self.tensor_aliases[key].append(name)
        if is_output:
            self.outputs.add(key)


class _Mode(TorchDispatchMode):
    def __init__(self, checker: StreamChecker) -> None:
        super().__init__()
        self.checker = checker

    def __torch_dispatch__(self, func: Any, types: Any, args: tuple = (), kwargs: Any = None) -> Any:
        kwargs = kwargs or {}
        checker, schema = self.checker, func._schema
        factory = bool(csan.FACTORY_FUNCTION_REGEX.match(schema.name))
        handler = _Args(checker)
        handler.parse_inputs(schema, args, kwargs, is_factory=factory)
        if func.namespace == "c10d":
            for argument, value in csan.zip_arguments(schema, args, kwargs):
                if argument.name in _COLLECTIVE_OUTPUTS:
                    pytree.tree_map_(lambda v: handler._handle_argument(v, True, False, argument.name), value)
        out = func(*args, **kwargs)
        handler.parse_outputs(schema, out, is_factory=factory)
        checker.launch(handler, schema)
        if func is torch.ops.aten._local_scalar_dense.default:  # .item(): the host waits for the stream
            checker.current.synchronize()
        return out


class StreamChecker:
    """The stand-in streams, the happens-before state (CSAN's `EventHandler`) and what was found."""

    def __init__(self) -> None:
        self.events = csan.EventHandler()
        self.ids = itertools.count(1)
        self.names: dict[int, str] = {}
        self.stack: list[_Stream] = [_Stream(self, "compute", csan.DEFAULT_STREAM_ID)]
        self.hazards: list[Hazard] = []
        self.blocks: dict[int, _Block] = {}  # by storage (its `_cdata`, stable across resize_)
        self.freed: list[
            tuple[_Block, list[csan.Access], str]
        ] = []  # waiting on their stream's next allocation
        self.new_on: set[int] = set()  # streams that allocated during the op being recorded
        self.launches: collections.Counter[str] = collections.Counter()  # ops recorded, by stream name

    @property
    def current(self) -> _Stream:
        return self.stack[-1]

    def streams_for(self, device: torch.device) -> _Streams:
        return _Streams(self)

    def name(self, sid: int) -> str:
        return self.names.get(sid, str(sid))

    def block(self, t: torch.Tensor, fresh: bool) -> int | None:
        """The access key of ``t``'s storage; a storage not seen before was allocated now on the
        current stream (``fresh``: an op's new output), or where the checker did not see it (before
        it, or inside a collective: gloo's staging copies, which NCCL does not make)."""
        storage = t.untyped_storage()
        if storage.nbytes() == 0:
            return None
        cdata, key = storage._cdata, storage.data_ptr()
        known = self.blocks.get(cdata)
        if known is not None and known.key == key:
            return key
        stream = self.current.id if fresh else None
        self.blocks[cdata] = _Block(key, stream)
        if known is None:
            weakref.finalize(storage, self._storage_died, cdata)
        if stream is not None:
            self.new_on.add(stream)
        return key

    def launch(self, handler: _Args, schema: Any) -> None:
        stream = self.current.id
        self.launches[self.name(stream)] += 1
        errors = self.events._handle_kernel_launch(
            stream,
            handler.dataptrs_read - handler.dataptrs_written,
            handler.dataptrs_written,
            handler.outputs,
            schema,
            handler.tensor_aliases,
        )
        for e in errors:
            assert isinstance(e, csan.UnsynchronizedAccessError)
            now, before = e.current_access, e.previous_access
            self.hazards.append(
                Hazard(
                    "unordered access",
                    str(now.operator.name),
                    self.name(now.stream),
                    str(before.operator.name),
                    self.name(before.stream),
                    _where(now.stack_trace),
                )
            )
        if self.new_on:
            for sid in self.new_on:
                self._allocated_on(sid)
            self.new_on.clear()

    def free(self, block: _Block) -> None:
        """The host freed ``block``: its accesses on other streams must be ordered before the next
        allocation on its own stream."""
        info = self.events.tensors_accessed.accesses.get(block.key)
        if info is None:
            return
        if block.stream is None:  # not allocated on any stream the checker knows
            self.events._handle_memory_deallocation(block.key)
            return
        accesses = [a for a in [info.write, *info.reads] if a is not None and a.stream != block.stream]
        late = [
            a for a in accesses if not self.events.syncs.is_ordered_after(block.stream, a.seq_num, a.stream)
        ]
        if late:
            here = traceback.StackSummary.extract(traceback.walk_stack(None), lookup_lines=False)
            here.reverse()
            self.freed.append((block, late, _where(here)))
        self.events._handle_memory_deallocation(block.key)

    def _allocated_on(self, sid: int) -> None:
        still = []
        for block, late, where in self.freed:
            if block.stream != sid:
                still.append((block, late, where))
                continue
            for a in late:
                if not self.events.syncs.is_ordered_after(sid, a.seq_num, a.stream):
                    self.hazards.append(
                        Hazard(
                            "freed while in use",
                            "",
                            self.name(sid),
                            str(a.operator.name),
                            self.name(a.stream),
                            where,
                        )
                    )
                    break
        self.freed = still

    def _storage_died(self, cdata: int) -> None:
        block = self.blocks.pop(cdata, None)
        if block is not None:
            self.free(block)

    def resized(self, storage: torch.UntypedStorage, old_key: int, old_nbytes: int) -> None:
        """``storage.resize_()``: a free of the old buffer and an allocation on the current stream."""
        block = self.blocks.get(storage._cdata)
        if block is not None and old_nbytes:
            self.free(_Block(old_key, block.stream))
        if storage.nbytes():
            self.blocks[storage._cdata] = _Block(storage.data_ptr(), self.current.id)
            if block is None:
                weakref.finalize(storage, self._storage_died, storage._cdata)
            self._allocated_on(self.current.id)
        elif block is not None:
            block.key = 0


def _where(stack: traceback.StackSummary | None) -> str:
    """The innermost frame in fully_shard's runtime (not this file), as ``file:line in function``."""
    for frame in reversed(stack or []):
        name = frame.filename.replace("\\", "/")
        if "/fully_shard/" in name and "/tools/stream_check" not in name:
            return f"{name.split('/fully_shard/')[-1]}:{frame.lineno} in {frame.name}"
    return "outside fully_shard"


@contextlib.contextmanager
def checked(raise_on_exit: bool = True) -> Iterator[StreamChecker]:
    """Run the body with stand-in streams for CPU meshes, every op recorded; at exit raise
    `StreamHazards` listing what was found (or leave it in ``checker.hazards``)."""
    checker = StreamChecker()
    original = torch.UntypedStorage.__dict__.get("resize_")

    def resize_(storage: torch.UntypedStorage, size: int) -> Any:
        old_key, old_nbytes = storage.data_ptr(), storage.nbytes()
        out = torch._C.StorageBase.resize_(storage, size)
        checker.resized(storage, old_key, old_nbytes)
        return out

    comm.set_cpu_streams(checker.streams_for)
    torch.UntypedStorage.resize_ = resize_  # type: ignore[method-assign]
    try:
        with _Mode(checker):
            yield checker
    finally:
        comm.set_cpu_streams(None)
        if original is None:
            del torch.UntypedStorage.resize_
        else:
            torch.UntypedStorage.resize_ = original  # type: ignore[method-assign]
    if raise_on_exit and checker.hazards:
        raise StreamHazards(checker.hazards)
