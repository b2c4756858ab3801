"""An open-loop load generator for `dilaserve serve` (or any OpenAI-compatible server).

Arrivals come from `trace_arrivals` (the same ones `run-trace` replays in process) and each is
sent at its scheduled time whether or not earlier requests have answered: a closed loop would
slow down with the server and hide exactly the overload an SLO benchmark is after. Prompts are
held-out problems of the bundled arithmetic task, so every answer is scored by exact match.

Every request streams (`stream: true` with `stream_options.include_usage`), which is what makes
time to first committed text measurable; latency is send to `data: [DONE]`. Requests go through
the load client (`bench/client.py`, aiohttp), which sends each once. A request that gets
an error status, a broken stream or no answer within `timeout` counts as a missed SLO and a
wrong answer, so overload cannot improve either number by failing requests fast.
"""

from __future__ import annotations

import asyncio
import json
import math
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import TextIO

import numpy as np

from dilaserve.bench.client import LoadClient, NoAnswer
from dilaserve.bench.plots import plot_bench
from dilaserve.cluster.trace_run import TraceRunSpec, trace_arrivals
from dilaserve.runs import create_run_dir, environment, markdown_table, write_json, write_records
from dilaserve.tasks import arith

ENDPOINTS = {"completions": "/v1/completions", "chat": "/v1/chat/completions"}
BENCH_FIELDS = ("model", "prompt", "messages", "max_tokens", "stream", "stream_options", "slo_ms")
TEXT_IN_CSV = 200  # characters of each answer kept in records.csv


@dataclass(frozen=True)
class BenchSpec:
    url: str = "http://127.0.0.1:8000"  # server base URL
    trace: str = "poisson:4:20"  # a trace CSV, or poisson:RPS:SECONDS
    rate_scale: float = 1.0  # arrivals this many times as fast
    duration: float | None = None  # keep the first N seconds (after scaling)
    max_requests: int | None = None
    slo_ms: float = 1000.0  # sent with each request; also what met_slo is judged against
    endpoint: str = "chat"  # "chat" or "completions"
    max_tokens: int = 64
    model: str | None = None  # default: the first id from GET /v1/models
    seed: int = 0
    timeout: float = 60.0  # seconds per request, send to [DONE]
    extra: dict = field(default_factory=dict)  # more request fields, e.g. {"threshold": 0.9}
    api_key: str | None = field(default=None, repr=False)  # sent as a bearer token; never saved

    def __post_init__(self):
        if not self.url.startswith(("http://", "https://")):
            raise ValueError(f"url={self.url!r} must start with http:// or https://")
        if self.endpoint not in ENDPOINTS:
            raise ValueError(f"endpoint={self.endpoint!r} must be one of {sorted(ENDPOINTS)}")
        for name in ("rate_scale", "slo_ms", "max_tokens", "timeout"):
            if getattr(self, name) <= 0:
                raise ValueError(f"{name}={getattr(self, name)!r} must be positive")
        clash = sorted(set(self.extra) & set(BENCH_FIELDS))
        if clash:
            raise ValueError(f"extra={self.extra!r} sets {clash}, which the bench sets itself")

    def arrivals(self) -> np.ndarray:
        """Scheduled send times (s from the start), exactly as `run-trace` would replay them."""
        return trace_arrivals(
            TraceRunSpec(
                trace=self.trace,
                rate_scale=self.rate_scale,
                duration=self.duration,
                max_requests=self.max_requests,
                seed=self.seed,
            )
        )


def bench_problems(n: int, seed: int) -> list[arith.Problem]:
    """The held-out problems a run with this seed sends, in order (the same as `run-trace`)."""
    return arith.generate(n, seed=seed + 11, split="test")


@dataclass
class _Stream:
    """What one streamed response delivered, with times on the run's clock."""

    status: int = 0  # 0: no HTTP response at all
    error: str = ""
    pieces: list[str] = field(default_factory=list)
    first_text: float | None = None
    done: float | None = None
    completion_tokens: int | None = None


class ProgressBar:
    """Requests sent and done on one stderr line, redrawn at most `per_second` times a second
    so that a fast run does not spend its time writing to the terminal."""

    def __init__(self, total: int, out: TextIO | None, per_second: float = 4.0):
        self.total, self.out, self.gap = total, out, 1.0 / per_second
        self.sent = self.done = self.errors = 0
        self.last = -math.inf

    def update(self, *, sent: int = 0, done: int = 0, error: bool = False) -> None:
        self.sent += sent
        self.done += done
        self.errors += error
        if time.monotonic() - self.last >= self.gap:
            self.draw()

    def draw(self) -> None:
        if self.out is None:
            return
        self.last = time.monotonic()
        self.out.write(
            f"\rsent {self.sent}/{self.total}  done {self.done}/{self.total}  errors {self.errors}"
        )
        self.out.flush()

    def close(self) -> None:
        self.draw()
        if self.out is not None:
            self.out.write("\n")


