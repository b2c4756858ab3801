"""The decision digests docs/simulator/digests.md pins still come out of the code.

Its table lists short deterministic simulations (policy, trace, GPUs, the degree the cluster
starts at, "-" for the policy's own, planner period) and the first 16 hex digits of their
decision digests. When a change moves decisions, this fails until the table (and every number
quoted from runs made before the change) is brought up to date.
"""

import re
from pathlib import Path

import pytest

from dilaserve.sim.run import SimulationSpec, simulate

DOCS = Path(__file__).resolve().parents[1] / "docs" / "simulator" / "digests.md"
ROW = re.compile(
    r"^\| `([\w-]+)` \| `([\w:.]+)` \| (\d+) \| (-|\d+) \| ([\d.e]+) \| `([0-9a-f]{16})` \|$"
)


def pinned() -> list[tuple[str, str, int, int | None, float, str]]:
    rows = [ROW.match(line.strip()) for line in DOCS.read_text().splitlines()]
    return [
        (m[1], m[2], int(m[3]), None if m[4] == "-" else int(m[4]), float(m[5]), m[6])
        for m in rows
        if m
    ]


def test_the_docs_pin_some_digests():
    assert len(pinned()) >= 3


@pytest.mark.parametrize("policy, trace, gpus, start, period, digest", pinned())
def test_a_documented_digest_matches_a_short_run(policy, trace, gpus, start, period, digest):
    spec = SimulationSpec(
        policy=policy,
        trace=trace,
        gpus=gpus,
        initial_tp=start,
        planner_period=period,
        predictor_prompts=12,
    )
    assert simulate(spec).summary["decision_digest"][:16] == digest
