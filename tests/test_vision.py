"""The vision MoE job (`flexmoe train-vision`): the ViT's shapes and layout, the dense twin's equal active
compute, a short run learns the digits, the run directory, --resume."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
import torch._dynamo

from flexmoe.apps import cli, vision
from flexmoe.apps.models.vit import ViT, ViTConfig, patchify
from flexmoe.checkpoint import read_checkpoint
from flexmoe.layer import MoELayer
from flexmoe.routing.routers import CosineRouter

pytestmark = pytest.mark.usefixtures("one_thread")  # tests/conftest.py


def _metrics(run_dir: Path) -> list[dict]:
    return [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]


# ------------------------------------------------------------------------------------------ the model


def test_patchify_cuts_row_major_patches() -> None:
    images = torch.randn(3, 2, 8, 8)
    p = 4
    expected = torch.stack([
        torch.stack([images[b, :, i * p:(i + 1) * p, j * p:(j + 1) * p].reshape(-1)
                     for i in range(8 // p) for j in range(8 // p)])
        for b in range(3)
    ])
    assert torch.equal(patchify(images, p), expected)


@pytest.mark.parametrize("patch_size", [2, 4])
@pytest.mark.parametrize("pool", ["mean", "cls"])
def test_model_shapes(patch_size: int, pool: str) -> None:
    torch.manual_seed(0)
    cfg = ViTConfig(patch_size=patch_size, n_layer=2, n_embd=32, num_experts=4, expert_hidden=16, pool=pool)
    model = ViT(cfg)
    images, labels = torch.rand(5, 1, 8, 8), torch.randint(0, 10, (5,))
    logits, loss = model(images, labels)
    assert logits.shape == (5, 10)
    tokens = (8 // patch_size) ** 2 + (pool == "cls")  # the patches, and the class token
    assert model.pos_emb.shape == (1, tokens, 32)
    assert (model.cls_token is not None) == (pool == "cls")
    assert loss is not None and loss.shape == () and torch.isfinite(loss)
    assert torch.allclose(loss, torch.nn.functional.cross_entropy(logits, labels))
    assert model(images)[1] is None
    with pytest.raises(ValueError, match=r"images must be \[B, 1, 8, 8\]"):
        model(torch.rand(5, 8, 8, 1))


def test_moe_every_other_block_with_the_cosine_router() -> None:
    model = ViT(ViTConfig(n_layer=4))
    kinds = [type(b.mlp) for b in model.blocks]
    assert kinds[1] is MoELayer and kinds[3] is MoELayer
    assert kinds[0] is not MoELayer and kinds[2] is not MoELayer
    for block in (model.blocks[1], model.blocks[3]):
        assert isinstance(block.mlp.router, CosineRouter)
        assert block.mlp.num_experts == 8 and block.mlp.k == 2
    assert not any(isinstance(m, MoELayer) for m in ViT(ViTConfig(dense=True)).modules())


def _count_active_per_token(cfg: ViTConfig) -> dict[str, int]:
    """Parameters one token uses, from the configuration alone, split into the MLPs' and everything else."""
    d, c, p, n = cfg.n_embd, cfg.channels, cfg.patch_size, (cfg.image_size // cfg.patch_size) ** 2
    cls = 1 if cfg.pool == "cls" else 0
    # patch embedding, class token, positions, final norm, head
    shared = (c * p * p * d + d) + cls * d + (n + cls) * d + 2 * d + (d * cfg.num_classes + cfg.num_classes)
    attention_and_norms = 4 * d + (3 * d * d + 3 * d) + (d * d + d)
    mlp_weights = mlp_biases = router = 0
    for i in range(cfg.n_layer):
        moe = not cfg.dense and (i + 1) % cfg.moe_every == 0
        h = cfg.expert_hidden if moe else cfg.k * cfg.expert_hidden
        copies = cfg.k if moe else 1  # a token runs k experts of hidden h, or one dense MLP of hidden k * h
        mlp_weights += copies * 2 * d * h
        mlp_biases += copies * (h + d)
        router += (cfg.num_experts * d + 1) if moe else 0  # cosine gate: [E, D] and a temperature
    return {"other": shared + cfg.n_layer * attention_and_norms, "mlp_weights": mlp_weights,
            "mlp_biases": mlp_biases, "router": router}


@pytest.mark.parametrize("pool", ["mean", "cls"])
def test_dense_twin_has_the_moe_models_active_parameters_per_token(pool: str) -> None:
    cfg = ViTConfig(pool=pool)
    moe, dense = ViT(cfg), ViT(cfg.dense_twin())
    want_moe, want_dense = _count_active_per_token(cfg), _count_active_per_token(cfg.dense_twin())
    assert moe.num_params(active=True) == sum(want_moe.values())
    assert dense.num_params(active=True) == dense.num_params() == sum(want_dense.values())
    # Equal compute per token: the same matrices (attention, MLP weights) and shapes everywhere else; the MoE
    # model adds only its gates and the k-1 extra output biases of the experts a token visits.
    assert want_moe["mlp_weights"] == want_dense["mlp_weights"] == cfg.n_layer * 2 * 64 * 256
    assert want_moe["other"] == want_dense["other"]
    extra = moe.num_params(active=True) - dense.num_params(active=True)
    assert extra == 2 * (8 * 64 + 1) + 2 * (2 - 1) * 64
    # ...and holds E/k times the expert parameters in total.
    assert moe.num_params() - moe.num_params(active=True) == 2 * (8 - 2) * (2 * 64 * 128 + 128 + 64)


# ------------------------------------------------------------------------------------------ data


def test_held_out_split_is_fixed_and_disjoint() -> None:
    train_a, held_a = vision.load_digits_split()
    train_b, held_b = vision.load_digits_split()
    assert len(train_a) + len(held_a) == 1797 and len(held_a) == 360
    assert torch.equal(held_a.images, held_b.images) and torch.equal(held_a.labels, held_b.labels)
    rows = {tuple(x.flatten().tolist()) + (int(y),) for x, y in zip(train_a.images, train_a.labels)}
    # A handful of digits occur twice in the data set, so compare rows, allowing those few duplicates.
    shared = sum(tuple(x.flatten().tolist()) + (int(y),) in rows for x, y in zip(held_a.images, held_a.labels))
    assert shared <= 5
    assert float(train_a.images.min()) == 0.0 and float(train_a.images.max()) == 1.0
    assert sorted(set(held_a.labels.tolist())) == list(range(10))
    x1, y1 = train_a.batch(16, seed=3, step=7)
    x2, y2 = train_a.batch(16, seed=3, step=7)
    assert torch.equal(x1, x2) and torch.equal(y1, y2) and x1.shape == (16, 1, 8, 8)
    assert not torch.equal(train_a.batch(16, seed=3, step=8)[1], y1)


# ------------------------------------------------------------------------------------------ the job

SHORT = ["--steps", "150", "--log-every", "25", "--eval-every", "75", "--ckpt-every", "75", "--n-embd", "32",
         "--n-layer", "2", "--expert-hidden", "64", "--num-experts", "4", "--no-progress"]


def test_short_run_learns_and_writes_the_run_directory(tmp_path: Path) -> None:
    out = tmp_path / "vision"
    assert cli.main(["train-vision", "--out", str(out), "--compare-dense", *SHORT]) == 0
    for run_dir in (out, out / "dense"):
        summary = json.loads((run_dir / "summary.json").read_text())
        assert summary["steps"] == 150
        assert summary["val_accuracy"] > 0.5, summary  # chance is 0.1
        records = _metrics(run_dir)
        assert [r["step"] for r in records] == list(range(25, 175, 25))
        evaluated = [r for r in records if "val_accuracy" in r]
        assert [r["step"] for r in evaluated] == [75, 150]
        assert evaluated[-1]["val_accuracy"] == summary["val_accuracy"]
        assert (run_dir / "loss.png").stat().st_size > 0
        assert sorted(p.name for p in (run_dir / "checkpoints").iterdir() if p.is_dir()) == \
            ["step_000075", "step_000150"]
        assert json.loads((run_dir / "config.json").read_text())["model"]["router"] == "cosine"
    moe_records = _metrics(out)
    assert all(len(r["expert_load"]) == 1 and len(r["expert_load"][0]) == 4 for r in moe_records)
    assert (out / "expert_load.png").stat().st_size > 0
    assert not (out / "dense" / "expert_load.png").exists()  # the twin has no experts
    compare = json.loads((out / "compare.json").read_text())
    assert compare["moe"]["active_params"] - compare["dense"]["active_params"] == 4 * 32 + 1 + 32  # one gate
    assert "held-out accuracy" in (out / "compare.md").read_text()
    assert (out / "compare.png").stat().st_size > 0

    # An existing run is touched only with --resume or --overwrite.
    assert cli.main(["train-vision", "--out", str(out), *SHORT]) == 2


def test_resume_continues_exactly_as_an_uninterrupted_run(tmp_path: Path) -> None:
    flags = ["--log-every", "10", "--eval-every", "20", "--ckpt-every", "20", "--n-embd", "32", "--n-layer", "2",
             "--expert-hidden", "32", "--num-experts", "4", "--no-progress", "--no-plots"]
    straight, split = tmp_path / "straight", tmp_path / "split"
    assert cli.main(["train-vision", "--out", str(straight), "--steps", "40", *flags]) == 0
    assert cli.main(["train-vision", "--out", str(split), "--steps", "20", *flags]) == 0
    assert cli.main(["train-vision", "--out", str(split), "--steps", "40", "--resume", "--no-progress"]) == 0
    a, b = _metrics(straight), _metrics(split)
    assert [r["step"] for r in b] == [10, 20, 30, 40]
    for ra, rb in zip(a, b):
        assert ra["train_loss"] == rb["train_loss"] and ra.get("val_loss") == rb.get("val_loss")
    assert json.loads((split / "summary.json").read_text())["val_accuracy"] == \
        json.loads((straight / "summary.json").read_text())["val_accuracy"]


@pytest.mark.slow  # the GPT job's compiled run (tests/test_train.py) covers --compile in the default suite
def test_compiled_run_equals_eager(tmp_path: Path) -> None:
    """--compile (aot_eager here, for speed) trains the cosine-router ViT to the eager run's losses."""
    flags = ["--steps", "20", "--log-every", "10", "--eval-every", "20", "--ckpt-every", "20", "--n-embd", "32",
             "--n-layer", "2", "--expert-hidden", "32", "--num-experts", "4", "--no-progress", "--no-plots"]
    eager, compiled = tmp_path / "eager", tmp_path / "compiled"
    assert cli.main(["train-vision", "--out", str(eager), *flags]) == 0
    graphs = torch._dynamo.utils.counters["stats"]["unique_graphs"]
    assert cli.main(["train-vision", "--out", str(compiled), "--compile", "aot_eager", *flags]) == 0
    assert torch._dynamo.utils.counters["stats"]["unique_graphs"] > graphs  # it did compile
    a, b = _metrics(eager), _metrics(compiled)
    assert [r["step"] for r in b] == [r["step"] for r in a] == [10, 20]
    for ra, rb in zip(a, b):
        assert rb["train_loss"] == pytest.approx(ra["train_loss"], rel=1e-5, abs=1e-6)
    assert b[-1]["val_loss"] == pytest.approx(a[-1]["val_loss"], rel=1e-5, abs=1e-6)


def test_selection_biases_move_once_per_step_as_in_the_other_jobs(tmp_path: Path, monkeypatch) -> None:
    """train-vision makes the per-step expert-bias update of flexmoe train (balance="bias", DeepSeek-V3's rule):
    after each optimizer step ``bias += rate * sign(mean(load) - load)``, ``load`` the step's pairs per expert
    before drops. With one forward per step and --log-every 1 that load is each record's ``expert_demand``, so
    the saved bias must equal the rule applied here, step by step, to the logged demands."""
    rate = 0.05

    def vit_with_bias(cfg: ViTConfig, seed: int) -> ViT:  # the job's model, its MoE layer selecting with a bias
        torch.manual_seed(seed)
        model = ViT(cfg)
        for block in model.blocks:
            if block.is_moe:
                block.mlp = MoELayer(cfg.n_embd, cfg.num_experts, cfg.expert_hidden, k=cfg.k, router=cfg.router,
                                     capacity_factor=cfg.capacity_factor, activation="gelu", group="single",
                                     balance="bias", bias_update_rate=rate)
        return model

    monkeypatch.setattr(vision, "build_vit", vit_with_bias)
    out = tmp_path / "bias"
    steps = 6
    assert cli.main(["train-vision", "--out", str(out), "--steps", str(steps), "--log-every", "1", "--eval-every",
                     "6", "--ckpt-every", "6", "--n-embd", "32", "--n-layer", "2", "--expert-hidden", "32",
                     "--num-experts", "4", "--no-progress", "--no-plots"]) == 0
    records = _metrics(out)
    assert [r["step"] for r in records] == list(range(1, steps + 1))
    want = torch.zeros(4, dtype=torch.float32)
    history = []
    for r in records:
        (demand,) = r["expert_demand"]  # one MoE layer
        load = torch.tensor(demand, dtype=torch.float32)
        want = want + rate * torch.sign(load.mean() - load)
        history.append(want)
    assert len({tuple(h.tolist()) for h in history}) > 1  # the load was uneven, so the bias moved
    saved = read_checkpoint(out / "checkpoints" / f"step_{steps:06d}").model
    (name,) = [n for n in saved if n.endswith("expert_bias")]
    torch.testing.assert_close(saved[name], want, rtol=0, atol=1e-6)
    assert saved[name].abs().sum() > 0


def test_user_errors_are_one_line(tmp_path: Path, capsys) -> None:
    assert cli.main(["train-vision", "--out", str(tmp_path / "a"), "--patch-size", "3"]) == 2
    assert "image_size=8 must divide by patch_size=3" in capsys.readouterr().err
    assert cli.main(["train-vision", "--out", str(tmp_path / "a"), "--batch-size", "5000"]) == 2
    assert "--batch-size 5000 exceeds" in capsys.readouterr().err


@pytest.mark.slow
def test_default_run_reaches_high_accuracy(tmp_path: Path) -> None:
    out = tmp_path / "vision"
    assert cli.main(["train-vision", "--out", str(out), "--compare-dense", "--no-progress"]) == 0
    compare = json.loads((out / "compare.json").read_text())
    assert compare["moe"]["val_accuracy"] > 0.9 and compare["dense"]["val_accuracy"] > 0.9, compare
