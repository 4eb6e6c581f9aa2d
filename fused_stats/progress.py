"""Progress reporting for long commands, with one rule everywhere.

Role: a single place that decides how a long loop (training steps, probe batches) shows progress:

* stderr is a terminal: a tqdm bar (redrawn in place with ``\\r``);
* stderr is redirected (a log file, a pipe, CI): a plain line every ``interval`` seconds and one
  at the end, never a carriage return;
* disabled (``--no-progress``): nothing; the Hugging Face loading bars are silenced as well
  (:func:`quiet_hf_progress`).

Messages printed while a bar is shown go through :meth:`Progress.write` so that the bar is not torn.
"""

from __future__ import annotations

import os
import sys
import time


def stderr_is_terminal(stream=None) -> bool:
    stream = sys.stderr if stream is None else stream
    try:
        return bool(stream.isatty())
    except (AttributeError, ValueError):  # a closed or replaced stream
        return False


def quiet_hf_progress() -> None:
    """Silence the loading bars of transformers and huggingface_hub (if installed)."""
    os.environ["HF_HUB_DISABLE_PROGRESS_BARS"] = "1"
    try:
        from transformers.utils import logging as hf_logging

        hf_logging.disable_progress_bar()
    except ImportError:
        pass
    try:
        from huggingface_hub.utils import disable_progress_bars

        disable_progress_bars()
    except ImportError:
        pass


class Progress:
    """A counter over ``total`` units shown by the module's rule.

    Parameters
    ----------
    total : int or None
        Units expected (None: unknown).
    desc : str
        What is counted, e.g. ``"probe train"``.
    enabled : bool
        False: show nothing.
    unit : str
        What one unit is called, plural (``"batches"``, ``"steps"``).
    interval : float
        Seconds between plain lines when stderr is not a terminal.
    stream : file, optional
        Where to write (default ``sys.stderr`` at construction).
    """

    def __init__(
        self,
        total: int | None,
        desc: str,
        enabled: bool = True,
        unit: str = "steps",
        interval: float = 30.0,
        stream=None,
    ):
        self.total, self.desc, self.unit, self.interval = total, desc, unit, interval
        self.stream = sys.stderr if stream is None else stream
        self.count = 0
        self._bar = None
        self._plain = False
        self._start = self._last = time.perf_counter()
        if not enabled:
            return
        if stderr_is_terminal(self.stream):
            from tqdm.auto import tqdm

            self._bar = tqdm(total=total, desc=desc, unit=unit, file=self.stream, leave=False)
        else:
            self._plain = True

    def __enter__(self) -> Progress:
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    def set_description(self, desc: str) -> None:
        self.desc = desc
        if self._bar is not None:
            self._bar.set_description(desc)

    def update(self, n: int = 1) -> None:
        self.count += n
        if self._bar is not None:
            self._bar.update(n)
        elif self._plain and time.perf_counter() - self._last >= self.interval:
            self._line()

    def write(self, message: str, echo=print) -> None:
        """Print ``message`` (with ``echo``) without tearing a bar."""
        if self._bar is not None:
            from tqdm.auto import tqdm

            with tqdm.external_write_mode(file=self.stream):
                echo(message)
        else:
            echo(message)

    def close(self) -> None:
        if self._bar is not None:
            self._bar.close()
            self._bar = None
        elif self._plain:
            self._line()
            self._plain = False

    def _line(self) -> None:
        self._last = time.perf_counter()
        of = f"/{self.total}" if self.total is not None else ""
        print(
            f"{self.desc}: {self.count}{of} {self.unit}, {self._last - self._start:.0f} s",
            file=self.stream,
            flush=True,
        )
