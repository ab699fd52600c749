"""Draft-depth policy for speculative decoding: drafts must earn their keep in wall time.

In a streaming MoE engine a verify forward of 1+d rows routes to more experts than a single-row
step, and on a small model every extra row costs compute, so speculation can lose time even at
high acceptance. The policy therefore measures what matters - seconds per emitted token at each
depth d (0 included): the measured seconds of an iteration at d (the median of its last few) over
the tokens an iteration at d emits, 1 + P(draft 1 accepted) + P(drafts 1 and 2 accepted) + ...,
those rates pooled over every drafting iteration (the i-th draft's fate does not depend on how many
drafts follow it). It runs one depth (the incumbent) and climbs: now and then it probes one depth
up (after a loss, one down) for a short block of iterations, and only a probe's verdict changes the
depth. The verdict compares costs measured close together - the probe block's iterations against
the incumbent's own last ones - so a figure measured minutes ago (a cold cache after load, the
host's slower minute) never decides against a fresh one. A verdict within the noise of the two
medians (iterations that wait on expert reads vary by a factor of several) extends the probe, up to
MAX_PROBE iterations; still unsure, the shallower depth is kept and the next probe comes as soon.
The SETTLE iterations after a losing probe (whose verify rows evicted experts they need), the first
ones of a generation (after the prefill's loads) and the first of a probe (the incumbent's cache
state) are not taken as costs.
A probe up whose best case loses (one more row priced at what the last row cost, over the tokens
the acceptance by position says it would add) is not run and counts as lost.
A probe that wins becomes the depth and the next step that way comes soon; a probe that loses
quadruples the gap to the next one, so a useless head costs a few iterations per generation and a
useful one is found within the first few dozen tokens; the pooled acceptance keeps a short probe's
verdict from being a matter of luck.

A policy can start from a previous generation's (``prior``): an LLM, the chat and the server pass
the last one on, so a session's later requests begin at the depth that won before, and the count
towards the next probe goes on where it stopped (no probe starts in a generation's first SETTLE
iterations).

The reference engine's guard is kept: after >= 24 drafts tested with < 10% accepted, drafting is
off for the rest of the generation (drafts a verify forward dropped for their expert reads were
not tested and do not count).
"""
from __future__ import annotations

import statistics

GUARD_MIN_PROPOSALS = 24
GUARD_MIN_ACCEPT = 0.10
MAX_AUTO_DEPTH = 4
RECENT = 9                  # iterations of a depth whose median is its cost
SETTLE = 2                  # iterations after a losing probe / a generation's start not taken as costs
SETTLE_PROBE = 1            # ... and at a probe's start
ACCEPT_PRIOR = 2.0          # verifies' worth of the guess a draft position's rate starts from
ACCEPT_DECAY = 0.99         # per verified draft: the acceptance follows the text over ~100 drafts
MAX_PROBE = 16              # iterations a probe may run while its verdict is within the noise
NOISE_Z = 1.0               # ... the noise: this many spreads of the difference of the medians
DROP_MIN_VERIFIED = 8       # drafts verified at position 1 before a verify forward may drop rows
DROP_EXPLORE_EVERY = 8      # ... and every 8th verify forward tests the first draft regardless


