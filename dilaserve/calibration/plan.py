"""What a calibration measures (`Plan`): the key, the engine, the profile grid and the prompts,
and what each measurement costs in token-steps, for the time left (`calibration/progress.py`).

The profiled sequences (prompt + window, twice the window by default) are capped at the model's
positions. The grid's batch sizes are not: a point of 128 requests of a 512-position model is a
65,536-token step, the engine's default `max_forward_tokens`, a batch that serving runs and whose
latency the planner and the scheduler look up.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path

from dilaserve.calibration.latency import BEFORE, KINDS, ProfileGrid, batch_sizes
from dilaserve.calibration.progress import Unit, step_tokens, trajectory_cost
from dilaserve.calibration.store import CalibrationKey, model_key
from dilaserve.config import ASSETS, EngineConfig, SamplingParams
from dilaserve.protocol import KVCacheMode, StepKind

SHIPPED_PROMPTS = ASSETS / "prompts" / "calibration.jsonl"
MODEL_PROMPTS = "calibration_prompts.jsonl"
PROFILE, TRAJECTORIES = "profile", "trajectories"  # the phases of the progress log


def device_name(device: str) -> str:
    """What calibrations are keyed by: the GPU's name, or "cpu"."""
    import torch

    from dilaserve.models.checkpoint import check_device

    check_device(device)
    d = torch.device(device)
    if d.type == "cuda":
        return torch.cuda.get_device_name(d.index or 0)
    return d.type


def load_prompts(cfg) -> tuple[list[str], str]:
    """The prompt set and where it came from."""
    own = Path(cfg.model) / MODEL_PROMPTS
    path = Path(cfg.prompts) if cfg.prompts else own if own.is_file() else SHIPPED_PROMPTS
    try:
        lines = path.read_text().splitlines()
    except FileNotFoundError:
        raise FileNotFoundError(f"prompt file {path} does not exist") from None
    prompts = []
    for i, line in enumerate(lines):
        if not line.strip():
            continue
        try:
            prompts.append(str(json.loads(line)["prompt"]))
        except (json.JSONDecodeError, KeyError, TypeError):
            raise ValueError(f"{path} line {i + 1}: expected a JSON object with 'prompt'") from None
    if len(prompts) < 5:
        raise ValueError(f"{path} has {len(prompts)} prompts; calibration needs at least 5")
    return prompts[: cfg.num_prompts], str(path)


def _model(model: str):
    """The checkpoint's config, family and tokenizer (no weights)."""
    from dilaserve.models.registry import family_of, load_config
    from dilaserve.models.tokenizer import Tokenizer

    config = load_config(model)
    return config, family_of(config), Tokenizer(Path(model), config)


def _fitting(tokenizer, context: int, prompts: list[str], gen_len: int) -> list[tuple[str, int]]:
    """The prompts that fit the model's context with the output window, with their lengths."""
    lengths = [(p, len(tokenizer.encode_chat(p))) for p in prompts]
    return [(p, n) for p, n in lengths if n + gen_len <= context]


@dataclass(frozen=True)
class Plan:
    """What one calibration (or profile) measures: the key, the engine, the grid, the prompts."""

    key: CalibrationKey
    engine: EngineConfig
    grid: ProfileGrid
    mask_id: int
    prompts: tuple[str, ...]
    source: str  # where the prompts came from
    gen_len: int  # the output window of the prompts' trajectories
    prompt_len: float = 0.0  # the prompts' mean length in tokens
    editing: str = "off"  # the token-editing mode the trajectories run (the family's, resolved)

    @property
    def kinds(self) -> tuple[StepKind, ...]:
        return KINDS[self.engine.kv_cache]

    def num_points(self, tps) -> int:
        """Profile points to measure at TP degrees `tps`: each step kind at each batch size."""
        return len(self.profile_units(tps))

    def profile_units(self, tps) -> list[Unit]:
        """One unit per profile point, costed at the tokens its warm-up and repeats run."""
        g, units = self.grid, []
        runs = g.repeats + 1
        for _ in tps:
            for kind in self.kinds:
                kinds = (kind, BEFORE[kind]) if kind in BEFORE else (kind,)
                tokens = sum(step_tokens(k, g.seq_len, g.gen_len, g.block_len) for k in kinds)
                for n in batch_sizes(g, self.engine.max_forward_tokens):
                    units.append(Unit(PROFILE, runs * n * tokens))
        return units

    def trajectory_cost(self, steps: float) -> float:
        """Token-steps of one threshold's trajectories at `steps` steps per request."""
        mode, block_len = self.engine.kv_cache, self.engine.block_len
        one = trajectory_cost(mode, self.prompt_len, self.gen_len, block_len, steps)
        return len(self.prompts) * one

    def trajectory_units(self, num_thresholds: int) -> list[Unit]:
        """One unit per threshold, first costed at one committed token per step (the most
        steps a request can take; a random-weight model takes about as many)."""
        cost = self.trajectory_cost(self.gen_len)
        return [Unit(TRAJECTORIES, cost) for _ in range(num_thresholds)]


def create_plan(cfg, with_prompts: bool = True) -> Plan:
    """The plan of `cfg` (a `CalibrateConfig`); without prompts for a profile alone."""
    from dilaserve.models.generation import default_max_tokens

    key = model_key(cfg.model, device_name(cfg.device), cfg.dtype)
    model_config, family, tokenizer = _model(cfg.model)
    for tp in cfg.tp:
        model_config.check_tensor_parallel(tp)
    mode = family.cache_mode(KVCacheMode.DUAL)  # the exact block cache of block diffusion
    engine = EngineConfig(
        mode, dtype=cfg.dtype, device=cfg.device, cuda_graphs=cfg.cuda_graphs, editing=cfg.editing
    )
    editing = family.decoding_for(model_config, cfg.editing).editing  # a mode it lacks: refused
    window = SamplingParams(max_tokens=cfg.max_tokens or default_max_tokens(cfg.model))
    gen_len = window.gen_len(engine.block_len)
    # a commit step needs a block after the first: the profiled window holds two at least
    profiled = max(gen_len, 2 * engine.block_len) if mode is KVCacheMode.BLOCK else gen_len
    positions = model_config.max_sequence_length
    seq_len = min(cfg.seq_len or 2 * profiled, positions)
    if profiled >= seq_len:
        raise ValueError(
            f"the profiled window of {profiled} tokens leaves no prompt within the model's "
            f"{positions} positions: give a smaller --max-tokens"
        )
    grid = ProfileGrid(seq_len, profiled, cfg.requests, cfg.repeats, block_len=engine.block_len)
    prompts, source = load_prompts(cfg) if with_prompts else ([], "")
    fitting = _fitting(tokenizer, positions, prompts, gen_len)
    if with_prompts and len(fitting) < 5:
        raise ValueError(f"fewer than 5 prompts of {source} fit the context with {gen_len} tokens")
    prompt_len = sum(n for _, n in fitting) / max(len(fitting), 1)
    kept = tuple(p for p, _ in fitting)
    mode_name = editing.mode if editing is not None else "off"
    return Plan(
        key, engine, grid, tokenizer.special.mask, kept, source, gen_len, prompt_len, mode_name
    )
