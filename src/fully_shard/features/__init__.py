"""Optional features and checks built on the runtime (`fully_shard.quant`, a codec, is one too).

Owns: per-parameter offload choosers (`offload`), the finite check (`finite`), the schedule check
(`schedule`: a per-root collective observer), the traps for silent mistakes (`traps`: an
optimizer built before ``fully_shard``), and `FlatShard` optimizer state in state dicts
(`flat_state`, put on by the traps' step pre-hook).

May import: `layouts`, `runtime`.
"""
