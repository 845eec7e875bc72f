"""Checkpoints: safetensors for tensors, JSON for everything else, no pickle anywhere.

A checkpoint is a directory::

    step_000200/
        meta.json                  step, configs, Python RNG state, optimizer hyper-parameters, layout,
                                   and a sha256 of every tensor (so a flipped bit names its tensor)
        model.safetensors          parameters; expert parameters in GLOBAL form ``[E, ...]``
        optimizer.safetensors      AdamW moments and steps per parameter (experts global too), torch RNG state

or, after ``flexmoe reshard --world-size N`` (N > 1), the same split per rank of an N-rank layout:
``model-rank00001-of-00002.safetensors`` etc., each holding that rank's experts (rank 0 also holds every
non-expert tensor). Loading accepts either form at any world size the layout allows: the expert tensors are
gathered to global form and cut again for the loading rank (:mod:`flexmoe.parallel.layout`), so a run saved
on N ranks resumes on M.

Writes are atomic: each file goes to a temporary name then ``os.replace``; the directory is assembled under a
temporary name and renamed into place; ``latest.json`` (the pointer ``--resume`` reads) is replaced last. A
process killed at any moment leaves either the old or the new checkpoint, never half of one.
"""

from __future__ import annotations

import hashlib
import json
import os
import random
import secrets
import shutil
import struct
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
from safetensors import SafetensorError
from safetensors.torch import load_file, save_file
from torch import Tensor, nn

from flexmoe.experts.modules import FeedForwardExperts, joined_parameter_halves, side_by_side_halves
from flexmoe.layer import MoELayer
from flexmoe.parallel.layout import HIDDEN_DIM, ExpertLayout, shard_expert_state, unshard_expert_states

__all__ = [
    "CheckpointError",
    "FORMAT",
    "expert_param_names",
    "ExpertPlacement",
    "expert_placement",
    "model_layout",
    "gather_experts",
    "global_state_dict",
    "load_global_state_dict",
    "save_checkpoint",
    "load_checkpoint",
    "read_checkpoint",
    "latest_checkpoint",
    "reshard_checkpoint",
]

FORMAT = "flexmoe-checkpoint-v1"
_OPT_KEYS = ("exp_avg", "exp_avg_sq", "step", "momentum_buffer")  # AdamW's, and Muon's (flexmoe.optim)


class CheckpointError(RuntimeError):
    """A checkpoint that cannot be used: missing, truncated, corrupted, or not fitting the model."""


# ----------------------------------------------------------------------------------------------------------
# Which tensors are experts, and how they are laid out over ranks.


def expert_param_names(model: nn.Module) -> dict[str, str]:
    """Full name -> expert parameter kind (``w1``, ``b2``, ...) for every batched expert tensor of the state dict
    and checkpoints: a joined ``gate_up`` (``gate_up_bias``) by its halves (``w1``, ``w3``)."""
    names: dict[str, str] = {}
    for prefix, module in model.named_modules():
        if isinstance(module, MoELayer):
            experts = module.experts
            halves = experts.joined_pairs() if isinstance(experts, FeedForwardExperts) else {}
            for pname, _ in experts.named_parameters(recurse=False):
                for kind in halves.get(pname, (pname,)):
                    if kind in HIDDEN_DIM:
                        names[f"{prefix}.experts.{kind}"] = kind
    return names


def _group_world(group: Any) -> tuple[int, int]:
    """(rank, world size) in ``group``; (0, 1) for None, ``"single"`` or without torch.distributed."""
    if group is None or isinstance(group, str) or not dist.is_available() or not dist.is_initialized():
        return 0, 1
    return dist.get_rank(group), dist.get_world_size(group)


@dataclass(frozen=True)
class ExpertPlacement:
    """Where this process's experts sit: the layout, the expert-parallel process group, this rank in it."""

    layout: ExpertLayout
    group: Any
    rank: int


def expert_placement(model: nn.Module) -> ExpertPlacement | None:
    """The placement of ``model``'s experts (None without MoE layers).

    Read from the MoE layers themselves (``layout`` and ``ep_group``, set by MoELayer under expert
    parallelism), so it describes what the layers really hold; every MoE layer of a model shares it.
    """
    layers = [m for m in model.modules() if isinstance(m, MoELayer)]
    if not layers:
        return None
    moe = layers[0]
    layout, eg = getattr(moe, "layout", None), getattr(moe, "ep_group", None)
    if layout is not None and eg is not None:
        return ExpertPlacement(layout, eg.group if eg.distributed else None, eg.rank)
    # A layer without expert parallelism of its own: the model's config says which group its experts span.
    group = getattr(getattr(model, "cfg", None), "group", None)
    rank, world = _group_world(group)
    return ExpertPlacement(ExpertLayout(moe.num_experts, world, moe.hidden_dim), group, rank)


