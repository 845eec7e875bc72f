"""flexmoe imports on a torch without FSDP2's per-parameter mesh (torch 2.11, the CUDA machines' torch when this was
written), and only parallelize, which needs it, says so by name."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

SRC = Path(__file__).resolve().parents[1] / "src"

# Removes the private symbol before flexmoe is imported, as on torch 2.11.
_WITHOUT_PER_PARAMETER_MESH = """
import sys
sys.path.insert(0, {src!r})
import torch
from torch.distributed.fsdp._fully_shard import _fsdp_common
del _fsdp_common.ShardPlacementResult
import flexmoe
from flexmoe import MoELayer
from flexmoe.sharding import parallelize
layer = MoELayer(8, 4, 16, group="single", k=2)
y = layer(torch.randn(5, 8))
assert y.shape == (5, 8), y.shape
try:
    parallelize(layer, None)
except RuntimeError as e:
    print("REFUSED:", e)
"""


def test_imports_and_runs_without_per_parameter_mesh_and_parallelize_names_what_is_missing() -> None:
    done = subprocess.run([sys.executable, "-c", _WITHOUT_PER_PARAMETER_MESH.format(src=str(SRC))],
                          capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr
    assert "REFUSED: flexmoe.sharding.parallelize needs FSDP2's per-parameter mesh" in done.stdout
    assert torch_version_named(done.stdout)


def torch_version_named(text: str) -> bool:
    import torch

    return f"torch {torch.__version__} lacks" in text
