"""Control-plane messages: msgspec tagged structs, msgpack over pyzmq ROUTER/DEALER, every one in this file.

Sender -> receiver: Hello, Auth, Reserve, Heartbeat, Cancel, Done, ReturnPool. Receiver -> sender: Hello, Reserved,
Refused, Landed, Pool, BeatAck, Cancel, Error. Chunk payloads never travel here: they go over the channel, each followed
by a ``ChunkNotice`` (which carries the Reserve of a request written into the sender's pool, see ``Pool``). A change
of any message is a ``PROTOCOL_VERSION`` bump (README.md here, "Names").

With a shared secret, every message after the handshake travels with a tag frame that binds it to the session
(``pdkv.transfer.control``, "Sessions"): only what ``needs_session`` exempts is taken without one.
"""

from __future__ import annotations

from typing import Annotated, Literal

import msgspec
from msgspec import Meta

from pdkv.auth import PROOF_BYTES, message_tag, transcript, verify_tag
from pdkv.errors import HandshakeError, NoticeForged, ProtocolError
from pdkv.layout import HeadWindow, KVLayout

# 4: the id of a transfer is ``transfer_id`` on the wire (it was ``request_id``, the HTTP request's name), and a
# chunk's checksum is ``pdkv.checksum.chunk_checksum`` (computed on the device holding the bytes; was xxh3-64).
# 5: pre-granted pools (``Pool``, ``ReturnPool``, a ``ChunkNotice`` carrying its request's ``Reserve``).
# 6: the ``Landed`` of a pooled request carries the sender's next ``Pool``.
# 7: with a secret every message after the handshake carries a session tag frame; heartbeats are numbered and
# acknowledged (``BeatAck``): the sender counts a lease renewed when the receiver says it was.
# 8: a ``Reserved`` says how many leading tokens the receiver already holds (``held_tokens``, its prefix cache's
# hit): the sender pushes only the rest. A peer of 7 would push every chunk into the blocks granted past the hit.
# 9: peers may hold different numbers of KV heads; a ``Reserve`` names the receiver's window of them (``heads``). A
# peer of 8 would refuse the Hello of a tensor-parallel rank of another size, or write all its heads into ours.
# 10: the handshake's proofs are bound to its transcript (``hello_transcript``: both Hellos whole), and with a secret a
# chunk notice carries a tag under the session key (``seal_notice``). A peer of 9 proves only the nonces.
PROTOCOL_VERSION = 11  # 11: a chunk's verdict on its data connection (``ChunkVerdict``), where the channel carries it

MAX_MESSAGE_BYTES = 1 << 20
MAX_ID_LEN = 256
MAX_CHUNKS = 1 << 20  # chunks of one request (a request of 256-token chunks up to 268M tokens)
# Completed transfers one heartbeat reports, as many as fit a quarter of a message at the longest ids; past it the
# oldest go unsaid (a Done lets the receiver free at once a reservation that lapsed unclaimed; without it, the hold)
MAX_DONE_PER_BEAT = MAX_MESSAGE_BYTES // (4 * MAX_ID_LEN)
MAX_DONE_ACCEPTED = 4096  # what a Heartbeat of protocol 11 may list: a sender from before the bound above sends more

# The reason a receiver gives for refusing a Reserve from a peer it has no Hello from (it restarted):
# a sender that sees it handshakes again once, instead of failing the request.
HELLO_REQUIRED = "hello-required"

TransferId = Annotated[str, Meta(min_length=1, max_length=MAX_ID_LEN)]
NonNegInt = Annotated[int, Meta(ge=0)]


class Hello(msgspec.Struct, tag="hello", forbid_unknown_fields=True):
    """Who a peer is and what its KV looks like; refused when incompatible."""

    protocol_version: int
    agent: Annotated[str, Meta(max_length=MAX_ID_LEN)]
    model_fingerprint: str
    layout: KVLayout
    chunk_size: Annotated[int, Meta(ge=1)]
    channel: str
    channel_metadata: bytes
    kv_regions: list[NonNegInt]
    staging_region: int = -1
    nonce: Annotated[bytes, Meta(max_length=64)] = b""
    auth: Annotated[bytes, Meta(max_length=64)] = b""
    # The sender's capability token for this receiver: its data connections present it, and the receiver
    # grants each of its reservations' blocks to that token alone (``pdkv.channels.grants.Grants``).
    data_token: Annotated[bytes, Meta(max_length=64)] = b""
    # The KV codecs this side can run for its layout (``pdkv.codec.available_codecs``): a sender configured
    # with one the receiver lacks is refused at the handshake, not at its first request.
    codecs: Annotated[list[Annotated[str, Meta(max_length=32)]], Meta(max_length=64)] = []


