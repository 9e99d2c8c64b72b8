"""Cost curves T(B) per (model, path), learned from the hardware. Pure: no clock, no I/O.

``CostCurve`` keeps two views of the same observations:
- a linear fit ``T(B) = launch + per_item * B`` by recursive least squares with a forgetting
  factor (what B1/B2 and the reports use);
- per-batch-size knots (running means of clipped samples, with their spread), interpolated
  piecewise-linearly. The MLP's curve on AMX is flat up to B~16 and then rises, which a single
  line fits badly; where the profile, or later the knots, say the line is poor (``mode =
  "piecewise"``) predictions come from the knots.
Outliers (first call at a new shape, GC pauses: measured up to 30x) are rejected once a curve
has enough data: a sample more than ``OUTLIER_FACTOR`` x what its size is expected to take (the
prediction, or the size's own measured knot if that is longer) is counted, not learned, unless
it is the ``OUTLIER_RUN``-th in a row (see ``observe``).
"""

from __future__ import annotations

import bisect
import math
from dataclasses import dataclass, field
from typing import Optional

OUTLIER_FACTOR = 3.0
# A stale knot this many times dearer than the fresh knots beside it allow (per item against a
# smaller size, whole against a bigger one) is no evidence to refuse its size a batch by
# (stale_and_dear): batching does not make items dearer by that much.
STALE_DEAR = 2.0
MIN_SAMPLES_FOR_OUTLIERS = 8
# Slow batches of one size this many in a row are no outliers: the device itself got slower (a GC
# pause or a first call at a new shape comes alone). Judged one by one, a device that turned 3x slower
# would never be learnt: every sample it sends is rejected, so the curve never moves.
OUTLIER_RUN = 3
# Fast batches of one size this many in a row are no noise either: the knot learnt a slow spell
# that is over (see observe: only beyond the knot's own spread).
FAST_RUN = 3
LINEAR_MAX_ERROR = 0.10  # a line that misses a measured point by more than 10 % is not used
MIN_PREDICTION_S = 1e-6  # no batch takes less (see CostCurve.predict)
# ... and once learnt online, one that misses a proven knot by more than this plus LINE_Z of the
# knot's standard errors: knots are noisy, and the check runs every CAP_REFRESH samples for good
# (a line is given up once). Simulated, 40 curves of 1 ms + 0.5 ms·B learnt over 1,200 batches:
# at 10 % jitter 2 gave their line up (8 at 10 % + 2 errors), at 20 % 5; a MiniLM AMX core's
# curve with 10 % jitter went piecewise in 20 runs of 20.
LINE_POOR = 0.20
LINE_Z = 3.0
# A batch size whose time per item is within this of the best measured one counts as efficient;
# beyond the largest such size the curve has shown batches get slower per item (cache spills:
# MiniLM on an EPYC core, 928 ms at B=32 against 2 x 370 ms at B=16).
EFFICIENT_TOLERANCE = 0.02
TRIAL_PATIENCE = 8  # batches of other sizes after which _trial_size's rule (3) gives a size up
EFFICIENT_MIN_COUNT = 3  # one slow batch (a GC pause) must not cap a worker for good
# Learned knots are noisy: each is a running estimate of jittery batch times, and the best of ~30
# of them is the luckiest. Read against the bare 2 %, one core's MiniLM curve with 10 % jitter
# (simulated, 43 req/s, 90 % of its limit) was capped at 19-23 of 32 by chance, and MCB's p99
# was 1.16x greedy's. A size is efficient unless it is slower per item than the best by more
# than the tolerance plus EFFICIENT_Z standard errors of the difference of the two estimates.
EFFICIENT_Z = 2.0
KNOT_MEMORY = 20  # a knot is a running mean with weight 1/KNOT_MEMORY once it has that many samples
DRIFT_MEMORY = 4  # ... unless its last ~DRIFT_MEMORY samples say the machine's speed changed
DRIFT_Z = 3.0
# The drift EWMA's standard deviation per unit of spread: (x1.25 for a standard deviation from a
# mean absolute deviation) x sqrt(w / (2 - w)) for weight w; past DRIFT_Z of it, the speed changed.
DRIFT_LIMIT = DRIFT_Z * 1.25 * math.sqrt((1 / DRIFT_MEMORY) / (2 - 1 / DRIFT_MEMORY))
KNOT_EFFECTIVE = 30  # samples a knot's estimate is worth, for its standard error (see _relative_error)
# Background work (low priority while urgent requests arrive) gives up this much throughput per
# item for short batches: an urgent request that arrives behind one waits for it (not preemptible).
COMPACT_TOLERANCE = 0.10
# A knot not measured in this many of the curve's samples is stale: it no longer counts as
# evidence for the batch cap (so the max batch is tried again when a full one is queued), and its
# next sample starts it afresh (``probe_size``, ``_refit_fresh``). Without this a curve could lock
# for good. Big batches measured during a slow spell (MiniLM batches of ~30 ran 12-14 ms an item
# under load on an H100 host's Xeon core) beside a batch of 1 at 12.7 ms leave a cap of 1 and a
# fit with no launch (MCB then serves one request at a time); only size 1 is sent after that and
# no other size is measured again. A live run there ran batches of 1 with ~1,000 requests queued
# (56 req/s served of 107 offered; B=16 serves 133 items/s); its curve was not captured. The same
# symptom on another AMX core, captured, was a second lock: the samples of size 1 were rejected as
# outliers of the line, so none counted (``observe``). A cap that is right costs a re-probe of
# EFFICIENT_MIN_COUNT batches every STALE_SAMPLES: ~1 % of them at the worse size.
STALE_SAMPLES = 256
# The caps move slowly: look at them again every this many samples (and at every new size), not
# at every batch (they scan every measured size: 12 % of a simulated MCB run, seeds 50 % load).
CAP_REFRESH = 16
# RLS with forgetting divides the covariance by the factor at every sample; in a direction the
# samples never excite (a worker that only ever runs B=1 cannot tell launch from per-item time)
# it grows as 0.995^-n and overflows after ~141,000 batches: the curve turns NaN and the policy
# with it (simulated: p99 of seconds after 11 s at 30 % load). Its trace is kept at most the
# initial covariance's, the usual bounded-covariance remedy.
P_INITIAL = 1e3  # the covariance starts at P_INITIAL * identity: the first samples move the fit freely
P_TRACE_MAX = 2 * P_INITIAL


