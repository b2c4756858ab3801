"""What a caller of the cluster holds: a request's handle (a future of its result and a stream
of its committed text), what fills it (`Answers`: streamed text, stop strings, the result or the
error), the errors `Cluster.submit` raises, the observer interface monitors implement, and a
run's recording for replay in the simulator. No torch, no processes.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import queue
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Protocol

from dilaserve.cluster.loop_post import LoopPost, on_loop
from dilaserve.protocol import RequestStepResult, StepOutput
from dilaserve.request import Request


class InvalidRequest(ValueError):
    """A request argument is wrong; `param` names it (the HTTP layer's 400)."""

    def __init__(self, param: str, message: str):
        super().__init__(message)
        self.param = param


class Overloaded(RuntimeError):
    """Admission control refused a request: over capacity, or too many in flight. Retry
    later."""


FULL = "over capacity: the load in flight leaves no room within an SLO; retry later"


class Closed(RuntimeError):
    """The cluster is shutting down (or not started) and takes no new requests."""


class Observer(Protocol):
    """What a monitor (the server's Prometheus metrics) hears from the controller thread."""

    def step_done(self, instance_id: str, tp: int, output: StepOutput, seconds: float) -> None: ...

    def request_done(self, result: RequestResult, thresholds: list[float]) -> None: ...

    def request_failed(self, request_id: str, reason: str) -> None: ...


@dataclass(frozen=True)
class RequestResult:
    request_id: str
    text: str
    token_ids: tuple[int, ...]
    num_steps: int
    latency: float  # seconds from submission to the last step
    first_block_latency: float | None
    mean_threshold: float
    met_slo: bool
    finish_reason: str = "length"  # "stop": the model ended its answer, or a stop string came

    @classmethod
    def of(
        cls, handle: RequestHandle, ids: list[int], text: str, stopped: bool, now: float
    ) -> RequestResult:
        """A finished request's answer: `ids` its tokens (those of `text` when a stop string
        cut it), `text` the answer (their text before any stop string), `stopped` whether a
        stop string came."""
        r = handle.request
        first = None if r.first_block_time is None else r.first_block_time - handle.submitted
        return cls(
            handle.request_id,
            text,
            tuple(ids),
            r.num_steps,
            now - handle.submitted,
            first,
            r.mean_threshold,
            now <= r.deadline,
            "stop" if stopped or len(ids) < r.gen_len else "length",
        )


def cut_at_stop(text: str, stop: Sequence[str]) -> tuple[str, bool]:
    """`text` before the first occurrence of any of the `stop` strings, and whether one occurs."""
    cut = min((i for s in stop if (i := text.find(s)) >= 0), default=-1)
    return (text, False) if cut < 0 else (text[:cut], True)


def tokens_for(tokenizer, ids: Sequence[int], num_chars: int) -> int:
    """The fewest leading `ids` whose text holds the first `num_chars` characters of theirs (a
    token that straddles a stop string counts: its start is returned)."""
    lo, hi = 0, len(ids)
    while lo < hi:  # (a prefix's text grows with it)
        mid = (lo + hi) // 2
        if len(tokenizer.decode(ids[:mid])) >= num_chars:
            hi = mid
        else:
            lo = mid + 1
    return lo


def held_back(text: str, stop: Sequence[str]) -> int:
    """How many characters at the end of `text` may be the start of a stop string (and so
    may not be streamed until more text is committed)."""
    longest = 0
    for s in stop:  # the longest proper prefix of s that `text` ends with
        n = min(len(s) - 1, len(text))
        while n > longest and not text.endswith(s[:n]):
            n -= 1
        longest = max(longest, n)
    return longest


class RequestHandle:
    """A submitted request: a future of its `RequestResult`, and its committed text as it
    grows (iterate it, or `async for` over it). Deltas are text whose every token and every
    token before it is committed, in order; with `stop` strings, text before the first of them
    only (the request ends there), and nothing that may be the start of one. Not `stream`ed, a
    request keeps no deltas: its caller awaits the result, and the controller does not wake
    the event loop at each step for text nobody reads."""

    def __init__(
        self,
        request: Request,
        submitted: float,
        stop: Sequence[str] = (),
        loop: asyncio.AbstractEventLoop | None = None,
        stream: bool = True,
    ):
        self.request = request
        self.submitted = submitted
        self.stop = tuple(stop)
        self.future: concurrent.futures.Future[RequestResult] = concurrent.futures.Future()
        # done once the controller has taken the request in (or raised `Overloaded`, ...)
        self.admission: concurrent.futures.Future[None] = concurrent.futures.Future()
        self.stream = stream
        self._deltas: queue.SimpleQueue | None = queue.SimpleQueue() if stream else None
        loop = loop or _running_loop()  # told of it without blocking a thread
        self._post = None if loop is None else LoopPost.of(loop)
        self._async = asyncio.Queue() if stream and loop is not None else None
        self.sent_tokens = 0  # committed-prefix tokens already decoded
        self.committed_text = ""  # their text
        self.text_stream = None  # their decoder (`Tokenizer.decode_stream()`), once one comes
        self.sent_text = ""  # the part of it streamed (not a possible start of a stop string)

    @property
    def request_id(self) -> str:
        return self.request.request_id

    def result(self, timeout: float | None = None) -> RequestResult:
        return self.future.result(timeout)

    def admitted(self) -> asyncio.Future[None]:
        """The admission's outcome (`admission`) as an asyncio future on the handle's loop."""
        return self._on_loop(self.admission)

    def answered(self) -> asyncio.Future[RequestResult]:
        """The result (`future`) as an asyncio future on the handle's loop."""
        return self._on_loop(self.future)

    def _on_loop(self, future: concurrent.futures.Future) -> asyncio.Future:
        if self._post is None:
            raise RuntimeError("awaiting a request needs it submitted from an event loop")
        return on_loop(future, self._post)

    def extend_text(self, text: str, final: bool = False) -> bool:
        """Stream what committed `text` adds to the text already sent (committed text only
        grows), up to the first stop string, holding back a possible start of one unless
        `final`. Returns whether a stop string has come."""
        text, stopped = cut_at_stop(text, self.stop)
        if not (stopped or final):
            text = text[: len(text) - held_back(text, self.stop)]
        if text.startswith(self.sent_text) and len(text) > len(self.sent_text):
            self._push(text[len(self.sent_text) :])
            self.sent_text = text
        return stopped

    def _push(self, item) -> None:
        if not self.stream:
            return
        self._deltas.put(item)
        if self._async is not None:
            self._post.post(self._async.put_nowait, item)

    def __iter__(self):
        if not self.stream:
            raise RuntimeError("iterating a request needs it submitted with stream=True")
        while (item := self._deltas.get()) is not None:
            if isinstance(item, BaseException):
                raise item
            yield item

    async def __aiter__(self):
        if self._async is None:
            raise RuntimeError(
                "async iteration needs the request submitted with stream=True from an event loop"
            )
        while (item := await self._async.get()) is not None:
            if isinstance(item, BaseException):
                raise item
            yield item


def _running_loop() -> asyncio.AbstractEventLoop | None:
    try:
        return asyncio.get_running_loop()
    except RuntimeError:
        return None


class Answers:
    """What callers see of their requests: committed text streamed as it grows, the result
    when a request finishes, the error when it fails; the observer hears of each outcome."""

    def __init__(self, tokenizer, observer: Observer | None = None):
        self.tokenizer = tokenizer  # models.tokenizer.Tokenizer
        self.observer = observer

    def stream(self, handle: RequestHandle) -> bool:
        """Send the text whose tokens, and all before them, are committed (when it grew).
        Returns whether it has reached a stop string: the request is done. A request neither
        streamed nor with stop strings needs no text before it finishes: none is decoded."""
        if not (handle.stream or handle.stop):
            return False
        stop_ids = self.tokenizer.special.stop_ids
        new = handle.request.generated_ids(stop_ids, start=handle.sent_tokens)
        if not new:
            return False
        if handle.text_stream is None:
            handle.text_stream = self.tokenizer.decode_stream()
        handle.sent_tokens += len(new)  # only the new tokens are decoded: linear in the answer
        handle.committed_text += handle.text_stream.add(new)
        return handle.extend_text(handle.committed_text)

    def finish(self, handle: RequestHandle, now: float) -> None:
        r = handle.request
        ids = r.generated_ids(self.tokenizer.special.stop_ids)
        text, stopped = cut_at_stop(self.tokenizer.decode(ids), handle.stop)
        if stopped:  # usage counts the tokens of the text returned, not those cut off
            ids = ids[: tokens_for(self.tokenizer, ids, len(text))]
        handle.extend_text(text, final=True)
        handle._push(None)
        result = RequestResult.of(handle, ids, text, stopped, now)
        if self.observer is not None:
            self.observer.request_done(result, r.threshold_steps)
        handle.future.set_result(result)

    def fail(self, handle: RequestHandle, error: BaseException) -> None:
        if handle.future.done():
            return
        if self.observer is not None:
            self.observer.request_failed(handle.request_id, type(error).__name__)
        self.refuse(handle, error)

    def refuse(self, handle: RequestHandle, error: BaseException) -> None:
        """End a request with `error` (unheard by the observer: admission refused it)."""
        if not handle.admission.done():
            handle.admission.set_exception(error)
        handle.future.set_exception(error)
        handle._push(error)


@dataclass
class Recording:
    """What a run did, for replay in the simulator: each request as admitted, and each step
    launch with the clock at launch and at completion and what the step committed; and the
    requests admission refused on arrival, which a prediction of the run weighs again."""

    requests: list[Request] = field(default_factory=list)  # fresh copies, as admitted
    refused: list[Request] = field(default_factory=list)  # fresh copies, as they arrived
    launches: list[tuple[str, float, float, tuple[RequestStepResult, ...]]] = field(
        default_factory=list
    )
    # (instance, launched at) of the launches whose time a stall of the controller's held up:
    # the measured speed did not learn it (`stalls.py`)
    unmeasured: set[tuple[str, float]] = field(default_factory=set)
    # requests whose times teach no on-time factor (a fault's, a stall's: `Admission.void`)
    voided: set[str] = field(default_factory=set)