class Auth(msgspec.Struct, tag="auth", forbid_unknown_fields=True):
    """The sender's proof of the shared secret, over the handshake's transcript (sent after the receiver's Hello)."""

    proof: Annotated[bytes, Meta(max_length=64)]


class Reserve(msgspec.Struct, tag="reserve", forbid_unknown_fields=True):
    """Ask for room for a whole request's KV, all or nothing.

    ``prompt_key`` is the chained key (``pdkv.keys``) of the prompt whose KV
    the sender will write: the receiver hands it over with the KV, and the
    decode side adopts the KV only for a prompt with the same key, so KV is
    bound to the prompt it was computed from, not to what a client claims.
    With a shared secret, ``proof`` binds it (and the request) to the peer that
    proved the secret at Hello (``pdkv.auth.bound_proof`` over the handshake's transcript).
    """

    transfer_id: TransferId
    num_tokens: Annotated[int, Meta(ge=1, le=1 << 40)]
    prompt_key: Annotated[bytes, Meta(max_length=64)] = b""
    proof: Annotated[bytes, Meta(max_length=64)] = b""
    codec: Annotated[str, Meta(max_length=32)] = "none"  # how this request's chunks are encoded (staging mode only)
    # The receiver's heads the chunks carry (tensor parallel of different sizes: pdkv.layout.HeadWindow); None:
    # all of them, and then both sides hold the same heads. A window is always staged.
    heads: HeadWindow | None = None


def reserve_fields(msg: Reserve) -> tuple[bytes, ...]:
    """What a Reserve's ``proof`` covers, in order."""
    window = b"" if msg.heads is None else b"%d:%d" % (msg.heads.first, msg.heads.count)
    return msg.transfer_id.encode(), msg.num_tokens.to_bytes(8, "little"), msg.prompt_key, msg.codec.encode(), window


class Reserved(msgspec.Struct, tag="reserved", forbid_unknown_fields=True):
    """Room granted. ``mode`` says where chunks land.

    ``direct``: chunks are written block by block straight into
    ``block_ids`` (same layout on both sides). ``staging``: each chunk is
    written in canonical form into one of ``staging_slots`` (byte offsets in
    the receiver's staging region) and scattered in by the receiver.

    ``held_tokens``: the prompt's leading tokens the receiver already holds (its own prefix cache hit, a whole
    number of its blocks, fewer than the prompt): the sender pushes only tokens ``[held_tokens, num_tokens)``, in
    chunks that start there, and ``block_ids`` are the blocks past them.
    """

    transfer_id: TransferId
    mode: Literal["direct", "staging"]
    block_ids: list[NonNegInt]
    staging_slots: list[NonNegInt]
    lease_s: Annotated[float, Meta(gt=0, le=86400)]  # the sender stops writing once it may have lapsed
    held_tokens: NonNegInt = 0


class Refused(msgspec.Struct, tag="refused", forbid_unknown_fields=True):
    """No room. ``retryable``: room may free up (other requests finish); else it never fits."""

    transfer_id: TransferId
    reason: str
    retryable: bool = False


class Landed(msgspec.Struct, tag="landed", forbid_unknown_fields=True):
    """Chunks arrived and verified; their staging slots (if any) are free again.

    The receiver acknowledges every chunk it verified in one pass at once, so
    a request whose chunks land together costs one message, not one per chunk.
    ``pool``: the sender's next pool, when this completes a request written into
    its last one: no message of its own, and the sender holds it before its caller
    hears the request is done, so a next request at once finds it.
    """

    transfer_id: TransferId
    chunk_indices: Annotated[list[NonNegInt], Meta(min_length=1, max_length=MAX_CHUNKS)]
    pool: Pool | None = None


