"""Every multi-rank scenario of the layer, one named pytest case each (gloo on 127.0.0.1, a free port per case).

Each case starts W processes running one scenario of tests/scenario_worker.py through the harness of
tests/multiproc.py; a scenario checks many settings inside one process group (starting processes costs seconds)
and reports what differs. The reference is one process holding all experts with the same global weights,
running each rank's tokens as its own batch (docs/architecture.md, the expert layout over ranks).
"""

from __future__ import annotations

from collections.abc import Callable

import pytest
import torch

from multiproc import Scenario, failures_of, run_scenario


def _many_cases(minimum: int) -> Callable[[list[dict]], None]:
    def check(reports: list[dict]) -> None:
        cases = [rep.get("cases") for rep in reports]
        assert all(c is not None and c >= minimum for c in cases), f"expected >= {minimum} cases per rank, ran {cases}"
    return check


def _auto_agrees(reports: list[dict]) -> None:
    assert len({rep["choice"] for rep in reports}) == 1, f"ranks chose different settings: {reports}"
    assert reports[0]["decisions"], "auto made no decision"
    # r=1 d=1 is timed sending tokens and sending rows (whole built-in experts).
    tried = reports[0]["tried"]
    assert "r=1 d=1 a2a=flat" in tried and "r=1 d=1 a2a=flat rows" in tried, tried
    # Sending tokens under auto: one all-gather of the counts per forward, not the chooser's and the route's.
    assert [rep["all_gathers_sending_tokens"] for rep in reports] == [1] * len(reports), reports


def _fails_fast(reports: list[dict]) -> None:
    assert reports[0]["seconds"] < 6.0 + 5.0, f"rank 0 took too long to fail: {reports[0]}"


def _shadowing_balances(reports: list[dict]) -> None:
    _many_cases(40)(reports[:1])
    report = reports[0]
    # The skewed router really is skewed: the two hot experts get about half of the routed rows.
    for share in report["hot_share"].values():
        assert 0.4 <= share <= 0.6, f"the skewed router is not skewed: hot share {report['hot_share']}"
    # Shadowing the hot experts lowers the busiest rank's load (both hot ones live on rank 0).
    load = report["load"]["E=8"]
    assert max(load["after"]) < max(load["before"]), f"shadowing did not lower the busiest rank's rows: {load}"


def _global_bias_matters(reports: list[dict]) -> None:
    assert any(rep["bias_differs_from_local_rule"] for rep in reports), "the global load made no difference"


def _bound_binds(reports: list[dict]) -> None:
    remote = [rep["remote"]["0.25"] for rep in reports]
    assert all(r[0] == r[1] == 20 for r in remote), f"share 0.25: [remote, budget, wanted] per rank {remote}"


# (scenario, a check of the reports beyond "no rank reported a failure")
CASES: list[tuple[Scenario, Callable[[list[dict]], None] | None]] = [
    *[(Scenario("ep_equivalence", w, "outputs and gradients equal one process (k=1,2; capacity and dropless; "
                "E>W and E<W sharded; every valid r; d in 1,2,4; flat and 2dh)", timeout=240), _many_cases(21))
      for w in (2, 4)],
    *[(Scenario("token_exchange", w, "r=1 d=1 sends each token once per rank (token_exchange=False and d=4: rows, "
                "counted): outputs, input, router and global expert gradients equal one process (float64 plain and "
                "float32 fused experts; k < W, k = E, capacity, skewed routing)", timeout=240), _many_cases(24))
      for w in (2, 4)],
    (Scenario("host_reads", 2, "one layer call (forward + backward; sending tokens and rows, flat, 2dh, d=2, "
              "dropless and capacity) reads the host once in the expert-parallel code, the count exchange's "
              "split sizes (dropless: its only read), and nothing in the backward; capacity=C (the padded exchange) "
              "reads nothing; outputs and gradients equal one process"),
     _many_cases(10)),
    *[(Scenario("evaluation", w, "evaluation (eval, no grad) where one rank's tokens overflow an expert and the "
                "others' do not: the ranks run the same exchanges and each output equals one process", timeout=120),
       _many_cases(12)) for w in (2, 4)],
    (Scenario("joined_gate_up", 2, "gated experts with joined_gate_up hold gate_up on every rank (whole experts or a "
              "hidden shard) and equal one process (outputs, input, router and global expert gradients; dropless "
              "and capacity; tokens and rows)"),
     _many_cases(8)),
    (Scenario("auto", 2, "parallel='auto' chooses one setting on every rank and stays exact"), _auto_agrees),
    (Scenario("ddp", 2, "a 2-rank DDP step equals the single-process step on the global batch"), None),
    (Scenario("mismatch", 2, "a mismatched config fails on every rank naming the option and the rank"), None),
    (Scenario("dead_rank", 2, "a rank that exits early gives rank 0 a clear timeout error", teardown=False,
              timeout=60, ranks=(0,)), _fails_fast),
    (Scenario("stalled_rank", 2, "a stalled rank gives rank 0 a clear error within the timeout", teardown=False,
              timeout=60, ranks=(0,)), _fails_fast),
    *[(Scenario("no_leak", w, "no exchange stays alive after forward + backward"), None) for w in (2, 4)],
    *[(Scenario("fastermoe_equivalence", w, "shadowing and the pairwise schedule equal one process (outputs, "
                "global expert gradients, skewed and uniform routing)", timeout=240), _shadowing_balances)
      for w in (2, 4)],
    *[(Scenario("fastermoe_errors", w, "unsupported shadowing/pairwise combinations raise clear ValueErrors",
                timeout=150), None) for w in (2, 4)],
    (Scenario("routing_ep", 2, "balance='bias' uses the global load; expert choice, BASE and shared experts equal "
              "one process", collective_timeout=20.0), _global_bias_matters),
    (Scenario("topology", 4, "4 ranks as 2 nodes: each rank sends at most floor(s*T*k) pairs to the other node, "
              "re-routed as the plain loop of tests/test_topology_gate.py does", collective_timeout=20.0),
     _bound_binds),
    *[(Scenario("families", w, "the open MoE families' options (sigmoid, groups with bias and scale, shared gate and "
                "hidden size, per-sequence capacity and loss, router bias, glu_limit on shards) equal one process, "
                "and the bias moves by the global load", collective_timeout=20.0, timeout=240), _many_cases(12))
      for w in (2, 4)],
]


