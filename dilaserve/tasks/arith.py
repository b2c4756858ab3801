"""Arithmetic word problems in the style of GSM8K, with exact-match answers.

The bundled model is trained on this task so that quality is measurable on a laptop: a question
in words, a short worked solution, then `#### answer`. The generator is deterministic given a
seed; `split` keeps training and held-out problems disjoint (by hashing the question text).
It knows nothing about tokenizers or models.
"""

from __future__ import annotations

import hashlib
import random
import re
from dataclasses import dataclass

NAMES = (
    "Tom",
    "Anna",
    "Ben",
    "Lily",
    "Sam",
    "Mia",
    "Jack",
    "Emma",
    "Leo",
    "Zoe",
    "Max",
    "Ava",
    "Noah",
    "Ella",
    "Finn",
    "Ruby",
    "Owen",
    "Ivy",
    "Luke",
    "Nora",
)
ITEMS = (
    "apples",
    "pencils",
    "marbles",
    "books",
    "cookies",
    "stickers",
    "coins",
    "cards",
    "shells",
    "flowers",
    "stamps",
    "eggs",
    "toys",
    "rocks",
    "buttons",
    "candies",
)
ADD_PHRASES = ("buys {n} more", "finds {n} more", "gets {n} more from a friend", "wins {n} more")
SUB_PHRASES = ("gives away {n}", "loses {n}", "sells {n}", "uses {n}")
MUL_PHRASES = {2: "doubles the pile", 3: "triples the pile"}
ANSWER_PATTERN = re.compile(r"####\s*(-?[\d,]+)")


@dataclass(frozen=True, slots=True)
class Difficulty:
    """Number ranges. Values never exceed `max_value`; doubling and tripling only from small
    enough values."""

    max_start: int
    max_operand: int
    max_value: int
    max_double: int
    max_triple: int


# "wide" (values up to ~90) proved too hard to learn within the CPU budget (docs/engine.md);
# "narrow" keeps every value at most 20, so the model learns a few hundred arithmetic facts.
DIFFICULTIES = {
    "wide": Difficulty(max_start=30, max_operand=9, max_value=10_000, max_double=30, max_triple=20),
    "narrow": Difficulty(max_start=12, max_operand=5, max_value=20, max_double=10, max_triple=6),
}
DEFAULT_DIFFICULTY = "narrow"


@dataclass(frozen=True, slots=True)
class Problem:
    question: str
    solution: str
    answer: int

    @property
    def target(self) -> str:
        return f"{self.solution}\n#### {self.answer}"


def _apply(rng: random.Random, value: int, level: Difficulty) -> tuple[str, str, int]:
    """One operation: (question clause, solution clause, new value)."""
    kinds = ["sub"] if value > 1 else []
    if value + 1 <= level.max_value:
        kinds.append("add")
    if value <= level.max_double:
        kinds.append("mul")
    kind = rng.choice(kinds)
    if kind == "add":
        n = rng.randint(1, min(level.max_operand, level.max_value - value))
        clause = rng.choice(ADD_PHRASES).format(n=n)
        return clause, f"{value} + {n} = {value + n}", value + n
    if kind == "sub":
        n = rng.randint(1, min(level.max_operand, value - 1))
        clause = rng.choice(SUB_PHRASES).format(n=n)
        return clause, f"{value} - {n} = {value - n}", value - n
    k = rng.choice((2, 3)) if value <= level.max_triple else 2
    return MUL_PHRASES[k], f"{value} * {k} = {value * k}", value * k


def make_problem(rng: random.Random, num_ops: int, difficulty: str = DEFAULT_DIFFICULTY) -> Problem:
    level = DIFFICULTIES[difficulty]
    name, item = rng.choice(NAMES), rng.choice(ITEMS)
    value = rng.randint(2, level.max_start)
    sentences, steps = [f"{name} has {value} {item}."], [f"{name} starts with {value} {item}."]
    for i in range(num_ops):
        clause, step, value = _apply(rng, value, level)
        lead = name if i == 0 else rng.choice(("Then", "Next", "After that")) + " " + name
        sentences.append(f"{lead} {clause}.")
        steps.append(f"{step}.")
    sentences.append(f"How many {item} does {name} have now?")
    return Problem(" ".join(sentences), " ".join(steps), value)


def is_held_out(question: str) -> bool:
    return hashlib.blake2b(question.encode(), digest_size=2).digest()[0] < 26  # ~10%


def generate(
    num: int,
    seed: int,
    split: str = "train",
    max_ops: int = 3,
    difficulty: str = DEFAULT_DIFFICULTY,
) -> list[Problem]:
    """`num` problems with 1..max_ops operations; `split` is "train" or "test" (disjoint)."""
    if split not in ("train", "test"):
        raise ValueError(f"{split=} must be 'train' or 'test'")
    if difficulty not in DIFFICULTIES:
        raise ValueError(f"{difficulty=} must be one of {sorted(DIFFICULTIES)}")
    rng, out = random.Random(seed), []
    want_held_out = split == "test"
    while len(out) < num:
        problem = make_problem(rng, rng.randint(1, max_ops), difficulty)
        if is_held_out(problem.question) == want_held_out:
            out.append(problem)
    return out


def extract_answer(text: str) -> int | None:
    """The integer after `####`, or None if the text has none."""
    match = ANSWER_PATTERN.search(text)
    if match is None:
        return None
    try:
        return int(match.group(1).replace(",", ""))
    except ValueError:
        return None
