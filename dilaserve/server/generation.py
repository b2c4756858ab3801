"""Serving one generation request, for both endpoints (`add_generation_routes`): its body
parsed and validated, the request submitted to the cluster once the front and admission let it
in, and its answer returned whole or streamed as Server-Sent Events of committed text; a
client that leaves has its request cancelled. What the API promises is `app.py`'s docstring."""

from __future__ import annotations

import asyncio
import logging
from functools import partial
from typing import TYPE_CHECKING

from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, Response, StreamingResponse
from pydantic import BaseModel
from starlette.concurrency import run_in_threadpool
from starlette.exceptions import HTTPException
from starlette.requests import ClientDisconnect

from dilaserve.cluster.requests import FULL, Closed, InvalidRequest, Overloaded, RequestHandle
from dilaserve.cluster.runtime import Cluster
from dilaserve.server.bodies import INLINE_BODY_BYTES, body_docs, validated
from dilaserve.server.guards import ENTRY, error, error_body, received, retry_headers
from dilaserve.server.metrics import ServerMetrics
from dilaserve.server.schemas import ChatCompletionRequest, CompletionRequest
from dilaserve.server.shapes import ChatShape, CompletionShape, sse, token_usage

if TYPE_CHECKING:
    from dilaserve.server.app import ServerSettings

log = logging.getLogger("dilaserve.server")


def add_generation_routes(app: FastAPI, api: GenerationApi) -> None:
    """`POST /v1/completions` and `POST /v1/chat/completions`, served by `api`."""

    @app.post("/v1/completions", openapi_extra=body_docs(CompletionRequest))
    async def completions(request: Request):
        body = await api.parse(request, CompletionRequest)
        return await api.guarded(api.generate(request, body, body.prompt, body.max_tokens, False))

    @app.post("/v1/chat/completions", openapi_extra=body_docs(ChatCompletionRequest))
    async def chat_completions(request: Request):
        body = await api.parse(request, ChatCompletionRequest)
        return await api.guarded(api.chat(request, body))


