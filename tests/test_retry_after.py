"""A 429's retry advice (`guards.retry_headers`): Retry-After, and `retry-after-ms` jittered
around it, which OpenAI's clients read first, so that clients refused together do not all come
back together."""

import asyncio
from types import SimpleNamespace

import httpx
import openai

from dilaserve.server.guards import RETRY_JITTER, Guards, retry_headers


async def _api(scope, receive, send):
    await send({"type": "http.response.start", "status": 204, "headers": []})
    await send({"type": "http.response.body", "body": b""})


def test_retry_after_ms_is_jittered_around_retry_after():
    advice = [retry_headers(2) for _ in range(200)]
    assert all(a["retry-after"] == "2" for a in advice)
    millis = [int(a["retry-after-ms"]) for a in advice]
    low, high = (2000 * f for f in RETRY_JITTER)
    assert all(low <= m <= high for m in millis)
    assert max(millis) - min(millis) > (high - low) / 2  # spread, not one value


def test_the_fronts_429_carries_both_headers():
    cluster = SimpleNamespace(accepting=True, is_full=lambda *asks: True)
    guards = Guards(_api, 1 << 20, cluster=cluster, retry_after=1)

    async def refused():
        transport = httpx.ASGITransport(app=guards)
        async with httpx.AsyncClient(transport=transport, base_url="http://x") as client:
            return [(await client.post("/v1/completions", json={})) for _ in range(20)]

    answers = asyncio.run(refused())
    assert all(r.status_code == 429 and r.headers["retry-after"] == "1" for r in answers)
    millis = {int(r.headers["retry-after-ms"]) for r in answers}
    assert len(millis) > 1 and all(500 <= m <= 1500 for m in millis)


def test_openais_client_waits_what_retry_after_ms_says():
    client = openai.OpenAI(api_key="x", base_url="http://127.0.0.1:1/v1")
    headers = httpx.Headers(retry_headers(1))
    wait = client._parse_retry_after_header(headers)  # (what its retry loop waits)
    assert wait == int(headers["retry-after-ms"]) / 1000
