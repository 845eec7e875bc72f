"""flexmoe.hf.load: a save_pretrained directory loaded by shard (docs/architecture.md, "Loading by shard").

The reference is HF's own ``from_pretrained`` of the same directory. What each rank reads is recorded by a reader
that wraps the one ``load`` uses, and checked against what the mesh gives each rank to hold, worked out here from
the mesh's shape: every stored element read by exactly one rank (buffers, replicated, by every rank), and the
stored tensors of the routed experts by the ranks holding those experts only.
"""

from __future__ import annotations

import re
from pathlib import Path

import pytest
import torch

from flexmoe.launch import spawn_ranks
from flexmoe_cli import child_pythonpath
from hf_load_worker import RecordingReader, logits_of, save_checkpoint

TOL = 1e-5
NUM_EXPERTS = 8


@pytest.fixture(scope="module")
def checkpoints(tmp_path_factory) -> dict[str, Path]:
    root = tmp_path_factory.mktemp("hf_load")
    dirs = {}
    for family in ("qwen3_moe", "deepseek_v3"):
        dirs[family] = root / family
        save_checkpoint(family, dirs[family])
    dirs["qwen3_moe_single_tied"] = root / "single"
    save_checkpoint("qwen3_moe", dirs["qwen3_moe_single_tied"], tied=True, max_shard_size=None)
    return dirs


def hf_logits(directory: Path) -> torch.Tensor:
    import transformers

    model = transformers.AutoModelForCausalLM.from_pretrained(directory, dtype=torch.float32).eval()
    return torch.tensor(logits_of(model))


def stored_shapes(directory: Path) -> dict[str, tuple[int, ...]]:
    from safetensors import safe_open

    shapes = {}
    for path in directory.glob("*.safetensors"):
        with safe_open(str(path), framework="pt") as f:
            shapes.update({k: tuple(f.get_slice(k).get_shape()) for k in f.keys()})
    return shapes


def read_counts(directory: Path, reads_by_rank: list[list]) -> dict[str, torch.Tensor]:
    """For every stored tensor, how many times each element was read, over all ranks."""
    counts = {k: torch.zeros(shape, dtype=torch.int64) for k, shape in stored_shapes(directory).items()}
    for reads in reads_by_rank:
        for key, box in reads:
            counts[key][tuple(slice(a, b) for a, b in box)] += 1
    return counts


def held_experts(rank: int, ep: int, dp_shard: int) -> set[int]:
    """The experts rank ``rank`` of the mesh (dp_shard, ep), ep innermost, holds: its ep rank's E/ep, of which
    FSDP gives its dp_shard rank its chunk."""
    ep_rank, dp_rank = rank % ep, rank // ep
    per_ep = NUM_EXPERTS // ep
    per_dp = per_ep // dp_shard
    first = ep_rank * per_ep + dp_rank * per_dp
    return set(range(first, first + per_dp))


def check_reads(directory: Path, reads_by_rank: list[list], ep: int, dp_shard: int) -> None:
    world = len(reads_by_rank)
    counts = read_counts(directory, reads_by_rank)
    for key, count in counts.items():
        want = world if key.endswith("e_score_correction_bias") else 1  # buffers: every rank has them whole
        assert bool((count == want).all()), f"{key}: elements read {sorted(set(count.flatten().tolist()))} " \
                                            f"times over {world} ranks, want {want}"
    for rank, reads in enumerate(reads_by_rank):
        experts = set()
        for key, box in reads:
            if m := re.search(r"\.experts\.(\d+)\.", key):  # one stored tensor per expert
                experts.add(int(m.group(1)))
            elif ".experts." in key:  # stored fused, [E, ...]: the rows read
                experts |= set(range(*box[0]))
        assert experts == held_experts(rank, ep, dp_shard), (rank, experts)


@pytest.mark.parametrize("family", ["qwen3_moe", "deepseek_v3"])
def test_load_in_one_process_gives_hf_logits_reading_each_element_once(checkpoints, family, one_thread) -> None:
    from flexmoe.hf import ConvertedMoeBlock, load

    directory = checkpoints[family]
    assert (directory / "model.safetensors.index.json").is_file()  # sharded
    reader = RecordingReader(directory)
    model = load(directory, reader=reader)
    assert any(isinstance(m, ConvertedMoeBlock) for m in model.modules())
    got, want = torch.tensor(logits_of(model)), hf_logits(directory)
    assert (got - want).abs().max().item() < TOL
    check_reads(directory, [reader.reads], ep=1, dp_shard=1)


