"""Reliability suite (issue 22): `dilaserve serve` under hostile bodies, overload and faults.

    python benchmarks/reliability.py [--fuzz 1500] [--overload-seconds 60] [--slo-ms 2000]
                                     [--slo-headroom 1.0]

Starts `dilaserve serve` (the bundled model, two TP-1 instances, on 127.0.0.1 only) in a
process group of its own and runs these phases, each bounded in time:

1. fuzz: `--fuzz` hostile bodies (wrong types, values at and past every bound, NaN, lone
   surrogates, broken JSON, deep nesting, bodies over the size limit, prompts past the
   context), 16 at a time. Every answer must be a completion or an error in OpenAI's shape, and
   never a 5xx; afterwards a normal request is served and nothing is left in flight. Then
   /health is timed while 8 clients send the largest bodies the server reads and long prompts.
2. capacity: a closed loop of 32 clients for `--capacity-seconds`: requests served per second
   at saturation (the capacity).
3. overload: Poisson arrivals at 3x that capacity for `--overload-seconds`: how fast refusals
   come (429 with Retry-After), the share of admitted requests within their SLO, requests left
   without an answer, and the served rate against the capacity.
4. kill -9 of a worker under load (half the capacity): requests that failed, and how long
   until /health says "ok" again.
5. SIGSTOP of a worker under load: the longest wait of a request, and requests that failed
   (the instance is taken for hung after the step timeout the latency profile gives).
6. SIGTERM to the server's whole process group under streaming load (what systemd and
   `timeout` send): answers after the signal (503 with Retry-After, or refused connections),
   streams that ended with `[DONE]`, and the time to exit.

The load comes from `lean_http.Pool`, a lean HTTP client: httpx's own CPU time, on the cores the
server uses, was counted as the server's latency at these rates.

Writes benchmarks/results/reliability-TIMESTAMP/: config.json, summary.json (every figure),
server.log (without its access lines) and report.md. Latency figures depend on the machine's
load: the report says what else ran (the load average at start and end).
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import random
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

import httpx
from lean_http import NoAnswer, Pool

from dilaserve.runs import create_run_dir, environment, write_json

ROOT = Path(__file__).resolve().parent
MODEL = "tiny-llada"
PROMPT = "Tom has 12 stamps. Tom gives away 5. How many stamps does Tom have now?"
OPENAI_ERROR_KEYS = {"message", "type", "param", "code"}


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def start_server(port: int, slo_ms: float, log: Path, headroom: float = 1.0) -> subprocess.Popen:
    command = [sys.executable, "-m", "dilaserve.cli", "serve", "--port", str(port)]
    command += ["--slo", str(slo_ms / 1000), "--drain-timeout", "5", "--log-interval", "0"]
    command += ["--slo-headroom", str(headroom)]
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    out = log.open("w")
    server = subprocess.Popen(command, env=env, stdout=out, stderr=out, start_new_session=True)
    deadline = time.monotonic() + 300
    while time.monotonic() < deadline:
        try:
            if httpx.get(f"http://127.0.0.1:{port}/health", timeout=2).status_code == 200:
                return server
        except httpx.HTTPError:
            time.sleep(0.5)
    os.killpg(server.pid, signal.SIGKILL)
    raise RuntimeError(f"the server did not come up; see {log}")


def worker_pids(server_pid: int) -> list[int]:
    """The server's worker processes (children running dilaserve.cluster.worker)."""
    pids = []
    for entry in Path("/proc").iterdir():
        try:
            stat = (entry / "stat").read_text().rsplit(")", 1)[1].split()
            command = (entry / "cmdline").read_bytes()
        except (OSError, IndexError):
            continue
        if int(stat[1]) == server_pid and b"dilaserve.cluster.worker" in command:
            pids.append(int(entry.name))
    return sorted(pids)


def percentile(values: list[float], q: float) -> float | None:
    if not values:
        return None
    ordered = sorted(values)
    return round(ordered[min(int(q * len(ordered)), len(ordered) - 1)], 4)


# -- 1. fuzz -------------------------------------------------------------------------------


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