@dataclass
class CostCurve:
    launch_s: float = 1e-4
    per_item_s: float = 1e-5
    forgetting: float = 0.995
    mode: str = "linear"  # "linear" | "piecewise"
    samples: int = 0
    outliers: int = 0
    r2: float = float("nan")  # of the offline linear fit, when built from a profile
    # Its points were measured on a simulated device (a profile entry calibrate marked so): its
    # numbers are not real hardware's, and `status` and /metrics say so (DESIGN.md).
    simulated: bool = False
    # RLS state: inverse covariance P (2x2, symmetric) and parameters theta = (launch, per_item)
    _p: list = field(default_factory=lambda: [P_INITIAL, 0.0, P_INITIAL])
    # knots: batch size -> (estimate, count, spread, drift); kept sorted by size in _sizes. spread:
    # mean |sample / estimate - 1| (0: calibrated); drift: recent mean of (sample / estimate - 1)
    _knots: dict = field(default_factory=dict)
    _sizes: list = field(default_factory=list)
    # max_b -> efficient_batch, -max_b -> compact_batch, "probe" -> probe_size's candidates,
    # ("trial", max_b) -> trial_size; until
    # the next CAP_REFRESH (or a new knot)
    _caps: dict = field(default_factory=dict)
    _seen: dict = field(default_factory=dict)  # batch size -> the sample count at its knot's last sample
    _outliers_in_row: dict = field(default_factory=dict)  # batch size -> its latest samples rejected in a row
    _fast_in_row: dict = field(default_factory=dict)  # batch size -> its latest samples OUTLIER_FACTOR x fast, in a row
    _named_since: dict = field(default_factory=dict)  # size _trial_size's rule (3) names -> the samples then

    @classmethod
    def from_points(cls, points: list[tuple[int, float]], **kw) -> "CostCurve":
        """Offline fit from (B, seconds) points (a calibration sweep); chooses the mode."""
        c = cls(**kw)
        for b, t in points:
            c._set_knot(b, t, EFFICIENT_MIN_COUNT)  # a calibration point is a median of several runs
        c.launch_s, c.per_item_s, c.r2 = least_squares(points)
        if c.launch_s < 0 and points:
            # No batch takes less than nothing: a line below zero at B=1 (two points at B=2 and
            # 12 fit one) predicted 0 s there, and MCB asked to decide again at once. The line
            # through the origin that fits the points best instead.
            c.launch_s = 0.0
            c.per_item_s = sum(b * t for b, t in points) / sum(b * b for b, _ in points)
        c.samples = len(points)
        c._seen = {b: c.samples for b, _ in points}
        c.mode = "linear" if fit_error(points, c.launch_s, c.per_item_s) <= LINEAR_MAX_ERROR else "piecewise"
        return c

    def predict(self, b: int) -> float:
        """T(b), never below MIN_PREDICTION_S: the online fit can learn a negative launch (RLS
        splits each error between launch and per-item time), and a batch predicted to take no time
        "finished" at once: MCB held the queue for that worker with a wake-up at now, which the
        core drops, and the queue waited beside a free GPU until the worker really finished."""
        if self.mode == "piecewise" and self._sizes:
            return max(MIN_PREDICTION_S, self._interpolate(b))
        return max(MIN_PREDICTION_S, self.launch_s + self.per_item_s * b)

    def efficient_batch(self, max_b: int) -> int:
        """The largest batch size, at most ``max_b``, that serves items about as fast as the best
        one (time per item within ``EFFICIENT_TOLERANCE`` of the minimum): the cost-aware cap that
        keeps a saturated worker at its throughput limit. It reads the per-size knots (measured
        times, whatever the prediction mode), counting a size measured at least
        ``EFFICIENT_MIN_COUNT`` times, the last within ``STALE_SAMPLES``; with fewer than two
        such sizes it is ``max_b`` (which then gets measured again). T is piecewise
        linear between measured sizes, so T(B)/B is monotone on each piece and the measured
        sizes (plus ``max_b``) are the only candidates."""
        cap = self._caps.get(max_b)
        if cap is None:
            cap = self._caps[max_b] = self._efficient_batch(max_b)
        return cap

    def unproven(self, b: int) -> bool:
        """Whether size ``b`` has fewer than ``EFFICIENT_MIN_COUNT`` measurements (calibration
        points count as that many), or none in the last ``STALE_SAMPLES``."""
        k = self._knots.get(b)
        return k is None or k[1] < EFFICIENT_MIN_COUNT or self.stale(b)

    def probe_size(self, room: int) -> int:
        """A batch size to measure again now (0: none): the smallest size above the one
        measured of late whose knot is stale, at most ``room``, while every sample of the last
        ``STALE_SAMPLES`` was of that one size. The linear fit's slope then rests on the stale
        knots alone (one size cannot tell launch from per-item time), and a policy that trusts
        it keeps sending that size: after a slow spell that made big batches look dear, a fit
        with no launch sent one request at a time for good, however long the queue (see
        ``STALE_SAMPLES``). One batch of the probed size refreshes its knot and the fit."""
        probe = self._caps.get("probe")
        if probe is None:
            fresh = [b for b in self._sizes if not self.stale(b)]
            probe = self._caps["probe"] = [b for b in self._sizes if b > fresh[0]] if len(fresh) == 1 else []
        return next((b for b in probe if b <= room), 0)

    def stale_and_dear(self, b: int) -> bool:
        """Whether size ``b``'s knot was not measured within ``STALE_SAMPLES`` and the fresh knots
        beside it show it far too dear (a slow spell's, or a profile's written in ms): more than
        ``STALE_DEAR`` times the time per item of the nearest fresh smaller size, or that times the
        time of the nearest fresh bigger one. (Judged by the fresh knots, not the line: a line
        fitted to one size, or to big batches alone, can be off by a factor of ten elsewhere.)"""
        k = self._knots.get(b)
        if k is None or not self.stale(b):
            return False
        fresh = [x for x in self._sizes if not self.stale(x)]
        i = bisect.bisect_left(fresh, b)
        below = fresh[i - 1] if i > 0 else None
        above = fresh[i] if i < len(fresh) else None
        return ((below is not None and k[0] / b > STALE_DEAR * self._knots[below][0] / below)
                or (above is not None and k[0] > STALE_DEAR * self._knots[above][0]))

    def largest_measured(self) -> int:
        """The largest batch size measured (a knot's; a calibration point counts); 0 for none.
        Past it, ``predict`` extrapolates."""
        return self._sizes[-1] if self._sizes else 0

    def stale(self, b: int) -> bool:
        """Whether size ``b``'s knot was last measured more than ``STALE_SAMPLES`` samples ago."""
        return self.samples - self._seen.get(b, 0) > STALE_SAMPLES

    def compact_batch(self, max_b: int) -> int:
        """The smallest batch size whose predicted time per item is within ``COMPACT_TOLERANCE``
        of the best size up to ``max_b``: short batches that still give nearly all the throughput."""
        key = -max_b
        cap = self._caps.get(key)
        if cap is None:
            per_item = [self.predict(b) / b for b in range(1, max_b + 1)]
            bound = min(per_item) * (1 + COMPACT_TOLERANCE)
            cap = self._caps[key] = next(b for b, t in enumerate(per_item, 1) if t <= bound)
        return cap

    def _efficient_batch(self, max_b: int) -> int:
        return self._cap_among([b for b in self._sizes if b <= max_b and not self.unproven(b)], max_b)

    def trial_size(self, max_b: int) -> int:
        """A batch size to send a saturated worker now, to learn what the cap cannot see (0:
        none). The cap reads proven sizes only, and a saturated worker sends nothing but the
        cap (or its max): a better size that is unproven stays so. Live on one AMX core past
        saturation (MiniLM) only B=32 stayed fresh, 16's knot (5.6 ms an item against 32's
        6.8) went stale, and batches of 32 ran for good at 60 % of the core's limit; simulated
        at 200 req/s, a 16 measured once beside a proven 10 kept batches at 10 (6.2 ms an item
        against 16's 5.4); simulated at 280 req/s from the start, nothing but 32 was ever sent.

        1. An unproven size whose estimate says the cap is elsewhere is sent until proven
           (``EFFICIENT_MIN_COUNT`` fresh batches), the best-looking first.
        2. Else a gap wider than a factor of 2 on either side of the best proven size (a
           calibration's powers of two have none) is halved, one batch at a time: each probe is
           a knot after it (at most log2(max_b) probes a side, once), and one that looks better
           is then proven by rule 1. Time per item is unimodal in B on the cores measured (a
           launch amortised, then cache spills), so the best size ends within a factor of 2."""
        key = ("trial", max_b)
        trial = self._caps.get(key)
        if trial is None:
            trial = self._caps[key] = self._trial_size(max_b)
        return trial

    def _trial_size(self, max_b: int) -> int:
        sizes = [b for b in self._sizes if b <= max_b]
        proven = [b for b in sizes if not self.unproven(b)]
        if not proven:
            return 0
        cap = self.efficient_batch(max_b)
        per_item = {b: self._knots[b][0] / b for b in proven}
        b_star = min(per_item, key=per_item.get)
        best = per_item[b_star]
        trials = [b for b in sizes if b not in per_item and self._knots[b][0] > 0
                  and (self._knots[b][0] / b < best or b > cap) and self._cap_among(proven + [b], max_b) != cap]
        if trials:
            return min(trials, key=lambda b: self._knots[b][0] / b)
        i = bisect.bisect_left(sizes, b_star)
        below = sizes[i - 1] if i > 0 else 0
        if b_star > max(2 * below, 1):
            return (below + b_star) // 2
        if i + 1 < len(sizes) and sizes[i + 1] > 2 * b_star:
            return (b_star + sizes[i + 1]) // 2
        # (3) A neighbour of the best proven size that is unproven (measured once, or stale) is
        # measured again until it is proven. Neither rule above named it: a knot learnt during a
        # slow spell looked no better, and as the neighbour it kept the gap rule from halving, so
        # it was never sent again. A saturated worker whose best size is 16 ran 32s for good after
        # a 4x spell of 10 batches (34.5 items/s of 43.2), and one saturated from its start stayed
        # at its max where time per item is flat above its best (77 % of its limit).
        # Given up after TRIAL_PATIENCE batches of other sizes: requests are never split, and one
        # that requests of 4 items cannot make (15 beside 16) was named for good, the cap held at
        # it and the batches at 12 (41.0 items/s of 43.2).
        # Not where the cap lies above the best proven size and its estimate serves items faster:
        # the cap's own batches measure what lies beyond. A step into a backlog from light load
        # (sizes up to 16 proven, bigger ones measured once while the queue grew) walked the
        # neighbours up one at a time, each sent until proven, while the cap said max batch: ~25
        # batches of 17-58 on a GPU best at 64 (SIMULATED, held-out random-13-5 at 60 %: MCB's
        # p50 4.16 ms against escape:1's 2.48, now 2.52). A cap above it only within the
        # tolerance (sizes flat above the best, a spell having made the best look slow) still
        # gets its neighbours measured: skipped there too, a worker best at 8 ran 32s for good.
        cap_per_item = per_item[cap] if cap in per_item else self._interpolate(cap) / cap
        if cap > b_star and cap_per_item < best:
            return 0
        for j in (i - 1, i + 1):
            if 0 <= j < len(sizes) and self.unproven(sizes[j]):
                since = self._named_since.setdefault(sizes[j], self.samples)
                if self.samples - since <= TRIAL_PATIENCE:
                    return sizes[j]
        return 0

    def _cap_among(self, sizes: list[int], max_b: int) -> int:
        """The cap that ``sizes`` (at most ``max_b``) say: the largest size within the tolerance
        of the best time per item; ``max_b`` with fewer than two sizes."""
        if len(sizes) < 2:
            return max_b
        per_item = {b: self._knots[b][0] / b for b in sizes}
        error = {b: self._relative_error(b) for b in sizes}
        if max_b not in per_item:
            per_item[max_b] = self._interpolate(max_b) / max_b
            error[max_b] = max(error.values())  # as its nearest evidence, at worst
        best = min(per_item, key=per_item.get)
        return max(b for b, t in per_item.items()
                   if t <= per_item[best] * (1 + EFFICIENT_TOLERANCE + EFFICIENT_Z * math.hypot(error[b], error[best])))

    def _relative_error(self, b: int) -> float:
        """Standard error of knot ``b``'s estimate, relative to it: the samples' spread (a mean
        absolute deviation, x1.25 for a standard deviation) over the root of the samples it
        averages. A running mean of weight w = 1/KNOT_MEMORY alone would be a mean of 2/w - 1 =
        39; the speed-change detector's false alarms shorten that to about KNOT_EFFECTIVE
        (measured: 300 knots of 60 samples at 3, 10 and 20 % jitter). Calibrated knots carry
        no spread: a calibration point is a median of runs."""
        _, n, spread, _ = self._knots[b]
        return 1.25 * spread / math.sqrt(min(n, KNOT_EFFECTIVE))

    def observe(self, b: int, seconds: float) -> bool:
        """Learn from one completed batch. Returns False if it was rejected as an outlier.

        A sample is judged against what its size is expected to take: the prediction, or the
        size's own knot if that is longer. Against the prediction alone a curve locked live (one
        AMX core past saturation, MiniLM): RLS fitted to the big batches of the backlog ended at
        launch -7.4 ms, 9.3 ms an item, so T(1) = 1.9 ms; the plan saw no launch to amortise and
        sent one request at a time; each took 16 ms, as size 1's knot said, and each was
        rejected as an outlier of the line, so the line never moved (16,943 rejected, batches
        of 1.0, 53 req/s served of 170 offered on a core that serves 189 at B=16)."""
        self._named_since.pop(b, None)  # measured: rule (3) may name it again, patient again
        predicted = self.predict(b)
        k = self._knots.get(b)
        expected = max(predicted, k[0]) if k is not None else predicted
        run_ends = False
        # A calibrated curve judges from its first online sample: a profile has fewer points than
        # MIN_SAMPLES_FOR_OUTLIERS, and one 30x batch learnt just after it moved T(1) from 1.5 to
        # 30.5 ms, still 130 % off 128 samples later.
        calibrated = not math.isnan(self.r2)  # only from_points sets r2
        if (self.samples >= MIN_SAMPLES_FOR_OUTLIERS or calibrated) and seconds > OUTLIER_FACTOR * expected + 1e-4:
            run = self._outliers_in_row[b] = self._outliers_in_row.get(b, 0) + 1
            if run < OUTLIER_RUN:
                self.outliers += 1
                return False
            run_ends = True  # learnt, and this size's knot starts afresh from it
        self._outliers_in_row.pop(b, None)
        if k is not None and seconds * OUTLIER_FACTOR + 1e-4 < k[0] and seconds < k[0] * (1 - 3 * k[2]):
            # As fast as that, as many in a row: the knot is what is wrong (a slow spell it
            # learnt is over), and it starts afresh from this sample. Followed by the clipped
            # running mean below, 1.25 % a sample, a knot that learnt a 40x spell stayed above the
            # requests' timeouts for hundreds of batches, and admission refused them meanwhile.
            # Only beyond 3 of the knot's spreads too: a model whose batches take one of two
            # times (short and long inputs, 1 and 10 ms) makes runs of the fast one, and its
            # knot, which averages both, flipped to the fast time (49 % of the time with half
            # its batches fast); its spread is that wide.
            if self._fast_in_row.get(b, 0) + 1 >= FAST_RUN:
                run_ends = True
                self._fast_in_row.pop(b, None)
            else:
                self._fast_in_row[b] = self._fast_in_row.get(b, 0) + 1
        else:
            self._fast_in_row.pop(b, None)
        restarted = k is not None and (run_ends or self.stale(b))
        # A stale size measured again where the fit did not expect it: the fit is stale too.
        refit = restarted and abs(seconds - predicted) > LINEAR_MAX_ERROR * predicted
        self.samples += 1
        self._rls(b, seconds)
        if k is None or restarted:
            self._set_knot(b, seconds)  # new, or stale: what it measured may be another machine's speed
        else:
            est, n, spread, drift = k
            if n >= 4 and est > 0:
                # A running mean over about KNOT_MEMORY samples, each clipped to 3 spreads: the
                # odd slow batch (a GC pause) moves it little. (A fixed 5 % step per sample made
                # a median tracker whose error was 0.55x the samples' spread: 10 % jitter left
                # knots 5 % off, enough to reorder the sizes by time per item.) When the machine
                # itself changes speed, the last few samples agree on a bias beyond the noise
                # (their mean, an EWMA of weight 1/DRIFT_MEMORY, off by DRIFT_Z of its own
                # standard deviations); then the knot follows at that weight: a 20 % step is
                # tracked to within 5 % in a median of 8 batches at 5 % jitter, 15 at 10 % (not 26).
                bound = max(3.0 * spread, 0.05) * est
                step = max(-bound, min(bound, seconds - est))  # clipped: one slow batch is no shift
                drift += (step / est - drift) / DRIFT_MEMORY
                shifted = abs(drift) > DRIFT_LIMIT * spread
                est += step * (1 / DRIFT_MEMORY if shifted else 1 / min(n + 1, KNOT_MEMORY))
                dev = abs(step) / est  # clipped too: one slow batch must not double the spread
            else:
                est += (seconds - est) / (n + 1)
                dev = abs(seconds - est) / est if est > 0 else 0.0
            self._knots[b] = (est, n + 1, spread + (dev - spread) / min(n, KNOT_MEMORY), drift)
            if n + 1 == EFFICIENT_MIN_COUNT:
                self._caps.clear()  # a size just proven: the cap may move now, not at the next refresh
        self._seen[b] = self.samples
        if refit:
            self._refit_fresh()
        if self.samples % CAP_REFRESH == 0:
            self._forget_stale_dear_knots()
            if self.mode == "linear" and not self._line_fits_knots():
                self.mode = "piecewise"
            self._caps.clear()
        return True

    # ------------------------------------------------------------------ internals
    def _forget_stale_dear_knots(self) -> None:
        """Drop each ``stale_and_dear`` knot between two fresh ones: its sizes are predicted from
        those then, and sent again. Kept, it made the sizes around it look too dear to send, and
        no trial reached it (live, after a slow spell, the knot of 6 stayed at 1,000 ms between
        fresh ones of 40 and 60 ms at 4 and 8, and batches of 5 to 7 were never sent). One
        beyond the fresh sizes stays: what they would predict there is the line's extension,
        which one fresh size cannot tell (MCB probes such a size, fit_deadlines lets it run)."""
        fresh = [b for b in self._sizes if not self.stale(b)]
        dear = [b for b in self._sizes if fresh and fresh[0] < b < fresh[-1] and self.stale_and_dear(b)]
        if dear:
            for b in dear:
                del self._knots[b]
                self._seen.pop(b, None)
            self._sizes[:] = [b for b in self._sizes if b not in dear]
            self._caps.clear()

    def _line_fits_knots(self) -> bool:
        """Whether the fitted line predicts every proven knot within LINE_POOR, plus LINE_Z
        standard errors of the knot (noise alone must not condemn a line). A curve
        learnt online starts linear, as a profile whose points a line fits does; where the
        knots show the line is poor, it predicts from them from then on. Live on one AMX core
        (MiniLM, no profile) the line fitted to the batches of a run, launch 9.1 ms and 9.6 ms
        an item, put B=1 at 19 ms and B=8 at 86 where they took 22 and 59: batching looked
        to save far less than it does."""
        for b in self._sizes:
            t = self._knots[b][0]
            if self.unproven(b) or t <= 0:
                continue
            if abs(self.launch_s + self.per_item_s * b - t) > (LINE_POOR + LINE_Z * self._relative_error(b)) * t:
                return False
        return True

    def _refit_fresh(self) -> None:
        """A stale size measured again, more than LINEAR_MAX_ERROR off the fit's prediction:
        the fit's memory of that size is as old as its knot. Restart the fit from the knots
        measured within STALE_SAMPLES (when two sizes or more are), with the covariance of a
        new curve, so the samples to come move it freely. One sample of a size the fit last saw
        long ago barely moved it otherwise: RLS had weighed hundreds of samples of one size
        since. (A knot a run of outliers restarted, slow or fast, is as new.) With one fresh size,
        the line keeps its shape, scaled onto that knot, as ``_rls`` does while one size is all it
        has seen: after a slow spell of batches of 1, the fit stayed at the spell's 150 ms for
        hundreds of 1 ms batches."""
        fresh = [(b, self._knots[b][0]) for b in self._sizes if not self.stale(b)]
        if len(fresh) >= 2:
            self.launch_s, self.per_item_s, _ = least_squares(fresh)
            self._p = [P_INITIAL, 0.0, P_INITIAL]
        elif fresh:
            (b, t), = fresh
            before = self.launch_s + self.per_item_s * b
            if before > 0 and t > 0:
                self.launch_s, self.per_item_s = self.launch_s * t / before, self.per_item_s * t / before
            self._p = [P_INITIAL, 0.0, P_INITIAL]

    def _rls(self, b: int, y: float) -> None:
        lam = self.forgetting
        p00, p01, p11 = self._p
        x0, x1 = 1.0, float(b)
        px0, px1 = p00 * x0 + p01 * x1, p01 * x0 + p11 * x1
        denom = lam + x0 * px0 + x1 * px1
        k0, k1 = px0 / denom, px1 / denom
        before = self.launch_s * x0 + self.per_item_s * x1
        err = y - before
        launch, per_item = self.launch_s + k0 * err, self.per_item_s + k1 * err
        if per_item < 0 < before and self.per_item_s > 0 and self._sizes in ([], [b]):
            # Samples of one size cannot tell launch from per-item time, and RLS splits each
            # error between them: on batches of 1 from a device faster than the prior, the
            # per-item time went negative and T(B) read 0 for B >= 4 (8 items were admitted
            # within 30 us on a device that needs 120). The line keeps its shape instead,
            # scaled to the sample. Only while one size is all it has seen: with two, RLS can
            # tell them apart, and the scaling snapped the line onto each noisy sample.
            scale = y / before
            launch, per_item = self.launch_s * scale, self.per_item_s * scale
        self.launch_s, self.per_item_s = launch, per_item
        p = [(p00 - k0 * px0) / lam, (p01 - k0 * px1) / lam, (p11 - k1 * px1) / lam]
        trace = p[0] + p[2]
        if trace > P_TRACE_MAX:
            p = [v * (P_TRACE_MAX / trace) for v in p]
        self._p = p

    def _set_knot(self, b: int, t: float, count: int = 1) -> None:
        if b not in self._knots:
            bisect.insort(self._sizes, b)
        self._knots[b] = (t, count, 0.0, 0.0)
        self._caps.clear()

    def _interpolate(self, b: int) -> float:
        sizes = self._sizes
        i = bisect.bisect_left(sizes, b)
        if i < len(sizes) and sizes[i] == b:
            return self._knots[b][0]
        if i == 0:
            return self._knots[sizes[0]][0]  # flat below the smallest measured size
        if i == len(sizes):  # beyond the largest: extend with the fitted slope
            last = sizes[-1]
            return self._knots[last][0] + max(self.per_item_s, 0.0) * (b - last)
        lo, hi = sizes[i - 1], sizes[i]
        tlo, thi = self._knots[lo][0], self._knots[hi][0]
        return tlo + (thi - tlo) * (b - lo) / (hi - lo)

    def describe(self) -> dict:
        return {"launch_us": round(self.launch_s * 1e6, 2), "per_item_us": round(self.per_item_s * 1e6, 3),
                "mode": self.mode, "r2": self.r2, "samples": self.samples, "outliers": self.outliers,
                "knots_us": {str(b): round(self._knots[b][0] * 1e6, 1) for b in self._sizes},
                "simulated": self.simulated}


