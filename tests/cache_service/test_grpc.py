"""Every RPC of the KV-cache service through `CacheClient`, against a real TieredCache
(host -> real Redis -> disk) served in-process on a free port."""

from __future__ import annotations

import grpc
import pytest
import torch

from cache_service.client import CacheClient
from cache_service.codec import decode_block, encode_block
from cache_service.errors import CacheError, CacheUnavailable
from cache_service.proto import kvcache_pb2 as pb
from cache_service.proto import kvcache_pb2_grpc as pb_grpc
from tests.cache_service.grpc_helpers import (
    MiB,
    blocks_for,
    chain_keys,
    delete_redis_keys,
    open_cache,
    payload,
    running_server,
    unique_deployment,
)
from tests.conftest import free_port

pytestmark = [pytest.mark.redis, pytest.mark.timeout(120)]


@pytest.fixture(scope="module")
def served(redis_url, tmp_path_factory):
    """(server, cache, deployment) shared by the module; Redis keys of the run deleted after."""
    deployment = unique_deployment("grpc")
    cache = open_cache(redis_url, tmp_path_factory.mktemp("disk"), deployment)
    try:
        with running_server(cache, chunk_bytes=1 * MiB) as server:
            yield server, cache, deployment
    finally:
        cache.close()
        delete_redis_keys(redis_url, deployment)


@pytest.fixture
def client(served):
    server, _, _ = served
    with CacheClient(server.address, timeout_s=10.0) as client:
        yield client


