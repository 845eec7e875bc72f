"""What a GPU punishes, counted on any device: the aten operations a call dispatches (each one a kernel launch on
CUDA) and the ones that read the device from the host (each one a stream stall).

:class:`OpCounter` is a context manager: every aten operation dispatched inside it is counted, and those that
make the host wait for the device's values are listed by name:

* ``aten._local_scalar_dense`` (``item()``, ``int(t)``, ``bool(t)``, Python control flow on a tensor);
* ``Tensor.tolist()`` (which reads the data without dispatching an operation, so it is counted by wrapping it);
* operations whose output size depends on the values: ``nonzero``, ``masked_select``, ``bincount``, ``unique``,
  boolean-mask indexing, ``repeat_interleave`` without ``output_size``.

On the CPU none of these stall anything, which is why they go unnoticed there; counted here, they are the same
operations that :func:`torch.cuda.set_sync_debug_mode` reports on a GPU. ``flexmoe bench --host-reads`` prints
the counts of converted Hugging Face blocks against HF's own ``grouped_mm`` experts (:func:`count_block_call`).
"""

from __future__ import annotations

import statistics
import sys
import time
from collections import Counter
from collections.abc import Callable
from types import TracebackType
from typing import Any

import torch
from torch import Tensor
from torch.utils._python_dispatch import TorchDispatchMode

__all__ = ["OpCounter", "HOST_READING_OPS", "count_call", "count_hf_blocks", "format_counts"]

# Operations whose output shape (or a Python value) depends on the tensor's contents: the host must wait.
HOST_READING_OPS = frozenset({
    "aten._local_scalar_dense.default", "aten.nonzero.default", "aten.nonzero_static.default",
    "aten.masked_select.default", "aten.bincount.default", "aten._unique2.default", "aten.unique_dim.default",
    "aten.unique_consecutive.default", "aten.unique.default",
})


def _reads_host(name: str, args: tuple[Any, ...], kwargs: dict[str, Any]) -> bool:
    if name in HOST_READING_OPS:
        return name != "aten.nonzero_static.default"
    if name.startswith("aten.repeat_interleave.Tensor"):
        return kwargs.get("output_size") is None
    if name.startswith("aten.index.Tensor") or name.startswith("aten.index_put"):
        indices = args[1] if len(args) > 1 else ()
        return any(isinstance(i, Tensor) and i.dtype == torch.bool for i in indices)
    return False


def _read_site() -> str:
    """The innermost flexmoe module (other than this one) on the caller's stack, ``"-"`` if none: where a read
    happens, by module, so that a test can tell the routing plan's reads from the expert-parallel exchange's."""
    frame = sys._getframe(2)
    while frame is not None:
        module = frame.f_globals.get("__name__", "")
        if module.startswith("flexmoe.") and module != __name__:
            return str(module)
        frame = frame.f_back  # type: ignore[assignment]
    return "-"


class OpCounter(TorchDispatchMode):
    """Counts the aten operations dispatched inside ``with OpCounter() as c:`` (``c.ops``, ``c.by_name``) and
    lists the host reads among them (``c.host_reads``, names in call order), forward and backward alike;
    ``c.read_sites`` names the flexmoe module each read came from (``"flexmoe.parallel.alltoall"``), in the
    same order."""

    def __init__(self) -> None:
        super().__init__()
        self.ops = 0
        self.by_name: Counter[str] = Counter()
        self.host_reads: list[str] = []
        self.read_sites: list[str] = []
        self._tolist: Callable[..., Any] | None = None

    def __torch_dispatch__(self, func: Any, types: Any, args: tuple[Any, ...] = (),
                           kwargs: dict[str, Any] | None = None) -> Any:
        kwargs = kwargs or {}
        name = str(func)
        self.ops += 1
        self.by_name[name] += 1
        if _reads_host(name, args, kwargs):
            self.host_reads.append(name.removeprefix("aten.").removesuffix(".default"))
            self.read_sites.append(_read_site())
        return func(*args, **kwargs)

    def __enter__(self) -> OpCounter:
        # tolist() copies the values out without dispatching an operation: wrap it for the counter's lifetime.
        original = torch.Tensor.tolist
        reads, sites = self.host_reads, self.read_sites

        def tolist(t: Tensor) -> Any:
            reads.append("tolist")
            sites.append(_read_site())
            return original(t)

        self._tolist = original
        torch.Tensor.tolist = tolist  # type: ignore[method-assign,assignment]
        super().__enter__()
        return self

    def __exit__(self, exc_type: type[BaseException] | None, exc: BaseException | None,
                 tb: TracebackType | None) -> None:
        super().__exit__(exc_type, exc, tb)
        if self._tolist is not None:
            torch.Tensor.tolist = self._tolist  # type: ignore[method-assign]
            self._tolist = None


