"""Start-up cost of the DWS extra (issue 24): installing it brings scikit-learn and pandas, which
`import lightgbm` would load on every server and simulator start; the step predictor imports
LightGBM without them (dilaserve/control/predictor.py)."""

from __future__ import annotations

import importlib.util
import subprocess
import sys

import pytest

from dilaserve.config import BUNDLED_PREDICTOR

LOAD_AND_REPORT = f"""
import sys
from dilaserve.control.predictor import load_gbm
load_gbm({str(BUNDLED_PREDICTOR)!r})
print(sorted(m for m in ("sklearn", "pandas") if m in sys.modules))
import sklearn  # still importable afterwards
print("ok")
"""


def test_loading_the_step_predictor_leaves_scikit_learn_and_pandas_unimported():
    if importlib.util.find_spec("sklearn") is None:
        pytest.skip("scikit-learn is not installed (it comes with the dws extra)")
    out = subprocess.run(
        [sys.executable, "-c", LOAD_AND_REPORT], capture_output=True, text=True, check=True
    ).stdout.split()
    assert out == ["[]", "ok"]
