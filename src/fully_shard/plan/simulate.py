"""``simulate``: run one training step of *our own runtime* for one rank of a world of any size,
on one CPU, without real memory: the model is built on the meta device, the process group is
PyTorch's fake one (collectives return at once), and every buffer the engine makes is a meta
tensor. What comes back is the schedule that will run: each collective (as `fully_shard.debug`
traces it) and this rank's live tensor bytes over the step (`memory.LiveBytes`).
"""

from __future__ import annotations

import contextlib
import math
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, Callable, Iterator, Optional, Sequence, Union

import torch
import torch.distributed as dist
import torch.nn as nn
from torch.utils._pytree import tree_map_only

from ..api.module import engine_state
from ..debug import CollectiveRecord, trace
from ..layouts.mesh import SIMULATING
from .attention import FusedAttentionOnMeta
from .staging import staging
from ..tools.memory import Snapshot, _local

if TYPE_CHECKING:
    from .timing import StepTime

GiB = 2**30
MAX_RANKS = 2**20  # a fake world's mesh holds one int64 per rank


class BuilderError(RuntimeError):
    """The user's ``build_model`` raised (the cause is chained)."""


@dataclass
class Plan:
    """One rank's view of a simulated step (the last of ``steps``)."""

    mesh_shape: tuple[int, ...]
    peak_bytes: int  # the most live device tensor bytes after any op of the step
    timeline: list[Snapshot]  # live bytes by category at each collective and phase boundary
    collectives: list[CollectiveRecord]  # every collective of the step, in issue order
    parameters: int = 0  # parameters of the model (elements)
    module_params: dict[str, int] = field(
        default_factory=dict
    )  # per fully_shard call ("" = the root): elements
    tokens: int = 0  # tokens in one rank's batch (for the time estimate)
    host_peak_bytes: int = 0  # the most host bytes (offloaded shards, gradients, optimizer state)
    # CPUOffloadPolicy: per fully_shard call, the bytes of this rank's offloaded (padded) shards,
    # copied to the device before each all-gather and (as gradients) back after each reduction;
    # and the elements the optimizer steps on the host.
    module_offload_bytes: dict[str, int] = field(default_factory=dict)
    offloaded_elements: int = 0
    device_elements: int = 0  # this rank's sharded elements the optimizer steps on the device

    def estimate(
        self,
        cluster: Any = "h100-nvlink-ib400-bf16",
        tokens: Optional[int] = None,
        flops: Optional[float] = None,
    ) -> "StepTime":
        """Step time on ``cluster`` (a `timing.Cluster` or a preset name), see `timing.estimate`."""
        from .timing import PRESETS, estimate

        if isinstance(cluster, str):
            if cluster not in PRESETS:
                raise ValueError(
                    f"unknown cluster preset {cluster!r}; presets: {sorted(PRESETS)}, or pass a "
                    "timing.Cluster."
                )
            cluster = PRESETS[cluster]
        return estimate(self, cluster, tokens if tokens is not None else self.tokens, flops)

    @property
    def world_size(self) -> int:
        return math.prod(self.mesh_shape)

    @property
    def peak_snapshot(self) -> Snapshot:
        """The timeline point with the most live bytes (``peak_bytes`` may exceed it by the
        temporaries of one op)."""
        return max(self.timeline, key=lambda s: s.total)

    def fits(self, bytes_per_rank: int) -> bool:
        return self.peak_bytes <= bytes_per_rank

    def _count(self, op: str) -> int:
        """Collectives per step under ``op`` as `bytes_per_step` keys them (``dtensor_<op>``: DTensor's)."""
        dtensor = op.startswith("dtensor_")
        return sum(
            op in (r.op, f"dtensor_{r.op}") and dtensor == r.phase.startswith("dtensor_")
            for r in self.collectives
        )

    def bytes_per_step(self) -> dict[str, int]:
        """Bytes each kind of collective moves per step on this rank (all-gather output,
        reduce-scatter input, all-reduce buffer); DTensor's own (tensor parallel) under
        ``dtensor_<op>``."""
        out: dict[str, int] = {}
        for r in self.collectives:
            key = f"dtensor_{r.op}" if r.phase.startswith("dtensor_") else r.op
            out[key] = out.get(key, 0) + r.nbytes
        return out

    def summary(self) -> str:
        peak = self.peak_snapshot
        lines = [
            f"world {self.world_size} (mesh {self.mesh_shape}), {self.parameters / 1e9:.3f} B parameters",
            f"peak live tensor memory per rank: {self.peak_bytes / GiB:.3f} GiB"
            + (f" (and {self.host_peak_bytes / GiB:.3f} GiB on the host)" if self.host_peak_bytes else ""),
            f"  at '{peak.label}': "
            + ", ".join(f"{k} {v / GiB:.3f}" for k, v in peak.by_category.items() if v),
            "collectives per step: "
            + ", ".join(
                f"{op} x{self._count(op)} ({n / GiB:.3f} GiB)" for op, n in self.bytes_per_step().items()
            ),
        ]
        return "\n".join(lines)


