"""What users run on a fresh machine: the experts' kernel chooser with its REAL timer and an empty cache.

Every other test runs the kernels by the rule (tests/conftest.py's ``kernels_by_rule``, tests/child_site for the
children), so none of them takes the path of a first call that times kernels and routes. Here each test undoes
that (:func:`timed`: ``KernelChooser.default_timer`` back to :func:`~flexmoe.experts.chooser.time_kernel`, the
cache in the test's own fresh directory) and compares with the same run by the rule, computed in the same test:
a plain call, activation checkpointing (torch's both variants, Hugging Face's ``gradient_checkpointing_enable`` and
``Trainer``), an empty batch, an expert-parallel rank without rows, ``torch.compile``, ``flexmoe train --fsdp
--activation-checkpointing`` and autocast. The kernels differ only by rounding, hence the tolerances.
"""

from __future__ import annotations

import contextlib
import datetime
import json
import os
import subprocess
import sys
import traceback
from collections.abc import Callable, Iterator
from pathlib import Path

import pytest
import torch
from torch import nn
from torch.utils.checkpoint import checkpoint

from flexmoe import MoELayer
from flexmoe.experts.chooser import KernelChooser, time_kernel

TOL = dict(rtol=1e-5, atol=1e-5)


@pytest.fixture
def timed(monkeypatch: pytest.MonkeyPatch, tmp_path: Path, one_thread: None) -> Path:
    """Layers built in the test time their kernels for real, caching in a fresh directory (returned): what a
    user's first run does. Undoes conftest's ``kernels_by_rule`` for this test."""
    cache = tmp_path / "kernel-cache"
    monkeypatch.setattr(KernelChooser, "default_timer", staticmethod(time_kernel))
    monkeypatch.setattr(KernelChooser, "default_cache_dir", str(cache))
    return cache


@contextlib.contextmanager
def by_rule() -> Iterator[None]:
    """Layers built inside take the rule's kernel (the loop): the reference runs."""
    saved = KernelChooser.__dict__["default_timer"], KernelChooser.default_cache_dir
    KernelChooser.default_timer, KernelChooser.default_cache_dir = None, None
    try:
        yield
    finally:
        KernelChooser.default_timer, KernelChooser.default_cache_dir = saved  # type: ignore[assignment]


def layer_pair(seed: int = 0, **options: object) -> tuple[MoELayer, MoELayer]:
    """The same layer twice (same weights): by the rule, and timing as the fixture says."""
    with by_rule():
        torch.manual_seed(seed)
        rule = MoELayer(8, 4, 16, k=2, **options)
    torch.manual_seed(seed)
    timing = MoELayer(8, 4, 16, k=2, **options)
    assert rule.experts.kernels.timer is None and timing.experts.kernels.timer is not None
    return rule, timing


def step(layer: nn.Module, x: torch.Tensor, call: Callable[[nn.Module, torch.Tensor], torch.Tensor] | None = None,
         ) -> tuple[torch.Tensor, torch.Tensor, dict[str, torch.Tensor]]:
    """One forward and backward of ``(y * w).sum()`` (w fixed, so every output counts differently): the output,
    the input's gradient and the parameters' (zero where None)."""
    x = x.detach().requires_grad_()
    y = (call or (lambda m, t: m(t)))(layer, x)
    w = torch.linspace(-1, 1, y.numel()).reshape(y.shape)
    (y * w).sum().backward()
    grads = {n: (p.grad.clone() if p.grad is not None else torch.zeros_like(p)) for n, p in layer.named_parameters()}
    layer.zero_grad(set_to_none=True)
    assert x.grad is not None
    return y.detach(), x.grad, grads


def assert_same(got: tuple, want: tuple, tol: dict[str, float] = TOL) -> None:
    torch.testing.assert_close(got[0], want[0], **tol)
    torch.testing.assert_close(got[1], want[1], **tol)
    assert got[2].keys() == want[2].keys()
    for name in want[2]:
        torch.testing.assert_close(got[2][name], want[2][name], **tol, msg=lambda m, n=name: f"{n}: {m}")


# ------------------------------------------------------------------------------------------------ plain calls


def test_plain_first_calls_time_the_kernels_and_compute_the_rules_numbers(timed: Path) -> None:
    rule, timing = layer_pair()
    x = torch.randn(64, 8)
    for _ in range(2):  # the first call times, the second runs the choice
        assert_same(step(timing, x), step(rule, x))
    assert timing.experts.kernels.timings, "the first training call times the kernels"
    assert list(timed.glob("kernels-*.json")), "and writes the fresh cache"
    with torch.no_grad():
        torch.testing.assert_close(timing(x), rule(x), **TOL)
    assert any("/infer/" in b for b in timing.experts.kernels.timings), "a no-grad call times its own bucket"