def test_load_single_file_with_tied_embeddings(checkpoints, one_thread) -> None:
    from flexmoe.hf import load

    directory = checkpoints["qwen3_moe_single_tied"]
    assert (directory / "model.safetensors").is_file() and not (directory / "model.safetensors.index.json").exists()
    reader = RecordingReader(directory)
    model = load(directory, reader=reader)
    assert model.lm_head.weight is model.model.embed_tokens.weight
    got, want = torch.tensor(logits_of(model)), hf_logits(directory)
    assert (got - want).abs().max().item() < TOL
    check_reads(directory, [reader.reads], ep=1, dp_shard=1)


def test_load_refuses_what_it_cannot_do(checkpoints, tmp_path) -> None:
    from flexmoe.hf import load

    with pytest.raises(FileNotFoundError, match="config.json"):
        load(tmp_path)
    with pytest.raises(ValueError, match="group"):
        load(checkpoints["qwen3_moe"], group="single")
    with pytest.raises(TypeError, match="dtype"):
        load(checkpoints["qwen3_moe"], dtype="float32")
    with pytest.raises(ValueError, match="unknown options"):
        load(checkpoints["qwen3_moe"], not_an_option=1)
    broken = tmp_path / "broken"
    broken.mkdir()
    (broken / "config.json").write_text((checkpoints["qwen3_moe"] / "config.json").read_text())
    with pytest.raises(FileNotFoundError, match="safetensors"):
        load(broken)


def _load_train_export(directory: Path, export: Path, ep: int, dp_shard: int) -> None:
    """Every rank of ep x dp_shard loads ``directory`` with HF's logits, reading only what it holds; after a
    training step, the directory flexmoe.hf.save_pretrained wrote reloads in plain HF with the ranks' logits."""
    from hf_load_worker import load_main

    results = [r.value for r in spawn_ranks(ep * dp_shard, load_main, [str(directory), ep, dp_shard, str(export)],
                                            timeout=300.0, what=f"flexmoe.hf.load at ep={ep} x dp_shard={dp_shard}")]
    want = hf_logits(directory)
    for rank, result in enumerate(results):
        diff = (torch.tensor(result["logits"]) - want).abs().max().item()
        assert diff < TOL, f"rank {rank}: logits differ from HF's by {diff}"
    check_reads(directory, [[(k, tuple(tuple(r) for r in box)) for k, box in res["reads"]] for res in results],
                ep, dp_shard)
    exported = hf_logits(export)
    for rank, result in enumerate(results):
        diff = (exported - torch.tensor(result["trained_logits"])).abs().max().item()
        assert diff < TOL, f"rank {rank}: the exported model's logits differ from the trained one's by {diff}"
    assert (exported - want).abs().max().item() > 1e-3  # the trained weights, not the loaded ones


# DeepSeek-V3 (shared expert, bias, a dense layer) in the default suite; Qwen3-MoE with the slow ones.
@pytest.mark.parametrize("family", [pytest.param("qwen3_moe", marks=pytest.mark.slow), "deepseek_v3"])
def test_load_at_ep2_with_fsdp_reads_only_what_each_rank_holds_and_exports(checkpoints, family, tmp_path) -> None:
    _load_train_export(checkpoints[family], tmp_path / "export", ep=2, dp_shard=1)


@pytest.mark.slow
@pytest.mark.parametrize("family", ["qwen3_moe", "deepseek_v3"])
def test_load_at_ep2_x_dp_shard2_reads_only_what_each_rank_holds_and_exports(checkpoints, family, tmp_path) -> None:
    _load_train_export(checkpoints[family], tmp_path / "export", ep=2, dp_shard=2)


