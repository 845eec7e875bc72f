"""One rank of the 2-rank kernel-chooser case in tests/test_expert_kernels.py (run by flexmoe.launch.spawn_ranks):
the ranks' fake timers disagree, and they must still choose alike."""

from __future__ import annotations

import datetime
import traceback


def rank_main() -> dict:
    """Join the gloo group, calibrate one case with this rank's fake timer, share a table, build a layer; report
    what each step chose."""
    import torch
    import torch.distributed as dist

    from flexmoe import MoELayer
    from flexmoe.experts.chooser import KernelChooser
    from flexmoe.experts.weights import ExpertWeights

    torch.set_num_threads(1)
    dist.init_process_group("gloo", timeout=datetime.timedelta(seconds=30))
    rank = dist.get_rank()
    out: dict = {"rank": rank, "failures": []}
    try:
        # Rank 0 finds the loop fastest on its own, rank 1 the hand-written backward: summed over both ranks the
        # loop (1 + 5 = 6 s) beats segmented (5 + 2 = 7 s).
        own = [{"loop": 1.0, "segmented": 5.0}, {"loop": 5.0, "segmented": 2.0}][rank]

        def timer(name: str, run: object) -> float:
            return own.get(name, 100.0)

        gen = torch.Generator().manual_seed(0)
        weights = ExpertWeights(torch.randn(4, 8, 16, generator=gen).requires_grad_(), None,
                                torch.randn(4, 16, 8, generator=gen).requires_grad_(), None, None, None,
                                torch.nn.functional.gelu)
        rows = torch.randn(10, 8, generator=gen)
        chooser = KernelChooser(timer=timer)
        out["calibrated"] = chooser.calibrate([(rows, [3, 0, 5, 2], weights)], group=dist.group.WORLD)

        # share: rank 0's table reaches rank 1, which measured nothing.
        sharer = KernelChooser(timer=None)
        if rank == 0:
            sharer.decisions["cpu/float32/train/E4/M8/H16/ffn/N16/A4"] = "segmented"
        sharer.share(dist.group.WORLD)
        out["shared"] = dict(sharer.decisions)
        out["shared_times_calls"] = sharer.times_calls

        layer = MoELayer(8, 4, 16, k=2)  # expert parallel over the world: its experts take rank 0's table
        out["layer_times_calls"] = layer.experts.kernels.times_calls
    except Exception:
        out["failures"].append(traceback.format_exc())
    dist.destroy_process_group()
    return out
