"""Measured speed (an extension): how much slower steps run than the latency profile says.

The profile is measured once, on a quiet machine. Serving, the machine may be slower: other
processes share its cores, the HTTP layer takes its part, a GPU is throttled. The control plane
then under-prices every step: threshold selection (Alg. 1/5) picks thresholds whose steps do not
fit the budget left, and load control's and admission's capacity (Alg. 2/4) admits more than
the instances finish in an SLO window; admitted requests then finish around their deadline,
half of them late.

The cluster runtime reports each step's round trip (launch to result, as the controller sees
it); `slowdown` is the running ratio of those times to the profile's prediction for the same
batch, never below 1 (on a machine as fast as when it was profiled, or faster, the profile
stands, and the algorithms are the paper's). Threshold selection multiplies step times by it;
load control and admission divide capacity by it. The same ratio is kept per instance; with
`SchedulerConfig.instance_speed` (an extension) Alg. 3 prices each instance's step at its own,
so that a straggler (a throttled GPU, a noisy neighbour) looks as slow as it runs. The
simulator reports nothing (its steps
take what its latency model says, times `SimConfig.step_slowdown`, and `slowdown` stays 1)
unless it predicts a cluster run (`sim/run_prediction.py`: the control plane then learns the
host's slowdown as the cluster's does) or replays a cluster run's recorded durations
(`SimConfig.measured_speed`), so that the replay makes the run's decisions.

An estimate, not a fact (DESIGN.md section 7): it moves only when a step completes, so a
slowdown learnt under a storm, a neighbour or a fault would outlive them once admission refuses
everything (nothing runs, nothing is observed). Each ratio therefore decays back toward the
profile (1) with event time: `advance(now)`, which the scheduler calls on every event, halves
its excess over 1 every `HALF_LIFE` seconds once no step has been observed for `STALE_STEPS`
times the latest step's duration (while steps keep coming, the measurements alone steer it).
Admission also probes: a request that comes while nothing is in flight is admitted
(`admission.py`), and its steps measure the machine as it is now.

Served throughput (`ServedRates`, an extension): admission prices the load ahead of a request
over the cluster's throughput, which load control models (`LoadControl.throughput`) as Alg. 4's
steady block pattern at `max_requests_per_instance` requests a batch, over `slowdown`: full
batches, and a mean of per-step ratios, each step priced at its own batch. Where batches are
smaller (one request a batch gets through half of it on the bundled profile), the instances get
through less than that (0.55-0.80 of it live beside other work: docs/serving/reliability.md),
and admission's on-time factor (`on_time.py`) grew to cover it. So each instance's steps are
also measured as the tokens they processed (the unit of admission's load) over their round
trips, a ratio of running sums; admission counts on the least of that and the model, instance
by instance, and its on-time factor corrects what is left. Once stale (as above), what an
instance measured decays toward the model with the same half-life.
"""

from __future__ import annotations

from collections.abc import Mapping

from dilaserve.control.profile import LatencyProfile
from dilaserve.control.step_costs import StepCosts
from dilaserve.protocol import CACHED_KINDS, StepBatch

WEIGHT = 0.05  # each step's share of the running ratio
# seconds of event time in which a stale ratio's excess over the profile halves: long against
# a step (ms to ~1 s), so a busy server's ratio is its measurements'; short against an
# operator's patience: a 32x slowdown left by a storm is back under 2x within a minute
HALF_LIFE = 10.0
# a ratio counts as current for this many of the latest step's durations after it (a step
# that takes long is no sign of stale evidence); only the time beyond decays it
STALE_STEPS = 3.0


def _stale(now: float, seen: float | None, fresh_for: float) -> float:
    """Seconds of `now` past the time an observation at `seen` counts as current (0: current,
    or never observed)."""
    return 0.0 if seen is None else max(now - seen - fresh_for, 0.0)


def _toward(target: float, value: float, stale: float) -> float:
    """`value` after `stale` seconds of decay toward `target` (its distance halves every
    `HALF_LIFE`)."""
    return target + (value - target) * 0.5 ** (stale / HALF_LIFE)


