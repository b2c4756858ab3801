"""Closing the listening socket at shutdown without dropping a request a client already sent.

Closing a listening socket resets every connection in the kernel's accept queue: connections
the kernel completed but the server had not yet taken, whose clients have sent their requests
and get no answer. At capacity that queue is long (the reliability suite's drain under 400
clients: 255 connections reset, docs/serving/reliability.md). So the listener is closed in steps
(`close_listeners`):

1. a socket filter that keeps no byte of any packet (classic BPF `ret #0`, `SO_ATTACH_FILTER`)
   is attached to the listening socket (`turn_new_connections_away`): from then on the kernel
   drops every new connection's SYN there, and the accept queue only shrinks (connections
   already in it are sockets of their own, which the filter does not reach). A client whose
   SYN was dropped finds the port closed on its next try: refused, not answered wrongly;
2. asyncio stops accepting, and what is left in the queue (the kernel's count: `TCP_INFO`'s
   unacked of a listening socket) is taken here, through a duplicate of the socket, and each
   request answered `last_word` (the server's: 503, Retry-After, `Connection: close`) once
   its bytes are read: a few system calls each, where the HTTP stack and the app cost about a
   millisecond, which a front starved of CPU at shutdown does not have;
3. the listener closes with its queue empty, and the server waits until every connection it
   took has closed after an answer that said `Connection: close` (each answer does while the
   server drains). A connection on which no request has come yet has a client about to send
   one (beside a CPU hog, 85 were in that state when uvicorn closed them, and each of their
   requests was lost, "Can not write request body"); one kept alive after an earlier answer
   may carry the client's next request at any moment (closed at once, as it was until
   2026-12-05, 31 and 93 requests sent that way were lost, "Server disconnected", in one drain
   of three beside a CPU hog: docs/serving/reliability.md).

The server (`main.py`) attaches the filter before the drain's last second, and before it
fails the requests the drain left running, so that their clients' next connections are turned
away at once rather than queued (beside 400 closed-loop clients on a busy 2-core machine, 147
connections were still queued when the listener closed after 0.25 s of the server's own
accepting), and the clients of the connections it took have time to send their requests.
Each wait ends at the deadline given, whatever is left (logged). Where the filter or
`TCP_INFO` is not available (not Linux), the listener closes as before. This module knows
sockets and uvicorn's connections, not what the answer says.
"""

from __future__ import annotations

import asyncio
import ctypes
import logging
import os
import socket
import struct
import sys
import time
from collections.abc import Callable, Iterable

log = logging.getLogger("dilaserve.server")
SO_ATTACH_FILTER = getattr(socket, "SO_ATTACH_FILTER", 26)  # (Linux's value)
KEEP_NOTHING = struct.pack("HBBI", 0x06, 0, 0, 0)  # BPF_RET | BPF_K, k = 0: drop the packet
TCP_INFO_BYTES = 104
UNACKED_OFFSET = 24  # struct tcp_info: 8 one-byte fields, then rto, ato, snd_mss, rcv_mss, unacked
POLL_SECONDS = 0.005
READ_BYTES = 64 * 1024  # of a queued connection's request, read before it is answered


def refuse_new_connections(sock) -> bool:
    """Attach a filter that drops every packet arriving at the listening `sock`, so no new
    connection completes there; False where the platform has no socket filters."""
    if not sys.platform.startswith("linux"):
        return False
    program = ctypes.create_string_buffer(KEEP_NOTHING, len(KEEP_NOTHING))
    fprog = struct.pack("HL", 1, ctypes.addressof(program))  # struct sock_fprog (the kernel copies)
    try:
        sock.setsockopt(socket.SOL_SOCKET, SO_ATTACH_FILTER, fprog)
    except OSError as e:
        log.warning("cannot filter the listening socket (%s): closing it as it is", e)
        return False
    return True


