"""Replaying a cluster run in the simulator: the parity check of DESIGN section 3.

A cluster run's recording holds each request as it was admitted (arrival = the controller's
clock reading) and each step launch with its clock readings at launch and at completion and
what it committed. The simulator, fed those outcomes (`RecordedBehaviour`) and those durations
(`RecordedDurations`) and driving a scheduler built from the same `ControlSpec`, must make the
same decisions at the same times; `replay` returns its result with the decision log's lines.

A mismatch shows as a `ParityError` naming the first launch that differs, or as logs that
differ; either means the simulator would not predict what the runtime does.
"""

from __future__ import annotations

from collections import defaultdict, deque
from collections.abc import Collection

from dilaserve.control.build import ControlSpec, build_scheduler
from dilaserve.control.decision_log import DecisionLog
from dilaserve.control.decisions import InstanceSpec
from dilaserve.protocol import RequestStepResult, StepBatch, StepKind
from dilaserve.request import Request
from dilaserve.sim.simulator import SimConfig, SimResult, Simulator


class ParityError(AssertionError):
    pass


class RecordedDurations:
    """Each instance's launches in order: the step takes what it took in the recorded run."""

    def __init__(self, launches):
        self._queues: dict[str, deque] = defaultdict(deque)
        for instance_id, launched, done, results in launches:
            ids = tuple(r.request_id for r in results)
            self._queues[instance_id].append((launched, done, ids))

    def __call__(self, instance_id: str, batch: StepBatch, now: float) -> float:
        queue = self._queues[instance_id]
        if not queue:
            raise ParityError(f"instance {instance_id} launched a step the recorded run did not")
        launched, done, ids = queue.popleft()
        ours = tuple(i.request_id for i in batch.items)
        if ours != ids or abs(launched - now) > 1e-6:
            raise ParityError(
                f"instance {instance_id} launched {ours} at {now:.6f}; "
                f"the recorded run launched {ids} at {launched:.6f}"
            )
        return done - launched


class RecordedBehaviour:
    """A request's n-th step commits what its n-th step committed in the recorded run."""

    def __init__(self, launches):
        self._results: dict[tuple[str, int], RequestStepResult] = {}
        seen: dict[str, int] = defaultdict(int)
        for _, _, _, results in launches:
            for r in results:
                self._results[r.request_id, seen[r.request_id]] = r
                seen[r.request_id] += 1

    def step(self, request: Request, threshold: float, kind: StepKind) -> RequestStepResult:
        return self._results[request.request_id, request.num_steps]


def replay(
    requests: list[Request],
    launches,
    control: ControlSpec,
    instances: list[InstanceSpec],
    tick: float,
    max_batch_tokens: int,
    measured_speed: bool = True,
    unmeasured: Collection[tuple[str, float]] = (),
    voided: Collection[str] = (),
) -> tuple[SimResult, list[str]]:
    """The simulator's run of a recorded cluster run, and its decision log's lines.
    `measured_speed`: the run's (`ClusterConfig.measured_speed`); `unmeasured`: the recording's
    (instance, launched at) of the steps its measured speed did not learn (`cluster/stalls.py`);
    `voided`: its requests that taught Alg. 1's on-time factor nothing (a fault's or a stall's;
    void from the start here: a void request never teaches, whenever it was voided)."""
    scheduler = build_scheduler(control)
    if scheduler.deadline is not None:
        scheduler.deadline.void(voided)
    log = DecisionLog(keep_lines=True)
    simulator = Simulator(
        scheduler,
        scheduler.profile,
        RecordedBehaviour(launches),
        instances,
        SimConfig(tick=tick, max_batch_tokens=max_batch_tokens, measured_speed=measured_speed),
        durations=RecordedDurations(launches),
        log=log,
        unmeasured=unmeasured,
    )
    result = simulator.run([r.fresh() for r in requests])
    return result, log.lines
