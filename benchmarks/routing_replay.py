"""What routing replay costs: decoding with and without ``flexmoe.record_routing``, and a training step over the
generated sequences with and without ``flexmoe.replay_routing`` of the joined record, side by side in one run.

    python benchmarks/routing_replay.py [--device cpu|cuda] [--new-tokens 32] [--repeats 5]

A converted Qwen3-MoE (4 layers of 32 experts, k=4, M=256) decodes a batch of 4 prompts greedily with HF's
``generate()`` (KV cache). Before timing, it checks what the feature promises on this device: the replayed
training forward takes the decode's experts and gives HF generate's logits. Prints the median of ``--repeats``
of each case (the cases alternate, so load changes hit both), at one thread on the CPU.
"""

from __future__ import annotations

import argparse
import copy
import statistics
import time
from collections.abc import Callable

import torch
from transformers import AutoConfig, AutoModelForCausalLM

import flexmoe
import flexmoe.hf as fh

CONFIG = dict(vocab_size=1024, hidden_size=256, num_hidden_layers=4, num_attention_heads=4, num_key_value_heads=2,
              head_dim=64, intermediate_size=512, moe_intermediate_size=128, num_experts=32, num_experts_per_tok=4,
              norm_topk_prob=True, tie_word_embeddings=False, initializer_range=0.1, eos_token_id=None,
              pad_token_id=None, bos_token_id=None)


def seconds(run: Callable[[], object], device: torch.device) -> float:
    if device.type == "cuda":
        torch.cuda.synchronize(device)
    start = time.perf_counter()
    run()
    if device.type == "cuda":
        torch.cuda.synchronize(device)
    return time.perf_counter() - start


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--device", default="cpu")
    parser.add_argument("--new-tokens", type=int, default=32)
    parser.add_argument("--repeats", type=int, default=5)
    args = parser.parse_args()
    torch.set_num_threads(1)
    device = torch.device(args.device)
    torch.manual_seed(0)
    hf = AutoModelForCausalLM.from_config(AutoConfig.for_model("qwen3_moe", **CONFIG)).to(device).eval()
    model = fh.convert(copy.deepcopy(hf), group="single").eval()
    prompt = torch.randint(0, CONFIG["vocab_size"], (4, 16), generator=torch.Generator().manual_seed(1)).to(device)
    kwargs = dict(max_new_tokens=args.new_tokens, do_sample=False, use_cache=True,
                  attention_mask=torch.ones_like(prompt), output_logits=True, return_dict_in_generate=True)

    # The promise, checked on this device before anything is timed.
    want = hf.generate(prompt, **kwargs)
    with flexmoe.record_routing(model) as record:
        got = model.generate(prompt, **kwargs)
    assert torch.equal(got.sequences, want.sequences), "the converted model decoded other tokens than HF's"
    joined = record.joined()
    seq = got.sequences[:, :-1]
    model.train()
    with flexmoe.replay_routing(model, joined):
        logits = model(seq).logits
    for name, m in model.named_modules():
        if isinstance(m, flexmoe.MoELayer):
            assert torch.equal(m.last_plan.expert_index, joined.calls[name][0]), name
    step_logits = logits[:, prompt.shape[1] - 1:].float()
    err = float((step_logits.detach() - torch.stack(want.logits, 1).float()).abs().max())
    print(f"{device}: replayed training forward = decode's experts; max |logits - HF generate's| = {err:.2e}")
    assert err < 1e-3, err

    def decode() -> None:
        model.eval()
        model.generate(prompt, **kwargs)

    def decode_recording() -> None:
        model.eval()
        with flexmoe.record_routing(model):
            model.generate(prompt, **kwargs)

    def train_step() -> None:
        model.train()
        model(seq).logits.float().square().mean().backward()

    def train_step_replaying() -> None:
        model.train()
        with flexmoe.replay_routing(model, joined):
            model(seq).logits.float().square().mean().backward()

    cases = {"decode": decode, "decode, recording": decode_recording, "training step": train_step,
             "training step, replaying": train_step_replaying}
    times: dict[str, list[float]] = {name: [] for name in cases}
    for run in cases.values():
        run()  # warm-up
    for _ in range(args.repeats):
        for name, run in cases.items():
            times[name].append(seconds(run, device))
    median = {name: statistics.median(t) for name, t in times.items()}
    print(f"median of {args.repeats} (ms), batch {prompt.shape[0]}, prompt {prompt.shape[1]}, "
          f"{args.new_tokens} new tokens:")
    for plain, tapped in (("decode", "decode, recording"), ("training step", "training step, replaying")):
        print(f"  {plain:14} {median[plain] * 1e3:9.1f}   {tapped:26} {median[tapped] * 1e3:9.1f}   "
              f"ratio {median[tapped] / median[plain]:.3f}")


if __name__ == "__main__":
    main()
