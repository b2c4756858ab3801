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
MAX_START = 30
MAX_OPERAND = 9
MAX_DOUBLE = 30


@dataclass(frozen=True, slots=True)
class Problem:
    question: str
    solution: str
    answer: int

    @property
    def target(self) -> str:
        return f"{self.solution}\n#### {self.answer}"


def _apply(rng: random.Random, name: str, value: int) -> tuple[str, str, int]:
    """One operation: (question clause, solution clause, new value)."""
    kinds = ["add", "sub"] + (["mul"] if value <= MAX_DOUBLE else [])
    kind = rng.choice(kinds)
    if kind == "sub" and value <= 1:
        kind = "add"
    if kind == "add":
        n = rng.randint(1, MAX_OPERAND)
        clause = rng.choice(ADD_PHRASES).format(n=n)
        return clause, f"{value} + {n} = {value + n}", value + n
    if kind == "sub":
        n = rng.randint(1, min(MAX_OPERAND, value - 1))
        clause = rng.choice(SUB_PHRASES).format(n=n)
        return clause, f"{value} - {n} = {value - n}", value - n
    k = rng.choice((2, 3)) if value <= MAX_DOUBLE // 3 * 2 else 2
    return MUL_PHRASES[k], f"{value} * {k} = {value * k}", value * k


def make_problem(rng: random.Random, num_ops: int) -> Problem:
    name, item = rng.choice(NAMES), rng.choice(ITEMS)
    value = rng.randint(2, MAX_START)
    sentences, steps = [f"{name} has {value} {item}."], [f"{name} starts with {value} {item}."]
    for i in range(num_ops):
        clause, step, value = _apply(rng, name, value)
        lead = name if i == 0 else rng.choice(("Then", "Next", "After that")) + " " + name
        sentences.append(f"{lead} {clause}.")
        steps.append(f"{step}.")
    sentences.append(f"How many {item} does {name} have now?")
    return Problem(" ".join(sentences), " ".join(steps), value)


def is_held_out(question: str) -> bool:
    return hashlib.blake2b(question.encode(), digest_size=2).digest()[0] < 26  # ~10%


def generate(num: int, seed: int, split: str = "train", max_ops: int = 3) -> list[Problem]:
    """`num` problems with 1..max_ops operations; `split` is "train" or "test" (disjoint)."""
    if split not in ("train", "test"):
        raise ValueError(f"{split=} must be 'train' or 'test'")
    rng, out = random.Random(seed), []
    want_held_out = split == "test"
    while len(out) < num:
        problem = make_problem(rng, rng.randint(1, max_ops))
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
