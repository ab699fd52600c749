"""When to run the router-lookahead prefetch: only while it pays in wall time.

The lookahead (``Model.pilot_prefetch``, spec §7.7) loads the experts layer L+1's router predicts
while layer L computes. From a disk with idle time that hides reads; but its misses are extra
reads, and from the page cache a "read" is a memory copy on a core the matmuls need: on a 2-core
machine a fixture decoded 37 tok/s with it and 43 without, from the page cache. So under ``auto``
the engine measures both: it decodes windows of ``window`` iterations with the prefetch on and
off, alternately until each setting has ``min_windows`` windows, then keeps the one with the lower
median seconds per emitted token over its last few windows, and re-tries the other now and then
(after ``probe_gap`` windows, a gap that doubles each time the probe loses). ``on`` and ``off`` fix
it. Prefetching never changes the tokens (tested), only when the experts are read.
"""
from __future__ import annotations

import statistics

MODES = ("auto", "on", "off")


def parse_prefetch(value) -> str:
    """A prefetch mode: 'auto', 'on' or 'off' (True / False map to auto / off)."""
    if value is True:
        return "auto"
    if value is False or value is None:
        return "off"
    v = str(value).strip().lower()
    if v not in MODES:
        raise ValueError(f"prefetch must be one of {', '.join(MODES)}, got {value!r}")
    return v


class PrefetchPolicy:
    """Decides, iteration by iteration, whether the lookahead prefetch runs (see the module doc)."""

    def __init__(self, mode="auto", window: int = 8, min_windows: int = 2, keep: int = 3,
                 first_probe_gap: int = 4, max_probe_gap: int = 32):
        self.mode = parse_prefetch(mode)
        self.window = max(int(window), 1)
        self.min_windows = max(int(min_windows), 1)
        self.keep = max(int(keep), 1)
        self.probe_gap = first_probe_gap
        self.max_probe_gap = max_probe_gap
        self.costs = {True: [], False: []}      # setting -> seconds per token of its windows
        self.iterations = {True: 0, False: 0}
        self._setting = self.mode != "off"
        self._in_window = 0                     # iterations of the current window so far
        self._seconds = 0.0
        self._tokens = 0
        self._since_probe = 0
        self._probing = False

    def enabled(self) -> bool:
        """Whether the next iteration runs the lookahead."""
        return self._setting

    def record(self, seconds: float, tokens: int) -> None:
        """One decode iteration: its wall time and the tokens it emitted."""
        self.iterations[self._setting] += 1
        if self.mode != "auto":
            return
        self._seconds += seconds
        self._tokens += max(int(tokens), 1)
        self._in_window += 1
        if self._in_window < self.window:
            return
        self.costs[self._setting].append(self._seconds / self._tokens)
        self._in_window, self._seconds, self._tokens = 0, 0.0, 0
        self._setting = self._next_setting()

    def _median(self, setting) -> float:
        return statistics.median(self.costs[setting][-self.keep:])

    def _next_setting(self) -> bool:
        if min(len(self.costs[True]), len(self.costs[False])) < self.min_windows:
            return not self._setting                          # measuring both, alternately
        best = self._median(True) <= self._median(False)
        if self._probing:                                     # a probe window of the other setting ended
            self._probing = False
            if best != self._setting:                         # it lost: probe it less often
                self.probe_gap = min(self.probe_gap * 2, self.max_probe_gap)
            return best
        self._since_probe += 1
        if self._since_probe >= self.probe_gap:
            self._since_probe = 0
            self._probing = True
            return not best
        return best

    def stats(self) -> dict:
        out = {"prefetch_mode": self.mode, "prefetch_on_iterations": self.iterations[True],
               "prefetch_off_iterations": self.iterations[False]}
        for setting, key in ((True, "on"), (False, "off")):
            if self.costs[setting]:
                out[f"prefetch_{key}_s_per_token"] = self._median(setting)
        return out