def test_put_then_get_returns_the_same_bytes_small_and_chunked(client):
    keys = chain_keys(3, seed=1)
    # 3 KiB (one chunk), 2.5 MiB + 7 (three chunks, the last one partial), an empty-ish block.
    sizes = [3 * 1024, 5 * MiB // 2 + 7, 1]
    sources = [payload(n, seed=10 + i) for i, n in enumerate(sizes)]
    blocks = [encode_block(t, key=k) for t, k in zip(sources, keys, strict=True)]

    assert client.put_many(list(zip(keys, blocks, strict=True))) == [True, True, True]
    assert client.put(keys[1], blocks[1]) is False  # put-if-absent: already there

    got = client.get_many(keys)
    assert [len(b) for b in got] == [len(b) for b in blocks]
    assert got == blocks
    for data, key, source in zip(got, keys, sources, strict=True):
        assert torch.equal(decode_block(data, expected_key=key), source)
    assert client.get(keys[1]) == blocks[1]
    assert client.faults == {}


def test_unknown_key_is_a_miss_not_a_fault(client):
    known = chain_keys(1, seed=2)
    client.put(known[0], blocks_for(known, 100, seed=2)[0])
    unknown = chain_keys(2, seed=999)
    assert client.get_many([unknown[0], known[0], unknown[1]])[0::2] == [None, None]
    assert client.get(unknown[0]) is None
    assert client.contains([unknown[0], known[0]]) == [False, True]
    assert client.faults == {}


def test_a_key_list_past_one_message_is_split_not_lost(served):
    """A client whose messages are limited to 256 KiB (~5,000 keys in wire form) asks for
    12,000: it splits them (before, get_many sent one request, and every block came back as a
    miss; at the default 8 MiB that was any prefix over ~161,000 blocks)."""
    server, _, _ = served
    keys = chain_keys(12_000, seed=5)
    ends = [keys[0], keys[-1]]
    blocks = blocks_for(ends, 100, seed=5)
    small = {"max_message_bytes": 256 * 1024, "chunk_bytes": 128 * 1024, "timeout_s": 30.0}
    with CacheClient(server.address, **small) as client:
        assert client.put_many(list(zip(ends, blocks, strict=True))) == [True, True]
        got = client.get_many(keys)
        assert len(got) == len(keys) and [got[0], got[-1]] == blocks
        assert sum(g is not None for g in got) == 2
        assert client.contains(keys)[-1] and client.longest_prefix(keys) == 1
        assert client.faults == {}


def test_longest_prefix_contains_and_evict(client):
    keys = chain_keys(8, seed=3)
    blocks = blocks_for(keys, 256, seed=3)
    client.put_many(list(zip(keys[:5], blocks[:5], strict=True)))
    assert client.longest_prefix(keys) == 5
    assert client.longest_prefix([]) == 0
    assert client.contains(keys) == [True] * 5 + [False] * 3

    assert client.evict([keys[1], keys[6]]) == 1  # keys[6] was never stored
    assert client.longest_prefix(keys) == 1
    assert client.contains(keys[:3]) == [True, False, True]
    assert client.get(keys[1]) is None


def test_keys_travel_with_their_chain_tags(served, client):
    """A block stored through the service is found by the same key used in-process."""
    _, cache, _ = served
    keys = chain_keys(70, seed=4)  # crosses a run boundary (64 blocks): two run tags
    blocks = blocks_for(keys, 64, seed=4)
    client.put_many(list(zip(keys, blocks, strict=True)))
    assert cache.get_many(keys) == blocks
    assert cache.longest_prefix(keys) == 70


def test_stats_and_health_report_the_tiers_and_the_server(client):
    keys = chain_keys(1, seed=5)
    client.put(keys[0], blocks_for(keys, 64, seed=5)[0])
    stats = client.stats()
    assert [t["name"] for t in stats["tiers"]] == ["host", "redis", "disk"]
    assert stats["server"]["requests"]["Put"] >= 1
    health = client.health()
    assert health["serving"] is True
    assert set(health["tiers"]) == {"host", "redis", "disk"}
    assert all(t["available"] for t in health["tiers"].values())


def test_record_attention_reaches_the_server(client):
    keys = chain_keys(2, seed=6)
    before = client.stats()["server"]["requests"].get("RecordAttention", 0)
    assert client.record_attention(keys, [0.5, 2.0]) is True
    assert client.stats()["server"]["requests"]["RecordAttention"] == before + 1
    with pytest.raises(CacheError, match="2 keys but 1 attention"):
        client.record_attention(keys, [0.5])


def test_a_block_that_does_not_match_its_key_is_refused_not_stored(client):
    keys = chain_keys(2, seed=7)
    misfiled = blocks_for(keys[:1], 128, seed=7)[0]  # encoded for keys[0]
    with pytest.raises(CacheError, match="INVALID_ARGUMENT"):
        client.put(keys[1], misfiled)
    assert client.contains([keys[1]]) == [False]


def _raw_stub(address: str, limit: int = 64 * MiB) -> tuple[grpc.Channel, pb_grpc.KVCacheStub]:
    channel = grpc.insecure_channel(
        address,
        options=[
            ("grpc.max_send_message_length", limit),
            ("grpc.max_receive_message_length", limit),
        ],
    )
    return channel, pb_grpc.KVCacheStub(channel)


def test_oversized_message_is_refused_and_the_server_keeps_serving(served, client):
    server, _, _ = served
    key = chain_keys(1, seed=8)[0]
    block = blocks_for([key], 9 * MiB, seed=8)[0]  # one message over the 8 MiB limit
    channel, stub = _raw_stub(server.address)
    with channel:
        chunk = pb.BlockChunk(key=key.to_wire(), total_bytes=len(block), data=block)
        with pytest.raises(grpc.RpcError) as caught:
            stub.Put(iter([chunk]), timeout=10)
        assert caught.value.code() == grpc.StatusCode.RESOURCE_EXHAUSTED
    assert client.health()["serving"] is True
    # The client itself chunks the same block and stores it.
    assert client.put(key, block) is True
    assert client.get(key) == block


def test_malformed_requests_are_invalid_argument(served):
    server, _, _ = served
    key = chain_keys(1, seed=9)[0].to_wire()
    channel, stub = _raw_stub(server.address)
    bad_streams = {
        "short key": [pb.BlockChunk(key=b"x" * 16 + b"y", total_bytes=1, data=b"z")],
        "gap": [
            pb.BlockChunk(key=key, total_bytes=10, data=b"abc"),
            pb.BlockChunk(key=key, total_bytes=10, offset=5, data=b"def"),
        ],
        "overflow": [
            pb.BlockChunk(key=key, total_bytes=4, data=b"abc"),
            pb.BlockChunk(key=key, total_bytes=4, offset=3, data=b"def"),
        ],
        "truncated": [pb.BlockChunk(key=key, total_bytes=10, data=b"abc")],
        "over the block limit": [
            pb.BlockChunk(key=key, total_bytes=server.config.max_block_bytes + 1, data=b"a")
        ],
    }
    with channel:
        for name, chunks in bad_streams.items():
            with pytest.raises(grpc.RpcError) as caught:
                stub.Put(iter(chunks), timeout=10)
            assert caught.value.code() == grpc.StatusCode.INVALID_ARGUMENT, name
        for call in (stub.LongestPrefix, stub.Contains, stub.Evict):
            with pytest.raises(grpc.RpcError) as caught:
                call(pb.KeyList(packed_keys=key + b"\x00"), timeout=10)
            assert caught.value.code() == grpc.StatusCode.INVALID_ARGUMENT
        assert stub.Health(pb.HealthRequest(), timeout=10).serving


def test_deadline_exceeded_is_a_miss_for_values_and_an_error_for_answers(served):
    server, _, _ = served
    keys = chain_keys(8, seed=10)
    blocks = blocks_for(keys, 5 * MiB // 2, seed=10)
    many = chain_keys(62_500, seed=100)
    with CacheClient(server.address) as client:
        assert client.put_many(list(zip(keys, blocks, strict=True))) == [True] * 8
        # 20 MiB cannot cross gRPC in 2 ms; a 62,500-key lookup cannot either.
        assert client.get_many(keys, timeout_s=0.002) == [None] * 8
        assert client.get(keys[0], timeout_s=1e-6) is None  # no time left: not even sent
        assert client.faults == {"get": 2}
        with pytest.raises(CacheUnavailable, match="DEADLINE_EXCEEDED"):
            client.longest_prefix(many, timeout_s=0.002)
        with pytest.raises(CacheUnavailable, match="DEADLINE_EXCEEDED"):
            client.contains(keys, timeout_s=1e-6)
        assert client.get_many(keys) == blocks  # the channel still works after the timeouts
        assert server.counters()["faults"] == {}


def test_unreachable_server_turns_reads_into_misses_and_answers_into_errors():
    address = f"127.0.0.1:{free_port()}"  # nothing listens there
    key = chain_keys(1, seed=11)[0]
    with CacheClient(address, timeout_s=1.0, retries=2, backoff_s=0.01) as client:
        assert client.get(key) is None
        assert client.put(key, b"anything") is False
        assert client.faults == {"get": 1, "put": 1}
        with pytest.raises(CacheUnavailable, match=r"UNAVAILABLE|DEADLINE"):
            client.contains([key])


def test_wrong_or_missing_token_is_unauthenticated(served, monkeypatch):
    _, cache, _ = served
    monkeypatch.delenv("MOE_CACHE_TOKEN", raising=False)
    key = chain_keys(1, seed=12)[0]
    block = blocks_for([key], 64, seed=12)[0]
    with running_server(cache, token="s3cret-token") as server:
        for token in (None, "wrong-token"):
            with CacheClient(server.address, token=token) as client:
                with pytest.raises(CacheError, match="UNAUTHENTICATED"):
                    client.get(key)
                with pytest.raises(CacheError, match="UNAUTHENTICATED"):
                    client.put(key, block)
                with pytest.raises(CacheError, match="UNAUTHENTICATED"):
                    client.health()
        monkeypatch.setenv("MOE_CACHE_TOKEN", "s3cret-token")  # the client reads the environment
        with CacheClient(server.address) as client:
            assert client.put(key, block) is True
            assert client.get(key) == block


def test_tls_with_a_pinned_certificate(served, tmp_path):
    cryptography = pytest.importorskip("cryptography")
    del cryptography
    _, cache, _ = served
    cert, key_file = _self_signed(tmp_path)
    key = chain_keys(1, seed=13)[0]
    block = blocks_for([key], 1000, seed=13)[0]
    with running_server(cache, tls_cert=cert, tls_key=key_file) as server:
        address = f"localhost:{server.port}"
        with CacheClient(address, tls_ca=cert, timeout_s=10) as client:
            assert client.put(key, block) is True
            assert client.get(key) == block
        with CacheClient(address, timeout_s=1.0, retries=0) as plain:
            assert plain.get(key) is None  # plaintext to a TLS port: a fault, a miss
            assert plain.faults == {"get": 1}


def _self_signed(folder):
    import datetime
    import ipaddress

    from cryptography import x509
    from cryptography.hazmat.primitives import hashes, serialization
    from cryptography.hazmat.primitives.asymmetric import ec
    from cryptography.x509.oid import NameOID

    private = ec.generate_private_key(ec.SECP256R1())
    name = x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, "localhost")])
    now = datetime.datetime.now(datetime.UTC)
    certificate = (
        x509.CertificateBuilder()
        .subject_name(name)
        .issuer_name(name)
        .public_key(private.public_key())
        .serial_number(x509.random_serial_number())
        .not_valid_before(now - datetime.timedelta(minutes=5))
        .not_valid_after(now + datetime.timedelta(days=1))
        .add_extension(
            x509.SubjectAlternativeName(
                [x509.DNSName("localhost"), x509.IPAddress(ipaddress.ip_address("127.0.0.1"))]
            ),
            critical=False,
        )
        .add_extension(x509.BasicConstraints(ca=True, path_length=None), critical=True)
        .sign(private, hashes.SHA256())
    )
    cert = folder / "cert.pem"
    key = folder / "key.pem"
    cert.write_bytes(certificate.public_bytes(serialization.Encoding.PEM))
    key.write_bytes(
        private.private_bytes(
            serialization.Encoding.PEM,
            serialization.PrivateFormat.PKCS8,
            serialization.NoEncryption(),
        )
    )
    return cert, key
