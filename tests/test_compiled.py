"""`make compile`: mypyc compiles the control plane's hot path and the simulator's event loop
from the same source (the Makefile's COMPILED list). It broke unnoticed once (mypyc 2.4 read
an attribute first set to None as holding only None, and the compiled scheduler refused the
calibration given it), so a copy of the package is compiled here and must decide as the plain
one does."""

from __future__ import annotations

import os
import re
import shutil
import subprocess
import sys
import sysconfig
from pathlib import Path

import pytest

from dilaserve.sim.run import SimulationSpec, simulate

ROOT = Path(__file__).resolve().parent.parent
MYPYC = Path(sys.executable).parent / "mypyc"
# a short run through every compiled module: the planner, a straggler (measured speeds)
SPEC = dict(trace="fixed:4:20:256:256", gpus=4, predictor_prompts=12, planner_period=5.0)
SPEC |= dict(startup_delay=0.5, stragglers="1:2")


def compiled_modules() -> list[str]:
    """The Makefile's COMPILED list (its continued lines, `$(addprefix DIR,FILES)` expanded)."""
    text = (ROOT / "Makefile").read_text()
    block = re.search(r"^COMPILED :=((?:.*\\\n)*.*)$", text, re.M).group(1).replace("\\\n", " ")
    prefixed = re.findall(r"\$\(addprefix ([^,]+),([^)]*)\)", block)
    files = re.sub(r"\$\(addprefix [^)]*\)", " ", block).split()
    return files + [prefix + name for prefix, names in prefixed for name in names.split()]


def can_build() -> bool:
    """mypyc, the C compiler Python was built with, and Python's headers are all here."""
    compiler = (sysconfig.get_config_var("CC") or "cc").split()[0]
    headers = Path(sysconfig.get_paths()["include"]) / "Python.h"
    return MYPYC.exists() and shutil.which(compiler) is not None and headers.exists()


@pytest.mark.skipif(
    not can_build(), reason="needs mypyc (pip install mypy), a C compiler and Python.h"
)
def test_the_compiled_control_plane_makes_the_same_decisions(tmp_path):
    modules = compiled_modules()
    assert "dilaserve/control/scheduler.py" in modules and len(modules) > 10
    shutil.copytree(
        ROOT / "dilaserve",
        tmp_path / "dilaserve",
        ignore=shutil.ignore_patterns("__pycache__", "*.so", "assets"),
    )
    (tmp_path / "dilaserve" / "assets").symlink_to(ROOT / "dilaserve" / "assets")
    build = subprocess.run(
        [str(MYPYC), *modules], cwd=tmp_path, capture_output=True, text=True, timeout=900
    )
    assert build.returncode == 0, build.stdout[-3000:] + build.stderr[-3000:]
    code = (
        "import dilaserve.control.scheduler as s\n"
        "from dilaserve.sim.run import SimulationSpec, simulate\n"
        f"digest = simulate(SimulationSpec(**{SPEC!r})).summary['decision_digest']\n"
        "print('ran', s.__file__, digest)"
    )
    env = {**os.environ, "PYTHONPATH": str(tmp_path)}
    run = subprocess.run(
        [sys.executable, "-c", code], cwd=tmp_path, env=env, capture_output=True, text=True
    )
    assert run.returncode == 0, run.stderr[-3000:]
    where, digest = run.stdout.split()[-2:]  # (HiGHS prints its banner before)
    assert where.endswith(".so")  # the compiled module ran
    assert digest == simulate(SimulationSpec(**SPEC)).summary["decision_digest"]
