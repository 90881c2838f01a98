"""Text <-> token ids and the model's chat template.

Workers speak OpenAI's API, so they need three things from a model besides
its weights: encode a prompt, decode generated ids (also piece by piece for
streaming), and turn a chat into a prompt the way the model was trained to
see it. This wraps a Hugging Face ``tokenizers.Tokenizer`` (the fast Rust
tokenizer, no transformers needed) and renders the chat template with
jinja2 the way transformers does, so the prompt a user gets here is the
prompt they would get from transformers.

It lives outside ``pdkv.engine`` (which needs torch): the router encodes
prompts and renders chats with this same code to match them against the
workers' KV events (``router.tokenizer``), and never imports the engine.
"""

from __future__ import annotations

import functools
import json
from collections.abc import Mapping, Sequence
from datetime import datetime
from pathlib import Path
from typing import Any

import jinja2
import jinja2.sandbox
import tokenizers

from pdkv.errors import InvalidRequestError, ModelLoadError
from pdkv.modelfiles.jsonfile import read_json

Message = Mapping[str, Any]


class Tokenizer:
    """A model's tokenizer, special tokens and chat template."""

    def __init__(
        self,
        backend: tokenizers.Tokenizer,
        *,
        chat_template: str | None = None,
        bos_token: str | None = None,
        eos_token: str | None = None,
    ) -> None:
        self.backend = backend
        self.chat_template = chat_template
        self.bos_token = bos_token
        self.eos_token = eos_token
        self._template: jinja2.Template | None = _compile(chat_template) if chat_template else None

    # -- loading and saving ------------------------------------------------
    @classmethod
    def from_hf_dir(cls, path: Path) -> Tokenizer:
        """Read ``tokenizer.json`` and the chat template/special tokens of ``tokenizer_config.json``."""
        tok_file = path / "tokenizer.json"
        if not tok_file.is_file():
            raise ModelLoadError(
                f"{path} has no tokenizer.json; the reference engine needs a fast (tokenizers) tokenizer next to the "
                "weights"
            )
        try:
            backend = tokenizers.Tokenizer.from_file(str(tok_file))
        except Exception as exc:  # tokenizers raises plain Exception subclasses for bad files
            raise ModelLoadError(f"cannot read {tok_file}: {exc}") from exc
        cfg = read_json(path / "tokenizer_config.json")
        template_file = path / "chat_template.jinja"
        template = template_file.read_text() if template_file.is_file() else _pick_template(cfg.get("chat_template"))
        return cls(
            backend,
            chat_template=template,
            bos_token=_token_text(cfg.get("bos_token")),
            eos_token=_token_text(cfg.get("eos_token")),
        )

    def save(self, path: Path) -> None:
        """Write ``tokenizer.json`` and ``tokenizer_config.json`` (readable by transformers too)."""
        self.backend.save(str(path / "tokenizer.json"))
        cfg = {
            "tokenizer_class": "PreTrainedTokenizerFast",
            "bos_token": self.bos_token,
            "eos_token": self.eos_token,
            "chat_template": self.chat_template,
        }
        (path / "tokenizer_config.json").write_text(json.dumps(cfg, indent=2))

    # -- ids ---------------------------------------------------------------
    @property
    def vocab_size(self) -> int:
        return int(self.backend.get_vocab_size(with_added_tokens=True))

    def token_id(self, token: str | None) -> int | None:
        return None if token is None else self.backend.token_to_id(token)

    @property
    def eos_token_id(self) -> int | None:
        return self.token_id(self.eos_token)

    def encode(self, text: str, add_special_tokens: bool = True) -> list[int]:
        """Token ids of ``text``; ``add_special_tokens`` adds what the tokenizer's post-processor adds (e.g. BOS).

        Through ``encode_batch``, which releases the GIL (``encode`` holds it: a long prompt
        tokenized on a worker's thread would freeze its event loop, health checks included).
        """
        return list(self.backend.encode_batch([text], add_special_tokens=add_special_tokens)[0].ids)

    @functools.cached_property
    def max_token_bytes(self) -> int:
        """An upper bound of the UTF-8 bytes of text one token covers: a prompt longer than
        ``n * max_token_bytes`` bytes has more than ``n`` tokens, known without tokenizing it
        (tokenizing is what costs: about 400 bytes of memory and a microsecond per token).

        Each token's own text, decoded (a byte-level token that ends inside a character decodes
        to U+FFFD, longer than the byte it stands for: still a bound); a normalizer may shrink
        text before it is split (NFKC folds some characters into shorter ones), so then the bound
        is four times as loose.
        """
        size = self.backend.get_vocab_size(with_added_tokens=True)
        texts = self.backend.decode_batch([[i] for i in range(size)], skip_special_tokens=False)
        longest = max((len(t.encode("utf-8")) for t in texts), default=1)
        return max(1, longest) * (1 if self.backend.normalizer is None else 4)

    def decode(self, ids: Sequence[int], skip_special_tokens: bool = True) -> str:
        return str(self.backend.decode(list(ids), skip_special_tokens=skip_special_tokens))

    def decode_stream(self, skip_special_tokens: bool = True) -> tokenizers.decoders.DecodeStream:
        """An incremental decoder for streaming: ``step(backend, id)`` returns new text or None.

        Decoding one id at a time splits multi-byte characters; this holds
        bytes back until they form whole characters.
        """
        return tokenizers.decoders.DecodeStream(skip_special_tokens=skip_special_tokens)

    # -- chat --------------------------------------------------------------
    def render_chat(
        self, messages: Sequence[Message], add_generation_prompt: bool = True, tools: Sequence[Message] | None = None
    ) -> str:
        """The prompt text for ``messages`` (and ``tools``, for templates that render them) under the model's
        chat template."""
        if self._template is None:
            raise InvalidRequestError("this model has no chat template; send a plain prompt to /v1/completions instead")
        try:
            return self._template.render(
                messages=list(messages),
                tools=tools,
                add_generation_prompt=add_generation_prompt,
                bos_token=self.bos_token or "",
                eos_token=self.eos_token or "",
            )
        except (
            jinja2.TemplateError,
            TypeError,
            ValueError,
            LookupError,
            AttributeError,
        ) as exc:  # the messages' data, as the template reads it
            raise InvalidRequestError(f"chat template rejected the messages: {exc}", param="messages") from exc

    def encode_chat(
        self, messages: Sequence[Message], add_generation_prompt: bool = True, tools: Sequence[Message] | None = None
    ) -> list[int]:
        """Token ids of a chat; special tokens come from the template itself, never added twice."""
        return self.encode(self.render_chat(messages, add_generation_prompt, tools), add_special_tokens=False)


