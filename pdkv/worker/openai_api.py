"""OpenAI-compatible request parsing and response shaping, independent of any role.

Requests are validated into one ``GenerationRequest`` (prompt token ids,
sampling settings, streaming, log-probabilities, ``kv_transfer_params``) so
the prefill and decode paths share everything but what they do with the KV.
What vLLM's OpenAI server refuses is refused here the same way (a 400 naming
the field, a 404 for a model this worker does not serve): a value of the
wrong type, a number that is not finite, content parts that are not text.
Fields we cannot honour (``n`` > 1, ``stop`` strings, penalties, ``echo``,
...) are refused when set rather than silently dropped; fields that change
nothing here (``user``, ``metadata``, ...) are ignored, as OpenAI clients
send many.

``cache_salt`` (vLLM's field) puts the prompt's KV in a cache partition of
its own: its chunk keys chain from that salt (``pdkv.keys``), so it neither
loads nor offers KV of another salt. Behind a router with tenants the
router sets it (``pdkv.router.tenants``); a client reaching a worker
directly can name any salt, which is why workers' ports are the router's
alone (README, Security).

Parsing tokenizes, so a worker runs a long request's off its event loop.
"""

from __future__ import annotations

import time
import uuid
from collections.abc import Callable, Collection, Sequence
from dataclasses import dataclass, field
from typing import Any, Literal

from pdkv.engine.base import EngineAdapter
from pdkv.engine.sampling import MIN_LOGPROB, SamplingParams, TokenLogprobs
from pdkv.errors import InvalidRequestError
from pdkv.http.openai_wire import sse
from pdkv.keys import MAX_SALT_CHARS
from pdkv.modelfiles.tokenizer import Tokenizer

DEFAULT_MAX_TOKENS = 16
MAX_LOGPROBS = 20  # vLLM's default max_logprobs

# Fields we cannot honour, and the values that mean "not used" (what clients send by default).
_UNSUPPORTED: dict[str, Callable[[Any], bool]] = {
    "best_of": lambda v: v in (None, 1),
    "echo": lambda v: v in (None, False),
    "suffix": lambda v: v in (None, ""),
    "logit_bias": lambda v: v in (None, {}),
    "presence_penalty": lambda v: v in (None, 0),
    "frequency_penalty": lambda v: v in (None, 0),
    "repetition_penalty": lambda v: v in (None, 1),
    "top_k": lambda v: v in (None, 0, -1),
    "min_p": lambda v: v in (None, 0),
    "min_tokens": lambda v: v in (None, 0),
    "prompt_logprobs": lambda v: v is None,
    "response_format": lambda v: v is None or v == {"type": "text"},
    "guided_json": lambda v: v is None,
    "guided_regex": lambda v: v is None,
    "guided_choice": lambda v: v is None,
    "tool_choice": lambda v: v in (None, "auto", "none"),
}


Handoff = Literal["", "first", "rest"]
"""A streamed answer's part when it is handed from a prefill to a decode worker (``StreamEvents``)."""


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
    cache_salt: str = ""  # vLLM's field: the cache partition of this prompt's KV (pdkv.keys); "": unsalted
    # None: no log-probabilities; n: each token's, with the n most likely alternatives.
    logprobs: int | None = None
    created: int = field(default_factory=lambda: int(time.time()))


def _bad(message: str, param: str) -> InvalidRequestError:
    return InvalidRequestError(message, param=param)


def _is_int(value: Any) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


def _number(body: dict[str, Any], name: str, default: float) -> float:
    value = body.get(name)
    if value is None:
        return default
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        raise _bad(f"'{name}' must be a number, got {value!r}", name)
    return float(value)


def _integer(body: dict[str, Any], name: str, low: int, high: int, default: int | None) -> int | None:
    value = body.get(name)
    if value is None:
        return default
    if not _is_int(value) or not low <= value <= high:
        raise _bad(f"'{name}' must be an integer in [{low}, {high}], got {value!r}", name)
    return int(value)


def _flag(body: dict[str, Any], name: str) -> bool:
    value = body.get(name)
    if value is None:
        return False
    if not isinstance(value, bool):
        raise _bad(f"'{name}' must be true or false, got {value!r}", name)
    return value


