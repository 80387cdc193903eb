"""The runtime: the engine that moves parameters between their sharded and unsharded forms.

Owns: per-module and per-root state and their lifecycles (`state`, `lifecycle`, `settings`), parameter
groups and their buckets (`param_group`, `bucket`), one parameter's forms (`param`, all-gather
`extension`s), collectives and where they run (`collective`, `comm`, `collectives`), which FSDPParam
manages a tensor (`registry`), the `watchdog`, deepcopy (`copying`) and offloaded shards (`host`).

May import: `layouts`. Features, the API and tools attach through its interfaces
(`CommContext.observers`, `RootContext.gradient_check`, `FSDPState.setup_root`), never the reverse.
"""
