"""A transfer's chunks worked out once, when its blocks on both sides are known: ``TransferPlan``.

Every chunk of a request touches the same blocks whenever it is sent or lands, so neither side needs to
derive them again per chunk: P's ``OutgoingTransfer`` builds its plan when the reservation answers (its blocks
and D's), and each ``send_chunk`` takes its chunk's slice (our blocks for the checksum, the direct ops); D's
``IncomingTransfer`` builds one at admission (its blocks only) and each landing takes its chunk's blocks.
The runs are the same as ``pdkv.layout.block_runs``'s on each chunk's blocks (a test compares them on random
tables), found with numpy over the whole table at once: a run breaks wherever our id or theirs does not step
by one.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np

from pdkv.channels.handle import TransferOp
from pdkv.errors import TransferError
from pdkv.keys import chunk_spans


@dataclass(frozen=True, kw_only=True, eq=False)
class TransferPlan:
    """Per chunk: its ``(first token, tokens)``, our block ids, and (given the peer's blocks) the runs
    ``(our first block, their first block, count)`` adjacent on both sides."""

    spans: list[tuple[int, int]]
    bounds: list[tuple[int, int]]  # each chunk's blocks as a slice of the table: [first, last)
    table: np.ndarray  # our block ids the transfer uses, int64
    blocks: list[list[int]]
    runs: list[list[tuple[int, int, int]]]  # empty until ``with_peer``

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
        table = np.asarray(ours[:need], dtype=np.int64)
        if len(table) < need or (need and (table.min() < 0 or table.max() >= num_blocks)):
            raise TransferError(
                f"transfer {transfer_id!r}: block table {list(ours[:need])} does not give {num_tokens} tokens' "
                f"{need} blocks inside our {num_blocks} blocks"
            )
        bounds = [(start // block_size, -(-(start + n) // block_size)) for start, n in spans]
        return cls(spans=spans, bounds=bounds, table=table, blocks=[table[a:b].tolist() for a, b in bounds], runs=[])

    def with_peer(self, theirs: Sequence[int]) -> TransferPlan:
        """This plan with each chunk's runs against the peer's blocks ``theirs`` (its first block ids in the order
        of ours). Raises ``TransferError`` if the peer holds fewer blocks than the transfer needs."""
        a = self.table
        b = np.asarray(theirs[: len(a)], dtype=np.int64)
        if len(b) < len(a):
            raise TransferError(f"the peer holds {len(b)} blocks for a transfer of {len(a)}")
        cuts = np.flatnonzero((np.diff(a) != 1) | (np.diff(b) != 1)) + 1  # where a run starts, past the first
        runs = []
        for first, last in self.bounds:
            lo, hi = np.searchsorted(cuts, first, side="right"), np.searchsorted(cuts, last)  # cuts inside
            starts = np.concatenate(([first], cuts[lo:hi]))
            counts = np.diff(np.append(starts, last))
            runs.append(list(zip(a[starts].tolist(), b[starts].tolist(), counts.tolist(), strict=True)))
        return dataclasses.replace(self, runs=runs)

    def ops(self, local: Sequence[int], remote: Sequence[int], block_bytes: int) -> list[list[TransferOp]]:
        """Each chunk's direct ops: one per buffer tensor (``local[t]`` to ``remote[t]``, regions) per run, in
        wire order (tensor by tensor), the order both sides' checksums read the bytes in."""
        size = block_bytes
        return [
            [
                TransferOp(local[t], a * size, remote[t], b * size, k * size)
                for t in range(len(local))
                for a, b, k in chunk
            ]
            for chunk in self.runs
        ]
