"""block_key / prefix_block_keys / weights_fingerprint."""

from __future__ import annotations

import hashlib
import shutil
import struct
import subprocess
import sys

import pytest
import torch
from safetensors.torch import save_file

from cache_service.block_key import (
    RUN_BLOCKS,
    WIRE_BYTES,
    BlockKey,
    block_key,
    prefix_block_keys,
    weights_fingerprint,
)
from cache_service.errors import CacheConfigError

BASE = dict(
    secret=b"deployment-secret",
    weights_fingerprint="fp-base",
    kv_dtype="float16",
    codec="raw",
    layer_range=(0, 4),
    kv_head_range=(0, 8),
    block_size=16,
    parent=None,
    token_ids=list(range(16)),
)


@pytest.mark.parametrize(
    ("field", "value"),
    [
        ("secret", b"other-secret"),
        ("weights_fingerprint", "fp-finetuned"),
        ("kv_dtype", "bfloat16"),
        ("codec", "int8"),
        ("layer_range", (0, 3)),
        ("layer_range", (4, 8)),
        ("kv_head_range", (0, 4)),
        ("token_ids", [*range(15), 99]),
        ("salt", b"tenant-b"),
    ],
)
def test_every_input_changes_the_key(field, value):
    assert block_key(**{**BASE, field: value}) != block_key(**BASE)


def test_block_size_and_parent_change_the_key():
    parent = block_key(**BASE)
    child = block_key(**{**BASE, "parent": parent})
    assert child != parent
    assert block_key(**{**BASE, "block_size": 8, "token_ids": list(range(8))}).digest not in (
        parent.digest,
        child.digest,
    )


def test_key_is_keyed_blake2b_128_and_deterministic_across_processes():
    key = block_key(**BASE)
    assert len(key.digest) == 16 and key.hex == key.digest.hex()
    code = f"from cache_service.block_key import block_key;print(block_key(**{BASE!r}).hex)"
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert out.stdout.strip() == key.hex


def test_prefix_keys_chain_and_equal_prefixes_share_blocks():
    common = dict((k, v) for k, v in BASE.items() if k not in ("parent", "token_ids"))
    tokens_a = [*range(16 * 70), 1, 2, 3]  # trailing partial block gets no key
    tokens_b = list(range(16 * 40)) + [5] * (16 * 10)
    a = prefix_block_keys(**common, token_ids=tokens_a)
    b = prefix_block_keys(**common, token_ids=tokens_b)
    assert len(a) == 70 and len(b) == 50
    assert a[:40] == b[:40] and a[40] != b[40]
    # Step by step with block_key gives the same chain.
    parent = None
    for i in range(70):
        parent = block_key(
            **{**BASE, "parent": parent, "token_ids": tokens_a[16 * i : 16 * i + 16]}
        )
        assert parent == a[i]
    # Placement hints: positions, runs of 64, roots.
    assert [k.position for k in a] == list(range(70))
    assert all(k.run_tag == a[0].digest for k in a[:RUN_BLOCKS])
    assert all(k.run_tag == a[RUN_BLOCKS].digest for k in a[RUN_BLOCKS:])
    assert all(k.root_tag == a[0].digest for k in a)
    # Continuing from a parent matches the one-shot chain.
    tail = prefix_block_keys(**common, token_ids=tokens_a[16 * 30 : 16 * 70], parent=a[29])
    assert tail == a[30:] and [k.run_tag for k in tail] == [k.run_tag for k in a[30:]]


def test_salt_separates_tenants_for_every_block():
    common = dict((k, v) for k, v in BASE.items() if k not in ("parent", "token_ids"))
    tokens = list(range(16 * 5))
    plain = prefix_block_keys(**common, token_ids=tokens)
    salted = prefix_block_keys(**common, token_ids=tokens, salt=b"tenant")
    assert not set(plain) & set(salted)


