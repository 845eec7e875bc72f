"""The ``flexmoe`` command as a user meets it: run directories are never lost, every user error is one line
``error: ...`` with exit code 2, --version and --help, file permissions, progress output.

Most cases call :func:`flexmoe.apps.cli.main` in-process (fast); the ones about what a terminal sees
(tracebacks, torchrun ranks) run the command as a subprocess.
"""

from __future__ import annotations

import argparse
import json
import os
import signal
import stat
import subprocess
import sys
from pathlib import Path

import pytest
import torch

import flexmoe
from flexmoe.apps import cli

TINY = ["--n-layer", "2", "--n-head", "2", "--n-embd", "32", "--block-size", "32", "--num-experts", "4",
        "--expert-hidden", "32", "--batch-size", "8", "--warmup", "2", "--no-progress", "--eval-batches", "1",
        "--eval-every", "4", "--ckpt-every", "2", "--log-every", "1"]


pytestmark = pytest.mark.usefixtures("one_thread")  # tests/conftest.py


def _env() -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if k not in ("RANK", "WORLD_SIZE", "LOCAL_RANK")}
    return {**env, "OMP_NUM_THREADS": "1"}


def _flexmoe(*argv: str, env: dict[str, str] | None = None, timeout: float = 120) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "flexmoe", *argv], capture_output=True, text=True,
                          timeout=timeout, env=env or _env())


def _error_line(err: str) -> str:
    """The one line a user error prints (and nothing else: no traceback, no usage block)."""
    lines = [line for line in err.splitlines() if line.strip()]
    assert len(lines) == 1, err
    assert lines[0].startswith("error: "), err
    return lines[0]


def _tree(root: Path) -> dict[str, tuple[int, bytes | None]]:
    """Every path under ``root`` with its modification time and (for files) contents."""
    out = {}
    for p in sorted(root.rglob("*")):
        out[str(p.relative_to(root))] = (p.stat().st_mtime_ns, p.read_bytes() if p.is_file() else None)
    return out


@pytest.fixture(scope="module")
def finished_run(tmp_path_factory) -> Path:
    """A finished 4-step run (checkpoints at 2 and 4), made once for the tests that only read it."""
    out = tmp_path_factory.mktemp("cli") / "run"
    assert cli.main(["train", "--out", str(out), "--steps", "4", *TINY]) == 0
    return out


# ------------------------------------------------------------------------------------- run directories


def test_train_refuses_an_existing_run_directory(finished_run: Path, capsys) -> None:
    before = _tree(finished_run)
    capsys.readouterr()
    assert cli.main(["train", "--out", str(finished_run), "--steps", "4", *TINY]) == 2
    line = _error_line(capsys.readouterr().err)
    assert str(finished_run) in line and "--resume" in line and "--overwrite" in line
    assert _tree(finished_run) == before  # nothing written, nothing deleted


def test_train_refuses_a_non_empty_foreign_directory_even_with_resume(tmp_path: Path, capsys) -> None:
    (tmp_path / "notes.txt").write_text("mine")
    for extra in ([], ["--resume"]):
        assert cli.main(["train", "--out", str(tmp_path), "--steps", "2", *TINY, *extra]) == 2
        assert str(tmp_path) in _error_line(capsys.readouterr().err)
    assert [p.name for p in tmp_path.iterdir()] == ["notes.txt"]


def test_resume_and_overwrite_exclude_each_other(tmp_path: Path, capsys) -> None:
    assert cli.main(["train", "--out", str(tmp_path / "r"), "--resume", "--overwrite", *TINY]) == 2
    line = _error_line(capsys.readouterr().err)
    assert "--resume" in line and "--overwrite" in line
    assert not (tmp_path / "r").exists()


def test_overwrite_replaces_the_run_and_only_its_files(tmp_path: Path) -> None:
    out = tmp_path / "run"
    assert cli.main(["train", "--out", str(out), "--steps", "4", *TINY]) == 0
    (out / "notes.txt").write_text("mine")
    assert cli.main(["train", "--out", str(out), "--steps", "2", "--overwrite", *TINY]) == 0
    steps = [json.loads(line)["step"] for line in (out / "metrics.jsonl").read_text().splitlines()]
    assert steps == [1, 2]  # the new run's records only
    assert sorted(p.name for p in (out / "checkpoints").glob("step_*")) == ["step_000002"]
    assert json.loads((out / "summary.json").read_text())["steps"] == 2
    assert (out / "notes.txt").read_text() == "mine"


def test_resume_of_a_finished_run_changes_nothing(finished_run: Path, capsys) -> None:
    before = _tree(finished_run)
    capsys.readouterr()
    assert cli.main(["train", "--out", str(finished_run), "--resume", *TINY]) == 0
    out = capsys.readouterr().out
    assert "already complete" in out and str(finished_run) in out
    assert _tree(finished_run) == before


