"""The ``flexmoe`` command. Each subcommand lives in its own module, which provides
``add_arguments(parser)`` and ``run(args) -> int``; this file only wires them together.

User errors (:class:`flexmoe.apps.errors.UsageError`, and the library's corpus and checkpoint errors) end as one
line ``error: ...`` on stderr with exit code 2; see :mod:`flexmoe.apps.errors`. Each flag's value is checked as it
is parsed (:mod:`flexmoe.apps.flags`). A subcommand's ``run(args)`` finds the flags the user set in ``args.given``
(argparse destinations).
"""

from __future__ import annotations

import argparse
import importlib
import importlib.util
import os
import signal
import sys

import flexmoe
from flexmoe.apps.errors import USAGE_EXIT_CODE, UsageError
from flexmoe.apps.flags import given_flags

# name -> (module, one-line help). Only the module of the command being run (or whose --help is shown) is
# imported, so that `flexmoe --help` and one command's start-up do not pay for every other command's imports.
COMMANDS: dict[str, tuple[str, str]] = {
    "bench": ("flexmoe.apps.bench.cli", "time one MoE layer against the compute floor and reference layers"),
    "train": ("flexmoe.apps.train_command",
              "train the MoE GPT (or its dense twin, or a Hugging Face MoE model) on tiny Shakespeare or any text "
              "file"),
    "train-vision": ("flexmoe.apps.vision",
                     "train a vision MoE (cosine router, as SwinV2-MoE) or its dense twin on 8x8 digits"),
    "generate": ("flexmoe.apps.generate", "sample text from a training run's checkpoint"),
    "reshard": ("flexmoe.apps.reshard", "rewrite a checkpoint for another number of expert-parallel ranks"),
    "calibrate": ("flexmoe.apps.calibrate", "measure this machine and write the cost model's JSON profile"),
    "validate-model": ("flexmoe.apps.validate", "measure the layer, compare with the cost model, print the error"),
    "simulate": ("flexmoe.apps.simulate", "predict single-layer throughput from 8 to 2,048 GPUs from a profile"),
    "a2a-sweep": ("flexmoe.apps.a2a_sweep", "time the all-to-all at a range of sizes and write an alltoall_perf log"),
    "fit-a2a": ("flexmoe.apps.fit_a2a", "fit the simulator's all-to-all to a cluster's alltoall_perf logs"),
}

# What each command imports from the train extra (`pip install 'flexmoe[train]'`: progress bars, plots, the
# digits data), each with the flag that turns off its use (None: always used). The library itself needs none of
# it; main checks it before a command runs, so that a machine without the extra gets one line naming it, not a
# traceback at the end of a run.
TRAIN_EXTRA_NEEDS: dict[str, tuple[tuple[str, str | None], ...]] = {
    "bench": (("tqdm", "json"),),
    "train": (("tqdm", "no_progress"), ("matplotlib", "no_plots")),
    "train-vision": (("tqdm", "no_progress"), ("matplotlib", "no_plots"), ("sklearn", None)),
    "calibrate": (("tqdm", "json"),),
    "validate-model": (("tqdm", "json"),),
    "simulate": (("matplotlib", "no_plot"),),
}


class _Parser(argparse.ArgumentParser):
    """An argument parser whose errors are one line ``error: ...`` (exit 2) like every other user error."""

    def error(self, message: str) -> None:  # type: ignore[override]
        _print_error(f"{self.prog}: {message} (see '{self.prog} --help')")
        raise SystemExit(USAGE_EXIT_CODE)


class _HelpFormatter(argparse.ArgumentDefaultsHelpFormatter):
    """Shows every flag's default, except where there is none to show (None, False, or a positional)."""

    def _get_help_string(self, action: argparse.Action) -> str:
        help_text = action.help or ""
        no_default = action.default is None or action.default is False or action.default == argparse.SUPPRESS
        if "(default" in help_text or no_default or not action.option_strings:
            return help_text
        return help_text + " (default: %(default)s)"


