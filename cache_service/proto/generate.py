"""Regenerate `kvcache_pb2.py` and `kvcache_pb2_grpc.py` from `kvcache.proto`.

    python -m cache_service.proto.generate            # rewrite the committed files
    python -m cache_service.proto.generate --out DIR  # write elsewhere (the diff test does this)

The output depends only on kvcache.proto and the grpcio-tools version (its bundled protoc); the
proto is passed by a path relative to this folder, so no absolute path enters the descriptor.
protoc writes `import kvcache_pb2` in the gRPC module; Step 2 turns it into a package-relative
import so the code works as `cache_service.proto.kvcache_pb2`.
"""

from __future__ import annotations

import argparse
import re
import sys
from pathlib import Path

PROTO_DIR = Path(__file__).resolve().parent
PROTO = "kvcache.proto"
GENERATED = ("kvcache_pb2.py", "kvcache_pb2_grpc.py")
_ABSOLUTE_IMPORT = re.compile(r"^import kvcache_pb2 as (\w+)$", re.MULTILINE)


def generate(out_dir: Path) -> list[Path]:
    """Write the generated modules into `out_dir`; returns their paths."""
    import importlib.resources

    from grpc_tools import protoc

    out_dir.mkdir(parents=True, exist_ok=True)
    well_known = importlib.resources.files("grpc_tools") / "_proto"
    # Step 1: protoc, with this folder as the include root so the descriptor names "kvcache.proto".
    code = protoc.main(
        [
            "grpc_tools.protoc",
            f"-I{PROTO_DIR}",
            f"-I{well_known}",
            f"--python_out={out_dir}",
            f"--grpc_python_out={out_dir}",
            str(PROTO_DIR / PROTO),
        ]
    )
    if code != 0:
        raise RuntimeError(f"protoc failed with exit status {code} on {PROTO_DIR / PROTO}")
    # Step 2: the package-relative import.
    grpc_module = out_dir / GENERATED[1]
    text = grpc_module.read_text()
    fixed, count = _ABSOLUTE_IMPORT.subn(r"from . import kvcache_pb2 as \1", text)
    if count != 1:
        raise RuntimeError(
            f"expected one 'import kvcache_pb2' line in {grpc_module}, found {count}"
        )
    grpc_module.write_text(fixed)
    return [out_dir / name for name in GENERATED]


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", type=Path, default=PROTO_DIR, help="output folder")
    args = parser.parse_args(argv)
    for path in generate(args.out):
        print(path, file=sys.stderr)
    return 0


if __name__ == "__main__":
    sys.exit(main())