def test_resume_with_more_steps_extends_a_finished_run(tmp_path: Path, capsys) -> None:
    out = tmp_path / "run"
    assert cli.main(["train", "--out", str(out), "--steps", "2", *TINY]) == 0
    capsys.readouterr()
    assert cli.main(["train", "--out", str(out), "--resume", "--steps", "4", *TINY]) == 0
    assert "already complete" not in capsys.readouterr().out
    assert json.loads((out / "summary.json").read_text())["steps"] == 4
    steps = [json.loads(line)["step"] for line in (out / "metrics.jsonl").read_text().splitlines()]
    assert steps == [1, 2, 3, 4]


def test_resume_into_a_new_directory_starts_a_run(tmp_path: Path, capsys) -> None:
    """What `make train` does the first time (it passes --resume, so that a second `make train` keeps the run)."""
    out = tmp_path / "fresh"
    assert cli.main(["train", "--out", str(out), "--steps", "2", "--resume", *TINY]) == 0
    assert json.loads((out / "summary.json").read_text())["steps"] == 2


def test_makefile_train_resumes() -> None:
    makefile = (Path(__file__).parents[1] / "Makefile").read_text()
    recipe = makefile[makefile.index("\ntrain:"):].split("\n\n")[0]
    assert "flexmoe train --out runs/default --resume" in recipe


# ------------------------------------------------------------------------------------------- --data


def _main(argv: list[str]) -> int:
    """``flexmoe ARGV`` in this process; argparse's own errors leave through SystemExit."""
    try:
        return cli.main(argv)
    except SystemExit as exc:
        return int(exc.code)


@pytest.mark.parametrize("kind", ["missing", "empty", "too small", "directory"])
def test_bad_data_is_one_line(tmp_path: Path, kind: str, capsys) -> None:
    data = tmp_path / "data.txt"
    if kind == "empty":
        data.write_bytes(b"")
    elif kind == "too small":
        data.write_bytes(b"to be or not to be " * 10)  # 190 bytes: the validation split gets 19 < 34
    elif kind == "directory":
        data.mkdir()
    out = tmp_path / "run"
    assert _main(["train", "--out", str(out), "--data", str(data), "--steps", "2", *TINY]) == 2
    line = _error_line(capsys.readouterr().err)
    assert f"--data {data}" in line
    expected = {"missing": "no such file", "empty": "empty", "too small": "at least 340 bytes",
                "directory": "is a directory"}[kind]
    assert expected in line
    assert not out.exists()


def test_bad_data_prints_no_traceback(tmp_path: Path) -> None:
    """As a terminal sees it (an empty file used to end in torch's "both buffer length (0) and count (-1)")."""
    (tmp_path / "empty.txt").write_bytes(b"")
    proc = _flexmoe("train", "--out", str(tmp_path / "run"), "--data", str(tmp_path / "empty.txt"))
    assert proc.returncode == 2
    assert _error_line(proc.stderr).startswith(f"error: --data {tmp_path / 'empty.txt'}: the file is empty")


def test_data_of_exactly_the_minimum_size_trains(tmp_path: Path) -> None:
    """The size the 'too small' message asks for is enough (block size 32: each split needs 34 bytes)."""
    data = tmp_path / "data.txt"
    data.write_bytes(bytes(range(97, 123)) * 13 + b"ab")  # 340 bytes
    assert cli.main(["train", "--out", str(tmp_path / "run"), "--data", str(data), "--steps", "2", *TINY]) == 0


# -------------------------------------------------------------------------------- every subcommand


@pytest.mark.parametrize("argv, names", [
    (["train", "--steps", "0"], "--steps"),
    (["train", "--batch-size", "6", "--micro-batches", "4"], "--batch-size"),
    (["train", "--steps", "x"], "--steps"),
    (["generate", "--run", "/nonexistent/run"], "/nonexistent/run"),
    (["generate", "--run", ".", "--temperature", "0"], "--temperature"),
    (["reshard", "/nonexistent/run", "--world-size", "2", "--out", "x"], "/nonexistent/run"),
    (["bench", "--tokens", "0"], "--tokens"),
    (["bench", "--k", "3", "--experts", "2"], "--k"),
    (["bench", "--degrees", "0"], "--degrees"),
    (["calibrate", "--ranks", "two"], "--ranks"),
    (["calibrate", "--ranks", "1"], "--ranks"),
    (["validate-model", "--profile", "no-such-profile"], "--profile"),
    (["validate-model", "--steps", "0"], "--steps"),
    (["simulate", "--gpus", "8,x", "--no-plot"], "--gpus"),
    (["simulate", "--profile", "no-such-profile", "--no-plot"], "--profile"),
])
def test_user_errors_are_one_line_with_exit_code_2(tmp_path: Path, argv: list[str], names: str, capsys,
                                                   monkeypatch) -> None:
    monkeypatch.chdir(tmp_path)
    assert _main([*argv, *(["--out", str(tmp_path / "o")] if argv[0] == "train" else [])]) == 2
    assert names in _error_line(capsys.readouterr().err)
    assert not (tmp_path / "o").exists()


