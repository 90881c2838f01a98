"""KV codecs for the wire: fewer bytes per chunk on slow links.

A codec encodes one canonical chunk ``[layers, kv, tokens, kv_heads,
head_dim]`` into a self-describing, fully checked frame (pdkv/codec/base.py)
and decodes it back. ``transfer.codec`` names one; ``make_codec(name,
layout)`` builds it for a KV layout or says why it cannot.

| name | exact | bytes vs float32 / 16-bit KV | notes |
| --- | --- | --- | --- |
| ``none`` | yes | 1 / 1 | the default; the transfer path moves the chunk as is |
| ``zstd`` | yes | ~1.19 / ~1.45 on SmolLM2 | byte planes + zstd; extra ``pdkv[zstd]`` |
| ``bf16``, ``fp16`` | no | 2 / - | float32 caches only |
| ``fp8`` | no | ~3.9 / ~2 | e4m3, a power-of-two scale per token and head |
| ``k16v8`` | no | ~2.6 / ~1.3 | keys 16-bit, values fp8 |
| ``int8`` | no | ~3.8 / ~1.9 | uint8 + (min, step) per token and head |
| ``int8-kivi`` | no | ~3.9 / ~1.9 | uint8, keys per channel, values per token and head |

Measured ratios, speeds and fidelity on the default model: ``pdkv bench
codec`` and benchmarks/history/2026-11-23-kv-codecs.md.

How the transfer path uses a codec (pdkv/transfer/: posting.py, incoming.py, protocol.py),
as built; where it differs from the plan it was written from, the difference
is said:

1. Negotiation. ``Hello`` gains ``codecs: list[str]``: the codecs this side can
   run for its layout (``available_codecs(layout)``). The sender's configured
   ``transfer.codec`` must be in the receiver's list, else Hello is refused
   naming the codec and what the peer offers (``check_compatible``). ``Reserve``
   gains ``codec: str = "none"`` (the configured one today; issue 18 part 2's
   policy may pick one per request); the receiver refuses a codec it did not
   offer. ``make_codec`` runs once per peer at Hello, never per chunk.
2. Mode. A codec other than ``none`` always gets ``staging`` mode: direct mode
   writes whole blocks from P's buffer into D's and stays raw, byte for byte.
3. Slot size. Both sides size staging slots (``_Source.slot_bytes``,
   ``_Target.slot_bytes``) as
   ``max(layout.chunk_bytes(chunk_size), codec.max_encoded_bytes(chunk_size))``
   over the codecs in play (a multiple of 16, so slots stay aligned): a frame
   can never overrun a slot whatever the data.
4. Sender, after gather (``ChunkPoster._staged_ops``): for ``codec.passthrough``
   nothing changes (gather straight into the slot, no frame: ``none`` keeps
   today's wire bytes). Otherwise gather into a per-thread scratch chunk
   (``codec.scratch("raw", layout.chunk_shape(n), layout.torch_dtype)``) and
   ``nbytes = codec.encode(chunk, slot)``; the checksum covers
   ``slot[:nbytes]`` (the encoded bytes, what the wire carries); the
   ``TransferOp`` length is ``nbytes``. ``ChunkNotice`` gains ``nbytes``
   (the raw chunk length for ``none``). Encoding runs on the thread calling
   ``send_chunk`` outside the sender's lock, overlapping the previous chunk's
   write; in-flight credit can stay counted in raw bytes (a frame is never
   larger than its slot).
5. Receiver, before the chunk counts as landed (``IncomingTransfer.land``): check
   ``0 < notice.nbytes <= slot_bytes`` (and ``== chunk_bytes(n)`` for
   ``none``) before touching the slot, checksum ``slot[:nbytes]``, then
   ``codec.decode(slot[:nbytes], out=scratch chunk of n tokens)`` and scatter
   that. A ``CodecError`` (a ``TransferError``) fails the request like a
   checksum mismatch: its blocks are freed and D recomputes. Only then is
   ``Landed`` sent and the slot reused. Decode and scatter should run outside
   the receiver's lock: NOT done yet, ``KVReceiver._on_notice`` still calls
   ``land`` under it (decoding a 256-token float32 chunk of the default model
   takes ~1 ms on one core).
6. Metrics: the sender counts ``bytes_raw`` and ``bytes_wire`` (its
   ``stats()``), so the achieved ratio is visible; encode/decode seconds are
   not counted yet.
7. As built: the sender holds ``none`` and its configured codec and may pick
   either per request (``KVSender.open(codec=...)``); the receiver offers every
   codec it can run and sizes its slots for the largest of their frames.

What part 2 (bandwidth-aware disaggregation) needs from here: per codec the
bytes ratio on this model's KV and the encode and decode rates (raw GB/s):
moving KV through a codec pays when ``bytes / min(encode, decode, link *
ratio)`` beats both the raw transfer and the recompute. ``pdkv bench codec
--json`` measures all three; the transfer should count them live (item 6).
"""

