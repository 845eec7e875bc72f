"""What Tutel's helloworld examples share: their flags, the MoE layer, the data, the training step and the lines
they print. Each ``helloworld*.py`` imports this module (its own directory is on ``sys.path`` when run as a
script) and keeps only what makes it different.
"""

import argparse
import os

import torch
import torch.nn.functional as F

from flexmoe.compat.tutel import moe as tutel_moe  # Tutel: from tutel import moe as tutel_moe, net, system
from flexmoe.compat.tutel import net, system

DTYPES = {"float32": torch.float32, "float64": torch.float64, "float16": torch.float16, "bfloat16": torch.bfloat16}

# Every flag of Tutel's helloworld examples, with Tutel's defaults; a script accepts the ones it names.
ARGUMENTS = {
    "local_rank": dict(type=int, default=-1),
    "batch_size": dict(type=int, default=16),
    "num_tokens": dict(type=int, default=512),
    "model_dim": dict(type=int, default=2048),
    "hidden_size": dict(type=int, default=2048),
    "num_local_experts": dict(type=int, default=2),
    "dtype": dict(type=str, default="float32", choices=sorted(DTYPES)),
    "fp32_gate": dict(default=False, action="store_true"),
    "top": dict(type=int, default=2),
    "l_aux_wt": dict(type=float, default=0.0),
    "a2a_ffn_overlap_degree": dict(type=int, default=1),
    "allreduce_degree": dict(type=int, default=1),
    "num_steps": dict(type=int, default=100),
    "parallel_type": dict(type=str, default="adaptive:1"),
    "cap_factor": dict(type=float, default=1.0),
    "checkpoint_path": dict(type=str, default=""),
    "device": dict(type=str, default="cuda" if torch.cuda.is_available() else "cpu"),
    "use_2dh": dict(default=False, action="store_true"),
    "eval": dict(default=False, action="store_true"),
    "capacity_factor": dict(type=float, default=1.0),  # 0: dropless; < 0: dropless up to |cf|
    "megablocks_size": dict(type=int, default=0),
    "use_tensorcore": dict(default=False, action="store_true"),
    "expert_type": dict(type=str, default="ffn"),
}


def parse_args(description: str, names: list[str], **overrides: dict) -> argparse.Namespace:
    """The command line of a script taking the flags ``names`` (in that order); ``overrides`` replace a flag's
    settings (e.g. ``dtype=dict(type=str, default="float32")``)."""
    parser = argparse.ArgumentParser(description=description)
    for name in names:
        parser.add_argument(f"--{name}", **overrides.get(name, ARGUMENTS[name]))
    return parser.parse_args()


def init(args: argparse.Namespace):
    """Tutel's session on the backend ``--device`` asks for, with ``--dtype`` as the default dtype.

    Returns ``(env, rank, world, dist_print, device)``."""
    env = system.init_data_model_parallel(backend="nccl" if args.device == "cuda" else "gloo")
    torch.set_default_dtype(DTYPES[args.dtype])
    return env, env.global_rank, env.global_size, env.dist_print, env.local_device


def moe_layer(args: argparse.Namespace, rank: int, dist_print=None, gate_type: dict | None = None,
              experts: dict | None = None, **options):
    """The examples' layer: top-``--top`` gate and ReLU FFN experts unless ``gate_type``/``experts`` say
    otherwise, weights from ``seeds = (1, rank + 1, 1)``; prints Tutel's ``[Statistics]`` line if ``dist_print``."""
    layer = tutel_moe.moe_layer(
        gate_type=gate_type or {"type": "top", "k": args.top, "fp32_gate": args.fp32_gate},
        experts=experts or {"type": "ffn", "num_experts_per_device": args.num_local_experts,
                            "hidden_size_per_expert": args.hidden_size, "activation_fn": lambda h: F.relu(h)},
        model_dim=args.model_dim,
        # Expert parameters differ per rank: the data-parallel gradient average leaves them alone.
        scan_expert_func=lambda name, param: setattr(param, "skip_allreduce", True),
        seeds=(1, rank + 1, 1),
        a2a_ffn_overlap_degree=args.a2a_ffn_overlap_degree,
        **options,
    )
    if dist_print is not None:
        experts_count = sum(p.numel() for _, p in layer.get_parameter_iterator(param_type="local_experts"))
        gate_count = sum(p.numel() for _, p in layer.get_parameter_iterator(param_type="gate"))
        dist_print(f"[Statistics] param count for MoE local_experts = {experts_count}, "
                   f"param count for MoE gate = {gate_count}.\n")
    return layer


def sample_batch(args: argparse.Namespace, device) -> tuple[torch.Tensor, torch.Tensor]:
    """``x ~ N(0, 1)``: ``[batch_size, num_tokens, model_dim]`` drawn after ``torch.manual_seed(0)`` in the
    default dtype, and the target: token 0 of every sample."""
    torch.manual_seed(0)
    x = torch.randn(args.batch_size, args.num_tokens, args.model_dim, dtype=torch.float32).to(
        device=device, dtype=torch.get_default_dtype())
    target = torch.zeros(args.batch_size, dtype=torch.long, device=device)
    return x, target