def test_bad_flag_prints_no_usage_block() -> None:
    proc = _flexmoe("bench", "--tokens", "many")
    assert proc.returncode == 2
    assert _error_line(proc.stderr) == ("error: flexmoe bench: argument --tokens: must be an integer >= 1, got 'many' "
                                        "(see 'flexmoe bench --help')")


def test_reshard_names_the_world_sizes_that_work(finished_run: Path, tmp_path: Path, capsys) -> None:
    capsys.readouterr()
    assert cli.main(["reshard", str(finished_run), "--world-size", "3", "--out", str(tmp_path / "r3")]) == 2
    line = _error_line(capsys.readouterr().err)
    # 4 experts of hidden size 32: the divisors of 4, then 4 x every divisor of 32 (experts sharded that many ways).
    expected = sorted({w for w in range(1, 5) if 4 % w == 0} | {4 * s for s in range(1, 33) if 32 % s == 0})
    assert expected == [1, 2, 4, 8, 16, 32, 64, 128]
    assert line.endswith("world sizes that work: " + ", ".join(map(str, expected)))
    assert "--world-size 3" in line
    assert not (tmp_path / "r3").exists()


def test_only_rank_zero_prints_a_user_error_under_torchrun(tmp_path: Path) -> None:
    """Every rank fails alike; rank 0 says why, the others leave quietly with the same exit code."""
    for rank, expect_line in (("0", True), ("1", False)):
        env = {**_env(), "RANK": rank, "WORLD_SIZE": "2", "LOCAL_RANK": rank}
        proc = _flexmoe("train", "--out", str(tmp_path / "r"), "--data", str(tmp_path / "nope"), env=env)
        assert proc.returncode == 2
        assert ("error: --data" in proc.stderr) == expect_line, proc.stderr
        assert "Traceback" not in proc.stderr


# ------------------------------------------------------------------------------------------- counts


@pytest.mark.slow  # 19 s: a 2-rank job (test_train_device runs one in the default suite)
def test_two_ranks_report_the_global_parameter_counts(tmp_path: Path) -> None:
    from flexmoe.apps.models import GPT, GPTConfig

    flags = dict(n_layer=2, n_head=2, n_embd=32, block_size=32, num_experts=4, expert_hidden=32)
    whole = GPT(GPTConfig(**flags))  # one process holding every expert, counted by hand below
    params = sum(p.numel() for p in whole.parameters())
    expert = sum(p.numel() for n, p in whole.named_parameters() if ".experts." in n)
    active = params - expert + expert * 2 // 4
    out = tmp_path / "ep"
    proc = _flexmoe("train", "--out", str(out), "--steps", "2", "--nproc", "2", "--no-plots", *TINY, timeout=240)
    assert proc.returncode == 0, proc.stderr
    summary = json.loads((out / "summary.json").read_text())
    assert summary["world_size"] == 2
    assert (summary["params"], summary["active_params"]) == (params, active)
    assert f"{params:,} parameters, {active:,} active" in proc.stdout


# ------------------------------------------------------------------------------------ command line


def test_version() -> None:
    proc = _flexmoe("--version")
    assert proc.returncode == 0 and proc.stdout.strip() == f"flexmoe {flexmoe.__version__}"


@pytest.mark.parametrize("command", list(cli.COMMANDS))
def test_every_flag_has_help_and_shows_its_default(command: str) -> None:
    parser = cli.build_parser(command)
    sub = next(a for a in parser._actions if isinstance(a, argparse._SubParsersAction)).choices[command]
    formatter = sub._get_formatter()
    for action in sub._actions:
        if not action.option_strings or action.dest == "help":
            continue
        assert action.help and action.help.strip(), f"{command} {action.option_strings[0]} has no help"
        shown = formatter._get_help_string(action)
        if not isinstance(action, argparse._StoreTrueAction) and not action.required:
            assert "(default" in shown, f"{command} {action.option_strings[0]}: no default in {shown!r}"
        assert "issue" not in shown, f"{command} {action.option_strings[0]}: internal wording in {shown!r}"
    text = sub.format_help()
    assert "(default: 1,2,4)" in text if command == "bench" else True


def test_help_imports_only_the_command_asked_for() -> None:
    """The comment in cli.py says so: `flexmoe train --help` must not import bench, calibrate, ..."""
    code = ("import sys\nfrom flexmoe.apps import cli\n"
            "try:\n    cli.main(['train', '--help'])\nexcept SystemExit:\n    pass\n"
            "print(sorted(m for m in sys.modules if m.startswith('flexmoe.apps.')))")
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120, env=_env())
    loaded = proc.stdout.strip().splitlines()[-1]
    assert "flexmoe.apps.train" in loaded
    for other in ("flexmoe.apps.bench", "flexmoe.apps.calibrate", "flexmoe.apps.validate", "flexmoe.apps.simulate",
                  "flexmoe.apps.reshard"):
        assert f"'{other}'" not in loaded


