"""How one prefill/decode pair is told about each other: the ``kv_transfer_params`` of each hop.

Both modes shape the prefill hop the way vLLM's disaggregated proxy does
(``max_tokens`` 1, not streamed, no ``stream_options``, no ``min_tokens``;
in ``pdkv`` mode a streamed request's prefill hop is streamed, its event the
client's first, ``pdkv.router.handoff``)
and send the decode hop the client's body unchanged but for
``kv_transfer_params``, so chat stays chat and ``tools`` or any field the
router does not know reach the worker untouched. A client's own
``kv_transfer_params`` never pass: the router owns that field, and a client
must not be able to point a decode worker at someone else's transfer.

* ``pdkv``: P pushes to D, so P is told D's receiver (``remote_host``,
  ``remote_port`` from D's ``/pdkv/info``) and a fresh ``transfer_id``; P
  answers with the params D needs (``do_remote_prefill``, ``transfer_id``,
  ``first_token_id``, ...), passed on as they are. With a ``secret``, P's
  params carry ``push_proof``, the router's signature of the target (transfer
  id, receiver, codec): a P with the secret pushes nowhere else. A
  transfer whose decode hop never ran is cancelled on D
  (``DELETE /pdkv/transfers/{id}``) so its reservation is freed at once,
  not when its lease runs out.
* ``vllm``: vLLM pairs, with vLLM's shape of params. P gets
  ``{"do_remote_decode": true, "do_remote_prefill": false,
  "remote_engine_id": null, "remote_block_ids": null, "remote_host": null,
  "remote_port": null}``: for vLLM's NixlConnector, where D pulls from P.
  When D serves ``/pdkv/info`` (a vLLM started by ``pdkv launch --engine
  vllm``, whose pdkv connector has P push to D), ``remote_host`` and
  ``remote_port`` name D's receiver (``remote_ports``: one per tensor-parallel
  rank of D, each rank of P pushing to its own) and a ``transfer_id`` is added
  (and ``push_proof``, as in ``pdkv``). P
  answers with ``do_remote_prefill`` and what its connector needs (NIXL:
  ``remote_block_ids``, ``remote_engine_id``, ...; pdkv: ``transfer_id``,
  ``num_tokens``, ``prompt_key``), which D gets exactly as P sent them.
  vLLM has no cancel endpoint: a P whose blocks are never pulled frees them
  after its own abort timeout; a pushed transfer nobody claims is freed by
  D's receiver after ``claim_timeout_s``.
"""

from __future__ import annotations

import abc
from typing import Any, ClassVar
from urllib.parse import quote

import msgspec

from pdkv.errors import UpstreamError
from pdkv.router.pool import WorkerPool, WorkerState
from pdkv.transfer.params import PushTo, sign_push

# Fields a prefill hop must not carry: streaming options, and lower bounds vLLM refuses above max_tokens=1.
_PREFILL_DROPS = ("stream_options", "min_tokens", "min_completion_tokens")


def prefill_body(body: dict[str, Any], params: dict[str, Any], stream_first: bool = False) -> dict[str, Any]:
    """The client's body reshaped for a prefill hop: one token, not streamed, with ``params``; ``stream_first``:
    streamed, its event the client's first (``pdkv.router.handoff``)."""
    out = {k: v for k, v in body.items() if k not in _PREFILL_DROPS}
    if stream_first:
        params = {**params, "stream_first": True}
    out.update(max_tokens=1, stream=stream_first, kv_transfer_params=params)
    if "max_completion_tokens" in body:
        out["max_completion_tokens"] = 1
    return out


def decode_body(body: dict[str, Any], params: dict[str, Any] | None) -> dict[str, Any]:
    """The client's body for the decode hop: unchanged but for ``kv_transfer_params`` (none: decode alone)."""
    out = {k: v for k, v in body.items() if k != "kv_transfer_params"}
    if params is not None:
        out["kv_transfer_params"] = params
    return out


