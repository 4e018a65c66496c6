"""KVTiers' batched offload (store_many / load_many) over the real TieredCache: round trips are
exact across chunk boundaries, a corrupt, missing or misshapen block ends the loaded prefix, the
blocks are interchangeable with the one-block path, and the pinned host tier's zero-copy mode
(simulated on the CPU: what `host://` does with CUDA) keeps the rows it is given."""

from __future__ import annotations

import pytest
import torch

from actors.kv import offload as kv_offload
from actors.kv import store_puts as kv_store_puts
from actors.kv.cache import KVCache, KVLayout
from actors.kv.tiers import KVTiers
from cache_service.codec import HEADER_BYTES, BufferBlock, encode_block, is_buffer_block
from cache_service.store import TieredCache
from tests.cache_service.kv_blocks import SHAPE, keys_for, namespace, tensor_for

SHAPE_BYTES = tensor_for(0).numel() * 2


def host_cache(*, adopt: bool | str, capacity: int = 1 << 24) -> TieredCache:
    """adopt: False (copies), True (the pinned tier's fresh rows, simulated), "arena" (rows of
    the tier's arena: `host://?arena=1`, what `host://` is with CUDA)."""
    url = "host://?arena=1" if adopt == "arena" else "host://?arena=0"
    cache = TieredCache.from_urls([url], capacities=[capacity], namespace=namespace("kvb"))
    if adopt is True:
        # What the host tier does on a CUDA machine (pinned buffers): keep encode_rows' rows as
        # they are, and verify every read (the rows are mutable).
        tier = cache.tiers[0]
        tier.adopts_buffers, tier.holds_verified = True, False
    return cache


def blocks(n: int, seed: int = 0) -> torch.Tensor:
    return torch.stack([tensor_for(i, seed) for i in range(n)])


class UncheckedCache:
    """A cache that hands back whatever bytes it holds, unverified (as a remote cache may)."""

    def __init__(self) -> None:
        self.data: dict = {}

    def get(self, key):
        return self.data.get(key)

    def put(self, key, block):
        if key in self.data:
            return False
        self.data[key] = bytes(memoryview(block))
        return True

    def longest_prefix(self, keys):
        return next((i for i, k in enumerate(keys) if k not in self.data), len(keys))


@pytest.fixture(params=[False, True, "arena"], ids=["copying", "adopting", "arena"])
def adopt(request):
    return request.param


@pytest.fixture
def small_chunks(monkeypatch):
    """Three blocks per store chunk, two per load chunk (loads of more than four blocks in spans,
    the last one block): every path crosses chunk boundaries."""
    width = HEADER_BYTES + tensor_for(0).numel() * 2
    monkeypatch.setattr(kv_offload, "STORE_CHUNK_BYTES", 3 * width)
    monkeypatch.setattr(kv_offload, "LOAD_CHUNK_BYTES", 2 * width)
    monkeypatch.setattr(kv_offload, "SMALL_LOAD_BYTES", 4 * width)
    monkeypatch.setattr(kv_offload, "LOAD_TAIL_BYTES", width)


