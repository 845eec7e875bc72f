"""Starting N local ranks on 127.0.0.1, the one way the library, its applications, benchmarks and tests do it.

* :func:`relaunch`: ``flexmoe train --nproc N`` and ``flexmoe bench --nproc N`` re-run themselves as N local
  ranks (:func:`launch_ranks`, torchrun's environment without torchrun's report: a failure is one line).
* :func:`spawn_ranks`: N plain subprocesses, each running a module-level function (or ``python ARGS...``) with
  the environment ``torch.distributed``'s ``env://`` rendezvous reads (MASTER_ADDR, MASTER_PORT, RANK,
  WORLD_SIZE, LOCAL_RANK, LOCAL_WORLD_SIZE), the rendezvous store served by the launcher itself; it collects
  each rank's return value, and ends every rank when the time is up or shortly after one of them fails, so a
  broken group never hangs its caller.

Plain subprocesses rather than multiprocessing's spawn: spawn re-imports the caller's ``__main__``, which breaks
when the caller is a script without a ``__main__`` guard or ``python -c``.
"""

from __future__ import annotations

import json
import math
import os
import random
import signal
import socket
import subprocess
import sys
import tempfile
import threading
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path
from types import FrameType
from typing import IO, Any

__all__ = ["free_port", "under_torchrun", "relaunch", "launch_ranks", "rank_env", "spawn_ranks", "RankResult",
           "RanksFailed"]


# Where free_port looks first: below the kernel's ephemeral range, from this port up.
_LOW_PORTS_START = 10000


def free_port(rng: random.Random | None = None) -> int:
    """A TCP port on 127.0.0.1 that nobody listens on right now, for an endpoint two processes must be told
    before either starts (a multi-node rendezvous), so it is bound only later.

    Taken at random below the kernel's ephemeral range (``net.ipv4.ip_local_port_range``, Linux) where there is
    room: a port bound to 0 (gloo's listeners, every outgoing connection, :func:`spawn_ranks`' store) always
    comes from that range, so in the seconds before the port is used only another explicit choice could take it.
    Elsewhere, or when no low port binds, whatever free port the kernel gives. ``rng``: the random source
    (default: a fresh one, seeded by the OS)."""
    rng = rng or random.Random()
    first_ephemeral = _first_ephemeral_port()
    if first_ephemeral is not None and first_ephemeral - _LOW_PORTS_START >= 1000:
        for _ in range(20):
            port = rng.randrange(_LOW_PORTS_START, first_ephemeral)
            with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
                try:
                    s.bind(("127.0.0.1", port))
                except OSError:
                    continue
                return port
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def _first_ephemeral_port() -> int | None:
    """The first port of the kernel's range for ports bound to 0; None where it cannot be read."""
    try:
        return int(Path("/proc/sys/net/ipv4/ip_local_port_range").read_text().split()[0])
    except (OSError, ValueError, IndexError):
        return None


def under_torchrun() -> bool:
    """Whether this process is one rank started by torchrun (which sets LOCAL_RANK for its children)."""
    return "LOCAL_RANK" in os.environ


# Exit codes after which the ranks are not started again: a user error (every rank meets it alike), Ctrl-C and
# SIGTERM (the user stopped the job: it saved and said where).
_NOT_RESTARTED = (2, 128 + signal.SIGINT, 128 + signal.SIGTERM)


def relaunch(nproc: int, command: str, argv: list[str], *, max_restarts: int = 0) -> int:
    """Run ``python -m flexmoe COMMAND ARGV...`` as ``nproc`` local ranks (:func:`launch_ranks`); returns the
    exit code of the first rank that failed, 0 if none did.

    As ``torchrun --max-restarts``: when a rank fails, every rank is stopped and all ``nproc`` are started again,
    up to ``max_restarts`` times, each start with a fresh rendezvous store and ``TORCHELASTIC_RESTART_COUNT`` set
    to its number (a restarted ``flexmoe train`` resumes its run). A user error or a stop signal (exit 2, 130,
    143) is not restarted."""
    if max_restarts < 0:
        raise ValueError(f"relaunch: max_restarts must be >= 0, got {max_restarts}")
    print(f"launching {nproc} ranks: flexmoe {command} {' '.join(argv)}", flush=True)
    code = launch_ranks(nproc, ["-m", "flexmoe", command, *argv])
    for attempt in range(1, max_restarts + 1):
        if code == 0 or code in _NOT_RESTARTED:
            break
        print(f"restart {attempt} of {max_restarts}: starting the {nproc} ranks again", flush=True)
        code = launch_ranks(nproc, ["-m", "flexmoe", command, *argv], attempt=attempt, max_restarts=max_restarts)
    return code