# --------------------------------------------------------------------------------------- activation checkpointing


@pytest.mark.parametrize("reentrant", [False, True], ids=["non-reentrant", "reentrant"])
def test_checkpointed_first_calls_match_the_rule(timed: Path, reentrant: bool) -> None:
    """torch.utils.checkpoint around a fresh layer: the first steps (each timing where it may) give the plain
    rule run's output and gradients; nothing is timed inside the checkpointed region."""
    rule, timing = layer_pair()

    def checkpointed(m: nn.Module, t: torch.Tensor) -> torch.Tensor:
        return checkpoint(m, t, use_reentrant=reentrant)

    for seed in range(3):
        x = torch.randn(48, 8, generator=torch.Generator().manual_seed(seed))
        assert_same(step(timing, x, checkpointed), step(rule, x))
    if not reentrant:  # the reentrant forward runs under no_grad: a plain inference call, which may time
        assert not timing.experts.kernels.timings


def test_checkpoint_stop_signal_is_not_taken_for_a_kernel_failure(timed: Path) -> None:
    """The experts last in a non-reentrant checkpoint, a kernel other than the loop: torch stops the recomputation
    by an exception raised inside the kernel, which the chooser must let through (not warn and rerun the loop)."""
    rule, timing = layer_pair(expert_kernel="segmented")
    x = torch.randn(32, 8)
    counts = [8, 8, 8, 8]

    def experts_only(m: nn.Module, t: torch.Tensor) -> torch.Tensor:
        return m.experts(t, counts)

    import warnings

    with warnings.catch_warnings():
        warnings.simplefilter("error")  # "kernel 'segmented' failed ... the loop runs this case instead"
        got = step(timing, x, lambda m, t: checkpoint(experts_only, m, t, use_reentrant=False))
    want = step(rule, x, experts_only)
    assert_same(got, want)


# The HF families whose checkpointed training broke on a fresh machine (issue 39).
HF_FAMILIES = ["qwen3_moe", "qwen2_moe", "deepseek_v3"]


def hf_losses(family: str, steps: int, checkpointing: bool = True) -> list[float]:
    """SGD steps of the converted tiny HF model with HF's gradient checkpointing; the losses."""
    pytest.importorskip("transformers")
    import flexmoe.hf as fh
    from test_hf_convert import batches, tiny_model

    model = fh.convert(tiny_model(family), group="single")
    if checkpointing:
        model.gradient_checkpointing_enable()
    model.train()
    opt = torch.optim.SGD(model.parameters(), lr=0.05)
    losses = []
    for ids in batches(steps):
        out = model(ids, labels=ids)
        out.loss.backward()
        opt.step()
        opt.zero_grad()
        losses.append(float(out.loss.detach()))
    return losses


@pytest.mark.parametrize("family", HF_FAMILIES)
def test_hf_gradient_checkpointing_first_steps(timed: Path, family: str) -> None:
    with by_rule():
        want = hf_losses(family, 3, checkpointing=False)
    assert hf_losses(family, 3) == pytest.approx(want, rel=1e-5)


def test_hf_trainer_with_gradient_checkpointing(timed: Path, tmp_path: Path) -> None:
    """transformers.Trainer (gradient_checkpointing=True) on a converted tiny Qwen3-MoE: a fresh machine's
    losses are the rule's."""
    transformers = pytest.importorskip("transformers")
    import flexmoe.hf as fh
    from test_hf_convert import batches, tiny_model

    data = [{"input_ids": ids, "labels": ids} for ids in torch.cat(batches(2, batch=4)).unbind(0)]

    def losses(out: Path) -> list[float]:
        model = fh.convert(tiny_model("qwen3_moe"), group="single")
        args = transformers.TrainingArguments(
            output_dir=str(out), max_steps=2, per_device_train_batch_size=4, learning_rate=1e-2, logging_steps=1,
            save_strategy="no", report_to="none", use_cpu=True, disable_tqdm=True, gradient_checkpointing=True,
            dataloader_num_workers=0, seed=0)
        trainer = transformers.Trainer(model=model, args=args, train_dataset=data)
        trainer.train()
        return [e["loss"] for e in trainer.state.log_history if "loss" in e]

    with by_rule():
        want = losses(tmp_path / "rule")
    got = losses(tmp_path / "timed")
    assert len(want) == 2 and got == pytest.approx(want, rel=1e-5)


