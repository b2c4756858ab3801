"""The reliability suite's load on the server, over the lean client (`lean_http`): one
completion, closed and open loops of them, and one streamed completion. Each request gives a
record (`status`, `latency`, ...) for `reliability_summaries.py`; what the load is for, and the
faults injected under it, are `reliability_phases.py`'s."""

from __future__ import annotations

import asyncio
import json
import random
import time

import httpx
from lean_http import NoAnswer, Pool
from reliability_inputs import MODEL, PROMPT, is_openai_answer


async def one(pool: Pool, slo_ms: float) -> dict:
    """One completion over the lean client (`lean_http`: httpx's own CPU time, on the 2 cores
    the server uses, would be measured as the server's latency at these rates)."""
    start = time.perf_counter()
    record = {"sent": start}
    try:
        answer = await pool.post("/v1/completions", completion_body(slo_ms))
        record["status"], record["retry_after"] = answer.status, answer.headers.get("retry-after")
        record["connection"] = answer.headers.get("connection")
        record["openai_shape"] = is_openai_answer(answer.status, answer.body)
        if answer.status == 200:  # the latency the server counts, from when it got the request
            record["server_latency"] = answer.json()["dilaserve"]["latency_s"]
    except NoAnswer as e:
        record["status"] = "refused" if "cannot connect" in str(e) else "no answer (closed)"
    except asyncio.TimeoutError:
        record["status"] = "no answer (timeout)"
    record["latency"] = time.perf_counter() - start
    record["within_slo"] = record["status"] == 200 and record["latency"] * 1000 <= slo_ms
    return record


def completion_body(slo_ms: float) -> bytes:
    body = {"model": MODEL, "prompt": PROMPT, "max_tokens": 32, "slo_ms": slo_ms}
    return json.dumps(body).encode()


def pool_for(url: str) -> Pool:
    host, port = url.removeprefix("http://").rsplit(":", 1)
    return Pool(host, int(port), max_connections=2000)


async def closed_loop(
    url: str, clients: int, seconds: float, slo_ms: float, polite: bool = False
) -> list[dict]:
    """`clients` clients, each sending its next request when its last is answered: 50 ms after
    a refusal, or, `polite`, after the refusal's Retry-After (as OpenAI's client waits)."""
    records: list[dict] = []
    end = time.monotonic() + seconds
    pool = pool_for(url)

    async def client():
        while time.monotonic() < end:
            record = await one(pool, slo_ms)
            records.append(record)
            if record["status"] != 200:
                wait = record.get("retry_after") if polite else None
                await asyncio.sleep(float(wait) if wait else 0.05)

    await asyncio.gather(*(client() for _ in range(clients)))
    await pool.close()
    return records


async def open_loop(url: str, rate: float, seconds: float, slo_ms: float, seed: int, during=None):
    """Poisson arrivals at `rate` for `seconds`; `during(t0)` runs alongside (a fault)."""
    rng = random.Random(seed)
    pool = pool_for(url)
    tasks, t0 = [], time.monotonic()
    fault = asyncio.ensure_future(during(t0)) if during else None
    next_at = t0
    while next_at < t0 + seconds:
        await asyncio.sleep(max(0.0, next_at - time.monotonic()))
        tasks.append(asyncio.ensure_future(one(pool, slo_ms)))
        next_at += rng.expovariate(rate)
    records = await asyncio.gather(*tasks)
    if fault is not None:
        await fault
    await pool.close()
    return list(records)


async def stream_one(
    http: httpx.AsyncClient, slo_ms: float, max_tokens: int = 32, prompt: str = PROMPT
) -> dict:
    body = {"model": MODEL, "prompt": prompt, "max_tokens": max_tokens, "slo_ms": slo_ms,
            "stream": True}  # fmt: skip
    try:
        async with http.stream("POST", "/v1/completions", json=body) as r:
            lines = [line async for line in r.aiter_lines() if line.startswith("data: ")]
    except httpx.HTTPError as e:
        return {"status": f"no answer ({type(e).__name__})"}
    return {
        "status": r.status_code,
        "done": bool(lines) and lines[-1].endswith("[DONE]"),
        "error_event": any('"error"' in line for line in lines),
    }
