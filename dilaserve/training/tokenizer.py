"""Train the bundled models' tokenizers with the `tokenizers` library, saved as checkpoint files.

BPE over the task's text with digits split one per token (so arithmetic sees digits), and a
family's special tokens and chat template: LLaDA's (mask, EOS, end-of-turn, chat headers) or
LLaDA2's (`<|mask|>`, `<|endoftext|>`, `<role>`/`</role>` headers, `<|role_end|>`).
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path

from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

from dilaserve.models.tokenizer import EOT_TOKEN, MASK_TOKEN

BOS_TOKEN = "<|startoftext|>"
EOS_TOKEN = "<|endoftext|>"
SPECIAL_TOKENS = (
    BOS_TOKEN,
    EOS_TOKEN,
    "<|start_header_id|>",
    "<|end_header_id|>",
    EOT_TOKEN,
    MASK_TOKEN,
)
CHAT_TEMPLATE = (
    "{% for message in messages %}"
    "{% if loop.index0 == 0 %}{{ bos_token }}{% endif %}"
    "{{ '<|start_header_id|>' + message['role'] + '<|end_header_id|>\n\n' }}"
    "{{ message['content'] | trim }}{{ '<|eot_id|>' }}"
    "{% endfor %}"
    "{% if add_generation_prompt %}{{ '<|start_header_id|>assistant<|end_header_id|>\n\n' }}"
    "{% endif %}"
)

LLADA2_MASK_TOKEN = "<|mask|>"
LLADA2_EOT_TOKEN = "<|role_end|>"
LLADA2_SPECIAL_TOKENS = (EOS_TOKEN, "<role>", "</role>", LLADA2_EOT_TOKEN, LLADA2_MASK_TOKEN)
LLADA2_CHAT_TEMPLATE = (  # the shape of LLaDA2.0's (Ling's) template: HUMAN/ASSISTANT roles
    "{% for message in messages %}"
    "{% set role = 'HUMAN' if message['role'] == 'user' else message['role'] | upper %}"
    "{{ '<role>' + role + '</role>' }}{{ message['content'] | trim }}{{ '<|role_end|>' }}"
    "{% endfor %}"
    "{% if add_generation_prompt %}{{ '<role>ASSISTANT</role>' }}{% endif %}"
)


@dataclass(frozen=True, slots=True)
class ChatFormat:
    """A family's special tokens (in vocabulary order), chat template and named tokens."""

    special_tokens: tuple[str, ...]
    chat_template: str
    mask_token: str
    bos_token: str | None


LLADA_FORMAT = ChatFormat(SPECIAL_TOKENS, CHAT_TEMPLATE, MASK_TOKEN, BOS_TOKEN)
LLADA2_FORMAT = ChatFormat(LLADA2_SPECIAL_TOKENS, LLADA2_CHAT_TEMPLATE, LLADA2_MASK_TOKEN, None)


def train_tokenizer(
    texts: list[str], folder: Path, vocab_size: int, chat: ChatFormat = LLADA_FORMAT
) -> Tokenizer:
    tok = Tokenizer(models.BPE(unk_token=None))
    tok.pre_tokenizer = pre_tokenizers.Sequence(
        [
            pre_tokenizers.Metaspace(replacement="▁", prepend_scheme="first"),
            pre_tokenizers.Digits(individual_digits=True),
            pre_tokenizers.Punctuation(),
        ]
    )
    tok.decoder = decoders.Metaspace(replacement="▁", prepend_scheme="first")
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size, special_tokens=list(chat.special_tokens), show_progress=False
    )
    tok.train_from_iterator(texts, trainer)
    folder.mkdir(parents=True, exist_ok=True)
    tok.save(str(folder / "tokenizer.json"))
    special_map = {
        "bos_token": chat.bos_token,
        "eos_token": EOS_TOKEN,
        "pad_token": EOS_TOKEN,
        "mask_token": chat.mask_token,
    }
    special_map = {k: v for k, v in special_map.items() if v is not None}
    config = {
        **special_map,
        "chat_template": chat.chat_template,
        "tokenizer_class": "PreTrainedTokenizerFast",
        "model_max_length": 4096,
    }
    (folder / "tokenizer_config.json").write_text(json.dumps(config, indent=2) + "\n")
    (folder / "special_tokens_map.json").write_text(json.dumps(special_map, indent=2) + "\n")
    return tok
