"""What the reliability suite reports of its records: percentiles, counts of each status, the
served rate, and the figures of the overload and fault phases. Each record is one request's
dict (`status`, `latency`, ...; see `reliability_load.one`); nothing here sends a request."""

from __future__ import annotations


def percentile(values: list[float], q: float) -> float | None:
    if not values:
        return None
    ordered = sorted(values)
    return round(ordered[min(int(q * len(ordered)), len(ordered) - 1)], 4)


def answer_latencies(records) -> list[float]:
    """Each record's latency from when its head went out (`reliability_load.one`); from the
    call where the client did not say when."""
    return [r.get("answer_latency", r["latency"]) for r in records]


def tally(values) -> dict:
    """How often each value occurs, keyed by the value as a string."""
    counts: dict[str, int] = {}
    for value in values:
        counts[str(value)] = counts.get(str(value), 0) + 1
    return counts


def served_rate(records: list[dict], seconds: float) -> float:
    return round(sum(r["status"] == 200 for r in records) / seconds, 2)


def overload_summary(records: list[dict], seconds: float, capacity: float, slo_ms: float) -> dict:
    refused = [r for r in records if r["status"] == 429]
    served = [r for r in records if r["status"] == 200]
    unanswered = [r for r in records if r["status"] not in (200, 429, 503)]
    first_sent = min((r["sent"] for r in records), default=0.0)
    return {
        "sent": len(records),
        "served": len(served),
        "refused_429": len(refused),
        "refusals_with_retry_after": sum(r["retry_after"] is not None for r in refused),
        "refusal_latency_p50_s": percentile([r["latency"] for r in refused], 0.5),
        "refusal_latency_p99_s": percentile([r["latency"] for r in refused], 0.99),
        # without the first second's (a closed loop's clients all send at once at its start)
        "refusal_latency_p99_after_1s_s": percentile(
            [r["latency"] for r in refused if r["sent"] >= first_sent + 1.0], 0.99
        ),
        # from when each request's head went out: the server's share (and this process's
        # reading of the answer); what came before it was the load client's own wait
        "refusal_answer_p99_s": percentile(answer_latencies(refused), 0.99),
        "refusal_answer_p99_after_1s_s": percentile(
            answer_latencies(r for r in refused if r["sent"] >= first_sent + 1.0), 0.99
        ),
        "refusal_client_wait_p99_s": percentile(
            [r["client_wait"] for r in refused if "client_wait" in r], 0.99
        ),
        "refusal_reasons": {  # each kind: how many, and their latency's p99
            kind: [len(lat), percentile(lat, 0.99)] for kind, lat in by_reason(refused).items()
        },
        "served_within_slo": round(sum(r["within_slo"] for r in served) / max(len(served), 1), 4),
        "served_within_slo_server": round(
            sum(r["server_latency"] * 1000 <= slo_ms for r in served) / max(len(served), 1), 4
        ),
        "served_latency_p50_s": percentile([r["latency"] for r in served], 0.5),
        "served_latency_p99_s": percentile([r["latency"] for r in served], 0.99),
        "without_answer": len(unanswered),
        "without_answer_kinds": tally(r["status"] for r in unanswered),
        "served_per_s": served_rate(records, seconds),
        "capacity_per_s": capacity,
    }


def fault_summary(records: list[dict], health: list, at: float, fault_at: float) -> dict:
    """`at`: the fault's time on the health watch's clock; `fault_at`: on the records' clock. A
    429 after the fault is a failure (the server refused work it had room for: issue 38)."""
    failed = [
        r for r in records if r["status"] != 200 and (r["status"] != 429 or r["sent"] >= fault_at)
    ]
    not_ok = [t for t, status in health if t >= at and status != "ok"]
    back = next((t for t, status in health if t > (max(not_ok) if not_ok else at) and
                 status == "ok"), None)  # fmt: skip
    refused = [r for r in failed if r["status"] == 429]
    return {
        "sent": len(records),
        "served": sum(r["status"] == 200 for r in records),
        "failed": len(failed),
        "failed_statuses": tally(r["status"] for r in failed),
        "refused_s_after_fault": tally(int(r["sent"] - fault_at) for r in refused),
        "refusal_reasons": tally(reason_kind(r.get("message", "")) for r in refused),
        "longest_wait_s": round(max((r["latency"] for r in records), default=0.0), 3),
        "health_not_ok_s": [min(not_ok), max(not_ok)] if not_ok else None,
        "health_ok_again_at_s": back,
    }


def by_reason(refused: list[dict]) -> dict[str, list[float]]:
    """The refusals' latencies by the kind of their message (`reason_kind`)."""
    kinds: dict[str, list[float]] = {}
    for r in refused:
        kinds.setdefault(reason_kind(r.get("message", "")), []).append(r["latency"])
    return kinds


def reason_kind(message: str) -> str:
    """A refusal's message without its figures (so that alike refusals are counted together)."""
    return "".join("#" if c.isdigit() else c for c in message).replace("#.#", "#")[:90]