def parse_request(body: Any, engine: EngineAdapter, chat: bool, served: Collection[str]) -> GenerationRequest:
    """Validate a request body; raises ``InvalidRequestError`` naming the field at fault (404 for the model)."""
    if not isinstance(body, dict):
        raise InvalidRequestError("the request body must be a JSON object")
    model = body.get("model")
    if model is not None and not isinstance(model, str):
        raise _bad(f"'model' must be a string, got {model!r}", "model")
    if model and model not in served:
        raise InvalidRequestError(
            f"The model `{model}` does not exist. Valid aliases: {', '.join(sorted(served))}.",
            status=404,
            param="model",
        )
    if _integer(body, "n", 1, 1 << 31, 1) != 1:
        raise _bad("only n=1 is supported", "n")
    if body.get("stop") not in (None, [], ""):
        raise _bad("'stop' strings are not supported; use 'stop_token_ids'", "stop")
    for name, unused in _UNSUPPORTED.items():
        if not unused(body.get(name)):
            raise _bad(f"'{name}' is not supported by this worker (got {body[name]!r}); leave it out", name)
    if chat:
        max_tokens = _integer(body, "max_completion_tokens", 1, 1 << 62, None)
        max_tokens = max_tokens if max_tokens is not None else _integer(body, "max_tokens", 1, 1 << 62, None)
        logprobs = _chat_logprobs(body)
        tools = body.get("tools")
        if tools is not None and not (isinstance(tools, list) and all(isinstance(t, dict) for t in tools)):
            raise _bad("'tools' must be a list of objects", "tools")
        text = engine.tokenizer.render_chat(_messages(body.get("messages")), tools=tools or None)
        prompt_ids = _encode(engine, text, "messages", add_special_tokens=False)
    else:
        max_tokens = _integer(body, "max_tokens", 1, 1 << 62, None)
        logprobs = _integer(body, "logprobs", 0, MAX_LOGPROBS, None)
        prompt_ids = _prompt_ids(body.get("prompt"), engine)
    stop_ids = body.get("stop_token_ids") or []
    if not isinstance(stop_ids, list) or not all(_is_int(t) for t in stop_ids):
        raise _bad("'stop_token_ids' must be a list of integers", "stop_token_ids")
    kv = body.get("kv_transfer_params") or {}
    if not isinstance(kv, dict):
        raise _bad("'kv_transfer_params' must be an object", "kv_transfer_params")
    stream_options = body.get("stream_options") or {}
    if not isinstance(stream_options, dict):
        raise _bad("'stream_options' must be an object", "stream_options")
    sampling = SamplingParams(
        max_tokens=DEFAULT_MAX_TOKENS if max_tokens is None else max_tokens,
        temperature=_number(body, "temperature", 1.0),
        top_p=_number(body, "top_p", 1.0),
        seed=body.get("seed"),
        ignore_eos=_flag(body, "ignore_eos"),
        stop_token_ids=tuple(stop_ids),
    )
    salt = body.get("cache_salt")
    if salt is not None and not (isinstance(salt, str) and 0 < len(salt) <= MAX_SALT_CHARS):  # vLLM refuses "" too
        raise _bad(
            f"'cache_salt' must be a non-empty string of at most {MAX_SALT_CHARS} characters if provided, got "
            f"{salt!r:.80}",
            "cache_salt",
        )
    rid = body.get("request_id") if isinstance(body.get("request_id"), str) else None
    return GenerationRequest(
        request_id=rid or f"{'chatcmpl' if chat else 'cmpl'}-{uuid.uuid4().hex}",
        chat=chat,
        model=model or engine.model_name,
        prompt_token_ids=prompt_ids,
        sampling=sampling,
        stream=_flag(body, "stream"),
        include_usage=_flag(stream_options, "include_usage"),
        return_token_ids=_flag(body, "return_token_ids"),
        kv_transfer_params=kv,
        cache_salt=salt or "",
        logprobs=logprobs,
    )


def _chat_logprobs(body: dict[str, Any]) -> int | None:
    """Chat's ``logprobs`` (a flag) and ``top_logprobs`` (how many alternatives), as vLLM checks them."""
    wanted = _flag(body, "logprobs")
    top = _integer(body, "top_logprobs", 0, MAX_LOGPROBS, 0)
    if top and not wanted:
        raise _bad("'top_logprobs' needs 'logprobs': true", "top_logprobs")
    return top if wanted else None