async def fuzz(url: str, count: int, seed: int, deadline: float) -> dict:
    rng = random.Random(seed)
    bodies = [hostile_body(rng) for _ in range(count)]
    statuses: dict[str, int] = {}
    bad: list[str] = []
    queue: asyncio.Queue = asyncio.Queue()
    for item in bodies:
        queue.put_nowait(item)

    async def client():
        async with httpx.AsyncClient(base_url=url, timeout=60) as http:
            while not queue.empty() and time.monotonic() < deadline:
                path, raw, headers = queue.get_nowait()
                try:
                    r = await http.post(path, content=raw, headers=headers)
                except httpx.HTTPError as e:
                    statuses["no answer"] = statuses.get("no answer", 0) + 1
                    bad.append(f"{path} {raw[:80]!r}: {type(e).__name__}")
                    continue
                statuses[str(r.status_code)] = statuses.get(str(r.status_code), 0) + 1
                if r.status_code >= 500 or not is_openai_answer(r.status_code, r.content):
                    bad.append(f"{path} {raw[:80]!r}: {r.status_code} {r.text[:120]!r}")

    await asyncio.gather(*(client() for _ in range(16)))
    sent = sum(statuses.values())
    return {"bodies": sent, "statuses": statuses, "bad": len(bad), "bad_examples": bad[:10]}


async def health_under_large_bodies(url: str, seconds: float) -> dict:
    """/health polled every 20 ms while 8 clients send the largest bodies the server reads
    (just under its 1 MiB limit, a prompt past the context) and long prompts it admits."""
    huge = json.dumps({"model": MODEL, "prompt": "7" * ((1 << 20) - 100)}).encode()
    long = json.dumps({"model": MODEL, "prompt": "7 " * 200, "max_tokens": 32}).encode()
    end, waits, statuses = time.monotonic() + seconds, [], {}

    async def sender(body: bytes):
        async with httpx.AsyncClient(base_url=url, timeout=60) as http:
            while time.monotonic() < end:
                r = await http.post("/v1/completions", content=body,
                                    headers={"content-type": "application/json"})  # fmt: skip
                statuses[str(r.status_code)] = statuses.get(str(r.status_code), 0) + 1

    async def poller():
        async with httpx.AsyncClient(base_url=url, timeout=60) as http:
            while time.monotonic() < end:
                start = time.perf_counter()
                await http.get("/health")
                waits.append(time.perf_counter() - start)
                await asyncio.sleep(0.02)

    await asyncio.gather(poller(), *(sender(b) for b in [huge] * 4 + [long] * 4))
    return {
        "seconds": seconds,
        "large_requests": statuses,
        "health_polls": len(waits),
        "health_p50_s": percentile(waits, 0.5),
        "health_p99_s": percentile(waits, 0.99),
        "health_max_s": round(max(waits), 4),
    }


# -- load: one request, and loops of them --------------------------------------------------


async def one(pool: Pool, slo_ms: float) -> dict:
    """One completion over the lean client (`lean_http`: httpx's own CPU time, on the 2 cores
    the server uses, would be measured as the server's latency at these rates)."""
    start = time.perf_counter()
    record = {"sent": start}
    try:
        answer = await pool.post("/v1/completions", completion_body(slo_ms))
        record["status"], record["retry_after"] = answer.status, answer.headers.get("retry-after")
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


async def closed_loop(url: str, clients: int, seconds: float, slo_ms: float) -> list[dict]:
    records: list[dict] = []
    end = time.monotonic() + seconds
    pool = pool_for(url)

    async def client():
        while time.monotonic() < end:
            record = await one(pool, slo_ms)
            records.append(record)
            if record["status"] != 200:
                await asyncio.sleep(0.05)

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


def served_rate(records: list[dict], seconds: float) -> float:
    return round(sum(r["status"] == 200 for r in records) / seconds, 2)


