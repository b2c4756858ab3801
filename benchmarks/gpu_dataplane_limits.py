"""The limits `gpu_dataplane.py` sets each step against, and issue 42's targets.

- weight-read limit: the weight bytes a step reads (all but the input embedding; of a MoE's
  routed experts only the distinct ones its tokens chose, counted by hooks on the routers) over
  the copy bandwidth measured on the device (read + write bytes of a large copy);
- matrix-rate limit: the step's FLOPs (2 x the parameters a token multiplies, a MoE's top-k
  experts only, x tokens; plus 4 x layers x attention width x tokens x keys attended) over the
  data sheet's dense bf16 peak (`sim/hardware.py`), or the measured matmul rate on a GPU it
  does not know.
"""

from __future__ import annotations

import gpu_profile as gp
import torch

from dilaserve.models.layers import Embedding
from dilaserve.models.moe import ExpertBank, Router
from dilaserve.sim.hardware import GH200, H100_SXM, H200_SXM


def accounting(model) -> dict:
    """Bytes a step reads besides the routed experts, bytes of one expert, parameters a token
    multiplies (routed experts: top-k of them; the output head among them), the attention
    width and the output head's parameters (which multiply only the tokens given logits)."""
    cfg = model.config
    params = list(model.parameters())
    total = sum(p.numel() for p in params)
    embed = sum(m.weight.numel() for m in model.modules() if isinstance(m, Embedding))
    banks = [m for m in model.modules() if isinstance(m, ExpertBank)]
    routed = sum(p.numel() for b in banks for p in b.parameters())
    expert = (banks[0].gate_up[0].numel() + banks[0].down[0].numel()) if banks else 0
    top_k = getattr(cfg, "num_experts_per_tok", 0)
    size = params[0].element_size()
    heads = getattr(cfg, "n_heads", None) or cfg.num_attention_heads
    hidden = getattr(cfg, "d_model", None) or cfg.hidden_size
    return {
        "params": total,
        "dense_bytes": (total - embed - routed) * size,
        "expert_bytes": expert * size,
        "moe_layers": len(banks),
        "matmul_params": total - embed - routed + len(banks) * top_k * expert,
        "attention_width": cfg.num_layers * heads * cfg.head_dim,
        "head_params": getattr(cfg, "padded_vocab_size", cfg.vocab_size) * hidden,
    }


def touched_experts(model, step) -> int:
    """Distinct routed experts one run of `step` reads, summed over layers (0: dense)."""
    routers = [m for m in model.modules() if isinstance(m, Router)]
    if not routers:
        return 0
    seen: list[int] = []
    hooks = [
        r.register_forward_hook(lambda _m, _i, out: seen.append(out[0].unique().numel()))
        for r in routers
    ]
    try:
        step()
    finally:
        for h in hooks:
            h.remove()
    return sum(seen)


def probe_rates(device: torch.device, dtype: torch.dtype, smoke: bool) -> dict:
    """Copy bandwidth (read + write bytes) and a square matmul's FLOP/s, measured here; the
    data sheet's peak where the GPU is one `sim/hardware.py` knows."""
    n = (16 if smoke else 2048) << 20
    src = torch.empty(n, dtype=torch.uint8, device=device)
    dst = torch.empty_like(src)
    copy_ms = gp.timed(lambda: dst.copy_(src), device, 10)
    side = 256 if smoke else 8192
    a = torch.randn(side, side, dtype=dtype, device=device)
    b = torch.randn(side, side, dtype=dtype, device=device)
    mm_ms = gp.timed(lambda: a @ b, device, 10)
    name = torch.cuda.get_device_name() if device.type == "cuda" else "cpu"
    sheet = next((g for g in (GH200, H200_SXM, H100_SXM) if g.name.split()[0] in name), None)
    measured_flops = 2 * side**3 / (mm_ms / 1e3)
    return {
        "device": name,
        "hbm_bytes_per_s": 2 * n / (copy_ms / 1e3),
        "matmul_flops_per_s": measured_flops,
        "datasheet": None if sheet is None else sheet.name,
        "peak_flops_per_s": sheet.peak_flops if sheet else measured_flops,
        "datasheet_hbm_bytes_per_s": sheet.hbm_bytes_per_s if sheet else None,
    }


def limits(row: dict, info: dict, rates: dict, tokens: int, keys: int, logits: int) -> dict:
    """The step's weight bytes, FLOPs (`tokens` through the layers, each attending to `keys`,
    `logits` of them through the output head), both limits in ms and how near `row["ms"]`
    came."""
    ms = row["ms"]
    weight_bytes = info["dense_bytes"] + row["experts_touched"] * info["expert_bytes"]
    layers = info["matmul_params"] - info["head_params"]
    flops = 2 * layers * tokens + 2 * info["head_params"] * logits
    flops += 4 * info["attention_width"] * tokens * keys
    weight_ms = round(1e3 * weight_bytes / rates["hbm_bytes_per_s"], 6)
    matrix_ms = round(1e3 * flops / rates["peak_flops_per_s"], 6)
    return {
        "weight_bytes": weight_bytes,
        "flops": flops,
        "weight_limit_ms": weight_ms,
        "over_weight_limit": round(ms / weight_ms, 3),
        "matrix_limit_ms": matrix_ms,
        "pct_matrix_rate": round(100 * matrix_ms / ms, 1),
        "pct_measured_matmul": round(100 * flops / (ms / 1e3) / rates["matmul_flops_per_s"], 1),
    }


def targets(steps: list[dict], engine: list[dict], refs: dict) -> dict:
    """Issue 42's done-when figures, where this run measured them (None where not); the
    matrix rate at the most requests each kind ran (128 unless time ran out)."""

    def one(model: str, kind: str, rows: int, key: str):
        found = [
            r for r in steps if (r["model"], r["kind"], r["num_requests"]) == (model, kind, rows)
        ]
        return found[0][key] if found else None

    largest: dict[str, dict] = {}
    for r in steps:
        name = f"{r['model']} {r['kind']}"
        if r["num_requests"] >= largest.get(name, {}).get("num_requests", 0):
            largest[name] = {"num_requests": r["num_requests"], "pct": r["pct_matrix_rate"]}

    def over_published(model: str):
        """Our single request's tokens/s (CUDA graphs on where they ran) over the published
        decoder's."""
        ours = sorted(
            (e for e in engine if e["model"] == model and e["batch"] == 1),
            key=lambda e: -e["cuda_graphs"],
        )
        theirs = refs.get(model, {}).get("tokens_per_s")
        return round(ours[0]["tokens_per_s"] / theirs, 2) if ours and theirs else None

    return {
        "llada8b_cache_1_ms": one("llada-8b", "cache", 1, "ms"),
        "llada8b_cache_1_over_weight_limit": one("llada-8b", "cache", 1, "over_weight_limit"),
        "pct_matrix_rate_at_most_requests": largest,
        "llada2_block_1_over_touched_limit": one("llada2-mini", "block", 1, "over_weight_limit"),
        "llada8b_tokens_per_s_over_fastdllm": over_published("llada-8b"),
        "llada2_tokens_per_s_over_published": over_published("llada2-mini"),
        "wanted": {
            "llada8b_cache_1_over_weight_limit": "<= 1.5 (<= 5.6 ms on an H200)",
            "pct_matrix_rate_at_most_requests": ">= 70 at 128 requests",
            "llada2_block_1_over_touched_limit": "<= 2",
            "llada8b_tokens_per_s_over_fastdllm": ">= 2",
            "llada2_tokens_per_s_over_published": "(not a target: for the record)",
        },
    }