# ------------------------------------------------------------------------------------------ permissions


def test_every_file_of_a_run_has_the_same_permissions(finished_run: Path, tmp_path: Path) -> None:
    resharded = tmp_path / "r2"
    assert cli.main(["reshard", str(finished_run), "--world-size", "2", "--out", str(resharded)]) == 0
    umask = os.umask(0)
    os.umask(umask)
    files = {p: stat.S_IMODE(p.stat().st_mode) for root in (finished_run, resharded) for p in root.rglob("*")
             if p.is_file()}
    dirs = {p: stat.S_IMODE(p.stat().st_mode) for root in (finished_run, resharded) for p in [root, *root.rglob("*")]
            if p.is_dir()}
    assert any(p.suffix == ".safetensors" for p in files)
    assert set(files.values()) == {0o666 & ~umask}, files
    assert set(dirs.values()) == {0o777 & ~umask}, dirs


# ------------------------------------------------------------------------------------------ expert load


def test_metrics_log_the_load_wanted_before_the_capacity_limit(finished_run: Path) -> None:
    records = [json.loads(line) for line in (finished_run / "metrics.jsonl").read_text().splitlines()]
    pairs = 8 * 32 * 2  # batch x block x k: every (token, choice) pair of a step is routed somewhere
    for r in records:
        for load, wanted in zip(r["expert_load"], r["expert_demand"]):
            assert sum(wanted) == pairs
            assert all(0 <= c <= w for c, w in zip(load, wanted))
        dropped = [1 - sum(c) / sum(w) for c, w in zip(r["expert_load"], r["expert_demand"])]
        assert r["drop_rate"] == pytest.approx(sum(dropped) / len(dropped))


def test_expert_shares_are_shares_of_the_routed_pairs() -> None:
    from flexmoe.apps.plots import expert_shares

    records = [{"expert_load": [[6, 2]], "expert_demand": [[8, 2]]},   # expert 0 wanted 8, computed 6
               {"expert_load": [[5, 5]], "expert_demand": [[5, 5]]}]
    computed, wanted = expert_shares(records, 0)
    assert computed.tolist() == [[0.6, 0.5], [0.2, 0.5]]
    assert wanted.tolist() == [[0.8, 0.5], [0.2, 0.5]]


def test_the_first_logged_step_does_not_set_the_colour_scale() -> None:
    import numpy as np

    from flexmoe.apps.plots import share_scale

    first = np.array([[0.97], [0.01], [0.01], [0.01]])  # an untrained router: nearly everything to expert 0
    later = np.array([[0.3, 0.2], [0.25, 0.3], [0.25, 0.25], [0.2, 0.25]])
    scale = share_scale([np.hstack([first, later])], num_experts=4)
    assert scale == 0.5  # twice the uniform share, the later shares' 99th percentile (0.3) being below it
    wide = np.array([[0.9, 0.8, 0.7], [0.05, 0.1, 0.1], [0.03, 0.05, 0.1], [0.02, 0.05, 0.1]])
    assert share_scale([wide], num_experts=4) == pytest.approx(np.percentile(wide[:, 1:], 99))


def test_expert_load_plot_without_demand_still_draws(tmp_path: Path) -> None:
    """Runs logged before expert_demand existed (resumed ones) keep their plot."""
    from flexmoe.apps.plots import plot_expert_load

    records = [{"step": s, "expert_load": [[3 + s, 5, 4, 4]]} for s in (1, 2, 3)]
    assert plot_expert_load(records, tmp_path / "load.png") == tmp_path / "load.png"
    assert (tmp_path / "load.png").stat().st_size > 0


# ---------------------------------------------------------------------------------------- README, Makefile

ROOT = Path(__file__).parents[1]


def test_readme_opens_with_what_flexmoe_does_and_lists_the_make_targets() -> None:
    readme = (ROOT / "README.md").read_text()
    opening = readme.split("```")[0]
    assert "in progress" not in opening and "expert parallelism" in opening
    assert "AMD EPYC" in opening and "AVX2" in opening and "2-core" in opening
    makefile = (ROOT / "Makefile").read_text()
    for target in ("train", "test", "test-slow", "bench"):
        assert f"\n{target}:" in makefile
        assert f"make {target} " in readme
    assert "TORCH_INDEX=https://download.pytorch.org/whl/cpu" in readme