def count_call(call: Callable[[], Tensor], backward: bool = True) -> OpCounter:
    """Count one ``call()`` (its output ``[..., M]``), and with ``backward`` its backward with a gradient of ones
    (a dense tensor: an expanded one, as ``out.sum().backward()`` gives, takes other kernels)."""
    with OpCounter() as counter:
        out = call()
        if backward:
            out.backward(torch.ones(out.shape, dtype=out.dtype, device=out.device))
    return counter


def time_calls(calls: dict[str, Callable[[], Tensor]], steps: int, backward: bool = True,
               rotate: bool = True) -> dict[str, float]:
    """The median seconds of ``steps`` runs of each call (with ``backward``, forward + backward), the calls taken
    in turn within every step (side by side: a slow moment of the machine costs each the same), their order
    rotated every step so that none always runs first (as :func:`flexmoe.apps.bench.timing.time_side_by_side`).

    ``rotate=False`` keeps the order: of two calls, each then always runs right after the other, never after
    itself, so that neither finds its own code and data still in the CPU's caches (as a block does in a model,
    between other layers); rotated, a call follows itself every other step."""
    names = list(calls)
    seconds: dict[str, list[float]] = {name: [] for name in names}
    for step in range(steps):
        shift = step % len(names) if rotate else 0
        for name in names[shift:] + names[:shift]:
            start = time.perf_counter()
            out = calls[name]()
            if backward:
                out.backward(torch.ones(out.shape, dtype=out.dtype, device=out.device))
            seconds[name].append(time.perf_counter() - start)
    return {name: statistics.median(s) for name, s in seconds.items()}


