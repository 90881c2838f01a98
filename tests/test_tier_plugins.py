"""A cache level written outside pdkv, named in the config alone: ``module:Class`` or an installed distribution's
``pdkv.tier_backends`` entry point. It passes the conformance kit, serves a real prefill worker, and shows in
``pdkv launch --print-config`` and ``/pdkv/info``; bad names and options fail at start naming the field.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest
import yaml

from pdkv.config import convert_config
from pdkv.errors import ConfigError
from pdkv.layout import KVLayout
from pdkv.testing.http import get_text, metric, post_json
from pdkv.testing.procs import start_configured
from pdkv.testing.tier_conformance import HOSTILE_RULES, LAYOUT, RULES, Harness, Raw, run_conformance
from pdkv.tier import build_tier, open_level
from pdkv.tier.base import CacheTier

from tests.conftest import wait_until
from tests.test_tier_worker import BASE, CHUNK, body

# What a third party writes: values as files in a directory every handle shares, in pdkv's sealed format
# (pdkv.tier.store.SharedStoreTier makes and checks them), options as a plain dataclass.
BACKEND = '''
"""A pdkv cache level kept outside pdkv: one file per chunk in a shared directory."""

from __future__ import annotations

import dataclasses
import os
import uuid
from pathlib import Path

from pdkv.tier.store import SharedStoreTier


@dataclasses.dataclass
class DirOptions:
    path: str
    secret: str = ""


class DirStore(SharedStoreTier):
    Options = DirOptions
    default_name = "dirstore"

    def __init__(self, layout, options: DirOptions, name: str = "dirstore") -> None:
        super().__init__(layout, name, options.secret)
        self.root = Path(options.path)
        self.root.mkdir(parents=True, exist_ok=True)

    def _file(self, key: bytes) -> Path:
        return self.root / key.hex()

    def has(self, keys):
        return [self._file(k).exists() for k in keys]

    def _get(self, keys, outs):
        for i, (key, out) in enumerate(zip(keys, outs)):
            try:
                value = self._file(key).read_bytes()
            except FileNotFoundError:
                return i
            if not self.accept(key, value, out):
                return i
        return len(keys)

    def _put(self, keys, chunks, parents):
        for key, value in zip(keys, self.encode(keys, chunks)):
            tmp = self.root / f".tmp-{uuid.uuid4().hex}"
            tmp.write_bytes(value)
            try:
                os.link(tmp, self._file(key))  # atomic, and the first write stays
                self._count(written_bytes=len(value))
            except FileExistsError:
                pass
            finally:
                tmp.unlink()

    def remove(self, keys):
        removed = 0
        for key in keys:
            try:
                self._file(key).unlink()
                removed += 1
            except FileNotFoundError:
                pass
        return removed
'''


@pytest.fixture
def plugin_dir(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    """A directory outside pdkv holding the backend's module and a distribution's metadata naming it as the
    ``pdkv.tier_backends`` entry point ``dirstore``, put on ``sys.path`` as an install would."""
    root = tmp_path / "site"
    root.mkdir()
    (root / "my_kv_store.py").write_text(BACKEND)
    dist = root / "my_kv_store-1.0.dist-info"
    dist.mkdir()
    (dist / "METADATA").write_text("Metadata-Version: 2.1\nName: my-kv-store\nVersion: 1.0\n")
    (dist / "entry_points.txt").write_text("[pdkv.tier_backends]\ndirstore = my_kv_store:DirStore\n")
    monkeypatch.syspath_prepend(str(root))
    return root


def level(backend: str, path: Path, **options: Any) -> dict[str, Any]:
    return {"backend": backend, "path": str(path), **options}


def test_a_backend_named_by_module_and_class_passes_the_conformance_kit(plugin_dir: Path, tmp_path: Path) -> None:
    store = tmp_path / "store"

    def open_tier(layout: KVLayout, secret: str) -> CacheTier:
        (spec,) = convert_config(
            {"tier": {"levels": [level("my_kv_store:DirStore", store, secret=secret)]}}
        ).tier.level_specs()
        return open_level(spec, layout)

    def write(key: bytes, value: bytes) -> None:
        (store / key.hex()).write_bytes(value)

    raw = Raw(read=lambda key: (store / key.hex()).read_bytes() if (store / key.hex()).exists() else None, write=write)
    report = run_conformance(Harness(open=open_tier, raw=raw, shared=True, seals=True))
    not_networked = {"dead_store_is_a_miss"} | HOSTILE_RULES  # a directory: no store on the network
    assert {rule for rule, result in report.items() if result == "passed"} == set(RULES) - not_networked


def test_an_entry_point_names_it_too_and_print_config_shows_the_levels(plugin_dir: Path, tmp_path: Path) -> None:
    specs = convert_config(
        {"tier": {"levels": [level("dirstore", tmp_path / "s", name="shared-dir")]}}
    ).tier.level_specs()
    assert [(s.name, s.cls.__module__, s.cls.__name__) for s in specs] == [("shared-dir", "my_kv_store", "DirStore")]
    config = tmp_path / "p.yaml"
    config.write_text(
        yaml.safe_dump(
            {
                "tier": {
                    "disk_path": str(tmp_path / "d"),
                    "redis_url": "redis://pdkv:hunter2@127.0.0.1:1/0",
                    "levels": [level("dirstore", tmp_path / "s", secret="s3cr3t")],
                }
            }
        )
    )
    out = subprocess.run(
        [sys.executable, "-m", "pdkv.cli", "launch", "--role", "prefill", "--config", str(config), "--print-config"],
        capture_output=True,
        text=True,
        timeout=60,
        env={**os.environ, "PYTHONPATH": str(plugin_dir)},
        check=True,
    ).stdout
    printed = json.loads(out)
    assert [(lv["name"], lv["backend"]) for lv in printed["tier_levels"]] == [
        ("memory", "pdkv.tier.memory:MemoryTier"),
        ("disk", "pdkv.tier.disk:DiskTier"),
        ("redis", "pdkv.tier.remote:RedisTier"),
        ("dirstore", "my_kv_store:DirStore"),
    ]
    assert printed["tier_levels"][3]["options"] == {"path": str(tmp_path / "s"), "secret": "<redacted>"}
    assert printed["config"]["tier"]["redis_url"] == "redis://pdkv:<redacted>@127.0.0.1:1/0"
    assert "s3cr3t" not in out and "hunter2" not in out


def test_a_prefill_worker_is_served_by_it_through_the_config_alone(
    plugin_dir: Path, model_dir: Path, tmp_path: Path
) -> None:
    """`pdkv launch` with the plugin's directory on PYTHONPATH and a config that names it: the second request loads
    its three full chunks from the plugin's level (memory is off), bit-identical."""
    store = tmp_path / "store"
    cfg = {
        "model": str(model_dir),
        "num_blocks": 128,
        "transfer": {"chunk_size": CHUNK},
        "tier": {"memory_bytes": 0, "levels": [level("my_kv_store:DirStore", store, secret="fleet")]},
    }
    worker = start_configured("prefill", cfg, tmp_path / "p.yaml", timeout=120, env={"PYTHONPATH": str(plugin_dir)})
    try:
        no_decode = {"do_remote_decode": True, "return_kv_digest": True}  # KV computed, not sent
        first = post_json(worker.url + "/v1/completions", body(BASE, 1, **no_decode))
        wait_until(lambda: len(list(store.glob("[0-9a-f]*"))) == 3, timeout=30, what="three chunks written behind")
        second = post_json(worker.url + "/v1/completions", body(BASE, 1, **no_decode))
        assert second["kv_transfer_params"]["kv_digest"] == first["kv_transfer_params"]["kv_digest"]
        assert second["choices"][0]["token_ids"] == first["choices"][0]["token_ids"]
        metrics = get_text(worker.url + "/metrics")
        assert metric(metrics, "pdkv_tier_hits_total", tier="dirstore") == 3
        assert metric(metrics, "pdkv_prompt_tokens_total", source="tier") == 96
        info = json.loads(get_text(worker.url + "/pdkv/info"))
        assert [(lv["name"], lv["backend"]) for lv in info["tier"]] == [("dirstore", "my_kv_store:DirStore")]
    finally:
        assert worker.stop() == 0


