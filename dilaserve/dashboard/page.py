"""The dashboard page (`static/`), and a run's data for it.

`static/dashboard.html` is one shared page: it links its CSS and JavaScript and loads its data
from `dashboard-data.js` (`window.DASHBOARD = {...};`) beside it. A run folder holds only that
data file (`write_data`); `dilaserve dashboard RUN` serves the page with it (`serve.py`). For
the live server and for sharing, `live_page` and `static_page` inline the CSS, the JavaScript and
the config (where to poll for data, or the data itself) into one document that fetches nothing
else.
"""

from __future__ import annotations

import json
from importlib.resources import files
from pathlib import Path

REFRESH_SECONDS = 2.0  # how often a live page asks for new data
DATA_FILE = "dashboard-data.js"  # a run's data, beside the page
DATA_PREFIX = "window.DASHBOARD = "
# the page's references to its parts, and what a self-contained page puts in their place
_CSS_TAG = '<link rel="stylesheet" href="dashboard.css">'
_DATA_TAG = f'<script src="{DATA_FILE}"></script>'
_JS_TAG = '<script src="dashboard.js"></script>'


def asset(name: str) -> str:
    """The text of `static/<name>`: the page, its CSS or its JavaScript."""
    return files("dilaserve.dashboard").joinpath("static", name).read_text(encoding="utf-8")


def _script(config: dict) -> str:
    """`window.DASHBOARD = <config>;` as JavaScript that no string in it can end early."""
    # JSON is JavaScript; "</" is escaped so that no string in it can close a script element
    literal = json.dumps(config, allow_nan=False).replace("</", "<\\/")
    return f"{DATA_PREFIX}{literal};\n"


def _inline(page: str, tag: str, content: str) -> str:
    if page.count(tag) != 1:
        raise RuntimeError(f"static/dashboard.html must hold {tag!r} once")
    return page.replace(tag, content)


def _page(config: dict) -> str:
    page = asset("dashboard.html")
    page = _inline(page, _CSS_TAG, f"<style>\n{asset('dashboard.css')}</style>")
    page = _inline(page, _DATA_TAG, f"<script>\n{_script(config)}</script>")
    return _inline(page, _JS_TAG, f"<script>\n{asset('dashboard.js')}</script>")


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


def write_data(data: dict, folder: str | Path) -> Path:
    """`folder`/dashboard-data.js: `data` (a `Timeline.to_json`) for the shared page."""
    path = Path(folder) / DATA_FILE
    path.write_text(_script({"data": data}), encoding="utf-8")
    return path


def read_data(folder: str | Path) -> dict:
    """The data a run folder's dashboard-data.js holds (what `write_data` wrote)."""
    path = Path(folder) / DATA_FILE
    if not path.is_file():
        raise FileNotFoundError(
            f"no {DATA_FILE} in {folder}: not a simulated run's folder (an older one holds "
            "dashboard.html, which opens on its own)"
        )
    text = path.read_text(encoding="utf-8").strip()
    if not (text.startswith(DATA_PREFIX) and text.endswith(";")):
        raise ValueError(f"{path} is not `{DATA_PREFIX}{{...}};`")
    try:
        config = json.loads(text[len(DATA_PREFIX) : -1])
    except json.JSONDecodeError as err:
        raise ValueError(f"{path}: its data is not JSON: {err}") from None
    if not isinstance(config, dict) or not isinstance(config.get("data"), dict):
        raise ValueError(f'{path} holds no {{"data": {{...}}}}')
    return config["data"]
