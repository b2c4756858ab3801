"""LLaDA2.x through the registry: the published layout and computation (checked against an
independent re-statement), group-limited routing with a selection-only expert bias, block
causality, the exact block cache (prefill, block and commit steps equal to the no-cache
forward), batch invariance, tensor parallelism with experts split across ranks, and the
offline path; calibration and serving through the cluster."""

import json

import pytest
import torch
import torch.nn.functional as F
from family_checkpoints import (
    LLADA2_KEYS,
    drive,
    llada2_checkpoint,
    prompt_ids,
    quiet_mask,
    same_logs,
    tensor_parallel_execute,
)
from safetensors.torch import load_file

from dilaserve.cli import main
from dilaserve.cluster.runtime import Cluster
from dilaserve.config import EngineConfig, SamplingParams
from dilaserve.engine.engine import Engine
from dilaserve.engine.llm import LLM
from dilaserve.models.checkpoint import load_model
from dilaserve.models.llada2 import LLaDA2Config
from dilaserve.models.moe import Router, select_experts
from dilaserve.protocol import SequenceSpec, StepBatch, StepItem, StepKind
from dilaserve.request import Request

from conftest import HANG_GUARD_S

BLOCK = 8


@pytest.fixture(scope="module")
def path(tmp_path_factory):
    """Random weights, the mask's row scaled down so that it is never the top-1 (as in a
    trained model; the published rule's mask picks: test_llada2_decoding.py)."""
    path = llada2_checkpoint(tmp_path_factory.mktemp("llada2"))
    return quiet_mask(path, LLM(path).special.mask)


def engine(path, kv_cache="block") -> Engine:
    return Engine.from_checkpoint(path, EngineConfig(kv_cache, block_len=BLOCK))


def state_dict(path) -> dict[str, torch.Tensor]:
    out = {}
    for shard in sorted(path.glob("*.safetensors")):
        out.update(load_file(shard))
    return out