def model_layout(model: nn.Module) -> ExpertLayout | None:
    """The expert layout of ``model`` over its expert-parallel group (None without MoE layers)."""
    placement = expert_placement(model)
    return None if placement is None else placement.layout


def gather_experts(local: dict[str, Tensor], layout: ExpertLayout, group: Any) -> dict[str, Tensor]:
    """Every rank's local expert tensors -> global ``[E, ...]`` tensors (a collective over ``group``)."""
    if layout.world_size == 1:
        return dict(local)
    per_rank: list[dict[str, Tensor]] = [{} for _ in range(layout.world_size)]
    for name, tensor in local.items():
        parts = [torch.empty_like(tensor) for _ in range(layout.world_size)]
        dist.all_gather(parts, tensor.contiguous(), group=group)
        for r, part in enumerate(parts):
            per_rank[r][name] = part
    return unshard_expert_states(per_rank, layout)


def _split_by_layer(tensors: dict[str, Tensor], experts: dict[str, str]) -> dict[str, dict[str, Tensor]]:
    """{full name: tensor} -> {layer prefix: {kind: tensor}} for the expert entries."""
    layers: dict[str, dict[str, Tensor]] = {}
    for name, kind in experts.items():
        if name in tensors:
            layers.setdefault(name[: -len(kind)], {})[kind] = tensors[name]
    return layers


def _convert_experts(tensors: dict[str, Tensor], experts: dict[str, str],
                     convert: Callable[[dict[str, Tensor]], dict[str, Tensor]]) -> dict[str, Tensor]:
    """``tensors`` with each MoE layer's expert entries ({kind: tensor}) replaced by ``convert`` of them."""
    out = dict(tensors)
    for prefix, layer in _split_by_layer(tensors, experts).items():
        for kind, t in convert(layer).items():
            out[prefix + kind] = t
    return out


def _to_global(tensors: dict[str, Tensor], experts: dict[str, str], layout: ExpertLayout | None,
               group: Any) -> dict[str, Tensor]:
    if layout is None:
        return dict(tensors)
    return _convert_experts(tensors, experts, lambda local: gather_experts(local, layout, group))


def _to_local(tensors: dict[str, Tensor], experts: dict[str, str], layout: ExpertLayout | None,
              rank: int) -> dict[str, Tensor]:
    if layout is None:
        return dict(tensors)
    return _convert_experts(tensors, experts, lambda full: shard_expert_state(full, layout, rank))


def global_state_dict(model: nn.Module) -> dict[str, Tensor]:
    """The model's parameters and buffers with expert tensors in global form (collective under EP)."""
    state = {k: v.detach() for k, v in model.state_dict().items()}
    placement = expert_placement(model)
    if placement is None:
        return state
    return _to_global(state, expert_param_names(model), placement.layout, placement.group)


def load_global_state_dict(model: nn.Module, state: dict[str, Tensor], *, source: str = "state") -> None:
    """Load global-form tensors into ``model``, cutting out this rank's experts. Shapes are checked first."""
    placement = expert_placement(model)
    experts = expert_param_names(model)
    if placement is not None:
        _check_expert_count(state, experts, placement.layout, source)
        state = _to_local(state, experts, placement.layout, placement.rank)
    _check_shapes(state, model.state_dict(), source)
    model.load_state_dict(state, strict=True)


def _check_expert_count(state: dict[str, Tensor], experts: dict[str, str], layout, source: str) -> None:
    if layout is None:
        return
    for name in experts:
        if name in state and state[name].shape[0] != layout.num_experts:
            raise CheckpointError(
                f"{source}: tensor {name!r} holds {state[name].shape[0]} experts, the model has "
                f"{layout.num_experts} (num_experts differs)"
            )
        hidden_axis = HIDDEN_DIM[experts[name]]
        if name in state and hidden_axis is not None:
            h = state[name].shape[hidden_axis]
            if h != layout.hidden_dim:
                raise CheckpointError(
                    f"{source}: tensor {name!r} has expert hidden size {h}, the model has {layout.hidden_dim}"
                )