def overload_summary(records: list[dict], seconds: float, capacity: float, slo_ms: float) -> dict:
    refused = [r for r in records if r["status"] == 429]
    served = [r for r in records if r["status"] == 200]
    unanswered = [r for r in records if r["status"] not in (200, 429, 503)]
    return {
        "sent": len(records),
        "served": len(served),
        "refused_429": len(refused),
        "refusals_with_retry_after": sum(r["retry_after"] is not None for r in refused),
        "refusal_latency_p50_s": percentile([r["latency"] for r in refused], 0.5),
        "refusal_latency_p99_s": percentile([r["latency"] for r in refused], 0.99),
        "served_within_slo": round(sum(r["within_slo"] for r in served) / max(len(served), 1), 4),
        "served_within_slo_server": round(
            sum(r["server_latency"] * 1000 <= slo_ms for r in served) / max(len(served), 1), 4
        ),
        "served_latency_p50_s": percentile([r["latency"] for r in served], 0.5),
        "served_latency_p99_s": percentile([r["latency"] for r in served], 0.99),
        "without_answer": len(unanswered),
        "without_answer_kinds": _count(r["status"] for r in unanswered),
        "served_per_s": served_rate(records, seconds),
        "capacity_per_s": capacity,
    }


# -- faults ---------------------------------------------------------------------------------


async def health_watch(url: str, t0: float, until: float, seen: list) -> None:
    """Record (seconds since t0, /health status) every 0.2 s."""
    async with httpx.AsyncClient(base_url=url, timeout=5) as http:
        while time.monotonic() < until:
            try:
                r = await http.get("/health")
                seen.append((round(time.monotonic() - t0, 2), r.json()["status"]))
            except (httpx.HTTPError, ValueError):
                seen.append((round(time.monotonic() - t0, 2), "no answer"))
            await asyncio.sleep(0.2)


async def overload_phase(url: str, rate: float, capacity: float, args) -> dict:
    """Poisson arrivals at `rate` for `--overload-seconds`, with the server's measured step
    slowdown watched alongside."""
    slowdowns: list[float] = []
    seconds = args.overload_seconds
    records, _ = await asyncio.gather(
        open_loop(url, rate, seconds, args.slo_ms, args.seed),
        slowdown_watch(url, time.monotonic() + seconds, slowdowns),
    )
    summary = {"rate_per_s": round(rate, 2), "seconds": seconds}
    summary |= overload_summary(records, seconds, capacity, args.slo_ms)
    summary["step_slowdown"] = {
        "min": min(slowdowns, default=None),
        "median": percentile(slowdowns, 0.5),
        "max": max(slowdowns, default=None),
    }
    return summary


async def slowdown_watch(url: str, until: float, seen: list) -> None:
    """Record the server's measured step slowdown (`/metrics`) every second."""
    async with httpx.AsyncClient(base_url=url, timeout=5) as http:
        while time.monotonic() < until:
            await asyncio.sleep(1.0)
            try:
                text = (await http.get("/metrics")).text
            except httpx.HTTPError:
                continue
            for line in text.splitlines():
                if line.startswith("dilaserve_step_slowdown "):
                    seen.append(float(line.split()[1]))


def fault_summary(records: list[dict], health: list, at: float) -> dict:
    after = [r for r in records if r["status"] != 429]
    failed = [r for r in after if r["status"] != 200]
    not_ok = [t for t, status in health if t >= at and status != "ok"]
    back = next((t for t, status in health if t > (max(not_ok) if not_ok else at) and
                 status == "ok"), None)  # fmt: skip
    return {
        "sent": len(records),
        "served": sum(r["status"] == 200 for r in records),
        "failed": len(failed),
        "failed_statuses": sorted({str(r["status"]) for r in failed}),
        "longest_wait_s": round(max((r["latency"] for r in records), default=0.0), 3),
        "health_not_ok_s": [min(not_ok), max(not_ok)] if not_ok else None,
        "health_ok_again_at_s": back,
    }


async def kill_phase(url: str, server: subprocess.Popen, rate: float, slo_ms: float, how: str):
    pid = worker_pids(server.pid)[0]
    seen: list = []
    hold = 30.0 if how == "stop" else 0.0

    async def fault(t0):
        watch = asyncio.ensure_future(health_watch(url, t0, t0 + 35 + hold, seen))
        await asyncio.sleep(3.0)
        os.kill(pid, signal.SIGKILL if how == "kill" else signal.SIGSTOP)
        await asyncio.sleep(hold)
        if how == "stop":
            try:
                os.kill(pid, signal.SIGCONT)  # (the server has killed it for hung by now)
            except ProcessLookupError:
                pass
        await watch

    records = await open_loop(url, rate, 15.0 + hold, slo_ms, seed=5, during=fault)
    return fault_summary(records, seen, 3.0) | {"worker": pid}


