"""Shared parity helpers: the models, batches and training loop every parity test uses, and the
two oracles.

* **Numerics**: a single-process reference on the global batch, **in float64 on both sides**.
  The only differences left are rounding in reductions done in another order (per-rank partial
  sums, then the reduce-scatter, vs one global sum), and they are far below `TOL64` on any CPU,
  whatever kernels it picks (see the derivation at `TOL64`).
* **Bit-exactness**: PyTorch's own ``fully_shard`` given the same input reduces in the same order,
  so results are compared with ``torch.equal`` (`max_abs_diff == 0`), in any dtype.

Nothing here sets a tolerance from what one machine printed.
"""

from __future__ import annotations

import contextlib

import torch
import torch.nn as nn

from llama_model import Llama, LlamaConfig, loss_fn, synthetic_batch
from rank_utils import cpu_mesh, full, global_mean, max_param_diff, world

F64 = torch.float64
STEPS = 5
# Adam divides each gradient by its running RMS, so an element whose gradient is tiny moves by
# ~lr whatever its exact value; 1e-3 is a typical transformer lr.
LLAMA_LR = 1e-3

# TOL64, derived (float64 on both sides). Unit roundoff u = 2**-53 ~ 1.1e-16. The sharded run
# and the reference compute the same math; they differ only where a reduction runs in another
# order (per-rank partial sums, then the reduce-scatter, vs one global sum). A sum of n terms in
# another order differs by at most ~n * u * sum|terms|; the largest reductions here have n <= 1e4
# terms of O(1), so gradients differ by delta <= 1e4 * 1.1e-16 ~ 1e-12 (the loss, a mean, by less).
# AdamW's update lr * m / (sqrt(v) + eps) moves by at most lr * delta / |g| for a gradient of size
# |g|: with lr <= 1e-2 and the model's gradients >= 1e-4 (exact zeros, e.g. embedding rows no
# token used, are zero on both sides and stay equal), that is <= 1e-2 * 1e-12 / 1e-4 = 1e-10 per
# step, 5e-10 over 5 steps. TOL64 = 1e-9 holds on any CPU whatever kernels it picks (they only
# change which roundings happen, not their size), and a float32-sized bug (~1e-7 relative: a lost
# cast, a wrong padding row) cannot hide under it.
TOL64 = 1e-9


def llama64(cfg: LlamaConfig = LlamaConfig()) -> Llama:
    """The example Llama in float64 (built in float32 from the current seed, then cast, so float32
    and float64 tests start from the same values)."""
    return Llama(cfg).to(F64)


def make_mlp(dtype: torch.dtype = F64) -> nn.Sequential:
    """Nested blocks with dims that divide by neither 2 nor 4 (padding on every rank count)."""
    torch.manual_seed(0)
    return nn.Sequential(
        nn.Sequential(nn.Linear(7, 13), nn.ReLU(), nn.Linear(13, 11)),
        nn.Sequential(nn.Linear(11, 5), nn.ReLU()),
        nn.Sequential(nn.Linear(5, 9), nn.Tanh(), nn.Linear(9, 3)),
        nn.Linear(3, 3),
    ).to(dtype)


def shard_mlp(model: nn.Sequential, layout: str, reshard: bool, shard_fn) -> None:
    mesh = cpu_mesh()
    if layout == "nested":
        for block in model[:3]:
            shard_fn(block, mesh=mesh, reshard_after_forward=reshard)
    elif layout == "list":
        shard_fn([model[0], model[1]], mesh=mesh, reshard_after_forward=reshard)
        shard_fn(model[2], mesh=mesh, reshard_after_forward=reshard)
    shard_fn(model, mesh=mesh)


def nested_mlp_and_reference() -> tuple[nn.Module, nn.Module]:
    """The parity MLP with each block and the root sharded, and an unsharded copy of it."""
    import copy

    from fully_shard import fully_shard

    model = make_mlp()
    ref = copy.deepcopy(model)
    shard_mlp(model, "nested", True, fully_shard)
    return model, ref


def mlp_batch(step: int, dtype: torch.dtype = F64) -> tuple[torch.Tensor, torch.Tensor]:
    gen = torch.Generator().manual_seed(step)
    return torch.randn(8, 7, generator=gen).to(dtype), torch.randn(8, 3, generator=gen).to(dtype)


