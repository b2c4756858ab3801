"""Random-weight checkpoints in a published model's exact file layout, dimensions shrunk.

For tests and benchmarks of the path a user's own checkpoint takes (calibrate, serve), with no
download: `write_random_llada(folder)` writes LLaDA-8B-Instruct's layout (config.json with the
published keys, sharded safetensors with an index, generation_config.json) with the bundled
model's tokenizer files.
"""

from __future__ import annotations

import json
import shutil
from pathlib import Path

from dilaserve.config import BUNDLED_MODEL
from dilaserve.models.checkpoint import save_checkpoint
from dilaserve.models.config import LLaDAConfig
from dilaserve.models.llada import LLaDAModelLM

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