class GenerationApi:
    """Submitting a request and shaping its answer, for both endpoints."""

    def __init__(self, cluster: Cluster, settings: ServerSettings, metrics: ServerMetrics):
        self.cluster = cluster
        self.settings = settings
        self.metrics = metrics

    async def parse(self, request: Request, schema: type[BaseModel]):
        """The request's body as `schema`, or RequestValidationError (the 400 naming the field).
        A large body is parsed and validated off the event loop, so that it holds up no other
        request; a chat over `max_messages` is refused before its messages are validated."""
        try:
            raw = await request.body()
        except ClientDisconnect:  # gone, or over the size limit (Guards sent the 413)
            raise HTTPException(400, "the client left before sending the whole body") from None
        if len(raw) <= INLINE_BODY_BYTES:
            return validated(schema, raw, self.settings.max_messages)
        return await run_in_threadpool(validated, schema, raw, self.settings.max_messages)

    async def guarded(self, answer):
        """The answer, or, if handling the request raised, a 500 in OpenAI's shape for it alone
        (the connection stays open for the client's other requests)."""
        try:
            return await answer
        except Exception as e:
            log.exception("error handling a request")
            return error(500, f"internal error handling the request ({type(e).__name__})")

    async def chat(self, request: Request, body: ChatCompletionRequest):
        """A conversation through the checkpoint's chat template; DWS reads the last user turn."""
        messages = [{"role": m.role, "content": m.text()} for m in body.messages]
        try:
            self.cluster.intake.check_text_length(
                sum(len(m["content"]) for m in messages), "messages"
            )
            text = await run_in_threadpool(self.cluster.tokenizer.apply_chat_template, messages)
        except InvalidRequest as e:
            return error(400, str(e), e.param)
        except Exception as e:  # the checkpoint's template rejected the conversation
            return error(400, f"messages: {e}", "messages")
        user = next((m["content"] for m in reversed(messages) if m["role"] == "user"), text)
        return await self.generate(request, body, text, body.window, chat=True, text=user)

    async def generate(
        self, request: Request, body, prompt, max_tokens: int | None, chat: bool, text=None
    ):
        wrong = self._unservable(body)
        if wrong is not None:
            return wrong
        arrived, arrived_unix = received(request)
        slo = body.slo_ms / 1000 if body.slo_ms is not None else None
        if body.deadline is not None:
            slo = body.deadline - arrived_unix
            if slo <= 0:
                return error(400, f"deadline={body.deadline} has passed", "deadline")
        if not self.cluster.accepting:  # draining: 503 wins over 429
            return self._not_taken(Closed("the cluster is not accepting requests"))
        entry = request.scope.get(ENTRY)  # (its count in the room, if the front began it)
        if self.cluster.is_full(body.priority, slo, max_tokens, entry):  # before any work
            return self._not_taken(Overloaded(FULL))
        try:
            handle, refused = await self._submit(
                body, prompt, max_tokens, slo, text, arrived, entry
            )
        except InvalidRequest as e:
            return error(400, str(e), "messages" if chat and e.param == "prompt" else e.param)
        except Exception as e:
            return self._not_taken(e)
        if refused is not None:
            return self._not_taken(refused)
        shape = ChatShape() if chat else CompletionShape()
        if body.stream:
            return StreamingResponse(
                self._events(handle, shape, body.include_usage), media_type="text/event-stream"
            )
        try:
            result = await self._answer_or_cancel(handle, request)
        except Closed as e:  # the server shut down before it finished
            return error(503, str(e), headers={"Retry-After": "5"})
        except Exception as e:  # its step failed (the message names the request)
            return error(500, str(e))
        if result is None:  # the client went away; nobody reads this
            return Response(status_code=499)
        # (a Response: FastAPI would walk the dict through `jsonable_encoder` first, 15% of a
        # plain request's time on the event loop, for the same bytes)
        return JSONResponse(shape.response(handle, result, self.settings.model_name))

    async def _submit(self, body, prompt, max_tokens, slo, text, arrived, entry):
        """(the request queued for the controller, the error that refused it or None) once
        admission has decided. A long prompt, or one a DWS predictor reads, is checked off the
        event loop, where it holds up no other request; a short one on it, cheaper than the
        hop to a thread (`Intake.is_cheap`)."""
        with self.cluster.entering(entry) as submit:
            call = partial(
                submit,
                prompt,
                max_tokens=max_tokens,
                slo=slo,
                priority=body.priority,
                chat=False,  # chat prompts arrive already templated
                threshold=body.threshold,
                min_threshold=body.min_threshold,
                max_threshold=body.max_threshold,
                steps=body.steps,
                text=text,
                stop=body.stop,
                received=arrived,
                loop=asyncio.get_running_loop(),
                stream=body.stream,
            )
            inline = self.cluster.intake.is_cheap(prompt)
            handle = call() if inline else await run_in_threadpool(call)
        admission = handle.admitted()
        await asyncio.wait([admission])  # the controller took it in, or not
        # read, not raised: raised, the refusal's traceback would hold the frame, which holds
        # the handle, which holds the refusal (a cycle per request for the collector)
        return handle, admission.exception()

    def _unservable(self, body) -> Response | None:
        """The answer to a body this server cannot serve: another model (404), a field it
        cannot honour (400); None if it can."""
        if body.model != self.settings.model_name:
            message = (
                f"The model {body.model!r} does not exist (this server serves "
                f"{self.settings.model_name!r})"
            )
            return error(404, message, "model", code="model_not_found")
        unsupported = body.unsupported()
        if unsupported is not None:
            return error(400, f"{unsupported} is not supported by this server", unsupported)
        return None

    def _not_taken(self, e: Exception) -> Response:
        """The answer to a request the cluster did not take in: refused for capacity (429),
        closed (503), an SLO no idle cluster meets (400), or failed before it started (500;
        the message names the request)."""
        if isinstance(e, InvalidRequest):
            return error(400, str(e), e.param)
        if isinstance(e, Overloaded):
            self.metrics.rejected()
            return error(429, str(e), headers=retry_headers(self.settings.retry_after))
        if isinstance(e, Closed):
            self.metrics.rejected()
            return error(503, str(e), headers={"Retry-After": "5"})
        return error(500, str(e))

    async def _answer_or_cancel(self, handle: RequestHandle, request: Request):
        """The request's result, or None once its client disconnects, after which the cluster
        stops working on it (a client that timed out must not keep holding capacity)."""
        answer = handle.answered()
        gone = asyncio.ensure_future(_disconnected(request))
        await asyncio.wait((answer, gone), return_when=asyncio.FIRST_COMPLETED)
        gone.cancel()
        if answer.done():
            return answer.result()
        answer.cancel()  # (the handle's own future is the controller's to end)
        self.cluster.cancel(handle.request_id)
        return None

    async def _events(self, handle: RequestHandle, shape, include_usage: bool):
        name = self.settings.model_name
        try:
            if isinstance(shape, ChatShape):  # chat streams open with the role
                yield sse(shape.chunk(handle, name, delta=None))
            async for delta in handle:
                yield sse(shape.chunk(handle, name, delta=delta))
            result = handle.future.result()
            yield sse(shape.chunk(handle, name, finish=result.finish_reason))
            if include_usage:
                usage = token_usage(handle, result)
                yield sse({**shape.head(handle, name), "choices": [], "usage": usage})
        except Exception as e:  # the request failed mid-stream: say so in the stream
            status = 503 if isinstance(e, Closed) else 500
            yield sse(error_body(status, str(e)))
        finally:
            if not handle.future.done():  # the client went away: stop working on it
                self.cluster.cancel(handle.request_id)
        yield "data: [DONE]\n\n"


async def _disconnected(request: Request) -> None:
    """Returns when the client disconnects (the body has been read: what comes next is that)."""
    while (await request.receive())["type"] != "http.disconnect":
        pass
