"""Calls handed from the controller's thread to an event loop (`LoopPost`), and the asyncio
view of a request's concurrent future kept through it (`on_loop`).

Each `loop.call_soon_threadsafe` writes to the loop's wake-up pipe and wakes it; from the
controller's thread it also hands the interpreter's lock to the loop's thread, which the
controller then waits to get back. A step that finishes, admits or streams to many requests
made one wake-up each. A `LoopPost` makes one for all the calls handed over before the loop
runs them, and runs them there in the order they came.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import logging
import threading
import weakref
from collections.abc import Callable

log = logging.getLogger("dilaserve.cluster")


class LoopPost:
    """The calls posted to one event loop, from any thread; `of(loop)` is the loop's one."""

    _by_loop: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()
    _made = threading.Lock()

    def __init__(self, loop: asyncio.AbstractEventLoop):
        self.loop = loop
        self._calls: list[tuple[Callable, tuple]] = []
        self._lock = threading.Lock()
        self.wakeups = 0  # (how many times it woke the loop)

    @classmethod
    def of(cls, loop: asyncio.AbstractEventLoop) -> LoopPost:
        with cls._made:
            post = cls._by_loop.get(loop)
            if post is None:
                post = cls._by_loop[loop] = cls(loop)
            return post

    def post(self, call: Callable, *args) -> None:
        """Run `call(*args)` on the loop, after the calls posted before it. A closed loop runs
        nothing more (nobody waits on it)."""
        with self._lock:
            wake = not self._calls  # (else a wake-up is on its way to run them all)
            self._calls.append((call, args))
        if wake:
            self.wakeups += 1
            try:
                self.loop.call_soon_threadsafe(self._run)
            except RuntimeError:  # the loop is closed
                pass

    def _run(self) -> None:
        with self._lock:
            calls, self._calls = self._calls, []
        for call, args in calls:
            try:
                call(*args)
            except Exception:  # one caller's failure is not the others'
                log.exception("a call posted to the event loop failed")


def on_loop(future: concurrent.futures.Future, post: LoopPost) -> asyncio.Future:
    """An asyncio future on `post`'s loop that takes `future`'s outcome (through `post`)."""
    mirror = post.loop.create_future()
    future.add_done_callback(lambda done: post.post(_copy, done, mirror))
    return mirror


def _copy(done: concurrent.futures.Future, mirror: asyncio.Future) -> None:
    if mirror.done():  # (its waiter gave up and cancelled it)
        return
    if done.cancelled():
        mirror.cancel()
    elif done.exception() is not None:
        mirror.set_exception(done.exception())
    else:
        mirror.set_result(done.result())