def test_makefile_torch_index_reaches_pip() -> None:
    def setup_lines(*overrides: str) -> list[str]:
        dry = subprocess.run(["make", "-n", "-B", "setup", *overrides], cwd=ROOT, capture_output=True, text=True,
                             timeout=60)
        assert dry.returncode == 0, dry.stderr
        return dry.stdout.splitlines()

    # The locked torch (requirements.lock's pin, through the constraints), from the index given.
    lines = setup_lines("TORCH_INDEX=https://example.org/whl/cpu")
    torch_line = next(line for line in lines if '"torch"' in line)
    assert "-c .venv/constraints.txt" in torch_line
    assert torch_line.rstrip().endswith('"torch" --index-url https://example.org/whl/cpu')
    assert any(line.startswith("cat requirements.lock > .venv/constraints.txt") for line in lines)
    assert any("scripts/lock.py check" in line for line in lines)
    # Another torch: the lock without its torch line, and no check against the lock's torch.
    lines = setup_lines("TORCH_SPEC=torch==2.12.0")
    assert any('"torch==2.12.0"' in line for line in lines)
    assert any(line.startswith("grep -v '^torch==' requirements.lock > .venv/constraints.txt") for line in lines)
    assert not any("scripts/lock.py check" in line for line in lines)


# ------------------------------------------------------------------ every flag's range, before anything is written

# (argv, the flag the error line must name): each value was accepted, or ended in a traceback, before the ranges
# were checked as the command line is parsed (flexmoe.apps.flags).
BAD_FLAGS = [
    *[(["train", flag, value], flag) for flag, value in [
        ("--lr", "-1"), ("--lr", "nan"), ("--a2a", "foo"), ("--capacity-factor", "nan"), ("--dropout", "2"),
        ("--block-size", "0"), ("--num-experts", "0"), ("--warmup", "-1"), ("--log-every", "0"),
        ("--ckpt-every", "0"), ("--seed", "-1"), ("--batch-size", "0"), ("--micro-batches", "0"),
        ("--eval-every", "0"), ("--eval-batches", "0"), ("--target-loss", "nan"), ("--nproc", "0"),
        ("--n-layer", "0"), ("--n-head", "0"), ("--n-embd", "0"), ("--expert-hidden", "0"), ("--k", "0"),
        ("--moe-every", "0"), ("--aux-loss-coef", "-1"), ("--cross-node-share", "2"), ("--steps", "inf")]],
    (["train", "--nproc", "2", "--num-experts", "3"], "--nproc 2 does not fit --num-experts 3"),
    (["train", "--hf-arch", "mixtral", "--block-size", "0"], "--block-size"),
    *[(["bench", flag, value], flag) for flag, value in [
        ("--model-dim", "0"), ("--hidden-dim", "0"), ("--num-experts", "0"), ("--experts", "0"),
        ("--capacity-factor", "inf"), ("--steps", "0"), ("--warmup", "-1"), ("--seed", "-1"), ("--threads", "0"),
        ("--nproc", "0"), ("--ranks-per-node", "0"), ("--sleep-ms", "-5"), ("--hf-memory-gib", "0"),
        ("--auto-trials", "0"), ("--auto-runs", "0")]],
    (["bench", "--nproc", "2", "--sleep-ms", "10", "--num-experts", "3"], "--num-experts 3"),
    *[(["simulate", flag, value], flag) for flag, value in [
        ("--tokens", "0"), ("--model-dim", "0"), ("--num-experts", "0"), ("--k", "0"), ("--capacity-factor", "-1"),
        ("--skew", "0.5")]],
    (["simulate", "--plot", "/proc/flexmoe-test/plot.png"], "--plot"),
    (["calibrate", "--out", "/proc/flexmoe-test/profile.json"], "--out"),
    *[(["validate-model", flag, value], flag) for flag, value in [
        ("--warmup", "-1"), ("--rounds", "0"), ("--max-ranks", "0")]],
    *[(["generate", "--run", ".", flag, value], flag) for flag, value in [
        ("--tokens", "-1"), ("--temperature", "nan"), ("--top-k", "0"), ("--seed", "-1")]],
    (["reshard", ".", "--world-size", "0", "--out", "o"], "--world-size"),
    *[(["train-vision", flag, value], flag) for flag, value in [
        ("--patch-size", "0"), ("--pool", "max"), ("--batch-size", "0"), ("--dropout", "1"), ("--lr", "0")]],
]


@pytest.mark.parametrize("argv, names", BAD_FLAGS, ids=[" ".join(argv) for argv, _ in BAD_FLAGS])
def test_every_bad_flag_value_is_one_line_naming_the_flag(tmp_path: Path, argv: list[str], names: str, capsys,
                                                         monkeypatch) -> None:
    monkeypatch.chdir(tmp_path)
    out = ["--out", str(tmp_path / "run")] if argv[0] in ("train", "train-vision") else []
    assert _main([*argv, *out]) == 2
    line = _error_line(capsys.readouterr().err)
    assert names in line
    assert list(tmp_path.iterdir()) == []  # no run directory, no plot, nothing in the working directory


@pytest.mark.parametrize("out, why", [("/proc/flexmoe-test/run", "cannot write there"),
                                      ("FILE/run", "is a file")])
def test_train_out_in_an_unwritable_place_is_one_line(tmp_path: Path, out: str, why: str, capsys) -> None:
    (tmp_path / "FILE").write_text("not a directory")
    out = out.replace("FILE", str(tmp_path / "FILE"))
    assert _main(["train", "--out", out, "--steps", "2", *TINY]) == 2
    line = _error_line(capsys.readouterr().err)
    assert line.startswith(f"error: --out {out}: ") and why in line


