"""Model builders for ``python -m fully_shard.plan`` (each takes no arguments and returns the model;
the planner calls it under the meta device, so nothing is allocated).

    python -m fully_shard.plan examples/plan_models.py:llama_1b --input-shape 1x2048 --mesh 8 --mesh 512 --mesh 4096
"""

from __future__ import annotations

import os
import sys

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from llama_model import Llama, LlamaConfig  # noqa: E402


def llama_1b() -> Llama:
    """A 1.1B Llama (TinyLlama's shape: 22 layers, dim 2048, 32k vocabulary, 2k context)."""
    return Llama(LlamaConfig(vocab_size=32000, dim=2048, n_layers=22, n_heads=16, hidden_dim=5632, max_seq_len=2048))


def llama_small() -> Llama:
    """The examples' small Llama (tests and CI)."""
    return Llama(LlamaConfig())


def tp_shard(model: Llama, mesh) -> None:
    """Tensor parallel inside each block over ``mesh["tp"]`` (as ``examples/train_tp_fsdp.py``), then
    ``fully_shard`` over ``mesh["dp"]``: for ``--mesh-dim-names dp,tp --shard-fn ...:tp_shard``."""
    from torch.distributed.tensor.parallel import parallelize_module
    from train_tp_fsdp import BLOCK_PLAN

    from fully_shard import fully_shard

    for layer in model.layers:
        parallelize_module(layer, mesh["tp"], BLOCK_PLAN)
        layer.attention.n_heads //= mesh["tp"].size()  # each tp rank computes its share of the heads
        fully_shard(layer, mesh=mesh["dp"])
    fully_shard(model, mesh=mesh["dp"])


def flat_shard(model: Llama, mesh) -> None:
    """Each block, then the root, with `FlatShard` where dim 0 would pad over the shard ranks
    (``fully_shard.flat_where_padded``): for ``--shard-fn examples/plan_models.py:flat_shard``."""
    from fully_shard import fully_shard, flat_where_padded

    choose = flat_where_padded(mesh.size(-1))
    for layer in model.layers:
        fully_shard(layer, mesh=mesh, shard_placement_fn=choose)
    fully_shard(model, mesh=mesh, shard_placement_fn=choose)
