"""Tools for looking at a run (with `fully_shard.debug` and the planner `fully_shard.plan`).

Owns: the dispatch mode that reports DTensor's own collectives to a trace (`funcol_trace`), and
live-byte counting by category (`memory`), shared by ``debug.trace(memory=True)`` and the planner.

May import: `layouts`, `runtime`, `features`, `api`.
"""