def test_an_accepted_value_at_each_bound_parses() -> None:
    """The bounds are the documented ones, not one off: 0 warm-up steps, dropout 0, share 1, seed 0."""
    parser = cli.build_parser("train")
    args = parser.parse_args(["train", "--warmup", "0", "--dropout", "0", "--cross-node-share", "1", "--seed", "0",
                              "--capacity-factor", "-1", "--a2a", "2dh"])
    assert (args.warmup, args.dropout, args.cross_node_share, args.seed, args.capacity_factor, args.a2a) == \
        (0, 0.0, 1.0, 0, -1.0, "2dh")


def test_experts_is_an_alias_of_num_experts() -> None:
    for command in ("bench", "simulate"):
        parser = cli.build_parser(command)
        assert parser.parse_args([command, "--experts", "6"]).experts == 6
        assert parser.parse_args([command, "--num-experts", "6"]).experts == 6


def test_simulate_writes_its_plot_under_runs_not_the_working_directory(tmp_path: Path, monkeypatch) -> None:
    monkeypatch.chdir(tmp_path)
    assert cli.main(["simulate", "--profile", "a100-ndv4", "--gpus", "8,64"]) == 0
    assert [p.name for p in tmp_path.iterdir()] == ["runs"]
    assert (tmp_path / "runs" / "simulate" / "simulate-a100-ndv4.png").stat().st_size > 0


# ------------------------------------------------------------------------ --resume continues exactly, or refuses


def _copy_run(run: Path, tmp_path: Path) -> Path:
    import shutil

    copy = tmp_path / "run"
    shutil.copytree(run, copy)
    return copy


@pytest.mark.parametrize("damage", ["no checkpoints", "latest.json names a deleted step"])
def test_resume_without_a_usable_checkpoint_is_refused(finished_run: Path, tmp_path: Path, damage: str,
                                                       capsys) -> None:
    import shutil

    run = _copy_run(finished_run, tmp_path)
    if damage == "no checkpoints":  # stopped before its first checkpoint
        shutil.rmtree(run / "checkpoints")
    else:
        for step in (run / "checkpoints").glob("step_*"):
            shutil.rmtree(step)
    before = _tree(run)
    capsys.readouterr()
    assert cli.main(["train", "--out", str(run), "--resume", "--steps", "6", *TINY]) == 2
    line = _error_line(capsys.readouterr().err)
    assert str(run) in line and "metrics.jsonl up to step 4" in line and "--overwrite" in line
    assert ("step_000004, which is missing" in line) == (damage != "no checkpoints")
    assert _tree(run) == before  # metrics.jsonl and the rest untouched


@pytest.mark.parametrize("flags, named", [
    (["--n-layer", "4"], "--n-layer 4"),
    (["--data", "DATA"], "--data DATA"),
    (["--lr", "0.01"], "--lr 0.01"),
    (["--seed", "7"], "--seed 7"),
    (["--dense"], "--dense given"),
    (["--k", "1"], "--k 1"),
])
def test_resume_refuses_a_flag_that_differs_from_the_saved_run(finished_run: Path, tmp_path: Path, flags: list[str],
                                                              named: str, capsys) -> None:
    data = tmp_path / "my.txt"
    data.write_bytes(bytes(range(97, 123)) * 40)
    flags = [str(data) if f == "DATA" else f for f in flags]
    before = _tree(finished_run)
    capsys.readouterr()
    pairs = [TINY[i:i + 2] if TINY[i + 1:i + 2] and not TINY[i + 1].startswith("--") else TINY[i:i + 1]
             for i in range(len(TINY)) if TINY[i].startswith("--")]
    tiny = [word for pair in pairs if pair[0] not in flags for word in pair]  # TINY's values are the saved run's
    assert cli.main(["train", "--out", str(finished_run), "--resume", "--steps", "6", *tiny, *flags]) == 2
    line = _error_line(capsys.readouterr().err)
    assert named.replace("DATA", str(data)) in line and str(finished_run) in line
    assert _tree(finished_run) == before


def test_resume_takes_the_new_logging_cadence(tmp_path: Path) -> None:
    """--log-every may change on --resume, and does (it used to be the saved value, silently)."""
    out = tmp_path / "run"
    assert cli.main(["train", "--out", str(out), "--steps", "2", *TINY]) == 0
    assert cli.main(["train", "--out", str(out), "--resume", "--steps", "6", *TINY, "--log-every", "3",
                     "--eval-every", "100"]) == 0
    steps = [json.loads(line)["step"] for line in (out / "metrics.jsonl").read_text().splitlines()]
    assert steps == [1, 2, 3, 6]


