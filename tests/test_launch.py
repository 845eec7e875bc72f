"""flexmoe.launch.spawn_ranks with real processes: per-rank results, a failing rank, a hanging group.

The rank functions are in tests/launch_worker.py: module-level, so the spawned ranks import them (its folder
goes on their sys.path), and torch-free, so a launch costs no torch import.
"""

from __future__ import annotations

import os
import random
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

import pytest

from flexmoe.launch import RanksFailed, free_port, rank_env, spawn_ranks
from flexmoe_cli import child_pythonpath
from launch_worker import last_rank_fails, master_port_is_served, report_env, sleep_long


def test_free_port_can_be_bound() -> None:
    port = free_port()
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", port))
    assert rank_env(1, 4, port)["RANK"] == "1"


def test_free_port_lies_below_the_ports_the_kernel_hands_out() -> None:
    """A port bound to 0 (gloo, outgoing connections) comes from the ephemeral range; free_port's comes from
    below it where there is room, so nothing launched meanwhile takes it by chance."""
    path = Path("/proc/sys/net/ipv4/ip_local_port_range")
    first = int(path.read_text().split()[0]) if path.exists() else None
    ports = [free_port(random.Random(seed)) for seed in range(5)]
    if first is None or first < 11000:  # no range to read, or no room below it: the kernel's own choice
        assert all(0 < p < 65536 for p in ports), ports
        return
    assert all(10000 <= p < first for p in ports), ports
    assert len(set(ports)) > 1, "the port is not drawn at random"
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as taken:  # a taken port is passed over
        taken.bind(("127.0.0.1", ports[0]))
        taken.listen()
        assert free_port(random.Random(0)) != ports[0]


def test_every_rank_gets_its_environment_and_returns_its_value() -> None:
    ranks = spawn_ranks(3, report_env, ["x"], timeout=60)
    assert [r.rank for r in ranks] == [0, 1, 2] and all(r.ok for r in ranks)
    ports = {r.value["MASTER_PORT"] for r in ranks}
    assert len(ports) == 1, f"the ranks got different ports: {ports}"
    port = ports.pop()
    for r in ranks:
        assert r.value == {"tag": "x", "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": port, "RANK": str(r.rank),
                           "WORLD_SIZE": "3", "LOCAL_RANK": str(r.rank), "LOCAL_WORLD_SIZE": "3",
                           "OMP_NUM_THREADS": "1", "TORCHELASTIC_USE_AGENT_STORE": "True"}, f"rank {r.rank}: {r.value}"


def test_the_rendezvous_port_is_served_before_any_rank_starts() -> None:
    """The launcher serves the store itself, so no other process can take its port in the seconds before rank 0
    would have bound it (concurrent groups, as under pytest-xdist); the ranks join a real gloo group on it."""
    assert [r.value for r in spawn_ranks(2, master_port_is_served, timeout=60)] == [True, True]
    # The destroy is part of the contract, not tidiness: a gloo rank that exits with its group alive aborts now
    # and then ("terminate called without an active exception", -6), with any store.
    code = ("import torch, torch.distributed as dist; dist.init_process_group('gloo'); "
            "t = torch.tensor([dist.get_rank() + 1.0]); dist.all_reduce(t); print(t.item()); "
            "dist.destroy_process_group()")
    assert [r.stdout for r in spawn_ranks(3, ["-c", code], timeout=120)] == ["6.0\n"] * 3


def test_a_python_command_runs_as_every_rank() -> None:
    ranks = spawn_ranks(2, ["-c", "import os, sys; print(os.environ['RANK'], sys.argv[1])", "hello"], timeout=60)
    assert [r.stdout for r in ranks] == ["0 hello\n", "1 hello\n"]
    assert [r.value for r in ranks] == [None, None]


def test_a_function_of_a_script_imports_the_modules_beside_the_script(tmp_path: Path) -> None:
    """A benchmark script whose rank function uses a module in the script's folder (benchmarks/replicas_skew.py
    uses benchmarks/fastermoe.py): the ranks import it as the script itself does."""
    (tmp_path / "beside.py").write_text("def answer() -> int:\n    return 41\n")
    (tmp_path / "script.py").write_text(
        "from beside import answer\n"
        "from flexmoe.launch import spawn_ranks\n\n\n"
        "def rank_value() -> int:\n    return answer() + 1\n\n\n"
        "if __name__ == '__main__':\n    print([r.value for r in spawn_ranks(1, rank_value, timeout=60)])\n")
    env = {**os.environ, "PYTHONPATH": child_pythonpath(Path(__file__).parents[1] / "src")}
    out = subprocess.run([sys.executable, str(tmp_path / "script.py")], capture_output=True, text=True,
                         timeout=120, cwd=tmp_path.parent, env=env)
    assert out.returncode == 0 and out.stdout == "[42]\n", out.stderr[-3000:]


