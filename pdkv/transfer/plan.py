"""A transfer's chunks worked out once, when its blocks on both sides are known: ``TransferPlan``.

Every chunk of a request touches the same blocks whenever it is sent or lands, so neither side needs to
derive them again per chunk. P's ``KVSender.open`` builds its plan (and checks its block table) before it
reserves, ``OutgoingTransfer`` pairs it with D's blocks when the reservation answers (``with_peer``) and works out
every chunk's direct ops, and each ``send_chunk`` takes its chunk's (our blocks for the checksum, the ops); D's
``IncomingBook.open`` builds one at admission (its blocks only) and each landing takes its chunk's tokens and
blocks.
A transfer that starts past what D already holds (``held``, ``protocol.Reserved.held_tokens``) has chunks that
start at ``held`` (the first one there, each ``chunk_size`` on) over the blocks from the one holding token ``held``.
The runs are the same as ``pdkv.layout.block_runs``'s on each chunk's blocks (a test compares them on random
tables), found in one pass over the whole table (with numpy where the table is long enough to pay for it): a run
breaks wherever our id or theirs does not step by one.
"""

from __future__ import annotations

import bisect
import dataclasses
from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np

from pdkv.channels.handle import TransferOp
from pdkv.errors import TransferError
from pdkv.keys import chunk_spans

# Tables at least this long find their runs with numpy: below it numpy's fixed cost (about 10 us a call here) is more
# than a Python pass (about 0.07 us a block); at 1024 blocks numpy took 62 us and Python 94.
NUMPY_FROM_BLOCKS = 512


def run_starts(ours: list[int], theirs: list[int]) -> list[int]:
    """Indices (past 0) where a run starts: our id or theirs does not step by one from the previous block."""
    if len(ours) < NUMPY_FROM_BLOCKS:
        return [i for i in range(1, len(ours)) if ours[i] != ours[i - 1] + 1 or theirs[i] != theirs[i - 1] + 1]
    a, b = np.asarray(ours, dtype=np.int64), np.asarray(theirs, dtype=np.int64)
    starts: list[int] = (np.flatnonzero((np.diff(a) != 1) | (np.diff(b) != 1)) + 1).tolist()
    return starts


@dataclass(frozen=True, kw_only=True)
class TransferPlan:
    """Per chunk: its ``(first token, tokens)``, our block ids, and (given the peer's blocks) the runs
    ``(our first block, their first block, count)`` adjacent on both sides."""

    spans: list[tuple[int, int]]  # (first token in the prompt, tokens)
    bounds: list[tuple[int, int]]  # each chunk's blocks as a slice of the table: [first, last)
    table: list[int]  # our block ids the transfer uses, the first one holding token ``table_start``
    blocks: list[list[int]]
    runs: list[list[tuple[int, int, int]]]  # empty until ``with_peer``
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
            runs=[],
            table_start=first_block * block_size,
        )

    def with_peer(self, theirs: Sequence[int]) -> TransferPlan:
        """This plan with each chunk's runs against the peer's blocks ``theirs`` (its first block ids in the order
        of ours). Raises ``TransferError`` if the peer holds fewer blocks than the transfer needs."""
        ours, theirs = self.table, list(theirs[: len(self.table)])
        if len(theirs) < len(ours):
            raise TransferError(f"the peer holds {len(theirs)} blocks for a transfer of {len(ours)}")
        cuts = run_starts(ours, theirs)  # one pass over the whole table, not one per chunk
        runs = []
        for first, last in self.bounds:
            starts = [first, *cuts[bisect.bisect_right(cuts, first) : bisect.bisect_left(cuts, last)]]
            ends = [*starts[1:], last]
            runs.append([(ours[s], theirs[s], e - s) for s, e in zip(starts, ends, strict=True)])
        return dataclasses.replace(self, runs=runs)

    def ops(self, local: Sequence[int], remote: Sequence[int], block_bytes: int) -> list[list[TransferOp]]:
        """Each chunk's direct ops: one per buffer tensor (``local[t]`` to ``remote[t]``, regions) per run, in
        wire order (tensor by tensor), the order both sides' checksums read the bytes in."""
        size = block_bytes
        chunks = [[(a * size, b * size, k * size) for a, b, k in chunk] for chunk in self.runs]  # once per run
        return [
            [TransferOp(here, a, there, b, n) for here, there in zip(local, remote, strict=True) for a, b, n in chunk]
            for chunk in chunks
        ]
