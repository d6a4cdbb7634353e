"""A command's stages as they run, on stderr: a bar on a terminal, a line per stage elsewhere.

``rnnify convert`` of a real model spends minutes in single stages (the capture, the compile of
the decode step). On a terminal a tqdm bar names the stage that runs, and a stage that says
``spin`` also shows a spinner and its elapsed time moving, since nothing else would show that it
still runs. Piped into a log, under nohup or a job scheduler, a bar prints nothing (tqdm turns
itself off), which left such runs silent for minutes; there each stage prints a line as it starts
(``capture ...``) and one with its time as it ends (``capture: 31.0 s``), so the log says where the
time went and, while it runs, what it is doing.
"""

from __future__ import annotations

import itertools
import sys
import threading
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from typing import TextIO

__all__ = ["bar", "stages"]

SPIN_SECONDS = 0.25  # between two frames of a spinning stage
LOG_SECONDS = 30.0  # between two lines of a bar written to a log rather than a terminal


def bar(progress: bool, **options):
    """A tqdm bar on stderr for one long pass when ``progress`` (``options``: tqdm's): on a terminal as
    tqdm draws it; elsewhere, where tqdm would turn itself off and leave a log silent for the whole
    pass, a line every ``LOG_SECONDS`` and one at the end, none for a pass shorter than that (nor
    before an error that ends one)."""
    from tqdm import tqdm

    if not progress:
        return tqdm(disable=True, **options)
    if sys.stderr.isatty():
        return tqdm(file=sys.stderr, **options)
    return tqdm(file=_NewLines(sys.stderr), mininterval=LOG_SECONDS, delay=LOG_SECONDS, **{**options, "leave": True})


class _NewLines:
    """A file for tqdm that ends each of its redraws (``\\r`` + the bar) as a line of its own."""

    def __init__(self, file: TextIO) -> None:
        self.file = file

    def write(self, text: str) -> None:
        text = text.replace("\r", "").strip()
        if text:
            print(text, file=self.file, flush=True)

    def flush(self) -> None:
        self.file.flush()


@contextmanager
def stages(total: int, unit: str, leave: bool = True, lines: bool = True) -> Iterator[Callable[..., None]]:
    """``start(stage, spin=False)``, to call as each of ``total`` stages starts; the last ends with the
    block (one that raised has no end: its error says what happened). On a terminal a bar of ``unit``
    (kept when done if ``leave``); elsewhere a line as each starts and ends, or nothing unless ``lines``."""
    file = sys.stderr
    report = _Bar(total, unit, leave, file) if file.isatty() else _Lines(file) if lines else _Quiet()
    try:
        yield report.start
        report.end()
    finally:
        report.close()


class _Quiet:
    def start(self, stage: str, spin: bool = False) -> None:
        pass

    def end(self) -> None:
        pass

    def close(self) -> None:
        pass


class _Lines(_Quiet):
    def __init__(self, file: TextIO) -> None:
        self.file, self.stage, self.since = file, None, 0.0

    def start(self, stage: str, spin: bool = False) -> None:
        self.end()
        print(f"{stage} ...", file=self.file, flush=True)
        self.stage, self.since = stage, time.perf_counter()

    def end(self) -> None:
        if self.stage is not None:
            print(f"{self.stage}: {time.perf_counter() - self.since:.1f} s", file=self.file, flush=True)
            self.stage = None


class _Bar(_Quiet):
    def __init__(self, total: int, unit: str, leave: bool, file: TextIO) -> None:
        from tqdm import tqdm

        self.bar = tqdm(total=total, unit=unit, leave=leave, file=file)
        self.started = False
        self.spinning: tuple[threading.Thread, threading.Event] | None = None

    def start(self, stage: str, spin: bool = False) -> None:
        self._stop_spinning()
        if self.started:
            self.bar.update()
        self.started = True
        self.bar.set_description_str(stage)
        if spin:
            stop = threading.Event()
            thread = threading.Thread(target=self._spin, args=(stop,), daemon=True)
            thread.start()
            self.spinning = (thread, stop)

    def end(self) -> None:
        self._stop_spinning()
        self.bar.update()

    def close(self) -> None:
        self._stop_spinning()
        self.bar.close()

    def _spin(self, stop: threading.Event) -> None:
        """Redraw the bar with the next spinner frame, which also moves its elapsed time, until ``stop``."""
        for frame in itertools.cycle("|/-\\"):
            if stop.wait(SPIN_SECONDS):
                return
            self.bar.set_postfix_str(frame)

    def _stop_spinning(self) -> None:
        if self.spinning is not None:
            thread, stop = self.spinning
            stop.set()
            thread.join()
            self.spinning = None
            self.bar.set_postfix_str("", refresh=False)
