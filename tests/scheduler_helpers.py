"""The scheduler tests' fakes and factories (tests/test_scheduler*.py): a two-point latency
profile per TP degree and kind, a step predictor of fixed counts, and hand-made step results."""

import numpy as np

from dilaserve.control.policy import get_policy
from dilaserve.control.profile import LatencyProfile
from dilaserve.control.scheduler import Scheduler, SchedulerConfig
from dilaserve.protocol import RequestStepResult, StepKind, StepOutput

BLOCK = 8
# TP-2 steps take 60% of TP-1's; latency grows with batch tokens
PROFILE = LatencyProfile.from_dict(
    {
        "entries": [
            {"tp": tp, "kind": kind, "batch_tokens": n, "ms": ms * (0.6 if tp == 2 else 1.0)}
            for tp in (1, 2)
            for kind, pts in (
                ("recompute", ((8, 10), (1000, 200))),
                ("cache", ((8, 5), (800, 100))),
            )
            for n, ms in pts
        ]
    }
)


class FakePredictor:
    thresholds = (0.5, 0.9)

    def at(self, thresholds):  # predicts at the scheduler's ladder, in its order
        self.thresholds = tuple(thresholds)
        return self

    def __init__(self, steps=None):
        self.steps = steps or {0.5: 4.0, 0.9: 8.0}
        self.calls = 0
        self.batches = []

    def predict(self, request_ids, states):
        self.calls += 1
        self.batches.append(list(request_ids))
        return np.array([[self.steps[t] for t in self.thresholds] for _ in request_ids])


def scheduler(
    policy="dilaserve", instances=(("a", 1), ("b", 2)), max_tokens=10_000, predictor=None, **config
):
    cfg = SchedulerConfig(block_len=BLOCK, **{"slo": 100.0, "slo_headroom": 1.0, **config})
    pol = get_policy(policy, candidates=(0.5, 0.9))
    s = Scheduler(pol, PROFILE, predictor or FakePredictor(), cfg)
    for name, tp in instances:
        s.add_instance(name, tp, max_tokens)
    return s


def result(req, positions, block_done=False, finished=False, kind=StepKind.RECOMPUTE):
    positions = np.array(positions, dtype=np.int32)
    return RequestStepResult(
        req.request_id,
        kind,
        positions,
        np.full(len(positions), 3, np.int32),
        np.full(req.gen_len, 0.5, np.float32),
        req.current_block,
        block_done,
        finished,
    )


def done(s, instance, *results, now=1.0):
    return s.on_step_done(instance, StepOutput(tuple(results), 0), now=now)


def only_launch(decisions):
    [launch] = decisions.launches
    return launch