async def term_phase(url: str, server: subprocess.Popen, rate: float, slo_ms: float) -> dict:
    signalled: dict = {}

    async def fault(t0):
        await asyncio.sleep(3.0)
        signalled["at"] = time.perf_counter()
        os.killpg(server.pid, signal.SIGTERM)
        while server.poll() is None and time.perf_counter() - signalled["at"] < 60:
            await asyncio.sleep(0.05)
        signalled["exit_s"] = round(time.perf_counter() - signalled["at"], 2)

    records = await open_loop(url, rate, 12.0, slo_ms, seed=6, during=fault)
    after = [r for r in records if r["sent"] >= signalled["at"]]
    exited_at = signalled["at"] + signalled["exit_s"]
    during = [r for r in after if r["sent"] < exited_at]
    return {
        "exit_s": signalled["exit_s"],
        "exit_code": server.returncode,
        "sent_while_draining": len(during),
        "draining_answers": _count(r["status"] for r in during),
        "draining_503_with_retry_after": sum(
            r["status"] == 503 and r.get("retry_after") is not None for r in during
        ),
        "in_flight_at_signal": _count(
            r["status"] for r in records if r["sent"] < signalled["at"] <= r["sent"] + r["latency"]
        ),
        "errors_in_openai_shape": all(
            r.get("openai_shape", True) for r in records if isinstance(r["status"], int)
        ),  # fmt: skip
    }


def _count(values) -> dict:
    counts: dict[str, int] = {}
    for value in values:
        counts[str(value)] = counts.get(str(value), 0) + 1
    return counts


async def stream_one(http: httpx.AsyncClient, slo_ms: float) -> dict:
    body = {"model": MODEL, "prompt": PROMPT, "max_tokens": 32, "slo_ms": slo_ms, "stream": True}
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


async def term_streams(url: str, server, slo_ms: float) -> dict:
    """SIGTERM while streams run: each must end with [DONE]."""
    async with httpx.AsyncClient(base_url=url, timeout=60) as http:
        tasks = [asyncio.ensure_future(stream_one(http, slo_ms)) for _ in range(8)]
        await asyncio.sleep(0.3)
        os.killpg(server.pid, signal.SIGTERM)
        records = await asyncio.gather(*tasks)
    server.wait(60)
    return {
        "streams": len(records),
        "ended_with_done": sum(bool(r.get("done")) for r in records),
        "with_error_event": sum(bool(r.get("error_event")) for r in records),
        "statuses": _count(r["status"] for r in records),
    }


# -- the run ---------------------------------------------------------------------------------


def load_average() -> list[float]:
    return [round(x, 2) for x in os.getloadavg()]


async def run(args, folder: Path) -> dict:
    port = free_port()
    url = f"http://127.0.0.1:{port}"
    summary: dict = {"load_average_start": load_average(), "cpus": os.cpu_count()}
    server = start_server(port, args.slo_ms, folder / "server.log", args.slo_headroom)
    try:
        t = time.monotonic()
        summary["fuzz"] = await fuzz(url, args.fuzz, args.seed, t + args.fuzz_seconds)
        summary["fuzz"]["seconds"] = round(time.monotonic() - t, 1)
        health = httpx.get(f"{url}/health", timeout=10).json()
        pool = pool_for(url)
        served = await one(pool, args.slo_ms)
        await pool.close()
        summary["after_fuzz"] = {"health": health["status"], "in_flight": health["in_flight"],
                                 "normal_request": served["status"]}  # fmt: skip
        print("fuzz:", summary["fuzz"], summary["after_fuzz"], flush=True)
        summary["large_bodies"] = await health_under_large_bodies(url, 15.0)
        print("/health under large bodies:", summary["large_bodies"], flush=True)

        records = await closed_loop(url, 32, args.capacity_seconds, args.slo_ms)
        capacity = served_rate(records, args.capacity_seconds)
        summary["capacity"] = {"clients": 32, "seconds": args.capacity_seconds,
                               "served_per_s": capacity}  # fmt: skip
        print("capacity:", summary["capacity"], flush=True)

        summary["overload"] = await overload_phase(url, 3 * capacity, capacity, args)
        print("overload:", summary["overload"], flush=True)

        await asyncio.sleep(3)
        summary["kill_9"] = await kill_phase(url, server, capacity / 2, args.slo_ms, "kill")
        print("kill -9:", summary["kill_9"], flush=True)
        summary["sigstop"] = await kill_phase(url, server, capacity / 2, args.slo_ms, "stop")
        print("SIGSTOP:", summary["sigstop"], flush=True)
        summary["sigterm"] = await term_phase(url, server, capacity / 2, args.slo_ms)
        print("SIGTERM:", summary["sigterm"], flush=True)

        port = free_port()
        url = f"http://127.0.0.1:{port}"
        server = start_server(port, args.slo_ms, folder / "server-2.log", args.slo_headroom)
        summary["sigterm_streams"] = await term_streams(url, server, args.slo_ms)
        print("SIGTERM, streams:", summary["sigterm_streams"], flush=True)
    finally:
        if server.poll() is None:
            os.killpg(server.pid, signal.SIGKILL)
    summary["load_average_end"] = load_average()
    for log in folder.glob("server*.log"):
        drop_access_lines(log)
    return summary


