"""Moved to :mod:`flexmoe.sharding.mesh`; this path re-exports it for one release.

Import from :mod:`flexmoe.sharding.mesh` instead."""

from flexmoe.sharding.mesh import MESH_DIMS, full_mesh, make_mesh, mesh_sizes

__all__ = ["MESH_DIMS", "make_mesh", "full_mesh", "mesh_sizes"]
