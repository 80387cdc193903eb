"""A step-time estimate for a `Plan`: each collective priced by an alpha-beta model of its link,
overlapped with compute the way the schedule overlaps it.

Collectives (ring algorithms, as NCCL runs them at these sizes), for ``n`` ranks and ``S`` bytes
(the all-gather output / reduce-scatter input / all-reduce buffer):

* all-gather, reduce-scatter: ``(n - 1) * alpha + (n - 1) / n * S / beta``
* all-reduce: twice that.

``alpha`` (latency per ring step) and ``beta`` (bytes per second per rank) come from the link the
group crosses: a group whose ranks all sit on one node (nodes are ``gpus_per_node`` consecutive
global ranks) uses the intra-node link, any other group the inter-node one.

DTensor's collectives (tensor parallel layers; phases ``dtensor_forward`` / ``dtensor_backward``)
are priced the same way and added to the compute of the unit that runs them: the layer waits for
them, and FSDP's collectives overlap them as they overlap compute.

Compute: ``2 * parameters * tokens`` FLOPs forward and twice that backward per module (the usual
dense-layer count; attention's sequence-squared term is left out), at ``flops`` per second.

Offload (``CPUOffloadPolicy``): an offloaded shard's copy to the device (before its all-gather)
and its gradient's copy back (after its reduce-scatter) are priced on the cluster's host link and
added to that collective; the host's optimizer step over the offloaded elements follows backward,
exposed.

Optimizer: this rank's sharded elements on the device at ``optimizer_elements_per_s`` (AdamW is
memory-bound), after backward, exposed.

Copies: fully_shard's own work on the compute stream, each all-gather's copy-out and each
reduce-scatter's copy-in (twice the collective's bytes: read and written) at
``memory_bytes_per_s``, before the module's forward compute and within backward's. (The
all-gather's copy-in runs on its own stream on an accelerator and is not counted; on a CPU it
shares the cores.)

Overlap (what the schedule does): in forward, the next module's all-gather runs while this one
computes, so each module costs the larger of its compute and the next all-gather, and the first
all-gather is exposed. In backward, prefetched all-gathers and reductions run on their own streams
while modules compute: the pass costs the larger of all backward compute and all its
communication, plus what cannot overlap (the first all-gather, before any compute, and the last
reduction, after it). A model, not a measurement: check it against one real step at small scale.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Optional, Protocol


class PlanView(Protocol):
    """What the time model reads of a `simulate.Plan` (so this module needs no import of it)."""

    module_params: dict[str, int]
    collectives: list[Any]
    module_offload_bytes: dict[str, int]
    offloaded_elements: int
    device_elements: int


@dataclass(frozen=True)
class Link:
    latency_s: float  # alpha: per ring step
    bytes_per_s: float  # beta: per rank, achieved bus bandwidth


@dataclass(frozen=True)
class Cluster:
    """Links of a cluster and the compute rate of one device; for ``CPUOffloadPolicy``, its link
    to the host and how fast the host steps the optimizer."""

    gpus_per_node: int
    intra: Link
    inter: Link
    flops: float  # achieved FLOP/s of one device for the model's matmuls
    host: Link = Link(10e-6, 25e9)  # host <-> device copies, per device
    host_optimizer_elements_per_s: float = 2e8  # AdamW on the host, per device's share of the CPU
    optimizer_elements_per_s: float = 1e11  # AdamW on the device (memory-bound)
    memory_bytes_per_s: float = 2.8e12  # device memory bandwidth achieved by copies

    def link(self, first_rank: int, last_rank: int) -> Link:
        """The link a group of global ranks ``first_rank .. last_rank`` crosses."""
        return (
            self.intra if first_rank // self.gpus_per_node == last_rank // self.gpus_per_node else self.inter
        )


# Presets (achieved, not peak): 8 H100s per node on NVLink 4 (NCCL all-gather bus bandwidth about
# 350 GB/s), 400 Gb/s InfiniBand per GPU (about 45 GB/s achieved), bf16 matmuls at about 40% of
# 989 TFLOP/s; and the same nodes computing in fp32 (about 50 TFLOP/s without TF32). Host side
# (every preset): PCIe Gen5 x16 shared by two GPUs per switch, about 25 GB/s each way per GPU;
# PyTorch's AdamW on the CPU at about 2e8 elements/s per GPU's share of the cores (it reads and
# writes 28 bytes per fp32 element; a rough figure: set your own). AdamW on the device is
# memory-bound too: 28 bytes per element at about 2.8 TB/s achieved of an H100's 3.35 (1e11
# elements/s), 1.6 of an A100's 2.0 (6e10); the same bandwidths price fully_shard's copies.
PRESETS = {
    "h100-nvlink-ib400-bf16": Cluster(8, Link(5e-6, 350e9), Link(12e-6, 45e9), 400e12),
    "h100-nvlink-ib400-fp32": Cluster(8, Link(5e-6, 350e9), Link(12e-6, 45e9), 50e12),
    "a100-nvlink-ib200-bf16": Cluster(
        8,
        Link(6e-6, 230e9),
        Link(15e-6, 22e9),
        150e12,
        optimizer_elements_per_s=6e10,
        memory_bytes_per_s=1.6e12,
    ),
}


def collective_seconds(
    op: str, nbytes: int, ranks: int, cluster: Cluster, span: tuple[int, int] = (0, 0)
) -> float:
    """One collective of ``ranks`` ranks whose global ranks lie in ``span`` (default: within one node)."""
    if ranks <= 1:
        return 0.0
    link = cluster.link(*span)
    one = (ranks - 1) * link.latency_s + (ranks - 1) / ranks * nbytes / link.bytes_per_s
    return 2 * one if op == "all_reduce" else one


@dataclass
class StepTime:
    step_s: float
    compute_s: float
    communication_s: float  # every collective, as if nothing overlapped
    exposed_s: float  # communication not hidden behind compute
    host_optimizer_s: float = 0.0  # the optimizer step of offloaded parameters, on the host, after backward
    optimizer_s: float = 0.0  # the optimizer step on the device, after backward
    copy_s: float = 0.0  # fully_shard's copies in and out of the collectives' buffers, on the compute stream

    def __str__(self) -> str:
        host = f", host optimizer {self.host_optimizer_s * 1e3:.1f} ms" if self.host_optimizer_s else ""
        return (
            f"step {self.step_s * 1e3:.1f} ms (compute {self.compute_s * 1e3:.1f} ms, copies "
            f"{self.copy_s * 1e3:.1f} ms, communication {self.communication_s * 1e3:.1f} ms, of it exposed "
            f"{self.exposed_s * 1e3:.1f} ms, optimizer {self.optimizer_s * 1e3:.1f} ms{host})"
        )


def _unit(module: str, units: dict[str, int]) -> str:
    """The fully_shard unit (a key of ``Plan.module_params``, "" = the root) holding ``module``."""
    inside = [u for u in units if u and (module == u or module.startswith(u + "."))]
    return max(inside, key=len, default="")


def estimate(plan: PlanView, cluster: Cluster, tokens: int, flops: Optional[float] = None) -> StepTime:
    """The step time of ``plan`` on ``cluster`` with ``tokens`` tokens per rank per step."""
    rate = flops if flops is not None else cluster.flops
    fwd = {m: 2 * n * tokens / rate for m, n in plan.module_params.items()}
    cost = {
        id(r): collective_seconds(r.op, r.nbytes, r.group_size, cluster, r.rank_span)
        for r in plan.collectives
    }
    _add_host_copies(plan, cluster, cost)
    host_optimizer = plan.offloaded_elements / cluster.host_optimizer_elements_per_s
    optimizer = plan.device_elements / cluster.optimizer_elements_per_s
    tp_fwd, tp_bwd = _tensor_parallel_seconds(plan.collectives, cost, fwd)
    work = {m: fwd.get(m, 0.0) + tp_fwd.get(m, 0.0) for m in {*fwd, *tp_fwd}}
    fsdp = [r for r in plan.collectives if not r.phase.startswith("dtensor_")]
    forward = [r for r in fsdp if r.phase in ("forward", "forward_prefetch") and r.op == "all_gather"]
    backward = [r for r in fsdp if r.phase not in ("forward", "forward_prefetch")]
    # fully_shard's own copies on the compute stream: each all-gather's copy-out (its output read
    # and written once) and each reduce-scatter's copy-in (its input likewise).
    copies = {
        id(r): 2 * r.nbytes / cluster.memory_bytes_per_s
        for r in fsdp
        if r.op in ("all_gather", "reduce_scatter")
    }
    f_time = _forward_seconds(forward, cost, copies, work)
    b_compute = 2 * sum(fwd.values()) + tp_bwd + sum(copies.get(id(r), 0.0) for r in backward)
    b_time = _backward_seconds(backward, cost, b_compute)
    total_comm = sum(cost.values())
    step = f_time + b_time + optimizer + host_optimizer
    compute_total = 3 * sum(fwd.values())
    copy_total = sum(copies.values())
    exposed = max(0.0, f_time + b_time - compute_total - copy_total)
    return StepTime(step, compute_total, total_comm, exposed, host_optimizer, optimizer, copy_total)


def _members(label: str) -> list[str]:
    """The modules of a collective's label ("a+b" when bucketed; "" is the root)."""
    return [m if m != "<root>" else "" for m in label.split("+")]


