"""What every ``flexmoe`` flag accepts, checked while the command line is parsed.

Each numeric or named flag's ``type=`` is one of the value kinds below (a :class:`Number` with its bounds, or a
:class:`Choice`). argparse calls
it on the flag's text before any subcommand runs, and its :class:`argparse.ArgumentTypeError` becomes the one
line ``error: flexmoe COMMAND: argument --FLAG: must be ..., got ...`` with exit code 2
(:class:`flexmoe.apps.cli._Parser`), so a bad value never reaches a file, a process group or an optimizer.
What one flag cannot say alone (``--k`` against ``--num-experts``, a world size against the experts) is
checked by the subcommand, still before anything is written or launched, as is a path the command will write
(:func:`check_writable_dir`).

:func:`given_flags` tells which flags a command line set (rather than left at their defaults), which
``--resume`` needs to refuse a flag that contradicts the saved run.
"""

from __future__ import annotations

import argparse
import math
import tempfile
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path

from flexmoe.apps.errors import UsageError

__all__ = ["Number", "Choice", "COUNT", "NON_NEGATIVE", "SEED", "POSITIVE", "NON_NEGATIVE_REAL", "FINITE", "FRACTION",
           "SHARE", "RATIO", "given_flags", "check_writable_dir"]


@dataclass(frozen=True)
class Number:
    """A flag value type: an ``int`` (``integer=True``) or a finite ``float`` within the bounds.

    ``low`` / ``high``: the bounds (None: open); ``low_open`` / ``high_open``: whether the bound itself is
    excluded. Called with the flag's text, returns the number or raises :class:`argparse.ArgumentTypeError`
    saying what is accepted."""

    integer: bool
    low: float | None = None
    high: float | None = None
    low_open: bool = False
    high_open: bool = False

    @property
    def __name__(self) -> str:  # argparse names the type in some of its messages
        return "integer" if self.integer else "number"

    def accepted(self) -> str:
        """What the flag accepts, in words: ``an integer >= 1``, ``a number in [0, 1)``, ..."""
        kind = "an integer" if self.integer else "a finite number"
        if self.low is not None and self.high is not None:
            return (f"{kind} in {'(' if self.low_open else '['}{self.low:g}, {self.high:g}"
                    f"{')' if self.high_open else ']'}")
        if self.low is not None:
            return f"{kind} {'>' if self.low_open else '>='} {self.low:g}"
        if self.high is not None:
            return f"{kind} {'<' if self.high_open else '<='} {self.high:g}"
        return kind

    def __call__(self, text: str) -> int | float:
        try:
            value: int | float = int(text) if self.integer else float(text)
        except ValueError:
            raise argparse.ArgumentTypeError(f"must be {self.accepted()}, got {text!r}") from None
        if not math.isfinite(value) or not self._within(value):
            raise argparse.ArgumentTypeError(f"must be {self.accepted()}, got {text}")
        return value

    def _within(self, value: float) -> bool:
        if self.low is not None and (value <= self.low if self.low_open else value < self.low):
            return False
        return not (self.high is not None and (value >= self.high if self.high_open else value > self.high))


@dataclass(frozen=True)
class Choice:
    """A flag value type: one of ``values`` (argparse's ``choices``, as a type, so that it fits a table of
    flag -> type)."""

    values: tuple[str, ...]

    @property
    def __name__(self) -> str:
        return "choice"

    def __call__(self, text: str) -> str:
        if text not in self.values:
            raise argparse.ArgumentTypeError(f"must be one of {', '.join(self.values)}, got {text!r}")
        return text


# The kinds the subcommands use (each flag's help says what it means).
COUNT = Number(integer=True, low=1)  # sizes, steps, ranks, intervals
NON_NEGATIVE = Number(integer=True, low=0)  # warm-up steps, tokens to generate
SEED = Number(integer=True, low=0, high=2**63 - 1)  # torch.manual_seed's range, less the negative half
POSITIVE = Number(integer=False, low=0, low_open=True)  # learning rate, temperature, milliseconds, GiB
NON_NEGATIVE_REAL = Number(integer=False, low=0)  # loss coefficients, a target loss
FINITE = Number(integer=False)  # capacity factor (0: dropless, < 0: adaptive)
FRACTION = Number(integer=False, low=0, high=1, high_open=True)  # dropout
SHARE = Number(integer=False, low=0, high=1)  # a share of tokens
RATIO = Number(integer=False, low=1)  # the hottest expert's load over the mean


class _Unset:
    """Marks a flag the command line left out (see :func:`given_flags`)."""


def given_flags(parser: argparse.ArgumentParser, argv: Sequence[str]) -> frozenset[str]:
    """The destinations (``n_layer``, ``data``, ...) of the flags that ``argv`` sets on ``parser``.

    ``argv`` is parsed once more into a namespace whose every destination already holds a marker: argparse fills
    in a default only where a destination is absent, so the ones still holding the marker were not given
    (abbreviations such as ``--n-lay`` count as given, as argparse reads them)."""
    unset = _Unset()
    dests = {a.dest for a in parser._actions if a.dest != argparse.SUPPRESS}
    parsed = parser.parse_args(list(argv), argparse.Namespace(**dict.fromkeys(dests, unset)))
    return frozenset(dest for dest in dests if getattr(parsed, dest) is not unset)


def check_writable_dir(path: Path, flag: str) -> None:
    """``path`` is (or can be made) a directory this process can write into, else :class:`UsageError`."""
    existing = path
    while not existing.exists():  # the nearest ancestor that exists is where the directories get created
        existing = existing.parent
    if not existing.is_dir():
        raise UsageError(f"{flag} {path}: {existing} is a file, so no directory can be made there")
    try:  # a probe, rather than os.access: root passes every permission check, yet /proc or a read-only mount fail
        tempfile.TemporaryDirectory(dir=existing, prefix=".flexmoe-probe-").cleanup()
    except OSError as exc:
        where = "" if existing == path else f" (in {existing}, where it would be created)"
        raise UsageError(f"{flag} {path}: cannot write there{where}: {exc.strerror}; give a writable directory") \
            from None
