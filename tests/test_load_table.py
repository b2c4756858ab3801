"""LoadTable: load control's arrays kept across events."""

from types import SimpleNamespace

import numpy as np

from dilaserve.control.load_table import LoadTable


def filled(rows):
    """rows: (id, (priority, arrival), tokens, steps[0.9, 0.5], recompute)."""
    table = LoadTable(2, capacity=2)  # small, so that adding rows grows it
    for seq, (rid, (priority, arrival), tokens, steps, recompute) in enumerate(rows):
        table.add(rid, (-priority, arrival, seq), tokens)
        table.set_rows([rid], np.array([steps], float), [recompute])
    return table


ROWS = [
    ("a", (0, 0.0), 100, (8, 4), 0),
    ("b", (0, 1.0), 100, (8, 4), 0),
    ("c", (1, 2.0), 100, (8, 4), 0),  # arrives last, served first
]


def test_load_control_runs_in_service_order_and_reports_only_changes():
    table = filled(ROWS)
    # lowest loads 3 x 400 = 1200; a step up to 0.9 costs 400; 500 to spare: one request gets it
    assert dict(table.run(1700.0, None)) == {"c": 0, "a": 1, "b": 1}
    assert table.run(1700.0, None) == []  # nothing changed since
    assert dict(table.run(2100.0, None)) == {"a": 0}


def test_a_row_left_out_takes_no_capacity_but_admission_still_counts_it():
    table = filled(ROWS)
    table.leave_out("c")  # lost: a and b (800 at 0.5) both step up to 0.9 (+800) within 1700
    assert dict(table.run(1700.0, None)) == {"a": 0, "b": 0}
    assert table.lowest_load(float("-inf"), None)[2] == 3  # admission's view: all three rows


def test_removed_rows_free_their_slot_and_leave_the_order():
    table = filled(ROWS)
    table.run(1e9, None)
    table.remove("c")
    table.add("d", (0, 3.0, 9), 50)
    table.set_rows(["d"], np.array([[2.0, 1.0]]), [0])
    assert len(table) == 3 and "c" not in table
    assert table.mean_tokens() == (100 + 100 + 50) / 3
    assert dict(table.run(1e9, None)) == {"d": 0}


def test_estimates_count_down_one_per_step_but_not_below_one():
    table = filled([("a", (0, 0.0), 100, (2, 1), 3)])
    table.count_step([SimpleNamespace(request_id="a", num_blocks_to_recompute=2)])
    assert table.steps_of("a") == [1.0, 1.0]
    assert table.recompute[0] == 2


def test_steps_noted_before_a_refresh_or_a_removal_do_not_leak_into_the_next_row():
    table = filled([("a", (0, 0.0), 100, (5, 3), 3)])
    stepped = SimpleNamespace(request_id="a", num_blocks_to_recompute=2)
    table.count_step([stepped])
    table.count_step([stepped])
    assert table.steps_of("a") == [3.0, 1.0]
    table.count_step([stepped])
    table.set_rows(["a"], np.array([[6.0, 4.0]]), [1])  # a refresh starts the count again
    assert table.steps_of("a") == [6.0, 4.0]
    table.count_step([stepped])
    table.remove("a")
    table.add("b", (0, 1.0, 1), 100)  # b takes a's slot
    table.set_rows(["b"], np.array([[2.0, 2.0]]), [0])
    assert table.steps_of("b") == [2.0, 2.0]
