"""A real client under the whole-model compile (issue #27): transformers' ``LlamaForCausalLM``
(tied embeddings, its own loss), each decoder layer and the root sharded by ``fully_shard``, then
``model.compile(fullgraph=True)`` or a compiled loss function, as its users train it. One graph,
no graph break, the all-gathers in the forward graph and the reduce-scatters in the backward one,
training equal to our eager run to the bit (aot_eager) and to an unsharded float64 replica within
float64 rounding.

The model uses transformers' "eager" attention. With its default, "sdpa", compiled and eager
runs differ in the last bits of the attention weights' gradients without any sharding too:
AOTAutograd traces SDPA's backward, eager runs the fused CPU kernel (docs/compile.md)."""

from __future__ import annotations

import copy

import pytest
import torch

from _parity import TOL64
from rank_utils import cpu_mesh, world
from test_traced import AG, RS, _capturing_backend, _count, _fresh_compiler


def _hf_llama(attention: str = "eager", checkpointing: str = ""):
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(0)
    config = LlamaConfig(
        vocab_size=128, hidden_size=40, intermediate_size=112, num_hidden_layers=2, num_attention_heads=4,
        num_key_value_heads=4, max_position_embeddings=64, tie_word_embeddings=True, use_cache=False,
    )
    config._attn_implementation = attention
    model = LlamaForCausalLM(config).double()
    if checkpointing == "hf":  # each decoder layer's forward under torch.utils.checkpoint (non-reentrant)
        model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
    elif checkpointing == "wrapper":  # torchtitan's order: checkpoint_wrapper, then fully_shard on it
        from torch.distributed.algorithms._checkpoint.checkpoint_wrapper import checkpoint_wrapper

        for i, layer in enumerate(model.model.layers):
            model.model.layers[i] = checkpoint_wrapper(layer)
    return model


def _loss(model, ids):
    return model(input_ids=ids, labels=ids).loss


def _hf_compiled(form: str, checkpointing: str = "") -> dict:
    from torch._dynamo.utils import counters

    from fully_shard import fully_shard

    _fresh_compiler()
    rank, w = world()
    reference = _hf_llama(checkpointing=checkpointing)
    runs = {}
    for mode in ("eager", "compiled"):
        model = copy.deepcopy(reference)
        for layer in model.model.layers:
            fully_shard(layer, mesh=cpu_mesh())
        fully_shard(model, mesh=cpu_mesh())
        # eager reduces one group at a time, as the graph: at 3+ ranks gloo's order follows the
        # buffer's layout, and a bucket lays several groups out in one (test_traced: _NO_BUCKETS)
        model.set_bucket_bytes(0)
        runs[mode] = model
    graphs: dict = {}
    backend = _capturing_backend(graphs)
    if form == "model":
        runs["compiled"].compile(backend=backend, fullgraph=True)
        steps = {"eager": _loss, "compiled": _loss}
    else:
        steps = {"eager": _loss, "compiled": torch.compile(_loss, backend=backend, fullgraph=True)}
    models = {**runs, "reference": reference}
    opts = {k: torch.optim.AdamW(m.parameters(), lr=1e-2) for k, m in models.items()}
    losses: dict = {k: [] for k in models}
    for step in range(3):
        ids = torch.randint(0, 128, (2 * w, 16), generator=torch.Generator().manual_seed(step))
        for k, model in models.items():
            if k == "reference":  # the whole batch's mean loss (each rank's rows are equally many)
                loss = _loss(model, ids)
            else:
                loss = steps[k](model, ids.chunk(w)[rank])
            loss.backward()
            opts[k].step()
            opts[k].zero_grad()
            losses[k].append(loss.detach())
    params = {k: [p.full_tensor() for p in runs[k].parameters()] for k in runs}
    full = [p.detach() for p in reference.parameters()]
    fw, bw = graphs["fw"][0], graphs["bw"][0]
    # What the forward keeps for backward (the backward graph's inputs): a full-size weight there
    # was not resharded (at world 1 the shards are full-size: not counted)
    full_shapes = {tuple(p.shape) for p in reference.parameters() if p.dim() == 2}
    saved = [n.meta["val"] for n in bw.graph.nodes
             if n.op == "placeholder" and "val" in n.meta and not n.name.startswith("tangents")]
    return {
        "saved_full_params": sum(1 for t in saved if tuple(getattr(t, "shape", ())) in full_shapes) if w > 1 else 0,
        "graphs": counters["stats"]["unique_graphs"],
        "breaks": sum(counters["graph_break"].values()),
        "fw_ag": _count(fw, AG), "bw_rs": _count(bw, RS), "bw_ag": _count(bw, AG),
        "equal": all(torch.equal(a, b) for a, b in zip(losses["eager"], losses["compiled"]))
        and all(torch.equal(a, b) for a, b in zip(params["eager"], params["compiled"])),
        "reference_diff": max((a - b).abs().max().item() for a, b in zip(params["compiled"], full)),
        "tied": runs["compiled"].lm_head.weight is runs["compiled"].model.embed_tokens.weight,
    }


