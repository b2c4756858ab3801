"""run-trace counts the requests admission control refuses instead of stopping."""

from types import SimpleNamespace

import pytest

from dilaserve.cluster import trace_run
from dilaserve.cluster.requests import Overloaded
from dilaserve.control.decision_log import DecisionLog
from dilaserve.sim.simulator import SimConfig

from conftest import make_request


class TwoInFlightCluster:
    """Takes the first two requests (each done in 0.1 s) and refuses the rest."""

    def __init__(self, config):
        self.handles = []
        self.controller = SimpleNamespace(
            step_times=[], steps_run=0, stats={}, log=DecisionLog(), recording=None
        )
        self.step_time_ratio = 1.0
        self.step_time_ratio_by_batch: dict[int, float] = {}

    def start(self):
        return self

    def now(self) -> float:
        return 1e9  # never wait for an arrival

    def submit(self, question: str, slo: float, request_id: str, stream: bool = True):
        if len(self.handles) == 2:
            raise Overloaded("2 requests in flight (the limit)")
        r = make_request(request_id, arrival_time=0.0, deadline=slo)
        r.finish_time = r.first_block_time = 0.1
        handle = SimpleNamespace(
            request_id=request_id, request=r, result=lambda: SimpleNamespace(text="")
        )
        self.handles.append(handle)
        return handle

    def close(self) -> None:
        pass


def test_refused_requests_are_counted_as_missed(monkeypatch):
    monkeypatch.setattr(trace_run, "Cluster", TwoInFlightCluster)
    spec = trace_run.TraceRunSpec(trace="poisson:50:0.2", slo=1.0)
    arrivals = len(trace_run.trace_arrivals(spec))
    summary = trace_run.run_trace(None, spec)["summary"]
    assert arrivals > 2 and summary["refused_at_submit"] == arrivals - 2
    assert summary["slo_attainment"] == 1.0  # of the two it took
    assert summary["slo_attainment_of_arrivals"] == round(2 / arrivals, 4)


@pytest.mark.parametrize("slo", [1.0, 0.001])
def test_the_simulator_predicts_the_run_from_its_own_models(tmp_path, slo):
    """`run-trace --predict`: beside the real run, the simulator's prediction of the same
    arrivals from the measured profile and other prompts' recorded trajectories. Requests
    admission refused on arrival (an SLO nothing meets) count as missed in both, so the
    prediction weighs the same requests as the run."""
    from dilaserve.cluster.runtime import ClusterConfig
    from dilaserve.cluster.worker import WorkerConfig
    from dilaserve.config import BUNDLED_MODEL
    from dilaserve.engine.llm import LLM
    from dilaserve.engine.record import record_trajectories
    from dilaserve.tasks import arith
    from dilaserve.trajectory import save_trajectories

    llm = LLM(BUNDLED_MODEL)
    prompts = [p.question for p in arith.generate(6, seed=99, split="test")]
    trajs = record_trajectories(llm, prompts, (0.5, 0.6, 0.7, 0.8, 0.9), 64)
    save_trajectories(tmp_path / "t.npz", trajs)
    config = ClusterConfig(WorkerConfig(threads=1), instances=(1,), record=True)
    spec = trace_run.TraceRunSpec("poisson:6:2", slo=slo, predict=str(tmp_path / "t.npz"))
    summary = trace_run.run_trace(config, spec)["summary"]
    predicted = summary["prediction"]
    assert predicted["requests"] == summary["requests"]
    if slo < 0.01:  # every request refused on arrival, by the run and by the prediction
        assert summary["refused"] == summary["requests"] > 0
        assert summary["slo_attainment"] == predicted["slo_attainment"] == 0.0
        return
    assert 0 <= predicted["slo_attainment"] <= 1 and predicted["latency_mean"] > 0
    assert predicted["slo_attainment_error_pp"] == round(
        100 * (predicted["slo_attainment"] - summary["slo_attainment"]), 2
    )
    assert summary["step_time_ratio"] > 0 and predicted["step_slowdown"] == 1.0
    assert predicted["at_run_speed"]["step_slowdown"] == summary["step_time_ratio"]


def test_the_prediction_refuses_what_admission_control_would():
    from dilaserve.cluster.runtime import ClusterConfig
    from dilaserve.config import BUNDLED_CALIBRATION
    from dilaserve.control.build import ControlSpec
    from dilaserve.control.decisions import SchedulerConfig
    from dilaserve.sim.run_prediction import predict as simulate
    from dilaserve.sim.run_prediction import prediction_summary

    config = ClusterConfig(control=ControlSpec(scheduler=SchedulerConfig(slo=0.3)))
    burst = [make_request(f"r{i}", gen_len=64, arrival_time=0.0, deadline=0.3) for i in range(300)]
    args = (config.control, BUNDLED_CALIBRATION / "trajectories.npz", config.initial_specs())
    result = simulate(burst, *args, config.tick, config.max_batch_tokens)
    assert 0 < len(result.unfinished) < len(burst)  # refused at arrival: never run, missed
    assert prediction_summary(result)["requests"] == len(burst)


def test_the_prediction_runs_every_step_at_the_hosts_slowdown():
    """`step_slowdown` (a calibration run's measured ratio) scales every simulated step."""
    from dilaserve.cluster.runtime import ClusterConfig
    from dilaserve.config import BUNDLED_CALIBRATION
    from dilaserve.sim.run_prediction import predict as simulate

    config = ClusterConfig()
    spaced = [
        make_request(f"r{i}", gen_len=64, arrival_time=5.0 * i, deadline=5.0 * i + 60.0)
        for i in range(4)
    ]  # alone on the instance, with budget to spare at 0.9
    args = (config.control, BUNDLED_CALIBRATION / "trajectories.npz", config.initial_specs())
    latency = {}
    for slowdown in (1.0, 2.0):
        result = simulate(spaced, *args, config.tick, config.max_batch_tokens, slowdown=slowdown)
        latency[slowdown] = [r.finish_time - r.arrival_time for r in result.requests]
    assert latency[2.0] == pytest.approx([2 * t for t in latency[1.0]])
    with pytest.raises(ValueError, match="step_slowdown"):
        SimConfig(step_slowdown=0.0)


def test_a_slowdown_per_batch_size_prices_each_step_by_its_batch():
    """`slowdown_by_batch` (a calibration run's `step_time_ratio_by_batch`) picks each step's
    slowdown by its request count; batch sizes it lacks take `slowdown`."""
    from dilaserve.cluster.runtime import ClusterConfig
    from dilaserve.config import BUNDLED_CALIBRATION
    from dilaserve.sim.run_prediction import predict as simulate

    config = ClusterConfig()
    spaced = [
        make_request(f"r{i}", gen_len=64, arrival_time=5.0 * i, deadline=5.0 * i + 60.0)
        for i in range(4)
    ]  # alone on the instance: every step a batch of one
    args = (config.control, BUNDLED_CALIBRATION / "trajectories.npz", config.initial_specs())

    def latencies(**slowdowns):
        result = simulate(spaced, *args, config.tick, config.max_batch_tokens, **slowdowns)
        return [r.finish_time - r.arrival_time for r in result.requests]

    alone = latencies()
    assert latencies(slowdown_by_batch={1: 3.0}) == pytest.approx([3 * t for t in alone])
    assert latencies(slowdown=2.0, slowdown_by_batch={4: 3.0}) == pytest.approx(
        [2 * t for t in alone]
    )
    with pytest.raises(ValueError, match="slowdown_by_batch"):
        SimConfig(slowdown_by_batch={1: 0.0})
