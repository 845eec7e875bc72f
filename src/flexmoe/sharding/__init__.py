"""Model-level sharding: a whole model laid over many ranks, above the MoE layer.

:mod:`flexmoe.parallel` spreads one layer's experts over ranks (expert parallelism: layouts, all-to-all, the
execution strategies); this package takes the model that holds such layers and lays all of it on a device mesh
(docs/architecture.md, "Models larger than one rank"):

* :mod:`~flexmoe.sharding.mesh`: the device mesh, dims ``dp_replicate``, ``dp_shard``, ``ep`` (:func:`make_mesh`);
* :mod:`~flexmoe.sharding.fsdp`: FSDP2 with expert parallelism (:func:`parallelize`), with the collectives
  overlapped on gloo (:mod:`~flexmoe.sharding.fsdp_overlap`);
* :mod:`~flexmoe.sharding.ddp`: DDP that leaves the experts alone (:func:`wrap_ddp`);
* :mod:`~flexmoe.sharding.materialize`: a model built on the meta device, allocated and initialised per rank;
* :mod:`~flexmoe.sharding.dcp`: DCP checkpoints that load at any mesh (:func:`save_sharded`, :func:`load_sharded`);
* :mod:`~flexmoe.sharding.optim`: optimizer groups of one kind of tensor each (:func:`split_expert_groups`);
* :mod:`~flexmoe.sharding.memory`: the bytes of training state one rank holds (:func:`local_state_bytes`);
* :mod:`~flexmoe.sharding.model_experts`: which parameters are experts (:func:`expert_parameters`), the search
  all of the above share.

The layer's level (:mod:`flexmoe.layer` and what it imports, :mod:`flexmoe.parallel` among them) never imports
this package, so the modules here import :class:`~flexmoe.MoELayer` at module level. Until the next release
:mod:`flexmoe.parallel` still offers these names and modules, re-exported from here.
"""

from flexmoe.sharding.dcp import load_sharded, save_sharded
from flexmoe.sharding.ddp import expert_parameter_names, wrap_ddp
from flexmoe.sharding.fsdp import default_blocks, parallelize, place_experts
from flexmoe.sharding.materialize import allocate, materialize, reset_module
from flexmoe.sharding.memory import local_state_bytes
from flexmoe.sharding.mesh import MESH_DIMS, make_mesh
from flexmoe.sharding.model_experts import expert_parameters, named_moe_layers
from flexmoe.sharding.optim import split_expert_groups

__all__ = [
    "MESH_DIMS",
    "make_mesh",
    "parallelize",
    "place_experts",
    "default_blocks",
    "expert_parameter_names",
    "wrap_ddp",
    "materialize",
    "allocate",
    "reset_module",
    "save_sharded",
    "load_sharded",
    "split_expert_groups",
    "local_state_bytes",
    "expert_parameters",
    "named_moe_layers",
]
