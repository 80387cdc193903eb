"""Layouts and meshes: pure descriptions of how things are sharded, no runtime state.

Owns: the policies (`policy`), one parameter's shard arithmetic (`layout.ShardLayout`), meshes and
their process groups (`mesh.MeshInfo`, the subgroups of ``reshard_after_forward=int``), and how a
tensor-parallel parameter was distributed (`tp.TPSpec`).

May import: torch only (nothing else of fully_shard).
"""
