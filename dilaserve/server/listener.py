"""Closing the listening socket at shutdown without dropping a request a client already sent.

Closing a listening socket resets every connection in the kernel's accept queue: connections
the kernel completed but the server had not yet taken, whose clients have sent their requests
and get no answer. At capacity that queue is long (the reliability suite's drain under 400
clients: 255 connections reset, docs/serving.md). So the listener is closed in three moves
(`close_listeners`):

1. a socket filter that keeps no byte of any packet (classic BPF `ret #0`, `SO_ATTACH_FILTER`)
   is attached to the listening socket: from then on the kernel drops every new connection's
   SYN there, and the accept queue only shrinks (connections already in it are sockets of their
   own, which the filter does not reach);
2. the event loop takes what is in the queue, as it takes any connection, and answers its
   requests (while draining, 503 with Retry-After and `Connection: close`, `guards.py`); the
   queue's length is the kernel's (`TCP_INFO`'s unacked count of a listening socket);
3. the listener closes (a client whose SYN was dropped then finds the port closed on its next
   try: refused, not answered wrongly), and the server waits until no connection holds a request
   it read but has not answered, or bytes it has not read yet.

Each wait ends at the deadline given, whatever is left. Where the filter or `TCP_INFO` is not
available (not Linux), the listener closes as before. What the requests are answered is the
app's; this module knows only sockets and uvicorn's connections.
"""

from __future__ import annotations

import array
import asyncio
import ctypes
import fcntl
import logging
import socket
import struct
import sys
import termios
import time
from collections.abc import Callable, Iterable

log = logging.getLogger("dilaserve.server")
SO_ATTACH_FILTER = getattr(socket, "SO_ATTACH_FILTER", 26)  # (Linux's value)
KEEP_NOTHING = struct.pack("HBBI", 0x06, 0, 0, 0)  # BPF_RET | BPF_K, k = 0: drop the packet
TCP_INFO_BYTES = 104
UNACKED_OFFSET = 24  # struct tcp_info: 8 one-byte fields, then rto, ato, snd_mss, rcv_mss, unacked
POLL_SECONDS = 0.005


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


def unread_bytes(transport) -> int:
    """Bytes a connection's client sent that the server has not read yet."""
    sock = transport.get_extra_info("socket")
    if sock is None or transport.is_closing():
        return 0
    count = array.array("i", [0])
    try:
        fcntl.ioctl(sock.fileno(), termios.FIONREAD, count)
    except OSError:
        return 0
    return count[0]


def has_unanswered_request(connection) -> bool:
    """Does a uvicorn connection hold a request it has read (or has yet to read) and not
    answered?"""
    cycle = getattr(connection, "cycle", None)
    if cycle is not None and not cycle.response_complete:
        return True
    transport = getattr(connection, "transport", None)
    return transport is not None and unread_bytes(transport) > 0


async def close_listeners(servers: Iterable[asyncio.Server], connections, seconds: float) -> None:
    """Close asyncio's listening `servers` as the module's docstring says, within `seconds`;
    `connections`: the open connections (uvicorn's `server_state.connections`)."""
    deadline = time.monotonic() + seconds
    servers = list(servers)
    listeners = [sock for server in servers for sock in server.sockets]
    filtered = [sock for sock in listeners if refuse_new_connections(sock)]
    await _until(lambda: not any(accept_queue_length(s) for s in filtered), deadline)
    for server in servers:
        server.close()
    await _until(lambda: not any(has_unanswered_request(c) for c in list(connections)), deadline)


async def _until(done: Callable[[], bool], deadline: float) -> bool:
    """Let the event loop run (it takes connections in tasks of its own), then wait until
    `done()` or the deadline."""
    while True:
        await asyncio.sleep(POLL_SECONDS)
        if done():
            return True
        if time.monotonic() >= deadline:
            return False