def accept_queue_length(sock) -> int:
    """Connections the kernel completed on the listening `sock` and the server has not yet
    accepted (0 where `TCP_INFO` is not available)."""
    if not sys.platform.startswith("linux"):
        return 0
    info = sock.getsockopt(socket.IPPROTO_TCP, socket.TCP_INFO, TCP_INFO_BYTES)
    return struct.unpack_from("I", info, UNACKED_OFFSET)[0]


def is_open(connection) -> bool:
    """Is a uvicorn connection still open? Then a request may be on it: one read and not
    answered, one not read yet, the first on a new connection, or the next on one kept alive
    after an answer. During a drain every answer says `Connection: close`, after which uvicorn
    closes the connection, so one still open has not been told to close."""
    transport = getattr(connection, "transport", None)
    return transport is not None and not transport.is_closing()


def turn_new_connections_away(servers: Iterable[asyncio.Server]) -> list:
    """`refuse_new_connections` on each of asyncio's listening `servers`' sockets (from any
    thread; again is harmless); returns the sockets filtered."""
    listeners = [sock for server in servers for sock in server.sockets]
    return [sock for sock in listeners if refuse_new_connections(sock)]


async def close_listeners(
    servers: Iterable[asyncio.Server], connections, seconds: float, last_word: bytes
) -> None:
    """Close asyncio's listening `servers` as the module's docstring says, within `seconds`;
    `connections`: the open connections (uvicorn's `server_state.connections`); `last_word`:
    the whole HTTP answer to each request left in the accept queue."""
    deadline = time.monotonic() + seconds
    servers = list(servers)
    filtered = turn_new_connections_away(servers)
    held = [socket.socket(fileno=os.dup(sock.fileno())) for sock in filtered]
    for server in servers:
        server.close()  # (the duplicates keep the filtered sockets and their queues open)
    answers = [task for sock in held for task in _take_queue(sock, last_word, deadline)]
    queued = sum(accept_queue_length(sock) for sock in held)
    if queued:
        log.warning("closing the listener with %d connections queued", queued)
    for sock in held:
        sock.close()
    if answers:
        await asyncio.wait(answers, timeout=max(deadline - time.monotonic(), 0.0))
    if not await _until(lambda: not _open(connections), deadline):
        fresh = sum(getattr(c, "cycle", 0) is None for c in list(connections))
        log.warning(
            "closing %d connections not told to close (%d with no request yet)",
            _open(connections),
            fresh,
        )


def _take_queue(listener: socket.socket, last_word: bytes, deadline: float) -> list:
    """Accept every connection queued on `listener` (non-blocking); a task answering each."""
    listener.setblocking(False)
    tasks = []
    while True:
        try:
            conn, _ = listener.accept()
        except (BlockingIOError, InterruptedError):
            return tasks
        except OSError as e:  # e.g. out of file descriptors: leave the rest
            log.warning("cannot take a queued connection: %s", e)
            return tasks
        tasks.append(asyncio.ensure_future(_answer(conn, last_word, deadline)))


async def _answer(conn: socket.socket, last_word: bytes, deadline: float) -> None:
    """Read what the client sent (up to the deadline), send `last_word`, close."""
    conn.setblocking(False)
    try:
        await asyncio.wait_for(_read_then_send(conn, last_word), deadline - time.monotonic())
    except (OSError, asyncio.TimeoutError):
        pass  # the client left, or sent nothing in time
    finally:
        conn.close()


async def _read_then_send(conn: socket.socket, last_word: bytes) -> None:
    loop = asyncio.get_running_loop()
    if not await loop.sock_recv(conn, READ_BYTES):
        return  # the client closed without a request
    await loop.sock_sendall(conn, last_word)
    try:  # read what else came, so that the close is a FIN, not a reset losing the answer
        while conn.recv(READ_BYTES):
            pass
    except BlockingIOError:
        pass


def _open(connections) -> int:
    return sum(is_open(c) for c in list(connections))


async def _until(done: Callable[[], bool], deadline: float) -> bool:
    """Let the event loop run (it takes connections in tasks of its own), then wait until
    `done()` or the deadline."""
    while True:
        await asyncio.sleep(POLL_SECONDS)
        if done():
            return True
        if time.monotonic() >= deadline:
            return False