def test_evaluation_cadence_changes_no_weight(tmp_path: Path) -> None:
    """Why --eval-every may change on --resume: evaluating draws no random numbers and changes no weight."""
    from safetensors.torch import load_file

    weights = []
    for every in ("1", "4"):
        out = tmp_path / every
        flags = [f for f in TINY]
        flags[flags.index("--eval-every") + 1] = every
        assert cli.main(["train", "--out", str(out), "--steps", "4", "--no-plots", *flags]) == 0
        weights.append(load_file(out / "checkpoints" / "step_000004" / "model.safetensors"))
    assert weights[0].keys() == weights[1].keys()
    for name, tensor in weights[0].items():
        assert torch.equal(tensor, weights[1][name]), name


# ------------------------------------------------------------------------------ Ctrl-C and SIGTERM save the run


PAUSE_STEP = 3
_PAUSED_FLEXMOE = str(Path(__file__).with_name("paused_flexmoe.py"))


def _signal_mid_run(out: Path, signum: int, argv: list[str], nproc: int = 1,
                    command: str = "train") -> tuple[int, str]:
    """Start ``flexmoe COMMAND ARGV`` into ``out`` as a subprocess that waits for a signal at the end of step
    :data:`PAUSE_STEP` (tests/paused_flexmoe.py: it cannot finish before the signal comes, however fast it runs),
    send it ``signum`` once it has logged that step; its exit code and stderr."""
    import time

    extra = ["--nproc", str(nproc)] if nproc > 1 else []
    proc = subprocess.Popen([sys.executable, _PAUSED_FLEXMOE, str(PAUSE_STEP), command, "--out", str(out), *argv,
                             *extra], stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=_env())
    metrics = out / "metrics.jsonl"
    deadline = time.monotonic() + 300  # only a hung run gets here: a finished or failed one is seen at once
    while not (metrics.is_file() and len(metrics.read_text().splitlines()) >= PAUSE_STEP):
        assert proc.poll() is None, proc.communicate()
        assert time.monotonic() < deadline, f"the run logged no {PAUSE_STEP} steps in 300 s"
        time.sleep(0.02)
    proc.send_signal(signum)
    _, err = proc.communicate(timeout=300)
    return proc.returncode, err


def _weights(run: Path, step: int) -> dict[str, torch.Tensor]:
    from safetensors.torch import load_file

    return load_file(run / "checkpoints" / f"step_{step:06d}" / "model.safetensors")


def _losses(run: Path) -> list[tuple]:
    return [(r["step"], r["train_loss"], r.get("val_loss"))
            for r in map(json.loads, (run / "metrics.jsonl").read_text().splitlines())]


@pytest.mark.parametrize("signum", [signal.SIGINT, pytest.param(signal.SIGTERM, marks=pytest.mark.slow)],
                         ids=["SIGINT", "SIGTERM"])
def test_a_signal_saves_the_step_and_resume_equals_an_uninterrupted_run(tmp_path: Path, signum: int) -> None:
    steps = 60
    argv = ["--steps", str(steps), "--no-plots", *TINY, "--ckpt-every", "1000"]  # no checkpoint but the signal's
    reference = tmp_path / "reference"
    assert cli.main(["train", "--out", str(reference), *argv]) == 0
    victim = tmp_path / "victim"
    code, err = _signal_mid_run(victim, signum, argv)
    lines = [line for line in err.splitlines() if line.strip()]
    assert code == 128 + signum and len(lines) == 1, err
    name = signal.Signals(signum).name
    assert lines[0].startswith(f"[moe] {name}: stopped after step "), err
    stopped = int(lines[0].split("stopped after step ")[1].split()[0])
    assert stopped == PAUSE_STEP  # the step the run waited at: the signal came while it waited, or before
    assert str(victim / "checkpoints" / f"step_{stopped:06d}") in lines[0]
    assert [p.name for p in (victim / "checkpoints").glob("step_*")] == [f"step_{stopped:06d}"]

    assert cli.main(["train", "--out", str(victim), "--resume", *argv]) == 0
    assert _losses(victim) == _losses(reference)  # every step's losses, bit for bit
    expected, resumed = _weights(reference, steps), _weights(victim, steps)
    assert expected.keys() == resumed.keys()
    assert all(torch.equal(expected[name], resumed[name]) for name in expected)


@pytest.mark.slow
def test_train_vision_saves_on_a_signal_and_resumes_exactly(tmp_path: Path) -> None:
    steps = 60
    argv = ["--steps", str(steps), "--no-plots", "--no-progress", "--log-every", "1", "--eval-every", "20",
            "--ckpt-every", "1000", "--n-embd", "16", "--n-layer", "1", "--batch-size", "16"]
    reference = tmp_path / "reference"
    assert cli.main(["train-vision", "--out", str(reference), *argv]) == 0
    victim = tmp_path / "victim"
    code, err = _signal_mid_run(victim, signal.SIGINT, argv, command="train-vision")
    lines = [line for line in err.splitlines() if line.strip()]
    assert code == 130 and len(lines) == 1, err
    assert lines[0].startswith(f"[moe] SIGINT: stopped after step {PAUSE_STEP} of "), err
    assert cli.main(["train-vision", "--out", str(victim), "--resume", *argv]) == 0
    assert _losses(victim) == _losses(reference)
    expected, got = _weights(reference, steps), _weights(victim, steps)
    assert all(torch.equal(expected[name], got[name]) for name in expected)


