"""``flexmoe train --hf-arch NAME`` / ``--hf-model DIR``: the main job on a Hugging Face ``transformers`` model.

The model is built from one of the small configurations of :mod:`flexmoe.apps.hf_configs` (``--hf-arch``) or
loaded from a local ``save_pretrained`` directory (``--hf-model``, fine-tuning), and its sparse-MoE blocks are
converted in place by :func:`flexmoe.hf.convert` (under ``torchrun``: each rank keeps its own experts, the rest is
data-parallel). :class:`HFCausalLM` gives it the interface of the application models (``forward(x, y) ->
(logits, loss)`` and the MoE statistics), so it trains in the same loop as the MoE GPT
(:func:`flexmoe.apps.train_loop.train_model`): same run directory, metrics, plots, checkpoints and ``--resume``.

The loss is HF's own: the causal-LM cross-entropy of the model's ``loss_function``, plus
``router_aux_loss_coef`` times HF's auxiliary balance loss when the config has ``output_router_logits``.
DeepSeek-V3's selection bias moves once per optimizer step (``bias_update_rate`` 1e-3, DeepSeek-V3's own rate;
the loop calls :func:`flexmoe.update_expert_biases`). Tokens are bytes, unless the ``--hf-model`` directory has a
tokenizer; a ``--hf-model`` checkpoint missing any of its model's tensors is refused (transformers would
initialise them at random). ``--export-hf DIR`` writes the trained model with ``save_pretrained`` (a converted
model's state dict is in HF's names and layout), which plain ``transformers`` loads.
"""

from __future__ import annotations

import argparse
import dataclasses
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
from torch import Tensor, nn

from flexmoe.apps import sharded_job
from flexmoe.apps.data import TokenData, load_text_bytes
from flexmoe.apps.errors import UsageError
from flexmoe.apps.hf_configs import HF_ARCHS, NOT_OFFERED, small_config_keywords
from flexmoe.apps.models.moe_model import MoEModel
from flexmoe.apps.ranks import start_ranks
from flexmoe.apps.run_files import latest_run_checkpoint
from flexmoe.apps.train_config import TrainConfig
from flexmoe.apps.train_flags import MOE_MODEL_FLAGS, check_resumed_flags, saved_run_config, train_config
from flexmoe.apps.train_loop import TokenTask, train_model

__all__ = ["HFJobConfig", "HFCausalLM", "add_hf_flags", "job_config", "check_inputs", "run_job", "build_hf_model",
           "check_loaded_weights", "export_hf"]

DEFAULT_BLOCK_SIZE = 128  # tokens per sequence, as the MoE GPT's
DEEPSEEK_BIAS_UPDATE_RATE = 1e-3  # DeepSeek-V3's bias update speed (its paper's gamma)

# Flags of the MoE GPT that have no meaning for a Hugging Face model (its size and layout come from its config).
_GPT_ONLY_FLAGS = ("--dense", "--compare-dense", "--upcycle-from", "--granularity", "--aux-loss-type",
                   *(f for f in MOE_MODEL_FLAGS if f != "--capacity-factor"))
# Flags handed to flexmoe.hf.convert: flag -> MoELayer option.
_CONVERT_FLAGS = {"--capacity-factor": "capacity_factor", "--a2a": "a2a", "--cross-node-share": "cross_node_share",
                  "--redundant-experts": "redundant_experts"}


def add_hf_flags(parser: argparse.ArgumentParser) -> None:
    """The flags of the Hugging Face job (added to ``flexmoe train``)."""
    a = parser.add_argument
    a("--hf-arch", default=None, metavar="NAME",
      help=f"train a small Hugging Face model of this family instead of the MoE GPT: {', '.join(HF_ARCHS)} "
           f"(default: none, the MoE GPT; not offered: {'; '.join(f'{n}: {why}' for n, why in NOT_OFFERED.items())})")
    a("--hf-model", default=None, metavar="DIR",
      help="fine-tune the Hugging Face model saved in DIR (save_pretrained); its tokenizer if it has one, else bytes "
           "(default: none)")
    a("--export-hf", default=None, metavar="DIR",
      help="with --hf-arch/--hf-model: write the trained model to DIR in Hugging Face's format at the end "
           "(default: none)")


