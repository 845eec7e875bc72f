"""The training step minimises the LM loss plus the router's balance and z losses, not the LM loss alone.

One step of ``flexmoe.apps.train.train`` with plain SGD (lr 1, no clipping) moves every weight by exactly
minus its gradient. The test computes that gradient itself: the same model from the same initial weights, the
router logits caught with forward hooks, and the losses written out here (GShard/Switch balance loss
``E * sum_e f_e * P_e`` per MoE layer, ST-MoE z-loss ``mean(logsumexp(logits)^2)``), then compares.
"""

from __future__ import annotations

from dataclasses import replace

import torch
import torch.nn.functional as F

from flexmoe.apps import train as train_app
from flexmoe.apps import train_loop
from flexmoe.apps.data import TokenData
from flexmoe.apps.models.gpt import GPT, GPTConfig

MODEL = GPTConfig(block_size=16, n_layer=2, n_head=2, n_embd=32, moe_every=1, num_experts=4, expert_hidden=32,
                  k=2, capacity_factor=0.0, aux_loss_coef=0.5, z_loss_coef=0.05)
STEP = train_app.TrainConfig(steps=1, batch_size=4, lr=1.0, min_lr=1.0, warmup=1, grad_clip=0.0, log_every=1,
                             eval_every=1, eval_batches=1, ckpt_every=1, plots=False, progress=False)


def one_training_step(tmp_path, monkeypatch, mcfg: GPTConfig) -> tuple[dict, dict]:
    """The weights before and after one step of the training loop, run with SGD in place of AdamW."""
    seen: dict = {}

    def sgd(model, tcfg):
        seen["model"] = model
        seen["before"] = {n: p.detach().clone() for n, p in model.named_parameters()}
        return torch.optim.SGD(model.parameters(), lr=tcfg.lr)

    monkeypatch.setattr(train_loop, "build_optimizer", sgd)
    train_app.train(mcfg, STEP, tmp_path / "run")
    after = {n: p.detach().clone() for n, p in seen["model"].named_parameters()}
    return seen["before"], after


def reference_gradients(mcfg: GPTConfig, weights: dict) -> tuple[dict, dict]:
    """Gradients of the LM loss alone and of LM + aux_coef * balance + z_coef * z, computed here."""
    model = GPT(mcfg)
    model.load_state_dict(weights)
    logits_of_router: list[torch.Tensor] = []
    for moe in model.moe_layers:
        moe.router.register_forward_hook(lambda _m, _inp, out: logits_of_router.append(out))
    data = TokenData.from_file(None, block_size=mcfg.block_size)
    x, y = data.batch("train", STEP.batch_size, mcfg.block_size, seed=STEP.seed, step=1)
    _, lm = model(x, y)
    assert len(logits_of_router) == len(model.moe_layers) == 2
    balance = z = torch.zeros(())
    for logits in logits_of_router:  # [T, E]
        logits = logits.float()
        probs = logits.softmax(dim=-1)
        e = probs.shape[1]
        first = F.one_hot(probs.argmax(dim=-1), e).float()
        fraction = first.mean(dim=0)  # share of tokens whose first choice is e (a constant)
        balance = balance + e * (fraction * probs.mean(dim=0)).sum()
        z = z + torch.logsumexp(logits, dim=-1).square().mean()
    # The definitions above are the ones the layer reports (same forward, so equal to rounding).
    torch.testing.assert_close(balance, model.aux_loss())
    torch.testing.assert_close(z, model.z_loss())
    params = dict(model.named_parameters())
    lm_only = torch.autograd.grad(lm, list(params.values()), retain_graph=True, allow_unused=True)
    full = torch.autograd.grad(lm + mcfg.aux_loss_coef * balance + mcfg.z_loss_coef * z, list(params.values()),
                               allow_unused=True)
    zero = torch.zeros_like
    return ({n: g if g is not None else zero(p) for (n, p), g in zip(params.items(), lm_only)},
            {n: g if g is not None else zero(p) for (n, p), g in zip(params.items(), full)})


def test_training_step_backpropagates_balance_and_z_losses(tmp_path, monkeypatch) -> None:
    before, after = one_training_step(tmp_path, monkeypatch, MODEL)
    lm_only, full = reference_gradients(MODEL, before)
    stepped = {n: before[n] - after[n] for n in before}  # SGD, lr 1: minus the gradient the loop used
    routers = [n for n in before if n.endswith("router.weight")]
    assert len(routers) == 2
    for n in routers:
        # The regularisers change the router's gradient well beyond float32 noise ...
        assert (full[n] - lm_only[n]).abs().max() > 1e-3 * full[n].abs().max()
        torch.testing.assert_close(stepped[n], full[n], rtol=1e-4, atol=1e-6)
    for n in before:  # ... and every other weight's, through the router's input
        torch.testing.assert_close(stepped[n], full[n], rtol=1e-4, atol=1e-6, msg=lambda m, n=n: f"{n}: {m}")


def test_zero_coefficients_train_on_the_lm_loss_alone(tmp_path, monkeypatch) -> None:
    mcfg = replace(MODEL, aux_loss_coef=0.0, z_loss_coef=0.0)
    before, after = one_training_step(tmp_path, monkeypatch, mcfg)
    lm_only, _ = reference_gradients(mcfg, before)
    for n in before:
        torch.testing.assert_close(before[n] - after[n], lm_only[n], rtol=1e-4, atol=1e-6)