def test_round_trip_is_exact_across_chunks(adopt, small_chunks):
    cache = host_cache(adopt=adopt)
    tiers = KVTiers(cache, block_shape=SHAPE)
    keys, data = keys_for(11, seed=1), blocks(11, seed=1)
    assert tiers.store_many(keys, data) == [True] * 11
    assert tiers.store_many(keys[:2], data[:2]) == [False, False]
    got = tiers.load_many(keys, dtype=torch.float16)
    assert got.shape == (11, *SHAPE) and got.dtype == torch.float16
    assert torch.equal(got, data)
    assert tiers.counts["hits"] == 11 and tiers.counts["stored"] == 11
    stored = [cache.tiers[0]._blocks[k][0] for k in keys]
    if adopt == "arena":
        # Zero copy: the tier holds the very rows KVTiers encoded, adjacent rows of one slab.
        assert all(is_buffer_block(s) for s in stored)
        assert len({s.owner.data_ptr() for s in stored}) == 1
        assert [s.offset for s in stored] == [i * stored[0].nbytes for i in range(11)]
    elif adopt:
        # Zero copy: the tier holds the very rows KVTiers encoded, three per pinned chunk.
        assert all(is_buffer_block(s) for s in stored)
        assert stored[0].owner is stored[2].owner and stored[3].owner is not stored[0].owner
    else:
        # Copies, not KVTiers' rows: immutable bytes (pinned buffers on a CUDA machine).
        assert not any(is_buffer_block(s) for s in stored)
        assert all(isinstance(s, bytes) for s in stored) or torch.cuda.is_available()
    # The rows KVTiers reuses next time are not what the cache holds.
    tiers.store_many(keys_for(3, seed=2), blocks(3, seed=2))
    assert torch.equal(tiers.load_many(keys, dtype=torch.float16), data)


def test_one_block_and_batched_paths_read_each_other(adopt):
    cache = host_cache(adopt=adopt)
    tiers = KVTiers(cache, block_shape=SHAPE)
    keys, data = keys_for(6, seed=3), blocks(6, seed=3)
    for k, b in zip(keys[:3], data[:3], strict=True):
        assert tiers.store(k, b)
    assert tiers.store_many(keys[3:], data[3:]) == [True] * 3
    assert torch.equal(tiers.load_many(keys, dtype=torch.float16), data)
    assert torch.equal(torch.stack(tiers.load(keys)), data)


def test_a_corrupt_block_ends_the_prefix_and_is_dropped(small_chunks):
    cache = host_cache(adopt=True)
    tiers = KVTiers(cache, block_shape=SHAPE)
    keys, data = keys_for(9, seed=4), blocks(9, seed=4)
    tiers.store_many(keys, data)
    row = cache.tiers[0]._blocks[keys[5]][0]
    assert isinstance(row, BufferBlock)
    row[HEADER_BYTES + 100] ^= 0x40  # one bit of block 5's payload, in host memory
    got = tiers.load_many(keys, dtype=torch.float16)
    assert torch.equal(got, data[:5])
    assert cache.stats()["tiers"][0]["corrupt"] == 1  # the store caught it and deleted it
    assert cache.contains([keys[5]]) == [False] and tiers.counts["misses"] == 1


def test_kvtiers_verifies_what_an_unchecking_cache_returns(small_chunks):
    cache = UncheckedCache()
    tiers = KVTiers(cache, block_shape=SHAPE)
    keys, data = keys_for(7, seed=5), blocks(7, seed=5)
    assert tiers.store_many(keys, data) == [True] * 7
    bad = bytearray(cache.data[keys[4]])
    bad[-1] ^= 1
    cache.data[keys[4]] = bytes(bad)
    assert torch.equal(tiers.load_many(keys, dtype=torch.float16), data[:4])
    assert tiers.counts["corrupt"] == 1
    # A block of another dtype under the right key (valid header and checksum) is refused too.
    cache.data[keys[4]] = encode_block(data[4].float(), key=keys[4])
    assert tiers.load_many(keys, dtype=torch.float16).shape[0] == 4
    assert tiers.counts["corrupt"] == 2
    # A missing block ends the prefix as a miss.
    del cache.data[keys[2]]
    assert torch.equal(tiers.load_many(keys, dtype=torch.float16), data[:2])
    assert tiers.counts["misses"] == 1


def test_a_faulting_cache_is_a_counted_miss():
    class Broken(UncheckedCache):
        def get(self, key):
            raise ConnectionError("down")

        def put(self, key, block):
            raise ConnectionError("down")

    tiers = KVTiers(Broken(), block_shape=SHAPE)
    keys = keys_for(3, seed=6)
    assert tiers.store_many(keys, blocks(3)) == [False] * 3
    assert tiers.load_many(keys, dtype=torch.float16).shape == (0, *SHAPE)
    assert tiers.counts["faults"] == 2 and tiers.counts["stored"] == 0


