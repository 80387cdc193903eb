"""Layouts and meshes: pure descriptions of how things are sharded, no runtime state.

Owns: the policies (`policy.MixedPrecisionPolicy`, `OffloadPolicy`, `CPUOffloadPolicy`), the
layout arithmetic of one parameter's shard (`layout.ShardLayout`), meshes and their process
groups (`mesh.MeshInfo`, the smaller groups of ``reshard_after_forward=int``), and how a
tensor-parallel parameter was distributed (`tp.TPSpec`).

May import: torch only (nothing else of fully_shard).
"""
