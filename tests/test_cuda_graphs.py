"""Issue 41, item 3: decoding captured once and replayed, on the path a CUDA device takes (``expert_kernel=
"grouped_mm"`` in bf16).

- The native layer's no-grad call captured into a CUDA graph (``torch.cuda.CUDAGraph``) and replayed on new inputs
  copied into the captured buffer, different routings included, equals the eager call and a float64 reference.
- A converted Qwen3-MoE model's ``generate()`` with a static cache, its decoding step compiled with CUDA graphs
  (``CompileConfig(mode="reduce-overhead")``): no graph break (``fullgraph=True``), nothing compiled or captured
  again after the first decoding steps, the eager model's tokens.

On the CPU, where there are no CUDA graphs, the same tests check the same logic with the capture replaced by
``torch.compile(fullgraph=True)`` (dynamo's ``aot_eager`` backend): a call that reads the device from the host
cannot be captured, and there it is a graph break, which ``fullgraph`` turns into an error; a call that
recompiled for another routing would be re-captured on CUDA, and there it is a new graph, which is counted.
"""

from __future__ import annotations

import copy
from collections.abc import Callable
from typing import Any

import pytest
import torch
import torch._dynamo
from torch import Tensor

transformers = pytest.importorskip(
    "transformers", reason="flexmoe.hf needs transformers (pip install -e .[hf]; CI installs it via .[test])")

import flexmoe.hf as fh  # noqa: E402
from flexmoe import MoELayer  # noqa: E402
from reference import reference_for_layer  # noqa: E402
from test_hf_compile import _graphs, fresh_dynamo  # noqa: E402, F401  (fresh_dynamo: autouse, a fresh dynamo per test)
from test_hf_convert import batches, tiny_model  # noqa: E402

READ_FREE = dict(expert_kernel="grouped_mm", dtype=torch.bfloat16)
# The forced kernel must run every call here: its "does not run ... the loop runs" warning fails the test.
FORCED_KERNEL_RUNS = pytest.mark.filterwarnings("error:expert_kernel=:RuntimeWarning")


def _graph_breaks() -> int:
    return sum(torch._dynamo.utils.counters["graph_break"].values())


def capture(call: Callable[[Tensor], Tensor], static_x: Tensor) -> Callable[[], Tensor]:
    """``call`` on the buffer ``static_x`` captured once; the returned function runs it again on whatever
    ``static_x`` holds then. CUDA: a CUDA graph (warmed up on a side stream first, as capture requires), replayed.
    Elsewhere: ``torch.compile(call, fullgraph=True)``."""
    if static_x.device.type != "cuda":
        compiled = torch.compile(call, fullgraph=True, backend="aot_eager")
        return lambda: compiled(static_x)
    side = torch.cuda.Stream(static_x.device)
    side.wait_stream(torch.cuda.current_stream(static_x.device))
    with torch.cuda.stream(side):
        for _ in range(2):
            call(static_x)
    torch.cuda.current_stream(static_x.device).wait_stream(side)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        static_out = call(static_x)

    def replay() -> Tensor:
        graph.replay()
        return static_out

    return replay


@FORCED_KERNEL_RUNS
@pytest.mark.parametrize("capacity_factor", [0.0, 1.0], ids=["dropless", "capacity"])
def test_layer_no_grad_call_is_captured_and_replays_eager(capacity_factor: float, device: torch.device) -> None:
    """Three inputs that route differently through one capture: each replay equals the eager call on that input
    exactly and the float64 reference to bf16 rounding; the capture is made once (on the CPU: one graph)."""
    torch.manual_seed(0)
    layer = MoELayer(16, 8, 32, k=2, capacity_factor=capacity_factor, group="single", **READ_FREE).to(device).eval()
    g = torch.Generator().manual_seed(4)
    inputs = [torch.randn(6, 16, generator=g).bfloat16().to(device) for _ in range(3)]
    static_x = inputs[0].clone()
    with torch.no_grad():
        before = _graphs()
        replay = capture(layer, static_x)
        routings = []
        for x in inputs:
            static_x.copy_(x)
            got = replay().clone()
            want = layer(x)  # eager
            ref, _, _ = reference_for_layer(layer, x, k=2, capacity_factor=capacity_factor)
            routings.append(ref.expert_index)
            scale = float(ref.y.abs().max())
            # A CUDA graph replays the eager call's kernels: the same bits. A compiled call may order its bf16
            # sums otherwise: the same to bf16 rounding.
            exact = device.type == "cuda"
            torch.testing.assert_close(got, want, rtol=0 if exact else 1e-2, atol=0 if exact else 1e-2 * scale)
            torch.testing.assert_close(got.double().cpu(), ref.y.detach().view(got.shape), rtol=2e-2,
                                       atol=2e-2 * scale)
    if device.type == "cpu":
        assert _graphs() - before == 1
    assert len({str(r) for r in routings}) == len(inputs)  # the inputs route differently
    if capacity_factor > 0:
        assert ref.num_dropped > 0  # the capacity drops pairs of the last input


