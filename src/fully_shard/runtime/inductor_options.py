"""What Inductor may do with the collectives of a whole-model graph: ``FSDPModule.compile(collectives=)``.

Each setting is a set of ``torch._inductor.config`` options added to the compile's ``options``
(the user's own win); docs/compile.md has the measurements. Imports only torch (Inductor lazily).
"""

from __future__ import annotations

import functools
from typing import Any, Optional

COLLECTIVES = {
    "as_traced": {},  # one all-gather / reduce-scatter per group where the forward reads it
    # Inductor's FX bucketing, each bucket capped (`_bucket_cap_mb`): the reduce-scatters, and the
    # forward graph's all-gathers only (`_forward_all_gather_bucketing`): bucketing the backward's
    # recomputed all-gathers holds two groups' parameters through the first one's backward (+8% peak
    # memory on the example Llama, docs/compile.md)
    "bucket": {"bucket_reduce_scatters_fx": "all"},
    "bucket_all": {"bucket_all_gathers_fx": "all", "bucket_reduce_scatters_fx": "all"},  # no cap
    # Inductor's overlap scheduler (and its bucketing); its cost model needs a GPU
    "overlap": {
        "aten_distributed_optimizations.enable_overlap_scheduling": True,
        "aten_distributed_optimizations.collective_bucketing": True,
    },
    "reorder": {
        "reorder_for_compute_comm_overlap": True,
        "reorder_for_compute_comm_overlap_passes": [
            "reorder_communication_preserving_peak_memory",
            "sink_waits_iterative",
            "reorder_communication_preserving_peak_memory",
        ],
    },
}
DEFAULT_COLLECTIVES = "bucket"  # measured fastest at no more memory on CPU/gloo (docs/compile.md)


def _bucket_cap_mb(mb: float, bucket_id: int) -> float:
    return mb


def is_backward_graph(graph: Any) -> bool:
    """AOTAutograd's backward graph: it takes the outputs' gradients (``tangents_*`` inputs)."""
    return any(n.op == "placeholder" and n.name.startswith("tangents") for n in graph.nodes)


@functools.cache
def _forward_all_gather_bucketing(cap_mb: float) -> Any:
    """An Inductor post-grad pass (``post_grad_custom_post_pass``) running Inductor's own all-gather
    bucketing (``fx_passes.bucketing.bucket_all_gather``, buckets of at most ``cap_mb``) on forward
    graphs and leaving backward graphs alone."""
    from torch._inductor.custom_graph_pass import CustomGraphPass

    class ForwardAllGatherBucketing(CustomGraphPass):
        def __call__(self, graph: Any) -> None:
            if is_backward_graph(graph):
                return
            from torch._inductor.fx_passes.bucketing import bucket_all_gather
            from torch._inductor.pattern_matcher import stable_topological_sort

            bucket_all_gather(graph.owning_module, functools.partial(_bucket_cap_mb, cap_mb))
            # a bucket's inputs may be made after its first member (Inductor sorts after the custom
            # pass too, in 2.11 and 2.13: kept in case it stops)
            stable_topological_sort(graph)

        def uuid(self) -> Optional[Any]:  # Inductor's cache key for this pass
            return f"fully_shard.forward_all_gather_bucketing.v1.{cap_mb!r}"

        def __reduce__(self) -> tuple[Any, tuple[float]]:  # pickled (e.g. with a compiled model) by name
            return _forward_all_gather_bucketing, (cap_mb,)

    return ForwardAllGatherBucketing()


def compile_options(collectives: Optional[str], kwargs: dict, groups: list[Any], device_type: str) -> dict:
    """``torch.compile``'s keyword arguments for a whole-model compile: ``collectives``' Inductor
    settings added to ``options`` (the user's own win). None: the default, where it applies (with
    Inductor, and no ``mode``, which torch does not take together with ``options``). ``"bucket"``
    caps a bucket at twice the largest group's unsharded bytes: about what eager holds (a block
    and the next one prefetched), so bucketing does not gather the whole model at once."""
    chosen_name = DEFAULT_COLLECTIVES if collectives is None else collectives
    if chosen_name not in COLLECTIVES:
        raise ValueError(
            f"FSDPModule.compile: collectives={collectives!r} is not one of {sorted(COLLECTIVES)}. "
            f"Fix: pass one of those (default {DEFAULT_COLLECTIVES!r}; docs/compile.md says what each does)."
        )
    backend, mode = kwargs.get("backend", "inductor"), kwargs.get("mode")
    if backend != "inductor" or mode is not None:
        if collectives is None or collectives == "as_traced":
            return kwargs
        what = (
            f"backend={backend!r}"
            if backend != "inductor"
            else f"mode={mode!r} (torch takes no options with it)"
        )
        raise ValueError(
            f"FSDPModule.compile: collectives={collectives!r} sets Inductor options, but {what}. "
            "Fix: use Inductor without mode (pass its settings in options=), or leave collectives out."
        )
    if chosen_name == "overlap" and device_type == "cpu":
        raise ValueError(
            "FSDPModule.compile: collectives='overlap' runs Inductor's overlap scheduler, whose cost "
            "model reads a GPU's bandwidth (it fails on CPU for want of triton). Fix: on CPU use "
            "'bucket' or 'reorder' (docs/compile.md)."
        )
    chosen = dict(COLLECTIVES[chosen_name])
    if chosen_name == "bucket":
        mb = 2 * max((g.unsharded_bytes() for g in groups), default=0) / 2**20
        chosen["bucket_reduce_scatters_fx_bucket_size_determinator"] = functools.partial(_bucket_cap_mb, mb)
        chosen["post_grad_custom_post_pass"] = _forward_all_gather_bucketing(mb)
    if not chosen:
        return kwargs
    return {**kwargs, "options": {**chosen, **(kwargs.get("options") or {})}}
