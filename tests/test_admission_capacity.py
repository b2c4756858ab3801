"""Admission's capacity follows what the instances serve (`control/speed.py`: `ServedRates`),
and decays back to load control's model once no step reports.

Load control's model prices a batch of `max_requests_per_instance` requests; steps of one
request each get through half of that on the bundled profile, and admission priced the load
ahead over the model. On a virtual clock (`VirtualInstances`): counted in steps and ticks."""

from fastapi.testclient import TestClient
from test_admission_recovery import MODEL, QUESTION, run_until, virtual_cluster

from dilaserve.control.speed import HALF_LIFE
from dilaserve.server.app import ServerSettings, create_app
from dilaserve.server.metrics import ServerMetrics


def serve_one_request_per_instance():
    """Two instances, each stepping one long request: (cluster, clock, the tokens and seconds
    each instance's steps took, as the test counts them)."""
    cluster, clock = virtual_cluster(instances=(1, 1), slo=60.0)
    served = {}  # instance -> [tokens, seconds]
    step = clock.step

    def counted(instance_id, batch):
        step(instance_id, batch)
        costs, tracked = cluster.scheduler.config.costs, cluster.scheduler.requests
        tokens = sum(
            costs.request_tokens(i.kind, tracked[i.request_id].request) for i in batch.items
        )
        sums = served.setdefault(instance_id, [0, 0.0])
        sums[0] += tokens
        sums[1] += clock._running[instance_id][0] - clock.t

    clock.step = counted
    handles = [
        cluster.submit(QUESTION, max_tokens=256, request_id=f"r{k}", slo=600.0) for k in range(2)
    ]
    run_until(cluster, lambda: cluster.controller.steps_run >= 100)
    assert sorted(served) == ["i0", "i1"]  # one request each
    return cluster, clock, handles, served


def test_admission_counts_on_what_the_instances_serve_not_the_full_batch_model():
    cluster, clock, handles, served = serve_one_request_per_instance()
    admission = cluster.controller.admission
    measured = sum(tokens / seconds for tokens, seconds in served.values())
    modelled = admission.modelled_capacity()
    assert modelled > 1.5 * measured  # the model's full batches
    room = cluster.controller.admitting.room  # what the HTTP front refuses by
    counted_on = room.throughput * admission.on_time.factor(clock.t)
    assert abs(counted_on / measured - 1) < 0.1
    assert abs(admission.capacity(clock.t) / measured - 1) < 0.1
    app = create_app(cluster, ServerSettings(MODEL), ServerMetrics(), manage=False)
    with TestClient(app) as client:
        text = client.get("/metrics").text
    gauges = {
        line.split()[0]: float(line.split()[1])
        for line in text.splitlines()
        if line.startswith("dilaserve_admission_") and "capacity" in line
    }
    assert gauges["dilaserve_admission_modelled_capacity"] == modelled
    assert abs(gauges["dilaserve_admission_capacity"] / measured - 1) < 0.1


def test_what_the_steps_measured_decays_back_to_the_model_when_none_report():
    cluster, clock, handles, served = serve_one_request_per_instance()
    admission = cluster.controller.admission
    run_until(cluster, lambda: all(h.future.done() for h in handles))
    measured = admission.capacity(clock.t)
    modelled = admission.modelled_capacity()
    assert measured < 0.7 * modelled
    ticks = round(HALF_LIFE / cluster.config.tick)  # one half-life, idle
    until = clock.t + ticks * cluster.config.tick
    run_until(cluster, lambda: clock.t >= until)
    assert admission.capacity(clock.t) > measured  # on its way back, with no step
    until = clock.t + 10 * ticks * cluster.config.tick
    run_until(cluster, lambda: clock.t >= until)
    assert (
        cluster.controller.steps_run == 0 or abs(admission.capacity(clock.t) / modelled - 1) < 0.01
    )