def least_squares(points: list[tuple[int, float]]) -> tuple[float, float, float]:
    """Ordinary least squares of t on B: (launch, per_item, R^2)."""
    n = len(points)
    if n == 0:
        return 0.0, 0.0, 0.0
    if n == 1:
        return points[0][1], 0.0, 1.0
    mb = sum(b for b, _ in points) / n
    mt = sum(t for _, t in points) / n
    sbb = sum((b - mb) ** 2 for b, _ in points)
    sbt = sum((b - mb) * (t - mt) for b, t in points)
    slope = sbt / sbb if sbb else 0.0
    icpt = mt - slope * mb
    sst = sum((t - mt) ** 2 for _, t in points)
    sse = sum((t - icpt - slope * b) ** 2 for b, t in points)
    return icpt, slope, (1.0 - sse / sst) if sst else 1.0


def fit_error(points, launch: float, per_item: float) -> float:
    """Largest relative error of the line over the points (how well 'linear' describes them)."""
    return max((abs(launch + per_item * b - t) / t for b, t in points if t > 0), default=0.0)


def load_profile(path: str, models=None) -> dict[tuple[str, str], CostCurve]:
    """Read a calibration profile (``batchyard calibrate``): {"models": {model: {path: {"points":
    [[B, seconds], ...], "simulated": bool}}}}, B >= 1 once each, seconds finite and > 0, path
    "cpu" or "gpu", and each model one of ``models`` when given; "simulated" (true: measured on a
    simulated device) may be absent, as in profiles written before it: false. Anything else is a
    ValueError naming the file and key: a point at B = 0 or a negative time crashed the first
    decision, and a NaN time (or one in ms, T(1) = 32 s) refused every request as unable to meet
    its deadline, for good, since nothing dispatched could correct the curve."""
    import msgspec

    from .profile_schema import PathProfile, Profile

    try:
        with open(path, "rb") as f:
            data = msgspec.json.decode(f.read(), type=Profile)
    except (msgspec.ValidationError, msgspec.DecodeError) as e:
        raise ValueError(f"profile {path}: {e}") from None
    except OSError as e:  # one its user may not read (calibrated as root, 0600): a traceback, exit 1
        raise ValueError(f"profile {path}: cannot read it: {e.strerror or e}") from None
    out = {}
    for model, paths in data.models.items():
        if models is not None and model not in models:
            raise ValueError(f"profile {path}: models.{model}: not a model of this config ({sorted(models)})")
        for p, raw in paths.items():
            if p not in ("cpu", "gpu"):
                raise ValueError(f"profile {path}: models.{model}.{p}: a path is \"cpu\" or \"gpu\"")
            try:
                entry = msgspec.json.decode(raw, type=PathProfile)
            except msgspec.ValidationError as e:
                raise ValueError(f"profile {path}: models.{model}.{p}: {e}") from None
            sizes = [b for b, _ in entry.points]
            if len(set(sizes)) != len(sizes):
                raise ValueError(f"profile {path}: models.{model}.{p}.points: a batch size twice ({sorted(sizes)})")
            out[(model, p)] = CostCurve.from_points([(b, t) for b, t in entry.points], simulated=entry.simulated)
    return out


