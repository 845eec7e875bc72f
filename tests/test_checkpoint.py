"""Checkpoints: round trip, clear failures on damage or mismatch, and offline resharding N -> M."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

from flexmoe.apps.models import GPT, GPTConfig
from flexmoe.apps.train import TrainConfig, build_optimizer
from flexmoe.checkpoint import (
    CheckpointError,
    latest_checkpoint,
    load_checkpoint,
    read_checkpoint,
    reshard_checkpoint,
    save_checkpoint,
)
from flexmoe.parallel.layout import ExpertLayout, shard_expert_state

TINY = dict(n_layer=2, n_head=2, n_embd=32, block_size=16, num_experts=4, expert_hidden=32, k=2)

# Tiny models run fastest on one thread (the fixture one_thread of tests/conftest.py).
pytestmark = pytest.mark.usefixtures("one_thread")



def _trained(tmp_path: Path, **cfg) -> tuple[GPT, torch.optim.Optimizer, Path]:
    """A tiny model after two optimizer steps (so the AdamW moments are not empty), saved once."""
    torch.manual_seed(0)
    model = GPT(GPTConfig(**{**TINY, **cfg}))
    opt = build_optimizer(model, TrainConfig())
    for _ in range(2):
        x = torch.randint(0, 256, (4, 16))
        _, loss = model(x, x)
        (loss + model.regularization_loss()).backward()
        opt.step()
        opt.zero_grad()
    ckpt = save_checkpoint(tmp_path, model=model, optimizer=opt, step=2)
    assert ckpt is not None
    return model, opt, ckpt


def _outputs(model: GPT) -> torch.Tensor:
    model.eval()
    with torch.no_grad():
        return model(torch.arange(32).reshape(2, 16) * 7 % 256)[0]


def test_round_trip_restores_model_optimizer_and_rng(tmp_path: Path) -> None:
    model, opt, ckpt = _trained(tmp_path)
    rng_after_save = torch.rand(3)
    assert latest_checkpoint(tmp_path) == ckpt
    meta = json.loads((ckpt / "meta.json").read_text())
    assert meta["step"] == 2 and meta["num_experts"] == 4
    assert meta["layout"]["world_size"] == 1 and meta["config"]["num_experts"] == 4
    assert meta["optimizer"]["class"] == "AdamW"

    torch.manual_seed(123)
    fresh = GPT(GPTConfig(**TINY))
    fresh_opt = build_optimizer(fresh, TrainConfig())
    load_checkpoint(ckpt, model=fresh, optimizer=fresh_opt)
    assert torch.equal(torch.rand(3), rng_after_save)  # torch RNG restored to its state at save time
    for (n, a), b in zip(model.state_dict().items(), fresh.state_dict().values()):
        assert torch.equal(a, b), n
    for p, q in zip(model.parameters(), fresh.parameters()):
        for key in ("exp_avg", "exp_avg_sq", "step"):
            assert torch.equal(opt.state[p][key], fresh_opt.state[q][key])


@pytest.mark.parametrize("keep", [1, 2, 3])
def test_only_the_newest_keep_checkpoints_stay(tmp_path: Path, keep: int) -> None:
    """Five saves with ``keep``: the directories left are the newest ``keep`` steps, latest.json names the last."""
    model, opt, _ = _trained(tmp_path / "first")
    steps = [3, 6, 9, 12, 15]
    for step in steps:
        save_checkpoint(tmp_path, model=model, optimizer=opt, step=step, keep=keep)
    want = [f"step_{s:06d}" for s in steps[-keep:]]
    assert sorted(p.name for p in (tmp_path / "checkpoints").iterdir() if p.is_dir()) == want
    assert latest_checkpoint(tmp_path) == tmp_path / "checkpoints" / "step_000015"


def test_no_pickle_in_checkpoint(tmp_path: Path) -> None:
    _, _, ckpt = _trained(tmp_path)
    assert sorted(p.name for p in ckpt.iterdir()) == ["meta.json", "model.safetensors", "optimizer.safetensors"]
    assert not list(tmp_path.rglob("*.tmp"))  # atomic writes leave no temporary files behind


def test_truncated_checkpoint_names_file_and_tensor(tmp_path: Path) -> None:
    _, _, ckpt = _trained(tmp_path)
    path = ckpt / "model.safetensors"
    data = path.read_bytes()
    path.write_bytes(data[: len(data) - 100])
    with pytest.raises(CheckpointError, match=r"model\.safetensors: truncated: tensor '[\w.]+'"):
        read_checkpoint(ckpt)


def test_corrupted_tensor_names_file_and_tensor(tmp_path: Path) -> None:
    _, _, ckpt = _trained(tmp_path)
    path = ckpt / "model.safetensors"
    data = bytearray(path.read_bytes())
    data[-5] ^= 0xFF  # one flipped byte in the last tensor's data
    path.write_bytes(bytes(data))
    with pytest.raises(CheckpointError, match=r"model\.safetensors: tensor '[\w.]+' is corrupted"):
        read_checkpoint(ckpt)


def test_corrupted_header_and_meta_fail_clearly(tmp_path: Path) -> None:
    _, _, ckpt = _trained(tmp_path)
    (ckpt / "optimizer.safetensors").write_bytes(b"\xff" * 16)
    with pytest.raises(CheckpointError, match=r"optimizer\.safetensors: not a readable safetensors file"):
        read_checkpoint(ckpt)
    (ckpt / "meta.json").write_text("{not json")
    with pytest.raises(CheckpointError, match=r"meta\.json: not valid JSON"):
        read_checkpoint(ckpt)


def test_shape_mismatch_names_tensor(tmp_path: Path) -> None:
    _, _, ckpt = _trained(tmp_path)
    wider = GPT(GPTConfig(**{**TINY, "n_embd": 48}))
    with pytest.raises(CheckpointError, match=r"model\.safetensors: tensor 'tok_emb\.weight' has shape \(256, 32\)"):
        load_checkpoint(ckpt, model=wider)
    more_experts = GPT(GPTConfig(**{**TINY, "num_experts": 8}))
    with pytest.raises(CheckpointError, match=r"tensor 'blocks\.1\.mlp\.experts\.\w+' holds 4 experts.*has 8"):
        load_checkpoint(ckpt, model=more_experts)


def test_offline_reshard_1_2_4_1_keeps_outputs(tmp_path: Path) -> None:
    """Global -> 2 ranks -> 4 ranks -> global (whole experts), and 4 experts on 8 ranks (hidden shards)."""
    model, _, ckpt = _trained(tmp_path)
    expected = _outputs(model)
    two = reshard_checkpoint(ckpt, tmp_path / "two", 2)
    four = reshard_checkpoint(two, tmp_path / "four", 4)
    eight = reshard_checkpoint(four, tmp_path / "eight", 8)  # W % E == 0: each expert split over 2 ranks
    back = reshard_checkpoint(eight, tmp_path / "back", 1)
    assert (two / "model-rank00001-of-00002.safetensors").is_file()
    assert (eight / "model-rank00007-of-00008.safetensors").is_file()

    # Each rank file holds exactly that rank's slice of the layout.
    name = "blocks.1.mlp.experts.w1"
    full = model.state_dict()[name]
    for world, path in ((2, two), (4, four), (8, eight)):
        layout = ExpertLayout(4, world, 32)
        for rank in range(world):
            part = read_tensors_of(path / f"model-rank{rank:05d}-of-{world:05d}.safetensors")
            assert torch.equal(part[name], shard_expert_state({"w1": full}, layout, rank)["w1"])

    for path in (two, four, eight, back):
        fresh = GPT(GPTConfig(**TINY))
        opt = build_optimizer(fresh, TrainConfig())
        load_checkpoint(path, model=fresh, optimizer=opt)  # N ranks -> 1 process at load time
        assert torch.equal(_outputs(fresh), expected), path
    with pytest.raises(CheckpointError, match="cannot reshard to 3 ranks"):
        reshard_checkpoint(ckpt, tmp_path / "three", 3)


def read_tensors_of(path: Path) -> dict[str, torch.Tensor]:
    from safetensors.torch import load_file

    return load_file(str(path))


def test_missing_rank_file_fails_clearly(tmp_path: Path) -> None:
    _, _, ckpt = _trained(tmp_path)
    two = reshard_checkpoint(ckpt, tmp_path / "two", 2)
    (two / "model-rank00001-of-00002.safetensors").unlink()
    with pytest.raises(CheckpointError, match=r"model-rank00001-of-00002\.safetensors: missing"):
        read_checkpoint(two)


def test_a_checkpoint_of_whole_groups_resumes_into_split_groups(tmp_path: Path) -> None:
    """A checkpoint whose optimizer held one group per weight decay (as build_optimizer made them before it split
    each group's experts apart) resumes into today's split groups: every parameter's moments, and each part with
    its saved group's hyperparameters, but the resuming optimizer's own way to compute (foreach)."""
    torch.manual_seed(0)
    model = GPT(GPTConfig(**TINY))
    decay = [p for n, p in model.named_parameters() if p.dim() >= 2 and not n.endswith(("b1", "b2", "b3"))]
    rest = [p for p in model.parameters() if all(p is not q for q in decay)]
    whole = torch.optim.AdamW([{"params": decay, "weight_decay": 0.25}, {"params": rest, "weight_decay": 0.0}],
                              lr=3e-3, foreach=False)
    x = torch.randint(0, 256, (4, 16))
    _, loss = model(x, x)
    loss.backward()
    whole.step()
    ckpt = save_checkpoint(tmp_path, model=model, optimizer=whole, step=1)
    assert ckpt is not None

    fresh = GPT(GPTConfig(**TINY))
    split = build_optimizer(fresh, TrainConfig(weight_decay=0.5, lr=1e-2))
    assert len(split.param_groups) > len(whole.param_groups)  # the experts apart: a real split
    load_checkpoint(ckpt, model=fresh, optimizer=split)
    names = {id(p): n for n, p in fresh.named_parameters()}
    saved_decay = {n for n, p in model.named_parameters() if any(p is q for q in decay)}
    for group in split.param_groups:
        in_decay = {names[id(p)] in saved_decay for p in group["params"]}
        assert len(in_decay) == 1
        assert group["weight_decay"] == (0.25 if in_decay.pop() else 0.0) and group["lr"] == 3e-3
        assert group["foreach"] is True
    for p, q in zip(model.parameters(), fresh.parameters()):
        for key in ("exp_avg", "exp_avg_sq", "step"):
            assert torch.equal(whole.state[p][key], split.state[q][key])
