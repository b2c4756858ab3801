"""Latency profiles by name: the analytic presets (`latency.py`'s cost model over the batch-token
grids, at each TP degree that holds the model's weights) and the measured profiles the package
ships, which replace the preset of their name; or a latency-profile file by path.

    load_profile("llada-8b-h100")            # a preset ...
    load_profile("llada-8b-h200")            # ... the measured H200 profile the package ships ...
    load_profile("profiles/measured.json")   # ... or a profile file, same call
"""

from __future__ import annotations

import math
from pathlib import Path

from dilaserve.config import ASSETS
from dilaserve.control.profile import Curve, LatencyProfile
from dilaserve.protocol import APPROXIMATE_KINDS, CACHED_KINDS, EXACT_KINDS
from dilaserve.sim.hardware import GPUSpec, ModelShape
from dilaserve.sim.latency import (
    BLOCK_LEN,
    BLOCK_PRESETS,
    CALIBRATION,
    PRESETS,
    REF_CONTEXT,
    step_seconds,
)

WEIGHT_SHARE_OF_HBM = 0.9  # ASSUMED: a TP degree serves a model whose weights fit in 90% of HBM
# A measured profile the package ships for a name (gpu_profile.py, gpu_dataplane.py; TP-1):
# `<name>-profile.json` in the assets; where it is there, it replaces the preset of that name
PROFILE_SUFFIX = "-profile.json"

# Batch-token grids: powers of two and the midpoints 3 x 2^e between them.
FULL_GRID = tuple(sorted({2**e for e in range(7, 17)} | {3 * 2**e for e in range(6, 15)}))
CACHE_GRID = tuple(sorted({2**e for e in range(5, 14)} | {3 * 2**e for e in range(4, 12)}))


def fits(model: ModelShape, gpu: GPUSpec, tp: int) -> bool:
    """Whether a TP-`tp` group holds the model's weights within `WEIGHT_SHARE_OF_HBM`."""
    return model.weight_bytes(math.inf) / tp <= WEIGHT_SHARE_OF_HBM * gpu.memory_gb * 1e9


def preset_profile(name: str, tp_degrees=(1, 2, 4, 8)) -> LatencyProfile:
    """The analytic profile of preset `name` (a key of `PRESETS` or `BLOCK_PRESETS`) for the
    given TP degrees that hold its weights (`fits`)."""
    block_causal = name in BLOCK_PRESETS
    if name not in PRESETS and not block_causal:
        names = ", ".join([*PRESETS, *BLOCK_PRESETS])
        raise ValueError(f"unknown latency preset {name!r}; presets: {names}")
    model, gpu = BLOCK_PRESETS[name] if block_causal else PRESETS[name]
    curves = {}
    for tp in (d for d in tp_degrees if fits(model, gpu, d)):
        for kind in EXACT_KINDS if block_causal else APPROXIMATE_KINDS:
            grid = CACHE_GRID if kind in CACHED_KINDS else FULL_GRID
            secs = tuple(step_seconds(model, gpu, tp, n, kind) for n in grid)
            curves[tp, kind] = (grid, secs)
    meta = {
        "model": model.name,
        "hardware": gpu.name,
        "dtype": "bfloat16",
        "source": "analytic preset",
        "preset": name,
        **({"block_causal": True} if block_causal else {}),
        "calibration": {
            "mfu": round(CALIBRATION.mfu, 4),
            "hbm_eff": round(CALIBRATION.hbm_eff, 4),
            "overhead_ms": round(CALIBRATION.overhead_s * 1e3, 3),
            "ref_context": REF_CONTEXT,
        },
    }
    return LatencyProfile({k: Curve(*v) for k, v in curves.items()}, block_len=BLOCK_LEN, meta=meta)


def load_profile(spec: str | Path) -> LatencyProfile:
    """A measured profile the package ships (`<name>-profile.json` in its assets) or a preset
    (`PRESETS`, `BLOCK_PRESETS`) by name, or a latency-profile JSON file by path."""
    shipped = ASSETS / f"{spec}{PROFILE_SUFFIX}" if isinstance(spec, str) else None
    if shipped is not None and shipped.is_file():
        return LatencyProfile.from_file(shipped)
    if isinstance(spec, str) and (spec in PRESETS or spec in BLOCK_PRESETS):
        return preset_profile(spec)
    path = Path(spec)
    if not path.is_file():
        measured = [p.name.removesuffix(PROFILE_SUFFIX) for p in ASSETS.glob(f"*{PROFILE_SUFFIX}")]
        names = ", ".join(dict.fromkeys([*PRESETS, *BLOCK_PRESETS, *sorted(measured)]))
        raise ValueError(f"{str(spec)!r} is neither a latency-profile file nor a profile ({names})")
    return LatencyProfile.from_file(path)
