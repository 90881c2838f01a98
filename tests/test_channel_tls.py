"""The tcp channel with mutual TLS: exact bytes over real sockets between processes, and every way a peer is refused.

Certificates are made at test time (``pdkv.testing.tls``): one CA for the
deployment, another for strangers. The clear channel's own tests
(tests/test_channel_tcp.py) run unchanged beside these.
"""

from __future__ import annotations

import socket
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import msgspec
import pytest

from pdkv.channels import TransferOp
from pdkv.channels.tcp import TcpChannel, wire
from pdkv.errors import ChannelError, ConfigError
from pdkv.testing.tls import CertificateAuthority, TlsFiles

from tests.conftest import wait_until
from tests.test_channel_tcp import CALL_TIMEOUT, MiB, Peer, pattern

KEY = "tls-and-a-secret"
REGION = 64 << 10


@pytest.fixture(scope="module")
def pki(tmp_path_factory: pytest.TempPathFactory) -> tuple[CertificateAuthority, CertificateAuthority]:
    """This deployment's CA, and a stranger's."""
    base = tmp_path_factory.mktemp("pki")
    return CertificateAuthority(base / "ours", "ours"), CertificateAuthority(base / "theirs", "theirs")


def _channel(name: str, tls: TlsFiles | None, **options: Any) -> TcpChannel:
    raw: dict[str, Any] = {"io_timeout": 5, "connect_timeout": 5, **options}
    if tls is not None:
        raw["tls"] = tls.options()
    opts = TcpChannel.parse_options(raw)
    return TcpChannel(name, opts)


@pytest.fixture(scope="module")
def remote(pki: tuple[CertificateAuthority, CertificateAuthority]) -> Iterator[Peer]:
    """A TLS agent with a secret in its own process: bytes cross a real socket between two address spaces."""
    options = {
        "streams": 4,
        "stream_min_bytes": 256 << 10,
        "io_timeout": 10,
        "secret": KEY,
        "tls": pki[0].issue("remote").options(),
    }
    p = Peer("remote", options, [8 * MiB, 1 * MiB])
    yield p
    p.stop()


def test_tls_write_and_read_land_bit_exact_across_streams_with_the_secret_on_top(
    pki: tuple[CertificateAuthority, CertificateAuthority], remote: Peer
) -> None:
    split = {"streams": 4, "stream_min_bytes": 256 << 10, "one_host_shares": 4}
    local = _channel("local", pki[0].issue("local"), **split, io_timeout=10, secret=KEY)
    try:
        src, dst = bytearray(pattern(1, 8 * MiB)), bytearray(8 * MiB + 16)
        s, d = local.register(src), local.register(dst)
        local.add_peer(remote.meta)
        remote.call("add_peer", local.metadata())
        r0, r1 = remote.regions
        # a large write (split over the 4 streams, frames past a TLS record) and small ones in one transfer
        ops = [
            TransferOp(s, 0, r0, 0, 8 * MiB - 4096),
            TransferOp(s, 100, r1, 7, 3000),
            TransferOp(s, 5000, r1, 9000, 1),
        ]
        local.wait(local.write("remote", ops, notif=b"landed"), CALL_TIMEOUT)
        assert remote.call("notifs", 5.0) == [("local", b"landed")]
        for op in ops:
            assert remote.call("bytes", op.remote_region, op.remote_offset, op.length) == bytes(
                src[op.local_offset : op.local_offset + op.length]
            )
        assert len([n for n in local.stream_bytes("remote") if n]) == 4
        remote.call("fill", r0, 7)
        local.wait(
            local.read("remote", [TransferOp(d, 0, r0, 0, 8 * MiB), TransferOp(d, 8 * MiB, r1, 0, 16)]), CALL_TIMEOUT
        )
        assert bytes(dst[: 8 * MiB]) == pattern(7, 8 * MiB)
        assert bytes(dst[8 * MiB :]) == remote.call("bytes", r1, 0, 16)
        assert not local.stats().get("tls_failures") and not local.stats().get("auth_failures")
    finally:
        local.close()


