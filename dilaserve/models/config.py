"""LLaDA's configuration, read from a checkpoint's `config.json` (LLaDA's published key names).

Only the keys the architecture needs are read; unknown keys are kept in `extra` so that a
checkpoint's file round-trips. Special token ids come from here or from the tokenizer, never
from literals in code. Every family's config offers the same properties to the rest of the
code (`max_sequence_length`, `vocab_size`, `num_layers`, `num_kv_heads`, `head_dim`, the special
ids, `check_tensor_parallel`); `models/registry.py` picks the class from config.json.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass, field

SUPPORTED_MODEL_TYPES = ("llada",)


@dataclass(frozen=True, slots=True)
class LLaDAConfig:
    d_model: int
    n_heads: int
    n_layers: int
    mlp_hidden_size: int
    vocab_size: int
    embedding_size: int | None = None
    n_kv_heads: int | None = None
    rope_theta: float = 10000.0
    rms_norm_eps: float = 1e-5
    max_sequence_length: int = 4096
    weight_tying: bool = False
    include_bias: bool = False
    mask_token_id: int | None = None
    eos_token_id: int | None = None
    pad_token_id: int | None = None
    model_type: str = "llada"
    extra: dict = field(default_factory=dict)

    def __post_init__(self):
        if self.model_type not in SUPPORTED_MODEL_TYPES:
            raise ValueError(
                f"config.json: {self.model_type=} is not one of {SUPPORTED_MODEL_TYPES}"
            )
        if self.d_model % self.n_heads:
            raise ValueError(f"config.json: {self.d_model=} must be divisible by {self.n_heads=}")
        if self.n_heads % self.num_kv_heads:
            raise ValueError(f"config.json: n_heads={self.n_heads} not divisible by n_kv_heads")
        if self.include_bias:
            raise ValueError(
                "config.json: include_bias=true is not supported (LLaDA has no biases)"
            )

    def check_tensor_parallel(self, size: int) -> None:
        """Raise ValueError if `size` ranks cannot split the model (heads and MLP width)."""
        for name, n in (
            ("n_heads", self.n_heads),
            ("n_kv_heads", self.num_kv_heads),
            ("mlp_hidden_size", self.mlp_hidden_size),
        ):
            if n % size:
                raise ValueError(
                    f"tensor-parallel size {size} does not divide the model's {name}={n}"
                )

    @property
    def head_dim(self) -> int:
        return self.d_model // self.n_heads

    @property
    def num_layers(self) -> int:
        return self.n_layers

    @property
    def num_kv_heads(self) -> int:
        return self.n_kv_heads or self.n_heads

    @property
    def padded_vocab_size(self) -> int:
        return self.embedding_size or self.vocab_size

    @classmethod
    def from_dict(cls, raw: dict) -> LLaDAConfig:
        known = {f for f in cls.__dataclass_fields__ if f != "extra"}
        missing = [
            k
            for k in ("d_model", "n_heads", "n_layers", "mlp_hidden_size", "vocab_size")
            if k not in raw
        ]
        if missing:
            raise ValueError(f"config.json is missing required key(s): {', '.join(missing)}")
        kwargs = {k: v for k, v in raw.items() if k in known}
        return cls(**kwargs, extra={k: v for k, v in raw.items() if k not in known})

    def to_dict(self) -> dict:
        out = asdict(self)
        out.update(out.pop("extra"))
        out["architectures"] = ["LLaDAModelLM"]
        out.setdefault("block_type", "llama")
        out.setdefault("activation_type", "silu")
        out.setdefault("layer_norm_type", "rms")
        out.setdefault("rope", True)
        return out
