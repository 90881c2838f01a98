"""The engine loop's yield after a streamed request's first token (``EngineLoop._emit``, ``first_token_yield_s``)."""

from __future__ import annotations

import threading
import time

import pytest

from pdkv.engine import ReferenceEngine, SamplingParams
from pdkv.engine.base import Request
from pdkv.testing.model import random_checkpoint, tiny_config
from pdkv.worker.engine_loop import EngineLoop, Job

from tests.conftest import wait_until

pytestmark = pytest.mark.usefixtures("one_torch_thread")  # tests/conftest.py

PROMPT = list(range(5, 45))
PARAMS = SamplingParams(max_tokens=3, ignore_eos=True)


class Recorded:
    """A job's tokens as the loop reports them, and when the engine ran each decode step."""

    def __init__(self, engine: ReferenceEngine) -> None:
        self.tokens: list[int] = []
        self.finished = threading.Event()
        self.steps: list[float] = []
        real = engine.decode_step

        def decode_step(requests: list[Request]) -> object:
            self.steps.append(time.monotonic())
            return real(requests)

        engine.decode_step = decode_step  # type: ignore[method-assign]

    def job(self, engine: ReferenceEngine, first_out: threading.Event | None) -> Job:
        def on_token(token: int, finish: str | None, _lp: object) -> None:
            self.tokens.append(token)
            if finish is not None:
                self.finished.set()

        def on_error(exc: BaseException) -> None:
            raise AssertionError(f"the job failed: {exc}")

        return Job(engine.new_request(PROMPT, PARAMS), on_token, on_error, first_out=first_out)


def make_engine() -> ReferenceEngine:
    return ReferenceEngine(random_checkpoint(tiny_config("llama", num_hidden_layers=2), seed=3), max_kv_tokens=256)


def test_the_step_after_a_streamed_first_token_waits_until_it_is_out() -> None:
    engine = make_engine()
    seen = Recorded(engine)
    loop = EngineLoop(engine, chunk_size=64, first_token_yield_s=60)  # only ``first_out`` ends this wait
    try:
        out = threading.Event()
        loop.submit(seen.job(engine, out))
        wait_until(lambda: len(seen.tokens) == 1, what="the first token")
        time.sleep(0.3)
        assert not seen.steps, "the engine stepped on before the first token was out"
        released = time.monotonic()
        out.set()
        assert seen.finished.wait(30)
        assert len(seen.tokens) == 3 and seen.steps[0] >= released
    finally:
        loop.close()


def test_the_wait_is_bounded_and_unstreamed_jobs_do_not_wait() -> None:
    engine = make_engine()
    seen = Recorded(engine)
    loop = EngineLoop(engine, chunk_size=64, first_token_yield_s=0.2)
    try:
        started = time.monotonic()
        loop.submit(seen.job(engine, threading.Event()))  # never set: the step goes on after 0.2 s
        assert seen.finished.wait(30)
        assert seen.steps[0] - started >= 0.2 and len(seen.tokens) == 3
        seen.tokens.clear()
        seen.steps.clear()
        seen.finished.clear()
        loop.first_token_yield_s = 60
        loop.submit(seen.job(engine, None))  # an answer sent whole: nothing to wait for
        assert seen.finished.wait(30)
        assert len(seen.tokens) == 3
    finally:
        loop.close()