def default_shard_fn(
    model: nn.Module,
    mesh: Any,
    mp_policy: Any = None,
    reshard_after_forward: Any = None,
    offload_policy: Any = None,
    bucket_bytes: Optional[int] = None,
) -> None:
    """Every block (the children of the outermost ``nn.ModuleList`` holding the most parameters,
    e.g. ``model.layers``; for an ``nn.Sequential`` without one, each child with parameters), then
    the root, with these ``fully_shard`` settings (and the root's ``set_bucket_bytes``, when given)."""
    from ..api.sharding import fully_shard
    from ..layouts.policy import MixedPrecisionPolicy

    kwargs = {
        "mesh": mesh,
        "mp_policy": mp_policy or MixedPrecisionPolicy(),
        "reshard_after_forward": reshard_after_forward,
        "offload_policy": offload_policy,
    }
    lists = [m for m in model.modules() if isinstance(m, nn.ModuleList)]
    nested = {
        id(inner)
        for outer in lists
        for inner in outer.modules()
        if inner is not outer and isinstance(inner, nn.ModuleList)
    }
    outer = [m for m in lists if id(m) not in nested]  # not the experts inside each layer of an MoE
    if outer:
        blocks = list(max(outer, key=lambda m: sum(p.numel() for p in m.parameters())))
    else:  # an nn.Sequential: each child that holds parameters is a block
        blocks = (
            [c for c in model.children() if any(True for _ in c.parameters())]
            if isinstance(model, nn.Sequential)
            else []
        )
    for block in blocks:
        fully_shard(block, **kwargs)
    root = fully_shard(
        model, **{**kwargs, "reshard_after_forward": None}
    )  # the root keeps its parameters for backward
    if bucket_bytes is not None:
        root.set_bucket_bytes(bucket_bytes)


def _optimizer(
    choice: Union[str, Callable, None], params: list[nn.Parameter]
) -> Optional[torch.optim.Optimizer]:
    if choice is None:
        return None
    if callable(choice):
        return choice(params)
    kinds = {"adamw": torch.optim.AdamW, "adam": torch.optim.Adam, "sgd": torch.optim.SGD}
    if choice not in kinds:
        raise ValueError(
            f"simulate(optimizer={choice!r}): use one of {sorted(kinds)}, None, or a callable params -> "
            "optimizer."
        )
    return kinds[choice](params, lr=1e-4)


def simulate(
    build_model: Callable[[], nn.Module],
    sample_inputs: Any,
    *,
    mesh_shape: Sequence[int],
    mesh_dim_names: Optional[Sequence[str]] = None,
    shard_fn: Optional[Callable[[nn.Module, Any], None]] = None,
    optimizer: Union[str, Callable, None] = "adamw",
    mp_policy: Any = None,
    steps: int = 2,
    loss_fn: Optional[Callable[[Any], torch.Tensor]] = None,
    backend: str = "nccl",
) -> Plan:
    """Plan one training step at world size ``prod(mesh_shape)`` (1-D: FSDP; 2-D: HSDP as
    ``(replicate, shard)``) as rank 0 sees it.

    ``build_model()`` is called under ``torch.device("meta")``; ``shard_fn(model, mesh)`` applies
    ``fully_shard`` (default: `default_shard_fn`, with ``mp_policy``); ``sample_inputs`` (one
    rank's batch: a tensor, a tuple of positional arguments, or a dict of keyword arguments) is
    moved to the meta device; the loss is ``loss_fn(output)`` (default: the output's sum). Runs
    ``steps`` steps and reports the last (by default the second: optimizer state exists, as in
    training). ``backend``: whose staging copies count at each collective (`staging.STAGED`). Needs
    a process without a process group (it makes a fake one and removes it after)."""
    shape = _checked_mesh(mesh_shape, mesh_dim_names, shard_fn, steps)
    staging(backend)  # an unknown backend is refused before any work
    with _fake_world(shape, mesh_dim_names) as mesh:
        model, n_params = _built_on_meta(build_model, mesh, shard_fn, mp_policy)
        opt = _optimizer(optimizer, [p for p in model.parameters() if p.requires_grad])
        with FusedAttentionOnMeta():  # attention as the devices run it (attention.py)
            inputs = tree_map_only(torch.Tensor, lambda t: t.to("meta"), sample_inputs)
            return measure(
                model,
                inputs,
                opt,
                steps=steps,
                loss_fn=loss_fn,
                mesh_shape=shape,
                parameters=n_params,
                backend=backend,
            )