def test_store_many_refuses_a_wrong_shape():
    tiers = KVTiers(host_cache(adopt=False), block_shape=SHAPE)
    with pytest.raises(ValueError, match="shape"):
        tiers.store_many(keys_for(2), torch.zeros(2, 3, 4))
    with pytest.raises(ValueError, match="2 keys for 3 blocks"):
        tiers.store_many(keys_for(2), blocks(3))


@pytest.mark.parametrize("mla", [False, True])
def test_kv_cache_reads_and_writes_many_blocks(mla):
    if mla:
        layout = KVLayout(mla=True, block_size=4, layer_range=(2, 5), kv_head_range=(0, 1),
                          latent_dim=6)  # fmt: skip
    else:
        layout = KVLayout(mla=False, block_size=4, layer_range=(2, 5), kv_head_range=(0, 2),
                          head_dim=3)  # fmt: skip
    cache = KVCache(layout, 10)
    data = torch.randn(4, *layout.block_shape)
    cache.write_blocks([7, 1, 4, 9], data)
    for i, b in enumerate([7, 1, 4, 9]):
        assert torch.equal(cache.read_block(b), data[i])
    assert torch.equal(cache.read_blocks([9, 7]), data[[3, 0]])
    with pytest.raises(Exception, match="shape"):
        cache.write_blocks([1], data)


def test_chunks_of_a_mebibyte_and_more_are_checksummed_on_worker_threads(adopt):
    cache = host_cache(adopt=adopt, capacity=1 << 26)
    tiers = KVTiers(cache, block_shape=SHAPE)
    tiers.workers = 3
    keys, data = keys_for(300, seed=7), blocks(300, seed=7)  # 1.2 MiB: one chunk, 3 parts
    assert tiers.store_many(keys, data) == [True] * 300
    assert torch.equal(tiers.load_many(keys, dtype=torch.float16), data)
    assert torch.equal(torch.stack(tiers.load(keys[-2:])), data[-2:])
    tiers.close()


def test_each_block_is_hashed_once_per_read(small_chunks, monkeypatch):
    """Over the in-process TieredCache (which verifies what it returns) load_many does not hash a
    block again; over a cache that does not say so, it hashes every block itself."""
    from cache_service import codec

    hashed = []
    real = codec._checksum

    def counting(*parts):
        hashed.append(1)
        return real(*parts)

    for cache, want in ((host_cache(adopt=True), 9), (UncheckedCache(), 9)):
        tiers = KVTiers(cache, block_shape=SHAPE)
        keys, data = keys_for(9, seed=8), blocks(9, seed=8)
        tiers.store_many(keys, data)
        monkeypatch.setattr(codec, "_checksum", counting)
        hashed.clear()
        assert torch.equal(tiers.load_many(keys, dtype=torch.float16), data)
        assert len(hashed) == want, (type(cache).__name__, len(hashed))
        monkeypatch.setattr(codec, "_checksum", real)


@pytest.mark.parametrize("where", ["header", "payload"])
def test_mix64_offload_is_verified_where_it_lands(adopt, small_chunks, monkeypatch, where):
    """checksum="mix64" (what CUDA blocks use; the same code on CPU tensors): no host hashing
    on either side, every block verified in the staging rows, a flipped bit anywhere ends the
    prefix there and drops the block."""
    from cache_service import codec

    monkeypatch.setattr(kv_offload, "VERIFY_GROUP_BYTES", 3 * (HEADER_BYTES + SHAPE_BYTES))
    hashed = []
    real = codec._checksum
    monkeypatch.setattr(codec, "_checksum", lambda *p: hashed.append(1) or real(*p))
    cache = host_cache(adopt=adopt)
    tiers = KVTiers(cache, block_shape=SHAPE, checksum="mix64")
    keys, data = keys_for(11, seed=8), blocks(11, seed=8)
    assert tiers.store_many(keys, data) == [True] * 11
    assert torch.equal(tiers.load_many(keys, dtype=torch.float16), data)
    assert hashed == []  # no XXH3 anywhere; the store did not hash the reads either
    if not adopt:
        return
    row = cache.tiers[0]._blocks[keys[7]][0]
    assert tiers.counts["stored"] == 11
    row[30 if where == "header" else HEADER_BYTES + 77] ^= 0x10
    assert torch.equal(tiers.load_many(keys, dtype=torch.float16), data[:7])
    assert tiers.counts["corrupt"] == 1 and cache.contains([keys[7]]) == [False]


