"""flexmoe.sharding.parallelize: FSDP2 with expert parallelism on one device mesh (docs/architecture.md, "Models
larger than one rank").

The multi-rank cases run scenarios of tests/fsdp_worker.py as real gloo processes (tests/multiproc.py); their
reference is one process holding every expert, running each rank's batch, its loss the mean of the ranks'.
"""

from __future__ import annotations

import json
import os
import re
import signal
import subprocess
import sys
import time
from collections.abc import Callable
from pathlib import Path

import pytest
import torch
from torch import nn

from flexmoe.apps.models.gpt import GPT, GPTConfig
from flexmoe.sharding import default_blocks, local_state_bytes, make_mesh, materialize
from flexmoe.sharding.fsdp_overlap import PendingReduceScatters
from flexmoe_cli import child_pythonpath
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


def _ran(n: int) -> Callable[[list[dict]], None]:
    def check(reports: list[dict]) -> None:
        assert all(rep.get("cases") == n for rep in reports), [rep.get("cases") for rep in reports]
    return check


def _big(reports: list[dict]) -> None:
    assert all(rep["params"] >= 2e9 for rep in reports), [rep.get("params") for rep in reports]
    assert all(abs(rep["loss"] - 5.545) < 0.5 for rep in reports), [rep["loss"] for rep in reports]  # ~ln 256
    print({rep["rank"]: round(rep["peak_bytes"] / 2**30, 2) for rep in reports})


