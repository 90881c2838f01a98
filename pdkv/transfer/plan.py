"""A transfer's chunks worked out once, when its blocks on both sides are known: ``TransferPlan``.

Every chunk of a request touches the same blocks whenever it is sent or lands, so neither side needs to
derive them again per chunk. P's ``KVSender.open`` builds its plan (and checks its block table) before it
reserves, ``OutgoingTransfer`` pairs it with D's blocks when the reservation answers (``with_peer``) and makes
every chunk's direct write (``writes``: both sides' block ids as arrays, a ``BlockWrite``), and each ``send_chunk``
takes its chunk's (our blocks for the checksum, the write); D's ``IncomingBook.open`` builds one at admission (its
blocks only) and each landing takes its chunk's tokens and blocks.
A write's runs (``BlockWrite.runs``, where a channel needs ops) are the same as ``pdkv.layout.block_runs``'s on its
chunk's blocks (a test compares them on random tables): a run breaks wherever our id or theirs does not step by one.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np

from pdkv.channels.handle import BlockWrite
from pdkv.errors import TransferError
from pdkv.keys import chunk_spans


@dataclass(frozen=True, kw_only=True)
class TransferPlan:
    """Per chunk: its ``(first token, tokens)``, our block ids, and (given the peer's blocks) its direct write."""

    spans: list[tuple[int, int]]
    bounds: list[tuple[int, int]]  # each chunk's blocks as a slice of the table: [first, last)
    table: list[int]  # our block ids the transfer uses
    blocks: list[list[int]]
    theirs: list[int]  # the peer's block ids in the order of ours; empty until ``with_peer``

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
    ) -> TransferPlan:
        """The chunks of ``num_tokens`` in chunks of ``chunk_size`` over our blocks (``ours``, of ``block_size``).

        Raises ``TransferError`` unless every block the transfer uses is one of our ``num_blocks``: checked here
        once for every chunk.
        """
        spans = list(chunk_spans(num_tokens, chunk_size))
        need = -(-num_tokens // block_size)
        table = list(ours[:need])
        if len(table) < need or (need and (min(table) < 0 or max(table) >= num_blocks)):
            raise TransferError(
                f"transfer {transfer_id!r}: block table {table} does not give {num_tokens} tokens' {need} blocks "
                f"inside our {num_blocks} blocks"
            )
        bounds = [(start // block_size, -(-(start + n) // block_size)) for start, n in spans]
        return cls(spans=spans, bounds=bounds, table=table, blocks=[table[a:b] for a, b in bounds], theirs=[])

    def with_peer(self, theirs: Sequence[int]) -> TransferPlan:
        """This plan paired with the peer's blocks ``theirs`` (its block ids in the order of ours). Raises
        ``TransferError`` if the peer holds fewer blocks than the transfer needs."""
        ours, theirs = self.table, list(theirs[: len(self.table)])
        if len(theirs) < len(ours):
            raise TransferError(f"the peer holds {len(theirs)} blocks for a transfer of {len(ours)}")
        return TransferPlan(spans=self.spans, bounds=self.bounds, table=ours, blocks=self.blocks, theirs=theirs)

    def writes(self, local: Sequence[int], remote: Sequence[int], block_bytes: int) -> list[BlockWrite]:
        """Each chunk's direct write (none before ``with_peer``): its blocks of every buffer tensor (``local[t]`` to
        ``remote[t]``, regions) as arrays, for ``Channel.write_blocks``; their ops (``BlockWrite.ops``) are the
        chunk's runs tensor by tensor, the order both sides' checksums read the bytes in."""
        if not self.theirs:
            return []
        ours, theirs = np.asarray(self.table, dtype=np.int64), np.asarray(self.theirs, dtype=np.int64)
        here, there = tuple(local), tuple(remote)
        return [BlockWrite(here, there, ours[a:b], theirs[a:b], block_bytes) for a, b in self.bounds]
