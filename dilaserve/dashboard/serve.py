"""`dilaserve dashboard RUN`: the package's page and one run folder's data, over HTTP.

It serves four files and nothing else: the shared page (at `/` and `/dashboard.html`), its CSS
and JavaScript from `static/`, and the run's `dashboard-data.js`, read again at each request.
It listens on 127.0.0.1 only: the run's folder is not listed, nor any other file in it.
"""

from __future__ import annotations

import logging
from http import HTTPStatus
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from urllib.parse import urlsplit

from dilaserve.dashboard.page import DATA_FILE, asset, read_data

log = logging.getLogger("dilaserve.dashboard")

HOST = "127.0.0.1"
_ASSETS = {  # path -> (file in static/, content type)
    "/": ("dashboard.html", "text/html"),
    "/dashboard.html": ("dashboard.html", "text/html"),
    "/dashboard.css": ("dashboard.css", "text/css"),
    "/dashboard.js": ("dashboard.js", "text/javascript"),
}


class _Handler(BaseHTTPRequestHandler):
    server: RunServer

    def do_GET(self) -> None:  # noqa: N802 (http.server's name)
        path, data = urlsplit(self.path).path, self.server.run_folder / DATA_FILE
        if path == f"/{DATA_FILE}" and data.is_file():
            self._send(HTTPStatus.OK, "text/javascript", data.read_bytes())
        elif path in _ASSETS:
            name, kind = _ASSETS[path]
            self._send(HTTPStatus.OK, kind, asset(name).encode())
        else:
            self._send(HTTPStatus.NOT_FOUND, "text/plain", f"no {path} here\n".encode())

    def _send(self, status: HTTPStatus, kind: str, body: bytes) -> None:
        self.send_response(status)
        self.send_header("Content-Type", f"{kind}; charset=utf-8")
        self.send_header("Content-Length", str(len(body)))
        self.send_header("Cache-Control", "no-store")
        self.end_headers()
        self.wfile.write(body)

    def log_message(self, format, *args) -> None:  # noqa: A002 (http.server's name)
        log.debug(format, *args)  # not on stderr: the command prints its URL, nothing per request


class RunServer(ThreadingHTTPServer):
    def __init__(self, run_folder: Path, port: int):
        self.run_folder = run_folder
        super().__init__((HOST, port), _Handler)

    @property
    def url(self) -> str:
        return f"http://{HOST}:{self.server_address[1]}/"


def create_server(run_folder: str | Path, port: int = 0) -> RunServer:
    """A server (bound, not yet serving) of `run_folder`'s dashboard on 127.0.0.1:`port` (0:
    any free port; `url` says which)."""
    if not 0 <= port <= 65535:
        raise ValueError(f"{port=} must be a TCP port, 0 to 65535 (0: any free one)")
    read_data(run_folder)  # a clear error now rather than an empty page later
    try:
        return RunServer(Path(run_folder), port)
    except OSError as err:
        raise OSError(f"cannot listen on {HOST}:{port}: {err} (port 0: any free one)") from None
