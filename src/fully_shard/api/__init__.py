"""The public API: what users call, and the checks of what they pass.

Owns: `sharding.fully_shard` / `sharding.replicate` (validate everything, then build the runtime
objects and install the hooks), `module.FSDPModule` (the methods a sharded module gains: unshard,
reshard, the ``set_*`` settings), `unsharded.unsharded`, `clip.clip_grad_norm_`, which parameters
a call manages and the refusals of bad input (`discovery`), and the data-parallel sub-mesh of a
full SPMD mesh (`spmd`).

May import: `layouts`, `runtime`, `features`, `fully_shard.quant`.
"""
