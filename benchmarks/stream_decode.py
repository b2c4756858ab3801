"""Streaming's detokenization work: the whole committed prefix decoded at every step (as the
controller did before issue 40) against `Answers.stream`, which hands the decoder only the
tokens committed since the last step (`tokenizers`' `DecodeStream`).

    python benchmarks/stream_decode.py [--lengths 256,1024] [--per-step 2] [--repeats 5]
                                       [--tokenizer FOLDER] [--out runs]

An answer of each length (worked solutions of the bundled arithmetic task, one after another)
commits `--per-step` tokens a step, left to right, the order that makes each step's committed
prefix grow. Per length: the tokens handed to the decoder over the whole answer, and the CPU
seconds spent streaming it (the best of `--repeats`), before and after. Both give the same text,
which is checked. Writes a run folder under `--out` (ignored by git).
"""

from __future__ import annotations

import argparse
import time

from dilaserve.cluster.requests import Answers, RequestHandle
from dilaserve.config import BUNDLED_MODEL
from dilaserve.models.tokenizer import Tokenizer
from dilaserve.request import Request
from dilaserve.runs import create_run_dir, environment, markdown_table, write_json, write_records
from dilaserve.tasks import arith

COLUMNS = ("tokens", "decoded_before", "decoded_after", "cpu_ms_before", "cpu_ms_after", "speedup")


class CountingTokenizer:
    """The tokenizer, counting every token handed to a decoder (whole or incremental)."""

    def __init__(self, tokenizer: Tokenizer):
        self.tokenizer, self.special, self.decoded = tokenizer, tokenizer.special, 0

    def decode(self, ids: list[int]) -> str:
        self.decoded += len(ids)
        return self.tokenizer.decode(ids)

    def decode_stream(self):
        inner, counter = self.tokenizer.decode_stream(), self

        class Counted:
            def add(self, ids: list[int]) -> str:
                counter.decoded += len(ids)
                return inner.add(ids)

        return Counted()


def answer_ids(tokenizer: Tokenizer, num_tokens: int) -> list[int]:
    """`num_tokens` tokens of worked solutions, none of them a stop token."""
    ids: list[int] = []
    for problem in arith.generate(10_000, seed=0):
        ids += tokenizer.encode(problem.target + "\n")
        if len(ids) >= num_tokens:
            return ids[:num_tokens]
    raise ValueError(f"{num_tokens=} is more than the generated answers hold")


def committed_steps(tokenizer, ids: list[int], per_step: int):
    """A request whose output commits `per_step` more of `ids` at each step, left to right:
    yields it after each step."""
    special = tokenizer.special
    request = Request("r", (1,), len(ids), len(ids), special.mask, 0.9, deadline=0.0)
    for start in range(0, len(ids), per_step):
        request.output_ids[start : start + per_step] = ids[start : start + per_step]
        yield request


def stream_before(tokenizer, ids: list[int], per_step: int) -> str:
    """The old way: the whole committed prefix read and decoded again at every step."""
    text = ""
    for request in committed_steps(tokenizer, ids, per_step):
        text = tokenizer.decode(request.generated_ids(tokenizer.special.stop_ids))
    return text


def stream_after(tokenizer, ids: list[int], per_step: int) -> str:
    """`Answers.stream`, as the controller calls it after each step."""
    handle, answers = None, Answers(tokenizer)
    for request in committed_steps(tokenizer, ids, per_step):
        handle = handle or RequestHandle(request, 0.0)
        answers.stream(handle)
    return handle.committed_text


def measure(way, tokenizer: Tokenizer, ids: list[int], per_step: int, repeats: int):
    """(tokens decoded, best CPU ms, text) of streaming `ids` the `way` given."""
    counting = CountingTokenizer(tokenizer)
    text = way(counting, ids, per_step)
    best = float("inf")
    for _ in range(repeats):
        start = time.process_time()
        way(tokenizer, ids, per_step)
        best = min(best, time.process_time() - start)
    return counting.decoded, best * 1000, text


def run(args) -> list[dict]:
    tokenizer = Tokenizer(args.tokenizer)
    rows = []
    for length in args.lengths:
        ids = answer_ids(tokenizer, length)
        before = measure(stream_before, tokenizer, ids, args.per_step, args.repeats)
        after = measure(stream_after, tokenizer, ids, args.per_step, args.repeats)
        if before[2] != after[2]:
            raise AssertionError(f"{length} tokens: the streamed text differs from decode's")
        rows.append(
            {
                "tokens": length,
                "decoded_before": before[0],
                "decoded_after": after[0],
                "cpu_ms_before": round(before[1], 2),
                "cpu_ms_after": round(after[1], 2),
                "speedup": round(before[1] / after[1], 1) if after[1] else float("inf"),
            }
        )
    return rows


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--lengths", type=lambda s: [int(x) for x in s.split(",")],
                        default=[256, 1024])  # fmt: skip
    parser.add_argument("--per-step", type=int, default=2, help="tokens committed a step")
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--tokenizer", default=str(BUNDLED_MODEL), help="a checkpoint folder")
    parser.add_argument("--out", default="runs", help="folder for the run folder")
    args = parser.parse_args()
    rows = run(args)
    table = markdown_table(rows, list(COLUMNS))
    print(table)
    folder = create_run_dir(args.out, "stream-decode")
    write_json(folder / "config.json", {**vars(args), "environment": environment()})
    write_records(folder / "records.csv", rows)
    (folder / "report.md").write_text(f"# stream decode\n\n{table}\n")
    print(f"wrote {folder}")


if __name__ == "__main__":
    main()
