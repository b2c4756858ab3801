"""A checkpoint's tokenizer and chat template, from its own files (no network, no remote code).

Reads `tokenizer.json` (the `tokenizers` library's format) and `tokenizer_config.json` (special
tokens and the Jinja chat template), the files LLaDA, Dream and LLaDA2 checkpoints ship. Special
ids (mask, EOS, end-of-turn, pad) are resolved here, from the model config first and the
tokenizer second, with the token names the model's family declares (`models/family.py`).
Without a model config, the folder's config.json (if any) names the family; else LLaDA's names.
A checkpoint without tokenizer.json takes token ids only: `special_ids` then reads the special
ids from config.json alone.
"""

from __future__ import annotations

import functools
import json
from dataclasses import dataclass
from pathlib import Path

from tokenizers import Tokenizer as HFTokenizer
from tokenizers.decoders import DecodeStream

from dilaserve.models import chat_template

MASK_TOKEN = "<|mdm_mask|>"
EOT_TOKEN = "<|eot_id|>"


@dataclass(frozen=True, slots=True)
class SpecialIds:
    mask: int
    eos: int
    eot: int | None
    pad: int | None = None

    @property
    def stop_ids(self) -> frozenset[int]:
        return frozenset(i for i in (self.eos, self.eot) if i is not None)


class Tokenizer:
    def __init__(self, folder: Path, model_config=None):
        folder = Path(folder)
        path = folder / "tokenizer.json"
        if not path.exists():
            raise FileNotFoundError(f"no tokenizer.json in checkpoint folder {folder}")
        self._tok = HFTokenizer.from_file(str(path))
        self.folder = folder
        cfg_path = folder / "tokenizer_config.json"
        self.config = json.loads(cfg_path.read_text()) if cfg_path.exists() else {}
        if model_config is None and (folder / "config.json").exists():
            from dilaserve.models.registry import load_config

            model_config = load_config(folder)
        self.special = self._resolve_special(model_config)

    def _token_id(self, token: str | dict | None) -> int | None:
        if isinstance(token, dict):
            token = token.get("content")
        return None if token is None else self._tok.token_to_id(token)

    def _resolve_special(self, model_config) -> SpecialIds:
        mask_token, eot_token = _token_names(model_config)
        mask = getattr(model_config, "mask_token_id", None)
        if mask is None:
            mask = self._token_id(mask_token)
        eos = getattr(model_config, "eos_token_id", None)
        if eos is None:
            eos = self._token_id(self.config.get("eos_token"))
        if mask is None:
            raise ValueError(
                f"cannot find the mask token: set mask_token_id in config.json or "
                f"add {mask_token} to the tokenizer"
            )
        if eos is None:
            raise ValueError(
                "cannot find the EOS token: set eos_token_id in config.json or "
                "eos_token in tokenizer_config.json"
            )
        pad = getattr(model_config, "pad_token_id", None)
        if pad is None:
            pad = self._token_id(self.config.get("pad_token"))
        return SpecialIds(mask=mask, eos=eos, eot=self._token_id(eot_token), pad=pad)

    @property
    def vocab_size(self) -> int:
        return self._tok.get_vocab_size()

    def encode(self, text: str) -> list[int]:
        return self._tok.encode(text, add_special_tokens=False).ids

    def decode(self, ids: list[int]) -> str:
        return self._tok.decode(list(ids), skip_special_tokens=True)

    def decode_stream(self) -> TextStream:
        """A decoder for a growing token sequence, which `decode` would otherwise re-read from
        its start each time it grows."""
        return TextStream(self._tok)

    def apply_chat_template(
        self, messages: list[dict], add_generation_prompt: bool = True, tools: list | None = None
    ) -> str:
        """The checkpoint's chat template over `messages`, rendered as Hugging Face renders it
        (`models/chat_template.py`), with its special tokens by name."""
        return chat_template.render(
            self._chat_template,
            messages,
            tools=tools,
            add_generation_prompt=add_generation_prompt,
            **self._special_tokens,
        )

    @functools.cached_property
    def _chat_template(self):
        """The checkpoint's chat template, compiled once."""
        return chat_template.compile_chat_template(
            chat_template.template_text(self.config, self.folder)
        )

    @functools.cached_property
    def _special_tokens(self) -> dict[str, str]:
        return chat_template.special_tokens(self.config)

    def encode_chat(self, user_text: str) -> list[int]:
        return self.encode(self.apply_chat_template([{"role": "user", "content": user_text}]))


class TextStream:
    """Incremental detokenization (the `tokenizers` library's `DecodeStream`): `add(ids)` gives
    the text that the tokens add to those added before, the same text that `decode` of the
    whole sequence gives, for a constant amount of work a token. A character whose bytes are
    split across tokens comes out whole once its last token arrives, never as U+FFFD."""

    def __init__(self, tokenizer: HFTokenizer):
        self._tok = tokenizer
        self._stream = DecodeStream(skip_special_tokens=True)

    def add(self, ids: list[int]) -> str:
        pieces = (self._stream.step(self._tok, i) for i in ids)
        return "".join(p for p in pieces if p is not None)


def has_tokenizer(folder: str | Path) -> bool:
    return (Path(folder) / "tokenizer.json").is_file()


def special_ids(folder: str | Path, model_config) -> SpecialIds:
    """A checkpoint's special ids: through its tokenizer, or, in a folder without tokenizer.json
    (token ids only), from config.json's `mask_token_id` and `eos_token_id`."""
    if has_tokenizer(folder):
        return Tokenizer(Path(folder), model_config).special
    mask = getattr(model_config, "mask_token_id", None)
    eos = getattr(model_config, "eos_token_id", None)
    missing = [name for name, v in (("mask_token_id", mask), ("eos_token_id", eos)) if v is None]
    if missing:
        raise ValueError(
            f"checkpoint folder {Path(folder)} has no tokenizer.json, so its config.json must "
            f"set {' and '.join(missing)}"
        )
    return SpecialIds(mask=mask, eos=eos, eot=None, pad=getattr(model_config, "pad_token_id", None))


def _token_names(model_config) -> tuple[str, str | None]:
    """(mask token, end-of-turn token) as the model's family names them."""
    if model_config is None:
        return MASK_TOKEN, EOT_TOKEN
    from dilaserve.models.registry import family_of

    family = family_of(model_config)
    return family.mask_token, family.eot_token