# How a Python traceback begins: what a rank writes after this on its stderr goes to the log, not the terminal.
_TRACEBACK = b"Traceback (most recent call last):"
_LOG_TAIL_BYTES = 64_000  # of each rank's stderr, kept for the log of a failed launch


class _RankStderr(threading.Thread):
    """Reads one rank's stderr to its end: keeps its last bytes for the log and, with ``forward``, passes it on
    as it comes (a progress bar included) until a traceback begins."""

    def __init__(self, stream: IO[bytes], forward: IO[bytes] | None) -> None:
        super().__init__(daemon=True)
        self.stream, self.forward = stream, forward
        self.tail = b""
        self.forwarded = b""  # the last bytes passed on (where the rank's own "error: ..." line is looked for)

    def run(self) -> None:
        pending = b""
        while chunk := os.read(self.stream.fileno(), 65536):
            self.tail = (self.tail + chunk)[-_LOG_TAIL_BYTES:]
            if self.forward is None:
                continue
            pending += chunk
            start = pending.find(_TRACEBACK)
            # A marker cut in two by the pipe: hold back an end of the text that could begin it.
            end = start if start >= 0 else len(pending) - _marker_start_length(pending)
            self.forward.write(pending[:end])
            self.forward.flush()
            self.forwarded = (self.forwarded + pending[:end])[-_LOG_TAIL_BYTES:]
            pending = pending[end:]
            if start >= 0:
                self.forward = None

    def printed_error(self) -> bool:
        """Whether the rank passed on its own one-line ``error: ...`` (a user error)."""
        return any(line.startswith(b"error: ") for line in self.forwarded.splitlines())


def _marker_start_length(text: bytes) -> int:
    """The length of the longest end of ``text`` that begins :data:`_TRACEBACK` (0: none)."""
    return next((n for n in range(min(len(_TRACEBACK) - 1, len(text)), 0, -1) if text.endswith(_TRACEBACK[:n])), 0)


def launch_ranks(nproc: int, python_args: Sequence[str], *, grace: float = 10.0, attempt: int = 0,
                 max_restarts: int = 0) -> int:
    """Run ``python PYTHON_ARGS...`` as ``nproc`` local ranks on 127.0.0.1 (:func:`rank_env`, the rendezvous
    store served by this process) and wait for them; returns the exit code of the first rank that failed, 0 if
    none did.

    The user sees one program: every rank's stdout and rank 0's stderr as they come (its progress bar
    included), and, when a rank fails, one line. That is rank 0's own ``error: ...`` where it printed one (a user
    error, which every rank meets alike), else ``error: rank R exited with code C: LAST LINE`` of the first rank
    to fail and the file that keeps every rank's stderr: the ranks' tracebacks go there, not to the terminal.
    Once a rank has failed, the others get ``grace`` seconds, then are killed (a collective with a dead peer
    would wait much longer). SIGINT and SIGTERM reach every rank: a terminal's Ctrl-C reaches them as one process
    group, and this process passes on what it receives; a training rank then saves and exits 130 / 143
    (:mod:`flexmoe.apps.interrupt`), and so does this process. ``attempt`` / ``max_restarts``: which start of
    the job this is and how many restarts it may have (:func:`relaunch`), given to the ranks as torchrun gives
    them.
    """
    if nproc < 1:
        raise ValueError(f"launch_ranks: nproc must be >= 1, got {nproc}")
    from torch.distributed import TCPStore

    store = TCPStore("127.0.0.1", 0, is_master=True, wait_for_workers=False)  # served until the ranks are done
    threads = int(os.environ.get("OMP_NUM_THREADS", "1"))  # as torchrun: 1 unless the user says otherwise
    procs: list[subprocess.Popen[bytes]] = []
    readers: list[_RankStderr] = []

    def pass_on(signum: int, frame: FrameType | None) -> None:
        for p in procs:
            if p.poll() is None:
                p.send_signal(signum)

    # Only the main thread may set handlers; called from another one, the signals keep theirs (a terminal's
    # Ctrl-C still reaches the ranks, as one process group).
    in_main = threading.current_thread() is threading.main_thread()
    previous = {s: signal.signal(s, pass_on) for s in (signal.SIGINT, signal.SIGTERM)} if in_main else {}
    try:
        for rank in range(nproc):
            env = rank_env(rank, nproc, store.port, threads, attempt=attempt, max_restarts=max_restarts)
            proc = subprocess.Popen([sys.executable, *python_args], env=env,
                                    stdin=subprocess.DEVNULL, stderr=subprocess.PIPE)
            procs.append(proc)
            assert proc.stderr is not None  # stderr=PIPE
            readers.append(_RankStderr(proc.stderr, sys.stderr.buffer if rank == 0 else None))
            readers[-1].start()
        _, _, first_failed = _wait(procs, math.inf, grace)
    finally:
        for p in procs:
            if p.poll() is None:
                p.kill()
            p.wait()
        for s, handler in previous.items():
            signal.signal(s, handler)
        for reader in readers:
            reader.join()
    if first_failed is None:
        return 0
    code = procs[first_failed].returncode
    if code in (128 + signal.SIGINT, 128 + signal.SIGTERM) or readers[0].printed_error():
        return code  # rank 0 said where it saved, or what the user's error is, in its own one line
    log = _write_rank_log(readers)
    lines = [line for line in readers[first_failed].tail.decode(errors="replace").splitlines() if line.strip()]
    last = lines[-1].strip() if lines else "(nothing on stderr)"
    print(f"error: rank {first_failed} of {nproc} exited with code {code}: {last} (every rank's stderr: {log})",
          file=sys.stderr, flush=True)
    return code


