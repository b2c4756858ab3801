"""What a model family declares, so that nothing outside its module branches on model names.

A `ModelFamily` names the config.json `architectures` / `model_type` it serves, its config and
model classes, where its special tokens come from, and its decoding and cache semantics:

- `logit_shift`: the token at position i is read from the model's output at i - shift (Dream: 1);
- `attention`: bidirectional (LLaDA, Dream: the K/V of a cache are approximate, refreshed at each
  block's first step) or block-causal (LLaDA2: bidirectional inside a block, causal across
  blocks, so the K/V of the prompt and of finished blocks are exact);
- `decoding`: its decoding rule (`DecodingRule`): how many tokens a step commits at least, and
  when a request may stop early, with the published defaults;
- `editing_modes`: where the family has token editing (LLaDA2.1), its published modes and the
  rule they run (`decoding_for` picks the rule an engine runs).

The engine reads these; the registry (`models/registry.py`) maps a checkpoint to its family.
"""

from __future__ import annotations

import enum
from dataclasses import asdict, dataclass, replace

from dilaserve.protocol import MAX_EDIT_STEPS, EosStop, KVCacheMode


class Attention(str, enum.Enum):
    BIDIRECTIONAL = "bidirectional"
    BLOCK_CAUSAL = "block_causal"


APPROXIMATE_MODES = (KVCacheMode.NONE, KVCacheMode.PREFIX, KVCacheMode.DUAL)


EDITING_OFF = "off"
# steps per block position after which a rule with no step schedule stops picking the mask
MASK_PICK_STEPS = 8


@dataclass(frozen=True, slots=True)
class TokenEditing:
    """Token-to-token editing beside mask-to-token unmasking (LLaDA2.1's published decoding).

    A step also replaces a committed, non-prompt token of the current block by the step's top-1
    when that differs from it and its probability exceeds the edit threshold. A block whose
    masks are all committed runs on, editing only, until a step edits nothing or after
    `max_post_steps` such steps. `threshold`, `edit_threshold`: the mode's published pair; a
    request's threshold (the control knob) sets the mask-to-token threshold and moves the edit
    threshold in the mode's ratio (`edit_threshold_for`), so at the mode's own threshold both
    are the published ones.
    """

    mode: str
    threshold: float
    edit_threshold: float
    max_post_steps: int = MAX_EDIT_STEPS

    def edit_threshold_for(self, threshold: float) -> float:
        return self.edit_threshold * (threshold / self.threshold)  # exact at the mode's own


@dataclass(frozen=True, slots=True)
class DecodingRule:
    """A family's threshold rule: a step commits every masked position of the current block
    whose confidence exceeds the threshold, and at least `min_commits` of them (the most
    confident).

    step_schedule: False, at least one a step; True, LLaDA2's published schedule, where `steps`
    steps share a block's `block_len` commits as evenly as they can, the earlier steps taking
    the remainder, and a block ends after its `steps` steps (they commit it whole, unless
    `commits_mask` left masks).
    eos_stop: when a request may stop early (the published default).
    eos_only: the stop rule watches the EOS token only (the published generate's `eos_id`), not
    the chat template's end-of-turn token; the answer still ends at the first of either.
    mask_in_softmax: a confidence is a probability over the whole vocabulary, the mask token
    included (the published softmax of LLaDA2 and Fast-dLLM's Dream), rather than over the
    tokens a step may commit; the committed token is never the mask, unless `commits_mask`.
    commits_mask: the top-1 is over the whole vocabulary too (LLaDA2's published `generate`): a
    step that picks the mask at a position counts it among its commits and leaves the position
    masked, an edit to the mask masks its position again (LLaDA2.1's), and a block whose
    `steps` run out keeps the mask where it is left (the published loop moves on; the answer's
    text ends before it). Without a step schedule nothing bounds a block whose top-1 stays the
    mask (LLaDA2.1's published loop then never ends), so from a block's
    `MASK_PICK_STEPS` x `block_len`-th step on the top-1 is over the other tokens
    (`picks_mask`). A trained model does not rank the mask first, so this changes none of its
    answers.
    first_opens_block: a block's first step with an approximate cache (a recompute step, prefix
    or dual) commits the block's first position only, its top-1 whatever its confidence
    (Fast-dLLM's Dream decoders); the threshold rule runs from the block's second step on.
    editing: token editing (`TokenEditing`), or None.
    whole_window: without a cache (`none`), a step's candidates are every masked position of
    the output window, and it commits at most a budget (`max_commits`): Fast-dLLM's Dream
    `generation_utils.py`, where `gen_len / budget` steps are scheduled and the budget's
    rejections carry over to the next step, and steps are appended while the last one rejects.
    """

    step_schedule: bool = False
    eos_stop: EosStop = EosStop.COMMITTED
    eos_only: bool = False
    mask_in_softmax: bool = False
    commits_mask: bool = False
    first_opens_block: bool = False
    editing: TokenEditing | None = None
    whole_window: bool = False

    def picks_mask(self, block_len: int, block_step: int) -> bool:
        """Whether a block's step number `block_step` may pick the mask as its top-1."""
        if not self.commits_mask:
            return False
        return self.step_schedule or block_step < MASK_PICK_STEPS * block_len

    def min_commits(self, block_len: int, steps: int, block_step: int) -> int:
        """Fewest commits of a block's step number `block_step` (0-based); never below one,
        which changes nothing reachable: the schedule's first steps commit the whole block."""
        if not self.step_schedule:
            return 1
        base, extra = divmod(block_len, steps)
        return max(base + (block_step < extra), 1)

    @staticmethod
    def max_commits(gen_len: int, budget: int, num_steps: int, num_committed: int) -> int:
        """Most commits of a whole-window step after `num_steps` steps: `budget` a step plus
        the rejections carried over, as `num_committed` trails the schedule; past the
        scheduled `gen_len / budget` steps, what is left (each appended step's budget); never
        below one."""
        return max(min((num_steps + 1) * budget, gen_len) - num_committed, 1)

    def budget_for(self, kv_cache: KVCacheMode, step_budget: int | None, block_len: int):
        """A request's whole-window budget (`max_commits`) under the cache mode the engine
        runs (None: the rule decodes block by block there); `step_budget` None: `block_len`."""
        if not (self.whole_window and kv_cache is KVCacheMode.NONE):
            return None
        return step_budget or block_len

    def steps_for(self, steps: int, max_tokens: int) -> int | None:
        """The steps per block a request gets (None: no schedule): the published generate caps
        them at its `gen_length` (its `minimal_topk` left at 1)."""
        return min(steps, max_tokens) if self.step_schedule else None


