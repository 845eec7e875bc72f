"""Tutel's ``moe.moe_layer`` on :class:`flexmoe.MoELayer`.

The layer keeps Tutel's module tree, so Tutel's checkpoints load as they are::

    _num_global_experts                  buffer, int
    experts.batched_fc1_w, ...           FusedExpertsNetwork (experts type "ffn") or the custom module
    gates.0.wg.weight, ...               one gate per entry of gate_type

A forward call computes the chosen gate's logits here (Tutel's gate noise and capacity rule need them), then
hands them to a :class:`flexmoe.MoELayer` that shares this layer's expert module and does everything else:
top-k, slots in Tutel's order (every token's 1st choice before any 2nd choice; by descending top-1 score with
``batch_prioritized_routing``), drops, dispatch, the experts (over the expert-parallel group), combine and
the GShard loss. One MoELayer is kept per (top_k, logits dtype); they are not submodules (their only
parameters are this layer's experts), so every parameter has exactly its Tutel name.
"""

from __future__ import annotations

import logging
import re
from collections.abc import Callable, Iterator
from typing import Any, cast

import torch
import torch.distributed as dist
from torch import Tensor, nn

from flexmoe.compat.tutel import net
from flexmoe.compat.tutel.experts import FusedExpertsNetwork, GatheredExperts, PaddedExperts
from flexmoe.compat.tutel.gates import BUILTIN_GATES, RoutingGate
from flexmoe.compat.tutel.routing import alignment_of, load_importance_loss, tutel_capacity
from flexmoe.layer import MoELayer
from flexmoe.routing.plan import RoutingPlan

__all__ = ["moe_layer", "MOELayer"]

log = logging.getLogger(__name__)


class _GivenLogits(nn.Module):
    """The router of the inner MoELayers: returns the logits the Tutel layer computed for this call."""

    def __init__(self) -> None:
        super().__init__()
        self.logits: Tensor | None = None

    def forward(self, x: Tensor) -> Tensor:
        logits, self.logits = self.logits, None
        if logits is None or logits.shape[0] != x.shape[0]:
            raise RuntimeError("the Tutel layer's inner MoELayer was called without this call's logits")
        return logits


def _count(value: object, what: str) -> int:
    if isinstance(value, bool) or not isinstance(value, int):
        raise TypeError(f"{what} must be an int, got {type(value).__name__}")
    return value


