"""The dashboard as one self-contained HTML document: the page, its CSS and its JavaScript
(`static/`) inlined, plus either where to poll for data (live) or the data itself (a report).
Nothing is fetched from anywhere else."""

from __future__ import annotations

import json
from importlib.resources import files
from pathlib import Path

REFRESH_SECONDS = 2.0  # how often a live page asks for new data


def _asset(name: str) -> str:
    return files("dilaserve.dashboard").joinpath("static", name).read_text(encoding="utf-8")


def _page(config: dict) -> str:
    # JSON is JavaScript; "</" is escaped so that no string in it can close the script element
    literal = json.dumps(config, allow_nan=False).replace("</", "<\\/")
    return (
        _asset("dashboard.html")
        .replace("/*DASHBOARD_CSS*/", _asset("dashboard.css"))
        .replace("/*DASHBOARD_CONFIG*/", f"window.DASHBOARD = {literal};")
        .replace("/*DASHBOARD_JS*/", _asset("dashboard.js"))
    )


def live_page(
    data_url: str, refresh_seconds: float = REFRESH_SECONDS, token: str | None = None
) -> str:
    """The page that polls `data_url` every `refresh_seconds` (sending `token` as a bearer
    token, when given)."""
    config = {"url": data_url, "refresh_ms": int(refresh_seconds * 1000)}
    return _page({**config, "token": token} if token else config)


def static_page(data: dict) -> str:
    """The page with `data` (a `Timeline.to_json`) embedded: a report that needs no server."""
    return _page({"data": data})


def write_report(data: dict, path: str | Path) -> Path:
    path = Path(path)
    path.write_text(static_page(data), encoding="utf-8")
    return path
