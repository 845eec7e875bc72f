"""``flexmoe bench``: every benchmark of the project, one module per kind of measurement.

The modules import one another in one direction only (tests/test_import_graph.py checks that no module of
flexmoe reaches itself through its imports); each imports only modules listed before it:

* :mod:`~flexmoe.apps.bench.timing`: cases timed side by side, activation bytes (nothing of flexmoe);
* :mod:`~flexmoe.apps.bench.suite`: the suite's checks, settings and runners (targets by module name only);
* :mod:`~flexmoe.apps.bench.config`: :class:`BenchConfig`, and the layer, inputs and floor built from it;
* :mod:`~flexmoe.apps.bench.layer`: one layer against the floor and peers; the "layer" group;
* :mod:`~flexmoe.apps.bench.families`: DeepSeek-style routing against plain top-k (``--families``);
* :mod:`~flexmoe.apps.bench.fine`: the "fine-grained" and "decode" groups;
* :mod:`~flexmoe.apps.bench.compile`: the "compile" group;
* :mod:`~flexmoe.apps.bench.hf`: Hugging Face blocks (``--hf``; the parts in ``hf_blocks``, ``hf_timing``,
  ``hf_steps``), the "hf" and "decode-hf" groups (``hf_checks``);
* :mod:`~flexmoe.apps.bench.distributed`: every expert-parallel setting over ranks (``--nproc``);
* :mod:`~flexmoe.apps.bench.ep`: the "expert-parallel" group, launching :mod:`distributed`'s ranks;
* :mod:`~flexmoe.apps.bench.cli`: the command's flags and ``run``.

This file imports none of them, so that importing one module (a suite check's process runs
``python -m flexmoe.apps.bench.suite``) loads only what that module needs.
"""
