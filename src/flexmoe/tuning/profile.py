"""Hardware profiles: the few numbers the cost model needs, stored as JSON.

A profile is either *calibrated* (``flexmoe calibrate`` measures this machine) or *published* (a data file in
``tuning/profiles/`` whose numbers come from public spec sheets, with the sources named and every efficiency
factor written down as an assumption). Both have the same shape, so the model never knows which it was given.

Units are SI throughout: seconds, bytes, bytes per second, flop per second.
"""

from __future__ import annotations

import json
import os
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

from flexmoe.tuning.a2a_scale import A2AScale

__all__ = [
    "ComputeSpec",
    "LinkSpec",
    "Profile",
    "PROFILE_DIR",
    "LOCAL_PROFILE_PATH",
    "available_profiles",
    "load_profile",
]

PROFILE_DIR = Path(__file__).resolve().parent / "profiles"


# Where `flexmoe calibrate` writes and `--profile local` / ModelGuidedChooser("local") read this machine's
# profile: one documented place in the user's cache directory, not the working directory.
LOCAL_PROFILE_PATH = Path.home() / ".cache" / "flexmoe" / "profile-local.json"


@dataclass(frozen=True)
class ComputeSpec:
    """GEMM throughput of one rank for one dtype.

    A GEMM of ``flops`` with smallest dimension ``m_min`` moving ``bytes`` takes
    ``overhead_s + max(flops / (peak_flops * m_min / (m_min + half_dim)), bytes / memory_bandwidth)``:
    a roofline whose compute roof bends down for thin matrices (Hockney's half-performance length).
    """

    peak_flops: float
    overhead_s: float = 0.0
    half_dim: float = 0.0


@dataclass(frozen=True)
class LinkSpec:
    """One level of the interconnect, seen by one rank (one direction).

    ``alpha_s``/``bandwidth_Bps`` describe a point-to-point message (``alpha + bytes / bandwidth``) and are used
    for broadcasts, reductions and gathers; ``a2a_alpha_s``/``a2a_bandwidth_Bps`` are the per-message latency and
    per-rank bandwidth seen inside an all-to-all, where every rank talks to many peers at once.
    """

    name: str
    alpha_s: float
    bandwidth_Bps: float
    a2a_alpha_s: float
    a2a_bandwidth_Bps: float


