"""The DWS cost kernel: what a request's denoising grid costs in ms (papers.md 2.6, 2.7).

A request decodes a grid of cells, output block b and denoising step s within it. Cells do not
all cost the same: in our engine with `kv_cache="dual"` a block's first step (s = 0) is a
RECOMPUTE forward over the whole sequence and the others are CACHE forwards over one block. So
the expected cost of a request is its surface S[b, s] (the probability that each cell runs)
weighted by a per-cell cost kernel rather than a step count:

    K[b, s]   = W[b, s] + delta * (m - m_bar)         m = floor(P / d) prompt blocks
    C_prefill = m * alpha                              (only if not yet prefilled)
    C_refresh = E[N] * beta                            E[N] = sum_b S[b, 0]
    C_total   = C_prefill + C_refresh + sum_{b,s} K[b, s] * S[b, s]

W, delta, alpha and beta are measured per deployment from batch-1 probe runs (`ProbeRun`, which
`profile.run_probes` times on the engine) and fitted by weighted, smoothed non-negative least
squares (`fit_cost_kernel`); the surface comes from the prompt-only predictor, so the two are
decoupled: the predictor is reused across hardware, the kernel is re-measured.

With an approximate cache our engine has no separate prefill forward (the prompt is part of
every block's RECOMPUTE step) and no separate refresh forward (the next block's RECOMPUTE step
refreshes the K/V), so its probes carry prefill_ms = refresh_ms = 0 and the fit gives alpha =
beta = 0. Block diffusion (an exact cache, LLaDA2.x) is the execution model the formula was
written for: a PREFILL step is the prefill fused with the first cell, a COMMIT step the refresh
fused with a block's first cell; a probe charges such a cell the median BLOCK step and counts
the rest as prefill (resp. refresh) time, so alpha and beta are measured. `dilaserve profile
--dws` (`dws/profile.py`) runs the whole procedure.
"""

from __future__ import annotations

import json
from dataclasses import asdict, dataclass, field
from pathlib import Path

import numpy as np

SCHEMA = "dilaserve-dws-cost-1"
LAMBDAS = (1e-6, 1e-4, 1e-2)  # the smoothing strengths papers.md 2.7 chooses from
MIN_PROBES = 5  # every 5th probe is held out, so 5 is the fewest with one validation probe
WEIGHT_OFFSET = 10.0  # probe weight (T + 10)^-2: long probes do not dominate the fit


@dataclass(frozen=True)
class ProbeRun:
    """One batch-1 run of one prompt: the time of every denoising step and where it ran.

    step_ms: (block index, step index within the block, ms) for every step, in order.
    prefill_ms / refresh_ms: time of separate prefill and refresh forwards; 0 for our engine,
    which has neither. natural: False for a canvas probe (decoded to the end of its window).
    """

    prompt_tokens: int
    block_len: int
    step_ms: list[tuple[int, int, float]]
    prefill_ms: float = 0.0
    refresh_ms: float = 0.0
    natural: bool = True

    def __post_init__(self):
        if not self.step_ms:
            raise ValueError("a probe needs at least one denoising step")
        expected = [(b, s) for b, t in enumerate(self.block_steps) for s in range(t)]
        if [(b, s) for b, s, _ in self.step_ms] != expected:
            raise ValueError(
                "a probe's steps must run blocks in order from 0, each block's steps numbered "
                f"0, 1, ...; got {[(b, s) for b, s, _ in self.step_ms]}"
            )

    @property
    def prompt_blocks(self) -> int:
        """m = floor(P / d): the prompt's whole blocks (the prefill rounds of papers.md 2.1)."""
        return self.prompt_tokens // self.block_len

    @property
    def output_blocks(self) -> int:
        """N, the output blocks this run executed."""
        return 1 + max(b for b, _, _ in self.step_ms)

    @property
    def block_steps(self) -> list[int]:
        """T_b, the denoising steps each executed block took."""
        steps = [0] * (1 + max(b for b, _, _ in self.step_ms))
        for b, _, _ in self.step_ms:
            steps[b] += 1
        return steps

    @property
    def total_steps(self) -> int:
        return len(self.step_ms)

    @property
    def denoise_ms(self) -> float:
        return sum(ms for _, _, ms in self.step_ms)

    @property
    def total_ms(self) -> float:
        return self.prefill_ms + self.refresh_ms + self.denoise_ms

    def cells(self, max_blocks: int | None = None) -> np.ndarray:
        """The executed-cell indicator a[b, s] = 1[s < T_b], [max_blocks, block_len]."""
        rows = self.output_blocks if max_blocks is None else max_blocks
        if self.output_blocks > rows:
            raise ValueError(f"probe ran {self.output_blocks} blocks, more than {max_blocks=}")
        out = np.zeros((rows, self.block_len))
        for b, s, _ in self.step_ms:
            out[b, s] = 1.0
        return out


