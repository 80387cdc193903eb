"""Tied parameters across ``fully_shard`` calls: the embedding and the output projection sharded
separately (either first), or the projection left to the root. The shared weight is managed once
(by the first call) and gradients from both uses are reduced: training equals the single-process
reference, and the weights stay tied."""

from __future__ import annotations

import copy

import pytest
import torch

from llama_model import Llama
from rank_utils import cpu_mesh
from _parity import LLAMA_LR, STEPS, _llama_loss, _train_pair, check, llama64, llama_batch

LAYOUTS = ["embedding_first", "output_first", "output_in_root"]


def shard_tied(model: Llama, layout: str, reshard: bool) -> None:
    from fully_shard import fully_shard

    mesh = cpu_mesh()
    if layout == "embedding_first":
        fully_shard(model.tok_embeddings, mesh=mesh, reshard_after_forward=reshard)
        fully_shard(model.output, mesh=mesh, reshard_after_forward=reshard)
    elif layout == "output_first":
        fully_shard(model.output, mesh=mesh, reshard_after_forward=reshard)
        fully_shard(model.tok_embeddings, mesh=mesh, reshard_after_forward=reshard)
    else:
        fully_shard(model.tok_embeddings, mesh=mesh, reshard_after_forward=reshard)
    for layer in model.layers:
        fully_shard(layer, mesh=mesh, reshard_after_forward=reshard)
    fully_shard(model, mesh=mesh)


def _tied_parity(layout: str, reshard: bool) -> dict:
    from fully_shard import debug

    torch.manual_seed(0)
    model = llama64()
    ref = copy.deepcopy(model)
    shard_tied(model, layout, reshard)
    assert model.output.weight is model.tok_embeddings.weight
    with debug.trace() as t:
        out = _train_pair(model, ref, llama_batch, _llama_loss, STEPS, LLAMA_LR)
    out["tied"] = model.output.weight is model.tok_embeddings.weight
    owner = "output" if layout == "output_first" else "tok_embeddings"
    out["owner_gathers"] = t.count(op="all_gather", step=0, module=owner)
    out["owner_reduces"] = t.count(op="reduce_scatter", step=0, module=owner)
    return out


@pytest.mark.parametrize("world_size", [1, 2, 4])
@pytest.mark.parametrize("layout", LAYOUTS)
@pytest.mark.parametrize("reshard", [True, False])
def test_tied_embedding_across_calls_matches_single_process(ranks, world_size, layout, reshard):
    results = ranks(world_size).run(_tied_parity, layout, reshard)
    check(results, f"tied {layout} reshard={reshard}")
    # Owner-group collectives in step 0 (world 1 issues none). Resharded between uses, the owner
    # gathers for each forward use and once for backward; output_first gathers once more in
    # backward (autograd runs the shared AccumulateGrad only after both uses, so the owner's
    # post-backward finds no gradient yet and reshards; see docs/composability.md).
    gathers = {
        ("embedding_first", True): 3, ("embedding_first", False): 1,
        ("output_first", True): 4, ("output_first", False): 2,
        ("output_in_root", True): 1, ("output_in_root", False): 1,  # the root keeps it for both uses
    }[(layout, reshard)]
    for r in results:
        print(f"  owner group: {r['owner_gathers']} all-gathers, {r['owner_reduces']} reduce-scatters in step 0")
        assert r["tied"]
        assert r["owner_gathers"] == (gathers if world_size > 1 else 0)
        assert r["owner_reduces"] == (1 if world_size > 1 else 0)