def _mad(xs) -> float:
    """1.4826 x the median absolute deviation: a spread that a few slow iterations (expert reads)
    do not inflate; the standard deviation for normal samples."""
    m = statistics.median(xs)
    return 1.4826 * statistics.median([abs(x - m) for x in xs])


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

    def __init__(self, mode="auto", max_depth: int = MAX_AUTO_DEPTH, prior: "DraftPolicy" = None,
                 probe_block: int = 4, first_probe_gap: int = 4, max_probe_gap: int = 512,
                 decay: float = 0.9, margin: float = 0.02):
        self.mode = parse_draft(mode)
        self.max_depth = self.mode if isinstance(self.mode, int) else max_depth
        self.probe_block, self.max_probe_gap = probe_block, max_probe_gap
        self.decay, self.margin = decay, margin
        self._recent = {}               # depth -> its last RECENT iteration times (the median is its cost)
        self.count = {}                 # depth -> decayed number of its iterations
        self._drafted = {}              # depth -> decayed [drafts proposed, drafts verified]
        self._ver = [0.0] * (self.max_depth + 1)        # decayed: iterations that verified draft i
        self._acc = [0.0] * (self.max_depth + 1)        # ... and accepted drafts 1..i+1
        self.proposed = 0               # drafts proposed (before clipping, as the reference counts)
        self.verified = 0               # drafts a verify forward tested
        self.accepted = 0
        self.iterations = 0
        self.off = self.max_depth == 0  # the guard (or --draft 0) turned drafting off
        self.probe_gap = self.first_probe_gap = first_probe_gap
        self._from = 0                  # the depth a probe started from
        self._cur = 0                   # depth of the current block
        self._left = 0                  # iterations left in it
        self._probe = None              # the depth being probed (None: running the incumbent)
        self._since = 0                 # iterations since the last probe
        self._up = True                 # direction of the next probe
        self._block = []                # the current probe block's iteration times
        self._settle = SETTLE           # iterations left whose times are not the incumbent's cost
        self._verify_calls = 0          # verify_values calls (the drop rule's exploration rhythm)
        self.min_p = 0.0                # the draft chain ends below this top-1 probability (mtp_draft)
        self.verified_at = [0] * (self.max_depth + 1)   # drafts verified / accepted, by position
        self.accepted_at = [0] * (self.max_depth + 1)
        self.time_s = {"draft": 0.0, "verify": 0.0, "absorb": 0.0, "iterations": 0.0}
        if prior is not None and self.mode == "auto" and prior.mode == "auto":
            # a previous generation's measurements, at half weight: the next ones soon outweigh them
            self.count = {d: n / 2 for d, n in prior.count.items() if d <= self.max_depth}
            self._drafted = {d: [v / 2 for v in pv] for d, pv in prior._drafted.items() if d <= self.max_depth}
            self._recent = {d: list(v) for d, v in prior._recent.items() if d <= self.max_depth}
            for i in range(min(len(prior._ver), len(self._ver))):
                self._ver[i], self._acc[i] = prior._ver[i] / 2, prior._acc[i] / 2
            self._cur = prior.incumbent()
            self.probe_gap = min(max(prior.probe_gap, first_probe_gap), 64)
            # the probes' rhythm goes on across generations: restarting the count at each one
            # would let a gap longer than a generation (up to 64 iterations) stop probing for good
            # and pin the depth that won first
            self._since, self._up = prior._since, prior._up

    # -- decisions ------------------------------------------------------------------------------

    def acceptance(self) -> float:
        """Per-draft acceptance with a weak prior (one accepted in two) so few samples don't pin it."""
        return (self.accepted + 1.0) / (self.proposed + 2.0)

    def expected_tokens(self, d: int) -> float:
        """Tokens an iteration at depth d emits: 1 + sum over r <= d of P(drafts 1..r accepted)
        (the pooled rates), times the share of d's drafts that verify forwards tested (those that
        drop drafts for their expert reads emit fewer than the drafts' acceptance says)."""
        proposed, verified = self._drafted.get(d, (0.0, 0.0))
        return 1.0 + sum(self.prefix_acceptance(d)) * (verified + 1.0) / (proposed + 1.0)

    def prefix_acceptance(self, d: int) -> list:
        """[P(drafts 1..r accepted) for r = 1..d], measured per position; each position's rate is
        drawn towards the guess its predecessor makes (one in two at the first, then the last
        ratio P(1..r) / P(1..r-1) carried on) by ACCEPT_PRIOR verifies' worth, so a deep position
        seen in a few probe iterations is not judged on their luck alone."""
        out, p, ratio = [], 1.0, 0.5
        for i in range(d):
            guess = p * min(ratio, 1.0)
            n = self._ver[i] if i < len(self._ver) else 0.0
            q = guess if n <= 0 else min((self._acc[i] + ACCEPT_PRIOR * guess) / (n + ACCEPT_PRIOR), p)
            ratio = q / p if p > 0 else 0.0
            p = q
            out.append(p)
        return out

    def verify_values(self, g: int):
        """P(drafts 1..r accepted) for the r = 1..g drafts of a verify batch, what the engine weighs
        their expert reads against (Model._rows_to_keep); None (keep every row) while few drafts
        were verified. A dropped draft is never tested, so an estimate that says "drop" would
        never be corrected (one unlucky early rejection would keep the drafts of a whole generation
        out): every DROP_EXPLORE_EVERY-th call counts the first draft as sure, so that one is tested
        (the rows after it are weighed as usual)."""
        self._verify_calls += 1
        if self._ver[0] < DROP_MIN_VERIFIED:
            return None
        values = self.prefix_acceptance(g)
        if self._verify_calls % DROP_EXPLORE_EVERY == 0 and values:
            values[0] = 1.0
        return values

    def iteration_seconds(self, d: int):
        """The median of depth d's last RECENT iterations (None: never run)."""
        r = self._recent.get(d)
        return statistics.median(r) if r else None

    def incumbent(self) -> int:
        """The depth the policy runs between probes (a running probe's starting depth)."""
        return self._from if self._probe is not None else self._cur

    def depth(self) -> int:
        """Depth for the next iteration."""
        if self.off:
            return 0
        if isinstance(self.mode, int):
            return self.mode
        if self._left > 0:
            self._left -= 1
            return self._cur
        if self._probe is not None:                 # a probe block ended: did it win?
            verdict = self._verdict(self._probe, self._from)
            if verdict == "unsure" and len(self._block) < MAX_PROBE:
                self._left = self.probe_block - 1   # not told yet: more of the probe
                return self._cur
            probe, self._probe = self._probe, None
            # still unsure after MAX_PROBE: the shallower depth, which spends less on drafts that
            # may not pay (a probe down wins, a probe up loses)
            won = verdict == "win" or (verdict == "unsure" and probe < self._from)
            up = probe > self._from
            # a win: soon one more step the same way; a loss: wait longer, then try the other way
            self._up = up if won else not up
            self._cur = probe if won else self._from
            if won:
                self.probe_gap = self.first_probe_gap
                self._recent[probe] = list(self._block)     # its cost from now on: fresh samples only
            else:
                if verdict == "lose":               # unsure: no slower than before, try again as soon
                    self.probe_gap = min(4 * self.probe_gap, self.max_probe_gap)
                self._settle = SETTLE
        self._since += 1
        if self._since >= self.probe_gap and self._settle == 0:    # not while the incumbent settles
            cand = self._cur + 1 if (self._up or self._cur == 0) and self._cur < self.max_depth else self._cur - 1
            if not 0 <= cand <= self.max_depth or cand == self._cur:
                return self._cur
            self._since = 0
            if cand > self._cur and self._cannot_pay(cand):
                # a probe up that even a cost linear in the rows says loses: not run, taken as lost
                self._up = False
                self.probe_gap = min(4 * self.probe_gap, self.max_probe_gap)
            else:
                # a depth measured before needs fewer iterations to bring its figures up to date
                # (+ SETTLE_PROBE: its first iterations pay for the incumbent's cache state)
                n = (self.probe_block if cand not in self.count else max(self.probe_block // 2, 1)) + SETTLE_PROBE
                self._from, self._probe, self._cur, self._left = self._cur, cand, cand, n - 1
                self._block, self._settle = [], SETTLE_PROBE
        return self._cur

    def _cannot_pay(self, cand: int) -> bool:
        """Whether a probe from depth cand - 1 = d >= 1 up to cand would lose even if one more row
        cost only what the last one did: the iteration at cand priced at c(d) + (c(d) - c(d-1)),
        the medians of the two shallower depths, over the tokens it would emit. On a real host
        a verify row costs more than the one before it (its experts evict the next row's), so this
        is the probe's best case; skipping probes that cannot win keeps a depth whose next step
        loses (sampled text, whose acceptance falls fast by position) from paying for them."""
        d = cand - 1
        cd, cp = self.iteration_seconds(d), self.iteration_seconds(d - 1) if d >= 1 else None
        if cd is None or cp is None:
            return False
        best_case = (cd + max(cd - cp, 0.0)) / self.expected_tokens(cand)
        return best_case > cd / self.expected_tokens(d)

    def _verdict(self, probe: int, incumbent: int) -> str:
        """'win', 'lose' or 'unsure': seconds per token of the probe block (the median of its
        iterations) against the incumbent's (the median of its last iterations before the probe),
        both measured within the last few dozen iterations; the probe must win by the margin. A
        difference within the noise of the two medians (their spread, 1.48 x the median absolute
        deviation, over the square root of the samples) is 'unsure': on a host whose iterations
        vary with their expert reads, four samples cannot tell a few percent."""
        if not self._block:
            return "lose"
        inc = self._recent.get(incumbent)
        if not inc:
            return "win"
        ep, ei = self.expected_tokens(probe), self.expected_tokens(incumbent)
        p = [t / ep for t in self._block]
        i = [t / ei for t in inc]
        mp, mi = statistics.median(p), statistics.median(i)
        bar = mi * (1 - self.margin)
        spread = ((_mad(p) ** 2) / len(p) + (_mad(i) ** 2) / len(i)) ** 0.5
        if abs(mp - bar) <= NOISE_Z * spread:
            return "unsure"
        return "win" if mp < bar else "lose"

    # -- measurements ---------------------------------------------------------------------------

    def record(self, depth: int, proposed: int, accepted: int, seconds: float, verified: int = None,
               parts=None):
        """One iteration: the depth it ran at, drafts proposed / accepted, its wall time (without
        one-off catch-up); verified: drafts that went into the verify batch (default: proposed);
        parts: its seconds (draft chain, verify forward, MTP absorb, whole iteration)."""
        self.iterations += 1
        self.proposed += proposed
        self.accepted += accepted
        # the cost compared is the median of the depth's recent iterations: the few plain ones right
        # after a probe (whose verify rows evicted experts they need) do not move it
        if self._settle > 0:
            self._settle -= 1                       # a change of depth's wake: not a cost (module doc)
        else:
            if self._probe is not None and depth == self._probe:
                self._block.append(seconds)
            rec = self._recent.setdefault(depth, [])
            rec.append(seconds)
            del rec[:-RECENT]
        self.count[depth] = self.count.get(depth, 0.0) * self.decay + 1
        verified = proposed if verified is None else verified
        pv = self._drafted.setdefault(depth, [0.0, 0.0])
        pv[0], pv[1] = pv[0] * self.decay + proposed, pv[1] * self.decay + min(verified, proposed)
        for i in range(min(verified, len(self.verified_at))):
            self.verified_at[i] += 1
            self.accepted_at[i] += i < accepted
            self._ver[i] = self._ver[i] * ACCEPT_DECAY + 1
            self._acc[i] = self._acc[i] * ACCEPT_DECAY + (i < accepted)
        if parts is not None:
            for key, v in zip(("draft", "verify", "absorb", "iterations"), parts):
                self.time_s[key] += v
        self.verified += verified
        # the guard counts the drafts tested (not those a verify forward dropped for their reads)
        if self.verified >= GUARD_MIN_PROPOSALS and self.accepted < GUARD_MIN_ACCEPT * self.verified:
            self.off = True

    def stats(self) -> dict:
        t = self.time_s
        return {"drafts_proposed": self.proposed, "drafts_verified": self.verified, "drafts_accepted": self.accepted,
                "acceptance": (self.accepted / self.proposed) if self.proposed else 0.0,
                "draft_off": self.off, "draft_iterations": self.iterations,
                "draft_cost_s": {str(d): self.iteration_seconds(d) for d in sorted(self._recent)},
                # acceptance of the i-th draft among the iterations that verified an i-th draft
                "acceptance_by_position": [a / v for a, v in zip(self.accepted_at, self.verified_at) if v],
                "drafts_verified_by_position": [v for v in self.verified_at if v],
                "time_draft_s": t["draft"], "time_verify_s": t["verify"], "time_absorb_s": t["absorb"],
                "time_spec_python_s": max(t["iterations"] - t["draft"] - t["verify"] - t["absorb"], 0.0)}
