"""What a collective backend allocates through PyTorch's allocator while a collective runs, beyond
its input and output: the planner adds it to the live bytes at each collective (``simulate(...,
backend=)``). Read from the backends' source and checked against the allocator
(``benchmarks/plan_vs_alloc.py``).

* ``gloo`` (CPU): an all-gather gathers into a flat copy of its output and copies out of it; a
  reduce-scatter all-reduces a clone of its input and keeps this rank's chunk. All-reduce works in
  place.
* ``nccl``: nothing through PyTorch's allocator (its buffers are NCCL's own, outside
  ``torch.cuda.max_memory_allocated``).
"""

from __future__ import annotations

from typing import Callable

# backend -> op (`Collective.op` values, DTensor's too) -> staged bytes per byte of the traced size
# (all-gather output, reduce-scatter input)
STAGED: dict[str, dict[str, int]] = {
    "gloo": {"all_gather": 1, "reduce_scatter": 1},
    "nccl": {},
}


def staging(backend: str) -> Callable[[str, int], int]:
    """``(op, nbytes) -> bytes`` the ``backend`` stages while that collective runs."""
    if backend not in STAGED:
        raise ValueError(
            f"plan: unknown collective backend {backend!r}; the planner models {sorted(STAGED)}. Fix: pass "
            "backend='nccl' for accelerators or 'gloo' for CPU runs."
        )
    table = STAGED[backend]
    return lambda op, nbytes: table.get(op, 0) * nbytes