CASES = [
    pytest.param(Scenario("fsdp_gpt", 2, "ep=2 with FSDP (and activation checkpointing): 10 AdamW steps of the GPT "
                          "equal one process's losses and weights"), _cases(2), id="fsdp_gpt-w2"),
    pytest.param(Scenario("fsdp_gpt", 4, "ep=2 x dp_shard=2, ep=4 and dp_replicate=2 x ep=2 (HSDP): 10 AdamW steps "
                          "of the GPT equal one process's losses and weights", timeout=400.0, collective_timeout=60.0),
                 _cases(3),
                 id="fsdp_gpt-w4", marks=pytest.mark.slow),
    pytest.param(Scenario("fsdp_features", 2, "r=0, overlap, shadowing, pairwise, auto, bias balance and dropless "
                          "routing under parallelize equal one process", timeout=300.0), _cases(7),
                 id="fsdp_features-w2", marks=pytest.mark.slow),
    pytest.param(Scenario("fsdp_meta", 2, "a meta-built GPT laid on ep=2 and materialised from a seed holds only its "
                          "shards, has one process's weights and trains like it"), _ran(1), id="fsdp_meta-w2"),
    pytest.param(Scenario("fsdp_meta", 4, "a meta-built GPT laid on ep=2 x dp_shard=2 and on ep=4 and materialised "
                          "from a seed has one process's weights and trains like it", timeout=400.0,
                          collective_timeout=60.0), _ran(2), id="fsdp_meta-w4", marks=pytest.mark.slow),
    pytest.param(Scenario("fsdp_hf", 2, "converted Qwen3-MoE and DeepSeek-V3 models at ep=2: 5 AdamW steps equal one "
                          "process's losses and weights", timeout=300.0), _cases(2), id="fsdp_hf-w2",
                 marks=pytest.mark.slow),
    pytest.param(Scenario("fsdp_hf", 4, "converted Qwen3-MoE and DeepSeek-V3 models at ep=2 x dp_shard=2: 5 AdamW "
                          "steps equal one process's losses and weights", timeout=500.0, collective_timeout=60.0),
                 _cases(2), id="fsdp_hf-w4",
                 marks=pytest.mark.slow),
    pytest.param(Scenario("fsdp_big", 4, "a ~2B-parameter GPT built on meta and materialised on 4 ranks stays below "
                          "half its fp32 size per rank", timeout=600.0, collective_timeout=300.0), _big,
                 id="fsdp_big-w4", marks=pytest.mark.slow),
    pytest.param(Scenario("fsdp_compile", 2, "torch.compile (inductor) per block of the GPT at ep=2 gives the eager "
                          "process's losses and weights", timeout=900.0, collective_timeout=300.0), _ran(1),
                 id="fsdp_compile-w2", marks=pytest.mark.slow),
    pytest.param(Scenario("fsdp_overlap", 2, "on gloo, reduce-scatters deferred to the end of backward give one "
                          "process's gradients, and micro-batches accumulate like one process's"), None,
                 id="fsdp_overlap-w2"),
    pytest.param(Scenario("fsdp_mixed_precision", 2, "bf16 parameters with float32 reduction at ep=2: every layer, "
                          "experts included, computes in bf16, and the float32 gradients are one process's"), None,
                 id="fsdp_mixed_precision-w2"),
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


def test_pending_reduce_scatters_keep_at_most_their_limit_in_flight() -> None:
    """The oldest started reduce-scatter is waited for as soon as more than ``limit`` are in flight; the rest at the
    end of backward (finish_all), oldest first."""
    finished: list[int] = []

    class Started:
        def __init__(self, i: int) -> None:
            self.i = i

        def finish(self) -> None:
            finished.append(self.i)

    pending = PendingReduceScatters(limit=2)
    for i in range(5):
        pending.add(Started(i))
        assert len(pending.entries) == min(i + 1, 2)
    assert finished == [0, 1, 2]
    pending.finish_all()
    assert finished == [0, 1, 2, 3, 4] and not pending.entries


def test_default_blocks_are_the_gpt_blocks() -> None:
    model = GPT(GPTConfig(n_layer=3, n_embd=16, n_head=2, num_experts=4, expert_hidden=8))
    assert default_blocks(model) == list(model.blocks)


def test_make_mesh_needs_torch_distributed() -> None:
    with pytest.raises(RuntimeError, match="init_process_group"):
        make_mesh(ep=2)


def _meta_gpt(n_layer: int = 2) -> GPT:
    with torch.device("meta"):
        return GPT(GPTConfig(vocab_size=64, block_size=16, n_layer=n_layer, n_head=2, n_embd=32, num_experts=4,
                             expert_hidden=16, k=2, moe_every=1))


def test_materialize_follows_the_gpt_initialisation_rule() -> None:
    model = _meta_gpt()
    assert all(p.is_meta for p in model.parameters())
    materialize(model, seed=1, init=model.init_module)
    params = dict(model.named_parameters())
    assert not any(p.is_meta for p in params.values())
    # GPT-2 rule: N(0, 0.02), residual projections N(0, 0.02 / sqrt(2 * n_layer)), linear biases 0, norms 1 and 0.
    assert abs(params["tok_emb.weight"].std().item() - 0.02) < 0.003
    assert abs(params["blocks.0.attn.proj.weight"].std().item() - 0.02 / 2) < 0.002
    assert torch.equal(params["blocks.1.attn.qkv.bias"], torch.zeros(96))
    assert torch.equal(params["blocks.0.ln1.weight"], torch.ones(32))
    assert torch.equal(params["ln_f.bias"], torch.zeros(32))
    # Experts and routers: nn.Linear's default, U(-1/sqrt(fan_in), 1/sqrt(fan_in)), every expert drawn differently.
    w1 = params["blocks.0.mlp.experts.w1"]  # [E, M, H], fan_in M = 32
    assert w1.abs().max().item() <= 32**-0.5 and w1.std().item() > 0.8 * 32**-0.5 / 3**0.5
    assert not torch.equal(w1[0], w1[1])
    assert params["blocks.0.mlp.router.weight"].abs().max().item() <= 32**-0.5
    x = torch.randint(0, 64, (2, 16))
    _, loss = model(x, x)
    assert abs(loss.item() - torch.log(torch.tensor(64.0)).item()) < 0.1  # small init: near-uniform predictions
    again = _meta_gpt()
    materialize(again, seed=1, init=again.init_module)
    other = _meta_gpt()
    materialize(other, seed=2, init=other.init_module)
    for name, p in again.named_parameters():
        assert torch.equal(p, params[name]), name
    assert not torch.equal(dict(other.named_parameters())["blocks.0.mlp.experts.w1"], w1)


def test_materialize_refuses_a_module_it_cannot_initialise() -> None:
    class Scale(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.weight = nn.Parameter(torch.empty(3))

    with torch.device("meta"):
        model = nn.Sequential(nn.Linear(3, 3), Scale())
    with pytest.raises(ValueError, match="1.*Scale.*reset_parameters"):
        materialize(model, seed=0)


@pytest.mark.slow
def test_dcp_checkpoint_saved_at_2x2_loads_at_2_ranks_and_at_1_process(tmp_path) -> None:
    """Saved at 4 ranks (ep=2 x dp_shard=2) after 3 AdamW steps; loaded into differently seeded models at ep=2 and
    in one process: the same logits bit for bit, and the same AdamW moments (their global sum of squares).

    Every side evaluates with the experts' rows by embedding_bag (fsdp_worker.ROW_BY_ROW_KERNEL), a row's output
    independent of the other rows of the call. By the default kernel (the loop's matmuls) one process differs by
    float32 rounding (6e-8): each rank computes an expert over both ranks' rows, one process over its own batch's,
    and MKL's sgemm rounds a product of 1-3 rows otherwise than the same rows among 4 or more (an expert with 2
    or 3 rows in one process has 4 or 6 at a rank). The default kernel is held to the same function up to that."""
    from flexmoe.launch import spawn_ranks
    from flexmoe.sharding import load_sharded
    from fsdp_worker import _logits_and_moment, dcp_load_main, dcp_save_main, gpt

    directory = str(tmp_path / "ckpt")
    saved = [r.value for r in spawn_ranks(4, dcp_save_main, [directory, 2, 2], timeout=300.0, what="DCP save")]
    loaded = [r.value for r in spawn_ranks(2, dcp_load_main, [directory, 2], timeout=300.0, what="DCP load")]
    model = gpt(seed=99)
    opt = torch.optim.AdamW(model.parameters())
    load_sharded(directory, model, opt)
    by_default_kernel = torch.tensor(_logits_and_moment(model, opt, expert_kernel=None)["logits"])
    alone = _logits_and_moment(model, opt)

    want = torch.tensor(saved[0]["logits"])
    for who, logits in [*((f"saving rank {i}", s["logits"]) for i, s in enumerate(saved)),
                        *((f"loading rank {i}", s["logits"]) for i, s in enumerate(loaded)),
                        ("one process", alone["logits"])]:
        assert torch.equal(torch.tensor(logits), want), (who, (torch.tensor(logits) - want).abs().max())
    torch.testing.assert_close(by_default_kernel, want, rtol=1e-6, atol=1e-6)
    square = sum(s["exp_avg_square"] for s in saved)
    assert square > 0
    assert sum(s["exp_avg_square"] for s in loaded) == pytest.approx(square, rel=1e-9)
    assert alone["exp_avg_square"] == pytest.approx(square, rel=1e-9)


# --- the job: flexmoe train --fsdp -----------------------------------------------------------------------------

TINY = ["--n-layer", "2", "--n-head", "2", "--n-embd", "32", "--block-size", "32", "--num-experts", "4",
        "--expert-hidden", "32", "--batch-size", "8", "--warmup", "2", "--no-progress", "--eval-batches", "1",
        "--eval-every", "4", "--ckpt-every", "3", "--log-every", "1", "--no-plots"]


def _train(out: Path, *argv: str) -> subprocess.CompletedProcess:
    # A generous bound: a --compile run with a cold inductor cache takes 3 minutes alone on 2 cores, and CI runs
    # another test beside it; a hang still ends here, and the job's own collective timeout ends it sooner.
    env = {**os.environ, "PYTHONPATH": child_pythonpath(Path(__file__).resolve().parents[1] / "src")}
    return subprocess.run([sys.executable, "-m", "flexmoe", "train", "--out", str(out), *argv, *TINY],
                          capture_output=True, text=True, timeout=900, env=env)


def _losses(out: Path) -> list[float]:
    return [json.loads(line)["train_loss"] for line in (out / "metrics.jsonl").read_text().splitlines()]


@pytest.mark.slow
@pytest.mark.parametrize("nproc", [2, 4])
def test_train_fsdp_equals_the_replicated_run_holds_less_and_resumes(tmp_path: Path, nproc: int) -> None:
    """flexmoe train --nproc N --ep 2 --fsdp (activation checkpointing at 2 ranks) logs the losses of the replicated
    run (wrap_ddp, experts over all ranks), holds at most 1.1 x its state / N + the largest tensor per rank, and
    resumed from its DCP checkpoint at step 3 continues exactly."""
    flags = ["--nproc", str(nproc), "--ep", "2", "--fsdp"] + (["--activation-checkpointing"] if nproc == 2 else [])
    ddp = _train(tmp_path / "ddp", "--steps", "6", "--nproc", str(nproc))
    assert ddp.returncode == 0, ddp.stderr[-3000:]
    fsdp = _train(tmp_path / "fsdp", "--steps", "6", *flags)
    assert fsdp.returncode == 0, fsdp.stderr[-3000:]
    want = _losses(tmp_path / "ddp")
    assert len(want) == 6
    assert _losses(tmp_path / "fsdp") == pytest.approx(want, rel=1e-5)
    held = json.loads((tmp_path / "fsdp" / "summary.json").read_text())["state_bytes_per_rank"]
    replicated = json.loads((tmp_path / "ddp" / "summary.json").read_text())["state_bytes_per_rank"]
    assert "state bytes per rank" in fsdp.stdout and len(held) == len(replicated) == nproc
    # The whole model's state (every rank holds the non-expert part and 1/N of the experts when replicated).
    total = 16 * json.loads((tmp_path / "ddp" / "summary.json").read_text())["params"]
    largest = 4 * 256 * 32  # the largest tensor: the token embedding / head, vocab 256 x n_embd 32, fp32
    assert all(h <= 1.1 * total / nproc + largest for h in held), (held, total)
    assert all(h < r for h, r in zip(held, replicated)), (held, replicated)

    first = _train(tmp_path / "resumed", "--steps", "3", *flags)
    assert first.returncode == 0, first.stderr[-3000:]
    assert (tmp_path / "resumed" / "checkpoints" / "dcp-step_000003" / "meta.json").is_file()
    resumed = _train(tmp_path / "resumed", "--steps", "6", "--resume", "--nproc", str(nproc))
    assert resumed.returncode == 0, resumed.stderr[-3000:]
    assert "resumed from" in resumed.stdout
    assert _losses(tmp_path / "resumed") == _losses(tmp_path / "fsdp")


def _train_ok(out: Path, *argv: str) -> subprocess.CompletedProcess:
    """:func:`_train` that must succeed."""
    done = _train(out, *argv)
    assert done.returncode == 0, done.stderr[-3000:]
    return done


@pytest.mark.slow
def test_train_fsdp_compiled_per_block_logs_the_eager_losses(tmp_path: Path) -> None:
    """flexmoe train --nproc 2 --fsdp --compile (inductor, with activation checkpointing) compiles each block, FSDP2's
    hooks between them eager, and logs the eager --fsdp run's losses."""
    flags = ["--steps", "4", "--nproc", "2", "--ep", "2", "--fsdp"]
    _train_ok(tmp_path / "eager", *flags)
    compiled = _train_ok(tmp_path / "compiled", *flags, "--compile", "--activation-checkpointing")
    assert "compile each of its 2 blocks" in compiled.stdout
    assert _losses(tmp_path / "compiled") == pytest.approx(_losses(tmp_path / "eager"), rel=1e-5)


@pytest.mark.slow
def test_train_dense_twin_under_fsdp_logs_the_replicated_losses(tmp_path: Path) -> None:
    """flexmoe train --dense --nproc 2 --fsdp (activation checkpointing): the dense twin sharded per block logs the
    replicated (DDP) dense run's losses and holds less per rank."""
    _train_ok(tmp_path / "ddp", "--steps", "4", "--nproc", "2", "--dense")
    _train_ok(tmp_path / "fsdp", "--steps", "4", "--nproc", "2", "--dense", "--fsdp", "--activation-checkpointing")
    assert _losses(tmp_path / "fsdp") == pytest.approx(_losses(tmp_path / "ddp"), rel=1e-5)
    held, replicated = (json.loads((tmp_path / run / "summary.json").read_text())["state_bytes_per_rank"]
                        for run in ("fsdp", "ddp"))
    assert all(2 * h < 1.1 * r for h, r in zip(held, replicated)), (held, replicated)


@pytest.mark.slow
def test_train_fsdp_in_bf16_tracks_the_float32_run(tmp_path: Path) -> None:
    """flexmoe train --fsdp --param-dtype bfloat16: blocks compute in bf16 (FSDP2's mixed precision), the weights
    and DCP checkpoints stay float32, and the losses track the float32 run's to bf16 precision."""
    flags = ["--steps", "6", "--nproc", "2", "--ep", "2", "--fsdp"]
    _train_ok(tmp_path / "fp32", *flags)
    bf16 = _train_ok(tmp_path / "bf16", *flags, "--param-dtype", "bfloat16")
    assert "blocks compute in bfloat16" in bf16.stdout
    want, got = _losses(tmp_path / "fp32"), _losses(tmp_path / "bf16")
    assert got != want  # bf16 rounding shows in the losses
    assert got == pytest.approx(want, abs=0.03)  # a couple of bf16 steps (2**-7 relative) at a loss of ~5.5
    import torch.distributed.checkpoint as dcp

    meta = dcp.FileSystemReader(str(tmp_path / "bf16" / "checkpoints" / "dcp-step_000006")).read_metadata()
    dtypes = {m.properties.dtype for key, m in meta.state_dict_metadata.items()
              if key.startswith("model.") and hasattr(m, "properties")}
    assert dtypes == {torch.float32}, dtypes


@pytest.mark.parametrize(("argv", "words"), [
    (["--nproc", "4", "--ep", "2"], "--ep 2 of 4 ranks needs --fsdp"),
    pytest.param(["--nproc", "4", "--ep", "3", "--fsdp"], "--ep 3 must divide the number of ranks 4",
                 marks=pytest.mark.slow),
    (["--activation-checkpointing"], "--activation-checkpointing needs --fsdp"),
    (["--param-dtype", "bfloat16"], "--param-dtype bfloat16 needs --fsdp"),
])
def test_train_mesh_flags_are_checked_before_anything_runs(tmp_path: Path, argv: list[str], words: str) -> None:
    out = _train(tmp_path / "run", "--steps", "1", *argv)
    assert out.returncode == 2, out.stderr[-2000:]
    assert words in out.stderr
    assert not (tmp_path / "run").exists()


@pytest.mark.slow
def test_train_fsdp_killed_with_sigkill_resumes_bit_identical(tmp_path: Path) -> None:
    """Every process of a 2-rank --fsdp run killed at once (SIGKILL to its process group) after a DCP checkpoint;
    --resume then logs exactly the losses, validation losses and expert loads of an uninterrupted run."""
    steps = 40
    flags = ["--steps", str(steps), "--nproc", "2", "--ep", "2", "--fsdp"]
    ref = _train(tmp_path / "ref", *flags)
    assert ref.returncode == 0, ref.stderr[-3000:]
    env = {**os.environ, "PYTHONPATH": child_pythonpath(Path(__file__).resolve().parents[1] / "src")}
    # Every rank waits at the end of step 10 (after step 9's checkpoint) until it is killed (tests/paused_flexmoe.py):
    # a run left to go on could finish its 40 steps while this process waits for its turn on a loaded machine.
    paused = str(Path(__file__).with_name("paused_flexmoe.py"))
    victim = subprocess.Popen([sys.executable, paused, "10", "train", "--out", str(tmp_path / "victim"), *flags,
                               *TINY], env=env, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True,
                              start_new_session=True)  # its own process group: the launcher and both ranks
    checkpoints = tmp_path / "victim" / "checkpoints"
    deadline = time.time() + 240
    while time.time() < deadline and victim.poll() is None:
        done = [json.loads(m.read_text())["step"] for m in checkpoints.glob("dcp-step_*/meta.json")]
        if done and max(done) >= 9:
            break
        time.sleep(0.05)
    assert victim.poll() is None, "the run ended before it could be killed"
    os.killpg(victim.pid, signal.SIGKILL)
    victim.wait()
    assert max(json.loads(line)["step"] for line in (tmp_path / "victim" / "metrics.jsonl").read_text().splitlines()) \
        < steps
    resumed = _train(tmp_path / "victim", "--steps", str(steps), "--resume", "--nproc", "2")
    assert resumed.returncode == 0, resumed.stderr[-3000:]
    want, got = [(tmp_path / run / "metrics.jsonl").read_text().splitlines() for run in ("ref", "victim")]
    keys = ("step", "train_loss", "val_loss", "expert_load")
    rows = [[{k: json.loads(line).get(k) for k in keys} for line in lines] for lines in (want, got)]
    assert [r["step"] for r in rows[1]] == list(range(1, steps + 1))
    assert rows[1] == rows[0]


@pytest.mark.slow
def test_sharded_example_trains_at_4_ranks_resumes_at_2_and_exports(tmp_path: Path) -> None:
    """examples/fsdp/train_sharded.py, quoted in the README: 4 ranks (ep=2 x dp_shard=2) learn, 2 ranks (ep=2)
    continue from the DCP checkpoint, one process exports a flexmoe checkpoint that holds the trained model."""
    from flexmoe.apps.data import TokenData
    from flexmoe.checkpoint import latest_checkpoint, load_checkpoint

    example = Path(__file__).resolve().parents[1] / "examples" / "fsdp" / "train_sharded.py"
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONPATH": child_pythonpath(example.parents[2] / "src")}
    printed: dict[tuple[int, int], float] = {}
    for nproc, stage in ((4, "train"), (2, "resume")):
        done = subprocess.run([sys.executable, "-m", "torch.distributed.run", "--standalone",
                               f"--nproc_per_node={nproc}", str(example), stage], cwd=tmp_path, env=env,
                              capture_output=True, text=True, timeout=600)
        assert done.returncode == 0, done.stdout[-2000:] + done.stderr[-3000:]
        for r, s, v in re.findall(r"rank (\d) step (\d+): loss ([\d.]+)", done.stdout):
            printed[int(r), int(s)] = float(v)
    assert sorted(printed) == sorted([(r, s) for r in range(4) for s in (10, 20, 30)] +
                                     [(r, s) for r in range(2) for s in (40, 50, 60)])
    assert printed[0, 60] < printed[0, 10] - 0.3  # it learns, across the change of mesh
    done = subprocess.run([sys.executable, str(example), "export"], cwd=tmp_path, env=env, capture_output=True,
                          text=True, timeout=300)
    assert done.returncode == 0, done.stderr[-3000:]

    exported = GPT(GPTConfig(n_layer=2, n_head=2, n_embd=64, num_experts=4, expert_hidden=64, block_size=64))
    ckpt = latest_checkpoint(tmp_path / "runs" / "sharded" / "export")
    assert ckpt is not None
    load_checkpoint(ckpt, model=exported)
    # Rank 0's rows of step 60 (its last): the exported weights (after that step) do at least as well as the loss
    # printed before the update; an export missing the other ranks' experts or shards would not.
    x, y = TokenData.from_file(None, block_size=64).batch("train", 16, 64, seed=0, step=59, rows=slice(0, 8))
    with torch.no_grad():
        _, loss = exported(x, y)
    assert loss.item() < printed[0, 60] + 0.02


@pytest.mark.slow
def test_hf_job_fsdp_equals_the_replicated_run(tmp_path: Path) -> None:
    """flexmoe train --hf-arch qwen3_moe --nproc 2 --ep 2 --fsdp logs the replicated run's losses, holds less, and
    exports (--export-hf) what the replicated run exports."""
    env = {**os.environ, "PYTHONPATH": child_pythonpath(Path(__file__).resolve().parents[1] / "src")}
    hf = ["--hf-arch", "qwen3_moe", "--steps", "4", "--nproc", "2", "--batch-size", "4", "--block-size", "32",
          "--warmup", "2", "--lr", "1e-2", "--log-every", "1", "--eval-every", "4", "--eval-batches", "1",
          "--ckpt-every", "4", "--no-progress", "--no-plots"]
    runs = {}
    for name, extra in (("ddp", []), ("fsdp", ["--ep", "2", "--fsdp"])):
        extra = [*extra, "--export-hf", str(tmp_path / f"{name}-export")]
        done = subprocess.run([sys.executable, "-m", "flexmoe", "train", "--out", str(tmp_path / name), *hf, *extra],
                              capture_output=True, text=True, timeout=600, env=env)
        assert done.returncode == 0, done.stderr[-3000:]
        runs[name] = (_losses(tmp_path / name),
                      json.loads((tmp_path / name / "summary.json").read_text())["state_bytes_per_rank"])
    assert len(runs["ddp"][0]) == 4
    assert runs["fsdp"][0] == pytest.approx(runs["ddp"][0], rel=1e-5)
    assert all(f < d for f, d in zip(runs["fsdp"][1], runs["ddp"][1])), runs

    # --export-hf: under --fsdp one block gathered at a time (flexmoe.hf.save_pretrained), without it HF's own
    # save_pretrained; plain HF reloads both, and the two trained models compute the same logits.
    import transformers

    logits = []
    for name in ("ddp", "fsdp"):
        exported = transformers.AutoModelForCausalLM.from_pretrained(tmp_path / f"{name}-export",
                                                                     dtype=torch.float32).eval()
        x = torch.randint(0, exported.config.vocab_size, (2, 16), generator=torch.Generator().manual_seed(0))
        with torch.no_grad():
            logits.append(exported(x).logits)
    assert (logits[0] - logits[1]).abs().max().item() < 1e-4