# ----------------------------------------------------------------------------------------------------------
# Configuration.


@dataclass
class HFJobConfig:
    """What the job trains: an HF configuration (``hf_config``, ``config.to_dict()``), built from scratch or loaded
    from ``hf_model``, converted with ``convert_options``, on sequences of ``block_size`` tokens (the tokenizer
    of directory ``tokenizer``, or bytes). Plain data, what the run saves: the expert-parallel group is passed
    beside it (:func:`build_hf_model`'s ``group``)."""

    hf_config: dict[str, Any]
    block_size: int = DEFAULT_BLOCK_SIZE
    arch: str | None = None
    hf_model: str | None = None
    tokenizer: str | None = None
    convert_options: dict[str, Any] = field(default_factory=dict)

    @property
    def label(self) -> str:
        """The run's name in logs and summary.json: the family (``model_type``)."""
        return str(self.hf_config.get("model_type", "hf"))

    def to_dict(self) -> dict[str, Any]:
        """JSON-ready fields."""
        return {f.name: getattr(self, f.name) for f in dataclasses.fields(self)}

    @classmethod
    def from_dict(cls, values: dict[str, Any], **overrides: Any) -> HFJobConfig:
        return cls(**{**values, **overrides})

    def transformers_config(self) -> Any:
        """The ``transformers`` configuration object of ``hf_config``."""
        from transformers import CONFIG_MAPPING

        values = dict(self.hf_config)
        return CONFIG_MAPPING[values["model_type"]].from_dict(values)


def _import_transformers() -> None:
    try:
        import transformers  # noqa: F401
    except ImportError:
        raise UsageError("--hf-arch / --hf-model need the transformers package: pip install 'flexmoe[hf]'") from None


def job_config(args: argparse.Namespace) -> tuple[HFJobConfig, TrainConfig] | None:
    """The Hugging Face job's configuration from the flags (a resumed run: from its config.json), or None when
    the command line asks for the MoE GPT. Raises :class:`UsageError` for flags that do not fit together."""
    saved = saved_run_config(Path(args.out)) if args.resume else None
    resumes_hf = saved is not None and "hf_config" in saved.get("model", {})
    if not (args.hf_arch or args.hf_model or resumes_hf):
        if args.export_hf:
            raise UsageError("--export-hf needs --hf-arch NAME or --hf-model DIR (it writes a Hugging Face model)")
        return None
    if args.hf_arch and args.hf_model:
        raise UsageError("--hf-arch and --hf-model exclude each other: --hf-arch builds a new model of a family, "
                         "--hf-model starts from a saved one")
    for flag in _GPT_ONLY_FLAGS:
        value = getattr(args, flag[2:].replace("-", "_"))
        if value is not None and value is not False:
            raise UsageError(f"{flag} is a flag of the MoE GPT; a Hugging Face model's size and layout come from its "
                             f"config (--hf-arch / --hf-model)")
    if args.hf_arch in NOT_OFFERED:
        raise UsageError(f"--hf-arch {args.hf_arch}: not offered: {NOT_OFFERED[args.hf_arch]}")
    if args.hf_arch is not None and args.hf_arch not in HF_ARCHS:
        raise UsageError(f"--hf-arch {args.hf_arch}: unknown; choose one of {', '.join(HF_ARCHS)}")
    _import_transformers()
    tcfg, saved = train_config(args)
    if saved is not None:
        if "hf_config" not in saved["model"]:
            raise UsageError(f"--out {args.out} holds a run of the MoE GPT, not of a Hugging Face model; resume it "
                             f"without --hf-arch / --hf-model")
        cfg = HFJobConfig.from_dict(saved["model"])
        convert = {flag[2:].replace("-", "_"): cfg.convert_options.get(name) for flag, name in _CONVERT_FLAGS.items()}
        check_resumed_flags(args, {"block_size": cfg.block_size, **convert}, Path(args.out))
        asked = args.hf_arch or args.hf_model
        if asked is not None and asked not in (cfg.arch, cfg.hf_model):
            raise UsageError(f"--out {args.out} holds a run of {cfg.arch or cfg.hf_model}, not of {asked}; resume it "
                             f"with the same model (or leave --hf-arch / --hf-model out)")
        return cfg, tcfg
    if args.hf_arch is not None:
        from transformers import AutoConfig

        config = AutoConfig.for_model(args.hf_arch, **small_config_keywords(args.hf_arch))
        tokenizer = None
    else:
        config, tokenizer = _saved_model(Path(args.hf_model))
    options = {name: getattr(args, flag[2:].replace("-", "_")) for flag, name in _CONVERT_FLAGS.items()}
    options = {name: value for name, value in options.items() if value is not None}
    if config.model_type == "deepseek_v3":
        options["bias_update_rate"] = DEEPSEEK_BIAS_UPDATE_RATE
    block_size = args.block_size if args.block_size is not None else DEFAULT_BLOCK_SIZE
    if block_size < 1:
        raise UsageError(f"--block-size must be >= 1, got {block_size}")
    longest = getattr(config, "max_position_embeddings", None)
    if longest is not None and block_size > longest:
        raise UsageError(f"--block-size {block_size} is longer than the model's max_position_embeddings {longest}")
    cfg = HFJobConfig(hf_config=config.to_dict(), block_size=block_size, arch=args.hf_arch,
                      hf_model=None if args.hf_model is None else str(args.hf_model),
                      tokenizer=None if tokenizer is None else str(tokenizer), convert_options=options)
    return cfg, tcfg