def _add_host_copies(plan: PlanView, cluster: Cluster, cost: dict[int, float]) -> None:
    """Offloaded shards go to the device before their all-gather and come back (as gradients) after
    their reduce-scatter, on the way of that collective: their copies are added to its ``cost``."""
    for r in plan.collectives:
        moved = sum(plan.module_offload_bytes.get(m, 0) for m in _members(r.module))
        if moved and r.op in ("all_gather", "reduce_scatter") and not r.phase.startswith("dtensor_"):
            cost[id(r)] += cluster.host.latency_s + moved / cluster.host.bytes_per_s


def _tensor_parallel_seconds(
    collectives: list[Any], cost: dict[int, float], fwd: dict[str, float]
) -> tuple[dict[str, float], float]:
    """DTensor's collectives (tensor parallel) block the compute that needs them: they count as
    their unit's compute, forward (per unit) or backward (in all)."""
    tp_fwd = dict.fromkeys(fwd, 0.0)
    tp_bwd = 0.0
    for r in collectives:
        if r.phase == "dtensor_forward":
            unit = _unit(r.module, fwd)
            tp_fwd[unit] = tp_fwd.get(unit, 0.0) + cost[id(r)]
        elif r.phase == "dtensor_backward":
            tp_bwd += cost[id(r)]
    return tp_fwd, tp_bwd