def shard_llama(model: Llama, reshard: bool, shard_fn) -> None:
    mesh = cpu_mesh()
    for layer in model.layers:
        shard_fn(layer, mesh=mesh, reshard_after_forward=reshard)
    shard_fn(model, mesh=mesh)


def llama_batch(step: int) -> tuple[torch.Tensor, torch.Tensor]:
    cfg = LlamaConfig()
    return synthetic_batch(step, batch=8, seq_len=16, vocab=cfg.vocab_size)


class WithGenerate(nn.Module):
    """A module with a second entry point, for ``register_fsdp_forward_method``."""

    def __init__(self) -> None:
        super().__init__()
        self.proj = nn.Linear(5, 7)

    def forward(self, x):
        return self.proj(x)

    def generate(self, x, steps: int = 3):
        for _ in range(steps):
            x = torch.tanh(self.proj(x))[:, :5]
        return x


def sharded_generate_model() -> tuple[nn.Module, nn.Module]:
    """`WithGenerate` in float64, sharded with ``generate`` registered as a forward method, and an
    unsharded copy of it."""
    import copy

    from fully_shard import fully_shard, register_fsdp_forward_method

    torch.manual_seed(0)
    model = WithGenerate().double()
    ref = copy.deepcopy(model)
    fully_shard(model, mesh=cpu_mesh())
    register_fsdp_forward_method(model, "generate")
    return model, ref


def _mlp_loss(model, x, y):
    return ((model(x) - y) ** 2).mean()


def _llama_loss(model, x, y):
    return loss_fn(model(x), y)


def _train_pair(model, ref, batch_fn, loss_of, steps: int, lr: float = 1e-2, split: tuple[int, int] | None = None) -> dict:
    """Train a sharded ``model`` on this rank's slice and the single-process ``ref`` on the whole
    global batch; return the largest loss and final parameter differences.

    ``split=(index, parts)``: which slice of the global batch this rank trains on (default: its
    rank of the world; tensor-parallel ranks of one data-parallel rank share a slice).
    """
    assert_float64(model)
    assert_float64(ref)
    rank, w = world() if split is None else split
    opt = torch.optim.AdamW(model.parameters(), lr=lr, weight_decay=0.1)
    ref_opt = torch.optim.AdamW(ref.parameters(), lr=lr, weight_decay=0.1)
    loss_diffs = []
    for step in range(steps):
        x, y = batch_fn(step)
        loss = loss_of(model, x.chunk(w)[rank], y.chunk(w)[rank])
        loss.backward()
        opt.step()
        opt.zero_grad()
        ref_loss = loss_of(ref, x, y)
        ref_loss.backward()
        ref_opt.step()
        ref_opt.zero_grad()
        loss_diffs.append(abs(global_mean(loss) - ref_loss.item()))
    return {"loss_diff": max(loss_diffs), "param_diff": max_param_diff(model, ref)}


def train_routed(model, ref, route: list[int], steps: int = 3, lr: float = 1e-2) -> float:
    """Expert-parallel training: the sharded ``model`` on this rank's slice of `mlp_batch`, the
    single-process ``ref`` on the whole batch with slice ``i`` routed to expert ``route[i]``
    (``ref(x, route)``), both with AdamW; returns the largest loss difference (float64)."""
    rank, w = world()
    opt = torch.optim.AdamW([p for p in model.parameters() if p.requires_grad], lr=lr)
    ref_opt = torch.optim.AdamW(ref.parameters(), lr=lr)
    diffs = []
    for step in range(steps):
        x, y = mlp_batch(step)
        loss = ((model(x.chunk(w)[rank]) - y.chunk(w)[rank]) ** 2).mean()
        loss.backward()
        opt.step()
        opt.zero_grad()
        ref_loss = ((ref(x, route) - y) ** 2).mean()
        ref_loss.backward()
        ref_opt.step()
        ref_opt.zero_grad()
        diffs.append(abs(global_mean(loss) - ref_loss.item()))
    return max(diffs)


