"""What a driver asks of DWS when a request arrives: its expected cost and step prior.

`DWSEstimator` joins the predictor (behaviour: the surface, from the prompt alone) with a
deployment's cost kernel (hardware: ms per cell; `dilaserve profile --dws`), kept apart so
that new hardware needs a new kernel, not a new predictor. Expected cost = prefill + refresh +
sum of surface x kernel (papers.md 2.6); without a kernel, the paper's unit cost (prompt blocks
+ E[N] + expected steps). The step prior, for the DiLaServe step predictor before a request's
first step, scales DWS's expected steps (at the threshold its labels were run at) to each
threshold by the step predictor's one-shot steps-per-token table.

A request's decoding knobs price in: a step schedule of `steps` a block zeroes the surface's
cells past step `steps` (no block runs more), and token editing adds each block's expected
edit-only steps (the step predictor's calibration measures them, `edit_steps_per_block`),
each priced as a block step (the kernel's last cell of the block).

`load` takes the INT8 ONNX graph where the folder has one (`dilaserve export-dws`) and ONNX
Runtime is installed: the fast path on one CPU thread; else the PyTorch predictor.
"""

from __future__ import annotations

import importlib.util
import json
from pathlib import Path

import numpy as np

from dilaserve.dws.cost import CostKernel
from dilaserve.dws.model import DWSPredictor
from dilaserve.dws.surface import step_cap

# a block under token editing runs at least one edit-only step (the one that edits nothing and
# closes it): the edit steps priced when the step predictor's calibration gives no mean
MIN_EDIT_STEPS = 1.0


def load_predictor(folder: str | Path):
    """The folder's INT8 ONNX graph where there is one and ONNX Runtime is installed, else its
    PyTorch predictor; both answer `predict(texts, prompt_tokens, gen_len)`."""
    from dilaserve.dws.onnx_predictor import INT8_NAME, ONNXDWSPredictor

    if (Path(folder) / INT8_NAME).is_file() and importlib.util.find_spec("onnxruntime"):
        return ONNXDWSPredictor.load(folder, int8=True)
    return DWSPredictor.load(folder)


class DWSEstimator:
    def __init__(
        self,
        predictor: DWSPredictor,
        kernel: CostKernel | None = None,
        steps_per_token: dict[float, float] | None = None,
        edit_steps: float = MIN_EDIT_STEPS,
    ):
        self.predictor = predictor
        self.kernel = kernel
        self.steps_per_token = steps_per_token or {}
        self.edit_steps = edit_steps  # edit-only steps a block runs, on average

    @classmethod
    def load(
        cls, folder: str | Path, kernel: str | Path | None = None, step_predictor=None
    ) -> DWSEstimator:
        rates, edit_steps = None, MIN_EDIT_STEPS
        if step_predictor is not None:
            meta = json.loads((Path(step_predictor) / "gbm-full.json").read_text())
            rates = {float(k): v for k, v in meta["one_shot_steps_per_token"].items()}
            edit_steps = meta.get("edit_steps_per_block") or MIN_EDIT_STEPS
        return cls(
            load_predictor(folder),
            CostKernel.load(kernel) if kernel is not None else None,
            rates,
            edit_steps,
        )

    def estimate(
        self,
        texts: list[str],
        prompt_tokens: list[int],
        gen_len: int,
        steps: int | None = None,
        edits: bool = False,
    ) -> list[tuple[float, dict[float, float] | None]]:
        """(expected cost, expected steps per threshold or None) for each prompt, under a step
        schedule of `steps` a block (None: none) and token editing (`edits`)."""
        surface = self.predictor.predict(texts, prompt_tokens, gen_len).surface
        if steps is not None:
            surface = step_cap(surface, steps)
        blocks = surface[:, :, 0]  # P(block b runs)
        edit = blocks * (self.edit_steps if edits else 0.0)  # expected edit-only steps a block
        expected = surface.sum(axis=(1, 2)) + edit.sum(axis=1)
        if self.kernel is not None:
            cost = np.atleast_1d(self.kernel.expected_cost(surface, prompt_tokens))
            last = self.kernel.cell_costs(np.asarray(prompt_tokens))[..., -1]  # a block step
            cost = cost + (edit * last).sum(axis=1)
        else:
            prompt_blocks = np.asarray(prompt_tokens) // self.predictor.block_len
            cost = prompt_blocks + blocks.sum(axis=1) + expected
        return [(float(c), self._prior(float(s))) for c, s in zip(cost, expected)]

    def _prior(self, steps: float) -> dict[float, float] | None:
        base = self.steps_per_token.get(self.predictor.threshold)
        if base is None:
            return None
        return {g: steps * rate / base for g, rate in self.steps_per_token.items()}
