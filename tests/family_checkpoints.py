"""Tiny random checkpoints of the Dream and LLaDA2 families, written at test time.

Each has the published checkpoint's config keys (Dream-v0-7B's 27, LLaDA2.0-mini's 48; values
shrunk) and parameter names, a word-level tokenizer with the family's special tokens, and a
chat template of the family's shape. Nothing is downloaded.
"""

from __future__ import annotations

import json
from pathlib import Path

import torch
from tokenizers import Tokenizer, models, pre_tokenizers

from dilaserve.models.checkpoint import save_checkpoint
from dilaserve.models.registry import config_from_dict

from conftest import HANG_GUARD_S

WORDS = [f"w{i}" for i in range(40)] + [str(d) for d in range(10)] + ["+", "=", "?"]
QWEN_TEMPLATE = (
    "{% for message in messages %}<|im_start|>{{ message['role'] }}\n"
    "{{ message['content'] }}<|im_end|>\n{% endfor %}"
    "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
)
LING_TEMPLATE = (
    "{% for message in messages %}<role>{{ message['role'] | upper }}</role>"
    "{{ message['content'] }}<|role_end|>{% endfor %}"
    "{% if add_generation_prompt %}<role>ASSISTANT</role>{% endif %}"
)
# The keys of the published config.json files, as listed in ../shared/reference/models.md (its
# LLaDA2.0-mini list says 48 and names 47).
DREAM_KEYS = frozenset(
    "architectures attention_dropout auto_map bos_token_id eos_token_id hidden_act hidden_size "
    "initializer_range intermediate_size mask_token_id max_position_embeddings max_window_layers "
    "model_type num_attention_heads num_hidden_layers num_key_value_heads pad_token_id "
    "rms_norm_eps rope_scaling rope_theta sliding_window tie_word_embeddings torch_dtype "
    "transformers_version use_cache use_sliding_window vocab_size".split()
)
LLADA2_KEYS = frozenset(
    "architectures attention_dropout auto_map num_hidden_layers hidden_size intermediate_size "
    "first_k_dense_replace hidden_act max_position_embeddings model_type moe_intermediate_size "
    "norm_topk_prob num_experts_per_tok norm_head num_attention_heads num_experts "
    "num_key_value_heads rope_theta rope_scaling tie_word_embeddings torch_dtype "
    "transformers_version use_bias use_rmsnorm rms_norm_eps head_dim num_shared_experts use_cache "
    "use_qkv_bias embedding_dropout norm_softmax output_dropout vocab_size rotary_dim "
    "using_split_qkv_in_self_attention router_dtype moe_router_enable_expert_bias "
    "routed_scaling_factor n_group topk_group score_function initializer_range max_window_layers "
    "output_router_logits pad_token_id partial_rotary_factor use_sliding_window".split()
)
DREAM_SPECIALS = ["<|endoftext|>", "<|im_start|>", "<|im_end|>", "<|mask|>"]
LLADA2_SPECIALS = ["<|endoftext|>", "<role>", "</role>", "<|role_end|>", "<|mask|>"]