@pytest.mark.slow
def test_a_signal_to_a_two_rank_run_saves_one_checkpoint_and_resume_equals_an_uninterrupted_run(
        tmp_path: Path) -> None:
    """SIGTERM to `flexmoe train --nproc 2` (the launcher passes it on): both ranks stop after the same step, one
    checkpoint is saved, and --resume with 2 ranks continues exactly as the uninterrupted 2-rank run."""
    steps = 40
    argv = ["--steps", str(steps), "--no-plots", *TINY, "--ckpt-every", "1000"]
    reference = tmp_path / "reference"
    done = _flexmoe("train", "--out", str(reference), *argv, "--nproc", "2", timeout=300)
    assert done.returncode == 0, done.stderr
    victim = tmp_path / "victim"
    code, err = _signal_mid_run(victim, signal.SIGTERM, argv, nproc=2)
    lines = [line for line in err.splitlines() if line.strip()]
    assert code == 143 and len(lines) == 1, err
    assert lines[0].startswith(f"[moe] SIGTERM: stopped after step {PAUSE_STEP} of "), err
    resumed = _flexmoe("train", "--out", str(victim), "--resume", *argv, "--nproc", "2", timeout=300)
    assert resumed.returncode == 0, resumed.stderr
    assert _losses(victim) == _losses(reference)
    expected, got = _weights(reference, steps), _weights(victim, steps)
    assert all(torch.equal(expected[name], got[name]) for name in expected)


def test_two_ranks_with_experts_they_cannot_split_is_one_line_before_launching(tmp_path: Path, capsys) -> None:
    """It used to print 139 lines: both ranks' tracebacks and torchrun's report."""
    assert _main(["train", "--out", str(tmp_path / "run"), "--nproc", "2", "--num-experts", "3"]) == 2
    line = _error_line(capsys.readouterr().err)
    assert line == ("error: --nproc 2 does not fit --num-experts 3 (of --expert-hidden 256): each rank holds whole "
                    "experts or an equal share of one; --nproc values that work: 1, 3, 6, 12, 24, 48, 96, 192, 384, "
                    "768")
    assert not (tmp_path / "run").exists()


def test_given_flags_are_the_ones_on_the_command_line_abbreviations_included() -> None:
    from flexmoe.apps.flags import given_flags

    parser = cli.build_parser("train")
    sub = next(a for a in parser._actions if isinstance(a, argparse._SubParsersAction)).choices["train"]
    assert given_flags(sub, ["--n-lay", "4", "--lr=0.002", "--dense", "--out", "x"]) == {"n_layer", "lr", "dense",
                                                                                         "out"}
    assert given_flags(sub, []) == set()


@pytest.mark.slow
def test_resume_of_a_hugging_face_run_refuses_another_block_size_or_capacity(tmp_path: Path, capsys) -> None:
    pytest.importorskip("transformers")
    out = tmp_path / "hf"
    flags = ["--batch-size", "4", "--block-size", "32", "--warmup", "1", "--eval-every", "2", "--eval-batches", "1",
             "--ckpt-every", "2", "--no-progress", "--no-plots"]
    assert cli.main(["train", "--hf-arch", "qwen3_moe", "--out", str(out), "--steps", "2", *flags]) == 0
    before = _tree(out)
    for changed, named in ((["--block-size", "64"], "--block-size 64"), (["--capacity-factor", "2"],
                                                                         "--capacity-factor 2.0")):
        capsys.readouterr()
        kept = [f for f in flags if f not in ("--block-size", "32")]
        assert cli.main(["train", "--out", str(out), "--resume", "--steps", "4", *kept, *changed]) == 2
        assert named in _error_line(capsys.readouterr().err)
    assert _tree(out) == before


def test_every_train_flag_is_either_kept_or_free_to_change_on_resume() -> None:
    """No flag of `flexmoe train` is silently ignored by --resume: each one is compared with the saved run
    (training, model and Hugging Face flags) or listed as changing no result (RESUME_MAY_CHANGE)."""
    from flexmoe.apps import train, train_flags

    parser = cli.build_parser("train")
    sub = next(a for a in parser._actions if isinstance(a, argparse._SubParsersAction)).choices["train"]
    dests = {a.dest for a in sub._actions if a.option_strings and a.dest != "help"}
    model = set(train_flags.saved_model_flags({}, train.GPT_MODEL_FLAGS))  # the model flags and --dense
    kept = set(train_flags.saved_train_flags({})) | model | {"hf_arch", "hf_model"}  # the HF job compares these two
    assert not kept & set(train_flags.RESUME_MAY_CHANGE)
    assert dests == kept | set(train_flags.RESUME_MAY_CHANGE)
