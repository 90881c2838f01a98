"""The reading path of pdkv/transfer/README.md runs: one real transfer over tcp (the default chunk: native kernels, a
clear connection, direct mode, verdicts on) is traced, and every step the README names for it must be called, in the
README's order. A step renamed, skipped by the code, or listed out of order fails here, not only a step whose function
no longer exists (tests/test_docs.py)."""

from __future__ import annotations

import asyncio
import re
import sys
import threading
from dataclasses import dataclass
from pathlib import Path
from types import FrameType
from typing import Any

from pdkv.config import TransferConfig
from pdkv.keys import chunk_keys

from tests.conftest import MakePair, wait_until
from tests.test_transfer import assert_same_kv

README = Path(__file__).resolve().parents[1] / "pdkv/transfer/README.md"
STEP = re.compile(r"^(?P<n>\d+)\. `(?P<file>[\w/.]+\.py):(?P<name>[\w.]+)`:(?P<text>[^\n]*)", re.M)


@dataclass(frozen=True)
class Step:
    n: int
    file: str
    name: str
    tag: str  # "" (called, in order), "meanwhile" (called), "branch" or "worker" (not in this trace)

    def matches(self, filename: str, qualname: str) -> bool:
        return qualname == self.name and (filename.endswith("/" + self.file) or filename.endswith("/pdkv/" + self.file))


def steps() -> list[Step]:
    section = README.read_text().split("## Reading path", 1)[1].split("\n## ", 1)[0]
    out = []
    for m in STEP.finditer(section):
        tag = re.match(r"\s*\*\[(meanwhile|branch|worker)", m["text"])
        out.append(Step(int(m["n"]), m["file"], m["name"], tag.group(1) if tag else ""))
    return out


class Trace:
    """Every call of a step's function, in the order they were entered, on every thread started while tracing."""

    def __init__(self, wanted: list[Step]) -> None:
        self.wanted = wanted
        self.calls: list[Step] = []
        self.on = False
        self._seen: dict[tuple[str, str], Step | None] = {}

    def __enter__(self) -> Trace:
        self.on = True
        threading.setprofile(self._profile)
        sys.setprofile(self._profile)
        return self

    def __exit__(self, *exc: object) -> None:
        self.on = False  # threads started meanwhile keep the hook until they end: it records nothing from here
        sys.setprofile(None)
        threading.setprofile(None)  # type: ignore[arg-type]

    def _profile(self, frame: FrameType, event: str, arg: Any) -> None:
        if event != "call" or not self.on:
            return
        code = frame.f_code
        key = (code.co_filename, code.co_qualname)
        if key not in self._seen:
            self._seen[key] = next((s for s in self.wanted if s.matches(*key)), None)
        step = self._seen[key]
        if step is not None:
            self.calls.append(step)  # list.append is atomic: the order is the order the calls were entered

    def called_after(self, step: Step, after: int) -> int:
        """The position of the first call of ``step`` past position ``after``, or -1."""
        return next((i for i in range(after + 1, len(self.calls)) if self.calls[i] is step), -1)


def test_the_reading_path_parses_into_tagged_steps() -> None:
    found = steps()
    assert [s.n for s in found] == list(range(1, len(found) + 1)), "the steps are not numbered 1, 2, 3, ..."
    assert sum(1 for s in found if not s.tag) >= 30, "too few steps are on the traced path to say much"


def test_one_transfer_calls_every_step_of_the_reading_path_in_order(make_pair: MakePair) -> None:
    traced = [s for s in steps() if s.tag in ("", "meanwhile")]
    config = TransferConfig(chunk_size=32, lease_s=5, drain_timeout_s=2, pool_tokens=0, heartbeat_s=0.05)
    with Trace(traced) as trace:
        pair = make_pair(config=config, channel="tcp")  # its threads start under the trace
        prompt = list(range(30))  # one chunk of 30 tokens
        key = chunk_keys(prompt, "model-a", config.chunk_size)[-1]
        xfer = pair.sender.open("traced", pair.receiver.address, len(prompt), [5, 6], prompt_key=key)
        xfer.send_chunk(0)
        xfer.wait(10)
        wait_until(lambda: pair.sender.stats()["open_transfers"] == 0, 5, "the sender to settle")
        got = asyncio.run(pair.receiver.claim("traced", 10, prompt_key=key))  # as the decode worker claims it
        step = {s.name: s for s in traced}
        # the Done rides P's next heartbeat after the settle (D's claim may come before or after it), and the reaper
        # ticks on

        def heard() -> bool:
            settled = trace.called_after(step["KVSender.transfer_settled"], -1)
            sent = trace.called_after(step["Heartbeats.beat"], settled) if settled >= 0 else -1
            beat = trace.called_after(step["IncomingBook.beat"], sent) if sent >= 0 else -1
            return beat >= 0 and trace.called_after(step["IncomingBook.reap"], beat) >= 0

        wait_until(heard, 5, "a heartbeat after the settle, its arrival and a reap after it")
    assert_same_kv(pair, [5, 6], got.blocks, 30)
    pair.allocator.free(got.blocks)
    d = pair.receiver.stats()
    assert d["tokens_landed"] == 30 and d["verdicts_sent"] == 1, d  # over the channel, answered on its connection
    never = [f"{s.n}. {s.file}:{s.name}" for s in traced if s not in trace.calls]
    assert not never, "pdkv/transfer/README.md names steps this transfer never called:\n" + "\n".join(never)
    at, previous = -1, None
    for s in (s for s in traced if not s.tag):
        found = trace.called_after(s, at)
        assert found >= 0, (
            f"step {s.n} ({s.file}:{s.name}) is not called after step {previous.n} ({previous.name})"
            if previous is not None
            else f"step {s.n} is never called"
        )
        at, previous = found, s