@dataclass
class CostKernel:
    """A fitted cost kernel (module docstring) with its fit diagnostics.

    W: [max_blocks, block_len] ms per cell at the mean prompt length, >= 0. delta: ms per cell per
    prompt block away from m_bar (the step-weighted mean prompt blocks of the probes). alpha: ms
    per prefill block; beta: ms per output block refresh. lambda_s / lambda_b: the smoothing
    chosen on held-out probes; train_mse / val_mse: squared error (ms^2) of the predicted
    denoising time on all probes after the refit / on the held-out probes at the chosen lambdas.
    meta: provenance (model, threshold, hardware), since a kernel holds for one deployment only.
    """

    W: np.ndarray
    delta: float
    alpha: float
    beta: float
    m_bar: float
    block_len: int
    lambda_s: float
    lambda_b: float
    train_mse: float
    val_mse: float
    num_probes: int
    meta: dict = field(default_factory=dict)

    @property
    def max_blocks(self) -> int:
        return self.W.shape[0]

    def cell_costs(self, prompt_tokens) -> np.ndarray:
        """K = W + delta (m - m_bar): [max_blocks, block_len], or [batch, ...] for a batch.

        Clamped at 0: a cell never takes negative time, which a free delta could otherwise
        claim for prompts far shorter than any probe's.
        """
        m = np.asarray(prompt_tokens) // self.block_len
        shift = self.delta * (m - self.m_bar)
        return np.maximum(self.W + np.asarray(shift, dtype=float)[..., None, None], 0.0)

    def expected_cost(self, surface: np.ndarray, prompt_tokens, prefilled: bool = False):
        """Expected ms of a request (or of each of a batch) from its surface.

        surface: [max_blocks, block_len] or [batch, max_blocks, block_len]; prompt_tokens: an
        int, or one per batch row. prefilled: the prompt is already in the cache (decode cost
        only, as the scheduler uses for admitted requests).
        """
        surface = np.asarray(surface, dtype=float)
        if surface.shape[-2:] != self.W.shape:
            raise ValueError(
                f"surface of shape {surface.shape} does not end in the kernel's {self.W.shape}"
            )
        m = np.asarray(prompt_tokens) // self.block_len
        prefill = 0.0 if prefilled else self.alpha * m
        refresh = self.beta * surface[..., :, 0].sum(axis=-1)
        denoise = (self.cell_costs(prompt_tokens) * surface).sum(axis=(-2, -1))
        total = prefill + refresh + denoise
        return float(total) if np.ndim(total) == 0 else total

    def cost_of_run(self, probe: ProbeRun) -> float:
        """The kernel's cost of a run whose executed cells are known (for evaluation)."""
        if probe.block_len != self.block_len:
            raise ValueError(f"probe block_len {probe.block_len} != kernel's {self.block_len}")
        if probe.output_blocks > self.max_blocks:
            raise ValueError(
                f"probe ran {probe.output_blocks} blocks, kernel has {self.max_blocks}"
            )
        k = self.cell_costs(probe.prompt_tokens)
        denoise = sum(k[b, s] for b, s, _ in probe.step_ms)
        return float(self.alpha * probe.prompt_blocks + self.beta * probe.output_blocks + denoise)

    def to_dict(self) -> dict:
        return {**asdict(self), "schema": SCHEMA, "W": np.round(self.W, 6).tolist()}

    @classmethod
    def from_dict(cls, data: dict) -> CostKernel:
        if data.get("schema") != SCHEMA:
            raise ValueError(f"not a DWS cost kernel: schema {data.get('schema')!r} != {SCHEMA!r}")
        fields = {k: v for k, v in data.items() if k != "schema"}
        return cls(**{**fields, "W": np.asarray(data["W"], dtype=float)})

    def save(self, path: str | Path) -> None:
        path = Path(path)
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(json.dumps(self.to_dict(), indent=2) + "\n")

    @classmethod
    def load(cls, path: str | Path) -> CostKernel:
        return cls.from_dict(json.loads(Path(path).read_text()))


# -- fitting (papers.md 2.7) ----------------------------------------------------------------


@dataclass(frozen=True)
class _Design:
    """The probes as a regression: cells a [n, B*L], steps T, prompt blocks m, denoise ms y."""

    cells: np.ndarray
    steps: np.ndarray
    m: np.ndarray
    y: np.ndarray
    m_bar: float

    def subset(self, keep: np.ndarray) -> _Design:
        return _Design(self.cells[keep], self.steps[keep], self.m[keep], self.y[keep], self.m_bar)

    def delta_column(self) -> np.ndarray:
        return (self.m - self.m_bar) * self.steps

    def predict(self, w: np.ndarray, delta: float) -> np.ndarray:
        return self.cells @ w.ravel() + delta * self.delta_column()


def _design(probes: list[ProbeRun], max_blocks: int) -> _Design:
    cells = np.stack([p.cells(max_blocks).ravel() for p in probes])
    steps = cells.sum(axis=1)
    m = np.array([p.prompt_blocks for p in probes], dtype=float)
    y = np.array([p.denoise_ms for p in probes])
    return _Design(cells, steps, m, y, float((m * steps).sum() / steps.sum()))