# -------------------------------------------------------------------------------------------------- empty calls


def test_empty_batch_gives_an_empty_output_and_zero_gradients(timed: Path) -> None:
    rule, timing = layer_pair()
    x = torch.randn(0, 8)
    got, want = step(timing, x), step(rule, x)
    assert got[0].shape == (0, 8)
    assert_same(got, want)
    assert all(not g.any() for g in got[2].values())
    with torch.no_grad():
        assert timing(torch.randn(0, 3, 8)).shape == (0, 3, 8)


def ep_rank_main(cache: str) -> dict:
    """One of 2 gloo ranks: an expert-parallel layer whose router sends every token to experts 0 and 1 (rank 0's),
    rank 1 with no tokens at all; its first step with the real timer and a fresh cache, against the same step by
    the rule. The timer is switched on here, explicitly: the child's sitecustomize set the rule."""
    torch.set_num_threads(1)
    torch.distributed.init_process_group("gloo", timeout=datetime.timedelta(seconds=60))
    rank = torch.distributed.get_rank()
    out: dict = {"rank": rank, "failures": []}
    try:
        def build() -> MoELayer:
            torch.manual_seed(0)
            layer = MoELayer(8, 4, 16, k=2, router_bias=True)
            with torch.no_grad():
                layer.router.weight.mul_(0.01)
                layer.router.bias.copy_(torch.tensor([10.0, 9.0, 0.0, 0.0]))
            return layer

        x = torch.randn(24 if rank == 0 else 0, 8, generator=torch.Generator().manual_seed(1))
        KernelChooser.default_timer, KernelChooser.default_cache_dir = None, None
        want = step(build(), x)
        KernelChooser.default_timer, KernelChooser.default_cache_dir = time_kernel, f"{cache}/{rank}"
        layer = build()
        got = step(layer, x)
        out["timer_on"] = layer.experts.kernels.timer is not None
        assert_same(got, want)
        out["local_expert_grads_zero"] = rank == 1 and not got[2]["experts.w1"].any()
    except Exception:
        out["failures"].append(traceback.format_exc())
    torch.distributed.destroy_process_group()
    return out


@pytest.mark.slow
def test_expert_parallel_rank_without_rows_on_its_first_call(timed: Path) -> None:
    from flexmoe.launch import spawn_ranks

    ranks = spawn_ranks(2, ep_rank_main, [str(timed)], timeout=180, check=True, what="EP rank without rows")
    values = [r.value for r in ranks]
    assert not [f for v in values for f in v["failures"]], "\n".join(f for v in values for f in v["failures"])
    assert all(v["timer_on"] for v in values) and values[1]["local_expert_grads_zero"]


# ----------------------------------------------------------------------------------------------- torch.compile


def test_compiled_first_call_matches_the_rule(timed: Path) -> None:
    rule, timing = layer_pair()
    x = torch.randn(32, 8)
    compiled = torch.compile(timing, backend="aot_eager")
    assert_same(step(timing, x, lambda m, t: compiled(t)), step(rule, x))
    assert not timing.experts.kernels.timings  # a traced call runs the rule, whatever this process measured


# ------------------------------------------------------------------------------------------------------ autocast


def test_autocast_first_call_matches_the_rule(timed: Path) -> None:
    rule, timing = layer_pair()
    x = torch.randn(64, 8)

    def autocast(m: nn.Module, t: torch.Tensor) -> torch.Tensor:
        with torch.autocast("cpu", dtype=torch.bfloat16):
            return m(t)

    for _ in range(2):
        assert_same(step(timing, x, autocast), step(rule, x, autocast), dict(rtol=2e-2, atol=2e-2))


# ------------------------------------------------------------------------------------------------ bad inputs


class _Router(nn.Module):
    def __init__(self, make: Callable[[torch.Tensor], object]) -> None:
        super().__init__()
        self.make = make

    def forward(self, x: torch.Tensor) -> object:
        return self.make(x)


