"""A one-instance cluster of the bundled model for the reliability tests
(tests/test_reliability*.py): its config and the questions they ask it."""

from dilaserve.cluster.runtime import ClusterConfig
from dilaserve.cluster.worker import WorkerConfig
from dilaserve.tasks import arith

from conftest import HANG_GUARD_S

WORKER = WorkerConfig(threads=1)
QUESTIONS = [p.question for p in arith.generate(4, seed=5, split="test")]


def config(**kw) -> ClusterConfig:
    kw.setdefault("worker", WORKER)
    kw.setdefault("tick", 0.1)
    kw.setdefault("instances", (1,))
    kw.setdefault("start_timeout", HANG_GUARD_S)
    return ClusterConfig(**kw)