def _forward_seconds(
    forward: list[Any], cost: dict[int, float], copies: dict[int, float], work: dict[str, float]
) -> float:
    """Forward: module i computes while the next all-gather runs. A module whose parameters are on
    several meshes has an all-gather per mesh: its compute counts once."""
    f_time = cost[id(forward[0])] if forward else 0.0
    counted: set[str] = set()
    for i, r in enumerate(forward):
        nxt = cost[id(forward[i + 1])] if i + 1 < len(forward) else 0.0
        new = [m for m in _members(r.module) if m not in counted]
        counted.update(new)
        f_time += max(sum(work.get(m, 0.0) for m in new) + copies[id(r)], nxt)
    f_time += sum(work[m] for m in work if m not in counted)  # modules without a collective of their own
    return f_time


def _backward_seconds(backward: list[Any], cost: dict[int, float], compute: float) -> float:
    """Backward, in the order the collectives were issued: each module's compute overlaps the
    communication issued while it runs (the next prefetch, the previous module's reductions)."""
    comm = sum(cost[id(r)] for r in backward)
    first = (
        cost[id(backward[0])] if backward and backward[0].op == "all_gather" else 0.0
    )  # before any compute
    last = (
        cost[id(backward[-1])] if len(backward) > 1 and backward[-1].op != "all_gather" else 0.0
    )  # after it
    return max(compute, comm - first - last) + first + last