def _check_shapes(found: dict[str, Tensor], expected: dict[str, Tensor], source: str) -> None:
    missing = sorted(set(expected) - set(found))
    unexpected = sorted(set(found) - set(expected))
    if missing:
        raise CheckpointError(f"{source}: tensor {missing[0]!r} missing ({len(missing)} missing in all)")
    if unexpected:
        raise CheckpointError(f"{source}: unexpected tensor {unexpected[0]!r} ({len(unexpected)} in all)")
    for name, t in expected.items():
        if tuple(found[name].shape) != tuple(t.shape):
            raise CheckpointError(
                f"{source}: tensor {name!r} has shape {tuple(found[name].shape)}, the model expects "
                f"{tuple(t.shape)}"
            )


# ----------------------------------------------------------------------------------------------------------
# Optimizer state <-> named tensors.


def _optimizer_tensors(model: nn.Module, optimizer: torch.optim.Optimizer) -> tuple[dict[str, Tensor], list]:
    """AdamW state as ``{"exp_avg/<param>": tensor, ...}`` and its param groups with names for indices."""
    names = {id(p): n for n, p in model.named_parameters()}
    # A joined experts' gate_up by its halves' names (w1, w3), as the model state: checkpoints load into either
    # layout (joined_gate_up or not).
    halves = joined_parameter_halves(model)
    tensors: dict[str, Tensor] = {}
    for p, st in optimizer.state.items():
        for key in _OPT_KEYS:
            if key in st:
                value = st[key]
                value = value if isinstance(value, Tensor) else torch.tensor(value)
                name = names[id(p)]
                if name not in halves:
                    tensors[f"{key}/{name}"] = value
                    continue
                # the step (a scalar) once per half: safetensors refuses one tensor under two names
                for half, part in zip(halves[name], side_by_side_halves(value) if value.dim() else
                                      (value, value.clone())):
                    tensors[f"{key}/{half}"] = part
    groups = []
    for g in optimizer.param_groups:
        hyper = {k: v for k, v in g.items() if k != "params"}
        groups.append({**_jsonable(hyper),
                       "params": [h for p in g["params"] for h in halves.get(names[id(p)], (names[id(p)],))]})
    return tensors, groups


def _joined_optimizer_tensors(tensors: dict[str, Tensor], groups: list,
                              halves: dict[str, tuple[str, str]]) -> tuple[dict[str, Tensor], list]:
    """:func:`_optimizer_tensors`' form for a model holding joined parameters: each pair of halves' states joined
    into the joined parameter's (the step is one), the groups naming it once."""
    tensors = dict(tensors)
    for joined, (first, second) in halves.items():
        for kind in {k.partition("/")[0] for k in tensors}:
            a, b = tensors.get(f"{kind}/{first}"), tensors.get(f"{kind}/{second}")
            if a is None or b is None:
                continue
            del tensors[f"{kind}/{first}"], tensors[f"{kind}/{second}"]
            tensors[f"{kind}/{joined}"] = a if kind == "step" else torch.cat([a, b], dim=-1)
    joined_of = {half: joined for joined, pair in halves.items() for half in pair}
    groups = [{**g, "params": list(dict.fromkeys(joined_of.get(n, n) for n in g["params"]))} for g in groups]
    return tensors, groups


def _jsonable(values: dict[str, Any]) -> dict[str, Any]:
    out = {}
    for k, v in values.items():
        if isinstance(v, tuple):
            v = list(v)
        if isinstance(v, Tensor):
            v = v.item()
        if v is None or isinstance(v, (bool, int, float, str, list)):
            out[k] = v
    return out


# Optimizer options that say how to compute a step, not what the state is: the resuming optimizer's own stand.
_HOW_TO_COMPUTE = ("foreach", "fused", "capturable", "differentiable")


