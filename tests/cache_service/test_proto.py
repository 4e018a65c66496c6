"""The committed gRPC code is exactly what `cache_service.proto.generate` produces from the proto."""

from __future__ import annotations

import re
from importlib.metadata import version
from pathlib import Path

import pytest

from cache_service.proto import generate

pytestmark = pytest.mark.timeout(120)


def _generated_grpc_version(path: Path) -> str:
    match = re.search(r"^GRPC_GENERATED_VERSION = '([^']+)'", path.read_text(), re.MULTILINE)
    assert match, f"{path} has no GRPC_GENERATED_VERSION line"
    return match.group(1)


def test_regenerated_code_matches_the_committed_files(tmp_path):
    committed = generate.PROTO_DIR / generate.GENERATED[1]
    tools = version("grpcio-tools")
    if _generated_grpc_version(committed) != tools:
        pytest.skip(
            f"grpcio-tools {tools} differs from {_generated_grpc_version(committed)}, which "
            "generated the committed code; its protoc writes a different version header"
        )
    written = generate.generate(tmp_path)
    assert [p.name for p in written] == list(generate.GENERATED)
    for path in written:
        assert path.read_text() == (generate.PROTO_DIR / path.name).read_text(), (
            f"{path.name} is stale: run `python -m cache_service.proto.generate`"
        )


def test_generated_grpc_module_imports_its_messages_relatively():
    text = (generate.PROTO_DIR / "kvcache_pb2_grpc.py").read_text()
    assert "from . import kvcache_pb2 as" in text
    assert re.search(r"^import kvcache_pb2", text, re.MULTILINE) is None


def test_proto_declares_every_rpc_of_the_service():
    from cache_service.proto import kvcache_pb2

    service = kvcache_pb2.DESCRIPTOR.services_by_name["KVCache"]
    methods = {m.name: (m.client_streaming, m.server_streaming) for m in service.methods}
    assert methods == {
        "Put": (True, False),
        "Get": (False, True),
        "LongestPrefix": (False, False),
        "Contains": (False, False),
        "Evict": (False, False),
        "RecordAttention": (False, False),
        "Stats": (False, False),
        "Health": (False, False),
    }