def _messages(messages: Any) -> list[dict[str, Any]]:
    """The chat as the template wants it: each message's content one string (text parts joined as vLLM does)."""
    if not isinstance(messages, list) or not messages:
        raise _bad("'messages' must be a non-empty list of {role, content} objects", "messages")
    out = []
    for i, message in enumerate(messages):
        if not isinstance(message, dict):
            raise _bad(f"messages[{i}] must be an object, got {message!r}", "messages")
        role = message.get("role")
        if not isinstance(role, str) or not role:
            raise _bad(f"messages[{i}].role must be a non-empty string, got {role!r}", "messages")
        content = message.get("content")
        if content is None and role == "assistant":  # an assistant turn may carry only tool_calls
            text = ""
        elif isinstance(content, str):
            text = content
        elif isinstance(content, list):
            text = "\n".join(_text_part(part, f"messages[{i}].content[{j}]") for j, part in enumerate(content))
        else:
            raise _bad(
                f"messages[{i}].content must be a string or a list of content parts, got {content!r}", "messages"
            )
        out.append({**message, "content": text})
    return out


def _text_part(part: Any, where: str) -> str:
    if not isinstance(part, dict) or part.get("type") != "text":
        kind = part.get("type") if isinstance(part, dict) else type(part).__name__
        raise _bad(
            f"{where}: content parts of type {kind!r} are not supported; this model takes text parts only", "messages"
        )
    if not isinstance(part.get("text"), str):
        raise _bad(f"{where}.text must be a string, got {part.get('text')!r}", "messages")
    return str(part["text"])