def _write_rank_log(readers: list[_RankStderr]) -> str:
    """Every rank's stderr (its last bytes) in one new file; its path."""
    fd, path = tempfile.mkstemp(prefix="flexmoe-ranks-", suffix=".log")
    with os.fdopen(fd, "wb") as f:
        for rank, reader in enumerate(readers):
            f.write(f"===== rank {rank} stderr =====\n".encode() + reader.tail + b"\n")
    return path


def rank_env(rank: int, world: int, port: int, threads: int = 1, *, attempt: int = 0,
             max_restarts: int = 0) -> dict[str, str]:
    """The environment of one local rank: this process's, plus the ``env://`` rendezvous on 127.0.0.1:port,
    ``threads`` OpenMP threads (ranks share the cores), and which start of the job this is (``attempt``, of at most
    ``max_restarts`` restarts: torchrun's ``TORCHELASTIC_RESTART_COUNT`` and ``TORCHELASTIC_MAX_RESTARTS``).

    The rendezvous store at ``port`` is served by the launching process, as torchrun's agent serves it, and every
    rank, rank 0 included, is its client (``TORCHELASTIC_USE_AGENT_STORE``, read by ``torch.distributed``'s
    ``env://`` rendezvous)."""
    return {**os.environ, "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(port), "RANK": str(rank),
            "WORLD_SIZE": str(world), "LOCAL_RANK": str(rank), "LOCAL_WORLD_SIZE": str(world),
            "OMP_NUM_THREADS": str(threads), "TORCHELASTIC_USE_AGENT_STORE": "True",
            "TORCHELASTIC_RESTART_COUNT": str(attempt), "TORCHELASTIC_MAX_RESTARTS": str(max_restarts)}


@dataclass
class RankResult:
    """What one rank left behind. ``exit_code`` is None if the rank was killed (timeout, or a peer failed);
    ``value`` is what the function returned (JSON round-tripped), None if it did not return."""

    rank: int
    exit_code: int | None
    value: Any
    stdout: str
    stderr: str

    @property
    def ok(self) -> bool:
        return self.exit_code == 0


class RanksFailed(RuntimeError):
    """A rank of :func:`spawn_ranks` failed or the group did not finish in time; ``results`` has every rank."""

    def __init__(self, message: str, results: list[RankResult]) -> None:
        super().__init__(message)
        self.results = results


