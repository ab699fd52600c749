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

Given the expert cache's counters (``counters``: a callable returning ``ExpertCache.stats``), a
window with the prefetch on is also judged by its reads: one that loaded nothing (every predicted
expert was in memory already: only the lookahead's router work was spent) or whose loads were
wasted (evicted unused, or dropped) more often than used has lost whatever its time, and the
policy turns the prefetch off at once and keeps it off until a later probe window (after
``probe_gap`` windows, as above) pays in reads; then the times decide again.
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
                 first_probe_gap: int = 4, max_probe_gap: int = 32, counters=None):
        self.mode = parse_prefetch(mode)
        self.counters = counters                # None, or () -> ExpertCache.stats
        self.lost_on_reads = 0                  # prefetch windows lost by their reads (see the module doc)
        self._at_start = None                   # the counters when the current window started
        self._read_lost = False                 # the last prefetch window lost by its reads
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
        if self._in_window == 0 and self.mode == "auto" and self._setting and self.counters is not None:
            self._at_start = _reads(self.counters())
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
        if self._setting:
            self._read_lost = not self._reads_paid()
            self.lost_on_reads += self._read_lost
        self._setting = self._next_setting()

    def _reads_paid(self) -> bool:
        """Whether the prefetch window that just ended loaded something and used at least as many
        of its loads as it wasted (True when there are no counters to tell)."""
        if self.counters is None or self._at_start is None:
            return True
        loaded, used, lost = (b - a for a, b in zip(self._at_start, _reads(self.counters())))
        self._at_start = None
        return loaded > 0 and used >= lost

    def _median(self, setting) -> float:
        return statistics.median(self.costs[setting][-self.keep:])

    def _next_setting(self) -> bool:
        if self._read_lost:                                   # off whatever the times, until a probe pays
            best = False
        elif min(len(self.costs[True]), len(self.costs[False])) < self.min_windows:
            return not self._setting                          # measuring both, alternately
        else:
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
               "prefetch_off_iterations": self.iterations[False],
               "prefetch_windows_lost_on_reads": self.lost_on_reads}
        for setting, key in ((True, "on"), (False, "off")):
            if self.costs[setting]:
                out[f"prefetch_{key}_s_per_token"] = self._median(setting)
        return out


def _reads(stats) -> tuple:
    """(loads, loads used, loads wasted or dropped) of the prefetch, from ExpertCache.stats."""
    return (stats["prefetch_loaded"], stats["prefetch_used"],
            stats["prefetch_wasted"] + stats["prefetch_dropped"])