class _EveryToken(transformers.StoppingCriteria):
    """Called by ``generate()`` after each new token: records the graphs dynamo has compiled and the CUDA graphs
    inductor has recorded so far; never stops."""

    def __init__(self, recorded: Callable[[], int]) -> None:
        self.recorded = recorded
        self.graphs: list[int] = []
        self.captures: list[int] = []

    def __call__(self, input_ids: Tensor, scores: Tensor, **kwargs: Any) -> Tensor:
        self.graphs.append(_graphs())
        self.captures.append(self.recorded())
        return torch.zeros(input_ids.shape[0], dtype=torch.bool, device=input_ids.device)


def _generate(model: Any, ids: Tensor, compile_config: Any = None, criteria: Any = None) -> Any:
    """Greedy decoding of 8 tokens with a static cache (the cache transformers compiles the decoding step with),
    compiled as ``compile_config`` says, else eager (on CUDA transformers would compile it by default)."""
    return model.generate(ids, max_new_tokens=8, do_sample=False, cache_implementation="static",
                          output_logits=True, return_dict_in_generate=True, compile_config=compile_config,
                          disable_compile=compile_config is None,
                          stopping_criteria=transformers.StoppingCriteriaList([criteria] if criteria else []))


@FORCED_KERNEL_RUNS
def test_compiled_generate_captures_once_and_gives_eager_tokens(device: torch.device,
                                                                 monkeypatch: pytest.MonkeyPatch) -> None:
    """A converted Qwen3-MoE model (bf16, the grouped kernel) decoding under ``CompileConfig(fullgraph=True)``:
    on CUDA with ``mode="reduce-overhead"`` (inductor's CUDA graphs), elsewhere ``aot_eager``. No graph break;
    after the first decoding step compiles, no step compiles again, and on CUDA every step after the capture
    replays it (no CUDA graph recorded again, none skipped); the tokens are the eager model's, whose logits are
    HF's own eager model's to bf16 rounding."""
    # Experts of hidden size 16 (bf16 rows of 32 bytes: torch._grouped_mm's alignment).
    hf = tiny_model("qwen3_moe", moe_intermediate_size=16).eval().to(device, torch.bfloat16)
    model = fh.convert(copy.deepcopy(hf), group="single", expert_kernel="grouped_mm").eval()
    ids = batches(1, seed=3, batch=2, seq=5)[0].to(device)

    recorded = [0]
    if device.type == "cuda":
        from torch._inductor.cudagraph_trees import CUDAGraphTreeManager

        record = CUDAGraphTreeManager.record_function

        def counting_record(self: Any, *args: Any, **kwargs: Any) -> Any:
            recorded[0] += 1
            return record(self, *args, **kwargs)

        monkeypatch.setattr(CUDAGraphTreeManager, "record_function", counting_record)
        compile_config = transformers.CompileConfig(fullgraph=True, mode="reduce-overhead")
        torch._dynamo.utils.counters["inductor"].clear()
    else:
        compile_config = transformers.CompileConfig(fullgraph=True, backend="aot_eager", mode=None)
        compile_config._compile_all_devices = True  # transformers compiles generate on accelerators only otherwise

    want = _generate(model, ids)
    breaks = _graph_breaks()
    steps = _EveryToken(lambda: recorded[0])
    got = _generate(model, ids, compile_config, steps)

    assert torch.equal(got.sequences, want.sequences)
    assert _graph_breaks() == breaks
    # Token 1 comes from the prompt's call (not compiled), tokens 2.. from the compiled decoding step.
    assert len(steps.graphs) == 8 and steps.graphs[1] > steps.graphs[0], steps.graphs
    assert all(n == steps.graphs[1] for n in steps.graphs[1:]), steps.graphs
    if device.type == "cuda":
        captured = [n for n in steps.captures if n]
        assert captured and all(n == captured[0] for n in captured), steps.captures
        assert torch._dynamo.utils.counters["inductor"]["cudagraph_skips"] == 0
    hf_logits = torch.stack(_generate(hf, ids).logits).double()
    torch.testing.assert_close(torch.stack(want.logits).double(), hf_logits, rtol=0.05,
                               atol=0.05 * float(hf_logits.abs().max()))