def run_bench(spec: BenchSpec, progress: TextIO | None = None) -> tuple[list[dict], dict]:
    """Run the benchmark to the last response; returns (records, summary)."""
    return asyncio.run(bench(spec, progress))


async def bench(spec: BenchSpec, progress: TextIO | None = None) -> tuple[list[dict], dict]:
    """`run_bench` for callers already inside an event loop."""
    arrivals = spec.arrivals().tolist()
    problems = bench_problems(len(arrivals), spec.seed)
    # One connection per request: an open loop must never queue behind the client's own pool.
    headers = {} if spec.api_key is None else {"Authorization": f"Bearer {spec.api_key}"}
    client = LoadClient(spec.url, spec.timeout, max_connections=len(arrivals), headers=headers)
    async with client:
        model = spec.model or await _first_model(client, spec.url)
        bar = ProgressBar(len(arrivals), progress)
        loop = asyncio.get_running_loop()
        start = loop.time()
        tasks = []
        for arrival, problem in zip(arrivals, problems):
            while (delay := start + arrival - loop.time()) > 0:
                await asyncio.sleep(delay)  # the loop may wake a hair early; never send early
            body = _request_body(spec, model, problem.question)
            sent = loop.time() - start
            tasks.append(asyncio.create_task(_send(client, spec, body, start, sent, bar)))
            bar.update(sent=1)
        streams = await asyncio.gather(*tasks)
        wall = loop.time() - start
        bar.close()
    records = [
        _record(f"r{i}", arrival, sent, stream, problem, spec.slo_ms)
        for i, (arrival, (sent, stream), problem) in enumerate(zip(arrivals, streams, problems))
    ]
    return records, summarize(records, wall)


async def _first_model(client: LoadClient, url: str) -> str:
    """The server's first model id, so that `--model` is only needed on multi-model servers."""
    try:
        answer = await client.get("/v1/models")
        if answer.status != 200:
            raise ValueError(f"status {answer.status}")
        return answer.json()["data"][0]["id"]
    except (NoAnswer, asyncio.TimeoutError, ValueError, KeyError, IndexError, TypeError) as e:
        raise ValueError(
            f"url={url!r}: GET /v1/models gave no model id ({type(e).__name__}: {e}); "
            "is the server up? (or set model, --model on the command line)"
        ) from None


def _request_body(spec: BenchSpec, model: str, question: str) -> dict:
    prompt = (
        {"messages": [{"role": "user", "content": question}]}
        if spec.endpoint == "chat"
        else {"prompt": question}
    )
    return {
        **spec.extra,
        "model": model,
        **prompt,
        "max_tokens": spec.max_tokens,
        "stream": True,
        "stream_options": {"include_usage": True},
        "slo_ms": spec.slo_ms,
    }


async def _send(
    client: LoadClient,
    spec: BenchSpec,
    body: dict,
    start: float,
    sent: float,
    bar: ProgressBar,
) -> tuple[float, _Stream]:
    """One request, never raising: whatever went wrong is the record's `error`."""
    stream = _Stream()
    try:
        await asyncio.wait_for(_stream(client, spec, body, start, stream), spec.timeout)
    except asyncio.TimeoutError:
        stream.error = f"no [DONE] within timeout={spec.timeout} s"
    except (NoAnswer, ValueError) as e:
        stream.error = f"{type(e).__name__}: {e}"
    bar.update(done=1, error=not (stream.status == 200 and not stream.error))
    return sent, stream


async def _stream(
    client: LoadClient, spec: BenchSpec, body: dict, start: float, stream: _Stream
) -> None:
    loop = asyncio.get_running_loop()
    async with client.stream(ENDPOINTS[spec.endpoint], body) as events:
        stream.status = events.status
        if events.status != 200:
            stream.error = _error_message(events.headers, await events.body())
            return
        async for chunk in events:
            _take_chunk(chunk, spec.endpoint, stream, loop.time() - start)
    if events.done:
        stream.done = loop.time() - start
    else:
        stream.error = stream.error or "stream ended without data: [DONE]"


def _take_chunk(chunk: dict, endpoint: str, stream: _Stream, now: float) -> None:
    if chunk.get("error"):
        stream.error = str(chunk["error"].get("message", chunk["error"]))
    if chunk.get("usage"):
        stream.completion_tokens = chunk["usage"].get("completion_tokens")
    for choice in chunk.get("choices") or []:
        text = choice.get("text") if endpoint == "completions" else choice["delta"].get("content")
        if text:
            stream.first_text = now if stream.first_text is None else stream.first_text
            stream.pieces.append(text)


