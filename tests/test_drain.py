"""The listener's close at shutdown (`server/listener.py`): new connections are turned away,
connections already in the kernel's accept queue are taken and answered rather than reset, and
the close waits for the requests read to be answered."""

import asyncio
import json
import signal
import socket
import sys
import threading
import time

import pytest
import uvicorn

from dilaserve.server import main
from dilaserve.server.app import ServerSettings
from dilaserve.server.guards import draining_answer
from dilaserve.server.limits import HttpLimits, limited_protocol
from dilaserve.server.listener import (
    accept_queue_length,
    close_listeners,
    refuse_new_connections,
)

from conftest import HANG_GUARD_S, wait_until

pytestmark = pytest.mark.skipif(not sys.platform.startswith("linux"), reason="Linux's sockets")
GET = b"GET /%s HTTP/1.1\r\nHost: 127.0.0.1\r\nConnection: close\r\n\r\n"


def test_the_filter_turns_new_connections_away_and_keeps_those_queued():
    with socket.socket() as listener, socket.socket() as queued, socket.socket() as late:
        listener.bind(("127.0.0.1", 0))
        listener.listen(8)
        queued.connect(listener.getsockname())
        wait_until(lambda: accept_queue_length(listener) == 1)
        assert refuse_new_connections(listener)
        late.settimeout(0.5)
        with pytest.raises(TimeoutError):  # its SYN is dropped: no connection completes
            late.connect(listener.getsockname())
        assert accept_queue_length(listener) == 1
        taken, _ = listener.accept()
        with taken:
            queued.sendall(b"x")
            assert taken.recv(1) == b"x"  # the queued connection works as any other
        assert accept_queue_length(listener) == 0


class _Server(uvicorn.Server):
    """uvicorn in a thread, its event loop kept for the test."""

    def __init__(self, app):
        config = uvicorn.Config(
            app, port=0, lifespan="off", log_level="warning", http=limited_protocol(HttpLimits())
        )
        super().__init__(config)
        self.thread = threading.Thread(target=self.run, daemon=True)
        self.thread.start()
        wait_until(lambda: self.started)

    async def startup(self, sockets=None):
        self.loop = asyncio.get_running_loop()
        await super().startup(sockets)

    @property
    def address(self):
        return self.servers[0].sockets[0].getsockname()

    def close_listeners(self, before=lambda: None, seconds=HANG_GUARD_S):
        """`close_listeners` on the server's loop, after `before()` ran with that loop held;
        then, as uvicorn's shutdown, each connection's `shutdown` (an idle one is closed)."""

        async def held_then_closed():
            before()  # (blocks the loop: nothing is accepted meanwhile)
            connections = self.server_state.connections
            await close_listeners(self.servers, connections, seconds, draining_answer())
            for connection in list(connections):
                connection.shutdown()

        return asyncio.run_coroutine_threadsafe(held_then_closed(), self.loop)

    def stop(self):
        self.should_exit = True
        self.thread.join(HANG_GUARD_S)


async def _app(scope, receive, send):
    await send({"type": "http.response.start", "status": 204, "headers": []})
    await send({"type": "http.response.body", "body": b""})


def _answer(sock: socket.socket) -> bytes:
    sock.settimeout(HANG_GUARD_S)
    parts = []
    try:
        while part := sock.recv(4096):
            parts.append(part)
    except ConnectionResetError:
        parts.append(b"<reset>")
    return b"".join(parts)


def test_requests_queued_in_the_kernel_when_the_listener_closes_are_answered():
    server = _Server(_app)
    address = server.address
    clients = [socket.socket() for _ in range(20)]

    def queue_requests():  # while the loop is held, the kernel queues each connection
        for client in clients:
            client.connect(address)
            client.sendall(GET % b"v1/completions")

    try:
        server.close_listeners(before=queue_requests).result(HANG_GUARD_S)
        answers = [_answer(client) for client in clients]
    finally:
        for client in clients:
            client.close()
        server.stop()
    assert answers == [draining_answer()] * len(clients)  # each answered, none reset
    with socket.socket() as late, pytest.raises(ConnectionRefusedError):
        late.connect(address)  # closed, not left listening