def test_save_pretrained_of_a_loaded_model_reloads_in_plain_hf(checkpoints, tmp_path, one_thread) -> None:
    from flexmoe.hf import load, save_pretrained
    from hf_load_worker import train_step

    model = load(checkpoints["deepseek_v3"])
    train_step(model, 0)
    save_pretrained(model, tmp_path / "export")
    assert (tmp_path / "export" / "model.safetensors.index.json").is_file()
    got = hf_logits(tmp_path / "export")
    assert (got - torch.tensor(logits_of(model))).abs().max().item() < TOL
    assert (got - hf_logits(checkpoints["deepseek_v3"])).abs().max().item() > 1e-3  # trained: not the saved model



@pytest.mark.slow
def test_larger_than_rank_example_loads_by_shard_trains_resumes_and_exports(tmp_path) -> None:
    """examples/hf/train_larger_than_rank.py, quoted in the README: a sharded HF checkpoint loaded by shard onto 4
    ranks (ep=2 x dp_shard=2) learns, 2 ranks (ep=2) continue from the DCP checkpoint, and plain transformers
    reads the export with the trained model's logits."""
    import os
    import subprocess
    import sys

    example = Path(__file__).resolve().parents[1] / "examples" / "hf" / "train_larger_than_rank.py"
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONPATH": child_pythonpath(example.parents[2] / "src")}
    launch = [sys.executable, "-m", "torch.distributed.run", "--standalone"]
    printed: dict[tuple[int, int], float] = {}
    for command in ([sys.executable, str(example), "save"], [*launch, "--nproc_per_node=4", str(example), "train"],
                    [*launch, "--nproc_per_node=2", str(example), "resume"], [sys.executable, str(example), "check"]):
        done = subprocess.run(command, cwd=tmp_path, env=env, capture_output=True, text=True, timeout=300)
        assert done.returncode == 0, done.stdout[-2000:] + done.stderr[-3000:]
        for r, s, v in re.findall(r"rank (\d) step (\d+): loss ([\d.]+)", done.stdout):
            printed[int(r), int(s)] = float(v)
    assert sorted(printed) == sorted([(r, s) for r in range(4) for s in (5, 10)] +
                                     [(r, s) for r in range(2) for s in (15, 20)])
    assert printed[0, 20] < printed[0, 5] - 0.5  # it learns, across the change of mesh
    assert len(list((tmp_path / "runs" / "hf_larger" / "pretrained").glob("*.safetensors"))) > 1  # sharded
    assert "max |logits difference| between plain HF and the trained model" in done.stdout


def test_dcp_checkpoint_of_a_converted_model_loads_into_another(checkpoints, tmp_path, one_thread) -> None:
    """save_sharded / load_sharded name a converted block's tensors as the model does (as its optimizer states),
    so a checkpoint of a trained converted model loads back; the same logits bit for bit."""
    from flexmoe.hf import load
    from flexmoe.sharding import load_sharded, save_sharded
    from hf_load_worker import tokens

    model = load(checkpoints["deepseek_v3"])
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    model.train()
    x = tokens()
    model(x, labels=x).loss.backward()
    opt.step()
    model.eval()
    save_sharded(tmp_path / "ckpt", model, opt)
    other = load(checkpoints["deepseek_v3"])
    before = torch.tensor(logits_of(other))
    load_sharded(tmp_path / "ckpt", other, torch.optim.AdamW(other.parameters()))
    got = torch.tensor(logits_of(other))
    assert torch.equal(got, torch.tensor(logits_of(model)))
    assert not torch.equal(got, before)


def test_load_in_bfloat16_keeps_hf_float32_router_and_gives_hf_logits(checkpoints, one_thread) -> None:
    """dtype=bfloat16: the stored float32 tensors are cast, except what HF keeps in float32 (DeepSeek-V3's router
    weight and selection bias), as from_pretrained(dtype=bfloat16) does; the logits are HF's to bf16 rounding."""
    import transformers

    from flexmoe.hf import load

    directory = checkpoints["deepseek_v3"]
    ref = transformers.AutoModelForCausalLM.from_pretrained(directory, dtype=torch.bfloat16).eval()
    model = load(directory, dtype=torch.bfloat16)
    router = model.model.layers[1].mlp.moe.router.hf_router
    assert router.weight.dtype == torch.float32 and router.e_score_correction_bias.dtype == torch.float32
    assert model.model.layers[1].mlp.moe.experts.w1.dtype == torch.bfloat16
    assert model.model.embed_tokens.weight.dtype == torch.bfloat16
    got, want = torch.tensor(logits_of(model)), torch.tensor(logits_of(ref))
    assert (got - want).abs().max().item() < 1e-2 * want.abs().max().item()


