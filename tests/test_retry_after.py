"""A 429's retry advice (`guards.retry_headers`): Retry-After, and `retry-after-ms` jittered
around it, which OpenAI's clients read first, so that clients refused together do not all come
back together."""

from types import SimpleNamespace

import httpx
import openai

from dilaserve.server.guards import RETRY_JITTER, EarlyRefusals, retry_headers


def test_retry_after_ms_is_jittered_around_retry_after():
    advice = [retry_headers(2) for _ in range(200)]
    assert all(a["retry-after"] == "2" for a in advice)
    millis = [int(a["retry-after-ms"]) for a in advice]
    low, high = (2000 * f for f in RETRY_JITTER)
    assert all(low <= m <= high for m in millis)
    assert max(millis) - min(millis) > (high - low) / 2  # spread, not one value


def test_the_fronts_429_carries_both_headers():
    cluster = SimpleNamespace(accepting=True, is_full=lambda *asks: True)
    refusals = EarlyRefusals(cluster, retry_after=1)
    answers = [_parsed(refusals.answer(b"{}")) for _ in range(20)]
    assert all(status == 429 and h["retry-after"] == "1" for status, h in answers)
    millis = {int(h["retry-after-ms"]) for _, h in answers}
    assert len(millis) > 1 and all(500 <= m <= 1500 for m in millis)


def _parsed(answer: bytes) -> tuple[int, dict[str, str]]:
    """(status, headers) of a whole HTTP answer."""
    head = answer.split(b"\r\n\r\n", 1)[0].decode().split("\r\n")
    fields = dict(line.split(": ", 1) for line in head[1:])
    return int(head[0].split()[1]), fields


def test_openais_client_waits_what_retry_after_ms_says():
    client = openai.OpenAI(api_key="x", base_url="http://127.0.0.1:1/v1")
    headers = httpx.Headers(retry_headers(1))
    wait = client._parse_retry_after_header(headers)  # (what its retry loop waits)
    assert wait == int(headers["retry-after-ms"]) / 1000