class Estimate:
    """One running ratio of measured over predicted step time, decaying toward 1 when stale."""

    __slots__ = ("ratio", "_anchor", "_seen", "_fresh_for")

    def __init__(self) -> None:
        self.ratio = 1.0  # as of the last `advance` (or observation)
        self._anchor = 1.0  # as of the last observation
        self._seen: float | None = None  # the event time of the last observation
        self._fresh_for = 0.0  # seconds after it that it counts as current

    def blend(self, ratio: float, seconds: float, now: float) -> None:
        """A step that took `seconds` ran `ratio` times the profile's time, at `now`."""
        self.advance(now)
        self.ratio += WEIGHT * (ratio - self.ratio)
        self._anchor, self._seen = self.ratio, now
        self._fresh_for = STALE_STEPS * seconds

    def advance(self, now: float) -> None:
        """Decay toward 1 for the stale part of the time since the last observation (a
        function of `now` alone: advancing twice to the same time is advancing once)."""
        self.ratio = self.at(now)

    def at(self, now: float) -> float:
        """The ratio as `advance(now)` would leave it, changing nothing (a reader on another
        thread, `/metrics`, must not write it under an observation)."""
        stale = _stale(now, self._seen, self._fresh_for)
        return _toward(1.0, self._anchor, stale) if stale > 0 else self.ratio

    def stale_seconds(self, now: float) -> float:
        """Seconds of `now` past the time the latest observation counts as current (0:
        current, or never observed)."""
        return _stale(now, self._seen, self._fresh_for)


class Served:
    """One instance's tokens processed over its steps' seconds: running sums, decaying toward
    a model once stale."""

    __slots__ = ("work", "seconds", "_seen", "_fresh_for")

    def __init__(self) -> None:
        self.work = 0.0  # tokens processed, running (each step `WEIGHT` of the sum)
        self.seconds = 0.0  # their steps' round trips, the same
        self._seen = 0.0  # the event time of the latest step
        self._fresh_for = 0.0  # seconds after it that it counts as current

    def observe(self, tokens: float, seconds: float, now: float) -> None:
        self.work += WEIGHT * (tokens - self.work)
        self.seconds += WEIGHT * (seconds - self.seconds)
        self._seen, self._fresh_for = now, STALE_STEPS * seconds

    def rate(self, modelled: float, now: float) -> float:
        """Tokens per second it serves as measured, or `modelled` where that is less; toward
        `modelled` by the stale part of the time since its latest step (`HALF_LIFE`)."""
        measured = min(self.work / self.seconds, modelled)
        return _toward(modelled, measured, _stale(now, self._seen, self._fresh_for))


class ServedRates:
    """`Served` by instance: what each instance's steps got through (`capacity`)."""

    def __init__(self) -> None:
        self.by_instance: dict[str, Served] = {}

    def observe(self, instance_id: str, tokens: float, seconds: float, now: float) -> None:
        """A step on the instance processed `tokens` in `seconds`, launch to result, ending at
        event time `now`."""
        if seconds > 0 and tokens > 0:
            self.by_instance.setdefault(instance_id, Served()).observe(tokens, seconds, now)

    def capacity(self, modelled: dict[str, float], now: float) -> float:
        """Tokens per second the instances serve: each one's `modelled` rate (instance id ->
        tokens per second), or what its steps measured where that is less (`Served.rate`)."""
        total = 0.0
        for instance_id, rate in modelled.items():
            served = self.by_instance.get(instance_id)
            total += rate if served is None else served.rate(rate, now)
        return total