def test_wire_form_round_trips_with_its_hints():
    keys = prefix_block_keys(
        **{k: v for k, v in BASE.items() if k not in ("parent", "token_ids")},
        token_ids=list(range(16 * 66)),
    )
    wire = keys[65].to_wire()
    assert len(wire) == WIRE_BYTES
    back = BlockKey.from_wire(wire)
    assert back == keys[65]
    assert (back.position, back.run_tag, back.root_tag) == (65, keys[64].digest, keys[0].digest)
    assert BlockKey.from_hex(keys[3].hex) == keys[3]


@pytest.mark.parametrize(
    "change",
    [
        {"token_ids": list(range(15))},
        {"layer_range": (3, 3)},
        {"kv_head_range": (-1, 2)},
        {"secret": b""},
        {"block_size": 0, "token_ids": []},
        {"token_ids": [*range(15), -1]},
    ],
)
def test_bad_inputs_are_config_errors(change):
    with pytest.raises(CacheConfigError):
        block_key(**{**BASE, **change})


def test_bad_digests_are_config_errors():
    with pytest.raises(CacheConfigError):
        BlockKey(digest=b"short")
    with pytest.raises(CacheConfigError):
        BlockKey.from_hex("zz")
    with pytest.raises(CacheConfigError):
        BlockKey.from_wire(b"x" * 20)


def _checkpoint(folder, *, seed, config='{"model_type": "tiny"}'):
    folder.mkdir(parents=True, exist_ok=True)
    gen = torch.Generator().manual_seed(seed)
    save_file(
        {"w.a": torch.randn(8, 8, generator=gen), "w.b": torch.randn(4, generator=gen)},
        str(folder / "model-00001-of-00001.safetensors"),
    )
    (folder / "config.json").write_text(config)
    return folder


def test_fingerprint_tells_a_finetuned_copy_from_its_base(tmp_path):
    base = _checkpoint(tmp_path / "base", seed=0)
    copy = tmp_path / "copy"
    shutil.copytree(base, copy)
    tuned = _checkpoint(tmp_path / "tuned", seed=1)  # same config, same header, other weights
    header = lambda d: (d / "model-00001-of-00001.safetensors").read_bytes()[:200]  # noqa: E731
    assert header(base)[:8] == header(tuned)[:8]
    assert weights_fingerprint(base) == weights_fingerprint(copy)
    assert weights_fingerprint(base) != weights_fingerprint(tuned)
    other_config = _checkpoint(tmp_path / "cfg", seed=0, config='{"model_type": "tiny2"}')
    assert weights_fingerprint(other_config) != weights_fingerprint(base)


def test_fingerprint_never_reads_whole_files(tmp_path):
    """A 4 GiB sparse tensor: hashing it whole would take tens of seconds and read 4 GiB."""
    folder = tmp_path / "big"
    folder.mkdir()
    header = b'{"w": {"dtype": "F32", "shape": [1073741824], "data_offsets": [0, 4294967296]}}'
    path = folder / "model.safetensors"
    with path.open("wb") as handle:
        handle.write(struct.pack("<Q", len(header)) + header)
        handle.truncate(8 + len(header) + 4 * 2**30)
    expected = hashlib.blake2b(digest_size=32, person=b"moe-weights-v1")
    name, data = b"model.safetensors", header + b"\x00" * 64
    for item in (name, data):
        expected.update(struct.pack("<Q", len(item)) + item)
    assert weights_fingerprint(folder) == expected.hexdigest()


def test_fingerprint_bad_inputs(tmp_path):
    with pytest.raises(CacheConfigError):
        weights_fingerprint(tmp_path / "absent")
    with pytest.raises(CacheConfigError):
        weights_fingerprint(tmp_path)
    (tmp_path / "model.safetensors").write_bytes(struct.pack("<Q", 10**12))
    with pytest.raises(CacheConfigError):
        weights_fingerprint(tmp_path)