def _saved_model(directory: Path) -> tuple[Any, Path | None]:
    """The configuration of the model saved in ``directory`` and the directory of its tokenizer (None: bytes)."""
    from transformers import AutoConfig

    if not directory.is_dir():
        raise UsageError(f"--hf-model {directory}: no such directory; give a directory written by save_pretrained")
    if not (directory / "config.json").is_file():
        raise UsageError(f"--hf-model {directory}: no config.json, so not a save_pretrained directory")
    try:
        config = AutoConfig.from_pretrained(directory)
    except (ValueError, OSError, KeyError) as exc:
        raise UsageError(f"--hf-model {directory}: its config.json cannot be read ({exc})".splitlines()[0]) from None
    if getattr(config, "is_encoder_decoder", False):
        why = NOT_OFFERED.get(config.model_type, "the job trains causal LMs on one token stream")
        raise UsageError(f"--hf-model {directory}: an encoder-decoder model ({config.model_type}): {why}")
    if getattr(config, "tie_word_embeddings", False):
        raise UsageError(f"--hf-model {directory}: ties its input and output embeddings (tie_word_embeddings), "
                         f"which flexmoe's checkpoints cannot store yet")
    has_tokenizer = any((directory / name).is_file() for name in ("tokenizer.json", "tokenizer_config.json"))
    return config, directory if has_tokenizer else None


def check_inputs(cfg: HFJobConfig, tcfg: TrainConfig, args: argparse.Namespace) -> None:
    """Everything that can fail before training starts: the data (and its tokens against the model's vocabulary)
    and the --export-hf directory."""
    load_data(cfg, tcfg)
    if args.export_hf is not None:
        export = Path(args.export_hf)
        if export.exists() and not export.is_dir():
            raise UsageError(f"--export-hf {export}: is a file; give a new directory or an earlier export")
        if export.is_dir() and any(export.iterdir()) and not (export / "config.json").is_file():
            raise UsageError(f"--export-hf {export}: a directory holding other files; give a new directory (an "
                             f"earlier export, with its config.json, is replaced)")


