"""flexmoe.RoutingRecord.from_routed_experts: routing replay from an inference engine's per-token choices.

* The engine is HF's own model decoding greedily (tests/routed_experts_worker.py): hooks on its routers take the
  top-k of the router logits at every call, laid out as vLLM / SGLang return them (prompt and generated tokens but
  the last, -1 on the padding). A converted copy replaying the record in one training forward over the whole
  sequences takes those experts and gives HF generate's logits, the batch left-padded as generated or re-laid
  right-padded; a record with one choice changed changes that token's logits (the record is what decides).
* The record's layout against a hand-written one (sequence by sequence, placeholders on the padding), from numpy.
* Each misfit is a TypeError / ValueError naming what differs.
* Two expert-parallel ranks (gloo), each replaying its own rows, give HF generate's logits (slow).
"""

from __future__ import annotations

import copy

import numpy as np
import pytest
import torch
from torch import nn

from flexmoe import MoELayer, RoutingRecord, replay_routing
from routed_experts_worker import engine_rollout, left_padded_prompts, left_positions

transformers = pytest.importorskip("transformers")

import flexmoe.hf as fh  # noqa: E402
from test_hf_convert import V, tiny_model  # noqa: E402

FAMILIES = ["mixtral", "qwen3_moe"]
NEW_TOKENS = 4


@pytest.fixture(autouse=True)
def _threads(one_thread):
    yield


def _moe_layers(model: nn.Module) -> list[MoELayer]:
    return [m for m in model.modules() if isinstance(m, MoELayer)]


def _assert_took(model: nn.Module, routed: torch.Tensor, mask: torch.Tensor) -> None:
    """Every MoE layer's last forward took ``routed [B, S, L, k]`` where ``mask [B, S]`` is 1."""
    real = mask.reshape(-1) == 1
    layers = _moe_layers(model)
    assert len(layers) == routed.shape[2]
    for layer, choices in zip(layers, routed.unbind(2)):
        assert torch.equal(layer.last_plan.expert_index[real], choices.reshape(-1, choices.shape[-1])[real])


def _rollout(family: str):
    ref = tiny_model(family).eval()
    model = fh.convert(copy.deepcopy(ref), group="single").train()
    prompt, prompt_mask = left_padded_prompts([6, 3, 5], V, seed=4)
    return model, prompt.shape[1], engine_rollout(ref, prompt, prompt_mask, NEW_TOKENS)


@pytest.mark.parametrize("family", FAMILIES)
def test_left_padded_generate_replays_to_hf_generate_logits(family):
    """The batch as generated (left padding): the training forward replaying the engine's record gives the logits
    HF generate() produced for every generated token, and takes the engine's experts."""
    model, prompt_len, (ids, mask, routed, hf_logits) = _rollout(family)
    record = RoutingRecord.from_routed_experts(routed, model, attention_mask=mask)
    with replay_routing(model, record):
        logits = model(ids, attention_mask=mask, position_ids=left_positions(mask)).logits  # [B, S, V]
    _assert_took(model, routed, mask)
    torch.testing.assert_close(logits[:, prompt_len - 1:], hf_logits, rtol=1e-5, atol=1e-5)

    # One real token's 1st choice at the first MoE layer moved to another expert: that token's logits change.
    b, s = 0, prompt_len - 1
    changed = routed.clone()
    first, second = (int(e) for e in routed[b, s, 0])
    changed[b, s, 0, 0] = next(e for e in range(4) if e not in (first, second))
    with replay_routing(model, RoutingRecord.from_routed_experts(changed, model, attention_mask=mask)):
        other = model(ids, attention_mask=mask, position_ids=left_positions(mask)).logits
    assert not torch.allclose(other[b, s], logits[b, s], rtol=1e-4, atol=1e-4)
    torch.testing.assert_close(other[b, :s], logits[b, :s], rtol=0, atol=0)  # earlier tokens: causal, unchanged