MIN_ELAPSED_S = 100e-6  # the dispatcher's decision granularity
# A stream silent for g s has arrivals rarer than SILENT_ARRIVALS / g with 95 % confidence
# (a Poisson stream of rate r stays silent that long with probability e^-(r g), 5 % at r g = 3).
SILENT_ARRIVALS = 3.0
# The arrival rate's window: a time constant of TAU_S, or as long as TAU_ARRIVALS requests take
# to arrive where that is longer (at most TAU_MAX_S). At the simulator's rates (thousands a
# second) it is TAU_S; at 22 req/s a fixed 0.25 s held ~5 arrivals, an estimate +-45 %, and MCB,
# waiting for company on it, had a p99 5-11 % above escape:2's on 8 of 8 traces where with a
# window of ~60 arrivals it was 0-10 % below (SIMULATED, the seeds' curves x 1000, 50 % load).
TAU_S = 0.25
TAU_ARRIVALS = 64
TAU_MAX_S = 10.0
# The window's length follows the requests of the last TAU_S (not its own estimate: after a
# quiet spell a 10 s window, sized by the estimate it held, took ~150 arrivals to follow a step
# to 40/s, and MCB's reservation for urgent requests 4.3 s). Where that short count (decaying over
# TAU_S, so at least RESTART_ARRIVALS / TAU_S requests/s) holds at least RESTART_ARRIVALS and twice
# the long window's rate, the long window restarts at it.
RESTART_ARRIVALS = 8
RESTART_FACTOR = 2.0