def _built_on_meta(build_model: Callable[[], nn.Module], mesh: Any, shard_fn: Any, mp_policy: Any) -> tuple:
    """The model built on the meta device and sharded (by ``shard_fn``, else `default_shard_fn`),
    with its parameter count before sharding."""
    try:
        with torch.device("meta"):
            model = build_model()
    except Exception as e:
        raise BuilderError(
            f"plan.simulate: build_model() raised {type(e).__name__}: {e}. It runs under "
            "torch.device('meta') (shapes, no data: no .item(), no weights loaded). Fix the builder; try it "
            "alone with `with torch.device('meta'): build_model()`."
        ) from e
    n_params = sum(p.numel() for p in model.parameters())
    if shard_fn is None:
        default_shard_fn(model, mesh, mp_policy)
    else:
        shard_fn(model, mesh)
    return model, n_params


def _checked_mesh(
    mesh_shape: Sequence[int], names: Optional[Sequence[str]], shard_fn: Any, steps: int
) -> tuple[int, ...]:
    """``simulate``'s arguments, checked before any work; the mesh shape as ints."""
    if dist.is_initialized():
        raise RuntimeError(
            "fully_shard.plan.simulate runs on a fake process group of the planned size, and this process "
            "already has a process group. Fix: call it from a process that has not called init_process_group "
            "(e.g. the command line, or a subprocess)."
        )
    if steps < 1:
        raise ValueError(f"simulate(steps={steps}): run at least one step.")
    shape = tuple(int(n) for n in mesh_shape)
    if not shape or min(shape) < 1 or (shard_fn is None and len(shape) > 2):
        raise ValueError(
            f"simulate(mesh_shape={tuple(mesh_shape)}): sizes must be positive, and without a shard_fn the "
            "mesh is 1-D (FSDP) or 2-D (replicate, shard). Fix: for tensor-parallel (or other) dims, name "
            "them in mesh_dim_names and pass a shard_fn that slices the mesh (e.g. parallelize_module over "
            "mesh['tp'], fully_shard over mesh['dp'])."
        )
    if math.prod(shape) > MAX_RANKS:
        raise ValueError(
            f"simulate(mesh_shape={shape}): {math.prod(shape):,} ranks; the simulation holds the mesh's rank "
            f"table (8 bytes a rank) and plans up to {MAX_RANKS:,}. Fix: plan a smaller world (per-rank "
            "memory stops changing once each parameter has one row per rank)."
        )
    if names is not None and len(names) != len(shape):
        raise ValueError(f"simulate: {len(names)} mesh_dim_names for a {len(shape)}-D mesh_shape {shape}.")
    return shape


@contextlib.contextmanager
def _fake_world(shape: tuple[int, ...], names: Optional[Sequence[str]]) -> Iterator[Any]:
    """Rank 0 of PyTorch's fake process group of ``prod(shape)`` ranks, and its mesh; removed after."""
    from torch.testing._internal.distributed.fake_pg import FakeStore  # registers the "fake" backend
    from torch.distributed.device_mesh import init_device_mesh

    token = SIMULATING.set(True)
    try:
        dist.init_process_group("fake", store=FakeStore(), rank=0, world_size=math.prod(shape))
        default = ("replicate", "shard") if len(shape) == 2 else None
        yield init_device_mesh("cpu", shape, mesh_dim_names=tuple(names) if names else default)
    finally:
        try:
            if dist.is_initialized():
                dist.destroy_process_group()
        finally:
            SIMULATING.reset(token)


