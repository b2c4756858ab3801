"""The DWS cost kernel: the fit recovers a known kernel, W stays >= 0, expected cost of an
executed grid equals the run's cost, and probes of the real engine put a recompute step's cost
in a block's first cell."""

from types import SimpleNamespace

import numpy as np
import pytest

from dilaserve.dws import profile
from dilaserve.dws.cost import CostKernel, ProbeRun, fit_cost_kernel
from dilaserve.dws.profile import run_probes
from dilaserve.engine.engine import Engine
from dilaserve.protocol import StepKind

L = 32  # block_len


def synthetic_probes(w, delta, num, seed, noise=0.01, max_steps=16):
    """Probes whose step times come from W + delta (m - m_bar), with relative noise."""
    rng = np.random.default_rng(seed)
    shapes = []
    for _ in range(num):
        prompt = int(rng.integers(20, 200))
        steps = rng.integers(1, max_steps + 1, size=int(rng.integers(1, w.shape[0] + 1)))
        shapes.append((prompt, steps))
    m = np.array([p // L for p, _ in shapes])
    total = np.array([s.sum() for _, s in shapes])
    m_bar = (m * total).sum() / total.sum()
    probes = []
    for prompt, steps in shapes:
        shift = delta * (prompt // L - m_bar)
        cells = [(b, s) for b, t in enumerate(steps) for s in range(t)]
        times = [(w[b, s] + shift) * (1 + noise * rng.standard_normal()) for b, s in cells]
        probes.append(ProbeRun(prompt, L, [(b, s, ms) for (b, s), ms in zip(cells, times)]))
    return probes


def test_fit_recovers_a_known_kernel():
    w = np.full((2, L), 2.0)
    w[:, 0] = 10.0  # a recompute step costs five cache steps
    kernel = fit_cost_kernel(synthetic_probes(w, 0.5, 100, seed=0), 2, L)
    assert kernel.W[:, 0] == pytest.approx(10.0, abs=0.5)
    assert kernel.W[:, 1:] == pytest.approx(np.full((2, L - 1), 2.0), abs=0.5)  # unseen too
    assert kernel.delta == pytest.approx(0.5, abs=0.02)
    assert kernel.alpha == kernel.beta == 0.0  # no separate prefill or refresh forwards
    assert kernel.num_probes == 100 and kernel.val_mse < 0.5


def test_w_is_never_negative_even_when_longer_runs_are_cheaper():
    rng = np.random.default_rng(1)
    probes = []
    for _ in range(20):
        steps = [(0, s, 0.0) for s in range(int(rng.integers(1, L + 1)))]
        measured = 100.0 - 3.0 * len(steps) + 5 * rng.standard_normal()
        probes.append(ProbeRun(int(rng.integers(10, 300)), L, [(0, 0, measured)] + steps[1:]))
    kernel = fit_cost_kernel(probes, 1, L)
    assert kernel.W.min() >= 0.0


def test_expected_cost_of_an_executed_grid_is_the_runs_cost(tmp_path):
    rng = np.random.default_rng(2)
    kernel = CostKernel(
        W=rng.uniform(0, 5, size=(3, L)),
        delta=0.7,
        alpha=4.0,
        beta=1.5,
        m_bar=2.2,
        block_len=L,
        lambda_s=1e-4,
        lambda_b=1e-4,
        train_mse=0.0,
        val_mse=0.0,
        num_probes=5,
    )
    probe = ProbeRun(130, L, [(0, s, 1.0) for s in range(7)] + [(1, s, 1.0) for s in range(3)])
    grid = probe.cells(3)
    by_hand = 4.0 * 4 + 1.5 * 2 + (kernel.W * grid).sum() + 0.7 * (4 - 2.2) * 10
    assert kernel.expected_cost(grid, 130) == pytest.approx(kernel.cost_of_run(probe))
    assert kernel.cost_of_run(probe) == pytest.approx(by_hand)
    assert kernel.expected_cost(grid, 130, prefilled=True) == pytest.approx(by_hand - 16.0)
    batch = kernel.expected_cost(np.stack([grid, grid]), np.array([130, 130]))
    assert batch == pytest.approx([by_hand, by_hand])
    kernel.save(tmp_path / "k.json")
    assert CostKernel.load(tmp_path / "k.json").cost_of_run(probe) == pytest.approx(by_hand)


class StepClock:
    """The probes' clock: each engine step takes a fixed time by the kind of step it was (a
    recompute twice a cache step, as on a quiet CPU), so the fit sees the real engine's steps
    and cells without a busy machine's timing noise (a measured kernel is `profile --dws`'s)."""

    MS = {StepKind.RECOMPUTE: 20.0, StepKind.CACHE: 10.0}

    def __init__(self, monkeypatch):
        self.now = 0.0
        execute = Engine.execute

        def timed(engine, batch):
            output = execute(engine, batch)
            self.now += sum(self.MS[r.kind] for r in output.results) / 1e3
            return output

        monkeypatch.setattr(Engine, "execute", timed)
        monkeypatch.setattr(profile, "time", SimpleNamespace(perf_counter=lambda: self.now))


def test_real_probes_show_recompute_cells_cost_more_than_cache_cells(monkeypatch):
    from dilaserve.config import BUNDLED_MODEL
    from dilaserve.engine.llm import LLM
    from dilaserve.tasks import arith

    llm = LLM(BUNDLED_MODEL)
    StepClock(monkeypatch)
    problems = arith.generate(6, seed=0, split="test")
    prompts = [llm.encode_prompt(p.question, chat=True) for p in problems]
    natural = run_probes(llm, prompts[:3], gen_len=64)
    canvas = run_probes(llm, prompts[3:], gen_len=64, natural=False)
    assert all(p.output_blocks == 2 for p in canvas)  # canvas probes decode the whole window
    assert llm.engine.config.early_finish  # the caller's engine is left as it was
    kernel = fit_cost_kernel(natural + canvas, 2, L)
    assert kernel.W[:, 0].mean() > kernel.W[:, 1:].mean()


def test_too_few_probes_is_a_clear_error():
    probes = synthetic_probes(np.full((1, L), 2.0), 0.0, 4, seed=3)
    with pytest.raises(ValueError, match="at least 5 probes"):
        fit_cost_kernel(probes, 1, L)


def test_a_probe_too_long_for_the_kernel_is_rejected():
    probes = synthetic_probes(np.full((2, L), 2.0), 0.0, 6, seed=4)
    with pytest.raises(ValueError, match="max_blocks"):
        fit_cost_kernel(probes + [ProbeRun(40, L, [(b, 0, 1.0) for b in range(3)])], 2, L)


def test_an_exact_caches_prefill_and_commit_steps_split_into_their_phase_and_a_cell():
    from dilaserve.dws.profile import _probe
    from dilaserve.protocol import StepKind as K

    steps = [(0, 0, 10.0, K.PREFILL), (0, 1, 2.0, K.BLOCK), (0, 2, 2.0, K.BLOCK)]
    steps += [(1, 0, 5.0, K.COMMIT), (1, 1, 2.0, K.BLOCK)]
    probe = _probe(40, L, True, steps)
    assert (probe.prefill_ms, probe.refresh_ms) == (8.0, 3.0)
    assert [ms for _, _, ms in probe.step_ms] == [2.0] * 5
    approximate = _probe(40, L, True, [(0, 0, 10.0, K.RECOMPUTE), (0, 1, 2.0, K.CACHE)])
    assert (approximate.prefill_ms, approximate.refresh_ms) == (0.0, 0.0)
    assert [ms for _, _, ms in approximate.step_ms] == [10.0, 2.0]


def test_probes_of_a_block_diffusion_model_run_its_absolute_blocks(tmp_path):
    from family_checkpoints import llada2_checkpoint

    from dilaserve.engine.llm import LLM

    llm = LLM(llada2_checkpoint(tmp_path / "llada2"))
    prompt = llm.encode_prompt("w1 w2 w3 w4", chat=False)
    [probe] = run_probes(llm, [prompt] * 2, gen_len=64, natural=False)[:1]
    blocks = -(-(64 + len(prompt) % 32) // 32)  # blocks at absolute positions
    assert probe.output_blocks == blocks and probe.total_steps >= 64 // 32
