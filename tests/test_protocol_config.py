import logging
import subprocess
import sys
from pathlib import Path
from typing import Any

import msgspec
import pytest

from pdkv.blocks import BlockAllocator
from pdkv.config import TransferConfig, convert_config, load_config
from pdkv.errors import ConfigError, HandshakeError, LayoutError, OutOfBlocksError, ProtocolError
from pdkv.layout import KVLayout
from pdkv.transfer import protocol
from pdkv.transfer.protocol import ChunkNotice, Hello, Reserve, Reserved

LAYOUT = KVLayout(num_layers=2, num_kv_heads=2, head_dim=8)


def hello(**kw: Any) -> Hello:
    base = dict(
        protocol_version=1,
        agent="a",
        model_fingerprint="fp",
        layout=LAYOUT,
        chunk_size=256,
        channel="tcp",
        channel_metadata=b"m",
        kv_regions=[0, 1],
    )
    base.update(kw)
    return Hello(**base)


def test_messages_round_trip() -> None:
    for msg in [
        hello(),
        Reserve("r", 10),
        Reserved("r", "staging", [1, 2], [0, 4096], 15.0),
        protocol.Cancel("r", "why"),
        protocol.Done("r", True),
    ]:
        assert protocol.decode(protocol.encode(msg)) == msg
    notice = ChunkNotice("r", 3, 2**63, -1)
    assert protocol.decode_notice(protocol.encode(notice)) == notice


@pytest.mark.parametrize(
    "data",
    [
        b"",
        b"\xff\xfe garbage",
        msgspec.msgpack.encode({"type": "reserve", "transfer_id": "r", "num_tokens": -5}),
        msgspec.msgpack.encode({"type": "reserve", "transfer_id": "", "num_tokens": 5}),
        msgspec.msgpack.encode({"type": "reserve", "transfer_id": "x" * 1000, "num_tokens": 5}),
        msgspec.msgpack.encode(
            {
                "type": "reserved",
                "transfer_id": "r",
                "mode": "direct",
                "block_ids": [-1],
                "staging_slots": [],
                "lease_s": 1.0,
            }
        ),
        msgspec.msgpack.encode({"type": "nope"}),
        b"\x00" * (protocol.MAX_MESSAGE_BYTES + 1),
    ],
)
def test_malformed_messages_raise_protocol_error(data: bytes) -> None:
    with pytest.raises(ProtocolError):
        protocol.decode(data)


def test_malformed_notice() -> None:
    with pytest.raises(ProtocolError):
        protocol.decode_notice(msgspec.msgpack.encode(["r", -1, 0, 0]))


def test_hello_compatibility_names_every_differing_field() -> None:
    convertible = KVLayout(2, 2, 8, block_size=32, order="HND")
    protocol.check_compatible(hello(), hello(layout=convertible), "decode")
    with pytest.raises(HandshakeError) as err:
        protocol.check_compatible(
            hello(), hello(chunk_size=128, layout=KVLayout(2, 2, 8, dtype="float16"), protocol_version=2), "decode"
        )
    text = str(err.value)
    assert "chunk_size (ours 256, peer 128)" in text
    assert "prefill's KV cache is float16, this decode's is bfloat16: start both with the same KV cache dtype" in text
    assert "protocol_version" in text
    assert "model_fingerprint" not in text


def test_config_errors_name_field_value_and_expectation(tmp_path: Path) -> None:
    cfg = tmp_path / "c.yaml"
    cfg.write_text("transfer:\n  chunk_size: 0\n")
    with pytest.raises(ConfigError, match=r"c.yaml: field 'transfer.chunk_size' = 0: Expected `int` >= 1"):
        load_config(cfg)
    cfg.write_text("channel:\n  name: rdma\n")
    with pytest.raises(ConfigError, match="'channel.name' = 'rdma'"):
        load_config(cfg)
    cfg.write_text("transfer:\n  lease: 3\n")
    with pytest.raises(ConfigError, match="'transfer.lease' = 3: unknown field"):
        load_config(cfg)
    cfg.write_text("[1, 2")
    with pytest.raises(ConfigError, match="not valid YAML"):
        load_config(cfg)
    with pytest.raises(ConfigError, match="cannot read"):
        load_config(tmp_path / "missing.yaml")


