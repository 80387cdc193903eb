"""Tier 1: no process group. Padding arithmetic, policies, lifecycle tables, buffer layouts."""

from __future__ import annotations

import math

import pytest
import torch
import torch.nn as nn

from fully_shard import CPUOffloadPolicy, MixedPrecisionPolicy, OffloadPolicy, fully_shard
from fully_shard.runtime import collectives
from fully_shard.api.discovery import _device_usable
from fully_shard.layouts.layout import ShardLayout, local_rows, rows_per_rank
from fully_shard.runtime.lifecycle import (
    GROUP_STATES, Event, IterationPhase, ModuleEvent, ShardedState, Step, TrainingPhase, advance, step_for,
)
from fully_shard.runtime.state import ITERATION, MODULE, FSDPState, RootContext


@pytest.mark.parametrize("n", [0, 1, 3, 7, 8, 101])
@pytest.mark.parametrize("world_size", [1, 2, 3, 4, 8])
def test_local_rows_match_torch_chunk(n, world_size):
    chunks = torch.arange(n).chunk(world_size) if n else ()
    for rank in range(world_size):
        expected = chunks[rank].numel() if rank < len(chunks) else 0
        assert local_rows(n, world_size, rank) == expected
    assert rows_per_rank(n, world_size) == (max(c.numel() for c in chunks) if n else 0)


