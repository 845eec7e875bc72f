"""Tutel's public API on flexmoe: ``from flexmoe.compat.tutel import moe, system, net``.

Code written for Tutel (``from tutel import moe, system, net``) runs with only its import line changed:

* :mod:`~flexmoe.compat.tutel.moe`: ``moe_layer`` with Tutel's arguments, parameter names, shapes and seeded
  initialisation, running on :class:`flexmoe.MoELayer` (CPU or GPU, pure Python).
* :mod:`~flexmoe.compat.tutel.system`: ``init_data_model_parallel``, ``apply_rank_size_from_pattern``, ...
* :mod:`~flexmoe.compat.tutel.net`: the collectives Tutel's examples use (``simple_all_reduce``,
  ``zero_gather``, ...).
* :mod:`~flexmoe.compat.tutel.convert`: Tutel checkpoints (one file or one per rank) to and from
  ``MoELayer`` state dicts.

Where Tutel's code and its documentation disagree, this package follows the documentation; every such place
is listed in ``docs/tutel_compat.md``.
"""

from flexmoe.compat.tutel import convert, moe, net, system

__all__ = ["moe", "system", "net", "convert"]
