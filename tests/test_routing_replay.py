"""Routing replay (flexmoe.record_routing / flexmoe.replay_routing) against independent references.

* The GPT in training mode with exploration noise: the replayed forward equals the recording forward bit for bit
  (outputs and every gradient), where the router's own choice differs.
* Replayed choices in each routing family: the output and the router's gradient equal a plain per-token loop
  written here (float64), from the layer's own scores at the given experts, the capacity applied.
* A converted Qwen3-MoE decoded with HF ``generate()`` while recording, then one training forward over the whole
  generated sequences replaying the joined record: the decode's experts, and HF generate's logits.
* Bad replays are clear errors; the record survives ``torch.save`` / ``torch.load(weights_only=True)``.
* Two expert-parallel ranks (gloo) replaying each rank's record equal one process (tests/replay_worker.py).
"""

from __future__ import annotations

import copy

import pytest
import torch
from torch import nn

import flexmoe
from flexmoe import MoELayer, RoutingRecord, record_routing, replay_routing
from flexmoe.apps.models.gpt import GPT, GPTConfig
from reference import layer_params_f64, ref_activation, ref_linear_logits


def _gpt_with_noisy_bias_routing() -> GPT:
    """The apps' GPT (2 MoE blocks of 4) whose MoE layers explore (gate noise, jitter) and balance by a selection
    bias, so that changing the bias changes the router's choice and nothing else."""
    torch.manual_seed(0)
    cfg = GPTConfig(vocab_size=32, block_size=16, n_layer=4, n_head=2, n_embd=16, num_experts=4, expert_hidden=8,
                    k=2, capacity_factor=1.0)
    model = GPT(cfg)
    for block in model.blocks:
        if block.is_moe:
            block.mlp = MoELayer(16, 4, 8, k=2, capacity_factor=1.0, activation="gelu", group="single",
                                 gate_noise=0.3, jitter=0.05, balance="bias", bias_update_rate=0.0)
    return model


def _grads(model: nn.Module) -> dict[str, torch.Tensor]:
    return {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}


def _choices(model: nn.Module) -> dict[str, torch.Tensor]:
    return {n: m.last_plan.expert_index.clone() for n, m in model.named_modules() if isinstance(m, MoELayer)}


def test_replay_in_training_is_bit_identical_to_the_recording_forward():
    """Recorded under one selection bias, replayed under another with the same exploration noise: the router's own
    choice differs, the replayed forward's outputs and gradients are the recording's, bit for bit."""
    model = _gpt_with_noisy_bias_routing().train()
    idx = torch.randint(0, 32, (2, 12), generator=torch.Generator().manual_seed(5))
    layers = [m for m in model.modules() if isinstance(m, MoELayer)]

    def step() -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
        model.zero_grad(set_to_none=True)
        torch.manual_seed(7)  # the same exploration noise in every call
        logits, loss = model(idx, idx)
        (loss + model.aux_loss()).backward()
        return logits.detach(), _grads(model)

    with torch.no_grad():
        for i, m in enumerate(layers):
            m.expert_bias.copy_(torch.tensor([0.4, -0.2, 0.1, -0.3]) * (i + 1))
    with record_routing(model) as record:
        want_logits, want_grads = step()
    assert [len(c) for c in record.calls.values()] == [1, 1]
    with torch.no_grad():
        for m in layers:
            m.expert_bias.neg_()
    own_logits, _ = step()
    own = _choices(model)
    assert any(not torch.equal(own[n], record.calls[n][0]) for n in own), "the bias change left the choice as it was"
    assert not torch.equal(own_logits, want_logits)

    with replay_routing(model, record):
        got_logits, got_grads = step()
    assert all(torch.equal(c, record.calls[n][0]) for n, c in _choices(model).items())
    assert torch.equal(got_logits, want_logits)
    assert got_grads.keys() == want_grads.keys() and any(".router." in n for n in got_grads)
    for name, grad in want_grads.items():
        assert torch.equal(got_grads[name], grad), name


# ---------------------------------------------------------------------------------- the families' weights

FAMILIES = {
    # softmax, then the top-k renormalised (Mixtral, Qwen3-MoE; GPT-OSS's softmax over the k is the same)
    "softmax_normalized": dict(score_func="softmax", normalize_weights=True),
    # softmax probabilities as they are (Qwen2-MoE, OLMoE)
    "softmax_raw": dict(score_func="softmax", normalize_weights=False),
    # DeepSeek-V3: sigmoid, renormalised, scaled; the groups and the bias only pick, so replay ignores them
    "sigmoid_groups_bias": dict(score_func="sigmoid", normalize_weights=True, route_scale=2.5, num_expert_groups=3,
                                num_limited_groups=1, balance="bias", bias_update_rate=0.0),
    # a capacity of 3 pairs per expert: the replayed choices overflow it and pairs are dropped
    "capacity": dict(score_func="softmax", normalize_weights=True, capacity=3),
}


