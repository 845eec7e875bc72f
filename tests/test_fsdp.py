"""flexmoe.parallel.parallelize: FSDP2 with expert parallelism on one device mesh (docs/architecture.md, "Models
larger than one rank").

The multi-rank cases run scenarios of tests/fsdp_worker.py as real gloo processes (tests/multiproc.py); their
reference is one process holding every expert, running each rank's batch, its loss the mean of the ranks'.
"""

from __future__ import annotations

from collections.abc import Callable

import pytest
import torch
from torch import nn

from flexmoe.apps.models.gpt import GPT, GPTConfig
from flexmoe.parallel import default_blocks, local_state_bytes, make_mesh
from multiproc import Scenario, failures_of, run_scenario


def _state_within_bound(reports: list[dict]) -> None:
    for rep in reports:
        for tag, held in rep["state_bytes"].items():
            bound = rep["bound"][tag]
            assert held <= bound, f"rank {rep['rank']} {tag}: holds {held} bytes of state, bound {bound:.0f}"


def _cases(n: int) -> Callable[[list[dict]], None]:
    def check(reports: list[dict]) -> None:
        assert all(rep.get("cases") == n for rep in reports), [rep.get("cases") for rep in reports]
        _state_within_bound(reports)
    return check


CASES = [
    pytest.param(Scenario("fsdp_gpt", 2, "ep=2 with FSDP (and activation checkpointing): 10 AdamW steps of the GPT "
                          "equal one process's losses and weights"), _cases(2), id="fsdp_gpt-w2"),
    pytest.param(Scenario("fsdp_gpt", 4, "ep=2 x dp_shard=2 and ep=4: 10 AdamW steps of the GPT equal one process's "
                          "losses and weights", timeout=400.0, collective_timeout=60.0), _cases(2),
                 id="fsdp_gpt-w4", marks=pytest.mark.slow),
    pytest.param(Scenario("fsdp_features", 2, "r=0, overlap, shadowing, pairwise, auto, bias balance and dropless "
                          "routing under parallelize equal one process", timeout=300.0), _cases(7),
                 id="fsdp_features-w2", marks=pytest.mark.slow),
    pytest.param(Scenario("fsdp_errors", 2, "parallelize refuses what it cannot do, naming it"), None,
                 id="fsdp_errors-w2"),
]


@pytest.mark.parametrize(("case", "check"), CASES)
def test_scenario(case: Scenario, check: Callable[[list[dict]], None] | None) -> None:
    reports = run_scenario(case)
    failures = failures_of(reports, case.ranks)
    assert not failures, f"{case.claim}:\n" + "\n".join(failures)
    if check is not None:
        check(reports)


def test_local_state_bytes_counts_parameters_gradients_and_adamw_states() -> None:
    model = nn.Sequential(nn.Linear(3, 4), nn.Linear(4, 2, bias=False))
    opt = torch.optim.AdamW(model.parameters())
    assert local_state_bytes(model, opt) == 4 * (12 + 4 + 8)  # no gradient, no state yet
    model(torch.ones(1, 3)).sum().backward()
    opt.step()
    # parameter + gradient + exp_avg + exp_avg_sq, float32; a 0-d float32 step per parameter
    assert local_state_bytes(model, opt) == 4 * 4 * (12 + 4 + 8) + 3 * 4


def test_default_blocks_are_the_gpt_blocks() -> None:
    model = GPT(GPTConfig(n_layer=3, n_embd=16, n_head=2, num_experts=4, expert_hidden=8))
    assert default_blocks(model) == list(model.blocks)


def test_make_mesh_needs_torch_distributed() -> None:
    with pytest.raises(RuntimeError, match="init_process_group"):
        make_mesh(ep=2)
