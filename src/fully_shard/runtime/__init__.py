"""The runtime: the engine that moves parameters between their sharded and unsharded forms.

Owns: per-module state and its lifecycle (`state.FSDPState`, the tables `state.MODULE` /
`state.ITERATION`, `lifecycle`), per-root state (`state.RootContext`), parameter groups
(`param_group.FSDPParamGroup`, one all-gather and one reduce-scatter each) and buckets of them
(`bucket`), one parameter's forms (`param.FSDPParam`), all-gather extensions (`extension`),
collectives as values and their observers (`collective`), where collectives run (`comm`: streams
on accelerators, async work on CPU), the flat-buffer copies and reductions (`collectives`),
which FSDPParam manages a tensor (`registry`), the watchdog, deepcopy support (`copying`) and where
offloaded shards live (`host`).

May import: `layouts`. Features, the API and tools attach to it through its interfaces
(`CommContext.observers`, `RootContext.gradient_check`, `FSDPState.setup_root`), never the reverse.
"""
