"""The parallel options of a layer: how its experts run over the expert-parallel group.

One frozen dataclass, validated once when it is made; a call's overrides (``moe(x, r=2)``) are one
``dataclasses.replace``. Whatever depends on the group or the expert layout (which r is valid, whether the
pairwise schedule fits) is checked by the execution strategy (:mod:`flexmoe.parallel.strategy`), which knows
them.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import Any

from flexmoe.parallel.alltoall import A2A_ALGORITHMS
from flexmoe.parallel.auto import Chooser
from flexmoe.parallel.expert_parallel import ParallelSetting
from flexmoe.parallel.pairwise import check_schedule
from flexmoe.parallel.shadow import ShadowPolicy
from flexmoe.validation import check_choice, check_int, check_optional_int, describe_value

__all__ = ["ParallelOptions"]


@dataclass(frozen=True)
class ParallelOptions:
    """How the experts run (see docs/architecture.md, "Experts over ranks").

    r: adaptive parallelism: 0 gathers every expert everywhere (no all-to-all); 1..s (dividing the s shards
        of an expert) is how many ranks share one expert's work; 1 with whole experts.
    overlap_degree: d >= 1 chunks whose all-to-all overlaps the previous chunk's expert compute.
    a2a: "flat" or "2dh" (2-D hierarchical over nodes of ``ranks_per_node`` ranks).
    ranks_per_node: ranks of one node (None: torchrun's LOCAL_WORLD_SIZE, read once by the layer).
    parallel: "static" (use r, overlap_degree, a2a) or "auto" (time the candidates, keep the fastest).
    schedule: "a2a" or "pairwise" (FasterMoE's pairwise exchange steps).
    shadow: False, or a :class:`~flexmoe.parallel.ShadowPolicy` choosing hot experts to replicate per step
        (the layer turns ``True`` into :class:`flexmoe.tuning.CostModelShadowPolicy`).
    chooser: what ``parallel="auto"`` decides with (None: a :class:`~flexmoe.parallel.MeasuringChooser`).
    token_exchange: at r = 1 and d = 1 over whole built-in experts, send each token once to every rank holding
        one of its experts and get back one weighted sum per rank (docs/architecture.md, "Each token once per
        rank"); False sends one row per (token, expert) pair, as every other setting does. With
        ``parallel="auto"``, True lets the chooser try both at r = 1, d = 1.
    redundant_experts: R >= 0 replica slots per rank, each computing a copy of a hot expert
        (:mod:`flexmoe.parallel.replicas`; docs/architecture.md, "Replicated experts"). The layer's own, not a
        call's: the placement and its load window live in the layer.
    """

    r: int = 1
    overlap_degree: int = 1
    a2a: str = "flat"
    ranks_per_node: int | None = None
    parallel: str = "static"
    schedule: str = "a2a"
    shadow: Any = False
    chooser: Chooser | None = None
    token_exchange: bool = True
    redundant_experts: int = 0

    def __post_init__(self) -> None:
        check_int("r", self.r, 0)
        check_int("redundant_experts", self.redundant_experts, 0)
        if not isinstance(self.token_exchange, bool):
            raise TypeError(f"token_exchange must be a bool, got {self.token_exchange!r}")
        if isinstance(self.overlap_degree, bool) or not isinstance(self.overlap_degree, int) \
                or self.overlap_degree < 1:
            raise ValueError(f"overlap_degree must be an int >= 1, got {self.overlap_degree!r}")
        if self.a2a not in A2A_ALGORITHMS:
            raise ValueError(f"a2a must be one of {A2A_ALGORITHMS}, got {self.a2a!r}")
        check_optional_int("ranks_per_node", self.ranks_per_node, 1)
        check_choice("parallel", self.parallel, ("static", "auto"))
        check_schedule(self.schedule)
        if self.shadow is None:
            object.__setattr__(self, "shadow", False)
        if not (self.shadow is False or self.shadow is True or isinstance(self.shadow, ShadowPolicy)):
            raise TypeError(f"shadow must be False, True or a ShadowPolicy (an object with choose()), "
                            f"got {self.shadow!r}")
        if self.chooser is not None and not (callable(getattr(self.chooser, "choose", None))
                                             and callable(getattr(self.chooser, "record", None))):
            raise TypeError(f"chooser must have choose() and record() (a flexmoe.parallel.Chooser), "
                            f"got {type(self.chooser).__name__}")

    @property
    def setting(self) -> ParallelSetting:
        """The static setting these options run with."""
        return ParallelSetting(self.r, self.overlap_degree, self.a2a, self.ranks_per_node, self.token_exchange)

    @property
    def shadow_policy(self) -> ShadowPolicy | None:
        """The shadow policy, None when shadowing is off (``True`` must have been resolved by the layer)."""
        return None if self.shadow is False else self.shadow

    def describe(self) -> dict[str, Any]:
        """Every field as a value that compares equal across processes (policies by ``describe()``/repr)."""
        return {f.name: describe_value(getattr(self, f.name)) for f in dataclasses.fields(self)}
