"""Dream through the registry: the published layout, the published computation (checked against
an independent re-statement of it), the one-position logit shift, the approximate caches,
batch invariance and tensor parallelism."""

import json

import pytest
import torch
import torch.nn.functional as F
from family_checkpoints import (
    DREAM_KEYS,
    dream_checkpoint,
    drive,
    plain_and_graphed,
    prompt_ids,
    same_logs,
    tensor_parallel_execute,
)
from safetensors.torch import load_file

from dilaserve.cli import main
from dilaserve.config import EngineConfig, SamplingParams
from dilaserve.engine.engine import Engine
from dilaserve.engine.llm import LLM
from dilaserve.models.checkpoint import load_model
from dilaserve.protocol import SequenceSpec, StepBatch, StepItem, StepKind
from dilaserve.request import Request

from conftest import HANG_GUARD_S

BLOCK = 8


@pytest.fixture(scope="module")
def path(tmp_path_factory):
    return dream_checkpoint(tmp_path_factory.mktemp("dream"))


def engine(path, kv_cache="dual") -> Engine:
    return Engine.from_checkpoint(path, EngineConfig(kv_cache, block_len=BLOCK))


def state_dict(path) -> dict[str, torch.Tensor]:
    out = {}
    for shard in sorted(path.glob("*.safetensors")):
        out.update(load_file(shard))
    return out