class NoOptions(CacheTier):
    pass


@pytest.mark.parametrize(
    ("entry", "message"),
    [
        ({"path": "/x"}, r"'tier.levels\[0\].backend' = None: expected 'module:Class'"),
        (
            {"backend": "no_such_backend"},
            r"'tier.levels\[0\].backend' = 'no_such_backend': expected .*installed: .*dirstore.*s3",
        ),
        (
            {"backend": "no_such_module:X"},
            r"'tier.levels\[0\].backend' = 'no_such_module:X': cannot import 'no_such_module'",
        ),
        ({"backend": "my_kv_store:Nope"}, r"'my_kv_store' has no 'Nope'"),
        ({"backend": "my_kv_store:uuid"}, r"names a module, expected a class"),
        (
            {"backend": "tests.test_tier_plugins:NoOptions"},
            r"NoOptions declares no typed options: give it a class attribute `Options`",
        ),
        ({"backend": "dirstore"}, r"'tier.levels\[0\].path' = missing: Object missing required field `path`"),
        ({"backend": "dirstore", "path": 5}, r"'tier.levels\[0\].path' = 5: Expected `str`, got `int`"),
        (
            {"backend": "dirstore", "path": "/x", "size": 1},
            r"'tier.levels\[0\].size': unknown option of my_kv_store:DirStore; expected one of: path, secret",
        ),
        (
            {"backend": "dirstore", "path": "/x", "name": "disk"},
            r"'tier.levels\[0\].name' = 'disk': expected a label .* no other level has",
        ),
    ],
)
def test_bad_names_and_options_fail_at_start_naming_the_field(
    plugin_dir: Path, entry: dict[str, Any], message: str
) -> None:
    with pytest.raises(ConfigError, match=message):
        convert_config({"tier": {"levels": [entry]}})


def test_a_class_that_is_no_cache_tier_fails_when_built(plugin_dir: Path) -> None:
    (plugin_dir / "not_a_tier.py").write_text(
        "import dataclasses\n\n@dataclasses.dataclass\nclass O:\n    pass\n\nclass T:\n    Options = O\n"
    )
    config = convert_config({"tier": {"levels": [{"backend": "not_a_tier:T"}]}}).tier
    with pytest.raises(
        ConfigError, match=r"'tier.levels\[0\].backend' = 'not_a_tier:T': T is not a pdkv.tier.CacheTier"
    ):
        build_tier(config, LAYOUT)
