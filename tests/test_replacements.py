"""Restoring lost capacity, as bookkeeping (`cluster/replacements.py`): a serving instance that
dies is replaced at once; a replacement that fails is retried after a backoff that doubles up
to MAX_BACKOFF. (tests/test_reliability_cluster.py does the same with real workers, slow.)"""

from dilaserve.cluster.replacements import FIRST_BACKOFF, MAX_BACKOFF, Replacements
from dilaserve.control.decisions import InstanceSpec

LOST = InstanceSpec("i0", 0, 1, (0,))


def test_a_serving_instance_that_dies_is_replaced_at_once_under_a_new_name():
    replacements = Replacements()
    first = replacements.lost(LOST, was_serving=True, now=5.0)
    assert first.instance_id == "i0.1" and (first.node, first.tp, first.gpus) == (0, 1, (0,))
    assert replacements.pending and replacements.due(5.0) == []
    assert replacements.up("i0.1", now=7.5) == 2.5  # seconds the capacity was lost
    assert not replacements.pending and replacements.up("i1", now=8.0) is None


def test_a_failed_replacement_is_retried_after_a_doubling_backoff_up_to_the_cap():
    replacements = Replacements()
    failing, now, delays = replacements.lost(LOST, was_serving=True, now=0.0), 0.0, []
    for _ in range(10):
        assert replacements.lost(failing, was_serving=False, now=now) is None
        due_at = now
        while not (ready := replacements.due(due_at)):
            due_at += 0.5
        [failing] = ready
        delays.append(due_at - now)
        now = due_at
    assert delays[:3] == [FIRST_BACKOFF, 2 * FIRST_BACKOFF, 4 * FIRST_BACKOFF]
    assert max(delays) == MAX_BACKOFF and delays[-1] == MAX_BACKOFF
    assert failing.instance_id == "i0.11" and replacements.pending
    assert replacements.up(failing.instance_id, now) == now  # lost at 0, every retry counted
    assert not replacements.pending


def test_an_instance_that_was_not_serving_and_no_replacement_is_not_replaced():
    replacements = Replacements()
    assert replacements.lost(LOST, was_serving=False, now=0.0) is None
    assert replacements.due(1e9) == [] and not replacements.pending