def test_mix64_blocks_from_an_unchecking_cache_and_old_blocks_mixed(small_chunks):
    cache = UncheckedCache()
    tiers = KVTiers(cache, block_shape=SHAPE, checksum="mix64")
    keys, data = keys_for(7, seed=9), blocks(7, seed=9)
    for k, b in zip(keys[:2], data[:2], strict=True):
        assert tiers.store(k, b)  # XXH3 blocks of the one-block path
    assert tiers.store_many(keys[2:], data[2:]) == [True] * 5
    assert torch.equal(tiers.load_many(keys, dtype=torch.float16), data)
    for i in (1, 5):  # an XXH3 block hashed on the host, a MIX64 one verified in staging
        bad = bytearray(cache.data[keys[i]])
        bad[-3] ^= 1
        cache.data[keys[i]] = bytes(bad)
        assert torch.equal(tiers.load_many(keys, dtype=torch.float16), data[:i])
        cache.data.pop(keys[i])
        assert tiers.store(keys[i], data[i])
    assert tiers.counts["corrupt"] == 2
    # The CPU one-block path decodes the MIX64 blocks too.
    assert torch.equal(torch.stack(tiers.load(keys)), data)


@pytest.mark.parametrize("checksum", ["mix64", "xxh3"])
def test_arena_rows_are_reused_after_eviction_without_aliasing_live_blocks(small_chunks, checksum):
    """The host tier's arena: a store after an eviction reuses the freed rows (no new slab), the
    blocks still in the tier keep their bytes, a block a reader still holds keeps its row, and a
    corrupt row is still caught (and its row reused once it is dropped)."""
    cache = host_cache(adopt="arena")
    arena = cache.tiers[0].arena
    tiers = KVTiers(cache, block_shape=SHAPE, checksum=checksum)
    a_keys, a_data = keys_for(8, seed=11), blocks(8, seed=11)
    assert tiers.store_many(a_keys, a_data) == [True] * 8
    slabs, reused = arena.slab_count(), arena.reused_rows
    held = cache.get_many(a_keys[1:2], verify=False)[0]  # a reader still holds block 1
    held_bytes = bytes(held)
    assert cache.evict(a_keys[:4]) == 4
    # Four new blocks: three rows freed by the eviction are reused; block 1's row is not.
    b_keys, b_data = keys_for(4, seed=12), blocks(4, seed=12)
    assert tiers.store_many(b_keys, b_data) == [True] * 4
    assert arena.slab_count() == slabs and arena.reused_rows == reused + 3
    assert bytes(held) == held_bytes
    rows = {cache.tiers[0]._blocks[k][0].offset for k in [*a_keys[4:], *b_keys]}
    assert held.offset not in rows and len(rows) == 8
    assert torch.equal(tiers.load_many(a_keys[4:], dtype=torch.float16), a_data[4:])
    assert torch.equal(tiers.load_many(b_keys, dtype=torch.float16), b_data)
    # Overwrite after evict: the same keys stored again land in reused rows, exact.
    del held
    assert cache.evict(b_keys) == 4
    assert tiers.store_many(b_keys, b_data) == [True] * 4
    assert arena.slab_count() == slabs
    assert torch.equal(tiers.load_many([*a_keys[4:], *b_keys], dtype=torch.float16),
                       torch.cat([a_data[4:], b_data]))  # fmt: skip
    # Corruption in an arena row is still a miss: the prefix ends there and the block is dropped.
    row = cache.tiers[0]._blocks[b_keys[2]][0]
    row[HEADER_BYTES + 5] ^= 0x08
    del row
    got = tiers.load_many([*a_keys[4:], *b_keys], dtype=torch.float16)
    assert torch.equal(got, torch.cat([a_data[4:], b_data[:2]]))
    # (MIX64: KVTiers verified it where it landed; XXH3: the store did, a miss for KVTiers.)
    assert tiers.counts["corrupt" if checksum == "mix64" else "misses"] == 1
    assert cache.contains([b_keys[2]]) == [False]
    assert tiers.store_many(b_keys[2:3], b_data[2:3]) == [True]
    assert torch.equal(tiers.load_many(b_keys, dtype=torch.float16), b_data)
    assert tiers.tier_hits == {"host": tiers.counts["hits"]}