def test_pipelined_small_writes_and_reads_over_tls_all_land(
    pki: tuple[CertificateAuthority, CertificateAuthority], remote: Peer
) -> None:
    """Many transfers in flight: ACKs are read while the same TLS connections are being written (sender threads,
    waiters)."""
    local = _channel("piper", pki[0].issue("piper"), secret=KEY, io_timeout=10)
    try:
        src, dst = bytearray(pattern(41, 4 * MiB)), bytearray(4 * MiB)
        s, d = local.register(src), local.register(dst)
        local.add_peer(remote.meta)
        remote.call("add_peer", local.metadata())
        r0, _ = remote.regions
        size, count = 16 << 10, 256
        handles = [local.write("remote", [TransferOp(s, i * size, r0, i * size, size)]) for i in range(count)]
        handles += [
            local.read("remote", [TransferOp(d, i * size, r0, i * size, size)]) for i in range(count // 2)
        ]  # behind the writes
        for handle in handles:
            local.wait(handle, CALL_TIMEOUT)
        assert remote.call("bytes", r0, 0, count * size) == bytes(src[: count * size])
        assert bytes(dst[: count // 2 * size]) == bytes(src[: count // 2 * size])
    finally:
        local.close()


def _refused(initiator: TcpChannel, target: TcpChannel, error: str) -> None:
    """A write from ``initiator`` fails with ``error``, lands nothing and is counted as a refusal by the target."""
    dst = bytearray(REGION)
    target.register(dst)
    region = initiator.register(bytearray(pattern(70, REGION)))
    initiator.add_peer(target.metadata())
    with pytest.raises(ChannelError, match=error):
        initiator.write("target", [TransferOp(region, 0, 0, 0, REGION)], notif=b"no")
    assert dst == bytearray(REGION) and target.get_notifications() == []


@pytest.mark.parametrize(
    ("initiator_ca", "target_ca", "error", "target_counts"),
    [
        (None, 0, "requires TLS", True),  # a clear peer is told so, in clear
        (0, None, "TLS with peer 'target' .* failed", False),  # the clear target reads a TLS record where HELLO was due
        (1, 0, "TLS with peer 'target' .* failed", True),  # our CA does not sign the stranger's certificate
        (0, 1, "TLS with peer 'target' .* failed: CERTIFICATE_VERIFY_FAILED", True),  # nor the target's
    ],
    ids=["clear initiator", "clear target", "initiator of another CA", "target of another CA"],
)
def test_a_peer_without_tls_or_with_another_cas_certificate_is_refused_naming_tls(
    pki: tuple[CertificateAuthority, CertificateAuthority],
    initiator_ca: int | None,
    target_ca: int | None,
    error: str,
    target_counts: bool,
) -> None:
    initiator = _channel("stranger", None if initiator_ca is None else pki[initiator_ca].issue("stranger"))
    target = _channel("target", None if target_ca is None else pki[target_ca].issue("target"))
    try:
        _refused(initiator, target, error)
        if target_counts:
            wait_until(
                lambda: target.stats().get("auth_failures", 0) == 1, CALL_TIMEOUT, "the target to count the refusal"
            )
    finally:
        initiator.close()
        target.close()


def test_under_tls_a_wrong_secret_is_still_refused_as_the_secret(
    pki: tuple[CertificateAuthority, CertificateAuthority],
) -> None:
    initiator = _channel("stranger", pki[0].issue("stranger"), secret="another")
    target = _channel("target", pki[0].issue("target"), secret=KEY)
    try:
        _refused(initiator, target, "did not prove the shared secret")
        assert not initiator.stats().get("tls_failures")
    finally:
        initiator.close()
        target.close()


def test_the_clear_target_says_the_peer_speaks_tls(
    pki: tuple[CertificateAuthority, CertificateAuthority], caplog: pytest.LogCaptureFixture
) -> None:
    initiator, target = _channel("stranger", pki[0].issue("stranger")), _channel("target", None)
    try:
        _refused(initiator, target, "TLS")
        wait_until(
            lambda: "the peer speaks TLS and this agent has no `tls`" in caplog.text,
            CALL_TIMEOUT,
            "the target to log why",
        )
    finally:
        initiator.close()
        target.close()


def test_tls_options_errors_name_the_field(
    pki: tuple[CertificateAuthority, CertificateAuthority], tmp_path: Path
) -> None:
    files = pki[0].issue("conf").options()
    with pytest.raises(ConfigError, match=r"tls\.cert='/nonexistent.pem': no such file"):
        TcpChannel("x", TcpChannel.parse_options({"tls": {**files, "cert": "/nonexistent.pem"}}))
    not_pem = tmp_path / "ca.pem"
    not_pem.write_text("not a certificate")
    with pytest.raises(ConfigError, match=r"tls\.ca="):
        TcpChannel("x", TcpChannel.parse_options({"tls": {**files, "ca": str(not_pem)}}))
    with pytest.raises(ConfigError, match=r"tls\.cert=.*tls\.key="):  # a key that is not the certificate's
        TcpChannel("x", TcpChannel.parse_options({"tls": {**files, "key": pki[0].issue("other").options()["key"]}}))
    with pytest.raises(ConfigError, match=r"tls.*ca"):
        TcpChannel.parse_options({"tls": {"cert": files["cert"], "key": files["key"]}})


def test_a_peer_silent_in_the_tls_handshake_is_cut_at_connect_timeout_on_both_sides(
    pki: tuple[CertificateAuthority, CertificateAuthority],
) -> None:
    """The TLS handshake is inside the bound of the whole handshake (connect_timeout), however the peer stalls it: a
    TLS target drops a connection that sent two bytes of a record and then nothing, and an initiator gives up on a
    listener that accepts and never answers its ClientHello (OpenSSL retries kernel timeouts inside the handshake,
    so these held a serve thread, or a caller's write, for ever)."""
    target = _channel("target", pki[0].issue("target"), connect_timeout=1)
    silent = socket.create_server(("127.0.0.1", 0))
    initiator = _channel("friend", pki[0].issue("friend"), connect_timeout=1)
    meta = wire.decode_meta(target.metadata())
    # the target's io_timeout is 5 s: a cut that waited for it, not for connect_timeout (1 s), times the prober out
    prober = socket.create_connection((meta.host, meta.port), timeout=4)
    try:
        prober.sendall(b"\x16\x03")  # a TLS record begins, and stops
        while prober.recv(4096):  # until the target hangs up
            pass
        # cut by the handshake's bound (connect_timeout, 1 s), not by io_timeout's per-byte one
        wait_until(lambda: target.stats().get("handshake_timeouts", 0) == 1, CALL_TIMEOUT, "the handshake timeout")
        meta = msgspec.structs.replace(meta, port=silent.getsockname()[1])
        region = initiator.register(bytearray(REGION))
        initiator.add_peer(msgspec.msgpack.encode(msgspec.structs.replace(meta, regions={0: REGION})))
        with pytest.raises(ChannelError, match="TLS handshake not complete within 1s"):
            initiator.write("target", [TransferOp(region, 0, 0, 0, REGION)], notif=b"no")
    finally:
        prober.close()
        silent.close()
        initiator.close()
        target.close()