def _raise(message: str) -> None:
    raise jinja2.TemplateError(message)


def _compile(source: str) -> jinja2.Template:
    """Compile like transformers does: sandboxed, trim/lstrip blocks, its helper globals."""
    env = jinja2.sandbox.ImmutableSandboxedEnvironment(
        trim_blocks=True, lstrip_blocks=True, extensions=["jinja2.ext.loopcontrols"]
    )
    env.filters["tojson"] = lambda value, indent=None: json.dumps(value, ensure_ascii=False, indent=indent)
    env.globals["raise_exception"] = _raise
    env.globals["strftime_now"] = lambda fmt: datetime.now().strftime(fmt)
    try:
        return env.from_string(source)
    except jinja2.TemplateError as exc:
        raise ModelLoadError(f"the model's chat template does not compile: {exc}") from exc


def _pick_template(value: Any) -> str | None:
    """``chat_template`` is a string, or a list of named templates of which we use ``default``."""
    if value is None or isinstance(value, str):
        return value
    named = {t.get("name"): t.get("template") for t in value if isinstance(t, Mapping)}
    return named.get("default")


def _token_text(value: Any) -> str | None:
    """Special tokens in tokenizer_config.json are a string or an AddedToken dict."""
    if isinstance(value, Mapping):
        return value.get("content")
    return value