def print_benchmark(dist_print, args: argparse.Namespace, world: int, device) -> None:
    """Tutel's ``[Benchmark]`` line; ``hidden_size`` and ``parallel_type`` appear where the script has them."""
    fields = [f"world_size = {world}", f"dtype = {args.dtype}", f"model_dim = {args.model_dim}"]
    if hasattr(args, "hidden_size"):
        fields.append(f"hidden_size = {args.hidden_size}")
    fields += [f"samples = {args.batch_size * args.num_tokens}", f"num_local_experts = {args.num_local_experts}",
               f"topK = {args.top}", f"a2a_ffn_overlap_degree = {args.a2a_ffn_overlap_degree}"]
    if hasattr(args, "parallel_type"):
        fields.append(f"parallel_type = `{args.parallel_type}`")
    fields.append(f"device = `{device}`")
    dist_print("[Benchmark] " + ", ".join(fields))


def shared_params(model: torch.nn.Module) -> list[torch.nn.Parameter]:
    """The parameters every rank holds a copy of (not the experts): their gradients are averaged over ranks."""
    return [p for p in model.parameters() if not hasattr(p, "skip_allreduce") and p.requires_grad]


def global_experts(args: argparse.Namespace) -> int:
    return tutel_moe.moe_layer.global_expert_count(args.num_local_experts,
                                                   group=system.get_local_session().model_group)


def average_gradients(params: list[torch.nn.Parameter], world: int) -> None:
    for p in params if world > 1 else []:
        p.grad = net.simple_all_reduce(p.grad / world)


def train_step(model, layer, optimizer, x, target, args, params, world) -> torch.Tensor:
    """One step of NLL of token 0 (plus ``l_aux_wt * l_aux``), gradients of ``params`` averaged over ranks;
    with ``--eval`` only the forward pass. Returns the loss."""
    if args.eval:
        with torch.no_grad():
            return F.nll_loss(model(x), target)
    optimizer.zero_grad()
    loss = F.nll_loss(model(x), target)
    if args.l_aux_wt:
        loss = loss + args.l_aux_wt * layer.l_aux
    loss.backward()
    average_gradients(params, world)
    optimizer.step()
    return loss


def start_run(model: torch.nn.Module, args: argparse.Namespace, world: int, device, dist_print,
              ) -> tuple[torch.optim.Optimizer, torch.Tensor, torch.Tensor, list[torch.nn.Parameter]]:
    """What every helloworld does before its steps: SGD at lr 1e-5 over ``model``, the sampled batch ``x``,
    ``target`` and the ``[Benchmark]`` line; returns them with the parameters whose gradients are averaged over
    ranks (none with ``--allreduce_degree -1``)."""
    optimizer = torch.optim.SGD(model.parameters(), lr=1e-5)
    x, target = sample_batch(args, device)
    print_benchmark(dist_print, args, world, device)
    params = [] if getattr(args, "allreduce_degree", None) == -1 else shared_params(model)
    return optimizer, x, target, params


def print_step(dist_print, args: argparse.Namespace, step: int, loss: torch.Tensor, seconds: float,
               num_global_experts: int, suffix: str = "") -> None:
    """Tutel's ``STEP-i`` line: the loss, the time and the expert GEMMs' rate."""
    passes = 1 if getattr(args, "eval", False) else 3  # forward, or forward + two backward GEMMs
    flops = args.batch_size * args.num_tokens * args.model_dim * args.hidden_size * 4 * passes \
        * min(args.top, num_global_experts)
    dist_print("STEP-%s: loss = %.5f, step_time = %.6f sec, perf = %.2f tflops.%s"
               % (step, float(loss.detach()), seconds, flops * 1e-12 / seconds, suffix))


def print_summary(dist_print, last_times: list[float]) -> None:
    dist_print(f"\n[Summary] Average synchronized step_time = {sum(last_times) / 10} sec.")


def train(model, layer, args: argparse.Namespace, world: int, device, dist_print, step_note=lambda: "") -> None:
    """helloworld's run: SGD on the sampled batch for ``--num_steps`` steps (``--allreduce_degree -1``: no
    gradient averaging), a ``STEP-i`` line each (``step_note()`` appended) and the ``[Summary]`` line."""
    optimizer, x, target, params = start_run(model, args, world, device, dist_print)
    num_global_experts = global_experts(args)
    last_times: list[float] = []
    for step in range(args.num_steps):
        t_start = system.record_time()
        loss = train_step(model, layer, optimizer, x, target, args, params, world)
        t_stop = system.record_time()
        print_step(dist_print, args, step, loss, t_stop - t_start, num_global_experts, step_note())
        last_times = (last_times + [t_stop - t_start])[-10:]
    print_summary(dist_print, last_times)


def load_checkpoint(model: torch.nn.Module, args: argparse.Namespace, rank: int, world: int) -> str:
    """This rank's ``--checkpoint_path`` (``{rank}``/``{size}`` filled in), loaded into ``model`` if it exists;
    returns the path ("" without the flag) for the final save."""
    if not args.checkpoint_path:
        return ""
    checkpoint_path = system.apply_rank_size_from_pattern(args.checkpoint_path, rank=rank, size=world)
    if os.path.exists(checkpoint_path):
        model.load_state_dict(torch.load(checkpoint_path, weights_only=True))
    else:
        print(f"Checkpoint not loaded: file `{checkpoint_path}` is not found. Will train the model from start.")
    return checkpoint_path