@pytest.mark.parametrize("world", range(1, 9))
@pytest.mark.parametrize("shape,dim", [((0, 3), 0), ((7,), 0), ((13, 4), 0), ((5, 3, 2), 1), ((3, 17), 1), ((2, 3, 9), 2)])
def test_shard_layout_round_trips_through_the_collective_layout(world, shape, dim):
    """Every rank's chunk is torch.chunk's (empty past the end); padded to ``rows`` rows with the
    sharded dim in front, each is ``shard_numel`` elements, and the ranks' padded chunks laid end to
    end (what the all-gather produces) hold the whole tensor in order."""
    full = torch.arange(math.prod(shape), dtype=torch.float64).reshape(shape)
    chunks = full.chunk(world, dim) if full.shape[dim] else ()
    gathered = []
    for rank in range(world):
        layout = ShardLayout(torch.Size(shape), dim, world, rank)
        local = full.narrow(dim, layout.start, layout.local_rows)
        expected = chunks[rank] if rank < len(chunks) else full.narrow(dim, 0, 0)
        assert torch.equal(local, expected) and local.shape == layout.local_shape
        moved = local.movedim(dim, 0)
        padded = torch.cat([moved, moved.new_zeros((layout.rows - layout.local_rows, *moved.shape[1:]))])
        assert padded.numel() == layout.shard_numel and padded.shape[1:] == layout.moved_shape[1:]
        gathered.append(padded)
    n = shape[dim]
    assert torch.equal(torch.cat(gathered)[:n], full.movedim(dim, 0))
    assert layout.full_chunks == (n // layout.rows if layout.rows else 0)


def test_policies_validate():
    with pytest.raises(ValueError, match="param_dtype"):
        MixedPrecisionPolicy(param_dtype=torch.int32)
    with pytest.raises(ValueError, match="cast_forward_inputs"):
        MixedPrecisionPolicy(cast_forward_inputs="yes")  # type: ignore[arg-type]
    with pytest.raises(ValueError, match="pin_memory"):
        CPUOffloadPolicy(pin_memory=1)  # type: ignore[arg-type]
    assert isinstance(CPUOffloadPolicy(), OffloadPolicy)


def test_lifecycle_tables_decide_and_reject_illegal_moves():
    with pytest.raises(RuntimeError, match="group layers.0: illegal transition SHARDED -> SHARDED_POST_FORWARD"):
        advance(GROUP_STATES, ShardedState.SHARDED, ShardedState.SHARDED_POST_FORWARD, "group layers.0")
    for state, allowed in GROUP_STATES.items():
        assert state not in allowed and allowed <= set(GROUP_STATES)
    with pytest.raises(RuntimeError, match="module layers.0: FORWARD_DONE is not expected while in POST_BACKWARD"):
        step_for(MODULE, TrainingPhase.POST_BACKWARD, ModuleEvent.FORWARD_DONE, "module layers.0")
    # Every action a table names is a method of what consults it; every phase can be reset.
    for table, owner, phases in ((MODULE, FSDPState, TrainingPhase), (ITERATION, RootContext, IterationPhase)):
        for entry in table.values():
            for step in (entry,) if isinstance(entry, Step) else entry:
                assert step.action is None or getattr(owner, step.action.__name__) is step.action, step
        reset = ModuleEvent.RESET if table is MODULE else Event.RESET
        assert all(table[(p, reset)].to.name == "IDLE" for p in phases)  # type: ignore[union-attr]


class _Guards:
    """What the module table's guards read: how many signals are pending, which members are done."""

    def __init__(self, signals: int, members: int, done: set[int]) -> None:
        self._signals_pending, self.modules, self._members_done = signals, list(range(members)), done

    signals_left = FSDPState.signals_left
    members_left = FSDPState.members_left
    _member_index = FSDPState._member_index


def test_module_table_walks_one_training_step():
    """One step of one module as its hooks report it; guards choose between a table's steps: a
    module used twice in forward reduces at its second signal; a list-form call reshards after its
    last member's forward."""
    phase, seen = TrainingPhase.IDLE, []
    once, twice = _Guards(1, 1, set()), _Guards(2, 1, set())
    hook_args = (0, None)  # what the forward hooks pass: the module, then its inputs or output
    events = [(ModuleEvent.FORWARD, once, hook_args), (ModuleEvent.FORWARD_DONE, once, hook_args),
              (ModuleEvent.PRE_BACKWARD, once, ()), (ModuleEvent.RECOMPUTE, once, hook_args),
              (ModuleEvent.SIGNAL, twice, ()), (ModuleEvent.SIGNAL, once, ()), (ModuleEvent.BACKWARD_END, once, ())]
    for event, guards, payload in events:
        step = step_for(MODULE, phase, event, "m", guards, *payload)
        phase = step.then or step.to
        seen.append((step.action.__name__ if step.action else "", phase.name))
    assert seen == [
        ("unshard_for_forward", "FORWARD"), ("after_forward", "IDLE"), ("unshard_for_backward", "PRE_BACKWARD"),
        ("unshard_for_recompute", "PRE_BACKWARD"), ("count_signal", "PRE_BACKWARD"), ("reduce", "IDLE"),
        ("reduce_leftovers", "IDLE"),
    ]
    # List form, three members: the first two finish (FORWARD stays), the last reshards.
    members = _Guards(1, 3, set())
    chosen = []
    for module in (0, 1, 2):
        step = step_for(MODULE, TrainingPhase.FORWARD, ModuleEvent.FORWARD_DONE, "m", members, module, None)
        chosen.append((step.action.__name__, step.to.name))
        members._members_done.add(module)
    assert chosen == [("finish_member", "FORWARD"), ("finish_member", "FORWARD"), ("after_forward", "IDLE")]


def test_all_gather_layout_round_trips():
    """Copy-in puts each rank's shards in its row; copy-out rebuilds each padded parameter."""
    world_size = 3
    params = [torch.randn(7, 2), torch.randn(4), torch.randn(1, 3)]
    rows = [-(-p.shape[0] // world_size) for p in params]
    padded = [torch.cat([p, p.new_zeros(r * world_size - p.shape[0], *p.shape[1:])]) for p, r in zip(params, rows)]
    shards = [[pp.chunk(world_size)[r].reshape(-1) for pp in padded] for r in range(world_size)]
    outputs = []
    for rank in range(world_size):
        _, out = collectives.all_gather_copy_in(shards[rank], world_size, rank, torch.float32, torch.device("cpu"))
        assert out.dtype == torch.uint8  # the all-gather moves bytes
        outputs.append(out.view(torch.float32).view(world_size, -1)[rank].clone())
    gathered = torch.stack(outputs).view(-1)  # what the all-gather would produce
    outs = [torch.empty(world_size, s[0].numel()) for s in zip(*shards)]
    collectives.all_gather_copy_out(gathered, world_size, outs)
    for out, pp in zip(outs, padded):
        assert torch.equal(out.view(pp.shape), pp)


def test_reduce_scatter_layout_puts_rank_chunks_in_rows():
    world_size = 4
    grads = [torch.randn(10, 3), torch.randn(3)]
    slot = sum(-(-g.shape[0] // world_size) * (g.numel() // g.shape[0]) for g in grads)
    flat = collectives.reduce_scatter_copy_in(grads, world_size, slot, torch.float32, torch.device("cpu"))
    rows = flat.view(world_size, slot)
    for rank in range(world_size):
        offset = 0
        for g in grads:
            r = -(-g.shape[0] // world_size)
            chunk = rows[rank, offset : offset + r * (g.numel() // g.shape[0])].view(r, *g.shape[1:])
            real = g[rank * r : (rank + 1) * r]
            assert torch.equal(chunk[: real.shape[0]], real)
            assert torch.count_nonzero(chunk[real.shape[0] :]) == 0
            offset += chunk.numel()


def test_device_rules():
    cpu, cuda0, cuda1 = torch.device("cpu"), torch.device("cuda", 0), torch.device("cuda", 1)
    assert _device_usable(cpu, cpu)
    assert not _device_usable(cuda0, cpu)  # a CPU mesh cannot use an accelerator tensor
    assert _device_usable(cpu, cuda0)  # CPU parameters are moved shard by shard
    assert _device_usable(cuda0, cuda0)
    assert not _device_usable(cuda1, cuda0)


def test_no_process_group_and_no_mesh_is_a_clear_error():
    import torch.distributed as dist

    assert not dist.is_initialized()
    model = nn.Linear(4, 4)
    with pytest.raises(RuntimeError, match="init_process_group"):
        fully_shard(model)
    assert type(model) is nn.Linear and not hasattr(model, "_fsdp_state")


def test_importing_does_not_initialise_an_accelerator():
    import subprocess
    import sys

    code = "import fully_shard, torch; import sys; sys.exit(int(torch.cuda.is_initialized()))"
    assert subprocess.run([sys.executable, "-c", code]).returncode == 0


# factor -> (before, after) for a low-precision reduction: before is the smallest power of two p
# with factor / p <= p (dividing by it is exact; PyTorch's rule), after the rest.
SPLITS = {1: (1.0, 1.0), 2: (2.0, 1.0), 3: (2.0, 1.5), 4: (2.0, 2.0), 8: (4.0, 2.0), 16: (4.0, 4.0), 1000: (16.0, 62.5)}


@pytest.mark.parametrize("factor", sorted(SPLITS))
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_low_precision_divide_split(factor, dtype):
    from fully_shard.runtime.collectives import split_divide_factor

    assert split_divide_factor(float(factor), dtype) == SPLITS[factor]
    if dtype == torch.float16 and factor > 1:  # the oracle: PyTorch's fully_shard splits fp16 so
        from torch.distributed.fsdp._fully_shard._fsdp_collectives import _get_gradient_divide_factors

        assert _get_gradient_divide_factors(None, None, dtype, factor=float(factor))[:2] == SPLITS[factor]
    for wide in (torch.float32, torch.float64):  # divided once, after the sum
        assert split_divide_factor(float(factor), wide) == (1.0, float(factor))


@pytest.mark.parametrize("force_sum", [False, True])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16, torch.float64])
def test_reduction_plan(force_sum, dtype):
    """NCCL averages fp32/bf16 in-kernel unless forced to sum; everything else sums and divides."""
    import torch.distributed as dist

    from fully_shard.runtime.collectives import plan_reduction

    nccl = plan_reduction(8.0, dtype, rs_size=4, dp_size=8, native_avg=True, force_sum=force_sum)
    gloo = plan_reduction(8.0, dtype, rs_size=4, dp_size=8, native_avg=False, force_sum=force_sum)
    split = (4.0, 2.0) if dtype in (torch.bfloat16, torch.float16) else (1.0, 8.0)
    assert (gloo.name, gloo.op, gloo.all_reduce_op, (gloo.before, gloo.after)) == ("sum", dist.ReduceOp.SUM, dist.ReduceOp.SUM, split)
    if force_sum or dtype in (torch.float16, torch.float64):
        assert nccl == gloo
    else:
        assert (nccl.name, nccl.op, nccl.all_reduce_op, nccl.before, nccl.after) == ("avg", dist.ReduceOp.AVG, dist.ReduceOp.AVG, 1.0, 1.0)
        # A custom divide factor: AVG over the shard ranks when it equals them, else PreMulSum.
        assert plan_reduction(4.0, dtype, 4, 8, True, False).name == "avg"
        premul = plan_reduction(3.0, dtype, 4, 8, True, False)
        assert (premul.name, premul.all_reduce_op, premul.before, premul.after) == ("premul_sum", dist.ReduceOp.SUM, 1.0, 1.0)
    # One shard rank: the reduce-scatter (and a division inside it) is skipped, so we divide.
    assert plan_reduction(2.0, dtype, 1, 2, True, False).name == "sum"