@pytest.mark.parametrize("router, error, says", [
    (_Router(lambda x: torch.zeros(x.shape[0], 3)), ValueError, r"num_experts=4.*got shape \(5, 3\)"),
    (_Router(lambda x: torch.zeros(2 * x.shape[0], 4)), ValueError, r"num_experts=4.*got shape \(10, 4\)"),
    (_Router(lambda x: torch.zeros(x.shape[0] * 4)), ValueError, r"num_experts=4.*got shape \(20,\)"),
    (_Router(lambda x: [0.0] * 4), TypeError, "must return a tensor of logits"),
], ids=["experts", "tokens", "flat", "not-a-tensor"])
def test_router_of_the_wrong_shape_is_a_clear_error(timed: Path, router: nn.Module, error: type, says: str) -> None:
    layer = MoELayer(8, 4, 16, k=2, router=router)
    for grad in (True, False):
        with torch.set_grad_enabled(grad), pytest.raises(error, match=says):
            layer(torch.randn(5, 8))


@pytest.mark.parametrize("make_x, error, says", [
    (lambda: torch.randn(5, 7), ValueError, "model_dim=8"),
    (lambda: torch.randint(0, 3, (5, 8)), TypeError, "x must be float"),
    (lambda: [[0.0] * 8], TypeError, "x must be a torch.Tensor"),
    (lambda: torch.full((5, 8), float("nan")), ValueError, "NaN"),
], ids=["model-dim", "dtype", "not-a-tensor", "nan"])
def test_bad_layer_input_is_a_clear_error(timed: Path, make_x: Callable[[], object], error: type, says: str) -> None:
    layer = MoELayer(8, 4, 16, k=2)
    with pytest.raises(error, match=says):
        layer(make_x())


# ------------------------------------------------------------------------------------------- flexmoe train (CLI)


@pytest.mark.slow
def test_cli_train_fsdp_activation_checkpointing_as_a_user_runs_it(tmp_path: Path) -> None:
    """``flexmoe train --nproc 2 --fsdp --activation-checkpointing`` run as a user runs it: no tests/child_site on
    the child's PYTHONPATH (so the real timer), HOME in the test's directory (so a fresh ~/.cache/flexmoe); its
    losses are the same job's by the rule (child_site on the path). Slow: two 2-rank jobs, about a minute on 2
    shared cores. (This tiny job times nothing even on today's fresh machine: its experts are expert-parallel,
    and every training call is checkpointed; the test guards the job, not the timer.)"""
    repo = Path(__file__).resolve().parents[1]
    child_site = str(Path(__file__).resolve().parent / "child_site")
    tiny = ["--n-layer", "1", "--n-head", "2", "--n-embd", "16", "--block-size", "16", "--num-experts", "4",
            "--expert-hidden", "16", "--batch-size", "4", "--warmup", "1", "--no-progress", "--eval-batches", "1",
            "--eval-every", "100", "--ckpt-every", "100", "--log-every", "1", "--no-plots", "--steps", "3",
            "--nproc", "2", "--fsdp", "--activation-checkpointing"]
    inherited = [p for p in os.environ.get("PYTHONPATH", "").split(os.pathsep) if p]
    assert child_site in inherited  # tests/conftest.py put it there: the rule's run keeps it, the user's drops it

    def train(out: Path, with_child_site: bool) -> list[float]:
        path = [str(repo / "src")] + [p for p in inherited if with_child_site or p != child_site]
        env = {**os.environ, "PYTHONPATH": os.pathsep.join(path), "HOME": str(tmp_path / "home")}
        done = subprocess.run([sys.executable, "-m", "flexmoe", "train", "--out", str(out), *tiny],
                              capture_output=True, text=True, timeout=300, env=env)
        assert done.returncode == 0, done.stderr[-3000:]
        return [json.loads(line)["train_loss"] for line in (out / "metrics.jsonl").read_text().splitlines()]

    want = train(tmp_path / "rule", with_child_site=True)
    got = train(tmp_path / "timed", with_child_site=False)
    assert len(want) == 3 and got == pytest.approx(want, rel=1e-5)


def test_a_router_may_return_its_sequences_tokens_flattened(timed: Path) -> None:
    """A router over ``[B, S, M]`` may return ``[B, S, E]`` or ``[B * S, E]`` (HF's Switch router does the latter):
    both route alike."""
    torch.manual_seed(0)
    weight = torch.randn(4, 8)
    flat = MoELayer(8, 4, 16, k=2, router=_Router(lambda x: x.reshape(-1, 8) @ weight.T))
    shaped = MoELayer(8, 4, 16, k=2, router=_Router(lambda x: x @ weight.T))
    shaped.experts.load_state_dict(flat.experts.state_dict())
    x = torch.randn(2, 3, 8)
    torch.testing.assert_close(flat(x), shaped(x), rtol=0, atol=0)