class MOELayer(nn.Module):
    """Tutel's MoE layer: ``y = layer(x)`` with ``x: [..., model_dim]`` -> ``[..., model_dim]``, ``y.l_aux``.

    Arguments as Tutel's (``tutel.moe.moe_layer``):
        gate_type: ``{'type': 'top' | 'cosine_top' | 'custom', 'k': ..., 'capacity_factor': ...,
            'gate_noise': ..., 'fp32_gate': ..., ...}`` or a list of them (pick one per call with
            ``gate_index``); the deprecated string ``'Top2Gate'`` means ``{'type': 'top', 'k': 2}``.
        model_dim: the token width M.
        experts: ``{'type': 'ffn', 'num_experts_per_device' (or 'count_per_node'): n,
            'hidden_size_per_expert': H, 'activation_fn': f, 'has_fc1_bias': ..., 'has_fc2_bias': ...}`` or
            ``{'type': 'custom', 'module': cls, ...}``. ``n > 0``: n experts per rank (``n * world`` in all);
            ``n < 0``: one expert shared by ``-n`` ranks (``world / -n`` in all).
        scan_expert_func: called as ``f(name, param)`` for every expert parameter.
        result_func: applied to the output before it is returned.
        group: the expert-parallel process group (default: the world when torch.distributed is initialized).
        seeds: ``(gate_seed, expert_seed, seed_after)``: ``torch.manual_seed`` before the experts, before
            gate i (``gate_seed + i``) and at the end, as Tutel seeds them.
        a2a_ffn_overlap_degree, parallel_type (``'adaptive:r'``, ``'data'``, ``'model'``, ``'auto'``),
        use_2dh: how the experts run over the group (flexmoe's ``overlap_degree``, ``r``, ``a2a='2dh'``).
        is_postscore: weight expert outputs when combining (True) or scale expert inputs (False).
        batch_prioritized_routing, normalize_gate: as in Tutel.
        is_gshard_loss: ``l_aux`` is the GShard loss (True) or the importance + load loss (False).
    """

    # Set in __init__ by register_buffer / object.__setattr__: declared for the type checker.
    _num_global_experts: Tensor
    _expert_runner: nn.Module

    @staticmethod
    def global_expert_count(num_local_experts: int | float, group: Any = None) -> int:
        """Experts in all for ``num_local_experts`` per rank (negative: ranks per expert) over ``group``."""
        if not isinstance(num_local_experts, int):
            num_local_experts = -int(1 / (num_local_experts + 1e-5))
        world_size = net.get_world_size(group)
        if num_local_experts == 0:
            raise ValueError("num_experts_per_device must not be 0")
        if num_local_experts > 0:
            return num_local_experts * world_size
        if world_size % -num_local_experts:
            raise ValueError(f"num_experts_per_device={num_local_experts} asks {-num_local_experts} ranks to share "
                             f"an expert, which must divide the world size {world_size}")
        return world_size // -num_local_experts

    def __init__(
        self,
        gate_type: dict | list | str,
        model_dim: int,
        experts: dict | None = None,
        scan_expert_func: Callable[[str, nn.Parameter], Any] | None = None,
        result_func: Callable[[Tensor], Any] | None = None,
        group: Any = None,
        seeds: tuple | list | None = None,
        a2a_ffn_overlap_degree: int = 1,
        is_postscore: bool = True,
        batch_prioritized_routing: bool = False,
        normalize_gate: bool = True,
        is_gshard_loss: bool = True,
        parallel_type: str = "adaptive:1",
        use_2dh: bool = False,
        **kwargs: Any,
    ) -> None:
        super().__init__()
        if kwargs.pop("pad_samples", None) is not None:
            log.warning("moe_layer(pad_samples=...) is deprecated in Tutel and ignored")
        if kwargs:
            raise TypeError(f"moe_layer got unexpected arguments: {sorted(kwargs)}")
        self.model_dim = _count(model_dim, "model_dim")
        if model_dim < 1:
            raise ValueError(f"model_dim must be >= 1, got {model_dim}")
        if not isinstance(experts, dict) or "type" not in experts:
            raise TypeError("experts must be a dict with a 'type' ('ffn' or 'custom'), "
                            f"got {experts!r}")
        experts = dict(experts)  # Tutel pops options out of the caller's dict; this layer leaves it alone
        if group is None and dist.is_available() and dist.is_initialized():
            group = dist.group.WORLD
        self.group = group
        self.result_func = result_func
        self.world_size = net.get_world_size(group)

        if "count_per_node" in experts:
            local = experts.pop("count_per_node")
            experts.pop("num_experts_per_device", None)
        else:
            local = experts.pop("num_experts_per_device", 1)
        self.num_local_experts = 1 if local == -1 else local
        self.register_buffer("_num_global_experts",
                             torch.tensor(MOELayer.global_expert_count(self.num_local_experts, group)))
        if self.num_global_experts < self.world_size:
            self.sharded_count = self.world_size // self.num_global_experts
            self.num_local_experts = 1
        else:
            self.sharded_count = 1
        self.valid_rs = [0] + [r for r in range(1, self.sharded_count + 1) if self.sharded_count % r == 0]
        self.adaptive_degree = self._parse_parallel_type(parallel_type)
        self.auto_parallel, self.use_model_parallel = False, True

        self.is_postscore = bool(is_postscore)
        self.batch_prioritized_routing = bool(batch_prioritized_routing)
        self.normalize_gate = bool(normalize_gate)
        self.is_gshard_loss = bool(is_gshard_loss)
        self.a2a_ffn_overlap_degree = _count(a2a_ffn_overlap_degree, "a2a_ffn_overlap_degree")
        if a2a_ffn_overlap_degree < 1:
            raise ValueError(f"a2a_ffn_overlap_degree must be >= 1, got {a2a_ffn_overlap_degree}")
        self.use_2dh = bool(use_2dh)
        self.megablocks_size = 0
        if seeds is not None and not isinstance(seeds, (tuple, list)):
            raise TypeError(f"seeds must be a tuple (gate_seed, expert_seed[, seed_after]), got {seeds!r}")

        if seeds is not None and len(seeds) > 1 and seeds[1] is not None:
            torch.manual_seed(seeds[1])
        self.experts, runner, self._hidden_dim = self._build_experts(experts)
        # Not a submodule: for the ffn type it is `experts` itself, for custom experts an adapter around it.
        object.__setattr__(self, "_expert_runner", runner)
        if scan_expert_func is not None:
            for name, param in self.experts.named_parameters():
                scan_expert_func(name, param)
        for param in self.experts.parameters():
            param._tutel_expert = True  # type: ignore[attr-defined]  # Tutel's mark for expert parameters (not all-reduced by data parallel)

        gates = []
        for i, spec in enumerate(self._gate_specs(gate_type)):
            if seeds is not None and seeds[0] is not None:
                torch.manual_seed(seeds[0] + i)
            gates.append(self._build_gate(spec))
        self.gates = nn.ModuleList(gates)
        if seeds is not None and len(seeds) > 2 and seeds[2] is not None:
            torch.manual_seed(seeds[2])

        self.l_aux: Tensor | None = None
        self.last_plan: RoutingPlan | None = None
        self._layers: dict[tuple[int, torch.dtype], MoELayer] = {}  # plain dict: not submodules (see above)
        self._layer_for(self._gate(0).top_k, self._gate_dtype(self.gates[0]))

    # ----------------------------------------------------------------------------------------- construction
    def _parse_parallel_type(self, parallel_type: str) -> int:
        if not isinstance(parallel_type, str):
            raise TypeError(f"parallel_type must be a str, got {type(parallel_type).__name__}")
        if parallel_type.startswith("adaptive:"):
            try:
                r = int(parallel_type.split(":", 1)[1])
            except ValueError:
                raise ValueError(f"parallel_type 'adaptive:r' needs an int r, got {parallel_type!r}") from None
            r = min(max(r, 0), self.sharded_count)
            if r not in self.valid_rs:
                raise ValueError(f"parallel_type {parallel_type!r}: r must be one of {self.valid_rs}")
            return r
        if parallel_type in ("data", "auto"):
            return 1
        if parallel_type == "model":
            return self.sharded_count
        raise ValueError(f"parallel_type must be 'adaptive:<r>', 'data', 'model' or 'auto', got {parallel_type!r}")

    def _build_experts(self, spec: dict) -> tuple[nn.Module, nn.Module, int]:
        """(the module under the name ``experts``, the module MoELayer runs, the hidden size for MoELayer).

        Sharded ffn experts (fewer experts than ranks) run through :class:`GatheredExperts` in a MoELayer of
        one process (``group="single"``): MoELayer shards only its own expert module over ranks.
        """
        kind = spec.pop("type")
        options = {**spec, "model_dim": self.model_dim, "num_experts_per_device": self.num_local_experts,
                   "sharded_count": self.sharded_count}
        if kind == "ffn":
            for gone in ("fused_custom_fn", "implicit_dropout_p"):
                if gone in options:
                    raise TypeError(f"experts option {gone!r} was removed from Tutel; see its helloworld examples")
            try:
                module = FusedExpertsNetwork(**options)
            except TypeError as e:
                raise TypeError(f"experts of type 'ffn': {e}") from None
            runner = GatheredExperts(module, self.num_global_experts, self.group) if self.sharded_count > 1 else module
            return module, runner, module.hidden_size_per_expert
        if kind == "custom":
            if self.sharded_count > 1:
                raise ValueError(
                    f"experts: a custom expert module over {self.sharded_count} ranks per expert (negative "
                    "num_experts_per_device) is not supported by flexmoe.compat.tutel; use num_experts_per_device "
                    ">= 1, or the 'ffn' type, which shards")
            if "module" not in options:
                raise TypeError("experts of type 'custom' need 'module': the expert module class")
            cls = options.pop("module")
            try:
                module = cls(**options)
            except TypeError:
                # Tutel's older name for num_experts_per_device, which its examples still use.
                options["local_experts"] = options.pop("num_experts_per_device")
                module = cls(**options)
            return module, PaddedExperts(module, self.num_local_experts, self), self.model_dim
        raise ValueError(f"experts type must be 'ffn' or 'custom', got {kind!r}")

    @staticmethod
    def _gate_specs(gate_type: dict | list | str) -> list[dict]:
        if isinstance(gate_type, str):
            match = re.fullmatch(r"Top([0-9]+)Gate", gate_type)
            if match is None:
                raise ValueError(f"gate_type must be a dict, a list of dicts or 'Top<k>Gate', got {gate_type!r}")
            gate_type = {"type": "top", "k": int(match.group(1))}
        specs = gate_type if isinstance(gate_type, list) else [gate_type]
        if not specs or not all(isinstance(s, dict) and "type" in s for s in specs):
            raise TypeError(f"gate_type must be a dict with a 'type' or a non-empty list of them, got {gate_type!r}")
        return [dict(s) for s in specs]

    def _build_gate(self, spec: dict) -> nn.Module:
        kind = spec.pop("type")
        if kind == "custom":
            if "module" not in spec:
                raise TypeError("gate of type 'custom' needs 'module': the gate module class")
            cls = spec.pop("module")
            gate = cls(model_dim=self.model_dim, num_global_experts=self.num_global_experts, **spec)
            if not hasattr(gate, "gate_noise"):
                gate.gate_noise = spec.get("gate_noise", 0.0)
            if not hasattr(gate, "capacity_factor"):
                gate.capacity_factor = spec.get("capacity_factor", 1.0)
            if not hasattr(gate, "top_k"):
                raise TypeError(f"custom gate {cls.__name__} must set the attribute top_k")
            return gate
        if kind not in BUILTIN_GATES:
            raise ValueError(f"gate type must be one of {sorted(BUILTIN_GATES)} or 'custom', got {kind!r}")
        try:
            return BUILTIN_GATES[kind](model_dim=self.model_dim, num_global_experts=self.num_global_experts, **spec)
        except TypeError as e:
            raise TypeError(f"gate of type {kind!r}: {e}") from None

    def _gate(self, index: int) -> RoutingGate:
        # _build_gate made every gate carry top_k, capacity_factor and gate_noise (the built-in gates set them,
        # a custom gate is checked and completed), which nn.ModuleList's item type cannot say.
        return cast(RoutingGate, self.gates[index])

    @staticmethod
    def _gate_dtype(gate: nn.Module) -> torch.dtype:
        if getattr(gate, "fp32_gate", False):
            return torch.float32
        for p in gate.parameters():
            return p.dtype
        return torch.get_default_dtype()

    def _layer_for(self, top_k: int, dtype: torch.dtype) -> MoELayer:
        """The MoELayer that routes top_k choices with logits of ``dtype`` (built once, shared experts)."""
        key = (top_k, dtype)
        if key not in self._layers:
            layer = MoELayer(
                self.model_dim, self.num_global_experts, self._hidden_dim, k=top_k,
                router=_GivenLogits(), router_dtype=dtype, normalize_weights=self.normalize_gate,
                batch_prioritized=self.batch_prioritized_routing,
                score_at="combine" if self.is_postscore else "dispatch",
                experts=self._expert_runner, group="single" if self.sharded_count > 1 else self.group,
                overlap_degree=self.a2a_ffn_overlap_degree, a2a="2dh" if self.use_2dh else "flat",
            )
            self._layers[key] = layer
        return self._layers[key]

    # ------------------------------------------------------------------------------------------ properties
    @property
    def num_global_experts(self) -> int:
        return int(self._num_global_experts)

    def get_parameter_iterator(self, param_type: str) -> Iterator[tuple[str, nn.Parameter]]:
        """``named_parameters()`` of the gates (``'gate'``) or of this rank's experts (``'local_experts'``)."""
        if param_type == "gate":
            return self.gates.named_parameters()
        if param_type == "local_experts":
            return self.experts.named_parameters()
        raise ValueError(f"param_type must be 'gate' or 'local_experts', got {param_type!r}")

    def extra_repr(self) -> str:
        gates = [f"k={g.top_k}, noise={g.gate_noise}" for g in self.gates]
        return (f"Top-K(s) = {gates}, Total-Experts = {self.num_global_experts} "
                f"[managed by {self.world_size} device(s)],")

    def _load_from_state_dict(self, state_dict, prefix, *args, **kwargs):
        key = prefix + "_num_global_experts"
        if key not in state_dict:
            log.warning("loading a Tutel checkpoint without %s (an older format); assuming %d experts",
                        key, self.num_global_experts)
            state_dict[key] = self._num_global_experts.clone()
        elif int(state_dict[key]) != self.num_global_experts:
            raise ValueError(f"checkpoint {key} = {int(state_dict[key])} experts, this layer has "
                             f"{self.num_global_experts}")
        for name, param in self.experts.named_parameters():
            key = prefix + "experts." + name
            if key in state_dict and state_dict[key].numel() == param.numel():
                state_dict[key] = state_dict[key].view(param.shape)  # older files store other (equal-size) shapes
        return super()._load_from_state_dict(state_dict, prefix, *args, **kwargs)

    # ------------------------------------------------------------------------------------------ forward
    def forward(self, input: Tensor, gate_index: int = 0, capacity_factor: float | None = None,
                top_k: int | None = None, a2a_ffn_overlap_degree: int | None = None, reserve_dims: int = 1,
                inequivalent_tokens: bool = False, adaptive_r: int | None = None,
                megablocks_size: int = 0) -> Any:
        """input: ``[..., model_dim]`` (at least 2-D) -> ``[..., model_dim]`` with ``.l_aux``, through
        ``result_func`` if given.

        Per call: ``gate_index`` picks the gate, ``capacity_factor`` and ``top_k`` override the gate's,
        ``a2a_ffn_overlap_degree`` and ``adaptive_r`` set the layer's (they stay set, as in Tutel).
        ``capacity_factor=0`` is dropless, as Tutel documents (Tutel's code falls back to the gate's factor
        for an explicit 0). ``megablocks_size`` (a CUDA inference kernel in Tutel) changes nothing here.
        """
        if not isinstance(input, Tensor):
            raise TypeError(f"input must be a torch.Tensor, got {type(input).__name__}")
        if input.dim() < 2 or input.shape[-1] != self.model_dim:
            raise ValueError(f"input must have shape [samples, ..., model_dim={self.model_dim}], "
                             f"got {tuple(input.shape)}")
        if reserve_dims != 1:
            raise ValueError(f"reserve_dims must be 1 (tokens of width model_dim), got {reserve_dims}")
        if not 0 <= gate_index < len(self.gates):
            raise ValueError(f"gate_index must be in [0, {len(self.gates)}), got {gate_index}")
        gate = self._gate(gate_index)
        if a2a_ffn_overlap_degree is not None:
            self.a2a_ffn_overlap_degree = a2a_ffn_overlap_degree
        if adaptive_r is not None:
            if adaptive_r not in self.valid_rs:
                raise ValueError(f"adaptive_r must be one of {self.valid_rs}, got {adaptive_r}")
            self.adaptive_degree = adaptive_r
        top_k = min(top_k or gate.top_k, self.num_global_experts)
        if capacity_factor is None:
            capacity_factor = gate.capacity_factor

        x = input.reshape(-1, self.model_dim)
        if torch.is_autocast_enabled(x.device.type):
            x = x.to(torch.get_autocast_dtype(x.device.type))
        else:
            for p in self.experts.parameters():
                x = x.to(p.dtype)
                break

        with torch.autocast(device_type=x.device.type, enabled=False):
            logits = gate(x)
            noisy = logits
            if self.training and gate.gate_noise > 0:
                noisy = logits + gate.gate_noise * torch.randn_like(logits) / self.num_global_experts
        capacity = self._capacity(noisy, top_k, float(capacity_factor), inequivalent_tokens)

        layer = self._layer_for(top_k, noisy.dtype)
        layer.train(self.training)
        layer.router.logits = noisy
        # r=0 (every rank gathers every expert) gives the same numbers as r=1; MoELayer gathers only its
        # built-in experts, so whole Tutel experts always run with r=1.
        y = layer(x, capacity=capacity, r=max(self.adaptive_degree, 1),
                  overlap_degree=self.a2a_ffn_overlap_degree)
        if self.is_gshard_loss:
            l_aux = layer.aux_loss
        else:
            plan = layer.last_plan
            assert plan is not None  # the layer call above made it
            chosen = noisy.gather(1, plan.expert_index)
            l_aux = load_importance_loss(torch.softmax(logits, dim=1), chosen, self.num_global_experts,
                                         gate.gate_noise)
        self.last_plan = layer.last_plan  # flexmoe's RoutingPlan of this call (capacity, drops, loads)
        y = y.view(*input.shape[:-1], self.model_dim).to(input.dtype)
        self.l_aux = y.l_aux = l_aux
        return self.result_func(y) if self.result_func is not None else y

    def _capacity(self, logits: Tensor, top_k: int, capacity_factor: float, inequivalent_tokens: bool) -> int:
        """Tutel's capacity for this call (:func:`flexmoe.compat.tutel.routing.tutel_capacity`)."""
        num_tokens = logits.shape[0]
        if inequivalent_tokens:
            num_tokens = int(net.simple_all_reduce(torch.tensor(num_tokens), group=self.group,
                                                   op=dist.ReduceOp.MAX))
        max_load = None
        if capacity_factor <= 0:
            chosen = torch.topk(logits.detach(), top_k, dim=1).indices  # softmax keeps the order
            load = torch.bincount(chosen.reshape(-1), minlength=self.num_global_experts).max()
            max_load = int(net.simple_all_reduce(load, group=self.group, op=dist.ReduceOp.MAX))
        return tutel_capacity(num_tokens, self.num_global_experts, top_k, capacity_factor, max_load,
                              alignment_of(self.sharded_count, self.a2a_ffn_overlap_degree))


moe_layer = MOELayer