class ArrivalRate:
    """Arrival rate lambda(t) as an exponentially decaying count: each arrival adds 1/tau and
    the count decays with time constant tau. It follows a step change to 1 - e^-(t/tau) of
    the new rate (86 % after 2 tau), and it decays while nothing arrives, so a policy waiting
    for "the next request" stops believing in it when the stream dries up.

    Bias-corrected from the first arrival on: the count of the arrivals after the first is
    divided by the share of the window observed so far, ``1 - e^-((t - t_first)/tau)``, so the
    estimate is unbiased from the second arrival on (about n/elapsed while elapsed << tau)
    instead of climbing from 0 over a few tau. Without it every start — and every simulated
    trace, where tau spans thousands of arrivals — spends its first ~2 tau believing the
    next request is up to several times further away than it is.
    """

    __slots__ = ("tau", "_rate", "_t", "_first", "_last_n", "_adaptive", "_requests", "_recent", "_tail")

    def __init__(self, tau_s: Optional[float] = None, initial: float = 0.0):
        """``tau_s``: a fixed time constant; None: the window of TAU_S / TAU_ARRIVALS (above)."""
        self._adaptive = tau_s is None
        self.tau = TAU_S if tau_s is None else tau_s
        self._rate = initial  # decayed count / tau at _t, not yet corrected
        self._t = 0.0
        # A given initial rate stands for a long past: nothing to correct.
        self._first = -math.inf if initial > 0 else None
        self._last_n = 1  # items of the latest arrival
        self._requests = 0.0  # decayed count of arrivals (not items) / tau
        self._recent = 0.0  # the same over TAU_S, for the window's length and its restarts
        # e^-(t_last - t_first)/tau, the share of the window not yet observed, once tau has
        # changed (None: computed from _first, as while tau is constant)
        self._tail: Optional[float] = None

    def arrive(self, now: float, n: int = 1) -> None:
        self._last_n = n
        if self._first is None:  # the first arrival starts the window; it says nothing of a rate
            self._first = self._t = now
            return
        dt = now - self._t
        decay = math.exp(-dt / self.tau) if dt > 0 else 1.0  # (x * 1.0 is x: the same bits as before)
        if self._tail is not None:
            self._tail *= decay
        if self._adaptive:
            self._requests = self._requests * decay + 1 / self.tau
            self._recent = (self._recent * math.exp(-dt / TAU_S) if dt > 0 else self._recent) + 1 / TAU_S
        self._rate = self._rate * decay + n / self.tau
        self._t = now
        if self._adaptive:
            elapsed = max(now - self._first, MIN_ELAPSED_S)
            recent = self._recent / -math.expm1(-elapsed / TAU_S)  # requests/s over the last TAU_S
            tau = min(TAU_MAX_S, max(TAU_S, TAU_ARRIVALS / recent))
            if tau != self.tau:
                if self._tail is None:
                    self._tail = math.exp(-(now - self._first) / self.tau)  # 0.0 for _first = -inf
                self.tau = tau
            if self.tau > TAU_S and recent * TAU_S >= RESTART_ARRIVALS:
                seen = self._seen(now)
                if recent > RESTART_FACTOR * self._requests / seen:  # a rise the long window has yet to see
                    scale = recent * seen / self._requests
                    self._requests *= scale
                    self._rate *= scale

    @property
    def last(self) -> float:
        """When the latest arrival came (0.0 before any)."""
        return self._t

    def _decayed(self, now: float) -> float:
        dt = now - self._t
        return self._rate * math.exp(-dt / self.tau) if dt > 0 else self._rate

    def _silence_cap(self, r: float, now: float) -> float:
        """``r``, at most SILENT_ARRIVALS arrivals (of the latest one's size) over the silence
        since the latest arrival."""
        silence = now - self._t
        return min(r, SILENT_ARRIVALS * self._last_n / silence) if silence > 0 else r

    def _silence_cap_at(self, target: float) -> float:
        """When ``_silence_cap`` comes down to ``target``, with no new arrival."""
        return self._t + SILENT_ARRIVALS * self._last_n / target

    def _seen(self, now: float) -> float:
        """Share of the window observed since the first arrival: 1 - e^-(elapsed/tau).

        Elapsed time counts as at least MIN_ELAPSED_S: arrivals closer together than the
        dispatcher's decision granularity say only that the rate is high, and several in the
        same instant (a client's burst, a test) would otherwise make it infinite."""
        if self._tail is not None:
            return 1.0 - self._tail * math.exp(-max(0.0, now - self._t) / self.tau)
        elapsed = max(now - self._first, MIN_ELAPSED_S) if self._first is not None else MIN_ELAPSED_S
        return -math.expm1(-elapsed / self.tau)  # 1.0 once elapsed >> tau (and for _first = -inf)

    def rate(self, now: float) -> float:
        """The estimate; from a window longer than TAU_S, at most SILENT_ARRIVALS arrivals over
        the silence since the latest: such a window follows a stream that stops only slowly (at
        22 req/s, 3 s), and a policy waiting for the next request would wait on for it."""
        if self._rate <= 0:
            return 0.0
        r = self._decayed(now) / self._seen(now)
        return self._silence_cap(r, now) if self.tau > TAU_S else r

    def time_when_rate_is(self, target: float, now: float) -> float:
        """The instant (>= now) at which, with no new arrival, the rate decays to ``target``.

        Solves ``A e^-(t - t_last)/tau = target (1 - e^-(t - t_first)/tau)`` for t (A: the
        count at the last arrival): ``t - t_last = tau ln(A/target + e^-(t_last - t_first)/tau)``."""
        r = self.rate(now)
        if target <= 0:
            return math.inf
        if r <= target:
            return now
        tail = self._tail if self._tail is not None else math.exp(-(self._t - self._first) / self.tau)
        when = self._t + self.tau * math.log(self._rate / target + tail)  # (tail 0.0 for _first = -inf)
        if self.tau > TAU_S:  # rate()'s cap
            when = min(when, self._silence_cap_at(target))
        return max(now, when)

    def rate_heard(self, now: float) -> float:
        """``rate(now)``, at most SILENT_ARRIVALS arrivals (of the latest one's size) over the
        silence since the latest arrival: the rate a stream that has gone quiet can still have.

        The decaying count alone believes in a burst's rate for a while after it: 170 requests
        within half a second held it above 20/s for 0.7 s of silence, and a reservation kept on
        that belief (MCB's step 1) left low requests with 20 ms deadlines to expire beside an
        idle CPU for half a second (live, sim workers: 115 of 2,406)."""
        return self._silence_cap(self.rate(now), now)

    def time_when_heard_rate_is(self, target: float, now: float) -> float:
        """The instant (>= now) at which, with no new arrival, ``rate_heard`` falls to ``target``."""
        if target <= 0:
            return math.inf
        return max(now, min(self.time_when_rate_is(target, now), self._silence_cap_at(target)))
