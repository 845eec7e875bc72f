"""scripts/lock.py: the lock that `make setup` installs from and checks against, and the lower bounds that
`make test-oldest` pins. The references are the lines written out here by hand."""

from __future__ import annotations

import importlib.util
import tomllib
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
_spec = importlib.util.spec_from_file_location("lock_script", ROOT / "scripts" / "lock.py")
assert _spec is not None and _spec.loader is not None
lock = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(lock)

FREEZE = """\
Jinja2==3.1.6
torch==2.13.0+cpu
-e git+https://example.invalid/flexmoe.git@abc#egg=flexmoe
# Editable install with no version control (flexmoe==0.1.0)
typing_extensions==4.16.0
pip==26.3
"""


def test_a_freeze_becomes_sorted_normalized_release_pins() -> None:
    text = lock.lock_text(FREEZE.splitlines())
    pins = [line for line in text.splitlines() if not line.startswith("#")]
    assert pins == ["jinja2==3.1.6", "pip==26.3", "torch==2.13.0", "typing-extensions==4.16.0"]


def test_check_names_each_difference() -> None:
    locked = lock.parse_pins(["torch==2.13.0", "peft==0.22.0", "numpy==2.4.6"])
    installed = lock.parse_pins(["torch==2.13.0+cu126", "peft==0.21.0", "trl==1.0"])
    assert lock.differences(installed, locked) == [
        "numpy==2.4.6 is locked but not installed",
        "peft: installed 0.21.0, locked 0.22.0",
        "trl==1.0 is installed but not in the lock",
    ]
    assert lock.differences(lock.parse_pins(FREEZE.splitlines()), lock.parse_pins(FREEZE.splitlines())) == []


@pytest.mark.parametrize("line", ["torch>=2.6", "https://example.invalid/x.whl", "peft==0.2,<1", "==1.0"])
def test_a_lock_line_that_is_no_exact_pin_is_refused_by_name(line: str) -> None:
    with pytest.raises(ValueError, match=r"lock line .*expected 'name==version'"):
        lock.parse_pins([line])


def test_lower_bounds_of_the_declared_requirements() -> None:
    assert lock.lower_bounds(["torch>=2.6", "safetensors >= 0.4", "flexmoe[hf]", "uvicorn[standard]>=0.20",
                              "tomli>=2; python_version < '3.11'"]) == {
        "torch": "2.6", "safetensors": "0.4", "uvicorn": "0.20", "tomli": "2"}
    for bad in ["torch", "torch>=2.6,<3", "torch~=2.6", "torch==2.6"]:
        with pytest.raises(ValueError, match=r"expected 'name>=version'"):
            lock.lower_bounds([bad])


def test_every_dependency_of_the_project_has_a_lower_bound_that_test_oldest_pins() -> None:
    project = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]
    names = {lock.normalize(r.split(">=")[0].split("[")[0]) for extra in project["optional-dependencies"].values()
             for r in extra} | {lock.normalize(r.split(">=")[0]) for r in project["dependencies"]}
    pinned = lock.parse_pins(lock.oldest_constraints(ROOT / "pyproject.toml").splitlines())
    assert set(pinned) == names - {"flexmoe"}
    assert "torch" in pinned and "transformers" in pinned


def test_the_committed_lock_pins_every_package_exactly() -> None:
    pins = lock.parse_pins((ROOT / "requirements.lock").read_text().splitlines())
    assert {"torch", "transformers", "peft", "safetensors", "pip", "setuptools"} <= set(pins)
    assert all("+" not in v for v in pins.values())