def _error_message(headers: dict[str, str], content: bytes) -> str:
    """OpenAI's `error.message` when the body has one, else the start of the body."""
    try:
        message = json.loads(content)["error"]["message"]
    except (ValueError, KeyError, TypeError):
        message = content.decode(errors="replace")[:200]
    retry = headers.get("retry-after")
    return f"{message} (Retry-After {retry})" if retry else message


def _record(
    request_id: str,
    arrival: float,
    sent: float,
    stream: _Stream,
    problem: arith.Problem,
    slo_ms: float,
) -> dict:
    ok = stream.status == 200 and not stream.error
    latency = stream.done - sent if ok and stream.done is not None else math.nan
    ttft = stream.first_text - sent if stream.first_text is not None else math.nan
    text = "".join(stream.pieces)
    return {
        "request_id": request_id,
        "arrival": round(arrival, 6),
        "sent": round(sent, 6),
        "status": stream.status,
        "error": stream.error,
        "latency": round(latency, 6),
        "ttft": round(ttft, 6),
        "completion_tokens": stream.completion_tokens,
        "correct": ok and arith.extract_answer(text) == problem.answer,
        "met_slo": ok and latency * 1000 <= slo_ms,
        "text": text,
    }


def summarize(records: list[dict], wall: float) -> dict:
    """Rates over all requests (an error is a missed SLO and a wrong answer); latency and time
    to first text over the requests that have them."""
    ok = [r for r in records if r["status"] == 200 and not r["error"]]
    errors: dict[str, int] = {}
    for r in records:
        if r["status"] != 200 or r["error"]:
            errors[str(r["status"])] = errors.get(str(r["status"]), 0) + 1
    latency = np.array([r["latency"] for r in ok])
    ttft = np.array([r["ttft"] for r in records if not math.isnan(r["ttft"])])
    last_arrival = records[-1]["arrival"]
    return {
        "requests": len(records),
        "ok": len(ok),
        "errors": errors,
        "slo_attainment": round(float(np.mean([r["met_slo"] for r in records])), 4),
        "accuracy": round(float(np.mean([r["correct"] for r in records])), 4),
        # the answers' own quality (what the threshold costs), apart from the requests refused
        "accuracy_answered": _share([r["correct"] for r in ok]),
        "latency_mean": _mean(latency),
        "latency_p50": _pct(latency, 50),
        "latency_p90": _pct(latency, 90),
        "latency_p99": _pct(latency, 99),
        "ttft_mean": _mean(ttft),
        "ttft_p50": _pct(ttft, 50),
        "ttft_p99": _pct(ttft, 99),
        "offered_rate": round(len(records) / last_arrival, 4) if last_arrival else math.nan,
        "request_rate": round(len(ok) / wall, 4),  # answered requests per second of wall time
        "send_lag_max": round(max(r["sent"] - r["arrival"] for r in records), 6),
        "wall_seconds": round(wall, 3),
    }


def _share(flags: list[bool]) -> float:
    return round(float(np.mean(flags)), 4) if flags else math.nan


def _mean(a: np.ndarray) -> float:
    return round(float(a.mean()), 4) if a.size else math.nan


def _pct(a: np.ndarray, q: float) -> float:
    return round(float(np.percentile(a, q)), 4) if a.size else math.nan


def write_bench_run(records: list[dict], summary: dict, spec: BenchSpec, root) -> Path:
    """A run folder: config.json (spec and environment), records.csv (answers cut to
    TEXT_IN_CSV characters), summary.json and report.md."""
    folder = create_run_dir(root, "bench")
    config = {k: v for k, v in asdict(spec).items() if k != "api_key"}
    write_json(folder / "config.json", {"bench": config, "environment": environment()})
    write_records(folder / "records.csv", [{**r, "text": r["text"][:TEXT_IN_CSV]} for r in records])
    write_json(folder / "summary.json", summary)
    rows = [{"metric": k, "value": v} for k, v in summary.items()]
    head = f"# bench\n\n{spec.endpoint} requests to {spec.url}, trace {spec.trace} "
    head += f"x{spec.rate_scale:g}, SLO {spec.slo_ms:g} ms\n\n"
    table = markdown_table(rows, ["metric", "value"]) + "\n"
    title = f"{folder.name}: {spec.trace} x{spec.rate_scale:g} against {spec.url}"
    if plot_bench(records, spec.slo_ms / 1000, title, folder) is not None:
        table += "\n![each request and the latency CDF](bench.png)\n"
    (folder / "report.md").write_text(head + table)
    return folder