def test_mix64_store_lands_whole_blocks_checks_them_and_puts_in_batches(small_chunks, monkeypatch):
    """checksum="mix64" (what CUDA blocks use): the headers and checksums are written with the
    payloads (on the device there), the host only checks them (`encode_rows(written=True)`) and
    puts ~PUT_BATCH_BYTES of adjacent pieces at a time, the last piece alone; the store admits
    the checked rows without a second header check."""
    from cache_service import codec, store

    width = HEADER_BYTES + SHAPE_BYTES
    monkeypatch.setattr(kv_store_puts, "PUT_BATCH_BYTES", 6 * width)  # two pieces of three
    puts, checks, written = [], [], []
    real_put, real_check = kv_store_puts.put_many, store.check_header
    real_encode = codec.encode_rows
    monkeypatch.setattr(kv_store_puts, "put_many", lambda c, items: puts.append(len(items))
                        or real_put(c, items))  # fmt: skip
    monkeypatch.setattr(store, "check_header", lambda *a, **k: checks.append(1)
                        or real_check(*a, **k))  # fmt: skip
    monkeypatch.setattr(kv_store_puts, "encode_rows", lambda *a, **k: written.append(k["written"])
                        or real_encode(*a, **k))  # fmt: skip
    cache = host_cache(adopt="arena")
    tiers = KVTiers(cache, block_shape=SHAPE, checksum="mix64")
    keys, data = keys_for(11, seed=13), blocks(11, seed=13)  # pieces of 3, 3, 3, 2 blocks
    assert tiers.store_many(keys, data) == [True] * 11
    assert puts == [6, 3, 2] and written == [True] * 3 and checks == []
    assert torch.equal(tiers.load_many(keys, dtype=torch.float16), data)
    stored = [cache.tiers[0]._blocks[k][0] for k in keys]
    assert all(s.checked_for is None for s in stored)  # every mark spent by the admission
    for i, s in enumerate(stored):
        want = codec.encode_block(data[i], key=keys[i], checksum="mix64")
        assert bytes(memoryview(s)) == bytes(want)


@pytest.mark.parametrize("adopt", [False, "arena"], ids=["copying", "arena"])
def test_a_header_written_wrong_is_not_stored(small_chunks, monkeypatch, adopt):
    """A header the device wrote that is not its key's (here block 4's key digest, one bit) is
    refused by the host's check: its batch is not stored (counted corrupt), the others are, and
    nothing is filed under a wrong header."""
    real = kv_offload._headers

    def wrong(*args):
        heads = real(*args)
        heads.view(torch.uint8)[4, 50] ^= 1  # in the key digest, bytes [44, 60)
        return heads

    monkeypatch.setattr(kv_offload, "_headers", wrong)
    monkeypatch.setattr(kv_store_puts, "PUT_BATCH_BYTES", 3 * (HEADER_BYTES + SHAPE_BYTES))
    cache = host_cache(adopt=adopt)
    tiers = KVTiers(cache, block_shape=SHAPE, checksum="mix64")
    keys, data = keys_for(7, seed=14), blocks(7, seed=14)  # batches of 3, 3, 1 blocks
    assert tiers.store_many(keys, data) == [True] * 3 + [False] * 3 + [True]
    assert tiers.counts["corrupt"] == 1 and tiers.counts["stored"] == 4
    assert cache.contains(keys) == [True] * 3 + [False] * 3 + [True]
    monkeypatch.setattr(kv_offload, "_headers", real)
    assert tiers.store_many(keys, data) == [False] * 3 + [True] * 3 + [False]
    assert torch.equal(tiers.load_many(keys, dtype=torch.float16), data)


