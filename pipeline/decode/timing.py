"""One timer for every latency figure: CUDA events on GPU, a synchronized perf_counter on CPU.

    from pipeline.decode.timing import Timer
    t = Timer(device)
    with t.measure("verify") as m:
        logits = model(...)
    t.collect()          # CUDA: events are read here, one sync for many blocks
    t.samples["verify"]  # list of seconds, one per measured block; m.seconds: this block's

Laps (`m = t.lap("round")` in each iteration, `t.end_lap("round")` after the loop) time each
iteration to the start of the next, so the laps add up to the whole loop.
"""
from __future__ import annotations

import contextlib
import time
from collections import defaultdict
from dataclasses import dataclass
from typing import Iterator

import torch


@dataclass(eq=False)
class Measurement:
    """One measured block; a caller keeps it to read that block's time."""

    name: str
    seconds: float | None = None


class Timer:
    def __init__(self, device: torch.device | str = "cpu", enabled: bool = True):
        self.device = torch.device(device)
        self.enabled = enabled
        self.samples: dict[str, list[float]] = defaultdict(list)
        self._pending: list[tuple[Measurement, object, object]] = []
        self._laps: dict[str, tuple[Measurement, object]] = {}  # name -> (open lap, its start mark)

    @contextlib.contextmanager
    def measure(self, name: str) -> Iterator[Measurement]:
        m = Measurement(name)
        if not self.enabled:
            yield m
            return
        start = self._mark()
        yield m
        self._close(m, start, self._mark())

    def _mark(self):
        """A point in time: a recorded CUDA event (read at collect), else perf_counter now."""
        if self.device.type == "cuda":
            event = torch.cuda.Event(enable_timing=True)
            event.record()
            return event
        return time.perf_counter()

    def _close(self, m: Measurement, start, end) -> None:
        if self.device.type == "cuda":
            self._pending.append((m, start, end))
        else:
            m.seconds = end - start
            self.samples[m.name].append(m.seconds)

    def lap(self, name: str) -> Measurement:
        """End the open lap `name` (if any) now and start the next one; returns the new lap's
        Measurement (its seconds are known once it ends, on CUDA at collect())."""
        m = Measurement(name)
        if not self.enabled:
            return m
        now = self._mark()
        if name in self._laps:
            prev, start = self._laps[name]
            self._close(prev, start, now)
        self._laps[name] = (m, now)
        return m

    def end_lap(self, name: str) -> None:
        """End the open lap `name`, if any (after a loop's last iteration)."""
        if self.enabled and name in self._laps:
            prev, start = self._laps.pop(name)
            self._close(prev, start, self._mark())

    def collect(self) -> dict[str, list[float]]:
        """Resolve pending CUDA events (a sync point) and return all samples in seconds."""
        if self._pending:
            torch.cuda.synchronize(self.device)
            for m, start, end in self._pending:
                m.seconds = start.elapsed_time(end) / 1000.0  # type: ignore[attr-defined]
                self.samples[m.name].append(m.seconds)
            self._pending.clear()
        return dict(self.samples)


def synchronize(device: torch.device) -> None:
    """A CPU-GPU sync point: call it before reading a wall clock around device work."""
    if device.type == "cuda":
        torch.cuda.synchronize(device)