def _rank_child(module: str, name: str, args_path: str, out_path: str, extra_path: str) -> None:
    """The child's side of :func:`spawn_ranks`: import the function, call it, write its return value as JSON,
    and leave without the interpreter's teardown (a dead peer can make a process group's destructor wait)."""
    import faulthandler
    import importlib
    import importlib.util
    import signal
    import traceback

    if hasattr(signal, "SIGUSR1"):  # spawn_ranks asks a hanging rank for its stacks before it kills it
        faulthandler.register(signal.SIGUSR1, all_threads=True)

    if extra_path:
        sys.path.insert(0, extra_path)
    code = 1
    try:
        if module.endswith(".py"):  # the caller's script, imported under another name: its main guard stays shut
            spec = importlib.util.spec_from_file_location("__rank_main__", module)
            assert spec is not None and spec.loader is not None, module
            target: Any = importlib.util.module_from_spec(spec)
            spec.loader.exec_module(target)
        else:
            target = importlib.import_module(module)
        for part in name.split("."):
            target = getattr(target, part)
        value = target(*json.loads(Path(args_path).read_text()))
        Path(out_path).write_text(json.dumps(value))
        code = 0
    except BaseException:
        traceback.print_exc()
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(code)


# This file loaded by its path, not as flexmoe.launch: importing the flexmoe package would import torch, seconds
# a rank of a torch-free target need not pay.
_CHILD = (f"import importlib.util as u, sys; spec = u.spec_from_file_location('flexmoe_launch', {__file__!r}); "
          f"launch = sys.modules['flexmoe_launch'] = u.module_from_spec(spec); spec.loader.exec_module(launch); "
          f"launch._rank_child(*sys.argv[1:])")


def _function_command(fn: Callable[..., Any], args: Sequence[Any], tmp: Path, rank: int) -> list[str]:
    """``python -c _CHILD ...`` calling the module-level ``fn(*args)``. The module's root goes on sys.path, so a
    module that is not installed (a test helper beside the tests) imports too; a function of the running script
    (``__main__``) is found by the script's path, with the script's folder on sys.path as Python puts it there for
    the script itself (so that the script's imports of modules beside it work in the ranks too)."""
    module = fn.__module__
    source = getattr(sys.modules.get(module), "__file__", None)
    if "<locals>" in fn.__qualname__ or (module == "__main__" and source is None):
        raise ValueError(f"spawn_ranks: target must be a module-level function of a module or script, "
                         f"got {fn.__qualname__} of {module}")
    root = ""
    if source is not None:
        path = Path(source).resolve()
        if module == "__main__":
            module, root = str(path), str(path.parent)
        else:
            depth = module.count(".") + (path.name == "__init__.py")
            root = str(path.parents[depth])
    args_path = tmp / "args.json"
    if not args_path.exists():
        args_path.write_text(json.dumps(list(args)))
    return [sys.executable, "-c", _CHILD, module, fn.__qualname__, str(args_path), str(tmp / f"rank{rank}.json"), root]


def _tail(path: Path, chars: int = 3000) -> str:
    text = path.read_text(errors="replace") if path.exists() else ""
    return text[-chars:]


