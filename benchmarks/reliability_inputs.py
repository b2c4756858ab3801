"""What the reliability suite sends and how it judges an answer: the hostile bodies of its fuzz
phase (wrong types, values at and past every bound, lone surrogates, broken JSON, deep nesting,
bodies over the size limit, prompts past the context), the model and prompt of its normal
requests, and whether an answer is a completion or an error in OpenAI's shape. It sends nothing
(`reliability_load.py` and `reliability_phases.py` do)."""

from __future__ import annotations

import json
import random
import time

MODEL = "tiny-llada"
PROMPT = "Tom has 12 stamps. Tom gives away 5. How many stamps does Tom have now?"
OPENAI_ERROR_KEYS = {"message", "type", "param", "code"}

WEIRD = [None, True, -1, 0, 1e-300, 1e308, 2**31, -(2**31) - 1, 10**30, "", "x", [], {}, [[]]]
FIELDS = ["model", "prompt", "max_tokens", "stream", "n", "slo_ms", "deadline", "priority",
          "threshold", "min_threshold", "max_threshold", "stop", "logprobs", "stream_options",
          "messages", "max_completion_tokens", "echo", "best_of", "suffix"]  # fmt: skip
BOUNDS = {
    "slo_ms": [1e-9, 1e-3, 0.1, 0.5, 1, 1e9, 1e300],
    "priority": [2**31 - 1, -(2**31), 0, 1],
    "threshold": [1e-9, 0.5, 1.0],
    "min_threshold": [1e-9, 1.0],
    "max_threshold": [1e-9, 1.0],
    "max_tokens": [1, 31, 32, 33],
    "deadline": [1.0, 1e12, None],
    "stop": ["\n", ["a", "b", "c", "d"], ["x" * 256], "####"],
}


def hostile_body(rng: random.Random) -> tuple[str, bytes, dict]:
    """(path, raw body, headers) of one hostile request."""
    chat = rng.random() < 0.4
    path = "/v1/chat/completions" if chat else "/v1/completions"
    body: dict = {"model": MODEL, "max_tokens": 32}
    body |= {"messages": [{"role": "user", "content": PROMPT}]} if chat else {"prompt": PROMPT}
    kind = rng.choice(["bound", "bound", "type", "type", "unicode", "json", "size", "shape"])
    if kind == "bound":  # extension fields at their bounds (mostly served: 200 or 429)
        for name in rng.sample(list(BOUNDS), rng.randint(1, 3)):
            body[name] = rng.choice(BOUNDS[name])
            if name == "deadline" and body[name] == 1e12:
                body[name] = time.time() + rng.choice([1e-3, 0.5, 5])
    elif kind == "type":
        for name in rng.sample(FIELDS, rng.randint(1, 3)):
            body[name] = rng.choice(WEIRD)
    elif kind == "unicode":
        spot = rng.choice(["prompt", "stop", "model", "content", "role"])
        text = rng.choice(["\ud800", "a\udfffb", "\x00", "\u202e", "\ufffe" * 3])
        if spot in ("content", "role"):
            body.pop("prompt", None)
            body["messages"] = [{"role": "user", "content": PROMPT, spot: text}]
            path = "/v1/chat/completions"
        else:
            body[spot] = text
    elif kind == "size":
        choice = rng.choice(["over", "context", "ids"])
        if choice == "over":
            body["prompt"] = "x" * (1 << 20)
        elif choice == "context":
            body["prompt"] = "7 " * 200_000
        else:
            body["prompt"] = [
                rng.choice([-1, 0, 10**9, 2**63]) for _ in range(rng.randint(1, 5000))
            ]
        path = "/v1/completions"
        body.pop("messages", None)
    elif kind == "shape":
        body = rng.choice([[], "x", 3, None, {"model": MODEL}, {"messages": "hi", "model": MODEL}])
    raw = json.dumps(body).encode() if kind != "json" else broken_json(rng)
    if kind == "shape" and rng.random() < 0.3:
        raw = b"[" * 100_000 + b"]" * 100_000  # deep nesting
    return path, raw, {"content-type": "application/json"}


def broken_json(rng: random.Random) -> bytes:
    return rng.choice(
        [
            b'{"model": "tiny-llada", "prompt": "x"',
            b'{"model": "tiny-llada", "prompt": NaN, "max_tokens": Infinity}',
            b'{"model": "tiny-llada", "slo_ms": -Infinity, "prompt": "x"}',
            bytes(rng.randrange(256) for _ in range(64)),
            b"\xff\xfe{}",
            b"",
        ]
    )


def is_openai_answer(status: int, raw: bytes) -> bool:
    try:
        body = json.loads(raw)
    except ValueError:
        return False
    if status == 200:
        return "choices" in body
    return isinstance(body, dict) and OPENAI_ERROR_KEYS <= set(body.get("error", {}))