def test_store_batches_are_adjacent_rows_of_one_buffer_the_last_piece_alone(monkeypatch):
    monkeypatch.setattr(kv_store_puts, "PUT_BATCH_BYTES", 100)
    a, b = object(), object()
    pieces = [(0, 3, a, 0, True), (3, 6, a, 3, True), (6, 9, a, 6, True), (9, 12, a, 9, True),
              (12, 14, b, 0, True), (14, 16, b, 2, True), (16, 18, b, 5, True)]  # fmt: skip
    # width 10: at most ten rows a batch; a new buffer or a gap starts one; the last alone.
    assert kv_store_puts.plan_batches(pieces, 10) == [(0, 3), (3, 4), (4, 6), (6, 7)]
    assert kv_store_puts.plan_batches(pieces[:1], 10) == [(0, 1)]
    assert kv_store_puts.plan_batches(pieces[:2], 10) == [(0, 1), (1, 2)]


def test_a_batch_is_put_during_the_launches_only_once_all_its_pieces_landed():
    """`landed_batches` (what a CUDA store puts between its rounds of launches): in order, only
    batches whose pieces are all queued and whose last piece's rows landed."""
    batches = [(0, 2), (2, 4), (4, 5)]
    everything = lambda c: True  # noqa: E731
    assert kv_store_puts.landed_batches(batches, 0, 5, everything) == 3
    assert kv_store_puts.landed_batches(batches, 0, 3, everything) == 1  # piece 3 not queued
    assert kv_store_puts.landed_batches(batches, 1, 3, everything) == 1
    assert kv_store_puts.landed_batches(batches, 0, 5, lambda c: c < 3) == 1  # piece 3 in flight
    assert kv_store_puts.landed_batches(batches, 0, 5, lambda c: c != 1) == 0  # in order
    assert kv_store_puts.landed_batches(batches, 2, 5, lambda c: c == 4) == 3


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
def test_cuda_store_lands_the_blocks_encode_block_makes(small_chunks):
    """On a GPU the headers and checksums are written in the staging rows: what lands in the
    host tier is byte for byte what `encode_block` makes, and loads back exact."""
    cache = host_cache(adopt="arena")
    tiers = KVTiers(cache, block_shape=SHAPE)
    keys, data = keys_for(11, seed=15), blocks(11, seed=15)
    assert tiers.store_many(keys, data.cuda()) == [True] * 11
    for i, key in enumerate(keys):
        row = cache.tiers[0]._blocks[key][0]
        assert bytes(memoryview(row)) == bytes(encode_block(data[i], key=key, checksum="mix64"))
    assert torch.equal(tiers.load_many(keys, dtype=torch.float16, device="cuda").cpu(), data)


@pytest.mark.parametrize("bad", [0, 3, 10])
def test_mix64_load_verifies_every_span_when_small_spans_are_verified_together(
    small_chunks, monkeypatch, bad
):
    """Spans too small to cover a verification's launches are verified with a later one
    (VERIFY_AFTER_BYTES): a bad block in the first, a middle or the last span still ends the
    prefix there."""
    # Spans of 2, 4, 5 blocks: the first two verified together, after the last one's copies.
    monkeypatch.setattr(kv_offload, "VERIFY_AFTER_BYTES", 5 * (HEADER_BYTES + SHAPE_BYTES))
    cache = host_cache(adopt="arena")
    tiers = KVTiers(cache, block_shape=SHAPE, checksum="mix64")
    keys, data = keys_for(11, seed=16), blocks(11, seed=16)
    assert tiers.store_many(keys, data) == [True] * 11
    cache.tiers[0]._blocks[keys[bad]][0][HEADER_BYTES + 9] ^= 4
    assert torch.equal(tiers.load_many(keys, dtype=torch.float16), data[:bad])
    assert tiers.counts["corrupt"] == 1 and cache.contains([keys[bad]]) == [False]