def max_abs_diff(ours: nn.Module, theirs: nn.Module) -> float:
    """Largest difference between two sharded (or plain) models' full parameters, matched by
    position; 0.0 means every parameter is ``torch.equal``."""
    diffs = [(full(a).detach() - full(b).detach()).abs().max().item() for a, b in zip(ours.parameters(), theirs.parameters())]
    return max(diffs)


def check(results: list[dict], label: str, tol: float = TOL64) -> None:
    """Assert each rank's ``loss_diff`` and ``param_diff`` are within ``tol`` (print them too).

    Use the default only for float64 runs against a float64 reference."""
    for rank, r in enumerate(results):
        print(f"{label} rank {rank}: max |loss diff| {r['loss_diff']:.2e}, max |param diff| {r['param_diff']:.2e}")
        assert r["loss_diff"] <= tol and r["param_diff"] <= tol, r


def assert_float64(model: nn.Module) -> None:
    """Numerics tests must run in float64: refuse a model that is not, so a test cannot silently
    fall back to float32 and a tolerance made for float64."""
    dtypes = {p.dtype for p in model.parameters()}
    assert dtypes == {F64}, f"parity model must be float64, got {dtypes}"


__all__ = [
    "F64", "LLAMA_LR", "WithGenerate", "sharded_generate_model", "STEPS", "TOL64", "_llama_loss", "_mlp_loss", "_train_pair", "assert_float64", "check",
    "global_mean", "llama64", "llama_batch", "make_mlp", "max_abs_diff", "mlp_batch", "nested_mlp_and_reference", "shard_llama", "shard_mlp",
    "train_routed",
]


class SPBlock(nn.Module):
    """A block for tensor + sequence parallelism: its norm's weight and bias are replicated over
    the TP mesh and their gradients Partial (each TP rank sees a slice of the sequence)."""

    def __init__(self) -> None:
        super().__init__()
        self.norm, self.up, self.down = nn.LayerNorm(16), nn.Linear(16, 32), nn.Linear(32, 16)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.down(torch.relu(self.up(self.norm(x))))


def make_sp_model(mesh, shard_fn, mp_policy, sequence_parallel: bool = True) -> nn.Sequential:
    """Two `SPBlock`\\ s (same seed), each made tensor/sequence parallel over ``mesh["tp"]``
    (``sequence_parallel=False``: only the linears, the norm a plain parameter, every TP gradient
    of its parameter's placement), then sharded by ``shard_fn`` over ``mesh["dp"]`` with
    ``mp_policy``, then the root."""
    from torch.distributed.tensor import Shard
    from torch.distributed.tensor.parallel import (
        ColwiseParallel,
        RowwiseParallel,
        SequenceParallel,
        parallelize_module,
    )

    torch.manual_seed(0)
    model = nn.Sequential(SPBlock(), SPBlock())
    plan = {"norm": SequenceParallel(), "up": ColwiseParallel(input_layouts=Shard(1)),
            "down": RowwiseParallel(output_layouts=Shard(1))} if sequence_parallel else {
        "up": ColwiseParallel(), "down": RowwiseParallel()}
    for block in model:
        parallelize_module(block, mesh["tp"], plan)
        shard_fn(block, mesh=mesh["dp"], mp_policy=mp_policy)
    shard_fn(model, mesh=mesh["dp"], mp_policy=mp_policy)
    return model


def sp_batch(mesh, index: int, whole: bool = False) -> torch.Tensor:
    """This rank's input: its dp rank's batch, its TP rank's slice of the sequence (``whole``: all
    of it, for TP without sequence parallelism)."""
    g = torch.Generator().manual_seed(1000 * index + mesh.get_local_rank(0))
    x = torch.randn(2, 8, 16, generator=g)
    return x if whole else x.chunk(mesh.size(1), dim=1)[mesh.get_local_rank(1)]


@contextlib.contextmanager
def reductions_in_flight():
    """The most gradient reductions in flight at once (`RootContext.pending_reduces`) while the
    body runs, as ``depth["max"]``."""
    from fully_shard.runtime.state import RootContext

    depth, original = {"max": 0}, RootContext.reduce

    def reduce(self, issue):
        original(self, issue)
        depth["max"] = max(depth["max"], len(self.pending_reduces))

    RootContext.reduce = reduce
    try:
        yield depth
    finally:
        RootContext.reduce = original