from __future__ import annotations

import importlib
import importlib.util
import threading
from typing import TYPE_CHECKING, Any

from pdkv.errors import ConfigError

if TYPE_CHECKING:
    from pdkv.codec.base import Codec
    from pdkv.layout import KVLayout

# Where each codec lives. The codecs (and torch with them) load on first use, not with this package: a process
# that only reads a config naming codecs, like the router, never pays for torch.
_WHERE: dict[str, tuple[str, str]] = {
    "none": ("pdkv.codec.lossless", "NoneCodec"),
    "zstd": ("pdkv.codec.lossless", "ZstdCodec"),
    "bf16": ("pdkv.codec.lossy", "Bf16Codec"),
    "fp16": ("pdkv.codec.lossy", "Fp16Codec"),
    "fp8": ("pdkv.codec.lossy", "Fp8Codec"),
    "k16v8": ("pdkv.codec.lossy", "K16V8Codec"),
    "int8": ("pdkv.codec.lossy", "Int8Codec"),
    "int8-kivi": ("pdkv.codec.lossy", "Int8KiviCodec"),
}
_loaded: dict[str, type[Codec]] = {}
_load_lock = threading.Lock()

CODEC_NAME_PATTERN = "^(" + "|".join(_WHERE) + ")$"
"""What ``transfer.codec`` may be (a config pattern, so a bad name fails at load naming the choices)."""


def _codecs() -> dict[str, type[Codec]]:
    """Every codec class by name, imported (and its wire id registered) the first time one is asked for."""
    with _load_lock:
        if not _loaded:
            from pdkv.codec.base import register_id

            for name, (module, cls_name) in _WHERE.items():
                cls = getattr(importlib.import_module(module), cls_name)
                if cls.name != name:
                    raise ConfigError(
                        f"codec table names {module}.{cls_name} {name!r} but the class calls itself {cls.name!r}"
                    )
                register_id(cls.codec_id, name)
                _loaded[name] = cls
        return _loaded


def __getattr__(name: str) -> Any:
    """``CODECS`` (name -> class) and ``Codec`` load the codecs on first use (see ``_WHERE``)."""
    if name == "CODECS":
        return _codecs()
    if name == "Codec":
        from pdkv.codec.base import Codec

        return Codec
    raise AttributeError(f"module 'pdkv.codec' has no attribute {name!r}")


def codec_names() -> list[str]:
    return list(_WHERE)


def codec_class(name: str) -> type[Codec]:
    """The codec called ``name``; ConfigError naming the choices, or the extra to install."""
    if name not in _WHERE:
        raise ConfigError(f"transfer.codec {name!r} is not a codec; expected one of {', '.join(_WHERE)}")
    cls = _codecs()[name]
    if cls.requires and importlib.util.find_spec(cls.requires[0]) is None:
        module, extra = cls.requires
        raise ConfigError(
            f"transfer.codec {name!r} needs {module}, which is not installed: pip install 'pdkv[{extra}]'"
        )
    return cls


def make_codec(name: str, layout: KVLayout) -> Codec:
    """``name`` built for ``layout``: ConfigError if unknown, not installed, or not for this KV dtype."""
    return codec_class(name)(layout)


def slot_bytes(layout: KVLayout, chunk_size: int, codecs: list[Codec]) -> int:
    """A staging slot's size: a raw chunk, or the largest frame any of ``codecs`` may write for one (a multiple of
    16)."""
    from pdkv.codec.base import align

    return align(max([layout.chunk_bytes(chunk_size), *(c.max_encoded_bytes(chunk_size) for c in codecs)]))


def available_codecs(layout: KVLayout) -> list[str]:
    """Codecs this process can run for ``layout`` (installed, and made for its dtype): what Hello would offer."""
    out = []
    for name, cls in _codecs().items():
        if cls.unsupported(layout) is None and (
            cls.requires is None or importlib.util.find_spec(cls.requires[0]) is not None
        ):
            out.append(name)
    return out


__all__ = [
    "CODECS",
    "CODEC_NAME_PATTERN",
    "Codec",
    "available_codecs",
    "codec_class",
    "codec_names",
    "make_codec",
    "slot_bytes",
]
