import os
import subprocess
import sys

import pytest

from pdkv.errors import CacheRequestError, ConfigError
from pdkv.keys import MAX_SALT_CHARS, PromptKeys, chunk_keys, chunk_spans, model_fingerprint

TOKENS = [(i * 7919) % 50000 for i in range(1000)]

SCRIPT = """
import sys
from pdkv.keys import chunk_keys, model_fingerprint
fp = model_fingerprint("llama", {"hidden": 64}, "bfloat16")
tokens = [(i * 7919) % 50000 for i in range(1000)]
print(fp, *[k.hex() for k in chunk_keys(tokens, fp)])
"""


def test_keys_identical_across_processes_with_different_hash_seeds() -> None:
    outs = []
    for seed in ("0", "1", "12345", "random"):
        env = dict(os.environ, PYTHONHASHSEED=seed)
        outs.append(
            subprocess.run([sys.executable, "-c", SCRIPT], env=env, capture_output=True, text=True, check=True).stdout
        )
    assert len(set(outs)) == 1
    fp, *keys = outs[0].split()
    assert fp == model_fingerprint("llama", {"hidden": 64}, "bfloat16")
    assert keys == [k.hex() for k in chunk_keys(TOKENS, fp)]


def test_chunking_and_partial_last_chunk() -> None:
    keys = chunk_keys(TOKENS, "fp")
    assert len(keys) == 4  # 256 + 256 + 256 + 232
    assert list(chunk_spans(1000, 256))[-1] == (768, 232)
    assert len(set(keys)) == 4
    assert all(len(k) == 16 for k in keys)


def test_keys_are_prefix_chained() -> None:
    base = chunk_keys(TOKENS, "fp")
    same_prefix = chunk_keys(TOKENS[:600] + [1, 2, 3], "fp")
    assert same_prefix[:2] == base[:2]
    assert same_prefix[2] != base[2]
    changed_first = chunk_keys([TOKENS[0] + 1] + TOKENS[1:], "fp")
    assert all(a != b for a, b in zip(changed_first, base, strict=True))  # a change in chunk 0 moves every later key


def test_fingerprint_separates_models_and_chunk_size_changes_keys() -> None:
    assert chunk_keys(TOKENS, "a") != chunk_keys(TOKENS, "b")
    assert chunk_keys(TOKENS, "a", 128)[1] != chunk_keys(TOKENS, "a", 256)[0]
    assert model_fingerprint("m", {"x": 1}) != model_fingerprint("m", {"x": 2})


def test_bad_chunk_size_is_a_config_error() -> None:
    with pytest.raises(ConfigError, match="chunk_size"):
        chunk_keys(TOKENS, "fp", 0)


def test_unsalted_keys_are_todays_bytes() -> None:
    # Pinned from the keys before salts existed: every cache already written keeps its keys.
    assert chunk_keys([1, 2, 3, 4, 5], "fp", 2)[-1].hex() == "710021df9680928271988a2fcc8031ce"
    assert chunk_keys([1, 2, 3, 4, 5], "fp", 2, "") == chunk_keys([1, 2, 3, 4, 5], "fp", 2)


def test_salted_keys_share_nothing_with_other_salts() -> None:
    plain, a, b = (set(chunk_keys(TOKENS, "fp", 256, salt)) for salt in ("", "tenant-a", "tenant-b"))
    assert not plain & a and not a & b and not plain & b  # not even the first chunk's key
    assert chunk_keys(TOKENS, "fp", 256, "tenant-a") == chunk_keys(TOKENS, "fp", 256, "tenant-a")
    # length-prefixed: moving characters between fingerprint and salt gives another root
    assert chunk_keys([1], "fpx", 4, "y") != chunk_keys([1], "fp", 4, "xy")


def test_bad_salt_is_refused() -> None:
    with pytest.raises(CacheRequestError, match="cache salt"):
        chunk_keys([1], "fp", 4, "s" * (MAX_SALT_CHARS + 1))
    with pytest.raises(CacheRequestError, match="cache salt"):
        PromptKeys.of([1], "fp", 4, 7)  # type: ignore[arg-type]
