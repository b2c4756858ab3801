"""What a driver asks of DWS when a request arrives: its expected cost and step prior.

`DWSEstimator` joins the predictor (behaviour: the surface, from the prompt alone) with a
deployment's cost kernel (hardware: ms per cell; `dilaserve profile --dws`), kept apart so
that new hardware needs a new kernel, not a new predictor. Expected cost = prefill + refresh +
sum of surface x kernel (papers.md 2.6); without a kernel, the paper's unit cost (prompt blocks
+ E[N] + expected steps). The step prior, for the DiLaServe step predictor before a request's
first step, scales DWS's expected steps (at the threshold its labels were run at) to each
threshold by the step predictor's one-shot steps-per-token table.

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
    ):
        self.predictor = predictor
        self.kernel = kernel
        self.steps_per_token = steps_per_token or {}

    @classmethod
    def load(
        cls, folder: str | Path, kernel: str | Path | None = None, step_predictor=None
    ) -> DWSEstimator:
        rates = None
        if step_predictor is not None:
            meta = json.loads((Path(step_predictor) / "gbm-full.json").read_text())
            rates = {float(k): v for k, v in meta["one_shot_steps_per_token"].items()}
        return cls(
            load_predictor(folder),
            CostKernel.load(kernel) if kernel is not None else None,
            rates,
        )

    def estimate(
        self, texts: list[str], prompt_tokens: list[int], gen_len: int
    ) -> list[tuple[float, dict[float, float] | None]]:
        """(expected cost, expected steps per threshold or None) for each prompt."""
        prediction = self.predictor.predict(texts, prompt_tokens, gen_len)
        steps = prediction.expected_steps
        if self.kernel is not None:
            cost = np.atleast_1d(self.kernel.expected_cost(prediction.surface, prompt_tokens))
        else:
            blocks = np.asarray(prompt_tokens) // self.predictor.block_len
            cost = blocks + prediction.expected_blocks + steps
        return [(float(c), self._prior(float(s))) for c, s in zip(cost, steps)]

    def _prior(self, steps: float) -> dict[float, float] | None:
        base = self.steps_per_token.get(self.predictor.threshold)
        if base is None:
            return None
        return {g: steps * rate / base for g, rate in self.steps_per_token.items()}
