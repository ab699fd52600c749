"""Draft-depth policy for speculative decoding: drafts must earn their keep in wall time.

In a streaming MoE engine a verify forward of 1+d rows routes to more experts than a single-row
step, so speculation can lose time even at 50% acceptance. The policy therefore measures, per
generation, what an iteration costs at each depth and what the drafts yield, and picks the depth d
(0 included) that minimises the expected seconds per emitted token:

    cost(d) / E[tokens | d],   E[tokens | d] = 1 + a + a² + … + a^d

with ``a`` the measured per-draft acceptance (drafts are accepted as a prefix) and ``cost(d)`` the
measured (or, for untried depths, linearly extrapolated) wall time of one draft+verify iteration.
While it sits at depth 0 it re-probes depth 1 now and then, with a growing gap, so a head that
becomes useful is noticed and a useless one costs a few iterations per generation.

The reference engine's guard is kept: after >= 24 proposals with < 10% accepted, drafting is off
for the rest of the generation.
"""
from __future__ import annotations

GUARD_MIN_PROPOSALS = 24
GUARD_MIN_ACCEPT = 0.10
MAX_AUTO_DEPTH = 4


def parse_draft(text) -> "int | str":
    """``--draft`` value: 'auto' or a depth 0..16."""
    if isinstance(text, int):
        value = text
    elif str(text).strip().lower() == "auto":
        return "auto"
    else:
        try:
            value = int(text)
        except ValueError:
            raise ValueError(f"--draft must be 'auto' or a depth 0..16, got {text!r}") from None
    if not 0 <= value <= 16:
        raise ValueError(f"--draft must be 'auto' or a depth 0..16, got {value}")
    return value


class DraftPolicy:
    """Chooses the draft depth of each speculative-decoding iteration and keeps the counters."""

    def __init__(self, mode="auto", max_depth: int = MAX_AUTO_DEPTH, ema: float = 0.3,
                 first_probe_gap: int = 64, max_probe_gap: int = 1024):
        self.mode = parse_draft(mode)
        self.max_depth = self.mode if isinstance(self.mode, int) else max_depth
        self.ema = ema
        self.cost = {}                  # depth -> EMA of seconds per iteration
        self.proposed = 0               # drafts proposed (before clipping, as the reference counts)
        self.accepted = 0
        self.iterations = 0
        self.off = self.max_depth == 0  # the guard (or --draft 0) turned drafting off
        self.probe_gap = first_probe_gap
        self.max_probe_gap = max_probe_gap
        self._since_probe = 0
        self._last = 0
        self.min_p = 0.0                # the draft chain ends below this top-1 probability (mtp_draft)
        self.verified_at = [0] * (self.max_depth + 1)   # drafts verified / accepted, by position
        self.accepted_at = [0] * (self.max_depth + 1)
        self.time_s = {"draft": 0.0, "verify": 0.0, "absorb": 0.0, "iterations": 0.0}

    # -- decisions ------------------------------------------------------------------------------

    def acceptance(self) -> float:
        """Per-draft acceptance with a weak prior (one accepted in two) so few samples don't pin it."""
        return (self.accepted + 1.0) / (self.proposed + 2.0)

    def expected_tokens(self, d: int, a: float = None) -> float:
        a = self.acceptance() if a is None else a
        return sum(a ** i for i in range(d + 1))

    def estimated_cost(self, d: int):
        """Seconds per iteration at depth d: measured, or extrapolated from the measured depths."""
        if d in self.cost:
            return self.cost[d]
        known = sorted(self.cost)
        if len(known) >= 2:
            (d0, c0), (d1, c1) = (known[0], self.cost[known[0]]), (known[-1], self.cost[known[-1]])
            slope = max((c1 - c0) / (d1 - d0), 0.0)
            return c1 + slope * (d - d1) if d > d1 else c0 + slope * (d - d0)
        return None

    def depth(self) -> int:
        """Depth for the next iteration."""
        if self.off:
            return 0
        if isinstance(self.mode, int):
            return self.mode
        if 0 not in self.cost:
            return self._choose(0)
        if 1 not in self.cost:
            return self._choose(1)
        best = min(range(self.max_depth + 1), key=self._score)
        if best == 0:
            self._since_probe += 1
            if self._since_probe >= self.probe_gap:        # re-probe depth 1 now and then
                self._since_probe = 0
                self.probe_gap = min(self.probe_gap * 2, self.max_probe_gap)
                return self._choose(1)
        return self._choose(best)

    def _score(self, d: int) -> float:
        c = self.estimated_cost(d)
        return float("inf") if c is None else c / self.expected_tokens(d)

    def _choose(self, d: int) -> int:
        self._last = d
        return d

    # -- measurements ---------------------------------------------------------------------------

    def record(self, depth: int, proposed: int, accepted: int, seconds: float, verified: int = None,
               parts=None):
        """One iteration: the depth it ran at, drafts proposed / accepted, its wall time (without
        one-off catch-up); verified: drafts that went into the verify batch (default: proposed);
        parts: its seconds (draft chain, verify forward, MTP absorb, whole iteration)."""
        self.iterations += 1
        self.proposed += proposed
        self.accepted += accepted
        verified = proposed if verified is None else verified
        for i in range(min(verified, len(self.verified_at))):
            self.verified_at[i] += 1
            self.accepted_at[i] += i < accepted
        if parts is not None:
            for key, v in zip(("draft", "verify", "absorb", "iterations"), parts):
                self.time_s[key] += v
        if depth in self.cost:
            self.cost[depth] += self.ema * (seconds - self.cost[depth])
        else:
            self.cost[depth] = seconds
        if depth > 0 and accepted > 0 and self._score(depth) < self._score(0):
            self.probe_gap = 8                              # drafting pays: come back to it soon
        if self.proposed >= GUARD_MIN_PROPOSALS and self.accepted < GUARD_MIN_ACCEPT * self.proposed:
            self.off = True

    def stats(self) -> dict:
        t = self.time_s
        return {"drafts_proposed": self.proposed, "drafts_accepted": self.accepted,
                "acceptance": (self.accepted / self.proposed) if self.proposed else 0.0,
                "draft_off": self.off, "draft_iterations": self.iterations,
                "draft_cost_s": {str(k): v for k, v in sorted(self.cost.items())},
                # acceptance of the i-th draft among the iterations that verified an i-th draft
                "acceptance_by_position": [a / v for a, v in zip(self.accepted_at, self.verified_at) if v],
                "drafts_verified_by_position": [v for v in self.verified_at if v],
                "time_draft_s": t["draft"], "time_verify_s": t["verify"], "time_absorb_s": t["absorb"],
                "time_spec_python_s": max(t["iterations"] - t["draft"] - t["verify"] - t["absorb"], 0.0)}