def measure(
    model: nn.Module,
    inputs: Any,
    optimizer: Optional[torch.optim.Optimizer],
    *,
    steps: int = 2,
    loss_fn: Optional[Callable[[Any], torch.Tensor]] = None,
    mesh_shape: Optional[Sequence[int]] = None,
    parameters: Optional[int] = None,
    backend: Optional[str] = None,
) -> Plan:
    """Run ``steps`` training steps of a sharded ``model`` on this rank's ``inputs`` (forward,
    ``loss_fn(output)`` or its sum, backward, ``optimizer`` step) and return the last one as a
    `Plan`: a real run measured exactly as `simulate` measures a simulated one (live tensor bytes
    on the model's device, the collectives it issued). ``backend``: also count that backend's staging
    copies at each collective (`staging.STAGED`; a real run's own are not seen by the counter)."""
    root = engine_state(model)
    if root is None:
        raise ValueError(
            "plan: fully_shard was not applied to the model itself (the root). Fix: end shard_fn with "
            "fully_shard(model, mesh=mesh)."
        )
    ctx = root.root_context()  # lazy init first, outside the counting modes
    with trace(dtensor=True, memory=True, optimizers=[optimizer] if optimizer is not None else []) as t:
        t.memory.staging = staging(backend) if backend is not None else None
        ctx.attach_active_observers()  # the model is counted from here
        for _ in range(steps):
            _counted_step(t.memory, model, inputs, optimizer, loss_fn)
    plan = from_trace(t, step=t.step)
    plan.parameters = parameters if parameters is not None else sum(p.numel() for p in model.parameters())
    plan.tokens = _tokens(inputs)
    if mesh_shape is not None:
        plan.mesh_shape = tuple(int(x) for x in mesh_shape)
    return plan


def _counted_step(
    memory: Any, model: nn.Module, inputs: Any, optimizer: Optional[torch.optim.Optimizer], loss_fn: Any
) -> None:
    """One training step, snapshotted at its phase boundaries (and, by the trace, at each collective)."""
    memory.new_step()
    memory.snapshot("step start")
    output = call(model, inputs)
    memory.snapshot("forward end")
    loss = loss_fn(output) if loss_fn is not None else output.float().sum()
    del output  # as training loops do (torchtitan: ``del pred``): autograd keeps what it needs
    loss.backward()
    del loss
    memory.snapshot("backward end")
    if optimizer is not None:
        optimizer.step()
        memory.snapshot("optimizer step")
        optimizer.zero_grad()
    memory.snapshot("step end")


def from_trace(t: Any, step: Optional[int] = None) -> Plan:
    """A `Plan` of a run traced with ``fully_shard.debug.trace(memory=True)``: its memory timeline
    and peaks (since the start, or since the last ``t.memory.new_step()``) and its collectives
    (those of ``step``, or all), to draw (`draw`) or price (``Plan.estimate`` with ``tokens``)."""
    if t.memory is None:
        raise ValueError(
            "plan.from_trace: this trace counted no memory. Fix: open it with "
            "fully_shard.debug.trace(memory=True, optimizers=[optimizer])."
        )
    if not t.memory.states:
        raise ValueError(
            "plan.from_trace: no fully_shard root ran inside this trace (nothing was counted). Fix: run the "
            "model's forward (or unshard()) inside the `with trace(memory=True)` block."
        )
    memory, states = t.memory, t.memory.states
    shards = {s.fqn: [p for g in s.own for p in g.params if p.offload] for s in states}
    on_device = [p for s in states for g in s.own for p in g.params if not p.offload and p.requires_grad]
    return Plan(
        memory.mesh_shape,
        memory.counter.peak,
        list(memory.counter.timeline),
        [r for r in t.records if step is None or r.step == step],
        sum(
            p.numel() for p in {id(p): p for s in states for m in s.modules for p in m.parameters()}.values()
        ),
        {s.fqn: sum(p.shape.numel() for g in s.own for p in g.params) for s in states},
        0,
        memory.counter.host_peak,
        {m: sum(_padded_shard_bytes(p) for p in ps) for m, ps in shards.items() if ps},
        sum(_local(p.sharded_param).numel() for ps in shards.values() for p in ps)
        if memory.optimizers
        else 0,
        sum(_local(p.sharded_param).numel() for p in on_device) if memory.optimizers else 0,
    )


def _padded_shard_bytes(p: Any) -> int:
    """This rank's padded shard of an `FSDPParam`, in bytes (what an all-gather sends)."""
    return p.layout.shard_numel * p.sharded_param.element_size()


def call(model: nn.Module, inputs: Any) -> Any:
    """``model`` on one batch: a dict of keyword arguments, a tuple of positional ones, or one input."""
    if isinstance(inputs, dict):
        return model(**inputs)
    if isinstance(inputs, tuple):
        return model(*inputs)
    return model(inputs)


def _tokens(inputs: Any) -> int:
    """Tokens in a batch: an integer tensor's elements (token ids), else all but the last dim."""
    first = (
        inputs
        if isinstance(inputs, torch.Tensor)
        else next(
            (
                v
                for v in (inputs.values() if isinstance(inputs, dict) else inputs)
                if isinstance(v, torch.Tensor)
            ),
            None,
        )
    )
    if first is None:
        return 0
    if first.is_floating_point():
        return first.numel() // max(first.shape[-1], 1)
    return first.numel()