# Four ranks on the 2-core CI machine take several times two ranks' time: the default suite runs every scenario at
# two ranks, the slow step at four as well.
@pytest.mark.parametrize("case,check", [
    pytest.param(case, check, id=case.id, marks=[pytest.mark.slow] if case.world > 2 else [])
    for case, check in CASES])
def test_scenario(case: Scenario, check: Callable[[list[dict]], None] | None) -> None:
    reports = run_scenario(case)
    failures = failures_of(reports, case.ranks)
    assert not failures, f"{case.id}: {case.claim}: {len(failures)} failures:\n" + "\n".join(failures[:30])
    if check is not None:
        check(reports)


def test_permute_rows_forward_and_gradient_match_indexing() -> None:
    """The reorder around the local experts: values and the gradient against plain indexing, in float64."""
    import torch

    from flexmoe.parallel.expert_parallel import permute_rows

    gen = torch.Generator().manual_seed(0)
    order = torch.randperm(37, generator=gen)
    inverse = torch.empty_like(order)
    inverse[order] = torch.arange(37)
    x = torch.randn(37, 5, generator=gen, dtype=torch.float64, requires_grad=True)
    weight = torch.randn(37, 5, generator=gen, dtype=torch.float64)
    got = permute_rows(x, order, inverse)
    want = torch.stack([x[int(i)] for i in order])
    assert torch.equal(got, want)
    (grad,) = torch.autograd.grad((got * weight).sum(), x)
    (want_grad,) = torch.autograd.grad((want * weight).sum(), x)
    assert torch.equal(grad, want_grad)
    empty = torch.zeros(0, dtype=torch.long)
    assert permute_rows(torch.zeros(0, 5), empty, empty).shape == (0, 5)


@pytest.mark.slow
def test_expert_parallel_on_the_device(device: torch.device) -> None:
    """Two ranks of expert parallelism on ``device`` against one CPU process in float64: gloo on the CPU, NCCL
    with one GPU per rank on CUDA."""
    if device.type == "cuda" and torch.cuda.device_count() < 2:
        pytest.skip(f"NCCL expert parallelism needs one GPU per rank: 2 ranks, {torch.cuda.device_count()} GPU here")
    case = Scenario("ep_on_device", 2, f"expert parallelism on {device.type} equals one process", timeout=240,
                    device_type=device.type)
    reports = run_scenario(case)
    failures = failures_of(reports)
    assert not failures, f"{case.id}: {case.claim}: {len(failures)} failures:\n" + "\n".join(failures[:30])
    assert [rep["device"] for rep in reports] == ([f"cuda:{r}" for r in range(2)] if device.type == "cuda"
                                                 else ["cpu", "cpu"])
    _many_cases(5)(reports)


@pytest.mark.slow
@pytest.mark.parametrize("world, backend", [(2, "gloo"), (1, None)], ids=["2 ranks over gloo", "1 rank"])
def test_expert_parallel_on_one_device(device: torch.device, world: int, backend: str | None) -> None:
    """Expert parallelism on a one-GPU machine: two ranks sharing ``device`` over gloo (CUDA tensors through gloo's
    all-to-all, all-gather and all-reduce), and one rank on the device's own backend (NCCL at world size 1 on
    CUDA), each against one CPU process in float64."""
    case = Scenario("ep_on_device", world, f"expert parallelism on one {device.type} device equals one process",
                    timeout=240, device_type=device.type, backend=backend)
    reports = run_scenario(case)
    failures = failures_of(reports)
    assert not failures, f"{case.id}: {case.claim}: {len(failures)} failures:\n" + "\n".join(failures[:30])
    want = "cuda:0" if device.type == "cuda" and torch.cuda.device_count() == 1 else None
    assert all(rep["device"] == (want or rep["device"]) and rep["device"].startswith(device.type) for rep in reports)
    assert all(rep["cases"] >= 3 for rep in reports)


def test_host_copy_reads_the_host_once(device: torch.device) -> None:
    """An exchange's split sizes: one copy of the ``[W, C]`` counts, started at once (on CUDA pinned and
    non-blocking) and read by the first ``tolist``; a second ``tolist`` reads nothing again. The values are the
    counts, also when the device writes over its tensor after the copy was started."""
    from flexmoe.apps.bench.host_reads import OpCounter
    from flexmoe.parallel.alltoall import HostCopy

    counts = torch.tensor([[3, 0, 2], [1, 4, 0]], device=device)
    with OpCounter() as c:
        copy = HostCopy(counts)
        counts.add_(10)  # the device moves on; the copy holds the values at its start
        first, again = copy.tolist(), copy.tolist()
    assert first == again == [[3, 0, 2], [1, 4, 0]]
    assert c.host_reads == ["tolist"]
