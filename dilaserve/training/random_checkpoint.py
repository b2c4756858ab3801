"""Random-weight checkpoints in a published model's exact file layout, dimensions shrunk, one
writer per model family (`dilaserve random-checkpoint FAMILY DIR`).

For tests and benchmarks of the path a user's own checkpoint takes (calibrate, serve), with no
download. `write_random_llada` writes LLaDA-8B-Instruct's layout (config.json with the published
keys, sharded safetensors with an index, generation_config.json) with the bundled model's
tokenizer files; `write_random_dream` and `write_random_llada2` write Dream-v0-7B's and
LLaDA2.0-mini's config keys (27 and 48, values shrunk) and parameter names, a word-level
tokenizer with the family's special tokens, and a chat template of the family's shape;
`write_random_llada21` LLaDA2.1's (LLaDA2.0's layout, model type `llada21_moe`). The
weights mean nothing: what they test is the layout, the loader and the serving path.
"""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import torch
from tokenizers import Tokenizer, models, pre_tokenizers

from dilaserve.config import BUNDLED_MODEL
from dilaserve.models.checkpoint import save_checkpoint
from dilaserve.models.config import LLaDAConfig
from dilaserve.models.llada import LLaDAModelLM
from dilaserve.models.registry import config_from_dict, family_of

TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "special_tokens_map.json")
# LLaDA-8B-Instruct's config.json, its dimensions shrunk (d_model 4096 -> 64, 32 -> 2 layers,
# 32 -> 4 heads, MLP 12288 -> 128) and its vocabulary that of the bundled tokenizer.
LLADA_8B_CONFIG = {
    "activation_type": "silu",
    "alibi": False,
    "alibi_bias_max": 8.0,
    "architectures": ["LLaDAModelLM"],
    "attention_dropout": 0.0,
    "attention_layer_norm": False,
    "attention_layer_norm_with_affine": True,
    "bias_for_layer_norm": False,
    "block_group_size": 1,
    "block_type": "llama",
    "d_model": 64,
    "embedding_dropout": 0.0,
    "embedding_size": 272,
    "eos_token_id": 1,
    "flash_attention": False,
    "include_bias": False,
    "include_qkv_bias": False,
    "init_cutoff_factor": None,
    "init_device": "meta",
    "init_fn": "mitchell",
    "init_std": 0.02,
    "input_emb_norm": False,
    "layer_norm_type": "rms",
    "layer_norm_with_affine": True,
    "mask_token_id": 5,
    "max_sequence_length": 4096,
    "mlp_hidden_size": 128,
    "mlp_ratio": 4,
    "model_type": "llada",
    "multi_query_attention": None,
    "n_heads": 4,
    "n_kv_heads": 4,
    "n_layers": 2,
    "pad_token_id": 1,
    "precision": "amp_bf16",
    "residual_dropout": 0.0,
    "rms_norm_eps": 1e-05,
    "rope": True,
    "rope_full_precision": True,
    "rope_theta": 500000.0,
    "scale_logits": False,
    "transformers_version": "4.46.3",
    "use_cache": False,
    "vocab_size": 266,
    "weight_tying": False,
}


def write_random_llada(
    folder: str | Path, seed: int = 0, num_shards: int = 3, max_new_tokens: int = 32, **overrides
) -> Path:
    """A random-weight LLaDA-8B-Instruct-layout checkpoint; `overrides` change config keys
    (e.g. d_model=4096, n_layers=32, ... for the real shape)."""
    folder = Path(folder)
    config = {**LLADA_8B_CONFIG, **overrides}
    model = LLaDAModelLM(LLaDAConfig.from_dict(config))
    model.init_weights(seed, std=0.5)
    save_checkpoint(model, folder, num_shards=num_shards)
    (folder / "config.json").write_text(json.dumps(config, indent=2) + "\n")
    for name in TOKENIZER_FILES:
        shutil.copy(BUNDLED_MODEL / name, folder / name)
    generation = {"bos_token_id": 0, "eos_token_id": 1, "max_new_tokens": max_new_tokens}
    (folder / "generation_config.json").write_text(json.dumps(generation) + "\n")
    return folder


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
    model = family_of(cfg).model_class(cfg)
    model.init_weights(seed, std)
    gen = torch.Generator().manual_seed(seed + 1)
    for name, buf in model.named_buffers():
        if name.endswith("expert_bias"):
            buf.copy_(torch.rand(buf.shape, generator=gen) * 0.2)
    save_checkpoint(model, folder, num_shards=2)
    (folder / "config.json").write_text(json.dumps(raw, indent=2))
    return folder


def write_random_dream(folder: str | Path, seed: int = 0, **overrides) -> Path:
    """A random-weight Dream-v0-Instruct-7B-layout checkpoint; `overrides` change config keys."""
    folder = Path(folder)
    vocab = write_tokenizer(folder, DREAM_SPECIALS, QWEN_TEMPLATE)
    return write_checkpoint(folder, dream_config(vocab, **overrides), seed)


def write_random_llada2(folder: str | Path, seed: int = 0, **overrides) -> Path:
    """A random-weight LLaDA2.0-mini-layout checkpoint; `overrides` change config keys."""
    folder = Path(folder)
    vocab = write_tokenizer(folder, LLADA2_SPECIALS, LING_TEMPLATE)
    return write_checkpoint(folder, llada2_config(vocab, **overrides), seed)


def write_random_llada21(folder: str | Path, seed: int = 0, **overrides) -> Path:
    """A random-weight LLaDA2.1 checkpoint: LLaDA2.0-mini's layout (the same network), its
    config.json naming the `llada21_moe` model type of LLaDA2.1's remote code (as ZHZisZZ/dllm
    registers it), so that engines run LLaDA2.1's token-editing decoding by default."""
    auto_map = {"AutoModelForCausalLM": "modeling_llada21_moe.LLaDA2MoeModelLM"}
    return write_random_llada2(
        folder, seed, **{"model_type": "llada21_moe", "auto_map": auto_map, **overrides}
    )


WRITERS = {
    "llada": write_random_llada,
    "dream": write_random_dream,
    "llada2": write_random_llada2,
    "llada2.1": write_random_llada21,
}


def write_random_checkpoint(family: str, folder: str | Path, seed: int = 0) -> Path:
    """A random-weight checkpoint of `family` (a key of `WRITERS`) into `folder`, which must be
    new or empty."""
    if family not in WRITERS:
        raise ValueError(f"unknown model family {family!r}; choose one of {', '.join(WRITERS)}")
    folder = Path(folder)
    if folder.exists() and (not folder.is_dir() or any(folder.iterdir())):
        raise ValueError(f"{folder} exists and is not an empty folder")
    return WRITERS[family](folder, seed=seed)
