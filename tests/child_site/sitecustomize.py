"""Loaded by every Python process the tests start (tests/conftest.py puts this folder first on PYTHONPATH): the
child, a ``python -m flexmoe train`` say, picks the experts' kernels by the rule as the test process does
(conftest's ``kernels_by_rule``), so that a run in a child and one in the test process compute alike, and no
child times kernels or writes the machine's kernel cache.

Nothing is imported here: the rule is set when the child itself first imports ``flexmoe.experts.chooser``, so a
child that checks what importing flexmoe pulls in sees only its own imports."""

import sys
from importlib.machinery import PathFinder


class _KernelsByRule:
    """A finder that lets the normal one find ``flexmoe.experts.chooser`` and sets the rule once it has run."""

    def find_spec(self, name, path=None, target=None):
        if name != "flexmoe.experts.chooser":
            return None
        spec = PathFinder.find_spec(name, path)
        if spec is None or spec.loader is None:
            return spec
        run_module = spec.loader.exec_module

        def exec_module(module):
            run_module(module)
            module.KernelChooser.default_timer = None
            module.KernelChooser.default_cache_dir = None

        spec.loader.exec_module = exec_module
        return spec


sys.meta_path.insert(0, _KernelsByRule())