class _FakeEvent:
    """A CUDA event's part the store's launch loop uses; the CPU copies are done when queued."""

    def record(self, stream=None):
        pass

    def query(self):
        return True

    def synchronize(self):
        pass


class _FakeStream:
    def __init__(self, name: str, log: list) -> None:
        self.name, self.log = name, log

    def wait_event(self, event):
        pass


def test_the_cuda_launch_loop_stages_through_the_ring_and_puts_landed_batches_between_rounds(
    small_chunks, monkeypatch
):
    """The CUDA store's launch loop (`kv_offload._launch`) run on CPU tensors, its streams and
    events faked (a GPU cannot run here): the rows go through a ring of two staging slots in
    rounds (the first piece alone), land byte for byte what `encode_block` makes, and a batch
    whose rows landed is put before the next round's launches."""
    from contextlib import nullcontext

    log: list = []
    monkeypatch.setattr(kv_offload, "STAGING_SLOTS", 2)
    monkeypatch.setattr(kv_offload, "_on_cuda", lambda src: True)
    monkeypatch.setattr(kv_store_puts, "PUT_BATCH_BYTES", 6 * (HEADER_BYTES + SHAPE_BYTES))
    monkeypatch.setattr(torch.cuda, "current_stream", lambda device=None: _FakeStream("cur", log))
    monkeypatch.setattr(torch.cuda, "set_stream", lambda s: log.append(("stream", s.name)))
    monkeypatch.setattr(torch.cuda, "stream", lambda s: nullcontext())
    real_put = kv_store_puts.Puts.put_next
    monkeypatch.setattr(kv_store_puts.Puts, "put_next", lambda self: log.append(("put", self.done))
                        or real_put(self))  # fmt: skip
    cache = host_cache(adopt="arena")
    tiers = KVTiers(cache, block_shape=SHAPE, checksum="mix64")
    names = {0: "copy", 1: "checks", 2: "staging"}
    monkeypatch.setattr(tiers, "side_stream", lambda d, which=0: _FakeStream(names[which], log))
    monkeypatch.setattr(tiers, "event", lambda d, i, s: _FakeEvent())
    keys, data = keys_for(11, seed=17), blocks(11, seed=17)  # pieces of 3, 3, 3, 2 blocks
    src = data.view(11, -1).view(torch.uint8)
    width = HEADER_BYTES + SHAPE_BYTES
    lease = cache.tiers[0].arena.take(width, 11)
    pieces = kv_offload._pieces(tiers, 11, width, lease, pinned=False, fresh=True)
    marks = kv_offload.Marks(None, None)
    out = kv_offload._store_pieces(tiers, keys, src, data.dtype, SHAPE, pieces, lease, True,
                                   True, marks)  # fmt: skip
    lease.close()
    assert out == [True] * 11
    # Rounds: piece 0; pieces 1-2 (then batch 0, pieces 0-1, is put); piece 3 (then the rest).
    assert log == [("stream", "staging"), ("stream", "copy"), ("stream", "staging"),
                   ("stream", "copy"), ("put", 0), ("put", 1), ("stream", "staging"),
                   ("stream", "copy"), ("put", 2), ("stream", "cur")]  # fmt: skip
    for i, key in enumerate(keys):
        row = cache.tiers[0]._blocks[key][0]
        assert bytes(memoryview(row)) == bytes(encode_block(data[i], key=key, checksum="mix64"))
    assert torch.equal(tiers.load_many(keys, dtype=torch.float16), data)
