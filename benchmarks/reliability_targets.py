"""Issue 38's targets, judged from the reliability suite's summary: each a line of the report
(`target`, what was `measured`, whether it was `met`), and the report itself (`report.md`: the
verdicts, then each phase's figures). Nothing here sends a request."""

from __future__ import annotations

HEALTH_P99_S = 0.1  # /health under hostile clients, and a refusal at 3x capacity
SERVED_SHARE = 0.9  # of the capacity, served while overloaded
WITHIN_SLO = 0.9  # of the admitted requests, within their SLO
HOSTILE_REQUESTS = 1500
HEALTH_PHASES = ("header_flood", "many_message_chats")


def verdicts(summary: dict, args) -> list[dict]:
    """The targets of the phases that ran (`--cases`)."""
    lines = [idle_verdict(i) for i in summary.get("idle_after", [])]
    if "overload" in summary:
        lines += overload_verdicts("3x capacity, open loop", summary["overload"])
    if "closed_loop" in summary:
        clients = f"{args.storm_clients} closed-loop clients"
        lines += overload_verdicts(clients, summary["closed_loop"])
    if "fuzz" in summary:
        lines.append(fuzz_verdict(summary["fuzz"]))
    lines += [health_verdict(n, summary[n]) for n in HEALTH_PHASES if n in summary]
    lines += [fault_verdict(n, summary[n]) for n in ("kill_9", "sigstop") if n in summary]
    if "drain_at_capacity" in summary:
        lines += drain_verdicts(summary["drain_at_capacity"])
    if "streams_past_the_drain" in summary:
        lines.append(streams_verdict(summary["streams_past_the_drain"]))
    return lines


def fault_verdict(name: str, figures: dict) -> dict:
    restored = figures.get("capacity_restored_after_s")
    after = f"; capacity restored after {restored} s" if restored is not None else ""
    return verdict(f"{name}: nothing lost (a 429 after the fault fails)",
                   f"{figures['failed']} failed {figures['failed_statuses']}{after}",
                   figures["failed"] == 0)  # fmt: skip


def verdict(target: str, measured: str, met: bool) -> dict:
    return {"target": target, "measured": measured, "met": bool(met)}


def idle_verdict(idle: dict) -> dict:
    return verdict(
        f"idle after {idle['after']}: 0 of {idle['sent']} refused",
        f"{idle['refused']} refused (slowdown before {idle['slowdown_before']}, "
        f"health {idle['health_before']})",
        idle["refused"] == 0,
    )


def overload_verdicts(name: str, o: dict) -> list[dict]:
    p99 = o.get("refusal_answer_p99_s", o["refusal_latency_p99_s"])
    return [
        verdict(f"{name}: refusals p99 < {HEALTH_P99_S * 1000:.0f} ms (from the request sent)",
                f"{p99} s of {o['refused_429']} (after the first second: "
                f"{o.get('refusal_answer_p99_after_1s_s')} s; from the client's call "
                f"{o['refusal_latency_p99_s']} s, its own wait before sending p99 "
                f"{o.get('refusal_client_wait_p99_s')} s)", p99 is None or p99 < HEALTH_P99_S),
        verdict(f"{name}: served >= {SERVED_SHARE}x capacity",
                f"{o['served_per_s']}/s vs {o['capacity_per_s']}/s",
                o["served_per_s"] >= SERVED_SHARE * o["capacity_per_s"]),
        verdict(f"{name}: >= {WITHIN_SLO:.0%} of admitted within SLO",
                f"{o['served_within_slo']:.1%} (client), {o['served_within_slo_server']:.1%} "
                f"(server) of {o['served']}; {o['without_answer']} unanswered",
                o["served_within_slo"] >= WITHIN_SLO and o["without_answer"] == 0),
    ]  # fmt: skip


def fuzz_verdict(f: dict) -> dict:
    errors = sum(n for status, n in f["statuses"].items() if status.startswith("5"))
    unanswered = sum(n for status, n in f["statuses"].items() if not status.isdigit())
    return verdict(
        f">= {HOSTILE_REQUESTS} hostile requests: 0 5xx, 0 unanswered",
        f"{f['bodies']} sent, {errors} 5xx, {unanswered} unanswered, {f['bad']} not OpenAI's shape",
        f["bodies"] >= HOSTILE_REQUESTS and errors == 0 and unanswered == 0 and f["bad"] == 0,
    )


