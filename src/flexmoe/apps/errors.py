"""The one way a ``flexmoe`` subcommand reports a user's mistake.

A subcommand raises :class:`UsageError` (a bad flag value, a missing or unusable file, a run directory it must
not touch); :func:`flexmoe.apps.cli.main` prints it as one line ``error: ...`` on stderr and exits with code 2,
without a traceback. Under torchrun every rank raises the same error and exits 2; only rank 0 prints it.
"""

from __future__ import annotations

__all__ = ["UsageError", "USAGE_EXIT_CODE"]

USAGE_EXIT_CODE = 2  # what argparse uses for bad flags, so every user error exits alike


class UsageError(Exception):
    """A user error: the message names the file or flag and what would work (one line, no traceback)."""