def _load_optimizer(
    model: nn.Module, optimizer: torch.optim.Optimizer, tensors: dict[str, Tensor], groups: list, source: str
) -> None:
    tensors, groups = _joined_optimizer_tensors(tensors, groups, joined_parameter_halves(model))
    params = dict(model.named_parameters())
    index: dict[int, int] = {}
    for g in optimizer.param_groups:
        for p in g["params"]:
            index[id(p)] = len(index)
    names = {id(p): n for n, p in params.items()}
    saved_group_of = {name: i for i, g in enumerate(groups) for name in g["params"]}
    live_names = [[names[id(p)] for p in g["params"]] for g in optimizer.param_groups]
    if set(saved_group_of) != {n for group in live_names for n in group}:
        raise CheckpointError(f"{source}: the optimizer's param groups hold other parameters than the saved ones")
    state: dict[int, dict[str, Tensor]] = {}
    for key, value in tensors.items():
        kind, _, name = key.partition("/")
        if name not in params:
            raise CheckpointError(f"{source}: optimizer tensor {key!r} names no parameter of the model")
        if kind != "step" and tuple(value.shape) != tuple(params[name].shape):
            raise CheckpointError(
                f"{source}: optimizer tensor {key!r} has shape {tuple(value.shape)}, the parameter is "
                f"{tuple(params[name].shape)}"
            )
        state.setdefault(index[id(params[name])], {})[kind] = value.clone()
    param_groups = []
    for i, (live, live_group_names) in enumerate(zip(optimizer.param_groups, live_names)):
        # Groups are matched by the parameters they hold, so that a run whose optimizer splits the saved groups
        # further (flexmoe.parallel.split_expert_groups) resumes with each part's saved hyperparameters.
        owners = {saved_group_of[n] for n in live_group_names}
        if len(owners) > 1:
            raise CheckpointError(f"{source}: optimizer param group {i} holds parameters of {len(owners)} saved "
                                  f"groups ({sorted(owners)})")
        saved = groups[owners.pop()] if owners else {}
        hyper = {k: (tuple(v) if isinstance(v, list) else v) for k, v in saved.items()
                 if k != "params" and k not in _HOW_TO_COMPUTE}
        param_groups.append({**live, **hyper, "params": [index[id(p)] for p in live["params"]]})
    optimizer.load_state_dict({"state": state, "param_groups": param_groups})


# ----------------------------------------------------------------------------------------------------------
# Files.


def _sha256(t: Tensor) -> str:
    return hashlib.sha256(t.detach().contiguous().cpu().view(-1).view(torch.uint8).numpy().tobytes()).hexdigest()


# Temporary names are made here rather than with tempfile.mkstemp / mkdtemp, which create 0600 files and 0700
# directories: renamed into place, those would give a checkpoint other permissions than every other file of the
# run. These are created like any file (0666 / 0777 less the umask).


def _temp_name(final: Path) -> Path:
    """A fresh hidden name beside ``final`` (the same directory, so that the rename into place is atomic)."""
    return final.parent / f".{final.name}.{os.getpid()}.{secrets.token_hex(4)}.tmp"


def _make_temp_file(final: Path) -> tuple[int, Path]:
    """An open descriptor and the path of a new, empty temporary file beside ``final``."""
    while True:
        tmp = _temp_name(final)
        try:
            return os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o666), tmp
        except FileExistsError:
            continue


def _make_temp_dir(final: Path) -> Path:
    """A new, empty temporary directory beside ``final``."""
    while True:
        tmp = _temp_name(final)
        try:
            tmp.mkdir()
            return tmp
        except FileExistsError:
            continue


def _atomic_write_bytes(path: Path, data: bytes) -> None:
    fd, tmp = _make_temp_file(path)
    try:
        with os.fdopen(fd, "wb") as f:
            f.write(data)
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, path)
    except BaseException:
        Path(tmp).unlink(missing_ok=True)
        raise


def _atomic_save_tensors(path: Path, tensors: dict[str, Tensor]) -> None:
    fd, tmp = _make_temp_file(path)
    mode = os.fstat(fd).st_mode & 0o777
    os.close(fd)
    try:
        save_file({k: v.detach().contiguous().cpu() for k, v in tensors.items()}, tmp)
        os.chmod(tmp, mode)  # safetensors writes a fresh 0600 file in its place
        with open(tmp, "rb") as f:
            os.fsync(f.fileno())
        os.replace(tmp, path)
    except BaseException:
        Path(tmp).unlink(missing_ok=True)
        raise