def _is_rank_zero() -> bool:
    """Under torchrun every rank fails alike; one of them (rank 0) says why."""
    return os.environ.get("RANK", "0") == "0"


def _print_error(message: str) -> None:
    if _is_rank_zero():
        print(f"error: {message}", file=sys.stderr, flush=True)


def _user_errors() -> tuple[type[BaseException], ...]:
    """The exceptions that mean the user asked for something that cannot work (not a bug in flexmoe)."""
    from flexmoe.apps.data import CorpusError
    from flexmoe.checkpoint import CheckpointError

    return UsageError, CorpusError, CheckpointError


def missing_train_extra(args: argparse.Namespace) -> list[str]:
    """The modules of the train extra that the command of ``args`` needs with its flags (:data:`TRAIN_EXTRA_NEEDS`)
    and this environment cannot import."""
    return [name for name, off in TRAIN_EXTRA_NEEDS.get(args.command, ())
            if not (off is not None and getattr(args, off)) and not _importable(name)]


def _importable(name: str) -> bool:
    try:
        return importlib.util.find_spec(name) is not None
    except (ImportError, ValueError):  # a finder that refuses the name; a module loaded without a spec
        return False


def _chosen_command(argv: list[str]) -> str | None:
    """The subcommand named on the command line (the first word that is one), if any."""
    return next((word for word in argv if word in COMMANDS), None)


def build_parser(command: str | None = None) -> argparse.ArgumentParser:
    """The parser; only ``command``'s module is imported and its flags added (all commands are listed)."""
    parser = _Parser(prog="flexmoe", description="Mixture-of-experts layers for PyTorch.",
                     formatter_class=_HelpFormatter)
    parser.add_argument("--version", action="version", version=f"flexmoe {flexmoe.__version__}")
    sub = parser.add_subparsers(dest="command", metavar="COMMAND", required=True, parser_class=_Parser)
    for name, (module_name, help_text) in COMMANDS.items():
        sub_parser = sub.add_parser(name, help=help_text, description=help_text, formatter_class=_HelpFormatter)
        if name == command:
            module = importlib.import_module(module_name)
            module.add_arguments(sub_parser)
            sub_parser.set_defaults(_run=module.run)
    return parser


def _subcommand_parser(parser: argparse.ArgumentParser, command: str) -> argparse.ArgumentParser:
    sub = next(a for a in parser._actions if isinstance(a, argparse._SubParsersAction))
    return sub.choices[command]


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else list(argv)
    parser = build_parser(_chosen_command(argv))
    args = parser.parse_args(argv)
    # Which flags the user set (not left at their defaults): --resume refuses those that differ from the run.
    args.given = given_flags(_subcommand_parser(parser, args.command), argv[argv.index(args.command) + 1:])
    missing = missing_train_extra(args)
    if missing:
        _print_error(f"flexmoe {args.command} needs {' and '.join(missing)}, which this environment lacks: "
                     f"pip install 'flexmoe[train]'")
        return USAGE_EXIT_CODE
    from flexmoe.apps.interrupt import Interrupted

    try:
        return int(args._run(args) or 0)
    except Interrupted as exc:  # a signal stopped the run after saving it: one line, the shell's 128 + signal
        if _is_rank_zero():
            print(str(exc), file=sys.stderr, flush=True)
        return exc.exit_code
    except KeyboardInterrupt:  # Ctrl-C outside a training loop (which saves first): nothing to save, one line
        if _is_rank_zero():
            print(f"flexmoe {args.command}: interrupted (SIGINT)", file=sys.stderr, flush=True)
        return 128 + signal.SIGINT
    except _user_errors() as exc:
        _print_error(str(exc).splitlines()[0] if str(exc) else type(exc).__name__)
        return USAGE_EXIT_CODE


if __name__ == "__main__":
    raise SystemExit(main())
