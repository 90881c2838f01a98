"""A transfer's chunks worked out once, when its blocks on both sides are known: ``TransferPlan``.

Every chunk of a request touches the same blocks whenever it is sent or lands, so neither side needs to
derive them again per chunk. P's ``KVSender.open`` builds its plan (and checks its block table) before it
reserves, ``OutgoingTransfer`` pairs it with D's blocks when the reservation answers (``with_peer``), its
``ChunkPoster`` makes every chunk's direct write (``writes``: both sides' block ids as arrays, a ``BlockWrite``), and
each ``post`` takes its chunk's (our blocks for the checksum, the write); D's ``IncomingBook.open`` builds one at
admission (its blocks only) and each landing takes its chunk's tokens and blocks.
A transfer that starts past what D already holds (``held``, ``protocol.Reserved.held_tokens``) has chunks that
start at ``held`` (the first one there, each ``chunk_size`` on) over the blocks from the one holding token ``held``.
A staged chunk of a head window or of a packed layout moves up to the end of its last block (``whole_blocks``): both
sides cut their chunks by that one rule.
A write's runs (``BlockWrite.runs``, where a channel needs ops) are the same as ``pdkv.layout.block_runs``'s on its
chunk's blocks (a test compares them on random tables): a run breaks wherever our id or theirs does not step by one.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np

from pdkv.channels.handle import BlockWrite
from pdkv.errors import TransferError
from pdkv.keys import chunk_spans
from pdkv.layout import KVLayout


@dataclass(frozen=True, kw_only=True)
class TransferPlan:
    """Per chunk: its ``(first token, tokens)``, our block ids, and (given the peer's blocks) its direct write."""

    spans: list[tuple[int, int]]  # (first token in the prompt, tokens)
    bounds: list[tuple[int, int]]  # each chunk's blocks as a slice of the table: [first, last)
    table: list[int]  # our block ids the transfer uses, the first one holding token ``table_start``
    blocks: list[list[int]]
    theirs: list[int]  # the peer's block ids in the order of ours; empty until ``with_peer``
    table_start: int = 0  # the prompt's token at the start of the table's first block

    @property
    def num_chunks(self) -> int:
        return len(self.spans)

    @classmethod
    def build(
        cls,
        transfer_id: str,
        *,
        num_tokens: int,
        chunk_size: int,
        block_size: int,
        ours: Sequence[int],
        num_blocks: int,
        held: int = 0,
    ) -> TransferPlan:
        """The tokens ``[held, num_tokens)`` in chunks of ``chunk_size`` from ``held`` over our blocks (``ours``, of
        ``block_size``, the first one holding token ``held``: the request's whole table when ``held`` is 0).

        Raises ``TransferError`` unless ``held`` is below ``num_tokens`` and every block the transfer uses is one of
        our ``num_blocks``: checked here once for every chunk.
        """
        if not 0 <= held < num_tokens:
            raise TransferError(f"transfer {transfer_id!r}: {held} tokens held of {num_tokens}: nothing left to move")
        first_block = held // block_size
        spans = [(held + start, n) for start, n in chunk_spans(num_tokens - held, chunk_size)]
        need = -(-num_tokens // block_size) - first_block
        table = list(ours[:need])
        if len(table) < need or (need and (min(table) < 0 or max(table) >= num_blocks)):
            raise TransferError(
                f"transfer {transfer_id!r}: block table {table} does not give tokens {held} to {num_tokens} their "
                f"{need} blocks inside our {num_blocks} blocks"
            )
        bounds = [(s // block_size - first_block, -(-(s + n) // block_size) - first_block) for s, n in spans]
        return cls(
            spans=spans,
            bounds=bounds,
            table=table,
            blocks=[table[a:b] for a, b in bounds],
            theirs=[],
            table_start=first_block * block_size,
        )

    def with_peer(self, theirs: Sequence[int]) -> TransferPlan:
        """This plan paired with the peer's blocks ``theirs`` (its block ids in the order of ours). Raises
        ``TransferError`` if the peer holds fewer blocks than the transfer needs."""
        ours, theirs = self.table, list(theirs[: len(self.table)])
        if len(theirs) < len(ours):
            raise TransferError(f"the peer holds {len(theirs)} blocks for a transfer of {len(ours)}")
        return dataclasses.replace(self, theirs=theirs)

    def writes(self, local: Sequence[int], remote: Sequence[int], block_bytes: int) -> list[BlockWrite]:
        """Each chunk's direct write (none before ``with_peer``): its blocks of every buffer tensor (``local[t]`` to
        ``remote[t]``, regions) as arrays, for ``Channel.write_blocks``; their ops (``BlockWrite.ops``) are the
        chunk's runs tensor by tensor, the order both sides' checksums read the bytes in."""
        if not self.theirs:
            return []
        ours, theirs = np.asarray(self.table, dtype=np.int64), np.asarray(self.theirs, dtype=np.int64)
        here, there = tuple(local), tuple(remote)
        return [BlockWrite(here, there, ours[a:b], theirs[a:b], block_bytes) for a, b in self.bounds]


def whole_blocks(layout: KVLayout, mode: str, window: bool) -> bool:
    """Whether a transfer's staged chunks move whole blocks (``KVLayout.whole_blocks``): a head window's, and a
    packed layout's (``KVLayout.packed``); both sides hold the same layout but for its heads (``admission.admit``)."""
    return window or (mode == "staging" and layout.packed)
