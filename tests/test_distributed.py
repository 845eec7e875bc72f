"""Multi-rank training and checkpoints with real gloo processes on 127.0.0.1 (flexmoe.launch.spawn_ranks).

* A 2-rank training step equals the single-process step over the same global batch (one micro-batch per
  rank's rows), so data parallelism (and expert parallelism) changes nothing.
* A checkpoint written by 2 ranks loads on 1 and on 4 ranks (directly, and after ``flexmoe reshard``) and the
  model gives the same outputs.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from flexmoe.apps.models import GPT, GPTConfig
from flexmoe.checkpoint import load_checkpoint, read_checkpoint, reshard_checkpoint
from flexmoe.launch import spawn_ranks

TINY_FLAGS = ["--n-layer", "2", "--n-head", "2", "--n-embd", "32", "--block-size", "32", "--num-experts", "4",
              "--expert-hidden", "32", "--batch-size", "8", "--warmup", "2", "--lr", "1e-2", "--no-progress",
              "--no-plots", "--eval-batches", "1"]

TRAIN_RUNNER = (
    "import argparse, sys\n"
    "from flexmoe.apps import train_command\n"
    "p = argparse.ArgumentParser(); train_command.add_arguments(p)\n"
    "sys.exit(train_command.run(p.parse_args(sys.argv[1:])))\n"
)

# Loads each checkpoint given on the command line at the launched world size and saves every rank's output
# on a fixed input: under expert parallelism each rank's output equals a single process running its tokens.
EVAL_RUNNER = (
    "import sys, torch, torch.distributed as dist\n"
    "from safetensors.torch import save_file\n"
    "from flexmoe.checkpoint import load_checkpoint, read_checkpoint\n"
    "from flexmoe.apps.models import GPT, GPTConfig\n"
    "dist.init_process_group('gloo')\n"
    "group = dist.group.WORLD\n"
    "out = {}\n"
    "for i, path in enumerate(sys.argv[2:]):\n"
    "    model = GPT(GPTConfig.from_dict(read_checkpoint(path).meta['config']), group=group).eval()\n"
    "    load_checkpoint(path, model=model)\n"
    "    out[f'out{i}'] = model(torch.arange(64).reshape(2, 32) * 5 % 256)[0].detach()\n"
    "    out[f'w1_{i}'] = model.blocks[1].mlp.experts.w1.detach().clone()\n"
    "save_file(out, f'{sys.argv[1]}/rank{dist.get_rank()}.safetensors')\n"
    # Every rank past its last all-to-all before any tears the group down: a rank that destroyed it while a
    # peer's exchange was still in flight made that peer abort ("terminate called", exit -6) once in a full run.
    "dist.barrier()\n"
    "dist.destroy_process_group()\n"
)


def _python(script: str, argv: list[str], nproc: int = 1) -> None:
    """Run ``script`` in one process, or in ``nproc`` gloo ranks (flexmoe.launch.spawn_ranks)."""
    if nproc == 1:
        proc = subprocess.run([sys.executable, "-c", script, *argv], env={**os.environ, "OMP_NUM_THREADS": "1"},
                              capture_output=True, text=True, timeout=240)
        assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    else:
        spawn_ranks(nproc, ["-c", script, *argv], timeout=240)  # raises, naming the failed rank and its stderr


def _metrics(run_dir: Path) -> list[dict]:
    return [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]


@pytest.fixture(scope="module")
def two_rank_run(tmp_path_factory) -> tuple[Path, Path]:
    """The same 3 steps trained by 1 process (2 micro-batches) and by 2 ranks (1 micro-batch each)."""
    root = tmp_path_factory.mktemp("dist")
    common = ["--steps", "3", "--log-every", "1", "--eval-every", "3", *TINY_FLAGS]
    _python(TRAIN_RUNNER, ["--out", str(root / "single"), "--micro-batches", "2", *common])
    _python(TRAIN_RUNNER, ["--out", str(root / "two"), *common], nproc=2)
    return root / "single", root / "two"


def test_two_rank_step_equals_single_process_step(two_rank_run) -> None:
    single, two = two_rank_run
    assert json.loads((two / "config.json").read_text())["world_size"] == 2
    a, b = _metrics(single), _metrics(two)
    assert [r["step"] for r in a] == [r["step"] for r in b] == [1, 2, 3]
    for ra, rb in zip(a, b):
        assert rb["train_loss"] == pytest.approx(ra["train_loss"], rel=1e-5, abs=1e-6)
        assert rb["expert_load"] == ra["expert_load"]  # the same routing, summed over ranks
    ckpt_a, ckpt_b = read_checkpoint(single / "checkpoints" / "step_000003"), \
        read_checkpoint(two / "checkpoints" / "step_000003")
    assert ckpt_b.meta["layout"]["trained_world_size"] == 2
    # Adam moves a weight by up to lr = 1e-2 per step whatever its gradient's size. Where a gradient element is
    # near zero by cancellation (comparable to Adam's eps, 1e-8), float32 rounding changes its step by up to a
    # few percent of lr; the 2-rank run adds each token's expert outputs per rank first (token exchange), a
    # different order than one process. Measured: at most 8e-5 on 0.5% of the dense MLP's weights.
    for name, t in ckpt_a.model.items():
        torch.testing.assert_close(ckpt_b.model[name], t, rtol=1e-4, atol=2e-4, msg=name)


@pytest.mark.slow  # 16 s: a 4-rank load
def test_checkpoint_from_two_ranks_loads_on_one_and_four(two_rank_run, tmp_path: Path) -> None:
    _, two = two_rank_run
    ckpt = two / "checkpoints" / "step_000003"
    meta = read_checkpoint(ckpt).meta
    model = GPT(GPTConfig.from_dict(meta["config"])).eval()
    load_checkpoint(ckpt, model=model)  # 2 -> 1 at load time
    with torch.no_grad():
        expected = model(torch.arange(64).reshape(2, 32) * 5 % 256)[0]
    w1 = model.blocks[1].mlp.experts.w1.detach()

    four = reshard_checkpoint(ckpt, tmp_path / "four", 4)  # offline 2 -> 4
    one = reshard_checkpoint(four, tmp_path / "one", 1)  # offline 4 -> 1
    outdir = tmp_path / "outs"
    outdir.mkdir()
    _python(EVAL_RUNNER, [str(outdir), str(ckpt), str(four), str(one)], nproc=4)  # 1 -> 4, 4 -> 4 at load time
    from safetensors.torch import load_file

    for rank in range(4):
        got = load_file(str(outdir / f"rank{rank}.safetensors"))
        for i in range(3):
            torch.testing.assert_close(got[f"out{i}"], expected, rtol=1e-5, atol=1e-6)
            local = w1[rank : rank + 1]
            assert torch.equal(got[f"w1_{i}"], local)  # rank r holds global expert r (E = W = 4)


# Checkpoint gather/scatter under an expert-parallel layout, at the state level: each rank's MoE layers hold
# only its experts (built as the layout says), the checkpoint must hold the global tensors, and loading must
# give each rank its slice back.
STATE_RUNNER = (
    "import sys, torch, torch.distributed as dist\n"
    "from safetensors.torch import save_file\n"
    "from flexmoe.checkpoint import global_state_dict, load_checkpoint, load_global_state_dict, save_checkpoint\n"
    "from flexmoe.apps.models import GPT, GPTConfig\n"
    "from flexmoe.parallel.layout import ExpertLayout\n"
    "from flexmoe.apps.train import TrainConfig, build_optimizer\n"
    "dist.init_process_group('gloo')\n"
    "rank, world = dist.get_rank(), dist.get_world_size()\n"
    "out, experts = sys.argv[1], int(sys.argv[2])\n"
    "cfg = GPTConfig(n_layer=2, n_head=2, n_embd=16, block_size=8, num_experts=experts, expert_hidden=8)\n"
    "layout = ExpertLayout(experts, world, 8)\n"
    "torch.manual_seed(0)\n"
    "reference = GPT(cfg)\n"
    "model = GPT(cfg, group=dist.group.WORLD)\n"
    "assert model.moe_layers[0].experts.w1.shape == (layout.experts_per_rank, 16, layout.local_hidden_dim)\n"
    "load_global_state_dict(model, reference.state_dict(), source='reference')\n"
    "opt = build_optimizer(model, TrainConfig())\n"
    "for i, p in enumerate(model.parameters()):\n"
    "    p.grad = torch.full_like(p, 0.01 * (i + 1))\n"
    "opt.step()\n"
    "local = {k: v.clone() for k, v in model.state_dict().items()}\n"
    "glob = global_state_dict(model)\n"
    "save_checkpoint(out, model=model, optimizer=opt, step=1)\n"
    "dist.barrier()\n"
    "for p in model.parameters():\n"
    "    torch.nn.init.zeros_(p)\n"
    "load_checkpoint(out + '/checkpoints/step_000001', model=model, optimizer=build_optimizer(model, TrainConfig()))\n"
    "assert all(torch.equal(v, model.state_dict()[k]) for k, v in local.items())\n"
    "save_file({**{'local.' + k: v for k, v in local.items()}, **{'global.' + k: v for k, v in glob.items()}},\n"
    "          f'{out}/rank{rank}.safetensors')\n"
    "dist.destroy_process_group()\n"
)


# Whole experts per rank; hidden-dim shards (4 ranks: the slow step).
@pytest.mark.parametrize("experts,world", [(4, 2), pytest.param(2, 4, marks=pytest.mark.slow)])
def test_checkpoint_gathers_and_scatters_expert_shards(tmp_path: Path, experts: int, world: int) -> None:
    from safetensors.torch import load_file

    from flexmoe.parallel.layout import ExpertLayout, shard_expert_state

    (tmp_path / "x").mkdir()
    _python(STATE_RUNNER, [str(tmp_path / "x"), str(experts)], nproc=world)
    ckpt = read_checkpoint(tmp_path / "x" / "checkpoints" / "step_000001")
    assert ckpt.meta["layout"]["trained_world_size"] == world
    layout = ExpertLayout(experts, world, 8)
    for rank in range(world):
        got = load_file(str(tmp_path / "x" / f"rank{rank}.safetensors"))
        for key, value in ckpt.model.items():
            assert torch.equal(got["global." + key], value), key  # every rank sees the global tensors
            kind = key.rsplit(".", 1)[-1]
            if ".experts." in key:
                expected = shard_expert_state({kind: value}, layout, rank)[kind]
                assert torch.equal(got["local." + key], expected), (rank, key)
                moment = ckpt.optimizer[f"exp_avg/{key}"]
                assert moment.shape == value.shape  # optimizer moments are stored globally too