def test_a_failing_rank_ends_the_group_with_its_stderr() -> None:
    # The other ranks sleep 600 s and the group's timeout is 300 s: only the kill after the grace second ends it
    # in less (the bound leaves a loaded machine minutes to start three Pythons).
    t0 = time.monotonic()
    with pytest.raises(RanksFailed, match=r"(?s)3 ranks failed: rank 2 exited with 1.*about to fail.*the last rank is"):
        spawn_ranks(3, last_rank_fails, timeout=300, grace=1.0)
    assert time.monotonic() - t0 < 200, "the other ranks were not killed soon after the failure"
    results = spawn_ranks(3, last_rank_fails, timeout=300, grace=1.0, check=False)
    assert [r.exit_code for r in results] == [None, None, 1]  # None: killed


def test_a_hanging_group_is_killed_at_the_timeout_and_says_where_it_hung() -> None:
    # 10 s: time for both ranks to start and reach sleep_long on a loaded machine (at 2 s a rank still starting
    # had no stack to show); they sleep 600 s, so an end before 200 s is the timeout's kill.
    t0 = time.monotonic()
    with pytest.raises(RanksFailed, match="sleepers did not finish in 10 s") as failed:
        spawn_ranks(2, sleep_long, timeout=10, what="sleepers")
    assert time.monotonic() - t0 < 200
    if hasattr(signal, "SIGUSR1"):  # each rank's Python stack, dumped before the kill, names the hanging call
        assert 'in sleep_long' in str(failed.value)
        assert all('in sleep_long' in r.stderr for r in failed.value.results)


def test_bad_arguments() -> None:
    def local() -> None:
        pass

    with pytest.raises(ValueError, match="module-level function"):
        spawn_ranks(2, local)
    with pytest.raises(ValueError, match="world must be >= 1"):
        spawn_ranks(0, sleep_long)


# launch_ranks (what `flexmoe train --nproc N` runs), in a subprocess: it writes to the terminal's stderr.
_LAUNCH = "import sys; from flexmoe.launch import launch_ranks; sys.exit(launch_ranks(2, sys.argv[2:], grace=1.0))"
# A rank program: the other rank writes one line, says so in file READY and waits (a collective with a dead peer,
# as far as the launcher can tell); rank FAILING, once READY exists (else the launcher could kill the other rank
# before its line), writes a progress line without its newline, then a traceback.
_RANK = """import os, sys, time
rank, ready = int(os.environ["RANK"]), sys.argv[2]
if rank == int(sys.argv[1]):
    deadline = time.monotonic() + 120
    while not os.path.exists(ready) and time.monotonic() < deadline:
        time.sleep(0.01)
    sys.stderr.write("step 3/10\\r"); sys.stderr.flush(); time.sleep(0.3)
    raise ValueError(f"boom on rank {rank}")
print(f"rank {rank} waiting", file=sys.stderr, flush=True)
open(ready, "w").close()
time.sleep(600)
"""


@pytest.mark.parametrize("failing", [0, 1])
def test_launched_ranks_fail_as_one_line_naming_the_first_failing_rank(failing: int, tmp_path: Path) -> None:
    # The waiting rank sleeps 600 s: an end within 200 s (time for a loaded machine to import flexmoe and start
    # two Pythons) is the launcher's kill after the grace second.
    t0 = time.monotonic()
    proc = subprocess.run([sys.executable, "-c", _LAUNCH, "-", "-c", _RANK, str(failing), str(tmp_path / "ready")],
                          capture_output=True, text=True, timeout=300)
    assert time.monotonic() - t0 < 200, "the other rank was not killed soon after the failure"
    assert proc.returncode == 1
    lines = [line for line in proc.stderr.replace("\r", "\n").splitlines() if line.strip()]
    # Rank 0's own output passes through (its progress included); no traceback reaches the terminal.
    shown = ["step 3/10"] if failing == 0 else ["rank 0 waiting"]
    assert lines[:-1] == shown, proc.stderr
    prefix = f"error: rank {failing} of 2 exited with code 1: ValueError: boom on rank {failing} (every rank's stderr: "
    assert lines[-1].startswith(prefix), proc.stderr
    log = Path(lines[-1][len(prefix):-1])
    text = log.read_text()
    log.unlink()
    assert "===== rank 0 stderr =====" in text and "===== rank 1 stderr =====" in text
    assert text.count("Traceback (most recent call last):") == 1 and f"boom on rank {failing}" in text


def test_a_rank_own_error_line_is_the_only_line() -> None:
    """A user error: every rank fails alike, rank 0 prints its one line, the launcher adds nothing."""
    code = "import sys; print('error: --data x: no such file', file=sys.stderr); sys.exit(2)"
    proc = subprocess.run([sys.executable, "-c", _LAUNCH, "-", "-c", code], capture_output=True, text=True, timeout=60)
    assert proc.returncode == 2
    assert proc.stderr == "error: --data x: no such file\n"


def test_a_traceback_marker_split_by_the_pipe_is_still_held_back() -> None:
    from flexmoe.launch import _marker_start_length

    assert _marker_start_length(b"step 3\rTraceb") == len(b"Traceb")
    assert _marker_start_length(b"step 3\r") == 0
    assert _marker_start_length(b"T") == 1
