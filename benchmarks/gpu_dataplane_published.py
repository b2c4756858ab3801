"""The published decoders `gpu_dataplane.py` sets beside the engine: Fast-dLLM's LLaDA generator
(`generate_with_dual_cache`) and LLaDA2's published `generate` (its remote code's
`LLaDA2MoeModelLM.generate`), one request each, same shapes, threshold and lengths.

Neither is ever imported unless its folder is given (`--fastdllm-code`: Fast-dLLM's `llada`
folder, holding `generate.py` and `model/`; `--llada2-code`: a package folder with
`modeling_llada2_moe.py` and `configuration_llada2_moe.py`, e.g. ZHZisZZ/dllm's
`dllm/pipelines/llada2/models`). Each published model is built with the engine model's shapes,
its parameters drawn at random and then overwritten by the engine model's where the names and
shapes agree (`weights_copied` says how many), so both decode the same kind of random model:
with random weights no position reaches the threshold and both commit one token a forward
(`forwards` says so). No test imports this module's published code.
"""

from __future__ import annotations

import importlib
import sys
import time
from pathlib import Path

import torch

DROPPED_KEYS = ("auto_map", "architectures", "torch_dtype")  # not config-class arguments


def _import(folder: str, module: str, package: bool = False):
    """`module` from the folder `folder` (on sys.path first), or from the package `folder`
    (its parent on sys.path: the module imports its siblings relatively)."""
    path = Path(folder).resolve()
    root = str(path.parent if package else path)
    if root not in sys.path:
        sys.path.insert(0, root)
    return importlib.import_module(f"{path.name}.{module}" if package else module)


def _mirror(theirs: torch.nn.Module, ours: torch.nn.Module) -> str:
    """Random normal parameters, then ours copied in where name and shape agree: "copied/all"."""
    with torch.no_grad():
        for p in theirs.parameters():
            p.normal_(0.0, 0.02)
        mine = ours.state_dict()
        copied = 0
        for name, p in theirs.state_dict().items():
            if name in mine and mine[name].shape == p.shape:
                p.copy_(mine[name])
                copied += 1
    return f"{copied}/{len(theirs.state_dict())}"


def _timed(fn, device: torch.device):
    if device.type == "cuda":
        torch.cuda.synchronize()
    t0 = time.perf_counter()
    out = fn()
    if device.type == "cuda":
        torch.cuda.synchronize()
    return out, time.perf_counter() - t0


def fastdllm(code: str, ours, prompt: list[int], gen: int, block: int, threshold: float) -> dict:
    """Fast-dLLM's dual-cache LLaDA generator on one request; tokens/s over its wall time."""
    # the published config's keys (imported here: the module needs safetensors, which the GPU
    # machine's environment may lack)
    from dilaserve.training.random_checkpoint import LLADA_8B_CONFIG

    generate = _import(code, "generate")
    config_mod = _import(code, "model.configuration_llada")
    cfg = ours.config
    raw = {
        **LLADA_8B_CONFIG,
        "d_model": cfg.d_model,
        "n_heads": cfg.n_heads,
        "n_kv_heads": cfg.n_kv_heads,
        "n_layers": cfg.n_layers,
        "mlp_hidden_size": cfg.mlp_hidden_size,
        "vocab_size": cfg.vocab_size,
        "embedding_size": cfg.padded_vocab_size,
        "rope_theta": cfg.rope_theta,
        "mask_token_id": cfg.mask_token_id,
        "eos_token_id": cfg.eos_token_id,
    }
    param = next(ours.parameters())
    previous = torch.get_default_dtype()
    torch.set_default_dtype(param.dtype)  # it builds on the CPU: half the bytes
    try:
        theirs = generate.LLaDAModelLM(config_mod.LLaDAConfig(**raw), init_params=False)
    finally:
        torch.set_default_dtype(previous)
    theirs = theirs.to(param.device, param.dtype).eval()
    copied = _mirror(theirs, ours)
    ids = torch.tensor([prompt], device=param.device)

    def run(ids, length):
        return generate.generate_with_dual_cache(
            theirs, ids, steps=length, gen_length=length, block_length=block,
            temperature=0.0, remasking="low_confidence", mask_id=cfg.mask_token_id,
            threshold=threshold,
        )  # fmt: skip

    run(ids[:, :64], block)  # warm-up: one block
    (_, forwards), seconds = _timed(lambda: run(ids, gen), param.device)
    return _record("Fast-dLLM generate_with_dual_cache", gen, seconds, forwards, copied)


def llada2(code: str, ours, prompt: list[int], gen: int, block: int, threshold: float) -> dict:
    """LLaDA2's published `generate` on one request (its cache-free block decoding)."""
    modeling = _import(code, "modeling_llada2_moe", package=True)
    config_mod = _import(code, "configuration_llada2_moe", package=True)
    raw = {k: v for k, v in ours.config.to_dict().items() if k not in DROPPED_KEYS}
    config = config_mod.LLaDA2MoeConfig(**raw)
    config._attn_implementation = "sdpa"
    param = next(ours.parameters())
    previous = torch.get_default_dtype()
    torch.set_default_dtype(param.dtype)
    try:
        with torch.device(param.device):
            theirs = modeling.LLaDA2MoeModelLM(config).eval()
    finally:
        torch.set_default_dtype(previous)
    copied = _mirror(theirs, ours)
    forward, forwards = theirs.forward, 0

    def counted(ids, attention_mask=None, **kwargs):
        """Counts the forwards; the block mask in the model's dtype, which SDPA wants."""
        nonlocal forwards
        forwards += 1
        if attention_mask is not None and attention_mask.is_floating_point():
            attention_mask = attention_mask.to(param.dtype)
        return forward(ids, attention_mask=attention_mask, **kwargs)

    theirs.forward = counted
    cfg = ours.config
    ids = torch.tensor([prompt], device=param.device)

    def run(ids, length):
        with torch.no_grad():
            return theirs.generate(
                ids, temperature=0.0, block_length=block, steps=block, gen_length=length,
                eos_early_stop=False, threshold=threshold, eos_id=cfg.eos_token_id,
                mask_id=cfg.mask_token_id,
            )  # fmt: skip

    run(ids[:, :64], block)  # warm-up: one block
    forwards = 0
    _, seconds = _timed(lambda: run(ids, gen), param.device)
    return _record("LLaDA2 published generate", gen, seconds, forwards, copied)


def _record(name: str, gen: int, seconds: float, forwards, copied: str) -> dict:
    return {
        "decoder": name,
        "gen": gen,
        "seconds": round(seconds, 3),
        "tokens_per_s": round(gen / seconds, 1),
        "forwards": int(forwards),
        "weights_copied": copied,
    }
