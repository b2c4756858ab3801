"""`dilaserve bench` against a stub OpenAI-compatible server on a real 127.0.0.1 socket.

The stub knows each prompt's answer (the bench's problems are deterministic given the seed), so
it can answer right or wrong on purpose; it streams an empty role chunk, then the answer in
three deltas and a usage chunk. One prompt gets 429 with Retry-After and one is slower than the
SLO, so the summary's accuracy and SLO attainment are known exactly.
"""

from __future__ import annotations

import asyncio
import json
import math
import sys
import threading
import time

import pytest
import uvicorn
from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, StreamingResponse

from dilaserve.bench.loadgen import BenchSpec, bench_problems, run_bench, write_bench_run
from dilaserve.cli import build_parser, main

from conftest import HANG_GUARD_S

SEED = 3
TRACE_TIMES = [0.0, 0.1, 0.1, 0.2, 0.3, 0.36, 0.5, 0.6]  # seconds; run at rate_scale 2
RATE_SCALE = 2.0
SLO_MS = 400.0
WRONG, REJECTED, SLOW = {1, 5}, 2, 3  # problem indices
FIRST_TEXT_DELAY = 0.03  # after the role chunk
TIMER_SLACK = 0.005  # uvloop's (libuv's) timers tick in milliseconds: a sleep may end early
SLOW_SECONDS = 2.0  # so long that the later requests are sent while it runs, on a busy machine


def stub_app(problems, bodies: list[dict]) -> FastAPI:
    index = {p.question: i for i, p in enumerate(problems)}
    app = FastAPI()

    @app.get("/v1/models")
    async def models():
        return {"object": "list", "data": [{"id": "stub-model", "object": "model"}]}

    async def answer(request: Request, chat: bool):
        body = await request.json()
        bodies.append({**body, "authorization": request.headers.get("authorization")})
        if not (body.get("stream") and body.get("stream_options", {}).get("include_usage")):
            return JSONResponse({"error": {"message": "stream with usage expected"}}, 400)
        question = body["messages"][-1]["content"] if chat else body["prompt"]
        i = index[question]
        if i == REJECTED:
            error = {"message": "queue full", "type": "rate_limit_exceeded", "code": 429}
            return JSONResponse({"error": error}, 429, headers={"Retry-After": "1"})
        value = problems[i].answer + (1 if i in WRONG else 0)
        deltas = ["Counting up.", "\n#### ", str(value)]
        pause = SLOW_SECONDS / 3 if i == SLOW else 0.01

        def chunk(text: str | None, usage=None) -> str:
            choices = [] if usage else [{"index": 0, "finish_reason": None}]
            if choices and chat:
                choices[0]["delta"] = {"content": text} if text else {"role": "assistant"}
            elif choices:
                choices[0]["text"] = text or ""
            return f"data: {json.dumps({'id': f'x{i}', 'choices': choices, 'usage': usage})}\n\n"

        async def events():
            yield chunk(None)  # no text yet: must not count as the first text
            await asyncio.sleep(FIRST_TEXT_DELAY)
            for delta in deltas:
                yield chunk(delta)
                await asyncio.sleep(pause)
            usage = {"prompt_tokens": 20, "completion_tokens": 32, "total_tokens": 52}
            yield chunk(None, usage)
            yield "data: [DONE]\n\n"

        return StreamingResponse(events(), media_type="text/event-stream")

    @app.post("/v1/chat/completions")
    async def chat(request: Request):
        return await answer(request, chat=True)

    @app.post("/v1/completions")
    async def completions(request: Request):
        return await answer(request, chat=False)

    return app


@pytest.fixture(scope="module")
def server():
    """(base URL, request bodies seen) of the stub, served by uvicorn on a free port."""
    problems = bench_problems(len(TRACE_TIMES), SEED)
    bodies: list[dict] = []
    config = uvicorn.Config(stub_app(problems, bodies), host="127.0.0.1", port=0, log_level="error")
    srv = uvicorn.Server(config)
    thread = threading.Thread(target=srv.run, daemon=True)
    thread.start()
    deadline = time.monotonic() + HANG_GUARD_S
    while not srv.started:
        assert thread.is_alive() and time.monotonic() < deadline, "stub server did not start"
        time.sleep(0.01)
    port = srv.servers[0].sockets[0].getsockname()[1]
    yield f"http://127.0.0.1:{port}", bodies
    srv.should_exit = True
    thread.join(timeout=5)


@pytest.fixture
def trace_csv(tmp_path):
    path = tmp_path / "trace.csv"
    rows = [f"{t},20,32" for t in TRACE_TIMES]
    path.write_text("arrival_time,prompt_tokens,output_tokens\n" + "\n".join(rows) + "\n")
    return str(path)