@pytest.mark.parametrize("family", FAMILIES)
def test_right_padded_batch_replays_to_hf_generate_logits(family):
    """The same rollout re-laid right-padded, as a trainer packs prompt + completion (padding after each sequence,
    plain positions): the replayed forward's logits at each sequence's generated tokens are HF generate's."""
    model, prompt_len, (ids, mask, routed, hf_logits) = _rollout(family)
    lengths = mask.sum(1).tolist()
    right_ids, right_mask = torch.zeros_like(ids), torch.zeros_like(mask)
    right_routed = torch.full_like(routed, -1)
    for b, n in enumerate(lengths):
        right_ids[b, :n], right_mask[b, :n], right_routed[b, :n] = ids[b, -n:], 1, routed[b, -n:]
    record = RoutingRecord.from_routed_experts(right_routed, model, attention_mask=right_mask)
    with replay_routing(model, record):
        logits = model(right_ids, attention_mask=right_mask).logits
    _assert_took(model, right_routed, right_mask)
    for b, n in enumerate(lengths):
        first = n - NEW_TOKENS  # the last prompt token: its logits chose the first generated token
        torch.testing.assert_close(logits[b, first:n], hf_logits[b], rtol=1e-5, atol=1e-5)


# --------------------------------------------------------------------------------------------- the layout


def _layers(k: int = 2) -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(MoELayer(8, 4, 8, k=k, group="single"), MoELayer(8, 4, 8, k=k, group="single"))


def test_record_lays_out_sequences_in_turn_with_placeholders_on_the_padding():
    """From a numpy int32 array (what engines give): one call per layer over [B * S] tokens, sequence by sequence,
    long; masked positions (-1 there) take experts (t * k + j) mod E in turn; a forward over [B, S] takes them."""
    routed = np.full((2, 3, 2, 2), -1, dtype=np.int32)  # [B=2, S=3, L=2, k=2]
    routed[0, 0] = [[1, 2], [3, 0]]
    routed[0, 1] = [[2, 3], [0, 1]]
    routed[1, 1] = [[0, 3], [1, 2]]
    routed[1, 2] = [[3, 1], [2, 0]]
    mask = np.array([[1, 1, 0], [0, 1, 1]])
    model = _layers()
    given = routed.copy()
    record = RoutingRecord.from_routed_experts(routed, model, attention_mask=mask)
    assert np.array_equal(routed, given)  # the engine's array is left as it was
    # tokens t = 0..5 are (b, s) = (0,0) (0,1) (0,2) (1,0) (1,1) (1,2); padding t=2: [4, 5] % 4, t=3: [6, 7] % 4
    want = {"0": [[1, 2], [2, 3], [0, 1], [2, 3], [0, 3], [3, 1]],
            "1": [[3, 0], [0, 1], [0, 1], [2, 3], [1, 2], [2, 0]]}
    assert record.calls.keys() == want.keys() and record.sequences == {"0": [2], "1": [2]}
    for name, rows in want.items():
        assert record.calls[name][0].dtype == torch.long
        assert record.calls[name][0].tolist() == rows
    x = torch.randn(2, 3, 8)
    with torch.no_grad(), replay_routing(model, record):
        model(x)
    assert all(m.last_plan.expert_index.tolist() == want[str(i)] for i, m in enumerate(model))
    # Without a mask every position must hold a choice; a tensor works as numpy does.
    as_tensor = torch.from_numpy(np.abs(routed)).long()
    full = RoutingRecord.from_routed_experts(as_tensor, model)
    assert full.calls["1"][0][2].tolist() == [1, 1]
    full.calls["1"][0].fill_(0)
    assert torch.equal(as_tensor, torch.from_numpy(np.abs(routed)).long())  # the record holds a copy


# ------------------------------------------------------------------------------------------------ misfits


def _routed(batch: int = 2, seq: int = 3, layers: int = 2, k: int = 2) -> torch.Tensor:
    g = torch.Generator().manual_seed(1)
    return torch.stack([torch.randperm(4, generator=g)[:k] for _ in range(batch * seq * layers)]).reshape(
        batch, seq, layers, k)


