"""OpenAI-compatible request parsing and response shaping, independent of any role.

Requests are validated into one ``GenerationRequest`` (prompt token ids,
sampling settings, streaming, ``kv_transfer_params``) so the prefill and
decode paths share everything but what they do with the KV. Unknown
OpenAI fields are ignored, as OpenAI clients send many; values we cannot
honour (``n`` > 1, string ``stop``) are refused with a 400 rather than
silently dropped.
"""

from __future__ import annotations

import time
import uuid
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

from pdkv.engine.sampling import SamplingParams
from pdkv.engine.tokenizer import Tokenizer
from pdkv.errors import InvalidRequestError
from pdkv.openai_wire import SSE_DONE, error_body, sse  # noqa: F401 - re-exported: the worker's shapes

DEFAULT_MAX_TOKENS = 16


@dataclass
class GenerationRequest:
    """A validated /v1/completions or /v1/chat/completions body."""

    request_id: str
    chat: bool
    model: str
    prompt_token_ids: list[int]
    sampling: SamplingParams
    stream: bool
    include_usage: bool
    return_token_ids: bool
    kv_transfer_params: dict[str, Any] = field(default_factory=dict)
    created: int = field(default_factory=lambda: int(time.time()))


def _number(body: dict[str, Any], name: str, default: float, kind: type = float) -> Any:
    value = body.get(name)
    if value is None:
        return default
    if isinstance(value, bool) or not isinstance(value, (int, float)) or (kind is int and not isinstance(value, int)):
        raise InvalidRequestError(f"'{name}' must be {'an integer' if kind is int else 'a number'}, got {value!r}")
    return kind(value)


def parse_request(body: Any, tokenizer: Tokenizer, model_name: str, chat: bool) -> GenerationRequest:
    """Validate a request body; raises ``InvalidRequestError`` with the field at fault."""
    if not isinstance(body, dict):
        raise InvalidRequestError("the request body must be a JSON object")
    if _number(body, "n", 1, int) != 1:
        raise InvalidRequestError("only n=1 is supported")
    if body.get("stop") not in (None, [], ""):
        raise InvalidRequestError("'stop' strings are not supported; use 'stop_token_ids'")
    if chat:
        messages = body.get("messages")
        if not isinstance(messages, list) or not messages or not all(isinstance(m, dict) and "role" in m for m in messages):
            raise InvalidRequestError("'messages' must be a non-empty list of {role, content} objects")
        prompt_ids = tokenizer.encode_chat(messages)
        max_tokens = body.get("max_completion_tokens", body.get("max_tokens"))
    else:
        prompt_ids = _prompt_ids(body.get("prompt"), tokenizer)
        max_tokens = body.get("max_tokens")
    stop_ids = body.get("stop_token_ids") or []
    if not isinstance(stop_ids, list) or not all(isinstance(t, int) for t in stop_ids):
        raise InvalidRequestError("'stop_token_ids' must be a list of integers")
    kv = body.get("kv_transfer_params") or {}
    if not isinstance(kv, dict):
        raise InvalidRequestError("'kv_transfer_params' must be an object")
    stream_options = body.get("stream_options") or {}
    sampling = SamplingParams(
        max_tokens=DEFAULT_MAX_TOKENS if max_tokens is None else max_tokens,
        temperature=_number(body, "temperature", 1.0),
        top_p=_number(body, "top_p", 1.0),
        seed=body.get("seed"),
        ignore_eos=bool(body.get("ignore_eos", False)),
        stop_token_ids=tuple(stop_ids),
    )
    rid = body.get("request_id") if isinstance(body.get("request_id"), str) else None
    return GenerationRequest(
        request_id=rid or f"{'chatcmpl' if chat else 'cmpl'}-{uuid.uuid4().hex}",
        chat=chat,
        model=str(body.get("model") or model_name),
        prompt_token_ids=prompt_ids,
        sampling=sampling,
        stream=bool(body.get("stream", False)),
        include_usage=bool(isinstance(stream_options, dict) and stream_options.get("include_usage")),
        return_token_ids=bool(body.get("return_token_ids", False)),
        kv_transfer_params=kv,
    )


def _prompt_ids(prompt: Any, tokenizer: Tokenizer) -> list[int]:
    if isinstance(prompt, str):
        if not prompt:
            raise InvalidRequestError("'prompt' is empty")
        return tokenizer.encode(prompt)
    if isinstance(prompt, list) and len(prompt) == 1 and isinstance(prompt[0], (str, list)):
        return _prompt_ids(prompt[0], tokenizer)  # a batch of one
    if isinstance(prompt, list) and prompt and all(isinstance(t, int) and not isinstance(t, bool) for t in prompt):
        return list(prompt)
    raise InvalidRequestError("'prompt' must be a non-empty string or a list of token ids (batches of several prompts are not supported)")


class Detokenizer:
    """Incremental text for streaming: multi-byte characters split over tokens come out whole."""

    def __init__(self, tokenizer: Tokenizer) -> None:
        self._tokenizer = tokenizer
        self._ids: list[int] = []
        self._text = ""

    def push(self, token_id: int, final: bool = False) -> str:
        """Text added by ``token_id``; ``final`` flushes what an unfinished character held back."""
        self._ids.append(token_id)
        text = self._tokenizer.decode(self._ids)
        if text.endswith("\ufffd") and not final:  # an incomplete UTF-8 sequence: wait for the next token
            return ""
        delta, self._text = text[len(self._text) :], text
        return delta


def usage(req: GenerationRequest, completion_tokens: int) -> dict[str, int]:
    n = len(req.prompt_token_ids)
    return {"prompt_tokens": n, "completion_tokens": completion_tokens, "total_tokens": n + completion_tokens}


def full_response(req: GenerationRequest, text: str, token_ids: Sequence[int], finish: str | None, kv_params: dict[str, Any] | None) -> dict[str, Any]:
    """The non-streaming body, in OpenAI's shape (plus vLLM's ``kv_transfer_params``)."""
    choice: dict[str, Any] = {"index": 0, "finish_reason": finish, "logprobs": None}
    if req.chat:
        choice["message"] = {"role": "assistant", "content": text}
    else:
        choice["text"] = text
    if req.return_token_ids:
        choice["token_ids"] = list(token_ids)
        choice["prompt_token_ids"] = req.prompt_token_ids
    return {
        "id": req.request_id,
        "object": "chat.completion" if req.chat else "text_completion",
        "created": req.created,
        "model": req.model,
        "choices": [choice],
        "usage": usage(req, len(token_ids)),
        "kv_transfer_params": kv_params,
    }


def stream_event(req: GenerationRequest, delta: str, token_id: int | None, finish: str | None, first: bool) -> bytes:
    """One SSE ``data:`` line of a streaming response."""
    choice: dict[str, Any] = {"index": 0, "finish_reason": finish, "logprobs": None}
    if req.chat:
        choice["delta"] = ({"role": "assistant", "content": delta} if first else {"content": delta})
    else:
        choice["text"] = delta
    if req.return_token_ids and token_id is not None:
        choice["token_ids"] = [token_id]
    body = {
        "id": req.request_id,
        "object": "chat.completion.chunk" if req.chat else "text_completion",
        "created": req.created,
        "model": req.model,
        "choices": [choice],
    }
    return sse(body)


def usage_event(req: GenerationRequest, completion_tokens: int) -> bytes:
    return sse({
        "id": req.request_id,
        "object": "chat.completion.chunk" if req.chat else "text_completion",
        "created": req.created,
        "model": req.model,
        "choices": [],
        "usage": usage(req, completion_tokens),
    })
