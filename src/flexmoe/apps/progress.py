"""Progress of long measurements on stderr: a tqdm bar whose steps are the measurement's own announcements.

calibrate and validate-model announce each piece of work before starting it (``log("measuring ...")``);
:class:`StepBar` turns those announcements into a bar: the piece being measured is its description, and a piece
counts as done when the next one is announced (or the bar is closed).
"""

from __future__ import annotations

import sys
from typing import Any

__all__ = ["StepBar"]


class StepBar:
    """A progress bar of ``total`` announced steps; call it with each announcement, ``close()`` at the end."""

    def __init__(self, total: int, desc: str, enabled: bool = True) -> None:
        self._bar: Any = None
        self._started = 0
        if enabled:
            from tqdm import tqdm

            self._bar = tqdm(total=total, desc=desc, unit="step", file=sys.stderr, dynamic_ncols=True)

    def __call__(self, message: str) -> None:
        if self._bar is None:
            return
        if self._started:
            self._bar.update(1)  # the previous announced step is done
        self._started += 1
        self._bar.write(message, file=sys.stderr)
        self._bar.set_postfix_str(message[:60])

    def close(self) -> None:
        if self._bar is not None:
            self._bar.update(max(self._bar.total - self._bar.n, 0))
            self._bar.close()

    def __enter__(self) -> StepBar:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()