def _reference(params: dict[str, torch.Tensor], x: torch.Tensor, choices: torch.Tensor, opts: dict) -> torch.Tensor:
    """The layer on tokens ``x [T, M]`` with the given ``choices [T, k]``, one token at a time in float64: scores
    from the router's logits, the chosen ones normalised and scaled, slots by (choice, token), pairs at or past
    the capacity dropped."""
    logits = ref_linear_logits(x, params["router.weight"])  # [T, E]
    act = ref_activation("gelu")
    capacity = opts.get("capacity")
    num_tokens, k = choices.shape
    taken = [0] * logits.shape[1]
    kept = [[False] * k for _ in range(num_tokens)]
    for c in range(k):  # every token's 1st choice claims its slot before any 2nd choice
        for t in range(num_tokens):
            e = int(choices[t, c])
            kept[t][c] = capacity is None or taken[e] < capacity
            taken[e] += 1
    rows = []
    for t in range(num_tokens):
        scores = torch.softmax(logits[t], 0) if opts["score_func"] == "softmax" else torch.sigmoid(logits[t])
        chosen = [scores[int(e)] for e in choices[t]]
        if opts["normalize_weights"]:
            total = sum(chosen)
            chosen = [s / total for s in chosen]
        y = x.new_zeros(x.shape[1])
        for c, e in enumerate(choices[t].tolist()):
            if kept[t][c]:
                h = act(x[t] @ params["experts.w1"][e] + params["experts.b1"][e])
                out = h @ params["experts.w2"][e] + params["experts.b2"][e]
                y = y + chosen[c] * opts.get("route_scale", 1.0) * out
        rows.append(y)
    return torch.stack(rows)


@pytest.mark.parametrize("family", FAMILIES)
def test_replayed_choices_weigh_by_the_layers_own_scores(family):
    opts = FAMILIES[family]
    torch.manual_seed(0)
    moe = MoELayer(6, 6, 5, k=2, capacity_factor=0.0, activation="gelu", bias=True, dtype=torch.float64,
                   router_dtype=torch.float64, **opts)
    if moe.expert_bias is not None:
        moe.expert_bias.copy_(torch.linspace(-1, 1, 6, dtype=torch.float64))
    g = torch.Generator().manual_seed(3)
    x = torch.randn(10, 6, generator=g, dtype=torch.float64)
    # Choices no router would make: expert 5 for every 1st choice (overflowing a capacity of 3), random 2nd ones.
    second = torch.randint(0, 5, (10,), generator=g)
    choices = torch.stack([torch.full((10,), 5), second], dim=1)
    record = RoutingRecord({"": [choices]}, {"": [1]})

    xg = x.clone().requires_grad_(True)
    with replay_routing(moe, record):
        y = moe(xg)
    y.square().sum().backward()
    assert torch.equal(moe.last_plan.expert_index, choices)

    params = layer_params_f64(moe)
    x64 = x.clone().requires_grad_(True)
    want = _reference(params, x64, choices, opts)
    want.square().sum().backward()
    torch.testing.assert_close(y, want, rtol=1e-12, atol=1e-12)
    torch.testing.assert_close(moe.router.weight.grad, params["router.weight"].grad, rtol=1e-10, atol=1e-12)
    torch.testing.assert_close(xg.grad, x64.grad, rtol=1e-10, atol=1e-12)
    assert (int(moe.last_plan.num_dropped) > 0) == ("capacity" in opts)


# ------------------------------------------------------------------------- decoding with HF generate()


def test_generate_record_replays_in_one_training_forward_with_hf_logits():
    """A converted Qwen3-MoE decodes 2 prompts with HF's generate() (KV cache) while recording; one training
    forward over the generated sequences replaying the joined record takes the decode's experts, and its logits
    are HF generate's (HF's own model) at every generated step."""
    transformers = pytest.importorskip("transformers")
    import flexmoe.hf as fh
    from test_hf_convert import batches, tiny_model

    del transformers
    ref = tiny_model("qwen3_moe").eval()
    model = fh.convert(copy.deepcopy(ref), group="single").eval()
    prompt = batches(1, seed=9, batch=2, seq=5)[0]
    kwargs = dict(max_new_tokens=6, do_sample=False, use_cache=True, attention_mask=torch.ones_like(prompt),
                  output_logits=True, return_dict_in_generate=True)
    want = ref.generate(prompt, **kwargs)
    with record_routing(model) as record:
        got = model.generate(prompt, **kwargs)
    assert torch.equal(got.sequences, want.sequences)
    assert all(len(calls) == 6 for calls in record.calls.values())  # the prefill, then 5 steps of one token

    joined = record.joined()
    seq = want.sequences[:, :-1]  # the last token was sampled, never fed back
    with torch.no_grad():
        model(seq)  # the router's own choices over the whole sequences: the decode's (float32, no near-ties here)
    for name, m in model.named_modules():
        if isinstance(m, MoELayer):
            assert torch.equal(m.last_plan.expert_index, joined.calls[name][0]), name
    model.train()
    with replay_routing(model, joined):
        logits = model(seq).logits  # [2, 10, V]
    for name, m in model.named_modules():
        if isinstance(m, MoELayer):
            assert torch.equal(m.last_plan.expert_index, joined.calls[name][0]), name
    hf_steps = torch.stack(want.logits, dim=1)  # [2, 6, V]: the logits of each generated token
    torch.testing.assert_close(logits[:, prompt.shape[1] - 1:], hf_steps, rtol=1e-5, atol=1e-5)


