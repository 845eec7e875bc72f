"""The counter of aten operations and host reads (flexmoe.apps.bench.host_reads): each way of reading the device
from the host is seen, a read-free call is not, and the operation count is the dispatcher's."""

from __future__ import annotations

import torch

from flexmoe.apps.bench.host_reads import OpCounter, count_call, time_calls


def test_every_host_read_is_listed_in_call_order() -> None:
    t = torch.tensor([3, 0, 2, 2])
    with OpCounter() as c:
        t[0].item()
        t.tolist()
        bool(t[1] > 0)
        t.nonzero()
        t[t > 1]
        torch.bincount(t)
        torch.unique(t)
        t.repeat_interleave(t)
        t.repeat_interleave(t, output_size=7)  # sized by the caller: no read
        torch.masked_select(t, t > 0)
    assert c.host_reads == ["_local_scalar_dense", "tolist", "_local_scalar_dense", "nonzero", "index.Tensor",
                            "bincount", "_unique2", "repeat_interleave.Tensor", "masked_select"]


def test_a_call_without_reads_counts_each_operation_once() -> None:
    a, b = torch.randn(4, 3, requires_grad=True), torch.randn(4, 3)
    counted = count_call(lambda: (a * b).sum(1))
    assert counted.host_reads == []
    # forward: mul, sum; backward: the ones, sum's expand, mul by b, and the accumulation into a.grad
    assert counted.by_name["aten.mul.Tensor"] == 2 and counted.by_name["aten.sum.dim_IntList"] == 1
    assert counted.ops == sum(counted.by_name.values())
    assert torch.equal(a.grad, b)


def test_tolist_is_restored_after_the_counter() -> None:
    original = torch.Tensor.tolist
    with OpCounter():
        pass
    assert torch.Tensor.tolist is original and torch.tensor([1]).tolist() == [1]


def test_time_calls_runs_each_call_steps_times_in_turn() -> None:
    """The timed runs alternate between the calls (side by side), the order rotated every step so that none
    always runs first, each forward + backward (or forward only), ``steps`` times."""
    order: list[str] = []
    w = torch.ones(3, requires_grad=True)

    def call(name: str) -> torch.Tensor:
        order.append(name)
        return w * 2

    seconds = time_calls({"a": lambda: call("a"), "b": lambda: call("b"), "c": lambda: call("c")}, steps=4)
    assert order == ["a", "b", "c", "b", "c", "a", "c", "a", "b", "a", "b", "c"]
    assert set(seconds) == {"a", "b", "c"} and all(s > 0 for s in seconds.values())
    assert torch.equal(w.grad, torch.full((3,), 24.0))  # 12 backward passes of d(2w)/dw with a gradient of ones
    time_calls({"a": lambda: call("a")}, steps=2, backward=False)
    assert torch.equal(w.grad, torch.full((3,), 24.0)) and order[-2:] == ["a", "a"]
    del order[:]
    time_calls({"a": lambda: call("a"), "b": lambda: call("b")}, steps=3, rotate=False)  # each after the other
    assert order == ["a", "b", "a", "b", "a", "b"] and torch.equal(w.grad, torch.full((3,), 36.0))


def test_each_read_names_the_flexmoe_module_it_came_from() -> None:
    """The plan's counts (routing.capacity's bincount, read by the plan), then a read outside flexmoe."""
    from flexmoe.routing.capacity import count_per_expert

    with OpCounter() as c:
        count_per_expert(torch.tensor([[0, 2], [2, 1]]), 3).tolist()
        torch.tensor([1]).item()
    assert c.host_reads == ["bincount", "tolist", "_local_scalar_dense"]
    assert c.read_sites == ["flexmoe.routing.capacity", "-", "-"]