def test_config_yaml_with_cli_overrides(tmp_path: Path) -> None:
    cfg = tmp_path / "c.yaml"
    cfg.write_text("role: decode\nport: 8100\ntransfer:\n  chunk_size: 128\n")
    loaded = load_config(cfg, {"port": 9000, "host": None, "transfer.lease_s": 3.5})
    assert (loaded.role, loaded.port, loaded.host) == ("decode", 9000, "127.0.0.1")
    assert loaded.transfer == TransferConfig(chunk_size=128, lease_s=3.5)


def test_allocator_all_or_nothing_and_exactly_once() -> None:
    alloc = BlockAllocator(4)
    got = alloc.allocate(3)
    with pytest.raises(OutOfBlocksError):
        alloc.allocate(2)
    assert alloc.num_free == 1
    alloc.free(got[:1])
    with pytest.raises(LayoutError, match="double free"):
        alloc.free(got[:2])  # got[0] is already free: nothing is freed
    assert alloc.num_free == 2
    alloc.free(got[1:])
    assert alloc.num_free == 4


def test_cli_help_lists_subcommands() -> None:
    out = subprocess.run(
        [sys.executable, "-m", "pdkv.cli", "--help"], capture_output=True, text=True, check=True
    ).stdout
    for cmd in ("demo", "launch", "bench"):
        assert cmd in out
    out = subprocess.run(
        [sys.executable, "-m", "pdkv.cli", "bench", "--help"], capture_output=True, text=True, check=True
    ).stdout
    for cmd in ("channel", "gather", "ttft"):
        assert cmd in out


EXPOSURE = [
    # role, host, settings, refused
    ("decode", "0.0.0.0", {}, True),
    ("prefill", "10.1.2.3", {"engine": "vllm"}, True),  # vLLM workers alike
    ("decode", "10.1.2.3", {"secret": "s"}, False),
    ("decode", "0.0.0.0", {"insecure": True}, False),
    ("decode", "127.0.0.5", {}, False),
    ("prefill", "::1", {}, False),
    ("decode", "localhost", {}, False),
    ("router", "0.0.0.0", {}, True),
    ("router", "0.0.0.0", {"router": {"admin_token": "t"}}, False),
    ("router", "0.0.0.0", {"secret": "s"}, False),
    ("router", "0.0.0.0", {"insecure": True}, False),
]


@pytest.mark.parametrize(("role", "host", "settings", "refused"), EXPOSURE)
def test_serving_beyond_loopback_unguarded_is_refused_unless_insecure(
    role: str, host: str, settings: dict[str, object], refused: bool, caplog: pytest.LogCaptureFixture
) -> None:
    from pdkv.launch.main import check_exposure

    config = convert_config({"role": role, "host": host, **settings})
    with caplog.at_level(logging.WARNING, logger="pdkv.launch"):
        if refused:
            with pytest.raises(ConfigError) as err:
                check_exposure(config)
            assert host in str(err.value) and "--insecure" in str(err.value)  # both ways out are named
            assert ("secret" if role != "router" else "router.admin_token") in str(err.value)
        else:
            check_exposure(config)
    assert any("insecure" in r.getMessage() for r in caplog.records) is bool(settings.get("insecure"))


def test_launch_refuses_an_unguarded_worker_beyond_loopback_before_loading_anything() -> None:
    """The real command line: no secret on 0.0.0.0 fails at once with the field and both ways out; --insecure
    reaches the config."""
    from pdkv.cli import build_parser
    from pdkv.launch.main import check_exposure, config_from_args

    cmd = ["launch", "--role", "decode", "--host", "0.0.0.0", "--port", "0", "--model", "/nonexistent/model"]
    refused = subprocess.run([sys.executable, "-m", "pdkv.cli", *cmd], capture_output=True, text=True, timeout=60)
    assert (
        refused.returncode == 1
        and "field 'host' = '0.0.0.0'" in refused.stderr
        and "--insecure" in refused.stderr
        and "secret" in refused.stderr
    )
    config = config_from_args(build_parser().parse_args([*cmd, "--insecure"]))
    assert config.insecure is True
    check_exposure(config)  # accepted: the flag is the explicit way out