def load_data(cfg: HFJobConfig, tcfg: TrainConfig) -> TokenData:
    """The corpus as the model's tokens: bytes, or the ids of the tokenizer in ``cfg.tokenizer``."""
    vocab = int(cfg.hf_config["vocab_size"])
    if cfg.tokenizer is None:
        if vocab < 256:
            raise UsageError(f"the model's vocabulary has {vocab} tokens; byte tokens need 256 (or a tokenizer in "
                             f"the --hf-model directory)")
        return TokenData.from_file(tcfg.data, block_size=cfg.block_size)
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(cfg.tokenizer)
    if len(tokenizer) > vocab:
        raise UsageError(f"the tokenizer in {cfg.tokenizer} has {len(tokenizer)} tokens, more than the model's "
                         f"vocabulary of {vocab}")
    text = load_text_bytes(tcfg.data).decode("utf-8", errors="replace")
    ids = torch.tensor(tokenizer(text, add_special_tokens=False)["input_ids"], dtype=torch.long)
    source = "tinyshakespeare (embedded)" if tcfg.data is None else str(tcfg.data)
    return TokenData.from_tokens(ids, source=f"{source}, tokenized by {cfg.tokenizer}", block_size=cfg.block_size,
                                 from_data_flag=tcfg.data is not None, unit="tokens")


# ----------------------------------------------------------------------------------------------------------
# The model.


class HFCausalLM(MoEModel):
    """A converted HF causal LM with the application models' interface.

    ``forward(x, y)``: tokens ``x, y: [B, L]`` (``y`` the next tokens of ``x``) -> (logits ``[B, L, V]``, HF's
    causal-LM loss). The auxiliary balance loss of that forward (HF's, when the config has
    ``output_router_logits``) is kept for :meth:`regularization_loss`; the MoE statistics come from the flexmoe
    layers inside (:class:`MoEModel`).
    """

    hf: Any  # a transformers PreTrainedModel (untyped here: transformers is optional)

    def __init__(self, hf: nn.Module, cfg: HFJobConfig) -> None:
        super().__init__(cfg)
        self.hf = hf
        config = hf.config
        self.aux_loss_coef = (float(getattr(config, "router_aux_loss_coef", 0.0))
                              if getattr(config, "output_router_logits", False) else 0.0)
        self.last_aux_loss: Tensor | None = None

    def forward(self, x: Tensor, y: Tensor | None = None) -> tuple[Tensor, Tensor | None]:
        out = self.hf(input_ids=x, use_cache=False)
        self.last_aux_loss = getattr(out, "aux_loss", None)
        if y is None:
            return out.logits, None
        # The targets are already shifted (y[:, i] follows x[:, i]): HF's loss takes them as shift_labels.
        loss = self.hf.loss_function(out.logits, None, self.hf.config.vocab_size, shift_labels=y.contiguous())
        return out.logits, loss

    def aux_loss(self) -> Tensor:
        """HF's auxiliary balance loss of the last forward (0 without ``output_router_logits``)."""
        return torch.zeros(()) if self.last_aux_loss is None else self.last_aux_loss.float()

    def regularization_loss(self) -> Tensor:
        """``router_aux_loss_coef * aux_loss()``, what HF adds to the LM loss."""
        return self.aux_loss_coef * self.aux_loss()


def hf_param_counts(hf: nn.Module) -> tuple[int, int]:
    """(parameters, parameters active per token) of an HF MoE model before conversion (all experts present):
    a token uses ``num_experts_per_tok`` of the routed experts of each MoE block."""
    config = hf.config
    k = getattr(config, "num_experts_per_tok", None)
    num_experts = next((getattr(config, n) for n in ("num_local_experts", "num_experts", "n_routed_experts")
                        if getattr(config, n, None)), None)
    total = routed = 0
    for name, p in hf.named_parameters():
        total += p.numel()
        if ".experts." in name:  # routed experts (shared experts are "shared_expert(s)")
            routed += p.numel()
    if not k or not num_experts:
        return total, total
    return total, total - routed + routed * k // num_experts


