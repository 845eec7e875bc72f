"""The multi-rank scenarios of :func:`flexmoe.sharding.parallelize` (FSDP2 with expert parallelism), run in every
rank by ``multiproc.rank_main`` (registered in ``scenario_worker.SCENARIOS``); the pytest cases are in
tests/test_fsdp.py.

The reference: one process holding every expert, running each rank's batch as its own forward, the loss the mean
of the ranks' losses (what FSDP's averaged gradients are the gradient of), one AdamW step per step. Every rank
computes it for itself (the model is tiny) and compares its own losses and its own shards of the final weights.
"""

from __future__ import annotations

import copy

import torch
from torch.distributed.fsdp import FSDPModule, MixedPrecisionPolicy
from torch.distributed.tensor import DTensor

from flexmoe import MoELayer, update_expert_biases
from flexmoe.apps.models.gpt import GPT, GPTConfig
from flexmoe.experts.chooser import KernelChooser
from flexmoe.parallel import ExpertLayout, shard_expert_state
from flexmoe.sharding import local_state_bytes, make_mesh, materialize, parallelize
from flexmoe.sharding.fsdp_overlap import DeferredReduceScatter

# Tiny: 2 MoE blocks of 8 experts, so ep=4 holds 2 experts a rank and ep=2 x dp_shard=2 one expert's worth of each.
CFG = dict(vocab_size=32, block_size=16, n_layer=2, n_head=2, n_embd=16, num_experts=8, expert_hidden=16, k=2,
           moe_every=1, capacity_factor=1.25)
BATCH, SEQ = 2, 16
LR = 1e-2
# The attention's key bias has a gradient of exactly 0 (softmax ignores a shift per query): only rounding noise,
# which AdamW's default eps=1e-8 would blow up into lr-sized steps that differ between any two summation orders.
EPS = 1e-4
# float32 end to end: the ranks sum gradients in another order than the reference, and AdamW divides by sqrt(v).
TOL = 2e-5
SEED = 7
COMPILE_BACKEND = "inductor"
DTYPE = torch.float32


def gpt(seed: int = 0, **overrides) -> GPT:
    torch.manual_seed(seed)
    return GPT(GPTConfig(**{**CFG, **overrides}))


def with_layer_options(model: GPT, **options) -> GPT:
    """``model`` with every MoE layer rebuilt with ``options`` on top of its own (same weights, one process)."""
    for block in model.blocks:
        old = block.mlp
        if not isinstance(old, MoELayer):
            continue
        new = MoELayer(old.model_dim, old.num_experts, old.hidden_dim, group="single",
                       routing_options=old.routing_options, expert_options=old.expert_options,
                       parallel_options=old.parallel_options, **options)
        new.load_state_dict(old.state_dict(), strict=False)  # a new expert_bias starts at 0
        block.mlp = new
    return model.to(DTYPE)


def batch(step: int, rank: int) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(1000 * step + rank)
    data = torch.randint(0, CFG["vocab_size"], (BATCH, SEQ + 1), generator=g)
    return data[:, :-1], data[:, 1:]


def train_reference(model: GPT, world: int, steps: int) -> list[list[float]]:
    """losses[step][rank] of one process running each rank's batch, the loss their mean."""
    opt = torch.optim.AdamW(model.parameters(), lr=LR, eps=EPS)
    losses = []
    for step in range(steps):
        opt.zero_grad()
        total = torch.zeros((), dtype=DTYPE)
        mine = []
        for j in range(world):
            x, y = batch(step, j)
            _, loss = model(x, y)
            loss = loss + model.regularization_loss()
            mine.append(loss.item())
            total = total + loss / world
        total.backward()
        update_expert_biases(model)
        opt.step()
        losses.append(mine)
    return losses


def train_parallel(model: GPT, rank: int, steps: int) -> tuple[list[float], torch.optim.Optimizer]:
    opt = torch.optim.AdamW(model.parameters(), lr=LR, eps=EPS)
    losses = []
    for step in range(steps):
        opt.zero_grad()
        x, y = batch(step, rank)
        _, loss = model(x, y)
        loss = loss + model.regularization_loss()
        loss.backward()
        update_expert_biases(model)
        opt.step()
        losses.append(loss.item())
    return losses, opt