def spawn_ranks(world: int, target: Callable[..., Any] | Sequence[str], args: Sequence[Any] = (), *,
                timeout: float = 120.0, threads: int = 1, grace: float = 5.0, check: bool = True,
                what: str = "") -> list[RankResult]:
    """Run ``world`` ranks on 127.0.0.1 and wait for all of them; each rank's result, by rank. The rendezvous
    store is served by this process (:func:`rank_env`) for as long as the ranks run. As
    under torchrun, a rank joins the group once: ``init_process_group`` again after ``destroy_process_group`` in
    the same rank fails within seconds (the store still holds the first group's addresses).

    target: a module-level function, called in every rank as ``target(*args)`` (args: JSON values) with the
    rendezvous in the environment (``torch.distributed.init_process_group("gloo")`` joins it); its return value
    (JSON-able) is the rank's ``value``. Or a list of ``python`` arguments (``["-c", code, ...]``,
    ``["-m", module, ...]``, ``[script, ...]``), run as is in every rank.
    timeout: seconds for the whole group; then every rank still running is killed.
    grace: seconds the other ranks get to finish once one rank exited with an error; then they are killed (a
    collective with a dead peer would otherwise wait for its own, longer timeout).
    check: raise :class:`RanksFailed` (naming the first failed rank, with its stderr tail) unless every rank
    exited with 0; with ``check=False`` the caller reads the exit codes itself.
    what: the group's name in error messages (``"gloo calibration with 4 ranks"``; default ``"4 ranks"``).
    """
    if world < 1:
        raise ValueError(f"spawn_ranks: world must be >= 1, got {world}")
    if timeout <= 0:
        raise ValueError(f"spawn_ranks: timeout must be > 0 seconds, got {timeout}")
    # The store is served from here on a port the kernel picks as it binds it: a port chosen first and bound
    # later by rank 0 (after its seconds of imports) can be taken in between, by another group launched at the
    # same time (parallel tests, two benchmarks) or by anything else on the machine.
    from torch.distributed import TCPStore

    store = TCPStore("127.0.0.1", 0, is_master=True, wait_for_workers=False)  # served until this call returns
    port = store.port
    with tempfile.TemporaryDirectory(prefix="flexmoe-ranks-") as tmp_name:
        tmp = Path(tmp_name)
        procs: list[subprocess.Popen[bytes]] = []
        try:
            for rank in range(world):
                if callable(target):
                    cmd = _function_command(target, args, tmp, rank)
                else:
                    cmd = [sys.executable, *target]
                with open(tmp / f"rank{rank}.out", "w") as out, open(tmp / f"rank{rank}.err", "w") as err:
                    procs.append(subprocess.Popen(cmd, env=rank_env(rank, world, port, threads), stdout=out,
                                                  stderr=err, stdin=subprocess.DEVNULL))
            timed_out, killed, _ = _wait(procs, time.monotonic() + timeout, grace)
        finally:  # the caller interrupted (Ctrl-C) or a rank failed to start: leave no rank behind
            for p in procs:
                if p.poll() is None:
                    p.kill()
                    p.wait()
        results = []
        for rank, proc in enumerate(procs):
            value_path = tmp / f"rank{rank}.json"
            value = json.loads(value_path.read_text()) if value_path.exists() else None
            exit_code = None if rank in killed else proc.returncode
            results.append(RankResult(rank, exit_code, value, _tail(tmp / f"rank{rank}.out"),
                                      _tail(tmp / f"rank{rank}.err")))
    if check:
        failed = [r for r in results if not r.ok]
        if failed:
            first = next((r for r in failed if r.exit_code is not None), failed[0])
            cause = (f"did not finish in {timeout:.0f} s" if timed_out else
                     f"failed: rank {first.rank} exited with {first.exit_code}")
            group = what or f"{world} ranks"
            raise RanksFailed(f"{group} {cause}; stderr of rank {first.rank}:\n{first.stderr[-2000:]}", results)
    return results


def _dump_stacks(procs: list[subprocess.Popen[bytes]], wait: float = 1.0) -> None:
    """Ask ranks that ran past the deadline to write every thread's Python stack to their stderr (the
    faulthandler a function rank registers on SIGUSR1), so the error says where they hung."""
    if not hasattr(signal, "SIGUSR1"):
        return
    for p in procs:
        try:
            p.send_signal(signal.SIGUSR1)
        except ProcessLookupError:
            pass
    time.sleep(wait)


def _wait(procs: list[subprocess.Popen[bytes]], deadline: float,
          grace: float) -> tuple[bool, set[int], int | None]:
    """Wait for every process; kill those still running at the deadline, or ``grace`` s after the first one
    exited non-zero. Returns (whether the deadline was hit, the ranks killed, the first rank seen to exit
    non-zero or None)."""
    failed_by: float | None = None  # when the ranks left after a failure are killed
    first_failed: int | None = None
    while True:
        running = [i for i, p in enumerate(procs) if p.poll() is None]
        if first_failed is None:
            first_failed = next((i for i, p in enumerate(procs) if p.returncode not in (None, 0)), None)
        if not running:
            return False, set(), first_failed
        now = time.monotonic()
        if failed_by is None and first_failed is not None:
            failed_by = now + grace
        if now >= min(deadline, failed_by if failed_by is not None else deadline):
            hung = failed_by is None or deadline <= failed_by
            if hung:
                _dump_stacks([procs[i] for i in running])
            for i in running:
                procs[i].kill()
                procs[i].wait()
            return hung, set(running), first_failed
        time.sleep(0.05)