def build_hf_model(cfg: HFJobConfig, seed: int, *, pretrained: bool,
                   group: Any = None) -> tuple[HFCausalLM, tuple[int, int]]:
    """The converted model on this rank and the whole model's (parameters, active parameters).

    Built identically on every rank (``seed``, or the weights of ``cfg.hf_model`` with ``pretrained``) before
    :func:`flexmoe.hf.convert` keeps each rank's experts of the expert-parallel ``group`` (None: convert's
    default, the world when torch.distributed is initialized; ``"single"``: every expert), so the initial weights do
    not depend on the number of ranks.
    """
    from transformers import AutoModelForCausalLM

    from flexmoe.hf import convert

    torch.manual_seed(seed)
    if pretrained:
        assert cfg.hf_model is not None, "pretrained weights come from cfg.hf_model"
        loaded: Any = AutoModelForCausalLM.from_pretrained(cfg.hf_model, dtype=torch.float32,
                                                           output_loading_info=True)
        hf, loading = loaded  # (model, {"missing_keys": ..., ...})
        check_loaded_weights(cfg.hf_model, loading)
    else:
        hf = AutoModelForCausalLM.from_config(cfg.transformers_config())
    counts = hf_param_counts(hf)
    try:
        convert(hf, group=group, **cfg.convert_options)
    except ValueError as exc:
        raise UsageError(f"flexmoe.hf.convert: {exc}".splitlines()[0]) from None
    return HFCausalLM(hf, cfg), counts


def load_hf_model_by_shard(cfg: HFJobConfig, tcfg: TrainConfig) -> tuple[HFCausalLM, tuple[int, int], Any]:
    """Under ``--fsdp``, the ``--hf-model`` checkpoint loaded onto the mesh ``--ep x dp_shard`` by
    :func:`flexmoe.hf.load`: each rank reads only its experts and shards. The model, its (parameters, active
    parameters) (counted on the meta device) and the mesh."""
    from transformers import AutoConfig, AutoModelForCausalLM

    from flexmoe.hf import SafetensorsReader, load
    from flexmoe.parallel import make_mesh

    assert cfg.hf_model is not None, "the weights come from cfg.hf_model"
    if not dist.is_initialized():
        raise UsageError("--fsdp needs more than one rank (--nproc N)")
    with torch.device("meta"):
        counts = hf_param_counts(AutoModelForCausalLM.from_config(AutoConfig.from_pretrained(cfg.hf_model)))
    torch.manual_seed(tcfg.seed)  # as build_hf_model: the job's random state starts from the seed either way
    mesh = make_mesh(ep=tcfg.ep or dist.get_world_size())
    reader = SafetensorsReader(cfg.hf_model)
    try:
        hf = load(cfg.hf_model, mesh, activation_checkpointing=tcfg.activation_checkpointing, reader=reader,
                  mp_policy=sharded_job.mixed_precision(tcfg.param_dtype), **cfg.convert_options)
    except ValueError as exc:
        raise UsageError(f"--hf-model {cfg.hf_model}: {exc}".splitlines()[0]) from None
    print(f"[{cfg.label}] rank {dist.get_rank()} read {reader.bytes_read:,} bytes of the checkpoint's "
          f"{reader.files_bytes():,} (by shard)", flush=True)
    return HFCausalLM(hf, cfg), counts, mesh