def _encode(engine: EngineAdapter, text: str, param: str, add_special_tokens: bool) -> list[int]:
    """Token ids of prompt text, refusing text that is not Unicode or surely longer than the model's context."""
    try:
        size = len(text.encode("utf-8"))
    except UnicodeEncodeError as exc:
        raise _bad(
            f"'{param}' is not valid Unicode: a lone surrogate (U+{ord(text[exc.start]):04X}) at character {exc.start}",
            param,
        ) from None
    # Checked before tokenizing: a 10 MB prompt would take seconds of CPU to be refused afterwards.
    if size > engine.max_model_len * engine.tokenizer.max_token_bytes:
        at_least = -(-size // engine.tokenizer.max_token_bytes)
        raise _bad(
            f"'{param}' is {size} bytes, at least {at_least} tokens: more than this model's context of "
            f"{engine.max_model_len} tokens",
            param,
        )
    return engine.tokenizer.encode(text, add_special_tokens=add_special_tokens)


def _prompt_ids(prompt: Any, engine: EngineAdapter) -> list[int]:
    if isinstance(prompt, list) and len(prompt) == 1 and isinstance(prompt[0], (str, list)):
        prompt = prompt[0]  # a batch of one
    if isinstance(prompt, str) and prompt:
        return _encode(engine, prompt, "prompt", add_special_tokens=True)
    if isinstance(prompt, list) and prompt and all(_is_int(t) for t in prompt):
        return list(prompt)  # the engine checks each id against its vocabulary
    raise _bad(
        "'prompt' must be a non-empty string or a list of token ids (batches of several prompts are not supported)",
        "prompt",
    )


class Detokenizer:
    """Incremental text for streaming: multi-byte characters split over tokens come out whole."""

    def __init__(self, tokenizer: Tokenizer) -> None:
        self._tokenizer = tokenizer
        self._ids: list[int] = []
        self._text = ""

    def push(self, token_id: int, final: bool = False) -> str:
        """Text added by ``token_id``; ``final`` flushes what an unfinished character held back."""
        self._ids.append(token_id)
        return self._advance(final)

    def flush(self) -> str:
        """What an unfinished character held back, now that no token follows."""
        return self._advance(final=True)

    def _advance(self, final: bool) -> str:
        text = self._tokenizer.decode(self._ids)
        if text.endswith("\ufffd") and not final:  # an incomplete UTF-8 sequence: wait for the next token
            return ""
        delta, self._text = text[len(self._text) :], text
        return delta


class StreamEvents:
    """The server-sent events of one streamed answer, one per generated token.

    An answer handed from a prefill to a decode worker (the router's ``stream_first_token``) is one stream in two
    parts. P (``handoff`` "first") sends the first token's event as any answer's first, but leaves the answer open:
    no finish reason, an unfinished character held back, as if more tokens followed. D (``handoff`` "rest") renders
    that same token the same way, so its text, log-probability offsets and token count run on from it, and sends
    nothing for it unless it ends the answer; then only the finish reason and what P held back.
    """

    def __init__(self, req: GenerationRequest, tokenizer: Tokenizer, handoff: Handoff = "") -> None:
        self._req = req
        self._detok = Detokenizer(tokenizer)
        self._fmt = LogprobsFormat.of(req, tokenizer)
        self._handoff = handoff
        self.count = 0  # tokens rendered, P's included on D: the answer's usage

    def next(self, token: int, finish: str | None, logprobs: TokenLogprobs | None) -> bytes | None:
        """The event of the answer's next token; None when there is nothing to send for it."""
        self.count += 1
        block = None if self._fmt is None else self._fmt.block([token], [logprobs])
        if self._handoff == "first":
            finish = None  # the decode worker ends the answer
        elif self._handoff == "rest" and self.count == 1:
            self._detok.push(token)  # the client has this text from P
            if finish is None:
                return None
            return stream_event(self._req, self._detok.flush(), None, finish, first=False)
        text = self._detok.push(token, final=finish is not None)
        first = self.count == 1  # never on D's side of a handoff: P's event carried the role
        return stream_event(self._req, text, token, finish, first=first, logprobs=block)


class LogprobsFormat:
    """Generated tokens' log-probabilities in OpenAI's shapes (as vLLM fills them).

    Completions: ``{tokens, token_logprobs, top_logprobs, text_offset}``, each
    ``top_logprobs`` entry a dict of the n best tokens plus the chosen one.
    Chat: ``{content: [{token, logprob, bytes, top_logprobs: [...]}]}``. A
    token whose log-probability is unknown (a decode worker given P's first
    token without it) has ``null`` on completions and vLLM's floor on chat.
    One instance per answer: completions' text offsets run on across calls.
    """

    def __init__(self, tokenizer: Tokenizer, chat: bool) -> None:
        self._tokenizer = tokenizer
        self._chat = chat
        self._offset = 0

    @classmethod
    def of(cls, req: GenerationRequest, tokenizer: Tokenizer) -> LogprobsFormat | None:
        """The format of ``req``'s answer; None when it asked for no log-probabilities."""
        return None if req.logprobs is None else cls(tokenizer, req.chat)

    def _text(self, token_id: int) -> str:
        return self._tokenizer.decode([token_id], skip_special_tokens=False)

    def block(self, tokens: Sequence[int], logprobs: Sequence[TokenLogprobs | None]) -> dict[str, Any]:
        if self._chat:
            return {"content": [self._chat_entry(t, lp) for t, lp in zip(tokens, logprobs, strict=True)]}
        out: dict[str, list[Any]] = {"tokens": [], "token_logprobs": [], "top_logprobs": [], "text_offset": []}
        for token, lp in zip(tokens, logprobs, strict=True):
            text = self._text(token)
            out["tokens"].append(text)
            out["text_offset"].append(self._offset)
            self._offset += len(text)
            out["token_logprobs"].append(None if lp is None else lp.logprob)
            out["top_logprobs"].append(
                None if lp is None else {self._text(t): v for t, v in ((token, lp.logprob), *lp.top)}
            )
        return out

    def _chat_entry(self, token: int, lp: TokenLogprobs | None) -> dict[str, Any]:
        text = self._text(token)
        top = (
            []
            if lp is None
            else [
                {"token": (s := self._text(t)), "logprob": v, "bytes": list(s.encode("utf-8", "replace"))}
                for t, v in lp.top
            ]
        )
        return {
            "token": text,
            "logprob": MIN_LOGPROB if lp is None else lp.logprob,
            "bytes": list(text.encode("utf-8", "replace")),
            "top_logprobs": top,
        }


def usage(req: GenerationRequest, completion_tokens: int) -> dict[str, int]:
    n = len(req.prompt_token_ids)
    return {"prompt_tokens": n, "completion_tokens": completion_tokens, "total_tokens": n + completion_tokens}


def full_response(
    req: GenerationRequest,
    text: str,
    token_ids: Sequence[int],
    finish: str | None,
    kv_params: dict[str, Any] | None,
    logprobs: dict[str, Any] | None = None,
) -> dict[str, Any]:
    """The non-streaming body, in OpenAI's shape (plus vLLM's ``kv_transfer_params``)."""
    choice: dict[str, Any] = {"index": 0, "finish_reason": finish, "logprobs": logprobs}
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


def stream_event(
    req: GenerationRequest,
    delta: str,
    token_id: int | None,
    finish: str | None,
    first: bool,
    logprobs: dict[str, Any] | None = None,
) -> bytes:
    """One SSE ``data:`` line of a streaming response."""
    choice: dict[str, Any] = {"index": 0, "finish_reason": finish, "logprobs": logprobs}
    if req.chat:
        choice["delta"] = {"role": "assistant", "content": delta} if first else {"content": delta}
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
    return sse(
        {
            "id": req.request_id,
            "object": "chat.completion.chunk" if req.chat else "text_completion",
            "created": req.created,
            "model": req.model,
            "choices": [],
            "usage": usage(req, completion_tokens),
        }
    )