class Pool(msgspec.Struct, tag="pool", forbid_unknown_fields=True):
    """Blocks granted ahead to one sender (``transfer.pool_tokens``): a one-chunk request may be written into
    them before it is reserved, its Reserve travelling in the chunk's notice (README.md here, "Pools").

    ``generation`` names this grant: a claim of an older one is refused. The sender holds it on the lease
    its heartbeats renew, and uses it for one request; the receiver grants the next one after that.
    ``staging_slot``: where a request's chunk is written when the receiver cannot take it in place (another block
    size or order, KV its channel cannot reach): a staging slot (a byte offset in the receiver's staging region,
    as ``Reserved.staging_slots``) granted to the sender, scattered into ``block_ids`` on landing; None: the
    chunk is written into ``block_ids``, which are granted.
    """

    generation: Annotated[int, Meta(ge=1)]
    block_ids: Annotated[list[NonNegInt], Meta(min_length=1, max_length=MAX_CHUNKS)]
    lease_s: Annotated[float, Meta(gt=0, le=86400)]
    staging_slot: NonNegInt | None = None


class ReturnPool(msgspec.Struct, tag="return_pool", forbid_unknown_fields=True):
    """Sender: it will not write into this pool (it closes): the receiver takes its blocks back now."""

    generation: Annotated[int, Meta(ge=1)]


class Heartbeat(msgspec.Struct, tag="heartbeat", forbid_unknown_fields=True):
    """Renews the leases of the sender's open reservations, and of its pool at this receiver; answered by a
    ``BeatAck`` of the same ``seq``. The sender counts the leases renewed only once that answer arrives: a
    beat that went out is not one that arrived (a one-way partition loses the answers, not the beats)."""

    transfer_ids: list[TransferId]
    seq: Annotated[int, Meta(ge=1)]
    # transfers of this sender that completed (every chunk verified) since its last beat: their ``Done``, which
    # costs a request no message of its own (a complete transfer's memory is the decode side's already)
    done: Annotated[list[TransferId], Meta(max_length=MAX_DONE_ACCEPTED)] = []


class BeatAck(msgspec.Struct, tag="beat_ack", forbid_unknown_fields=True):
    """Receiver: the heartbeat ``seq`` arrived and renewed what it named."""

    seq: Annotated[int, Meta(ge=1)]


class Cancel(msgspec.Struct, tag="cancel", forbid_unknown_fields=True):
    """Either side abandons a request. From the sender it also means: no more writes, unless ``writes_may_land``:
    it gave up on a write its channel could not call back (the receiver then holds the memory its full
    late-write quarantine)."""

    transfer_id: TransferId
    reason: str
    writes_may_land: bool = False


class Done(msgspec.Struct, tag="done", forbid_unknown_fields=True):
    """Sender: every write for this request has settled; none will follow."""

    transfer_id: TransferId
    ok: bool


class Error(msgspec.Struct, tag="error", forbid_unknown_fields=True):
    """A message could not be handled; ``message`` says why."""

    message: str


Message = (
    Hello
    | Auth
    | Reserve
    | Reserved
    | Refused
    | Landed
    | Pool
    | ReturnPool
    | Heartbeat
    | BeatAck
    | Cancel
    | Done
    | Error
)


def needs_session(msg: Message) -> bool:
    """Whether ``msg`` is taken only with a valid session tag once there is a session (with a secret).

    The handshake's own messages are not: they are sent before the keys exist and carry their own proofs. Nor is
    a ``Refused`` that says ``HELLO_REQUIRED`` (a receiver that restarted holds no key to tag it with): all it can
    do is start a new handshake, which proves the secret again. An ``Error`` carries no authority either: it ends
    a handshake still waiting, and is only logged after one.
    """
    if isinstance(msg, (Hello, Auth, Error)):
        return False
    return not (isinstance(msg, Refused) and msg.reason.startswith(HELLO_REQUIRED))