@pytest.mark.parametrize("form,world_size,checkpointing", [
    ("model", 1, ""), ("step", 2, ""), ("model", 4, ""),
    ("model", 1, "hf"), ("model", 2, "hf"), ("step", 4, "hf"), ("model", 2, "wrapper"),
])
def test_transformers_llama_compiled_whole_equals_eager(ranks, form, world_size, checkpointing):
    """``checkpointing``: "hf", transformers' gradient checkpointing (``gradient_checkpointing_enable()``,
    each decoder layer's forward inside ``torch.utils.checkpoint``); "wrapper", each layer in
    torch's ``checkpoint_wrapper``, sharded as the wrapper (torchtitan's order). Until 2026-11-28 dynamo refused
    it with ``fullgraph=True`` ("HOP: Non-nullified side effect": the parameters were gathered where
    first read, inside the checkpointed region, writing the state's per-forward dict) and, without,
    the forward raised mixing Tensors and DTensors; now each module's groups are gathered by its
    pre-forward hook, outside the region."""
    collectives = world_size > 1  # (at world 1 the traced gather returns the shard itself)
    for r in ranks(world_size).run(_hf_compiled, form, checkpointing):
        print(f"{form} world {world_size} checkpointing={checkpointing}: {r}")
        assert r["graphs"] == 1 and r["breaks"] == 0, r
        # one all-gather per group (2 layers, the root) forward; backward regathers the layers
        # (resharded: the default of a nested call), the root's are kept; one reduce-scatter each
        assert (r["fw_ag"], r["bw_ag"], r["bw_rs"]) == ((3, 2, 3) if collectives else (0, 0, 0)), r
        # kept for backward: the root's (tied) embedding only; the layers' weights are gathered
        # again, inside the checkpointed region's recompute too (the sizes are chosen so that no
        # shard or activation has a weight's shape)
        assert r["saved_full_params"] == (1 if collectives else 0), r
        assert r["equal"] and r["tied"], r
        assert r["reference_diff"] <= TOL64, r


def _checkpointed_calls() -> list[int]:
    """Calls of each decoder layer's MLP in one forward and after its backward, transformers'
    gradient checkpointing on, each layer and the root sharded (eager)."""
    from fully_shard import fully_shard

    rank, w = world()
    model = _hf_llama(checkpointing="hf")
    calls: list[int] = []
    for layer in model.model.layers:
        layer.mlp.register_forward_pre_hook(lambda module, args: calls.append(1))
        fully_shard(layer, mesh=cpu_mesh())
    fully_shard(model, mesh=cpu_mesh())
    ids = torch.randint(0, 128, (2 * w, 16), generator=torch.Generator().manual_seed(0))
    loss = _loss(model, ids.chunk(w)[rank])
    forward = len(calls)
    loss.backward()
    return [forward, len(calls)]


@pytest.mark.parametrize("world_size", [1, 2, 4])
def test_transformers_gradient_checkpointing_recomputes_each_sharded_layer(ranks, world_size):
    """transformers wraps each ``GradientCheckpointingLayer`` subclass's forward, the class
    ``fully_shard`` makes included, and checkpoints in the outermost wrapper only: the class's own
    forward must be wrapped, not set over the wrapper (7f891c9 did: no layer recomputed, nothing
    said). Each of the two layers' MLP runs once in forward and once more in backward."""
    for r in ranks(world_size).run(_checkpointed_calls):
        assert r == [2, 4], r