def _smoothing(shape: tuple[int, int], lambda_s: float, lambda_b: float) -> np.ndarray:
    """sqrt(lambda)-scaled first differences of W along s and along b, one row each.

    They tie every cell to its neighbours, so cells no probe executed take their neighbours'
    cost, and the system stays well-posed however few probes reach late blocks.
    """
    index = np.arange(shape[0] * shape[1]).reshape(shape)
    pairs = [(lambda_s, index[:, 1:], index[:, :-1]), (lambda_b, index[1:, :], index[:-1, :])]
    rows = []
    for lam, hi, lo in pairs:
        d = np.zeros((hi.size, index.size))
        d[np.arange(hi.size), hi.ravel()] = 1.0
        d[np.arange(hi.size), lo.ravel()] = -1.0
        rows.append(np.sqrt(lam) * d)
    return np.vstack(rows)


def _solve(data: _Design, shape, lambda_s: float, lambda_b: float, use_delta: bool):
    """argmin sum_r w_r (<W, a_r> + delta (m_r - m_bar) T_r - y_r)^2 / n + smoothing, W >= 0."""
    from scipy.optimize import lsq_linear

    scale = np.sqrt((data.steps + WEIGHT_OFFSET) ** -2.0 / len(data.y))
    smooth = _smoothing(shape, lambda_s, lambda_b)
    a = np.vstack([data.cells * scale[:, None], smooth])
    if use_delta:
        extra = np.concatenate([data.delta_column() * scale, np.zeros(len(smooth))])
        a = np.hstack([a, extra[:, None]])
    b = np.concatenate([data.y * scale, np.zeros(len(smooth))])
    lower = np.zeros(a.shape[1])
    if use_delta:
        lower[-1] = -np.inf
    fit = lsq_linear(a, b, bounds=(lower, np.inf), method="bvls")
    if not fit.success:
        raise RuntimeError(f"cost-kernel least squares did not converge: {fit.message}")
    w = np.maximum(fit.x[: smooth.shape[1]], 0.0).reshape(shape)
    return w, float(fit.x[-1]) if use_delta else 0.0


def _mse(data: _Design, w: np.ndarray, delta: float) -> float:
    return float(np.mean((data.predict(w, delta) - data.y) ** 2))


def _check(probes: list[ProbeRun], max_blocks: int, block_len: int, lambdas) -> None:
    if len(probes) < MIN_PROBES:
        raise ValueError(
            f"fitting a cost kernel needs at least {MIN_PROBES} probes (every 5th is held out "
            f"to choose the smoothing); got {len(probes)}"
        )
    if not lambdas or min(lambdas) <= 0:
        raise ValueError(f"lambdas must be positive smoothing strengths; got {lambdas}")
    for i, p in enumerate(probes):
        if p.block_len != block_len:
            raise ValueError(f"probe {i} has block_len {p.block_len}, the fit {block_len}")
        if p.output_blocks > max_blocks:
            raise ValueError(f"probe {i} ran {p.output_blocks} blocks, beyond {max_blocks=}")


def fit_cost_kernel(
    probes: list[ProbeRun],
    max_blocks: int,
    block_len: int,
    lambdas=LAMBDAS,
    meta: dict | None = None,
) -> CostKernel:
    """Fit W >= 0 and a free delta to the probes' denoising ms (papers.md 2.7).

    Weighted least squares, weight (T + 10)^-2 per probe (T its steps), plus first-difference
    smoothing of W along s (lambda_s) and along b (lambda_b). Each (lambda_s, lambda_b) pair from
    `lambdas` is fitted on the probes not held out (every 5th is held out) and scored by held-out
    MSE; the best pair is refitted on all probes. delta is fixed at 0 when every prompt has the
    same number of prompt blocks (it would not be identifiable). alpha and beta are plain ratios:
    total prefill ms per prefill block, total refresh ms per output block.
    """
    _check(probes, max_blocks, block_len, lambdas)
    data, shape = _design(probes, max_blocks), (max_blocks, block_len)
    use_delta = len(set(data.m)) > 1
    held_out = np.arange(len(probes)) % 5 == 4
    train, val = data.subset(~held_out), data.subset(held_out)

    def held_out_mse(pair):
        return _mse(val, *_solve(train, shape, *pair, use_delta))

    pairs = [(ls, lb) for ls in lambdas for lb in lambdas]
    scores = {pair: held_out_mse(pair) for pair in pairs}
    best = min(pairs, key=scores.__getitem__)
    w, delta = _solve(data, shape, *best, use_delta)
    prefill_blocks = sum(p.prompt_blocks for p in probes)
    return CostKernel(
        W=w,
        delta=delta,
        alpha=sum(p.prefill_ms for p in probes) / prefill_blocks if prefill_blocks else 0.0,
        beta=sum(p.refresh_ms for p in probes) / sum(p.output_blocks for p in probes),
        m_bar=data.m_bar,
        block_len=block_len,
        lambda_s=best[0],
        lambda_b=best[1],
        train_mse=_mse(data, w, delta),
        val_mse=scores[best],
        num_probes=len(probes),
        meta=dict(meta or {}),
    )