def write_tokenizer(folder: Path, specials: list[str], template: str) -> dict[str, int]:
    """A word-level tokenizer (specials first); returns the vocabulary."""
    vocab = {t: i for i, t in enumerate(specials + ["<unk>"] + WORDS)}
    tok = Tokenizer(models.WordLevel(vocab, unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    tok.add_special_tokens(specials)
    folder.mkdir(parents=True, exist_ok=True)
    tok.save(str(folder / "tokenizer.json"))
    config = {"eos_token": "<|endoftext|>", "pad_token": "<|endoftext|>", "chat_template": template}
    (folder / "tokenizer_config.json").write_text(json.dumps(config))
    return vocab


def dream_config(vocab: dict[str, int], **overrides) -> dict:
    """Dream-v0-Instruct-7B's config.json keys, dims shrunk (3584/28/28/4/18944 -> 32/2/4/2/64)."""
    raw = {
        "architectures": ["DreamModel"],
        "attention_dropout": 0.0,
        "auto_map": {
            "AutoConfig": "configuration_dream.DreamConfig",
            "AutoModel": "modeling_dream.DreamModel",
        },
        "bos_token_id": vocab["<|endoftext|>"],
        "eos_token_id": vocab["<|endoftext|>"],
        "hidden_act": "silu",
        "hidden_size": 32,
        "initializer_range": 0.02,
        "intermediate_size": 64,
        "mask_token_id": vocab["<|mask|>"],
        "max_position_embeddings": 512,
        "max_window_layers": 2,
        "model_type": "Dream",
        "num_attention_heads": 4,
        "num_hidden_layers": 2,
        "num_key_value_heads": 2,
        "pad_token_id": vocab["<|endoftext|>"],
        "rms_norm_eps": 1e-06,
        "rope_scaling": None,
        "rope_theta": 1000000.0,
        "sliding_window": None,
        "tie_word_embeddings": False,
        "torch_dtype": "bfloat16",
        "transformers_version": "4.46.2",
        "use_cache": False,
        "use_sliding_window": False,
        "vocab_size": len(vocab) + 7,  # padded past the tokenizer, as 152064 is
    }
    return {**raw, **overrides}


def llada2_config(vocab: dict[str, int], **overrides) -> dict:
    """LLaDA2.0-mini's config.json keys, dims shrunk (20 layers -> 2, 256 experts -> 8, ...)."""
    raw = {
        "architectures": ["LLaDA2MoeModelLM"],
        "attention_dropout": 0.0,
        "auto_map": {"AutoModelForCausalLM": "modeling_llada2_moe.LLaDA2MoeModelLM"},
        "num_hidden_layers": 2,
        "hidden_size": 32,
        "intermediate_size": 64,
        "first_k_dense_replace": 1,
        "hidden_act": "silu",
        "max_position_embeddings": 512,
        "model_type": "llada2_moe",
        "moe_intermediate_size": 16,
        "norm_topk_prob": True,
        "num_experts_per_tok": 2,
        "norm_head": False,
        "num_attention_heads": 4,
        "num_experts": 8,
        "num_key_value_heads": 2,
        "rope_theta": 600000,
        "rope_scaling": None,
        "tie_word_embeddings": False,
        "torch_dtype": "bfloat16",
        "transformers_version": "4.52.3",
        "use_bias": False,
        "use_rmsnorm": True,
        "rms_norm_eps": 1e-06,
        "head_dim": 8,
        "num_shared_experts": 1,
        "use_cache": True,
        "use_qkv_bias": False,
        "embedding_dropout": 0.0,
        "norm_softmax": False,
        "output_dropout": 0.0,
        "vocab_size": len(vocab) + 5,
        "rotary_dim": 4,
        "using_split_qkv_in_self_attention": False,
        "router_dtype": "fp32",
        "moe_router_enable_expert_bias": True,
        "routed_scaling_factor": 2.5,
        "n_group": 4,
        "topk_group": 2,
        "score_function": "sigmoid",
        "initializer_range": 0.02,
        "max_window_layers": 2,
        "output_router_logits": False,
        "pad_token_id": vocab["<|endoftext|>"],
        "partial_rotary_factor": 0.5,
        "use_sliding_window": False,
    }
    return {**raw, **overrides}


def write_checkpoint(folder: Path, raw: dict, seed: int = 0, std: float = 0.5) -> Path:
    """Random weights for config `raw` (through the registry), saved with `raw` as config.json."""
    cfg = config_from_dict(raw)
    from dilaserve.models.registry import family_of

    model = family_of(cfg).model_class(cfg)
    model.init_weights(seed, std)
    gen = torch.Generator().manual_seed(seed + 1)
    for name, buf in model.named_buffers():
        if name.endswith("expert_bias"):
            buf.copy_(torch.rand(buf.shape, generator=gen) * 0.2)
    save_checkpoint(model, folder, num_shards=2)
    (folder / "config.json").write_text(json.dumps(raw, indent=2))
    return folder


def dream_checkpoint(folder: Path, **overrides) -> Path:
    vocab = write_tokenizer(folder, DREAM_SPECIALS, QWEN_TEMPLATE)
    return write_checkpoint(folder, dream_config(vocab, **overrides))


def llada2_checkpoint(folder: Path, **overrides) -> Path:
    vocab = write_tokenizer(folder, LLADA2_SPECIALS, LING_TEMPLATE)
    return write_checkpoint(folder, llada2_config(vocab, **overrides))


def prompt_ids(n: int, offset: int = 0) -> tuple[int, ...]:
    """n ordinary word ids (no special token)."""
    first = len(LLADA2_SPECIALS) + 1
    return tuple(first + (offset + 3 * i) % len(WORDS) for i in range(n))


def drive(execute, requests, mode: str, delays: dict[str, int] | None = None) -> dict:
    """Step `requests` to completion through `execute(StepBatch) -> StepOutput`, request r
    joining at step `delays[r]` (default 0). Each request's log of (kind, positions, tokens,
    confidences) per step."""
    from dilaserve.protocol import StepBatch

    delays = delays or {}
    log = {r.request_id: [] for r in requests}
    on_instance: set[str] = set()
    step = 0
    while any(not r.is_finished for r in requests):
        batch = [r for r in requests if not r.is_finished and delays.get(r.request_id, 0) <= step]
        if batch:
            items = tuple(r.step_item(mode, r.request_id in on_instance) for r in batch)
            on_instance.update(r.request_id for r in batch)
            for r, res in zip(batch, execute(StepBatch(items)).results):
                r.apply(res)
                entry = (res.kind.value, res.positions.tolist(), res.tokens.tolist())
                log[r.request_id].append((*entry, res.confidences.copy()))
        step += 1
    return log


def same_logs(a: dict, b: dict, atol: float = 1e-5) -> bool:
    """Equal kinds, positions and tokens at every step; confidences equal to `atol`."""
    import numpy as np

    if a.keys() != b.keys():
        return False
    for rid in a:
        if [s[:3] for s in a[rid]] != [s[:3] for s in b[rid]]:
            return False
        if not all(np.allclose(x[3], y[3], atol=atol) for x, y in zip(a[rid], b[rid])):
            return False
    return True


def tensor_parallel_execute(path: Path, engine, tp: int = 2):
    """An `execute` running on a `tp`-rank instance of the cluster's local backend (gloo), and
    a function that stops it."""
    import time

    from dilaserve.cluster.backends import LocalBackend
    from dilaserve.cluster.worker import WorkerConfig
    from dilaserve.control.decisions import InstanceSpec

    backend = LocalBackend(WorkerConfig(model=str(path), engine=engine, threads=1))
    backend.start(InstanceSpec("tp", 0, tp, tuple(range(tp))))

    def wait(kind: str):
        deadline = time.monotonic() + HANG_GUARD_S
        while time.monotonic() < deadline:
            for event in backend.poll(0.5):
                assert event.kind == kind, event
                return event
        raise TimeoutError(kind)

    wait("up")

    def execute(batch):
        backend.step("tp", batch)
        return wait("done").output

    return execute, backend.shutdown