def check_loaded_weights(directory: str, loading: dict[str, Any]) -> None:
    """Refuse a ``--hf-model`` checkpoint that does not hold every tensor of its model (``loading``:
    ``from_pretrained``'s ``output_loading_info``): transformers would initialise the missing ones at random, and
    the job would fine-tune that. A checkpoint in flexmoe's internal names (``...mlp.moe.experts.w1``, what
    ``save_pretrained`` of a converted model wrote before its state dict took HF's names) is named as such."""
    missing = sorted(loading.get("missing_keys", ()))
    mismatched = sorted(str(m[0]) if isinstance(m, tuple) else str(m) for m in loading.get("mismatched_keys", ()))
    if not missing and not mismatched:
        return
    internal = sorted(k for k in loading.get("unexpected_keys", ()) if ".moe." in k)
    why = (f"it holds flexmoe's internal names instead (e.g. {internal[0]}): load that file into the converted model "
           f"with load_state_dict and save_pretrained it again" if internal else
           "from_pretrained would initialise them at random")
    if missing:
        raise UsageError(f"--hf-model {directory}: the checkpoint lacks {len(missing)} of the model's tensors "
                         f"(e.g. {missing[0]}); {why}")
    raise UsageError(f"--hf-model {directory}: {len(mismatched)} tensors of the checkpoint have other shapes than "
                     f"its config.json gives (e.g. {mismatched[0]})")


def export_hf(model: HFCausalLM, directory: Path, tokenizer: str | None, sharded: bool = False) -> None:
    """Write ``model`` in HF's format to ``directory`` (with the tokenizer it was trained with): a converted model's
    state dict is HF's own. Collective under expert parallelism (``state_dict()`` gathers the experts, so every
    rank calls ``save_pretrained``), rank 0 writes. ``sharded`` (laid on a mesh, ``--fsdp``): gathered one block
    at a time (:func:`flexmoe.hf.save_pretrained`)."""
    from flexmoe.hf import save_pretrained

    main = not dist.is_initialized() or dist.get_rank() == 0
    if sharded:
        save_pretrained(model.hf, directory)
    else:
        model.hf.save_pretrained(directory, is_main_process=main)
    if main:
        if tokenizer is not None:
            from transformers import AutoTokenizer

            AutoTokenizer.from_pretrained(tokenizer).save_pretrained(directory)
        print(f"[{model.cfg.label}] wrote the Hugging Face model to {directory}", flush=True)
    if dist.is_initialized():
        dist.barrier()


# ----------------------------------------------------------------------------------------------------------
# The job.


def run_job(args: argparse.Namespace, cfg: HFJobConfig, tcfg: TrainConfig) -> int:
    """Train (or resume) the HF model into ``args.out``, then export it if ``--export-hf`` asks."""
    out = Path(args.out)
    rank, world, device = start_ranks(args.backend, tcfg.device, tcfg.collective_timeout)
    tcfg = dataclasses.replace(tcfg, device=device)  # this rank's own GPU under --device cuda
    if args.resume and not (out / "config.json").is_file() and rank == 0:
        print(f"--resume: no run in {out} yet, starting a new one", flush=True)
    # Under --fsdp every rank builds every expert, and parallelize keeps its own (flexmoe.apps.sharded_job).
    group = "single" if tcfg.fsdp else dist.group.WORLD if world > 1 else None
    data = load_data(cfg, tcfg)
    # A resumed run takes its weights from its checkpoint; a new one from --hf-model (or the seed).
    resumes = args.resume and latest_run_checkpoint(out, sharded=tcfg.fsdp) is not None
    mesh = None
    if tcfg.fsdp and cfg.hf_model is not None and not resumes:
        model, counts, mesh = load_hf_model_by_shard(cfg, tcfg)
    else:
        model, counts = build_hf_model(cfg, tcfg.seed, pretrained=cfg.hf_model is not None and not resumes,
                                       group=group)
        model.to(tcfg.device)
    if tcfg.fsdp and mesh is None:
        laid, mesh = sharded_job.lay_out(model, tcfg.ep, tcfg.activation_checkpointing, tcfg.param_dtype)
        assert isinstance(laid, HFCausalLM)  # parallelize lays the model out in place
        model = laid
    train_model(model, TokenTask(data, tcfg, cfg.block_size), tcfg, out, label=cfg.label,
                model_config=cfg.to_dict(), param_counts=counts, resume=args.resume, mesh=mesh)
    if args.export_hf is not None:
        export_hf(model, Path(args.export_hf), cfg.tokenizer, sharded=tcfg.fsdp)
    return 0
