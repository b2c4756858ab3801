"""The model `dws.py`'s cost and sim parts judge (`--model`), and what DWS brings for it.

`target(args)` builds it once per run from the parsed arguments: the model's engine, the labels
DWS and the proxies trained on, its DWS predictors by encoder name, its cost kernel and latency
profile. It knows nothing of the parts that use it, nor of the command line's defaults.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path

from dilaserve.protocol import block_offset

GEN_LEN = 64


@dataclass
class Target:
    """The model the cost and sim parts judge (`--model`) and what DWS brings for it."""

    model: str
    llm: object  # its engine (`engine.llm.LLM`), for probes, prompt tokens and its cache mode
    labels: str  # the labels (`train-dws`'s labels.npz) DWS and the proxies trained on
    dws: dict[str, str]  # DWS predictor folders by encoder name
    kernel: str  # its cost kernel (`dilaserve profile --dws`)
    profile: str  # its latency profile, for the simulator

    @property
    def kv_cache(self):
        return self.llm.config.kv_cache  # as the model's family resolved it

    @property
    def aligned(self) -> bool:
        return self.llm.engine.family.is_block_causal  # blocks at absolute positions

    def offset(self, prompt_len: int) -> int:
        return block_offset(prompt_len, self.llm.config.block_len, self.aligned)


def target(args) -> Target:
    """The judged model and its DWS (made once, shared by the parts): the bundled LLaDA and its
    bundled predictor, kernel and labels by default; any other model names its own."""
    if getattr(args, "target", None) is None:
        from dilaserve.config import EngineConfig
        from dilaserve.engine.llm import LLM

        dws = {dws_encoder_name(args.dws): args.dws}
        if args.minilm_dws:  # given, or trained by the minilm part
            dws[dws_encoder_name(args.minilm_dws)] = args.minilm_dws
        llm = LLM(args.model, EngineConfig())
        args.target = Target(args.model, llm, args.labels, dws, args.dws_cost, args.profile)
    return args.target


def dws_encoder_name(folder) -> str:
    """The name of the encoder of the DWS predictor in `folder`."""
    encoder = json.loads((Path(folder) / "dws.json").read_text())["encoder"]
    return encoder.get("folder", encoder["kind"])  # MINILM's name, a folder, or "hashed"