def expected_shard(ref: GPT, name: str, ep: int, ep_rank: int, grad: bool = False) -> torch.Tensor:
    """What this rank's expert-parallel group member holds of reference parameter ``name`` (all of it, for a
    non-expert parameter), or of its gradient."""
    from flexmoe.experts.modules import joined_parameter_halves

    tensors = {n: (p.grad if grad else p) for n, p in ref.named_parameters()}
    for joined, halves in joined_parameter_halves(ref).items():  # the one process's gate_up by its halves
        whole = tensors.pop(joined)
        tensors.update(zip(halves, (None, None) if whole is None else whole.chunk(2, dim=-1)))
    want = tensors[name].detach()
    if ".experts." not in name:
        return want
    layer_name, param = name.rsplit(".experts.", 1)
    layer = ref.get_submodule(layer_name)
    layout = ExpertLayout(layer.num_experts, ep, layer.hidden_dim)
    return shard_expert_state({param: want}, layout, ep_rank)[param]


def compare_run(tag: str, ref_losses, losses, ref: GPT, model, rank: int, ep: int, failures: list[str]) -> None:
    got = torch.tensor(losses)
    want = torch.tensor([step[rank] for step in ref_losses])
    if not torch.allclose(got, want, rtol=TOL, atol=TOL):
        failures.append(f"{tag}: losses differ (max {(got - want).abs().max().item():.3g}): {got} vs {want}")
    for name, p in model.named_parameters():
        full = p.full_tensor() if isinstance(p, DTensor) else p
        want_p = expected_shard(ref, name, ep, rank % ep)
        if full.shape != want_p.shape:
            failures.append(f"{tag}: {name} has shape {tuple(full.shape)}, expected {tuple(want_p.shape)}")
        elif not torch.allclose(full.detach(), want_p, rtol=TOL, atol=TOL):
            failures.append(f"{tag}: {name} differs by {(full.detach() - want_p).abs().max().item():.3g}")


def state_bound(ref: GPT, world: int) -> float:
    """1.1 x the whole model's training state / world + the largest tensor (fp32 AdamW: 4 tensors a parameter)."""
    total = sum(4 * 4 * p.numel() for p in ref.parameters())
    largest = max(4 * p.numel() for p in ref.parameters())
    return 1.1 * total / world + largest