def _read_tensors(path: Path, checksums: dict[str, str] | None) -> dict[str, Tensor]:
    """Load a safetensors file, naming the file (and tensor) on truncation or corruption."""
    if not path.is_file():
        raise CheckpointError(f"{path}: missing checkpoint file")
    size = path.stat().st_size
    try:
        with open(path, "rb") as f:
            head = f.read(8)
            (n,) = struct.unpack("<Q", head)
            if n > size - 8:
                raise ValueError(f"header length {n} exceeds file size {size}")
            header = json.loads(f.read(n))
    except (struct.error, ValueError, UnicodeDecodeError) as exc:
        raise CheckpointError(f"{path}: not a readable safetensors file (corrupted header: {exc})") from exc
    data_size = size - 8 - n
    for name, entry in header.items():
        if name == "__metadata__":
            continue
        end = entry.get("data_offsets", [0, 0])[1] if isinstance(entry, dict) else 0
        if end > data_size:
            raise CheckpointError(
                f"{path}: truncated: tensor {name!r} needs bytes up to {end} of the data section, the file has "
                f"{data_size}"
            )
    try:
        tensors = load_file(str(path))
    except (SafetensorError, OSError, ValueError, RuntimeError) as exc:
        raise CheckpointError(f"{path}: cannot read safetensors ({exc})") from exc
    if checksums is not None:
        for name in sorted(set(checksums) - set(tensors)):
            raise CheckpointError(f"{path}: tensor {name!r} missing")
        for name, t in tensors.items():
            expected = checksums.get(name)
            if expected is None:
                raise CheckpointError(f"{path}: tensor {name!r} is not listed in meta.json")
            if _sha256(t) != expected:
                raise CheckpointError(f"{path}: tensor {name!r} is corrupted (sha256 differs from meta.json)")
    return tensors


def _rank_file(kind: str, rank: int, world: int) -> str:
    return f"{kind}.safetensors" if world == 1 else f"{kind}-rank{rank:05d}-of-{world:05d}.safetensors"


def _layout_json(layout: ExpertLayout | None, form_world: int) -> dict[str, Any] | None:
    if layout is None:
        return None
    saved = ExpertLayout(layout.num_experts, form_world, layout.hidden_dim)
    return {
        "num_experts": saved.num_experts,
        "world_size": saved.world_size,
        "hidden_dim": saved.hidden_dim,
        "experts_per_rank": saved.experts_per_rank,
        "shards_per_expert": saved.shards_per_expert,
        "trained_world_size": layout.world_size,
    }


@dataclass
class CheckpointData:
    """A checkpoint read into memory, in global form. ``model``/``optimizer``: name -> tensor."""

    path: Path
    meta: dict[str, Any]
    model: dict[str, Tensor]
    optimizer: dict[str, Tensor]
    rng: Tensor | None


def _write_dir(
    directory: Path, meta: dict[str, Any], model_t: dict[str, Tensor], opt_t: dict[str, Tensor], experts: set[str],
    world: int, layout: ExpertLayout | None,
) -> None:
    """Write tensors (split per rank of a ``world``-rank layout when world > 1) and meta.json into ``directory``."""
    directory.mkdir(parents=True, exist_ok=True)
    files: dict[str, dict[str, str]] = {}
    for kind, tensors in (("model", model_t), ("optimizer", opt_t)):
        kinds = {name: name.rsplit(".", 1)[-1] for name in experts}
        if kind == "optimizer":
            kinds = {k: k.rsplit(".", 1)[-1] for k in tensors if k.partition("/")[2] in experts and
                     not k.startswith("step/")}
        for rank in range(world):
            part: dict[str, Tensor] = {}
            if world == 1:
                part = dict(tensors)
            else:
                form = ExpertLayout(layout.num_experts, world, layout.hidden_dim)  # type: ignore[union-attr]
                expert_part = {k: v for k, v in tensors.items() if k in kinds}
                part = {k: v for k, v in tensors.items() if k not in kinds} if rank == 0 else {}
                part.update(_to_local(expert_part, kinds, form, rank))
            name = _rank_file(kind, rank, world)
            _atomic_save_tensors(directory / name, part)
            files[name] = {k: _sha256(v) for k, v in part.items()}
    meta = {**meta, "files": files}
    _atomic_write_bytes(directory / "meta.json", json.dumps(meta, indent=1).encode())