def reference_logits(path, ids: torch.Tensor) -> torch.Tensor:
    """Dream's published forward, restated from its equations (Qwen2, no causal mask)."""
    raw, w = json.loads((path / "config.json").read_text()), state_dict(path)
    d, heads, kv = raw["hidden_size"], raw["num_attention_heads"], raw["num_key_value_heads"]
    hd, eps, n = d // heads, raw["rms_norm_eps"], len(ids)
    inv = 1.0 / raw["rope_theta"] ** (torch.arange(0, hd, 2).float() / hd)
    freqs = torch.arange(n).float()[:, None] * inv
    cos, sin = torch.cat((freqs, freqs), -1).cos(), torch.cat((freqs, freqs), -1).sin()

    def rms(x, weight):
        return weight * (x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + eps))

    def rope(t):
        half = t.shape[-1] // 2
        return t * cos + torch.cat((-t[..., half:], t[..., :half]), -1) * sin

    x = w["model.embed_tokens.weight"][ids]
    for i in range(raw["num_hidden_layers"]):
        p = f"model.layers.{i}."
        h = rms(x, w[p + "input_layernorm.weight"])
        proj = {
            name: h @ w[f"{p}self_attn.{name}_proj.weight"].T + w[f"{p}self_attn.{name}_proj.bias"]
            for name in "qkv"
        }
        q = rope(proj["q"].view(n, heads, hd).transpose(0, 1))
        k = rope(proj["k"].view(n, kv, hd).transpose(0, 1)).repeat_interleave(heads // kv, 0)
        v = proj["v"].view(n, kv, hd).transpose(0, 1).repeat_interleave(heads // kv, 0)
        att = torch.softmax(q @ k.transpose(1, 2) / hd**0.5, -1) @ v
        x = x + att.transpose(0, 1).reshape(n, d) @ w[p + "self_attn.o_proj.weight"].T
        h = rms(x, w[p + "post_attention_layernorm.weight"])
        gate, up = h @ w[p + "mlp.gate_proj.weight"].T, h @ w[p + "mlp.up_proj.weight"].T
        x = x + (F.silu(gate) * up) @ w[p + "mlp.down_proj.weight"].T
    return rms(x, w["model.norm.weight"]) @ w["lm_head.weight"].T


def test_the_checkpoint_has_the_published_names_and_shapes(path):
    weights = state_dict(path)
    raw = json.loads((path / "config.json").read_text())
    d, hd = raw["hidden_size"], raw["hidden_size"] // raw["num_attention_heads"]
    kv = raw["num_key_value_heads"] * hd
    assert weights["model.layers.1.self_attn.q_proj.weight"].shape == (d, d)
    assert weights["model.layers.1.self_attn.k_proj.weight"].shape == (kv, d)
    assert weights["model.layers.1.self_attn.v_proj.bias"].shape == (kv,)
    assert weights["model.layers.0.mlp.down_proj.weight"].shape == (d, raw["intermediate_size"])
    assert weights["lm_head.weight"].shape == (raw["vocab_size"], d)  # untied
    assert "model.layers.0.self_attn.o_proj.bias" not in weights
    assert set(raw) == DREAM_KEYS


def test_the_forward_pass_is_the_published_computation(path):
    model = load_model(path)
    ids = torch.tensor(prompt_ids(11))
    out = model(ids[None], torch.arange(11)[None], torch.ones(1, 11, dtype=torch.bool))
    got = model.logits(out.hidden)[0]
    assert torch.allclose(got, reference_logits(path, ids), atol=1e-4)


def test_the_token_at_i_is_read_from_the_output_at_i_minus_one(path):
    eng = engine(path, "none")
    prompt, mask = prompt_ids(7), eng.special.mask
    spec = SequenceSpec(prompt, [mask] * BLOCK)
    result = eng.execute(StepBatch((StepItem("r", 1e-9, StepKind.FULL, spec),))).results[0]
    assert result.positions.tolist() == list(range(BLOCK))  # all clear ~0, the budget is B
    logits = reference_logits(path, torch.tensor(prompt + (mask,) * BLOCK))
    logits[:, mask] = float("-inf")
    shifted = logits[len(prompt) - 1 : len(prompt) - 1 + BLOCK].argmax(-1)
    unshifted = logits[len(prompt) : len(prompt) + BLOCK].argmax(-1)
    assert result.tokens.tolist() == shifted.tolist()
    assert shifted.tolist() != unshifted.tolist()  # the test tells the two apart


@pytest.mark.parametrize("kv_cache", ["dual", "prefix"])
def test_a_block_opens_with_its_first_position_then_cache_steps_run_the_block(path, kv_cache):
    """Fast-dLLM's Dream decoders: a block's first step (a full forward) commits its first
    position only, whatever the confidences; a cache step then runs only the block (dual) or the
    block and what follows (prefix), since the position before the block is read by no one."""
    eng = engine(path, kv_cache)
    mask = eng.special.mask
    spec = SequenceSpec(prompt_ids(5), [mask] * 2 * BLOCK)
    first = eng.execute(StepBatch((StepItem("r", 1e-9, StepKind.RECOMPUTE, spec),)))
    second = eng.execute(StepBatch((StepItem("r", 1.0, StepKind.CACHE),)))
    logits = reference_logits(path, torch.tensor(prompt_ids(5) + (mask,) * 2 * BLOCK))
    logits[:, mask] = float("-inf")
    assert first.num_tokens == 5 + 2 * BLOCK
    assert first.results[0].positions.tolist() == [0]  # though every position clears 1e-9
    assert first.results[0].tokens[0] == logits[4].argmax()  # its top-1
    assert second.results[0].kind is StepKind.CACHE
    assert second.num_tokens == (BLOCK if kv_cache == "dual" else 2 * BLOCK)
    assert len(second.results[0].positions) == 1 and second.results[0].positions[0] > 0


def test_a_recompute_inside_a_started_block_runs_the_threshold_rule(path):
    """A request moved mid-block recomputes there; its block is already open."""
    eng = engine(path, "dual")
    mask = eng.special.mask
    spec = SequenceSpec(prompt_ids(5), [prompt_ids(1)[0]] + [mask] * (2 * BLOCK - 1))
    result = eng.execute(StepBatch((StepItem("r", 1e-9, StepKind.RECOMPUTE, spec),))).results[0]
    assert result.positions.tolist() == list(range(1, BLOCK))


@pytest.mark.parametrize("kv_cache", ["none", "prefix", "dual"])
def test_the_offline_llm_generates_with_every_cache_mode(path, kv_cache):
    llm = LLM(path, EngineConfig(kv_cache, block_len=BLOCK, early_finish=False))
    out = llm.generate(["w1 w2 w3", "w4 + 5 ="], SamplingParams(0.9, 2 * BLOCK))
    assert len(out) == 2 and all(o.num_steps >= 2 for o in out)
    kinds = set().union(*(o.steps_by_kind for o in out))
    assert kinds == ({"full"} if kv_cache == "none" else {"recompute", "cache"})


def make(eng, rid, prompt_len, threshold):
    prompt = prompt_ids(prompt_len, offset=prompt_len)
    return Request(rid, prompt, 2 * BLOCK, BLOCK, eng.special.mask, threshold)


def test_a_batch_mixing_thresholds_and_step_kinds_is_invariant_to_its_batch_mates(path):
    eng = engine(path, "dual")
    shapes = {"a": (5, 0.3), "b": (9, 0.97), "c": (3, 0.6)}
    together = drive(
        eng.execute, [make(eng, r, *s) for r, s in shapes.items()], "dual", {"b": 2, "c": 3}
    )
    alone = {}
    for rid, shape in shapes.items():
        alone.update(drive(eng.execute, [make(eng, rid, *shape)], "dual"))
    assert same_logs(together, alone)
    kinds = {s[0] for steps in together.values() for s in steps}
    assert kinds == {"recompute", "cache"}


@pytest.mark.slow
def test_tensor_parallel_two_ranks_commit_the_same_tokens_as_one(path):
    config = EngineConfig("dual", block_len=BLOCK)
    eng = Engine.from_checkpoint(path, config)
    requests = [make(eng, "a", 5, 0.5), make(eng, "b", 8, 0.9)]
    one = drive(eng.execute, requests, "dual")
    execute, stop = tensor_parallel_execute(path, config)
    try:
        two = drive(execute, [make(eng, "a", 5, 0.5), make(eng, "b", 8, 0.9)], "dual")
    finally:
        stop()
    assert same_logs(one, two, atol=1e-4)


def test_too_few_kv_heads_for_the_ranks_is_refused(path):
    config = load_model(path).config
    config.check_tensor_parallel(2)
    with pytest.raises(ValueError, match="does not divide the model's num_key_value_heads=2"):
        config.check_tensor_parallel(4)


def test_bfloat16_generates_close_to_float32(path):
    ids = torch.tensor([prompt_ids(11)])
    args = (ids, torch.arange(11)[None], torch.ones(1, 11, dtype=torch.bool))
    full, half = load_model(path), load_model(path, "bfloat16")
    want, got = full.logits(full(*args).hidden), half.logits(half(*args).hidden).float()
    assert (want.argmax(-1) == got.argmax(-1)).float().mean() >= 0.8
    llm = LLM(path, EngineConfig("dual", block_len=BLOCK, dtype="bfloat16"))
    assert llm.generate(["w1 w2"], SamplingParams(0.9, BLOCK))[0].num_steps >= 1


def test_dilaserve_generate_runs_it(path, capsys):
    assert main(["generate", "--model", str(path), "--prompt", "w1 w2", "--max-tokens", "32"]) == 0
    out = capsys.readouterr().out
    assert "### w1 w2" in out and "recompute" in out


@pytest.mark.slow
def test_it_calibrates_and_serves_through_the_cluster(path, tmp_path):
    """The user's path: calibrate (through the cluster's workers), then a cluster built from the
    calibration answers as the offline engine does at a pinned threshold."""
    from dilaserve.cli import build_parser
    from dilaserve.cli_args import resolve_model
    from dilaserve.cli_cluster import cluster_config
    from dilaserve.cluster.runtime import Cluster

    folder = tmp_path / "calibration"
    argv = ["calibrate", str(path), "--requests", "1,2", "--repeats", "1", "--num-prompts", "6"]
    assert main([*argv, "--max-tokens", "32", "--calibration", str(folder)]) == 0
    serve = ["run-trace", str(path), "--calibration", str(folder), "--instances", "1"]
    args = build_parser().parse_args([*serve, "--max-tokens", "32"])
    resolve_model(args)
    config, inputs = cluster_config(args)
    assert inputs.label["source"] == "calibrated"
    prompts = ["w3 w5 w7", "w11 w2"]
    with Cluster(config) as cluster:
        served = [cluster.submit(p, threshold=0.9).result(HANG_GUARD_S).text for p in prompts]
    offline = LLM(path).generate(prompts, SamplingParams(0.9, 32))
    assert served == [c.text for c in offline]


@pytest.mark.parametrize("mode", ["dual", "prefix"])
def test_cache_steps_on_static_buffers_commit_the_same_tokens(path, mode):
    """engine/graphs.py's path (eager here: graphs are captured only on CUDA) runs Dream's
    dual- and prefix-cache steps too, whose blocks open by their first position, with padding
    rows (3 -> 4) and fallbacks (4 requests > 3): the same tokens and steps as the plain path.
    A prefix-cache step queries its block and the rest of the window."""

    config = EngineConfig(mode, block_len=BLOCK, early_finish=False, cuda_graphs=3)
    cases = [(5, 16, 0.5), (8, 24, 0.9), (13, 16, 0.7), (9, 32, 0.3)]
    plain, graphed, calls = plain_and_graphed(path, config, cases)
    assert graphed == plain
    rows, queried = zip(*calls)
    windows = {BLOCK} if mode == "dual" else {BLOCK * n for n in (1, 2, 3, 4)}
    assert max(rows) == 3 and set(queried) == windows
