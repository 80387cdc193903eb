"""python benchmarks/padding.py [--out FILE]

What the dim-0 layout's padding costs at scale (issue #28 item 3), from the layout arithmetic the
engine itself uses (``fully_shard.layouts.layout.ShardLayout``: every rank sends ``rows =
ceil(n / W)`` rows of each parameter, padding included), for the 1.1B Llama (TinyLlama's shape,
``examples/plan_models.py:llama_1b``) and a 7B-shaped one (Llama 2 7B: dim 4096, 32 layers, MLP
11008, 32k vocabulary), built on the meta device, each block and the root one group, bf16
all-gathers and fp32 reduce-scatters as in the planner's tables:

* bytes one rank's all-gathers receive per step (each group once; forward and backward regathers
  double it) against the unpadded minimum (the parameters' own bytes): the ratio is the cost;
* the same for the reduce-scatters (a rank sends the padded unsharded gradients);
* the last column: the same all-gathers with ``fully_shard.flat_where_padded(W)`` as the
  ``shard_placement_fn`` (`FlatShard` for each matrix whose rows do not divide over the ranks);
* the same ratio is what rank 0 stores of the sharded state (parameters, gradients, optimizer
  state: it holds ``rows`` real rows of each parameter, later ranks fewer) against numel / W, and
  what the padded unsharded buffers (the all-gather output, the reduce-scatter input) hold
  beyond the parameters.

The planner's table (docs/planning.md, 1.1B at 4,096 ranks: 15.0 vs 8.7 GiB per step at 512
ranks) counts the same bytes plus the regathers.
"""

from __future__ import annotations

import argparse
import os
import sys

import torch

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "examples"))
from llama_model import Llama, LlamaConfig  # noqa: E402

from fully_shard.layouts.layout import ShardLayout  # noqa: E402

WORLDS = [512, 1024, 2048, 4096, 8192, 10000]
MODELS = {
    "Llama 1.1B": LlamaConfig(vocab_size=32000, dim=2048, n_layers=22, n_heads=16, hidden_dim=5632, max_seq_len=2048),
    "Llama 7B-shaped": LlamaConfig(vocab_size=32000, dim=4096, n_layers=32, n_heads=32, hidden_dim=11008,
                                   max_seq_len=4096),
}


def groups_of(model: Llama) -> list[list[torch.Tensor]]:
    """Each block's parameters, then the root's own (embedding/output, final norm)."""
    blocks = [list(layer.parameters()) for layer in model.layers]
    inside = {id(p) for b in blocks for p in b}
    root = [p for p in model.parameters() if id(p) not in inside]
    return blocks + [root]


def padded_elements(shape: torch.Size, world: int) -> int:
    return ShardLayout(shape, 0, world, 0).shard_numel * world


def flat_elements(p: torch.Tensor, world: int) -> int:
    """Under ``fully_shard.flat_where_padded(world)``: `FlatShard` (the parameter flattened,
    ``ceil(numel / W)`` elements per rank) where dim 0 pads, the dim-0 layout elsewhere."""
    if p.dim() > 1 and p.shape[0] % world:
        return ShardLayout(torch.Size([p.numel()]), 0, world, 0).shard_numel * world
    return padded_elements(p.shape, world)


def measure(cfg: LlamaConfig, world: int) -> dict:
    with torch.device("meta"):
        model = Llama(cfg)
    numel = padded = flat = 0
    worst = (0.0, "")
    for group in groups_of(model):
        for p in group:
            n, pad = p.numel(), padded_elements(p.shape, world)
            numel, padded, flat = numel + n, padded + pad, flat + flat_elements(p, world)
            worst = max(worst, (pad / n, f"{tuple(p.shape)}"))
    return {"numel": numel, "padded": padded, "flat": flat, "worst": worst}


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--out", default=None)
    args = p.parse_args()
    lines = ["| model | ranks | all-gather GiB per pass (bf16), padded / minimum | reduce-scatter GiB (fp32), padded / minimum | "
             "ratio | unsharded buffers' padding | worst parameter (ratio) | FlatShard where padded: all-gather GiB, "
             "ratio |",
             "|---|---|---|---|---|---|---|---|"]
    for name, cfg in MODELS.items():
        for world in WORLDS:
            r = measure(cfg, world)
            ratio = r["padded"] / r["numel"]
            ag, ag_min = 2 * r["padded"] / 2**30, 2 * r["numel"] / 2**30
            rs, rs_min = 4 * r["padded"] / 2**30, 4 * r["numel"] / 2**30
            lines.append(f"| {name} | {world} | {ag:.2f} / {ag_min:.2f} | {rs:.2f} / {rs_min:.2f} | {ratio:.3f}x | "
                         f"+{(ratio - 1) * 100:.0f}% | {r['worst'][1]} ({r['worst'][0]:.2f}x) | "
                         f"{2 * r['flat'] / 2**30:.2f}, {r['flat'] / r['numel']:.4f}x |")
    table = "\n".join(lines) + "\n"
    print(table)
    if args.out:
        with open(args.out, "w") as f:
            f.write(table)


if __name__ == "__main__":
    main()