class ChunkNotice(msgspec.Struct, array_like=True, forbid_unknown_fields=True):
    """The notification that follows a chunk's bytes over the channel."""

    transfer_id: TransferId
    chunk_index: NonNegInt
    checksum: NonNegInt
    slot: int  # staging slot index, or -1 for a direct write
    nbytes: NonNegInt = 0  # bytes written into the slot (an encoded chunk's frame); 0 for a direct write
    # A request written into the sender's pool: its Reserve, and the generation of the pool it took its blocks
    # from. The receiver admits it (``admission.admit_pooled``) before the chunk counts; refused, the bytes
    # are discarded.
    reserve: Reserve | None = None
    pool: NonNegInt = 0


Outcome = Literal["landed", "mismatch", "failed", "refused", "gone"]
"""What became of a chunk at the receiver: verified and counted; its checksum did not match, or it broke another
rule (out of range, a repeat, a bad slot): the transfer failed; its pooled Reserve was refused (nothing reserved,
the bytes discarded); or the reservation it names no longer receives (failed, cancelled, reaped, unknown).
``reason`` says which."""


class ChunkVerdict(msgspec.Struct, array_like=True, forbid_unknown_fields=True):
    """The receiver's word on one chunk, sent back on the data connection that carried it, by the thread that
    landed it (a channel that carries answers: tcp's ANSWER frame). It stands for the ``Landed`` (or the
    ``Refused``/``Cancel``) the control plane would carry, so a request costs no control message on its way:
    the sender applies it on the thread that reads it. ``pool``: the sender's next pool when this chunk took its
    last one (as ``Landed.pool``)."""

    transfer_id: TransferId
    chunk_index: NonNegInt
    outcome: Outcome
    reason: Annotated[str, Meta(max_length=1024)] = ""
    pool: Pool | None = None


_encoder = msgspec.msgpack.Encoder()
_decoder = msgspec.msgpack.Decoder(Message)
_notice_decoder = msgspec.msgpack.Decoder(ChunkNotice)
_verdict_decoder = msgspec.msgpack.Decoder(ChunkVerdict)


def encode(msg: Message | ChunkNotice) -> bytes:
    return _encoder.encode(msg)


def decode(data: bytes) -> Message:
    """Decode one control message; anything malformed raises ``ProtocolError``."""
    if len(data) > MAX_MESSAGE_BYTES:
        raise ProtocolError(f"control message of {len(data)} bytes exceeds the {MAX_MESSAGE_BYTES} byte limit")
    try:
        return _decoder.decode(data)
    except (msgspec.DecodeError, msgspec.ValidationError) as exc:
        raise ProtocolError(f"malformed control message: {exc}") from None


def decode_notice(data: bytes) -> ChunkNotice:
    try:
        return _notice_decoder.decode(data)
    except (msgspec.DecodeError, msgspec.ValidationError) as exc:
        raise ProtocolError(f"malformed chunk notification: {exc}") from None


_NOTICE = "notice"  # the tag's direction: a notice only ever goes from sender to receiver


def seal_notice(notice: ChunkNotice, key: bytes) -> bytes:
    """A notice's bytes, followed (with a session key) by their tag under it.

    The notice vouches for the chunk (its checksum) and names where it counts (transfer id, index, the
    pooled Reserve): on the data connection, untagged, whoever sits on the path could rewrite the KV and its
    checksum together. Tagged, only the peer that proved the secret in this session can have written it.
    """
    data = _encoder.encode(notice)
    return data + message_tag(key, _NOTICE, data) if key else data


def open_notice(data: bytes, keys: list[bytes] | None) -> tuple[ChunkNotice, bytes]:
    """The notice in a notification, and the session key it was tagged under (b"" without a secret); ``keys``: the
    session keys of the peers it may come from (None: no secret, nothing to check). The receiver answers the notice
    under the same key: that session's sender is the one that can check the answer. A notice without a tag under one
    of them raises ``NoticeForged``."""
    if keys is None:
        return decode_notice(data), b""
    body, tag = data[:-PROOF_BYTES], data[-PROOF_BYTES:]
    key = next((k for k in keys if verify_tag(k, _NOTICE, body, tag)), None) if len(data) > PROOF_BYTES else None
    if key is None:
        raise NoticeForged(
            "chunk notification without a valid session tag: not written by a peer that proved the shared secret in a "
            "live session (a relay on the path, or a sender whose session ended)"
        )
    return decode_notice(body), key


_VERDICT = "verdict"  # and a verdict only ever from receiver to sender: neither can pass for the other