def test_joined_puts_each_sequences_tokens_together():
    """Two sequences: a prefill of 2 tokens each, then one token each: joined() orders them sequence by sequence."""
    prefill = torch.tensor([[0, 1], [1, 2], [2, 3], [3, 0]])  # sequence 0's 2 tokens, then sequence 1's
    step = torch.tensor([[4, 5], [5, 6]])
    record = RoutingRecord({"moe": [prefill, step]}, {"moe": [2, 2]})
    want = torch.tensor([[0, 1], [1, 2], [4, 5], [2, 3], [3, 0], [5, 6]])
    assert torch.equal(record.joined().calls["moe"][0], want)
    with pytest.raises(ValueError, match="different numbers of sequences"):
        RoutingRecord({"moe": [prefill, step]}, {"moe": [2, 1]}).joined()


# ----------------------------------------------------------------------------------------- bad replays


def _model() -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(MoELayer(8, 4, 8, k=2, group="single"), MoELayer(8, 4, 8, k=2, group="single"))


def _recorded(model: nn.Module, x: torch.Tensor) -> RoutingRecord:
    with torch.no_grad(), record_routing(model) as record:
        model(x)
    return record


@pytest.mark.parametrize("case, words", [
    ("tokens", "has 5 tokens, the call has T=4"),
    ("k", "has k=1 choices per token, the layer routes k=2"),
    ("range", r"must lie in \[0, num_experts=4\), got values in \[0, 4\]"),
    ("negative", r"must lie in \[0, num_experts=4\), got values in \[-1, 3\]"),
    ("float", "must hold integer expert indices"),
])
def test_a_recorded_call_that_does_not_fit_is_a_clear_error(case, words):
    model = _model()
    x = torch.randn(4, 8)
    record = _recorded(model, x)
    bad = {"tokens": torch.zeros(5, 2, dtype=torch.long), "k": torch.zeros(4, 1, dtype=torch.long),
           "range": torch.tensor([[0, 4], [1, 2], [0, 1], [2, 3]]),
           "negative": torch.tensor([[0, -1], [1, 2], [0, 1], [2, 3]]),
           "float": torch.zeros(4, 2)}[case]
    record.calls["1"][0] = bad
    with replay_routing(model, record), pytest.raises(ValueError, match="the record's call 0 of layer '1'") as err:
        model(x)
    assert err.match(words)
    assert all(m.routing_tap is None for m in model)  # the taps are off again after the error


def test_missing_layers_extra_calls_and_wrong_records_are_clear_errors():
    model = _model()
    x = torch.randn(4, 8)
    record = _recorded(model, x)
    partial = RoutingRecord({"0": record.calls["0"]}, {"0": record.sequences["0"]})
    with pytest.raises(ValueError, match=r"no calls of the MoE layers \['1'\]"):
        with replay_routing(model, partial):
            pass
    with pytest.raises(ValueError, match=r"MoE layers \['2'\] that the model lacks"):
        with replay_routing(model, RoutingRecord({**record.calls, "2": []}, {**record.sequences, "2": []})):
            pass
    with pytest.raises(TypeError, match="record must be a RoutingRecord"):
        with replay_routing(model, record.calls):  # type: ignore[arg-type]
            pass
    with replay_routing(model, record):
        model(x)
        with pytest.raises(ValueError, match=r"layer '0' made more calls than the record holds \(1\)"):
            model(x)
        with pytest.raises(ValueError, match="already recording or replaying"):
            with record_routing(model):
                pass
    with pytest.raises(ValueError, match="has no flexmoe MoE layer"):
        with record_routing(nn.Linear(2, 2)):
            pass
    with pytest.raises(ValueError, match="routing replay needs per-token top-k choices"):
        with record_routing(MoELayer(8, 4, 8, k=2, router="expert_choice", group="single")):
            pass