@dataclass(frozen=True, slots=True)
class ModelFamily:
    name: str
    architectures: tuple[str, ...]
    model_types: tuple[str, ...]
    config_class: type  # from_dict(raw) -> config; the config's common properties: see registry
    model_class: type  # model_class(config, tp) -> nn.Module (forward, logits, init_weights)
    attention: Attention = Attention.BIDIRECTIONAL
    logit_shift: int = 0
    mask_token: str = "<|mdm_mask|>"  # the tokenizer's mask token, if config.json has no id
    eot_token: str | None = None  # the chat template's end-of-turn token, if any
    decoding: DecodingRule = DecodingRule()
    # token editing: the rule its modes run (their `editing` filled in), the modes (the first
    # the published default), and the config.json model types that edit by default
    editing_decoding: DecodingRule | None = None
    editing_modes: tuple[TokenEditing, ...] = ()
    editing_model_types: tuple[str, ...] = ()

    def decoding_for(self, config, editing: str | None = None) -> DecodingRule:
        """The rule an engine runs for a checkpoint's `config`: `editing` names a token-editing
        mode, or "off"; None: the first mode where config.json's `model_type` is one that edits
        (LLaDA2.1's), else no editing."""
        if editing is None:
            model_type = getattr(config, "extra", {}).get("model_type")
            edits = self.editing_modes and model_type in self.editing_model_types
            editing = self.editing_modes[0].mode if edits else EDITING_OFF
        if editing == EDITING_OFF:
            return self.decoding
        modes = {m.mode: m for m in self.editing_modes}
        if editing not in modes:
            raise ValueError(
                f"editing={editing!r}: {self.name} has token-editing modes "
                f"{sorted(modes) or 'none'} (or {EDITING_OFF!r})"
            )
        return replace(self.editing_decoding, editing=modes[editing])

    @property
    def is_block_causal(self) -> bool:
        return self.attention is Attention.BLOCK_CAUSAL

    @property
    def cache_modes(self) -> tuple[KVCacheMode, ...]:
        if self.is_block_causal:
            return (KVCacheMode.NONE, KVCacheMode.BLOCK)
        return APPROXIMATE_MODES

    def cache_mode(self, requested: KVCacheMode) -> KVCacheMode:
        """The cache mode an engine of this family runs for `requested`.

        A block-causal model's cache is exact: asking it for an approximate one (prefix, dual)
        gets the exact block cache. A bidirectional model has no exact cache.
        """
        if self.is_block_causal:
            return KVCacheMode.NONE if requested is KVCacheMode.NONE else KVCacheMode.BLOCK
        if requested not in APPROXIMATE_MODES:
            raise ValueError(
                f"kv_cache={requested.value!r}: {self.name} attends bidirectionally, so its "
                f"cache is approximate; use one of {[m.value for m in APPROXIMATE_MODES]}"
            )
        return requested


def build_config(cls, raw: dict, required: tuple[str, ...], accepted: dict[str, tuple]):
    """Build a family's frozen config dataclass from config.json's dict.

    `required` keys must be present; a key of `accepted` may be absent or hold one of the values
    listed for it (anything else is a computation this family does not implement, refused by
    name). Keys that are not fields are kept in `extra`, so the file round-trips.
    """
    missing = [k for k in required if k not in raw]
    if missing:
        raise ValueError(f"config.json is missing required key(s): {', '.join(missing)}")
    for key, values in accepted.items():
        if key in raw and raw[key] not in values:
            raise ValueError(
                f"config.json: {key}={raw[key]!r} is not supported (supported: "
                f"{', '.join(repr(v) for v in values)})"
            )
    fields = {f for f in cls.__dataclass_fields__ if f != "extra"}
    kwargs = {k: v for k, v in raw.items() if k in fields}
    return cls(**kwargs, extra={k: v for k, v in raw.items() if k not in fields})


def config_dict(config, family: ModelFamily) -> dict:
    """A family's config back as config.json's dict: the fields, the kept `extra` keys, and the
    family's architecture and model type where the file named none."""
    out = asdict(config)
    out.update(out.pop("extra"))
    out.setdefault("architectures", list(family.architectures))
    out.setdefault("model_type", family.model_types[0])
    return out


def check_divisible(size: int, counts: dict[str, int]) -> None:
    """Raise ValueError if `size` tensor-parallel ranks cannot split one of these counts."""
    for name, n in counts.items():
        if n % size:
            raise ValueError(f"tensor-parallel size {size} does not divide the model's {name}={n}")
