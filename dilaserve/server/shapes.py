"""OpenAI's response shapes: a completion or a chat completion, whole or as stream chunks
(server-sent events), with usage and dilaserve's own figures beside OpenAI's fields."""

from __future__ import annotations

import json
import time

from dilaserve.cluster.requests import RequestHandle, RequestResult


def sse(payload: dict) -> str:
    return f"data: {json.dumps(payload)}\n\n"


def token_usage(handle: RequestHandle, result: RequestResult) -> dict:
    prompt, generated = handle.request.prompt_len, len(result.token_ids)
    return {
        "prompt_tokens": prompt,
        "completion_tokens": generated,
        "total_tokens": prompt + generated,
    }


def extras(result: RequestResult) -> dict:
    """dilaserve's own figures, beside OpenAI's fields."""
    return {
        "steps": result.num_steps,
        "mean_threshold": round(result.mean_threshold, 4),
        "latency_s": round(result.latency, 4),
        "met_slo": result.met_slo,
    }


class CompletionShape:
    def head(self, handle: RequestHandle, model: str) -> dict:
        obj = {"id": f"cmpl-{handle.request_id}", "object": "text_completion"}
        return {**obj, "created": int(time.time()), "model": model}

    def chunk(self, handle, model, delta=None, finish=None) -> dict:
        choice = {"index": 0, "text": delta or "", "logprobs": None, "finish_reason": finish}
        return {**self.head(handle, model), "choices": [choice]}

    def response(self, handle, result, model) -> dict:
        choice = {"index": 0, "text": result.text, "logprobs": None}
        choice["finish_reason"] = result.finish_reason
        usage = token_usage(handle, result)
        return {
            **self.head(handle, model),
            "choices": [choice],
            "usage": usage,
            "dilaserve": extras(result),
        }


class ChatShape:
    def head(self, handle: RequestHandle, model: str, final: bool = False) -> dict:
        obj = "chat.completion" if final else "chat.completion.chunk"
        return {
            "id": f"chatcmpl-{handle.request_id}",
            "object": obj,
            "created": int(time.time()),
            "model": model,
        }

    def chunk(self, handle, model, delta=None, finish=None) -> dict:
        content = {"role": "assistant", "content": ""} if delta is None and finish is None else {}
        if delta is not None:
            content = {"content": delta}
        choice = {"index": 0, "delta": content, "logprobs": None, "finish_reason": finish}
        return {**self.head(handle, model), "choices": [choice]}

    def response(self, handle, result, model) -> dict:
        message = {"role": "assistant", "content": result.text}
        choice = {"index": 0, "message": message, "logprobs": None}
        choice["finish_reason"] = result.finish_reason
        usage = token_usage(handle, result)
        head = self.head(handle, model, final=True)
        return {**head, "choices": [choice], "usage": usage, "dilaserve": extras(result)}