MISFITS = {  # case: (routed, attention_mask, the error, the words)
    "layers": (lambda: _routed(layers=3), None, ValueError,
               r"routed has 3 layers \(its axis 2\), the model has 2 MoE layers \['0', '1'\]"),
    "top_k": (lambda: _routed(k=1), None, ValueError, r"routed has top_k=1 \(its axis 3\), MoE layer '0' routes k=2"),
    "expert_range": (lambda: _routed().index_put_((torch.tensor(1), torch.tensor(2), torch.tensor(1),
                                                   torch.tensor(0)), torch.tensor(4)), None, ValueError,
                     r"routed\[1, 2, 1\] \(MoE layer '1'\) holds expert 4, outside \[0, 4\)"),
    "mask_dtype": (_routed, torch.ones(2, 3), TypeError, "attention_mask must hold 0 and 1 as integers or booleans, "
                   "got dtype torch.float32"),
    "last_token_unrouted": (lambda: _routed().index_fill_(1, torch.tensor([2]), -1),
                            torch.ones(2, 3, dtype=torch.long), ValueError,
                            r"routed\[0, 2, 0\] \(MoE layer '0'\) holds expert -1 where attention_mask is 1"),
    "mask_shape": (_routed, torch.ones(2, 4, dtype=torch.long), ValueError,
                   r"attention_mask is \[2, 4\], routed's tokens are \[2, 3\]"),
    "mask_values": (_routed, torch.full((2, 3), 2), ValueError, r"attention_mask must hold 0 and 1, got values \[2\]"),
    "float_ids": (lambda: _routed().float(), None, TypeError, "routed must hold integer expert ids, got dtype "
                  "torch.float32"),
    "bool_ids": (lambda: _routed() > 1, None, TypeError, "routed must hold integer expert ids, got dtype torch.bool"),
    "ndim": (lambda: _routed()[0], None, ValueError, r"routed must be \[batch, seq, layers, top_k\] \(4 dims\), got "
             r"shape \(3, 2, 2\)"),
    "empty": (lambda: _routed()[:, :0], None, ValueError, r"routed holds no choices: shape \(2, 0, 2, 2\)"),
    "list": (lambda: _routed().tolist(), None, TypeError, "routed must be a numpy array or a torch tensor, got list"),
    "numpy_strings": (lambda: np.full((2, 3, 2, 2), "1"), None, TypeError,
                      "routed must hold integers, got a numpy array of dtype <U1"),
}


@pytest.mark.parametrize("case", MISFITS)
def test_a_routing_that_does_not_fit_is_an_error_naming_what_differs(case):
    make, mask, error, words = MISFITS[case]
    with pytest.raises(error, match=words):
        RoutingRecord.from_routed_experts(make(), _layers(), attention_mask=mask)


def test_a_model_without_moe_layers_and_a_forward_of_other_length_are_errors():
    with pytest.raises(ValueError, match=r"the model \(Linear\) has no flexmoe MoE layer"):
        RoutingRecord.from_routed_experts(_routed(), nn.Linear(8, 8))
    with pytest.raises(TypeError, match="model must be a nn.Module, got dict"):
        RoutingRecord.from_routed_experts(_routed(), {})  # type: ignore[arg-type]
    model = _layers()
    record = RoutingRecord.from_routed_experts(_routed(), model)  # [2, 3] tokens
    with replay_routing(model, record), pytest.raises(ValueError, match="has 6 tokens, the call has T=4"):
        model(torch.randn(2, 2, 8))


# ---------------------------------------------------------------------------------- expert parallelism


@pytest.mark.slow
@pytest.mark.parametrize("family", FAMILIES)
def test_two_expert_parallel_ranks_replay_their_rows_to_hf_generate_logits(family):
    from multiproc import check_ranks_pass
    from routed_experts_worker import rank_main

    check_ranks_pass(2, rank_main, [family], what=f"engine routing replay over 2 expert-parallel ranks ({family})",
                     timeout=600.0)
