"""The library imports without the extras (tqdm, matplotlib: the applications'; transformers: flexmoe.hf's)."""

from __future__ import annotations

import subprocess
import sys

# torch.hub imports tqdm whenever it is installed, so "not in sys.modules" can only be checked where the extras
# are absent: the child process hides them (any import of them fails, as on a plain `pip install flexmoe`).
_WITHOUT_EXTRAS = """
import sys

class HideExtras:
    def find_spec(self, name, path=None, target=None):
        if name.split(".")[0] in ("tqdm", "matplotlib", "transformers"):
            raise ModuleNotFoundError(f"No module named {name!r}")
        return None

sys.meta_path.insert(0, HideExtras())
import flexmoe, flexmoe.parallel, flexmoe.routing, flexmoe.tuning, flexmoe.checkpoint, flexmoe.sharding
assert not any(m in sys.modules for m in ("matplotlib", "tqdm", "transformers")), sorted(
    m for m in sys.modules if m.startswith(("tqdm", "matplotlib", "transformers")))
try:
    import flexmoe.hf
except ImportError as error:
    assert "pip install flexmoe[hf]" in str(error), error
else:
    raise AssertionError("flexmoe.hf imported without transformers")
layer = flexmoe.MoELayer(8, num_experts=4, hidden_dim=16, k=2)
import torch
print(tuple(layer(torch.randn(5, 8)).shape))
"""


def test_library_imports_and_runs_without_tqdm_matplotlib_or_transformers() -> None:
    result = subprocess.run([sys.executable, "-c", _WITHOUT_EXTRAS], capture_output=True, text=True, timeout=120)
    assert result.returncode == 0, result.stderr
    assert result.stdout.strip() == "(5, 8)"

