"""Run folders record what made them: the checkout's commit among the environment."""

import subprocess
from pathlib import Path

import dilaserve
from dilaserve import runs


def test_the_environment_names_the_commit_it_ran_at():
    root = Path(runs.__file__).parent
    head = subprocess.run(
        ["git", "-C", str(root), "rev-parse", "HEAD"], capture_output=True, text=True
    )
    env = runs.environment()
    if head.returncode != 0:  # an installed copy, outside any checkout
        assert env["commit"] == "" and env["dirty"] is False
    else:
        assert env["commit"] == head.stdout.strip() and isinstance(env["dirty"], bool)


def test_outside_a_checkout_the_commit_is_empty(monkeypatch, tmp_path):
    monkeypatch.setattr(runs, "__file__", str(tmp_path / "runs.py"))
    assert runs.source_commit() == {"commit": "", "dirty": False}


def test_the_environment_says_whether_the_control_plane_is_compiled(monkeypatch):
    import dilaserve.control.scheduler as scheduler

    monkeypatch.setattr(scheduler, "__file__", "/x/scheduler.cpython-311-x86_64-linux-gnu.so")
    assert runs.environment()["compiled"] is True
    monkeypatch.setattr(scheduler, "__file__", "/x/scheduler.py")
    assert runs.environment()["compiled"] is False


def test_importing_runs_starts_no_process(monkeypatch):
    """The checkout is read when first asked for, not at import (import stays cheap)."""
    import importlib
    import sys

    calls = []
    for name in ("run", "Popen", "check_output"):
        monkeypatch.setattr(subprocess, name, lambda *a, **k: calls.append(a))
    monkeypatch.setattr(dilaserve, "runs", runs)  # put back after the test, with sys.modules
    monkeypatch.delitem(sys.modules, "dilaserve.runs")
    importlib.import_module("dilaserve.runs")
    assert calls == []