def drop_access_lines(log: Path) -> None:
    """Keep the server's own log lines, not one access line per request."""
    lines = log.read_text().splitlines(keepends=True)
    log.write_text("".join(line for line in lines if ' HTTP/1.1" ' not in line))


def report(summary: dict, args) -> str:
    o, f = summary["overload"], summary["fuzz"]
    lines = [
        "# Reliability suite",
        "",
        f"Command: `python benchmarks/reliability.py --fuzz {args.fuzz} --overload-seconds "
        f"{args.overload_seconds} --slo-ms {args.slo_ms} --slo-headroom {args.slo_headroom}`; "
        f"load average "
        f"{summary['load_average_start']} at start, {summary['load_average_end']} at end "
        f"({summary['cpus']} CPUs).",
        "",
        f"- fuzz: {f['bodies']} hostile bodies, statuses {f['statuses']}; answers not in OpenAI's "
        f"shape or 5xx: {f['bad']}; after: {summary['after_fuzz']}",
        f"- /health under the largest bodies: {summary['large_bodies']}",
        f"- capacity: {summary['capacity']['served_per_s']} requests/s served (32 clients)",
        f"- overload at {o['rate_per_s']}/s for {o['seconds']} s: {o['refused_429']} refused "
        f"(p50 {o['refusal_latency_p50_s']} s, p99 {o['refusal_latency_p99_s']} s; "
        f"{o['refusals_with_retry_after']} with Retry-After), {o['served']} served "
        f"({o['served_within_slo']:.1%} within SLO as the client counts, "
        f"{o['served_within_slo_server']:.1%} as the server does), "
        f"{o['without_answer']} without an answer, "
        f"{o['served_per_s']}/s served vs {o['capacity_per_s']}/s at capacity",
        f"- kill -9 of a worker: {summary['kill_9']}",
        f"- SIGSTOP of a worker (30 s): {summary['sigstop']}",
        f"- SIGTERM to the process group under load: {summary['sigterm']}",
        f"- SIGTERM with 8 streams open: {summary['sigterm_streams']}",
    ]
    return "\n".join(lines) + "\n"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--fuzz", type=int, default=1500, help="hostile bodies")
    parser.add_argument("--fuzz-seconds", type=float, default=300, help="the fuzz's time bound")
    parser.add_argument("--capacity-seconds", type=float, default=20)
    parser.add_argument("--overload-seconds", type=float, default=60)
    parser.add_argument("--slo-ms", type=float, default=2000)
    parser.add_argument(
        "--slo-headroom",
        type=float,
        default=1.0,
        help="serve's --slo-headroom (1.0: the paper's threshold selection)",
    )
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--out", default=str(ROOT / "results"))
    args = parser.parse_args()
    folder = create_run_dir(args.out, "reliability")
    write_json(folder / "config.json", {"args": vars(args), "environment": environment()})
    summary = asyncio.run(run(args, folder))
    write_json(folder / "summary.json", summary)
    (folder / "report.md").write_text(report(summary, args))
    print(f"run folder: {folder}")


if __name__ == "__main__":
    main()