@pytest.mark.slow
def test_train_hf_model_fsdp_loads_by_shard_and_equals_the_replicated_run(tmp_path) -> None:
    """flexmoe train --hf-model DIR --nproc 2 --ep 2 --fsdp reads the checkpoint by shard (flexmoe.hf.load) and logs
    the losses of the replicated run, which loads it with from_pretrained."""
    import json
    import os
    import subprocess
    import sys

    import transformers

    from fsdp_worker import tiny_hf_config

    directory = tmp_path / "pretrained"
    torch.manual_seed(3)
    transformers.AutoModelForCausalLM.from_config(tiny_hf_config("qwen3_moe", 256)).save_pretrained(
        directory, max_shard_size="40KB")
    env = {**os.environ, "PYTHONPATH": child_pythonpath(Path(__file__).resolve().parents[1] / "src")}
    job = ["--hf-model", str(directory), "--steps", "4", "--nproc", "2", "--batch-size", "4", "--block-size", "32",
           "--warmup", "2", "--lr", "1e-2", "--log-every", "1", "--eval-every", "4", "--eval-batches", "1",
           "--ckpt-every", "4", "--no-progress", "--no-plots"]
    losses = {}
    for name, extra in (("ddp", []), ("fsdp", ["--ep", "2", "--fsdp"])):
        done = subprocess.run([sys.executable, "-m", "flexmoe", "train", "--out", str(tmp_path / name), *job, *extra],
                              capture_output=True, text=True, timeout=600, env=env)
        assert done.returncode == 0, done.stderr[-3000:]
        lines = (tmp_path / name / "metrics.jsonl").read_text().splitlines()
        losses[name] = [json.loads(line)["train_loss"] for line in lines]
    assert len(losses["ddp"]) == 4
    assert losses["fsdp"] == pytest.approx(losses["ddp"], rel=1e-5)
    # Each rank read about half of the tensor data, the two halves all of it (the files add their headers).
    read = {int(r): (int(n.replace(",", "")), int(t.replace(",", ""))) for r, n, t in re.findall(
        r"rank (\d) read ([\d,]+) bytes of the checkpoint's ([\d,]+)", done.stdout + done.stderr)}
    assert sorted(read) == [0, 1], done.stdout[-2000:]
    files = read[0][1]
    tensors = sum(t.numel() * t.element_size() for t in transformers.AutoModelForCausalLM.from_pretrained(
        directory, dtype=torch.float32).state_dict().values())
    assert read[0][0] + read[1][0] == tensors and tensors < files
    assert all(n < 0.6 * tensors for n, _ in read.values()), read


@pytest.mark.parametrize("arch", ["mixtral", "qwen2_moe", "olmoe", "gpt_oss"])
def test_load_every_other_family_gives_hf_logits(arch, tmp_path, one_thread) -> None:
    """The job's small configs of the other families, sharded: Mixtral's renamed per-expert w1/w2/w3, Qwen2-MoE's
    gated shared expert, OLMoE, GPT-OSS's fused, transposed and interleaved experts with biases (stored as the model
    holds them); each stored element read once."""
    import transformers

    from flexmoe.apps.hf_configs import small_config
    from flexmoe.hf import load

    torch.manual_seed(0)
    transformers.AutoModelForCausalLM.from_config(small_config(arch)).save_pretrained(tmp_path, max_shard_size="200KB")
    reader = RecordingReader(tmp_path)
    model = load(tmp_path, reader=reader)
    ref = transformers.AutoModelForCausalLM.from_pretrained(tmp_path, dtype=torch.float32).eval()
    x = torch.randint(0, 100, (2, 10), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        assert (model(x).logits - ref(x).logits).abs().max().item() < TOL
    check_reads(tmp_path, [reader.reads], ep=1, dp_shard=1)
