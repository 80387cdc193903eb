"""Composability (issue #5, in part): activation checkpointing with sharded blocks, trained
against the single-process reference, with the trace confirming recomputation re-gathers
nothing it does not need."""

from __future__ import annotations

import copy

import pytest
import torch
from torch.utils.checkpoint import checkpoint

from llama_model import Llama, LlamaConfig
from rank_utils import cpu_mesh
from test_parity import LLAMA_LR, TOL, _llama_loss, _train_pair, llama_batch


class CheckpointedLlama(Llama):
    """torch.utils.checkpoint (non-reentrant) around all blocks at once: the recompute in
    backward runs every sharded block's forward again."""

    def forward(self, tokens):
        h = self.tok_embeddings(tokens)

        def blocks(x):
            for layer in self.layers:
                x = layer(x)
            return x

        h = checkpoint(blocks, h, use_reentrant=False)
        return self.output(self.norm(h))


def _ac(kind: str) -> dict:
    from torch.distributed.algorithms._checkpoint.checkpoint_wrapper import checkpoint_wrapper

    from fully_shard import debug, fully_shard

    torch.manual_seed(0)
    cfg = LlamaConfig(n_layers=3)
    model = CheckpointedLlama(cfg) if kind == "over_blocks" else Llama(cfg)
    ref = copy.deepcopy(model)
    if kind == "wrapper_per_block":
        for i, layer in enumerate(model.layers):
            model.layers[i] = checkpoint_wrapper(layer)
    for layer in model.layers:
        fully_shard(layer, mesh=cpu_mesh())
    fully_shard(model, mesh=cpu_mesh())
    with debug.trace() as t:
        result = _train_pair(model, ref, llama_batch, _llama_loss, 5, LLAMA_LR)
    last = t.step
    result["backward_all_gathers"] = sum(1 for r in t.select(op="all_gather", step=last) if r.phase != "forward")
    result["block_reduces_in_backward"] = sum(
        1 for r in t.select(op="reduce_scatter", step=last, phase="backward") if r.module.startswith("layers")
    )
    return result


@pytest.mark.parametrize("world_size", [1, 2, 4])
@pytest.mark.parametrize("kind", ["wrapper_per_block", "over_blocks"])
def test_activation_checkpointing(ranks, world_size, kind):
    for r in ranks(world_size).run(_ac, kind):
        assert r["loss_diff"] <= TOL and r["param_diff"] <= TOL, r
        # One all-gather per resharded block in backward, none for the recompute itself; each
        # block reduces as soon as its gradients exist (not at the end of backward).
        assert r["backward_all_gathers"] == 3 and r["block_reduces_in_backward"] == 3, r