def test_replay_under_activation_checkpointing_is_a_clear_error():
    moe = MoELayer(8, 4, 8, k=2, group="single")
    x = torch.randn(4, 8, requires_grad=True)
    record = _recorded(moe, x)
    with replay_routing(moe, record):
        y = torch.utils.checkpoint.checkpoint(moe, x, use_reentrant=False)
        with pytest.raises(ValueError, match="activation checkpointing"):
            y.sum().backward()


class _CheckpointedLayers(nn.Module):
    """Two residual MoE layers, each run under non-reentrant activation checkpointing when ``checkpointed``:
    backward recomputes each layer's forward (its router included)."""

    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.layers = nn.ModuleList(MoELayer(8, 4, 8, k=2, group="single", gate_noise=0.3, balance="bias",
                                             bias_update_rate=0.0) for _ in range(2))
        self.checkpointed = True

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        for layer in self.layers:
            x = x + (torch.utils.checkpoint.checkpoint(layer, x, use_reentrant=False) if self.checkpointed
                     else layer(x))
        return x


def test_recording_under_activation_checkpointing_records_each_call_once_and_replays():
    """Recording a checkpointed training step: the recomputation inside backward is not a call of its own (one
    call per layer), and the record replays: a run whose router would choose otherwise takes the recorded experts
    and gives the recording forward's output, bit for bit."""
    model = _CheckpointedLayers().train()
    x = torch.randn(6, 8, generator=torch.Generator().manual_seed(2))
    with torch.no_grad():
        for i, m in enumerate(model.layers):
            m.expert_bias.copy_(torch.tensor([0.4, -0.2, 0.1, -0.3]) * (i + 1))

    def step() -> torch.Tensor:
        torch.manual_seed(7)  # the same exploration noise in every run
        xg = x.clone().requires_grad_(True)
        y = model(xg)
        y.square().sum().backward()
        return y.detach()

    with record_routing(model) as record:
        want = step()
    assert record.calls.keys() == {"layers.0", "layers.1"}
    assert [record.num_calls(n) for n in ("layers.0", "layers.1")] == [1, 1]
    assert record.sequences == {"layers.0": [1], "layers.1": [1]}
    assert all(torch.equal(record.calls[n][0], c) for n, c in _choices(model).items())

    with torch.no_grad():
        for m in model.layers:
            m.expert_bias.neg_()
    model.checkpointed = False  # replay under checkpointing is refused (the test above); the record is the point
    own = step()
    assert any(not torch.equal(c, record.calls[n][0]) for n, c in _choices(model).items()), \
        "the bias change left the choice as it was"
    assert not torch.equal(own, want)
    with replay_routing(model, record):
        got = step()
    assert all(torch.equal(c, record.calls[n][0]) for n, c in _choices(model).items())
    assert torch.equal(got, want)


def test_random_second_expert_in_training_cannot_replay():
    moe = MoELayer(8, 4, 8, k=2, group="single", second_expert="random").train()
    x = torch.randn(4, 8)
    record = RoutingRecord({"": [torch.tensor([[0, 1], [1, 2], [2, 3], [3, 0]])]}, {"": [1]})
    with replay_routing(moe, record), pytest.raises(ValueError, match="second_expert='random'"):
        moe(x)


def test_record_round_trips_through_torch_save_with_weights_only(tmp_path):
    model = _model()
    x = torch.randn(2, 3, 8)
    with torch.no_grad(), record_routing(model) as record:
        model(x)
        model(x[:, :1])
    torch.save(record, tmp_path / "routing.pt")
    loaded = torch.load(tmp_path / "routing.pt", weights_only=True)
    assert isinstance(loaded, RoutingRecord)
    assert loaded.sequences == {"0": [2, 2], "1": [2, 2]}
    assert loaded.calls.keys() == record.calls.keys()
    for name, calls in record.calls.items():
        assert [c.shape for c in loaded.calls[name]] == [(6, 2), (2, 2)]
        assert all(torch.equal(a, b) for a, b in zip(loaded.calls[name], calls))
    with torch.no_grad(), replay_routing(model, loaded):
        model(x)
        model(x[:, :1])
    assert torch.equal(model[1].last_plan.expert_index, record.calls["1"][1])


def test_exported_from_flexmoe():
    assert flexmoe.record_routing is record_routing and flexmoe.replay_routing is replay_routing


# ---------------------------------------------------------------------------------- expert parallelism


@pytest.mark.slow
def test_two_expert_parallel_ranks_replay_as_one_process():
    from multiproc import check_ranks_pass
    from replay_worker import rank_main

    check_ranks_pass(2, rank_main, [], what="routing replay over 2 expert-parallel ranks")
