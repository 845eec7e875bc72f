"""An inference engine's rollout, played by Hugging Face's own model (tests/test_routed_experts.py), and one rank of
its 2-rank expert-parallel case (run by flexmoe.launch.spawn_ranks).

:func:`engine_rollout` decodes a left-padded batch greedily with HF ``generate()`` (KV cache) and captures the experts
each token took as vLLM and SGLang return them: forward hooks on HF's routers take the top-k of the router logits
(computed here, not HF's indices) at every call, the prefill and each decode step; each sequence's choices cover its
prompt and its generated tokens but the last (sampled, never run through the model); positions the engine never
saw (the padding) hold -1.
"""

from __future__ import annotations

import copy

import torch
from torch import nn


def hf_routers(ref: nn.Module) -> list[nn.Module]:
    """HF's router of every MoE block, in layer order (Mixtral's and Qwen3-MoE's ``mlp.gate``)."""
    return [layer.mlp.gate for layer in ref.model.layers]


def engine_rollout(ref: nn.Module, prompt: torch.Tensor, prompt_mask: torch.Tensor, new_tokens: int):
    """Greedy decoding of ``prompt [B, P]`` (left-padded, ``prompt_mask [B, P]``) by HF's model ``ref``; returns
    ``(ids [B, S], mask [B, S], routed [B, S, L, k], logits [B, new_tokens, V])`` with ``S = P + new_tokens - 1``:
    the sequences without their last token, the mask of what the engine ran, its routing (-1 where the mask is 0)
    and the logits of each generated token."""
    k = ref.config.num_experts_per_tok
    calls: list[list[torch.Tensor]] = [[] for _ in hf_routers(ref)]

    def capture(layer: int):
        def hook(module: nn.Module, args: tuple, output: tuple) -> None:
            logits = output[0]  # [T, E], T = B * (tokens of this call)
            calls[layer].append(torch.topk(logits.float(), k, dim=-1).indices)
        return hook

    handles = [router.register_forward_hook(capture(i)) for i, router in enumerate(hf_routers(ref))]
    try:
        out = ref.generate(prompt, attention_mask=prompt_mask, max_new_tokens=new_tokens, do_sample=False,
                           use_cache=True, output_logits=True, return_dict_in_generate=True, pad_token_id=0)
    finally:
        for handle in handles:
            handle.remove()
    batch = prompt.shape[0]
    per_layer = [torch.cat([c.reshape(batch, -1, k) for c in layer_calls], dim=1) for layer_calls in calls]
    routed = torch.stack(per_layer, dim=2)  # [B, S, L, k]: the prefill, then one token per decode step
    ids = out.sequences[:, :-1]
    mask = torch.cat([prompt_mask, torch.ones(batch, new_tokens - 1, dtype=prompt_mask.dtype)], dim=1)
    assert routed.shape[:2] == ids.shape
    routed = routed.masked_fill(mask[:, :, None, None] == 0, -1)  # the engine never ran the padding
    return ids, mask, routed, torch.stack(out.logits, dim=1)


def left_padded_prompts(lengths: list[int], vocab: int, seed: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Prompts of the given lengths, left-padded with token 0 to the longest: ``(ids [B, P], mask [B, P])``."""
    g = torch.Generator().manual_seed(seed)
    longest = max(lengths)
    ids = torch.zeros(len(lengths), longest, dtype=torch.long)
    mask = torch.zeros(len(lengths), longest, dtype=torch.long)
    for b, n in enumerate(lengths):
        ids[b, longest - n:] = torch.randint(1, vocab, (n,), generator=g)
        mask[b, longest - n:] = 1
    return ids, mask


def left_positions(mask: torch.Tensor) -> torch.Tensor:
    """The position ids HF ``generate()`` gives a left-padded batch: each real token its index among the real ones
    (the padding 1, as HF sets it; masked anyway)."""
    return (mask.cumsum(-1) - 1).masked_fill(mask == 0, 1)


# ---------------------------------------------------------------------------------- 2 expert-parallel ranks


def rank_main(family: str) -> dict:
    from hf_ep_worker import _in_world

    return _in_world(lambda rank, world: _check_rank_rows(family, rank, world))


def _check_rank_rows(family: str, rank: int, world: int) -> list[str]:
    """Every rank decodes the same batch with HF's model (the engine), then replays its own rows of the routing in
    a forward of its expert-parallel converted model: the logits of its rows are HF generate's."""
    import flexmoe.hf as fh
    from flexmoe import MoELayer, RoutingRecord, replay_routing
    from test_hf_convert import V, tiny_model

    failures: list[str] = []
    ref = tiny_model(family).eval()
    model = fh.convert(copy.deepcopy(ref)).train()  # group=None: the world is the expert-parallel group
    layers = [m for m in model.modules() if isinstance(m, MoELayer)]
    if not all(m.ep_group.distributed and m.experts.w1.shape[0] == m.num_experts // world for m in layers):
        failures.append(f"rank {rank}: the experts are not spread over the {world} ranks")
    prompt, prompt_mask = left_padded_prompts([5, 3, 4, 2], V, seed=21)
    ids, mask, routed, hf_logits = engine_rollout(ref, prompt, prompt_mask, new_tokens=4)
    rows = slice(rank * 2, rank * 2 + 2)  # this rank's sequences
    record = RoutingRecord.from_routed_experts(routed[rows].numpy(), model, attention_mask=mask[rows])
    with replay_routing(model, record), torch.no_grad():
        logits = model(ids[rows], attention_mask=mask[rows], position_ids=left_positions(mask[rows])).logits
    for m, layer_routed in zip(layers, routed[rows].unbind(2)):
        real = mask[rows].reshape(-1) == 1
        if not torch.equal(m.last_plan.expert_index[real], layer_routed.reshape(-1, layer_routed.shape[-1])[real]):
            failures.append(f"rank {rank}: a layer did not take the engine's experts")
    got, want = logits[:, prompt.shape[1] - 1:], hf_logits[rows]
    if not torch.allclose(got, want, rtol=1e-5, atol=1e-5):
        failures.append(f"rank {rank}: logits differ from HF generate's by {float((got - want).abs().max())}")
    return failures