def save_checkpoint(
    run_dir: str | Path,
    *,
    model: nn.Module,
    optimizer: torch.optim.Optimizer | None,
    step: int,
    extra: dict[str, Any] | None = None,
    keep: int = 2,
    before_commit: Callable[[], None] | None = None,
) -> Path | None:
    """Save ``model`` (and ``optimizer``, RNG states) as ``run_dir/checkpoints/step_XXXXXX``, in global form.

    Under expert parallelism every rank must call this (experts are gathered); rank 0 writes. Returns the
    checkpoint directory on rank 0, None elsewhere. Older checkpoints beyond the newest ``keep`` are removed, and
    so are the temporary directories a writer killed mid-save left. ``before_commit``: called on rank 0 once
    every file is written under the temporary name, before the rename that completes the checkpoint (a fault
    test kills the process there).
    """
    placement = expert_placement(model)
    layout = None if placement is None else placement.layout
    group = None if placement is None else placement.group
    experts = set(expert_param_names(model))
    model_t = global_state_dict(model)
    opt_t: dict[str, Tensor] = {}
    groups: list = []
    if optimizer is not None:
        local_opt, groups = _optimizer_tensors(model, optimizer)
        opt_kinds = {k: k.rsplit(".", 1)[-1] for k in local_opt if k.partition("/")[2] in experts
                     and not k.startswith("step/")}
        opt_t = _to_global(local_opt, opt_kinds, layout, group)
    # Every rank took part in the gathers above; global rank 0 alone writes.
    if dist.is_available() and dist.is_initialized() and dist.get_rank() != 0:
        return None
    opt_t["rng/torch_cpu"] = torch.get_rng_state()
    py_state = random.getstate()
    meta = {
        "format": FORMAT,
        "step": int(step),
        "config": model.cfg.to_dict(),  # type: ignore[union-attr,operator]  # a model with a cfg (GPT)
        "rng": {"python": [py_state[0], list(py_state[1]), py_state[2]]},
        "optimizer": None if optimizer is None else {"class": type(optimizer).__name__, "param_groups": groups},
        "num_experts": None if layout is None else layout.num_experts,
        "layout": _layout_json(layout, 1),
        "expert_params": sorted(experts),
        **(extra or {}),
    }
    root = Path(run_dir) / "checkpoints"
    root.mkdir(parents=True, exist_ok=True)
    final = root / f"step_{step:06d}"
    tmp = _make_temp_dir(final)
    try:
        _write_dir(tmp, meta, model_t, opt_t, experts, 1, layout)
        if before_commit is not None:
            before_commit()
        if final.exists():
            shutil.rmtree(final)
        os.replace(tmp, final)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    _atomic_write_bytes(root / "latest.json", json.dumps({"step": int(step), "path": final.name}).encode())
    old = sorted(p for p in root.glob("step_*") if p.is_dir() and p != final)
    for stale in old[: max(len(old) - (keep - 1), 0)]:
        shutil.rmtree(stale, ignore_errors=True)
    for unfinished in root.glob(".step_*.tmp"):  # a writer killed before its rename (rank 0 is the only writer)
        shutil.rmtree(unfinished, ignore_errors=True)
    return final


def latest_checkpoint(run_dir: str | Path) -> Path | None:
    """The newest complete checkpoint under ``run_dir/checkpoints`` (or ``run_dir`` itself if it is one)."""
    run_dir = Path(run_dir)
    if (run_dir / "meta.json").is_file():
        return run_dir
    root = run_dir / "checkpoints"
    pointer = root / "latest.json"
    if pointer.is_file():
        try:
            candidate = root / json.loads(pointer.read_text())["path"]
            if (candidate / "meta.json").is_file():
                return candidate
        except (ValueError, KeyError):
            pass  # a damaged pointer: fall back to scanning
    complete = sorted(p for p in root.glob("step_*") if (p / "meta.json").is_file())
    return complete[-1] if complete else None


