"""Compatibility layers: other MoE libraries' public APIs, built on :class:`flexmoe.MoELayer`.

``flexmoe.compat.tutel`` offers Tutel's ``moe``, ``system`` and ``net`` modules, so that code written against
``tutel`` moves over by changing one import line (see the README, "Coming from Tutel").
"""