@dataclass
class Profile:
    """Everything the cost model knows about a machine.

    compute: per dtype name (``"float32"``, ``"bfloat16"``, ``"float16"``) the GEMM roofline of one rank.
    memory_bandwidth_Bps: streaming read+write bandwidth of one rank (elementwise ops, copies).
    gather_bandwidth_Bps / scatter_bandwidth_Bps: rows moved by ``index_select`` / ``index_add`` (bytes read
        plus bytes written, per second).
    op_overhead_s: fixed cost of one framework op (kernel launch, dispatcher, autograd node).
    grad_stack_bandwidth_Bps: bytes per second at which the per-expert weight gradients are gathered into the
        batched parameters' gradients (``unbind``'s backward stacks them into freshly allocated memory); 0
        means the memory bandwidth over two (one read, one write).
    first_touch_bandwidth_Bps: bytes per second at which a freshly mapped large buffer is first written
        (page faults: buffers above the C allocator's largest mmap threshold, 32 MiB, are mapped anew at every
        allocation); 0 means no such cost (caching allocators, as on GPUs).
    intra / inter: the link inside a node and the link between nodes.
    ranks_per_node: ranks sharing a node (and its fast link) by default.
    compute_slots_per_node: ranks that can compute at once without slowing each other (GPUs per node; for
        single-threaded CPU ranks the cores, as measured: a shared machine may leave fewer than it has).
    overlap_efficiency: fraction of overlappable communication actually hidden behind compute (1 when
        transfers run on separate engines; lower when they share the cores with compute).
    rank_slowdown: measured compute slow-down with n ranks busy on one host at once, ``{"2": 1.3, "4": 2.6}``
        (string keys for JSON; empty: ``max(1, n / compute_slots_per_node)``). The model interpolates it.
    comm_uses_compute: transfers are copies run by the same cores that compute (gloo on one host), so when
        ranks outnumber compute slots, communication slows down like compute does.
    threads_per_rank: CPU threads each rank used when calibrated (0: not a CPU profile).
    sources / assumptions: citations for the numbers and the efficiency factors assumed.
    measured: raw calibration samples, kept so a fit can be re-checked.
    a2a_scale: the all-to-all scale model's constants (the fields of
        :class:`~flexmoe.tuning.a2a_scale.A2AScale`) fitted to this cluster's own measurements by
        ``flexmoe fit-a2a``; empty: the published fit of a profile of that name, or the plain alpha-beta
        all-to-all of ``intra`` / ``inter``.
    """

    name: str
    description: str
    compute: dict[str, ComputeSpec]
    memory_bandwidth_Bps: float
    gather_bandwidth_Bps: float
    scatter_bandwidth_Bps: float
    op_overhead_s: float
    intra: LinkSpec
    inter: LinkSpec
    ranks_per_node: int
    compute_slots_per_node: float
    grad_stack_bandwidth_Bps: float = 0.0
    first_touch_bandwidth_Bps: float = 0.0
    overlap_efficiency: float = 1.0
    rank_slowdown: dict[str, float] = field(default_factory=dict)
    comm_uses_compute: bool = False
    threads_per_rank: int = 0
    sources: list[str] = field(default_factory=list)
    assumptions: list[str] = field(default_factory=list)
    measured: dict[str, Any] = field(default_factory=dict)
    a2a_scale: dict[str, float] = field(default_factory=dict)

    def compute_for(self, dtype: str) -> ComputeSpec:
        """The GEMM roofline of ``dtype`` (float16 falls back to bfloat16 and back, both being 2-byte)."""
        if dtype in self.compute:
            return self.compute[dtype]
        twin = {"float16": "bfloat16", "bfloat16": "float16"}.get(dtype)
        if twin in self.compute:
            return self.compute[twin]
        raise KeyError(f"profile {self.name!r} has no compute entry for {dtype}; it has {sorted(self.compute)}")

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)

    @classmethod
    def from_dict(cls, data: dict[str, Any]) -> Profile:
        data = dict(data)
        data["compute"] = {k: ComputeSpec(**v) for k, v in data["compute"].items()}
        data["intra"] = LinkSpec(**data["intra"])
        data["inter"] = LinkSpec(**data["inter"])
        known = set(cls.__dataclass_fields__)
        unknown = set(data) - known
        if unknown:
            raise ValueError(f"unknown profile fields {sorted(unknown)}")
        if data.get("a2a_scale"):
            A2AScale.from_dict(data["a2a_scale"])  # refuses missing or unknown constants now, not mid-prediction
        return cls(**data)

    def to_json(self) -> str:
        return json.dumps(self.to_dict(), indent=2, sort_keys=False)

    @classmethod
    def from_json(cls, text: str) -> Profile:
        return cls.from_dict(json.loads(text))

    def save(self, path: str | os.PathLike[str]) -> Path:
        path = Path(path)
        path.parent.mkdir(parents=True, exist_ok=True)
        tmp = path.with_suffix(path.suffix + ".tmp")
        tmp.write_text(self.to_json() + "\n")
        tmp.replace(path)  # atomic: a reader never sees half a profile
        return path

    @classmethod
    def load(cls, path: str | os.PathLike[str]) -> Profile:
        return cls.from_json(Path(path).read_text())


def available_profiles() -> list[str]:
    """Names of the published profiles shipped with flexmoe."""
    return sorted(p.stem for p in PROFILE_DIR.glob("*.json"))


def load_profile(name_or_path: str | os.PathLike[str]) -> Profile:
    """A published profile by name (``"a100-ndv4"``), ``"local"`` (the calibrated one), or a JSON path."""
    text = str(name_or_path)
    if text == "local":
        if not LOCAL_PROFILE_PATH.exists():
            raise FileNotFoundError(f"no calibrated profile at {LOCAL_PROFILE_PATH}; run `flexmoe calibrate` first")
        return Profile.load(LOCAL_PROFILE_PATH)
    shipped = PROFILE_DIR / f"{text}.json"
    if shipped.exists():
        return Profile.load(shipped)
    if Path(text).exists():
        return Profile.load(text)
    raise FileNotFoundError(
        f"no profile {text!r}: use one of {available_profiles()}, 'local' (after `flexmoe calibrate`) or a JSON path"
    )