@pytest.mark.parametrize("endpoint", ["chat", "completions"])
def test_bench_against_stub(server, trace_csv, tmp_path, endpoint):
    url, bodies = server
    bodies.clear()
    spec = BenchSpec(
        url=url,
        trace=trace_csv,
        rate_scale=RATE_SCALE,
        slo_ms=SLO_MS,
        endpoint=endpoint,
        seed=SEED,
        timeout=HANG_GUARD_S,
        extra={"threshold": 0.9},
        api_key="sekret",
    )
    records, summary = run_bench(spec)

    n = len(TRACE_TIMES)
    assert [r["request_id"] for r in records] == [f"r{i}" for i in range(n)]
    assert [r["arrival"] for r in records] == pytest.approx([t / RATE_SCALE for t in TRACE_TIMES])
    sent = [r["sent"] for r in records]
    assert sent == sorted(sent)
    assert all(r["sent"] >= r["arrival"] for r in records)
    # Open loop: the slow request does not hold back the ones scheduled after it (each is
    # sent while it still runs; no bound on the send lag, which a loaded machine stretches)
    slow_end = records[SLOW]["sent"] + records[SLOW]["latency"]
    assert all(r["sent"] < slow_end for r in records[SLOW + 1 :])
    assert summary["send_lag_max"] == round(max(r["sent"] - r["arrival"] for r in records), 6)
    assert len(bodies) == n
    assert {b["model"] for b in bodies} == {"stub-model"}
    assert all(b["threshold"] == 0.9 and b["slo_ms"] == SLO_MS for b in bodies)
    assert {b["authorization"] for b in bodies} == {"Bearer sekret"}

    for i, r in enumerate(records):
        if i == REJECTED:
            assert (r["status"], r["correct"], r["met_slo"]) == (429, False, False)
            assert "queue full" in r["error"] and "Retry-After 1" in r["error"]
            assert math.isnan(r["latency"]) and math.isnan(r["ttft"])
            continue
        assert (r["status"], r["error"], r["completion_tokens"]) == (200, "", 32)
        assert FIRST_TEXT_DELAY - TIMER_SLACK <= r["ttft"] <= r["latency"]
        assert r["correct"] == (i not in WRONG)
        assert r["met_slo"] == (r["latency"] * 1000 <= SLO_MS)  # (a busy machine may miss it)
        assert r["text"].endswith(f"#### {bench_problems(n, SEED)[i].answer + (i in WRONG)}")

    assert summary["requests"] == n and summary["ok"] == n - 1
    assert summary["errors"] == {"429": 1}
    assert summary["accuracy"] == round((n - len(WRONG) - 1) / n, 4)  # the refused one wrong
    assert summary["accuracy_answered"] == round((n - len(WRONG) - 1) / (n - 1), 4)
    assert not records[SLOW]["met_slo"]
    assert summary["slo_attainment"] == round(sum(r["met_slo"] for r in records) / n, 4)
    assert summary["ttft_p50"] <= summary["latency_p50"] <= summary["latency_p99"]

    assert_run_folder(write_bench_run(records, summary, spec, tmp_path / "runs"), endpoint)


def assert_run_folder(folder, endpoint: str) -> None:
    """`dilaserve bench`'s run folder: its files, the plot linked, no key saved."""
    assert sorted(p.name for p in folder.iterdir()) == [
        "bench.png",  # matplotlib is in the dev extra
        "config.json",
        "records.csv",
        "report.md",
        "summary.json",
    ]
    assert "![each request and the latency CDF](bench.png)" in (folder / "report.md").read_text()
    assert json.loads((folder / "config.json").read_text())["bench"]["endpoint"] == endpoint
    assert "sekret" not in (folder / "config.json").read_text()  # a key is never saved
    assert json.loads((folder / "summary.json").read_text())["ok"] == len(TRACE_TIMES) - 1


def test_records_csv_cuts_long_answers(tmp_path):
    spec = BenchSpec(trace="poisson:1:1")
    record = {"request_id": "r0", "status": 200, "error": "", "text": "x" * 1000}
    folder = write_bench_run([record], {"requests": 1}, spec, tmp_path)
    assert ("x" * 200 + "\n") in (folder / "records.csv").read_text()
    assert "x" * 201 not in (folder / "records.csv").read_text()


@pytest.mark.parametrize(
    "field, value",
    [
        ("url", "127.0.0.1:8000"),
        ("endpoint", "embeddings"),
        ("slo_ms", 0),
        ("extra", {"stream": 0}),
    ],
)
def test_spec_names_the_bad_field(field, value):
    with pytest.raises(ValueError, match=field):
        BenchSpec(**{field: value})


def test_cli_bench_parses():
    args = build_parser().parse_args(
        ["bench", "--url", "http://h:1", "--trace", "poisson:2:5", "--threshold", "0.8"]
    )
    assert (args.rate_scale, args.slo_ms, args.endpoint, args.threshold) == (
        1.0,
        1000.0,
        "chat",
        0.8,
    )


def test_the_command_line_never_writes_the_api_key(server, trace_csv, tmp_path, monkeypatch):
    url, _ = server
    out = tmp_path / "runs"
    argv = ["bench", "--url", url, "--trace", trace_csv, "--out", str(out), "--timeout", "10"]
    monkeypatch.setattr(sys, "argv", ["dilaserve", *argv, "--api-key", "sekret"])
    assert main(argv + ["--api-key", "sekret"]) == 2  # refused: any user can read argv (ps)
    monkeypatch.setenv("DILASERVE_API_KEY", "sekret")
    monkeypatch.setattr(sys, "argv", ["dilaserve", *argv])
    assert main(argv) == 0
    (folder,) = out.iterdir()
    assert not any(b"sekret" in p.read_bytes() for p in folder.iterdir())
    key_file = tmp_path / "key"
    key_file.write_text("\n")
    assert main(argv + ["--api-key-file", str(key_file)]) == 2  # an empty key is refused