def seal_verdict(verdict: ChunkVerdict, key: bytes) -> bytes:
    """A verdict's bytes, followed (with a session key) by their tag under it: on a clear data connection whoever
    sits on the path could otherwise tell the sender that chunks landed which never did."""
    data = _encoder.encode(verdict)
    return data + message_tag(key, _VERDICT, data) if key else data


def open_verdict(data: bytes, key: bytes | None) -> ChunkVerdict:
    """The verdict in an answer; ``key``: the session key it must be tagged under (None: no secret). Raises
    ``NoticeForged`` for a missing or wrong tag and ``ProtocolError`` for a malformed verdict."""
    if key is not None:
        body, tag = data[:-PROOF_BYTES], data[-PROOF_BYTES:]
        if len(data) <= PROOF_BYTES or not verify_tag(key, _VERDICT, body, tag):
            raise NoticeForged(
                "chunk verdict without a valid session tag: not written by the receiver this session proved "
                "(a relay on the path)"
            )
        data = body
    try:
        return _verdict_decoder.decode(data)
    except (msgspec.DecodeError, msgspec.ValidationError) as exc:
        raise ProtocolError(f"malformed chunk verdict: {exc}") from None


def hello_transcript(sender: Hello, receiver: Hello) -> bytes:
    """What both proofs of a handshake cover: the sender's Hello and the receiver's, whole but for the proofs.

    Agent, channel metadata (where the KV goes), layout, data token and both nonces: a relay that changes any
    of it leaves the two sides with different transcripts, and no proof checks out across them. Each side
    hashes the Hellos as it sent and decoded them; msgspec encodes a struct the same way on both.
    """
    return transcript(*(_encoder.encode(msgspec.structs.replace(h, auth=b"")) for h in (sender, receiver)))


def make_hello(
    *,
    agent: str,
    channel: str,
    channel_metadata: bytes,
    fingerprint: str,
    layout: KVLayout,
    chunk_size: int,
    kv_regions: list[int],
    staging_region: int,
    codecs: tuple[str, ...] | list[str] = ("none",),
) -> Hello:
    """Our side's Hello: identical construction for sender and receiver (nonce and proof are added per peer)."""
    return Hello(
        codecs=list(codecs),
        protocol_version=PROTOCOL_VERSION,
        agent=agent,
        model_fingerprint=fingerprint,
        layout=layout,
        chunk_size=chunk_size,
        channel=channel,
        channel_metadata=channel_metadata,
        kv_regions=kv_regions,
        staging_region=staging_region,
    )


def check_compatible(ours: Hello, theirs: Hello, role: Literal["prefill", "decode"]) -> None:
    """Raise ``HandshakeError`` naming every field that makes the peers incompatible; ``role`` is our side's, so
    a KV dtype or MLA mismatch says which side runs what ("prefill's KV cache is float8_e4m3fn, this decode's
    is bfloat16")."""
    peer_role = "decode" if role == "prefill" else "prefill"
    diffs = []
    if ours.protocol_version != theirs.protocol_version:
        diffs.append(
            f"protocol_version (ours {ours.protocol_version}, peer {theirs.protocol_version}: run one pdkv release on "
            "prefill and decode)"
        )
    for field in ("model_fingerprint", "chunk_size", "channel"):
        a, b = getattr(ours, field), getattr(theirs, field)
        if a != b:
            diffs.append(f"{field} (ours {a!r}, peer {b!r})")
    # the head count is agreed per transfer (``Reserve.heads``): tensor-parallel ranks of different sizes differ in it
    diffs.extend(ours.layout.wire_mismatches(theirs.layout, us=f"this {role}", them=peer_role, heads=False))
    if diffs:
        raise HandshakeError(f"peer {theirs.agent!r} is incompatible: " + "; ".join(diffs))


__all__ = [
    "HELLO_REQUIRED",
    "PROTOCOL_VERSION",
    "ChunkNotice",
    "ChunkVerdict",
    "Outcome",
    "Message",
    "check_compatible",
    "decode",
    "decode_notice",
    "hello_transcript",
    "open_notice",
    "open_verdict",
    "seal_notice",
    "seal_verdict",
    "encode",
    "needs_session",
]
