"""``torch.compile(fullgraph=True)`` of converted Hugging Face models, training and ``generate()``, against HF's
own eager model (docs/architecture.md, "Compiling the layer").

The converted model is dropless, as HF's blocks are. ``fullgraph=True`` itself proves that nothing in the layer
reaches the host (a ``Tensor.item()`` / ``tolist()`` is a graph break, which ``fullgraph`` turns into an
error); dynamo's graph counter proves that calls with other routings recompile nothing. The backend is
``aot_eager``: dynamo and AOT autograd trace exactly as for inductor, without generating C++.
"""

from __future__ import annotations

import copy
import shutil
from collections.abc import Callable, Iterator
from typing import Any

import pytest
import torch
import torch._dynamo
from torch import Tensor, nn

transformers = pytest.importorskip(
    "transformers", reason="flexmoe.hf needs transformers (pip install -e .[hf]; CI installs it via .[test])")

import flexmoe.hf as fh  # noqa: E402
from test_hf_convert import batches, tiny_model  # noqa: E402

FAMILIES = ["mixtral", "qwen2_moe", "qwen3_moe", "olmoe", "deepseek_v3", "gpt_oss"]
FAST_FAMILY = "qwen3_moe"  # the default run's representative; the sweep over every family is slow
TOL = dict(rtol=1e-5, atol=1e-5)


def _families() -> list[Any]:
    return [f if f == FAST_FAMILY else pytest.param(f, marks=pytest.mark.slow) for f in FAMILIES]


@pytest.fixture(autouse=True)
def fresh_dynamo(one_thread: None) -> Iterator[None]:
    torch._dynamo.reset()
    yield
    torch._dynamo.reset()


def _graphs() -> int:
    """Graphs dynamo compiled so far in this process (``torch._dynamo.reset`` does not zero the counter)."""
    return int(torch._dynamo.utils.counters["stats"]["unique_graphs"])


def _sgd_steps(forward: Callable[..., Any], model: nn.Module, data: list[Tensor], lr: float = 0.05,
               after_step: Callable[[], None] = lambda: None) -> list[float]:
    """SGD steps on the LM loss plus HF's auxiliary loss (``output_router_logits=True``), ``forward`` computing
    ``model``'s output; the losses."""
    opt = torch.optim.SGD(model.parameters(), lr=lr)
    losses = []
    for ids in data:
        loss = forward(ids, labels=ids, output_router_logits=True).loss
        loss.backward()
        opt.step()
        opt.zero_grad()
        losses.append(float(loss.detach()))
        after_step()
    return losses


@pytest.mark.parametrize("family", _families())
def test_compiled_training_steps_equal_hf_eager(family: str) -> None:
    """Three SGD steps of the converted model compiled with ``fullgraph=True`` give HF eager's losses (the
    auxiliary loss included), and afterwards HF's logits: every gradient was HF's. The steps route other tokens
    to other experts, and compile no graph after the first step."""
    _check_compiled_training(family, "aot_eager", TOL)


_CXX = shutil.which("g++") or shutil.which("c++") or shutil.which("clang++")


@pytest.mark.slow
@pytest.mark.skipif(_CXX is None, reason="inductor on CPU compiles C++: no g++, c++ or clang++ on PATH")
@pytest.mark.parametrize("family", ["qwen3_moe", "gpt_oss"])
def test_inductor_compiled_training_steps_equal_hf_eager(family: str) -> None:
    """The same under inductor, the real backend (C++ kernels): the fused FFN op, and GPT-OSS's callable unit
    between flexmoe::grouped_linear's matmuls, fused by inductor."""
    _check_compiled_training(family, "inductor", dict(rtol=1e-4, atol=1e-4))


def _check_compiled_training(family: str, backend: str, tol: dict[str, float]) -> None:
    ref = tiny_model(family)
    model = fh.convert(copy.deepcopy(ref), group="single")
    data = batches(3)
    with torch.no_grad():
        # transformers installs its output recorders on the first call that asks for them, under a lock
        # dynamo cannot trace; one eager call does it outside the compiled region (HF's own models need it too).
        model.eval()(data[0], output_router_logits=True)
    ref.train()
    model.train()
    want = _sgd_steps(ref, ref, data)
    graphs: list[int] = []
    before = _graphs()
    got = _sgd_steps(torch.compile(model, fullgraph=True, backend=backend), model, data,
                     after_step=lambda: graphs.append(_graphs() - before))
    torch.testing.assert_close(torch.tensor(got), torch.tensor(want), **tol)
    assert graphs[0] >= 1 and graphs[-1] == graphs[0], graphs
    plans = [b.moe.last_plan for b in model.modules() if isinstance(b, fh.ConvertedMoeBlock)]
    assert plans and all(p is not None and not p.padded and p.num_dropped == 0 for p in plans)
    ids = batches(1, seed=11)[0]
    ref.eval()
    model.eval()
    with torch.no_grad():
        torch.testing.assert_close(model(ids).logits, ref(ids).logits, **tol)


def _generate(model: nn.Module, ids: Tensor, compile_config: Any = None) -> Any:
    """Greedy decoding of 6 tokens with a static cache (the cache transformers compiles the decoding step with),
    the per-step logits returned too."""
    return model.generate(ids, max_new_tokens=6, do_sample=False, cache_implementation="static",
                          output_logits=True, return_dict_in_generate=True, compile_config=compile_config)


@pytest.mark.parametrize("family", _families())
def test_compiled_generate_equals_hf_eager(family: str) -> None:
    """``generate()`` compiling the converted model's decoding step with ``fullgraph=True`` gives HF eager's tokens
    and logits, for two prompts that route differently, the second compiling no new graph."""
    # DeepSeek-V3 with as many key/value heads as query heads (as its own config has): with fewer, HF's own eager
    # model fails under the static cache (its latent attention's keys repeated twice over).
    ref = tiny_model(family, **({"num_key_value_heads": 2} if family == "deepseek_v3" else {})).eval()
    model = fh.convert(copy.deepcopy(ref), group="single").eval()
    compile_config = transformers.CompileConfig(fullgraph=True, backend="aot_eager", mode=None)
    compile_config._compile_all_devices = True  # transformers compiles generate on accelerators only otherwise
    before = _graphs()
    graphs = []
    for seed in (3, 9):
        ids = batches(1, seed=seed, batch=2, seq=5)[0]
        want = _generate(ref, ids)
        got = _generate(model, ids, compile_config)
        assert torch.equal(got.sequences, want.sequences)
        torch.testing.assert_close(torch.stack(got.logits), torch.stack(want.logits), **TOL)
        graphs.append(_graphs() - before)
    assert graphs[0] >= 1 and graphs[1] == graphs[0], graphs  # the decoding step was compiled, once
