"""The ``flexmoe`` command. Each subcommand lives in its own module, which provides
``add_arguments(parser)`` and ``run(args) -> int``; this file only wires them together."""

from __future__ import annotations

import argparse
import importlib
import sys

# name -> (module, one-line help). The module is imported only when its command runs or help is shown.
COMMANDS: dict[str, tuple[str, str]] = {
    "bench": ("flexmoe.apps.bench", "time one MoE layer against the compute floor and reference layers"),
    "train": ("flexmoe.apps.train", "train the MoE GPT (or its dense twin) on tiny Shakespeare or any text file"),
    "generate": ("flexmoe.apps.generate", "sample text from a training run's checkpoint"),
    "reshard": ("flexmoe.apps.reshard", "rewrite a checkpoint for another number of expert-parallel ranks"),
    "calibrate": ("flexmoe.apps.calibrate", "measure this machine and write the cost model's JSON profile"),
    "validate-model": ("flexmoe.apps.validate", "measure the layer, compare with the cost model, print the error"),
    "simulate": ("flexmoe.apps.simulate", "predict single-layer throughput from 8 to 2,048 GPUs from a profile"),
}


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="flexmoe", description="Mixture-of-experts layers for PyTorch.")
    sub = parser.add_subparsers(dest="command", metavar="COMMAND", required=True)
    for name, (module_name, help_text) in COMMANDS.items():
        module = importlib.import_module(module_name)
        command = sub.add_parser(name, help=help_text, description=help_text)
        module.add_arguments(command)
        command.set_defaults(_run=module.run)
    return parser


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(sys.argv[1:] if argv is None else argv)
    return int(args._run(args) or 0)


if __name__ == "__main__":
    raise SystemExit(main())