def reference_route(h, w, p, raw):
    """The published router for one token: (experts, weights)."""
    scores = torch.sigmoid(h @ w[p + "gate.weight"].T)
    biased = scores + w[p + "gate.expert_bias"]
    groups = biased.view(raw["n_group"], -1)
    best = groups.sort(descending=True).values[:, :2].sum(-1).argsort(descending=True)
    kept = set(best[: raw["topk_group"]].tolist())
    size = raw["num_experts"] // raw["n_group"]
    allowed = [e for e in range(raw["num_experts"]) if e // size in kept]
    chosen = sorted(allowed, key=lambda e: -biased[e].item())[: raw["num_experts_per_tok"]]
    weights = scores[chosen] / scores[chosen].sum() * raw["routed_scaling_factor"]
    return chosen, weights


def reference_logits(path, ids: torch.Tensor, block_len: int) -> torch.Tensor:
    """LLaDA2's published forward, restated from its equations, under the block-causal mask."""
    raw, w = json.loads((path / "config.json").read_text()), state_dict(path)
    heads, kv, hd = raw["num_attention_heads"], raw["num_key_value_heads"], raw["head_dim"]
    rot, eps, n = int(hd * raw["partial_rotary_factor"]), raw["rms_norm_eps"], len(ids)
    inv = 1.0 / raw["rope_theta"] ** (torch.arange(0, rot, 2).float() / rot)
    freqs = torch.arange(n).float()[:, None] * inv
    cos, sin = torch.cat((freqs, freqs), -1).cos(), torch.cat((freqs, freqs), -1).sin()
    blocks = torch.arange(n) // block_len
    allowed = blocks[None, :] <= blocks[:, None]

    def rms(x, weight):
        return weight * (x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + eps))

    def rope(t):
        r, rest = t[..., :rot], t[..., rot:]
        half = rot // 2
        return torch.cat((r * cos + torch.cat((-r[..., half:], r[..., :half]), -1) * sin, rest), -1)

    def mlp(x, p):
        gate, up = x @ w[p + "gate_proj.weight"].T, x @ w[p + "up_proj.weight"].T
        return (F.silu(gate) * up) @ w[p + "down_proj.weight"].T

    x = w["model.word_embeddings.weight"][ids]
    for i in range(raw["num_hidden_layers"]):
        p = f"model.layers.{i}."
        h = rms(x, w[p + "input_layernorm.weight"])
        qkv = (h @ w[p + "attention.query_key_value.weight"].T).view(n, heads + 2 * kv, hd)
        q, k, v = (t.transpose(0, 1) for t in qkv.split([heads, kv, kv], dim=1))
        q = rope(rms(q, w[p + "attention.query_layernorm.weight"]))
        k = rope(rms(k, w[p + "attention.key_layernorm.weight"]))
        k, v = k.repeat_interleave(heads // kv, 0), v.repeat_interleave(heads // kv, 0)
        scores = (q @ k.transpose(1, 2) / hd**0.5).masked_fill(~allowed, float("-inf"))
        att = torch.softmax(scores, -1) @ v
        x = x + att.transpose(0, 1).reshape(n, -1) @ w[p + "attention.dense.weight"].T
        h = rms(x, w[p + "post_attention_layernorm.weight"])
        if i < raw["first_k_dense_replace"]:
            x = x + mlp(h, p + "mlp.")
            continue
        out = mlp(h, p + "mlp.shared_experts.")
        for t in range(n):
            chosen, weights = reference_route(h[t], w, p + "mlp.", raw)
            for e, g in zip(chosen, weights):
                out[t] = out[t] + g * mlp(h[t], f"{p}mlp.experts.{e}.")
        x = x + out
    return rms(x, w["model.norm.weight"]) @ w["lm_head.weight"].T


def test_the_checkpoint_has_the_published_names_and_shapes(path):
    weights = state_dict(path)
    raw = json.loads((path / "config.json").read_text())
    d, hd = raw["hidden_size"], raw["head_dim"]
    qkv = (raw["num_attention_heads"] + 2 * raw["num_key_value_heads"]) * hd
    assert weights["model.layers.0.attention.query_key_value.weight"].shape == (qkv, d)
    assert weights["model.layers.0.attention.query_layernorm.weight"].shape == (hd,)
    assert weights["model.layers.0.mlp.gate_proj.weight"].shape == (raw["intermediate_size"], d)
    assert weights["model.layers.1.mlp.gate.weight"].shape == (raw["num_experts"], d)
    assert weights["model.layers.1.mlp.gate.expert_bias"].shape == (raw["num_experts"],)
    assert weights["model.layers.1.mlp.experts.7.down_proj.weight"].shape == (d, 16)
    assert weights["model.layers.1.mlp.shared_experts.up_proj.weight"].shape == (16, d)
    assert "model.layers.0.mlp.gate.weight" not in weights  # the first layer is dense
    assert set(raw) == LLADA2_KEYS


def test_the_forward_pass_is_the_published_computation(path):
    model = load_model(path)
    ids = torch.tensor(prompt_ids(19))
    out = model(ids[None], torch.arange(19)[None], torch.ones(1, 19, dtype=torch.bool), block_len=8)
    got = model.logits(out.hidden)[0]
    assert torch.allclose(got, reference_logits(path, ids, 8), atol=1e-4)


def tiny_router(**kw) -> LLaDA2Config:
    shape = dict(hidden_size=8, num_hidden_layers=1, num_attention_heads=1, intermediate_size=4)
    shape.update(vocab_size=8, moe_intermediate_size=2, num_experts=8, num_experts_per_tok=2)
    return LLaDA2Config(**shape, n_group=4, topk_group=2, routed_scaling_factor=2.5, **kw)


def test_routing_takes_the_top_k_inside_the_best_groups():
    biased = torch.tensor([[0.9, 0.0, 0.6, 0.5, 0.7, 0.05, 0.1, 0.1]])
    # group sums of the two best: 0.9, 1.1, 0.75, 0.2 -> groups 1 and 0 stay; expert 4 (0.7)
    # beats expert 2 (0.6) but its group is out
    assert sorted(select_experts(biased, tiny_router()).tolist()[0]) == [0, 2]
    assert sorted(biased.topk(2).indices.tolist()[0]) == [0, 4]  # a plain top-k differs


def test_the_expert_bias_changes_the_choice_but_not_the_weights():
    gate = Router(tiny_router())
    gate.weight.data = torch.eye(8)
    scores = torch.tensor([0.9, 0.3, 0.6, 0.4, 0.3, 0.3, 0.1, 0.4])
    x = torch.logit(scores)[None]  # router logits = x, so sigmoid scores = `scores`
    chosen, weights = gate(x)
    assert sorted(chosen.tolist()[0]) == [0, 2]
    gate.expert_bias.fill_(0.3)  # the same bias everywhere: nothing changes
    assert torch.equal(gate(x)[0], chosen) and torch.allclose(gate(x)[1], weights)
    gate.expert_bias.zero_()
    gate.expert_bias[7] = 0.9  # now group 3 wins (0.1 + 1.3) and expert 7 is chosen
    biased_choice, biased_weights = gate(x)
    assert sorted(biased_choice.tolist()[0]) == [0, 7]
    picked = scores[biased_choice[0]]
    assert torch.allclose(biased_weights[0], picked / picked.sum() * 2.5)  # unbiased scores


def test_attention_is_causal_across_blocks_and_bidirectional_inside(path):
    model = load_model(path)
    ids = torch.tensor([prompt_ids(24)])
    later = ids.clone()
    later[0, 20] = ids[0, 3]  # a token of block 2 (positions 16..23)
    inside = ids.clone()
    inside[0, 12] = ids[0, 3]  # a token of block 1

    def hidden(t):
        return model(t, torch.arange(24)[None], torch.ones(1, 24, dtype=torch.bool), block_len=8)

    base, after, within = hidden(ids).hidden[0], hidden(later).hidden[0], hidden(inside).hidden[0]
    assert torch.allclose(base[:16], after[:16], atol=1e-6)  # earlier blocks do not see it
    assert not torch.allclose(base[16:20], after[16:20], atol=1e-3)  # its own block does
    assert not torch.allclose(base[8:12], within[8:12], atol=1e-3)  # earlier in its block too


def make(eng, rid, prompt_len, threshold, gen_len=2 * BLOCK):
    prompt = prompt_ids(prompt_len, offset=prompt_len)
    return Request(rid, prompt, gen_len, BLOCK, eng.special.mask, threshold)


def test_blocks_are_aligned_to_absolute_positions_and_steps_have_exact_kinds(path):
    eng = engine(path)
    spec = SequenceSpec(prompt_ids(13), [eng.special.mask] * 2 * BLOCK)
    seen = []
    item = StepItem("r", 1.0, StepKind.PREFILL, spec)
    while True:
        out = eng.execute(StepBatch((item,)))
        result = out.results[0]
        seen.append((result.kind.value, out.num_tokens, result.block_index))
        if result.is_finished:
            break
        item = StepItem("r", 1.0, StepKind.BLOCK)
    # 13 prompt tokens: absolute block [8, 16) holds the prompt's tail and 3 output positions
    assert seen[:5] == [("prefill", 16, 0), ("block", 8, 0), ("block", 8, 0), ("commit", 16, 1)] + [
        ("block", 8, 1)
    ]
    assert [k for k, _, b in seen if b == 2][0] == "commit"
    assert len(seen) == 2 * BLOCK and max(b for _, _, b in seen) == 2


def test_the_cached_steps_equal_the_no_cache_forward(path):
    cached, full = engine(path, "block"), engine(path, "none")
    shapes = {"a": (13, 0.5), "b": (4, 0.8)}
    with_cache = drive(cached.execute, [make(cached, r, *s) for r, s in shapes.items()], "block")
    without = drive(full.execute, [make(full, r, *s) for r, s in shapes.items()], "none")
    for rid in shapes:
        assert [s[1:3] for s in with_cache[rid]] == [s[1:3] for s in without[rid]]
        for a, b in zip(with_cache[rid], without[rid]):
            assert torch.allclose(torch.from_numpy(a[3]), torch.from_numpy(b[3]), atol=1e-5)
    kinds = {s[0] for s in with_cache["a"]}
    assert kinds == {"prefill", "block", "commit"} and {s[0] for s in without["a"]} == {"full"}


def test_a_batch_mixing_thresholds_and_step_kinds_is_invariant_to_its_batch_mates(path):
    eng = engine(path)
    shapes = {"a": (13, 0.3), "b": (5, 0.97), "c": (20, 0.6)}
    together = drive(
        eng.execute, [make(eng, r, *s) for r, s in shapes.items()], "block", {"b": 2, "c": 4}
    )
    alone = {}
    for rid, shape in shapes.items():
        alone.update(drive(eng.execute, [make(eng, rid, *shape)], "block"))
    assert same_logs(together, alone)


@pytest.mark.slow
def test_tensor_parallel_two_ranks_commit_the_same_tokens_as_one(path):
    config = EngineConfig("dual", block_len=BLOCK)
    eng = Engine.from_checkpoint(path, config)
    one = drive(eng.execute, [make(eng, "a", 13, 0.5), make(eng, "b", 6, 0.9)], "block")
    execute, stop = tensor_parallel_execute(path, config)
    try:
        two = drive(execute, [make(eng, "a", 13, 0.5), make(eng, "b", 6, 0.9)], "block")
    finally:
        stop()
    assert same_logs(one, two, atol=1e-4)


def test_each_rank_holds_its_own_experts(path):
    from dilaserve.models.layers import TPGroup

    raw = json.loads((path / "config.json").read_text())
    held = []
    for rank in range(2):
        model = load_model(path, tp=TPGroup(2, rank))  # its group is never used: no forward
        held.append(list(model.model.layers[1].mlp.experts.held))
    assert held == [[0, 1, 2, 3], [4, 5, 6, 7]] and raw["num_experts"] == 8


def test_the_offline_path_generates(path, capsys):
    llm = LLM(path, EngineConfig("dual", block_len=BLOCK))
    out = llm.generate(["w1 w2 w3", "w4 + 5 ="], SamplingParams(0.9, 2 * BLOCK))
    assert all(o.num_steps >= 2 for o in out)
    assert set().union(*(o.steps_by_kind for o in out)) == {"prefill", "block", "commit"}
    assert main(["generate", str(path), "--prompt", "w1 w2", "--max-tokens", "32"]) == 0
    assert "### w1 w2" in capsys.readouterr().out


@pytest.fixture(scope="module")
def served(path, tmp_path_factory):
    """The user's path: calibrate (through the cluster's workers), then the cluster config
    `run-trace`/`serve` build from the calibration, two instances."""
    from dilaserve.cli_serving import run_trace_config

    folder = tmp_path_factory.mktemp("calibration")
    argv = ["calibrate", str(path), "--requests", "1,2", "--repeats", "1", "--num-prompts", "6"]
    assert main([*argv, "--max-tokens", "32", "--calibration", str(folder)]) == 0
    settings = {"calibration": str(folder), "instances": 2, "max_tokens": 32}
    return folder, run_trace_config(model=str(path), **settings)[0]


PROMPTS = ["w3 w5 w7", "w11 w2", "w1 + w4 ="]


def test_calibration_profiles_the_exact_caches_step_kinds(served):
    profile = json.loads((served[0] / "profile.json").read_text())
    assert {e["kind"] for e in profile["entries"]} == {"prefill", "block", "commit"}


@pytest.mark.slow  # in part by the OpenAI API test below, through the same cluster config
def test_the_cluster_answers_as_the_offline_engine_with_the_exact_caches_steps(path, served):
    with Cluster(served[1]) as cluster:
        assert cluster.scheduler.config.kv_cache.value == "block"
        handles = [cluster.submit(p, threshold=0.9) for p in PROMPTS]
        answers = [h.result(HANG_GUARD_S).text for h in handles]
    offline = LLM(path).generate(PROMPTS, SamplingParams(0.9, 32))
    assert answers == [c.text for c in offline]
    kinds = set().union(*(h.request.steps_by_kind for h in handles))
    assert {StepKind.PREFILL, StepKind.BLOCK} <= kinds
    assert all(h.request.block_offset == h.request.prompt_len % 32 for h in handles)


def test_the_openai_api_answers_through_it_and_steps_reach_the_schedule(path, served):
    """Completions and chat answer as the offline engine does; `steps` in the request body sets
    the request's schedule (threshold 1: a step commits exactly the schedule's count), and a bad
    value is a 400 naming it. One server for both (a cluster's start is most of the time)."""
    from fastapi.testclient import TestClient

    from dilaserve.server.main import build_app

    app, _ = build_app(served[1])
    common = {"model": path.name, "max_tokens": 32, "threshold": 0.9}
    chat = {**common, "messages": [{"role": "user", "content": PROMPTS[0]}]}
    body = {**common, "threshold": 1.0, "prompt": PROMPTS[1]}
    with TestClient(app) as client:
        raw = client.post("/v1/completions", json={**common, "prompt": PROMPTS[1]})
        templated = client.post("/v1/chat/completions", json=chat)
        replies = {s: client.post("/v1/completions", json={**body, "steps": s}) for s in (2, 4)}
        bad = [client.post("/v1/completions", json={**body, "steps": v}) for v in (0, 1.5, "2")]
    assert raw.status_code == templated.status_code == 200, (raw.text, templated.text)
    llm, params = LLM(path), SamplingParams(0.9, 32)
    assert (
        raw.json()["choices"][0]["text"] == llm.generate([PROMPTS[1]], params, chat=False)[0].text
    )
    answer = templated.json()["choices"][0]["message"]["content"]
    assert answer == llm.generate([PROMPTS[0]], params)[0].text
    for steps, reply in replies.items():
        assert reply.status_code == 200, reply.text
        (offline,) = llm.generate([PROMPTS[1]], SamplingParams(1.0, 32, steps), chat=False)
        assert reply.json()["choices"][0]["text"] == offline.text
        assert reply.json()["dilaserve"]["steps"] == offline.num_steps
    assert replies[2].json()["dilaserve"]["steps"] < replies[4].json()["dilaserve"]["steps"]
    assert [r.status_code for r in bad] == [400] * 3
    assert all(r.json()["error"]["param"] == "steps" for r in bad)


def test_bfloat16_generates_close_to_float32(path):
    ids = torch.tensor([prompt_ids(19)])
    args = (ids, torch.arange(19)[None], torch.ones(1, 19, dtype=torch.bool))
    full, half = load_model(path), load_model(path, "bfloat16")
    want = full.logits(full(*args, block_len=BLOCK).hidden)
    got = half.logits(half(*args, block_len=BLOCK).hidden).float()
    assert (want.argmax(-1) == got.argmax(-1)).float().mean() >= 0.8
    llm = LLM(path, EngineConfig("dual", block_len=BLOCK, dtype="bfloat16"))
    assert llm.generate(["w1 w2"], SamplingParams(0.9, BLOCK))[0].num_steps >= 1


def test_a_request_counts_the_blocks_the_engine_decodes(path):
    llm = LLM(path, EngineConfig("dual", block_len=BLOCK, early_finish=False))
    request = llm.make_requests(["w1 w2 w3"], SamplingParams(0.9, 2 * BLOCK), chat=False)[0]
    assert request.block_offset == request.prompt_len % BLOCK == 3
    assert request.num_blocks == 3  # 5 + 8 + 3 output positions
    blocks = []
    llm.run([request], 1, lambda r, result: blocks.append(result.block_index))
    assert sorted(set(blocks)) == [0, 1, 2] and request.current_block == request.num_blocks
    with pytest.raises(ValueError, match="block_offset"):
        Request("x", (1, 2), BLOCK, BLOCK, 0, 0.9, block_offset=BLOCK)