class MeasuredSpeed:
    def __init__(self, profile: LatencyProfile, costs: StepCosts, tracked: Mapping):
        self.profile = profile
        self.costs = costs
        self._tracked = tracked  # request id -> the scheduler's record of it
        self.overall = Estimate()  # measured over predicted step time, running
        self.by_instance: dict[str, Estimate] = {}  # the same, per instance
        self.served = ServedRates()  # tokens each instance's steps processed per second
        self.now = 0.0  # the latest event time it was told (`advance`)
        self.steps = 0  # steps observed
        self._measured = self._predicted = 0.0  # their seconds, measured and predicted, summed
        self._by_batch: dict[int, list[float]] = {}  # batch_bin -> [measured, predicted] sums

    @property
    def ratio(self) -> float:
        """Measured over predicted step time, running (decayed to `now`)."""
        return self.overall.ratio

    @ratio.setter
    def ratio(self, value: float) -> None:  # (tests set it; an observation moves it on)
        self.overall.ratio = self.overall._anchor = value

    def advance(self, now: float) -> None:
        """The event time is `now`: stale ratios decay toward the profile (`HALF_LIFE`)."""
        self.now = max(self.now, now)
        self.overall.advance(self.now)  # (an instance's is decayed when read: `at`)

    def stale_seconds(self) -> float:
        """How long the slowdown has been decaying for want of steps (0: it is current)."""
        return self.overall.stale_seconds(self.now)

    @property
    def slowdown(self) -> float:
        """How many times slower than the profile steps run now (>= 1)."""
        return max(self.ratio, 1.0)

    @property
    def run_ratio(self) -> float:
        """Measured over predicted step time over every step observed, each summed (1 before
        any): the host's slowdown over a whole run, which a simulator's prediction of this host
        takes as its `SimConfig.step_slowdown`: a ratio of sums, so that the prediction's steps
        add up to the time the run's did (a mean of the steps' ratios weighs slow steps less;
        docs/simulator/fidelity.md)."""
        return self._measured / self._predicted if self._predicted else 1.0

    def run_ratio_by_batch(self) -> dict[int, float]:
        """`run_ratio` per batch size (`batch_bin`: the steps of 1, 2-3, 4-7, ... requests).
        On a host whose cores the workers share with the controller the slowdown grows with
        the batch (fcfs at its knee: 0.66 at 8-15 requests, 0.82 at 64-127), which one ratio
        for every step misprices; a prediction takes this table (docs/simulator/fidelity.md)."""
        return {b: m / p for b, (m, p) in sorted(self._by_batch.items()) if p > 0}

    def instance_ratio(self, instance_id: str) -> float:
        """Measured over predicted step time on one instance, running (1 before any step)."""
        estimate = self.by_instance.get(instance_id)
        return 1.0 if estimate is None else estimate.at(self.now)

    def observe(
        self,
        tp: int,
        batch: StepBatch,
        seconds: float,
        instance_id: str = "",
        now: float | None = None,
    ) -> None:
        """A step of `batch` on a TP-`tp` instance took `seconds`, launch to result, and
        ended at event time `now` (default: the latest `advance`). (Call it before the
        scheduler hears of the step: its requests are still tracked.)"""
        sequence, cached = batch_tokens(batch, self.costs, self._tracked)
        predicted = tokens_seconds(self.profile, tp, sequence, cached, self.costs)
        if predicted <= 0:
            return
        self.now = self.now if now is None else max(self.now, now)
        ratio = seconds / predicted
        self.overall.blend(ratio, seconds, self.now)
        if instance_id:
            mine = self.by_instance.setdefault(instance_id, Estimate())
            mine.blend(ratio, seconds, self.now)
            self.served.observe(instance_id, sequence + cached, seconds, self.now)
        if seconds > 0:
            self.steps += 1
            self._measured += seconds
            self._predicted += predicted
            sums = self._by_batch.setdefault(batch_bin(len(batch.items)), [0.0, 0.0])
            sums[0] += seconds
            sums[1] += predicted


def batch_bin(requests: int) -> int:
    """The power of two at or below a step's request count: its bin in `run_ratio_by_batch`."""
    return 1 << (max(requests, 1).bit_length() - 1)


def batch_seconds(
    profile: LatencyProfile, tp: int, batch: StepBatch, costs: StepCosts, tracked: Mapping
) -> float:
    """The profile's time of a step of `batch` on a TP-`tp` instance, as the scheduler prices
    it (`step_costs.py`): its sequence steps on one curve plus its cached steps on another.
    `tracked`: request id -> the scheduler's record of it (requests it no longer tracks, e.g.
    cancelled while the step ran, are left out)."""
    return tokens_seconds(profile, tp, *batch_tokens(batch, costs, tracked), costs)


def batch_tokens(batch: StepBatch, costs: StepCosts, tracked: Mapping) -> tuple[int, int]:
    """(sequence, cached) tokens a step of `batch` processes (`batch_seconds`)."""
    sequence = cached = 0
    for item in batch.items:
        record = tracked.get(item.request_id)
        if record is None:
            continue
        tokens = costs.request_tokens(item.kind, record.request)
        if item.kind in CACHED_KINDS:
            cached += tokens
        else:
            sequence += tokens
    return sequence, cached


def tokens_seconds(
    profile: LatencyProfile, tp: int, sequence: int, cached: int, costs: StepCosts
) -> float:
    """The profile's time of a step of `sequence` and `cached` tokens (`batch_seconds`)."""
    seconds = profile.step_latency(tp, sequence, costs.sequence_kind) if sequence else 0.0
    if cached:
        seconds += profile.step_latency(tp, cached, costs.inner_kind)
    return seconds