def count_hf_blocks(families: list[str], *, experts: tuple[int, ...] = (8, 64), tokens: tuple[int, ...] = (1, 64),
                    model_dim: int = 64, hidden_dim: int = 32, expert_kernel: str = "grouped_mm",
                    seed: int = 0, steps: int = 0) -> list[dict[str, Any]]:
    """Per family, E and T: aten operations and host reads of one forward + backward of HF's block on its
    ``grouped_mm`` experts and of the same block converted (``flexmoe.hf.convert(..., expert_kernel=...)``), each
    counted on its second call (the first may time kernels). Tiny shapes: the counts, not the sizes, matter.

    ``steps`` > 0 also times them (:func:`time_calls`), with the block converted on the default kernel choice
    and the block converted with ``joined_gate_up=True`` beside them: ``x_time`` (converted with
    ``expert_kernel``), ``x_time_auto`` and ``x_time_joined`` over HF's time, the CPU proxy of issue 41 where
    only host work counts; and ``x_time_eval``: a no-grad forward of the default conversion in eval mode (a
    decoding step at T=1) over HF's. ``x_time_cold`` and ``x_time_eval_cold``: the default conversion against
    HF's block again, training and evaluating, each call right after the other's (``time_calls(...,
    rotate=False)``: neither finds its own code and data in the CPU's caches)."""
    import copy

    import flexmoe.hf
    from flexmoe.apps.bench.hf_blocks import HFShape, block_output, build_hf_block, set_experts_implementation

    rows = []
    for family in families:
        for num_experts in experts:
            for num_tokens in tokens:
                grouped = family == "deepseek_v3" and num_experts >= 8
                shape = HFShape("count", tokens=num_tokens, model_dim=model_dim, experts=num_experts,
                                k=min(8, num_experts // 2), hidden_dim=hidden_dim, groups=4 if grouped else 1,
                                limited_groups=2 if grouped else 1)
                reference = build_hf_block(family, shape, seed)
                x = torch.randn(1, num_tokens, model_dim, generator=torch.Generator().manual_seed(seed),
                                requires_grad=True)
                blocks = {"hf grouped_mm": set_experts_implementation(copy.deepcopy(reference), "grouped_mm"),
                          "converted": flexmoe.hf.convert(copy.deepcopy(reference), expert_kernel=expert_kernel)}
                if steps > 0:
                    blocks["converted auto"] = flexmoe.hf.convert(copy.deepcopy(reference))
                    blocks["converted joined"] = flexmoe.hf.convert(copy.deepcopy(reference),
                                                                    expert_kernel=expert_kernel, joined_gate_up=True)
                row: dict[str, Any] = {"family": family, "experts": num_experts, "tokens": num_tokens}
                calls: dict[str, Callable[[], Tensor]] = {}
                for name, block in blocks.items():
                    def call(block: torch.nn.Module = block, x: Tensor = x) -> Tensor:
                        return block_output(block(x))

                    calls[name] = call
                    for _ in range(2):
                        counted = count_call(call)
                    row[name] = {"ops": counted.ops, "host_reads": list(counted.host_reads)}
                row["x_ops"] = row["converted"]["ops"] / row["hf grouped_mm"]["ops"]
                if steps > 0:
                    seconds = time_calls(calls, steps)
                    row["seconds"] = seconds
                    row["x_time"] = seconds["converted"] / seconds["hf grouped_mm"]
                    row["x_time_auto"] = seconds["converted auto"] / seconds["hf grouped_mm"]
                    row["x_time_joined"] = seconds["converted joined"] / seconds["hf grouped_mm"]
                    evaluated = ("hf grouped_mm", "converted auto")
                    for name in evaluated:
                        blocks[name].eval()
                    with torch.no_grad():  # the same calls, in eval mode, recording nothing
                        eval_seconds = time_calls({name: calls[name] for name in evaluated}, steps, backward=False)
                    row["eval_seconds"] = eval_seconds
                    row["x_time_eval"] = eval_seconds["converted auto"] / eval_seconds["hf grouped_mm"]
                    with torch.no_grad():
                        cold = time_calls({name: calls[name] for name in evaluated}, steps, backward=False,
                                          rotate=False)
                    row["x_time_eval_cold"] = cold["converted auto"] / cold["hf grouped_mm"]
                    for name in evaluated:
                        blocks[name].train()
                    cold = time_calls({name: calls[name] for name in evaluated}, steps, rotate=False)
                    row["x_time_cold"] = cold["converted auto"] / cold["hf grouped_mm"]
                rows.append(row)
    return rows


def format_counts(rows: list[dict[str, Any]]) -> str:
    """The table of :func:`count_hf_blocks`: ops (forward + backward) and host reads, converted over HF."""
    timed = any("x_time" in r for r in rows)
    lines = [f"{'family':<12} {'E':>4} {'T':>4} {'HF ops':>7} {'reads':>5} {'ours':>6} {'reads':>5} {'x ops':>6}"
             + (f" {'x time':>6} {'x auto':>6} {'x join':>6} {'x eval':>6} {'x cold':>6} {'xe cold':>7}" if timed
                else "") + "  our host reads"]
    for r in rows:
        hf, ours = r["hf grouped_mm"], r["converted"]
        times = (f" {r['x_time']:>6.2f} {r['x_time_auto']:>6.2f} {r['x_time_joined']:>6.2f} {r['x_time_eval']:>6.2f}"
                 f" {r['x_time_cold']:>6.2f} {r['x_time_eval_cold']:>7.2f}") if timed else ""
        lines.append(f"{r['family']:<12} {r['experts']:>4} {r['tokens']:>4} {hf['ops']:>7} {len(hf['host_reads']):>5} "
                     f"{ours['ops']:>6} {len(ours['host_reads']):>5} {r['x_ops']:>6.2f}{times}  "
                     f"{', '.join(ours['host_reads']) or '-'}")
    return "\n".join(lines)