def check_mesh(tag: str, rank: int, world: int, mesh_sizes: dict, out: dict, failures: list[str], steps: int = 10,
               activation_checkpointing: bool = False, **options) -> None:
    """Train the GPT laid on ``make_mesh(**mesh_sizes)`` and compare it with one process; record its state bytes."""
    ref = with_layer_options(gpt(), **options)
    ref_losses = train_reference(ref, world, steps)
    model = parallelize(with_layer_options(gpt(), **options), make_mesh(**mesh_sizes),
                        activation_checkpointing=activation_checkpointing)
    losses, opt = train_parallel(model, rank, steps)
    ep = mesh_sizes.get("ep", 1)
    compare_run(tag, ref_losses, losses, ref, model, rank, ep, failures)
    held = local_state_bytes(model, opt)
    out.setdefault("state_bytes", {})[tag] = held
    # HSDP keeps a whole copy per replica: the state is sharded over the ranks of one replica.
    out.setdefault("bound", {})[tag] = state_bound(ref, world // mesh_sizes.get("dp_replicate", 1))
    out.setdefault("cases", 0)
    out["cases"] += 1


def scenario_fsdp_gpt(rank: int, world: int, out: dict) -> None:
    """The GPT laid on every mesh of this world (HSDP too): losses and final weights equal one process's."""
    failures: list[str] = []
    meshes = {2: [dict(ep=2)], 4: [dict(ep=2, dp_shard=2), dict(ep=4), dict(dp_replicate=2, ep=2, dp_shard=1)]}[world]
    for sizes in meshes:
        tag = "x".join(f"{k}={v}" for k, v in sizes.items())
        check_mesh(tag, rank, world, sizes, out, failures)
    if world == 2:
        check_mesh("ep=2 activation checkpointing", rank, world, dict(ep=2), out, failures, steps=4,
                   activation_checkpointing=True)
    out["failures"] = failures


def meta_gpt(**overrides) -> GPT:
    with torch.device("meta"):
        return GPT(GPTConfig(**{**CFG, **overrides}))


def scenario_fsdp_meta(rank: int, world: int, out: dict) -> None:
    """The GPT built on the meta device, laid on every mesh of this world and materialised from one seed: only
    this rank's shards allocated, the same global weights as one process materialising it, and 3 training steps
    equal to that process's."""
    failures: list[str] = []
    meshes = {2: [dict(ep=2)], 4: [dict(ep=2, dp_shard=2), dict(ep=4)]}[world]
    ref_init = meta_gpt()
    materialize(ref_init, seed=SEED, init=ref_init.init_module)
    ref_losses = train_reference(ref_init, world, 3)
    fresh = meta_gpt()
    materialize(fresh, seed=SEED, init=fresh.init_module)
    total = sum(4 * p.numel() for p in fresh.parameters())
    largest = max(4 * p.numel() for p in fresh.parameters())
    for sizes in meshes:
        tag = "meta " + "x".join(f"{k}={v}" for k, v in sizes.items())
        model = parallelize(meta_gpt(), make_mesh(**sizes))
        if not all(p.is_meta for p in model.parameters()):
            failures.append(f"{tag}: parallelize allocated parameters of a meta model")
        materialize(model, seed=SEED, init=model.init_module)
        held = local_state_bytes(model)
        if held > 1.1 * total / world + largest:
            failures.append(f"{tag}: holds {held} parameter bytes of {total} over {world} ranks")
        compare_run(f"{tag} initial", [], [], fresh, model, rank, sizes.get("ep", 1), failures)
        losses, _ = train_parallel(model, rank, 3)
        compare_run(f"{tag} trained", ref_losses, losses, ref_init, model, rank, sizes.get("ep", 1), failures)
        out["cases"] = out.get("cases", 0) + 1
    out["failures"] = failures


# About 2.1 billion parameters, nearly all in experts (a DeepSeek-V3-like share: 128 experts per layer, k=8).
BIG = dict(vocab_size=256, block_size=16, n_layer=8, n_head=8, n_embd=1024, num_experts=128, expert_hidden=1024, k=8,
           moe_every=1)


def scenario_fsdp_big(rank: int, world: int, out: dict) -> None:
    """A ~2B-parameter GPT built on meta and materialised on 4 ranks (ep=2 x dp_shard=2): each rank's peak memory
    up to then (its resident set, torch included) stays below half the model's fp32 size; then a forward runs."""
    import resource

    failures: list[str] = []
    with torch.device("meta"):
        model = GPT(GPTConfig(**BIG))
    params = sum(p.numel() for p in model.parameters())
    model = parallelize(model, make_mesh(ep=2, dp_shard=world // 2))
    materialize(model, seed=SEED, init=model.init_module)
    if any(p.is_meta for p in model.parameters()):
        failures.append("parameters left on meta")
    peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024  # Linux: kilobytes
    x, y = batch(0, rank)
    with torch.no_grad():
        _, loss = model(x, y)
    out.update(params=params, peak_bytes=peak, loss=loss.item(), held=local_state_bytes(model))
    if peak >= 4 * params / 2:
        failures.append(f"peak resident memory {peak / 2**30:.2f} GiB >= half the fp32 model "
                        f"({4 * params / 2 / 2**30:.2f} GiB)")
    out["failures"] = failures


def tiny_hf_config(family: str, vocab_size: int, **overrides):
    """A tiny HF config of ``family``: Qwen3-MoE (8 experts, k=2) or DeepSeek-V3 (8 experts in 4 groups, 2 groups
    per token, a shared expert, a selection bias, scaled weights); ``overrides`` on top."""
    import transformers

    common = dict(vocab_size=vocab_size, hidden_size=16, num_hidden_layers=2, num_attention_heads=2,
                  num_key_value_heads=2, max_position_embeddings=64, tie_word_embeddings=False, bos_token_id=None,
                  eos_token_id=None, pad_token_id=None)
    if family == "qwen3_moe":
        extra = dict(intermediate_size=32, moe_intermediate_size=16, num_experts=8, num_experts_per_tok=2,
                     norm_topk_prob=True, head_dim=8)
    else:
        extra = dict(intermediate_size=32, moe_intermediate_size=16, n_routed_experts=8, num_experts_per_tok=2,
                     n_group=4, topk_group=2, n_shared_experts=1, first_k_dense_replace=0, norm_topk_prob=True,
                     routed_scaling_factor=2.5, q_lora_rank=None, kv_lora_rank=8, qk_rope_head_dim=4,
                     qk_nope_head_dim=4, v_head_dim=8, rope_parameters={"rope_type": "default", "rope_theta": 1e4})
    return transformers.AutoConfig.for_model(family, **{**common, **extra, **overrides})


def hf_model(family: str, mesh_ep: int | None = None):
    """A tiny converted Hugging Face model of ``family`` (:func:`tiny_hf_config`) built from seed 5 (every expert in
    this process), float32."""
    from flexmoe.apps.hf_job import HFJobConfig, build_hf_model

    config = tiny_hf_config(family, CFG["vocab_size"])
    model, _ = build_hf_model(HFJobConfig(hf_config=config.to_dict(), block_size=SEQ), seed=5, pretrained=False,
                              group="single")
    g = torch.Generator().manual_seed(9)
    for layer in model.moe_layers:
        if layer.expert_bias is not None:  # DeepSeek-V3's selection bias, fixed (HF's), from random values
            layer.expert_bias.copy_(torch.randn(layer.expert_bias.shape, generator=g) * 0.05)
    return model


def scenario_fsdp_hf(rank: int, world: int, out: dict) -> None:
    """Converted Qwen3-MoE and DeepSeek-V3 models laid on ep=2 (and ep=2 x dp_shard=2 at 4 ranks): 5 AdamW steps
    equal one process's losses and weights, each rank's state within the bound."""
    failures: list[str] = []
    meshes = {2: [dict(ep=2)], 4: [dict(ep=2, dp_shard=2)]}[world]
    for family in ("qwen3_moe", "deepseek_v3"):
        ref = hf_model(family)
        ref_losses = train_reference(ref, world, 5)
        for sizes in meshes:
            tag = f"{family} " + "x".join(f"{k}={v}" for k, v in sizes.items())
            model = parallelize(hf_model(family), make_mesh(**sizes))
            losses, opt = train_parallel(model, rank, 5)
            compare_run(tag, ref_losses, losses, ref, model, rank, sizes["ep"], failures)
            out.setdefault("state_bytes", {})[tag] = local_state_bytes(model, opt)
            out.setdefault("bound", {})[tag] = state_bound(ref, world)
            out["cases"] = out.get("cases", 0) + 1
    out["failures"] = failures


def scenario_fsdp_features(rank: int, world: int, out: dict) -> None:
    """Options that change no layout, under parallelize (ep=2): still one process's numbers."""
    from flexmoe.parallel import ShadowExperts

    failures: list[str] = []
    cases = {
        "r=0": dict(r=0),
        "overlap_degree=2": dict(overlap_degree=2),
        "shadow": dict(shadow=ShadowExperts([0, 5])),
        "pairwise": dict(schedule="pairwise"),
        "auto": dict(parallel="auto"),
        "bias balance, sigmoid": dict(balance="bias", score_func="sigmoid"),
        "dropless": dict(capacity_factor=0.0),
    }
    for tag, options in cases.items():
        check_mesh(tag, rank, world, dict(ep=2), out, failures, steps=3, **options)
    out["failures"] = failures


def scenario_fsdp_compile(rank: int, world: int, out: dict) -> None:
    """torch.compile applied per block to the GPT laid on ep=2: 3 AdamW steps equal one eager process's."""
    failures: list[str] = []
    ref = with_layer_options(gpt())
    ref_losses = train_reference(ref, world, 3)
    model = parallelize(with_layer_options(gpt()), make_mesh(ep=2))
    for block in model.blocks:
        block.compile(backend=COMPILE_BACKEND)
    losses, _ = train_parallel(model, rank, 3)
    compare_run(f"compiled ({COMPILE_BACKEND})", ref_losses, losses, ref, model, rank, 2, failures)
    out["cases"] = 1
    out["failures"] = failures


def scenario_fsdp_errors(rank: int, world: int, out: dict) -> None:
    """What parallelize refuses, with errors naming the combination."""
    failures: list[str] = []

    def expect(tag: str, exc: type, words: tuple[str, ...], fn) -> None:
        try:
            fn()
        except exc as e:
            if not all(w in str(e) for w in words):
                failures.append(f"{tag}: message lacks {words}: {e}")
        except Exception as e:  # noqa: BLE001 - any other type is the failure reported
            failures.append(f"{tag}: raised {type(e).__name__} instead of {exc.__name__}: {e}")
        else:
            failures.append(f"{tag}: no error")

    expect("bias balance with dp", ValueError, ("balance='bias'", "dp_shard"),
           lambda: parallelize(with_layer_options(gpt(), balance="bias"), make_mesh(ep=1, dp_shard=world)))
    expect("float64 reduction over one-rank groups", ValueError, ("float64", "dp_shard=1 and ep=1"),
           lambda: parallelize(gpt().double(), make_mesh(ep=1, dp_shard=1, dp_replicate=world)))
    expect("float16 reduction of experts over one rank", ValueError, ("float16", "experts sharded over one rank"),
           lambda: parallelize(gpt(), make_mesh(ep=world),
                               mp_policy=MixedPrecisionPolicy(param_dtype=torch.float16)))
    expect("not a mesh", TypeError, ("mesh",), lambda: parallelize(gpt(), "ep=2"))
    expect("mesh size", ValueError, ("world has",), lambda: make_mesh(ep=3, dp_shard=1))
    expect("experts not divisible", ValueError, ("num_experts",),
           lambda: parallelize(gpt(num_experts=3, k=1), make_mesh(ep=2)))
    out["failures"] = failures


def scenario_fsdp_overlap(rank: int, world: int, out: dict) -> None:
    """The collectives overlapped on gloo (flexmoe.sharding.fsdp_overlap) at ep=world: in place on every parameter
    group FSDP reduce-scatters; the gradients present when ``backward()`` returns are one process's (their
    reduce-scatters were deferred to the end of backward, then divided); and micro-batches accumulated into existing
    gradients (a reduce-scatter that must not be deferred) train like one process accumulating the same ones."""
    failures: list[str] = []
    model = parallelize(gpt(), make_mesh(ep=world))
    comms = [group._reduce_scatter_comm for module in model.modules() if isinstance(module, FSDPModule)
             for group in module._get_fsdp_state()._fsdp_param_groups]
    if not comms or not all(isinstance(c, DeferredReduceScatter) for c in comms):
        failures.append(f"reduce-scatters not deferred: {[type(c).__name__ for c in comms]}")

    ref = gpt()
    total = torch.zeros((), dtype=DTYPE)
    for j in range(world):
        _, loss = ref(*batch(0, j))
        total = total + (loss + ref.regularization_loss()) / world
    total.backward()
    _, loss = model(*batch(0, rank))
    (loss + model.regularization_loss()).backward()
    for name, p in model.named_parameters():
        got = p.grad.full_tensor() if isinstance(p.grad, DTensor) else p.grad
        want = expected_shard(ref, name, world, rank, grad=True)
        if not torch.allclose(got, want, rtol=TOL, atol=TOL):
            failures.append(f"gradient of {name} after backward differs by {(got - want).abs().max().item():.3g}")

    micro, steps = 2, 3
    ref, model = gpt(), parallelize(gpt(), make_mesh(ep=world))
    ref_opt = torch.optim.AdamW(ref.parameters(), lr=LR, eps=EPS)
    opt = torch.optim.AdamW(model.parameters(), lr=LR, eps=EPS)
    for step in range(steps):
        ref_opt.zero_grad()
        opt.zero_grad()
        for m in range(micro):
            total = torch.zeros((), dtype=DTYPE)
            for j in range(world):
                _, loss = ref(*batch(micro * step + m, j))
                total = total + (loss + ref.regularization_loss()) / (world * micro)
            total.backward()
            _, loss = model(*batch(micro * step + m, rank))
            ((loss + model.regularization_loss()) / micro).backward()
        ref_opt.step()
        opt.step()
    compare_run(f"{micro} micro-batches", [], [], ref, model, rank, world, failures)
    out["failures"] = failures


def scenario_fsdp_mixed_precision(rank: int, world: int, out: dict) -> None:
    """FSDP2's mixed precision passed through parallelize (bf16 parameters, fp32 reduction) at ep=world, where no
    other rank holds a rank's experts: every MoE layer, its experts included, computes in bf16 while the sharded
    parameters and their gradients stay float32; the gradients are one process's computing each rank's batch with
    bf16 copies of the weights and averaging them in float32; 3 AdamW steps track that process."""
    failures: list[str] = []
    policy = MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.float32)
    model = parallelize(gpt(), make_mesh(ep=world), mp_policy=policy)
    seen: set[tuple[torch.dtype, torch.dtype]] = set()
    for layer in model.moe_layers:
        layer.register_forward_pre_hook(lambda layer, args: seen.add((args[0].dtype, layer.experts.w1.dtype)))
    opt = torch.optim.AdamW(model.parameters(), lr=LR, eps=EPS)
    ref = gpt()
    ref_opt = torch.optim.AdamW(ref.parameters(), lr=LR, eps=EPS)
    for step in range(3):
        ref_losses = _bf16_reference_gradients(ref, step, world)
        logits, loss = model(*batch(step, rank))
        (loss + model.regularization_loss()).backward()
        if logits.dtype != torch.bfloat16:
            failures.append(f"logits computed in {logits.dtype}")
        if abs(loss.item() - ref_losses[rank]) > 0.05:  # a few bf16 steps at a loss of ~3.5
            failures.append(f"step {step}: loss {loss.item()} vs the bf16 reference's {ref_losses[rank]}")
        if step == 0:
            for name, p in model.named_parameters():
                got = p.grad.full_tensor() if isinstance(p.grad, DTensor) else p.grad
                want = expected_shard(ref, name, world, rank, grad=True)
                if p.dtype != torch.float32 or got.dtype != torch.float32:
                    failures.append(f"{name}: parameter {p.dtype}, gradient {got.dtype}; float32 expected")
                elif (got - want).abs().max() > 0.05 * want.abs().max() + 1e-6:  # bf16 rounding, summed otherwise
                    failures.append(f"gradient of {name} differs by {(got - want).abs().max().item():.3g} "
                                    f"(largest {want.abs().max().item():.3g})")
        opt.step()
        ref_opt.step()
        opt.zero_grad()
        ref_opt.zero_grad()
    if seen != {(torch.bfloat16, torch.bfloat16)}:
        failures.append(f"MoE layers saw (input, expert weight) dtypes {seen}, expected bf16 for both")
    out["failures"] = failures


def _bf16_reference_gradients(master: GPT, step: int, world: int) -> list[float]:
    """Set ``master``'s gradients to the mean over ranks of each rank's batch's gradient computed by a bf16 copy of
    it, cast to float32 (what FSDP's bf16 parameters with float32 reduction compute); the ranks' losses."""
    work = copy.deepcopy(master).to(torch.bfloat16)
    grads = {name: torch.zeros_like(p) for name, p in master.named_parameters()}
    losses = []
    for j in range(world):
        work.zero_grad(set_to_none=True)
        _, loss = work(*batch(step, j))
        loss = loss + work.regularization_loss()
        loss.backward()
        losses.append(loss.item())
        for name, p in work.named_parameters():
            grads[name] += p.grad.float() / world
    for name, p in master.named_parameters():
        p.grad = grads[name]
    return losses


# --- DCP checkpoints: save at one mesh, load at others (each a separate group of processes) -----------------------

# The experts' kernel every side of a DCP check evaluates with: embedding_bag computes each row as a bag of its
# own, so a row's output does not depend on the other rows of its expert in the call. A matmul's does: MKL's sgemm
# (AVX-512, torch 2.13) rounds the rows of a 1-3 row product otherwise than the same rows among 4 or more, and one
# process gives an expert only its own batch's rows where an expert-parallel rank gets every rank's (2 against 4).
ROW_BY_ROW_KERNEL = "embedding_bag"


def _logits_and_moment(model, opt, expert_kernel: str | None = ROW_BY_ROW_KERNEL) -> dict:
    """The logits of a fixed batch (evaluation) and this rank's share of sum(exp_avg^2) over every parameter.

    expert_kernel: the kernel the model's experts are forced to from now on (None: their own choosers')."""
    if expert_kernel is not None:
        for layer in model.moe_layers:
            layer.experts.kernels = KernelChooser(expert_kernel, timer=None)
    x, _ = batch(99, 0)
    model.eval()
    with torch.no_grad():
        logits, _ = model(x)
    model.train()
    square = 0.0
    # The optimizer's parameters (the sharded ones): after a forward, FSDP keeps the root's gathered ones in the model.
    for p in (p for group in opt.param_groups for p in group["params"]):
        m = opt.state[p].get("exp_avg")
        if m is None:  # a parameter without a gradient yet (no tokens reached it) has no state
            continue
        local = m.to_local() if isinstance(m, DTensor) else m
        square += float(local.double().square().sum())
    return {"logits": logits.tolist(), "exp_avg_square": square}


def dcp_save_main(directory: str, ep: int, dp_shard: int) -> dict:
    """A rank of a run on ep x dp_shard: 3 training steps, then a DCP checkpoint of model and optimizer."""
    import torch.distributed as dist

    from flexmoe.sharding import save_sharded

    torch.set_num_threads(1)
    from multiproc import kernels_by_rule

    kernels_by_rule()
    dist.init_process_group("gloo")
    try:
        mesh = make_mesh(ep=ep, dp_shard=dp_shard)
        model = parallelize(gpt(), mesh)
        _, opt = train_parallel(model, dist.get_rank(), 3)
        save_sharded(directory, model, opt, mesh=mesh)
        return _logits_and_moment(model, opt)
    finally:
        dist.destroy_process_group()


def dcp_load_main(directory: str, ep: int) -> dict:
    """A rank of a run on ep ranks that loads the checkpoint into a differently seeded model."""
    import torch.distributed as dist

    from flexmoe.sharding import load_sharded

    torch.set_num_threads(1)
    from multiproc import kernels_by_rule

    kernels_by_rule()
    dist.init_process_group("gloo")
    try:
        mesh = make_mesh(ep=ep)
        model = parallelize(gpt(seed=99), mesh)
        opt = torch.optim.AdamW(model.parameters(), lr=LR, eps=EPS)
        load_sharded(directory, model, opt, mesh=mesh)
        return _logits_and_moment(model, opt)
    finally:
        dist.destroy_process_group()


SCENARIOS = {
    "fsdp_gpt": scenario_fsdp_gpt,
    "fsdp_features": scenario_fsdp_features,
    "fsdp_meta": scenario_fsdp_meta,
    "fsdp_hf": scenario_fsdp_hf,
    "fsdp_big": scenario_fsdp_big,
    "fsdp_errors": scenario_fsdp_errors,
    "fsdp_compile": scenario_fsdp_compile,
    "fsdp_overlap": scenario_fsdp_overlap,
    "fsdp_mixed_precision": scenario_fsdp_mixed_precision,
}
