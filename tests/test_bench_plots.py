"""What `dilaserve bench` says and draws when requests go unanswered: no figure without an
answer, refusals never drawn as latencies, and a line when most requests got no answer."""

from __future__ import annotations

import math

import pytest

from dilaserve.bench.plots import is_answered, plot_bench
from dilaserve.cli_serving import unanswered_note
from dilaserve.sim.plots import available


def record(i: int, status: int, latency: float = math.nan, error: str = "") -> dict:
    return {"arrival": 0.1 * i, "status": status, "error": error, "latency": latency,
            "met_slo": status == 200 and latency <= 0.3}  # fmt: skip


def test_only_full_answers_have_a_latency():
    assert is_answered(record(0, 200, 0.2))
    assert not is_answered(record(1, 429))
    assert not is_answered(record(2, 200, error="stream broke"))


@pytest.mark.skipif(not available(), reason="matplotlib is not installed")
def test_no_figure_when_every_request_was_refused(tmp_path):
    refused = [record(i, 429) for i in range(610)]
    assert plot_bench(refused, 0.3, "all refused", tmp_path) is None
    assert not (tmp_path / "bench.png").exists()
    some = refused[:5] + [record(5, 200, 0.25)]
    assert plot_bench(some, 0.3, "one answer", tmp_path) == tmp_path / "bench.png"


def summary(ok: int, errors: dict[str, int]) -> dict:
    return {"requests": ok + sum(errors.values()), "ok": ok, "errors": errors}


def test_most_requests_unanswered_is_said_with_the_reason():
    note = unanswered_note(summary(0, {"429": 610}), 300)
    assert note.startswith("610 of 610 requests got no answer (610 x 429): the server refused")
    assert "within the 300 ms SLO; give a longer --slo-ms" in note
    assert note.endswith("no bench.png")
    failed = unanswered_note(summary(1, {"0": 3}), 300)
    assert failed == "3 of 4 requests got no answer (3 x 0)"
    assert unanswered_note(summary(3, {"429": 3}), 300) is None  # half answered: said nowhere