def read_checkpoint(path: str | Path) -> CheckpointData:
    """Read and verify a checkpoint directory (either form), returning tensors in global form."""
    path = Path(path)
    meta_path = path / "meta.json"
    if not meta_path.is_file():
        raise CheckpointError(f"{meta_path}: missing (not a complete checkpoint)")
    try:
        meta = json.loads(meta_path.read_text())
    except (ValueError, UnicodeDecodeError) as exc:
        raise CheckpointError(f"{meta_path}: not valid JSON ({exc})") from exc
    if meta.get("format") != FORMAT:
        raise CheckpointError(f"{meta_path}: format {meta.get('format')!r}, expected {FORMAT!r}")
    files = meta["files"]
    layout_meta = meta.get("layout")
    world = 1 if layout_meta is None else int(layout_meta["world_size"])
    experts = set(meta.get("expert_params", []))
    out: dict[str, dict[str, Tensor]] = {}
    for kind in ("model", "optimizer"):
        per_rank = []
        for rank in range(world):
            name = _rank_file(kind, rank, world)
            if name not in files:
                raise CheckpointError(f"{path / name}: listed layout needs this file, meta.json does not list it")
            per_rank.append(_read_tensors(path / name, files[name]))
        if world == 1:
            out[kind] = per_rank[0]
            continue
        form = ExpertLayout(layout_meta["num_experts"], world, layout_meta["hidden_dim"])
        merged = dict(per_rank[0])
        if kind == "model":
            kinds = {n: n.rsplit(".", 1)[-1] for n in experts}
        else:
            kinds = {k: k.rsplit(".", 1)[-1] for k in per_rank[0] if k.partition("/")[2] in experts
                     and not k.startswith("step/")}
        for prefix in _split_by_layer(per_rank[0], kinds):
            layer_kinds = {n: k for n, k in kinds.items() if n.startswith(prefix) and n[len(prefix):] == k}
            locals_ = [{k: st[n] for n, k in layer_kinds.items()} for st in per_rank]
            for k, t in unshard_expert_states(locals_, form).items():
                merged[prefix + k] = t
        out[kind] = merged
    opt = out["optimizer"]
    rng = opt.pop("rng/torch_cpu", None)
    return CheckpointData(path=path, meta=meta, model=out["model"], optimizer=opt, rng=rng)


def load_checkpoint(
    path: str | Path,
    *,
    model: nn.Module,
    optimizer: torch.optim.Optimizer | None = None,
    restore_rng: bool = True,
) -> dict[str, Any]:
    """Load a checkpoint into ``model`` (and ``optimizer``) at the current world size; returns its meta.

    Expert tensors are cut for this rank from the global form, whatever world size the checkpoint was saved
    or resharded for. Restores the torch CPU and Python RNG states with ``restore_rng``.
    """
    data = read_checkpoint(path)
    source = str(data.path / "model.safetensors") if data.meta["layout"] is None or \
        data.meta["layout"]["world_size"] == 1 else str(data.path)
    load_global_state_dict(model, data.model, source=source)
    if optimizer is not None:
        if data.meta.get("optimizer") is None:
            raise CheckpointError(f"{data.path}: holds no optimizer state")
        placement = expert_placement(model)
        layout = None if placement is None else placement.layout
        rank = 0 if placement is None else placement.rank
        experts = set(expert_param_names(model))
        kinds = {k: k.rsplit(".", 1)[-1] for k in data.optimizer if k.partition("/")[2] in experts
                 and not k.startswith("step/")}
        local = _to_local(data.optimizer, kinds, layout, rank)
        _load_optimizer(model, optimizer, local, data.meta["optimizer"]["param_groups"],
                        str(data.path / "optimizer.safetensors"))
    if restore_rng:
        if data.rng is not None:
            torch.set_rng_state(data.rng)
        py = data.meta["rng"]["python"]
        random.setstate((py[0], tuple(py[1]), py[2]))
    return data.meta


def reshard_checkpoint(src: str | Path, dst: str | Path, world_size: int) -> Path:
    """Rewrite checkpoint ``src`` for a ``world_size``-rank layout into directory ``dst`` (1: global form)."""
    data = read_checkpoint(src)
    meta = {k: v for k, v in data.meta.items() if k != "files"}
    layout_meta = meta.get("layout")
    layout = None
    if layout_meta is not None:
        layout = ExpertLayout(layout_meta["num_experts"], layout_meta.get("trained_world_size", 1),
                              layout_meta["hidden_dim"])
        try:
            ExpertLayout(layout.num_experts, world_size, layout.hidden_dim)
        except ValueError as exc:
            raise CheckpointError(f"{src}: cannot reshard to {world_size} ranks: {exc}") from exc
        meta["layout"] = _layout_json(layout, world_size)
    elif world_size != 1:
        raise CheckpointError(f"{src}: a dense model has no experts to reshard")
    dst = Path(dst)
    if dst.exists() and any(dst.iterdir()):
        raise CheckpointError(f"{dst}: already exists and is not empty")
    opt = dict(data.optimizer)
    if data.rng is not None:
        opt["rng/torch_cpu"] = data.rng
    dst.parent.mkdir(parents=True, exist_ok=True)
    tmp = _make_temp_dir(dst)
    try:
        _write_dir(tmp, meta, data.model, opt, set(meta.get("expert_params", [])), world_size, layout)
        if dst.exists():
            dst.rmdir()
        os.replace(tmp, dst)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    return dst