def test_the_close_waits_for_each_request_read_to_be_answered():
    entered, release = threading.Event(), threading.Event()

    async def slow_app(scope, receive, send):
        entered.set()
        while not release.is_set():
            await asyncio.sleep(0.01)
        await send({"type": "http.response.start", "status": 200, "headers": []})
        await send({"type": "http.response.body", "body": b"done"})

    server = _Server(slow_app)
    address = server.address
    with socket.socket() as client:
        client.connect(address)
        client.sendall(GET % b"slow")
        wait_until(entered.is_set)
        closing = server.close_listeners()
        wait_until(lambda: not server.servers[0].is_serving())  # the listener is closed
        assert not closing.done()  # and the close waits for the request in hand
        release.set()
        closing.result(HANG_GUARD_S)
        answer = _answer(client)
        assert answer.startswith(b"HTTP/1.1 200") and b"done" in answer
    server.stop()


def test_the_close_waits_for_the_first_request_of_a_connection_just_opened():
    # beside a CPU hog, clients connected and were slow to send: the close took them for idle
    # and shut them, and each request was lost (the reliability suite's drain)
    server = _Server(_app)
    with socket.socket() as client:
        client.connect(server.address)
        wait_until(lambda: len(server.server_state.connections) == 1)  # taken; nothing sent
        closing = server.close_listeners()
        wait_until(lambda: not server.servers[0].is_serving())
        time.sleep(0.1)  # (the close's polls run meanwhile)
        assert not closing.done()  # it waits for the request the client is about to send
        client.sendall(GET % b"v1/completions")
        closing.result(HANG_GUARD_S)
        assert _answer(client).startswith(b"HTTP/1.1 204")  # answered, not reset
    server.stop()


def _answered_and_kept_alive(server: _Server) -> socket.socket:
    """A client connected to `server` whose first request was answered, its connection kept."""
    client = socket.socket()
    client.connect(server.address)
    client.sendall(b"GET / HTTP/1.1\r\nHost: 127.0.0.1\r\n\r\n")
    client.settimeout(HANG_GUARD_S)
    assert client.recv(4096).startswith(b"HTTP/1.1 204")
    return client


def test_the_close_waits_for_the_next_request_of_a_connection_kept_alive():
    # closed at once while idle, such a connection lost the request its client was sending
    # then ("Server disconnected": the reliability suite's drain beside a CPU hog)
    server = _Server(_app)
    with _answered_and_kept_alive(server) as client:
        closing = server.close_listeners()
        wait_until(lambda: not server.servers[0].is_serving())
        time.sleep(0.1)  # (the close's polls run meanwhile)
        assert not closing.done()  # the client may be sending its next request
        client.sendall(GET % b"v1/completions")  # (told to close after it, as a drain does)
        closing.result(HANG_GUARD_S)
        assert _answer(client).startswith(b"HTTP/1.1 204")  # answered, not reset
    server.stop()


def test_an_idle_connection_kept_alive_is_closed_at_the_close_deadline():
    server = _Server(_app)
    with _answered_and_kept_alive(server) as client:
        server.close_listeners(seconds=0.0).result(HANG_GUARD_S)  # no request came: it ends
        assert _answer(client) == b""  # then closed by the shutdown
    server.stop()


def test_new_connections_are_turned_away_for_the_drains_last_call(monkeypatch):
    # the connections taken until the drain's end had no time left to carry their requests
    events = []

    class Cluster:
        in_flight = 3

        def drain(self, timeout):
            events.append(("drain", timeout))
            return False  # (requests still in flight)

        def close(self, join_seconds):
            events.append(("close",))

    monkeypatch.setattr(main, "turn_new_connections_away", lambda s: events.append(("away",)))
    settings = ServerSettings("m", drain_timeout=10.0)
    server = main.DrainingServer(uvicorn.Config(_app), Cluster(), settings)
    server.servers = []  # (as uvicorn sets them on starting)
    server._drain_then_exit(signal.SIGTERM, None)
    last_call = main.LAST_CALL_SECONDS
    assert events[:3] == [("drain", 10.0 - last_call), ("away",), ("drain", last_call)]
    assert server.should_exit


def test_the_last_word_is_the_draining_servers_503():
    head, _, body = draining_answer().partition(b"\r\n\r\n")
    lines = head.decode().split("\r\n")
    headers = dict(line.split(": ", 1) for line in lines[1:])
    assert lines[0] == "HTTP/1.1 503 Service Unavailable"
    assert headers["connection"] == "close" and int(headers["retry-after"]) >= 1
    assert int(headers["content-length"]) == len(body)
    assert json.loads(body)["error"]["type"] == "service_unavailable"