def health_verdict(name: str, h: dict) -> dict:
    p99 = h["health_p99_s"]
    return verdict(
        f"/health p99 < {HEALTH_P99_S * 1000:.0f} ms during {name.replace('_', ' ')}",
        f"p99 {p99} s of {h['health_polls']} polls ({h['health_failed_polls']} failed), "
        f"server RSS <= {h['server_rss_max_mib']} MiB, answers {h['answers']}",
        p99 is not None and p99 < HEALTH_P99_S and h["health_failed_polls"] == 0,
    )


def drain_verdicts(drain: dict) -> list[dict]:
    """No request sent after the signal (the load's clients all waiting, or the server gone
    before any was sent) is no evidence: not met, saying so."""
    limit = drain["drain_timeout_s"] + 1
    sent = drain["sent_after_signal"]
    measured = f"{drain['answered_503_close_retry']} of {sent} "
    measured += f"(statuses {drain['statuses_after_signal']})" if sent else "(none sent after it)"
    return [
        verdict(
            "drain at capacity: every new request 503 + Retry-After + Connection: close",
            measured,
            sent > 0 and drain["answered_otherwise"] == 0 and drain["unanswered"] == 0,
        ),
        verdict(f"drain at capacity: exit <= {limit:g} s", f"{drain['exit_s']} s",
                drain["exit_s"] <= limit),
    ]  # fmt: skip


def streams_verdict(streams: dict) -> dict:
    limit = streams["drain_timeout_s"] + 1
    done = streams["ended_with_done"]
    return verdict(
        f"streams past the drain: each ends with [DONE], exit <= {limit:g} s",
        f"{done} of {streams['streams']}, exit {streams['exit_s']} s",
        done == streams["streams"] and streams["exit_s"] <= limit,
    )


PHASE_LABELS = {
    "after_fuzz": "after the fuzz",
    "large_bodies": "/health under the largest bodies",
    "header_flood": "/health under header floods",
    "many_message_chats": "/health under many-message chats",
    "capacity": "capacity (the most served by 32 or by 128 closed-loop clients)",
    "closed_loop": "closed loop (waiting as OpenAI's client does)",
    "storm": "storm (50 ms after a refusal)",
    "neighbour": "neighbour",
    "kill_9": "kill -9 of a worker",
    "sigstop": "SIGSTOP of a worker (30 s)",
    "drain_at_capacity": "drain at capacity",
    "streams_past_the_drain": "streams past the drain",
}


def report(summary: dict, args) -> str:
    lines = [
        "# Reliability suite",
        "",
        f"Command: `python benchmarks/reliability.py {' '.join(args.argv)}`; load average "
        f"{summary['load_average_start']} at start, {summary['load_average_end']} at end "
        f"({summary['cpus']} CPUs){'; beside a CPU hog on every core' if args.beside_hog else ''}.",
        "",
        "## Targets (issue 38)",
        "",
        "| target | measured | met |",
        "|---|---|---|",
        *(
            f"| {v['target']} | {v['measured']} | {'yes' if v['met'] else '**no**'} |"
            for v in summary["verdicts"]
        ),  # fmt: skip
        "",
        "## Phases",
        "",
    ]
    if "fuzz" in summary:
        f = summary["fuzz"]
        lines.append(f"- fuzz: {f['bodies']} hostile bodies, statuses {f['statuses']}; answers "
                     f"not in OpenAI's shape or 5xx: {f['bad']}")  # fmt: skip
    if "overload" in summary:
        lines.append(overload_line(summary["overload"]))
    lines += [f"- {label}: {summary[key]}" for key, label in PHASE_LABELS.items() if key in summary]
    lines += [f"- idle after {i['after']}: {i}" for i in summary.get("idle_after", [])]
    return "\n".join(lines) + "\n"


def overload_line(o: dict) -> str:
    return (
        f"- overload at {o['rate_per_s']}/s for {o['seconds']} s: {o['refused_429']} refused "
        f"(p50 {o['refusal_latency_p50_s']} s, p99 {o['refusal_latency_p99_s']} s, "
        f"{o.get('refusal_answer_p99_s')} s from the request sent; "
        f"{o['refusals_with_retry_after']} with Retry-After), {o['served']} served "
        f"({o['served_within_slo']:.1%} within SLO as the client counts, "
        f"{o['served_within_slo_server']:.1%} as the server does), "
        f"{o['without_answer']} without an answer, "
        f"{o['served_per_s']}/s served vs {o['capacity_per_s']}/s at capacity, "
        f"mean step threshold {o.get('mean_threshold')}"
    )