class PairMode(abc.ABC):
    """The ``kv_transfer_params`` protocol between a prefill and a decode worker."""

    name: ClassVar[str]
    hands_off: ClassVar[bool] = False  # whether P can send a streamed answer's first event (router.stream_first_token)

    def __init__(self, secret: str = "") -> None:
        self.secret = secret  # signs the push target P is handed: a P with the secret pushes only where it says

    async def prefill_params(
        self, pool: WorkerPool, decode: WorkerState, transfer_id: str, codec: str | None = None
    ) -> dict[str, Any]:
        """What the prefill hop carries, its push target signed (``sign_push``); ``codec``: P encodes this
        request's chunks with it (its transfer.codec). May raise ``UpstreamError`` if the decode worker cannot be
        reached."""
        params = await self.target(pool, decode, transfer_id)
        if codec:
            params["codec"] = codec
        return sign_push(params, self.secret)

    @abc.abstractmethod
    async def target(self, pool: WorkerPool, decode: WorkerState, transfer_id: str) -> dict[str, Any]:
        """The prefill hop's params before the codec and the signature: where P pushes, if anywhere."""

    def decode_params(self, prefill_answer: Any) -> tuple[dict[str, Any] | None, str | None]:
        """From the prefill hop's JSON answer: the decode hop's params and, if the KV will not
        arrive, why (a fallback reason). ``None`` params: the decode worker computes alone."""
        params = prefill_answer.get("kv_transfer_params") if isinstance(prefill_answer, dict) else None
        if not isinstance(params, dict) or not params.get("do_remote_prefill"):
            return None, "no_kv_transfer_params"
        return params, None

    def cancel_url(self, decode: WorkerState, transfer_id: str) -> str | None:
        """Where to DELETE a transfer whose decode hop never ran, if the decode worker has such a place."""
        return None


class PdkvMode(PairMode):
    name = "pdkv"
    hands_off = True

    async def target(self, pool: WorkerPool, decode: WorkerState, transfer_id: str) -> dict[str, Any]:
        info = await pool.decode_info(decode)
        return msgspec.to_builtins(PushTo(info["remote_host"], info["remote_port"], transfer_id))

    def decode_params(self, prefill_answer: Any) -> tuple[dict[str, Any] | None, str | None]:
        params, why = super().decode_params(prefill_answer)
        if params is not None and params.get("transfer_started") is False:
            return params, "transfer_not_started"  # D still gets P's first token, and recomputes the prompt
        return params, why

    def cancel_url(self, decode: WorkerState, transfer_id: str) -> str | None:
        return f"{decode.url}/pdkv/transfers/{quote(transfer_id, safe='')}"


PULL_PREFILL_PARAMS: dict[str, Any] = {
    "do_remote_decode": True,
    "do_remote_prefill": False,
    "remote_engine_id": None,
    "remote_block_ids": None,
    "remote_host": None,
    "remote_port": None,
}
"""The prefill hop's ``kv_transfer_params`` of vLLM's own proxies (NixlConnector's ``toy_proxy_server.py``): P
computes the prompt and answers what D needs to pull its blocks."""


class VllmMode(PairMode):
    name = "vllm"

    async def target(self, pool: WorkerPool, decode: WorkerState, transfer_id: str) -> dict[str, Any]:
        params = dict(PULL_PREFILL_PARAMS)
        try:
            info = await pool.decode_info(decode)
        except UpstreamError as exc:
            if exc.worker_down:
                raise
            return params  # no /pdkv/info: a vLLM whose connector pulls
        return {
            **params,
            "remote_host": info["remote_host"],
            "remote_port": info["remote_port"],
            "remote_ports": info["remote_ports"],
            "transfer_id": transfer_id,
        }


def make_mode(name: str, secret: str = "") -> PairMode:
    return VllmMode(secret) if name == "vllm" else PdkvMode(secret)
