"""Secure defaults, checked on the code and on running servers.

- Every server binds 127.0.0.1 unless configured: the config defaults, a scan of every literal
  in the project's code for an all-interfaces address, and a live cache server.
- No code-executing deserialisation anywhere in the project's code (pickle and friends,
  `torch.load` without `weights_only=True`, unsafe YAML loaders, eval/exec, numpy pickles).
- Secrets are never logged: a cache token, a Redis password and an HTTP API key are used, right
  and wrong, with every logger at DEBUG; none of them appears in any log record, in stderr, or in
  the errors the caller sees.
"""

from __future__ import annotations

import ast
import logging
from pathlib import Path

import pytest

from tests.conftest import REPO

PACKAGES = ("cluster", "placement", "actors", "cache_service", "deploy")
ALL_INTERFACES = {"0.0.0.0", "::", "[::]", "*"}


def project_files() -> list[Path]:
    files = [p for pkg in PACKAGES for p in (REPO / pkg).rglob("*.py")]
    files = [p for p in files if "_pb2" not in p.name]
    assert len(files) > 50, "the scan found too few files: wrong root?"
    return files


def parse(path: Path) -> ast.Module:
    return ast.parse(path.read_text(encoding="utf-8"), filename=str(path))


# ------------------------------------------------------------------------------ bind addresses


def test_config_defaults_bind_loopback():
    from actors.comm.group import Rendezvous
    from cache_service.server import ServerConfig
    from deploy.config import CacheSection, HttpSection, ServeConfig, to_serve_config

    assert HttpSection().host == "127.0.0.1"
    assert CacheSection().listen.startswith("127.0.0.1:")
    assert ServerConfig().host == "127.0.0.1"
    assert Rendezvous.fresh().host_port[0] == "127.0.0.1"
    serve = to_serve_config(ServeConfig.model_validate({"model": {"path": "demo"}}))
    assert serve["http_options"]["host"] == "127.0.0.1"


def test_no_all_interfaces_address_in_code():
    """No string literal in the project's code is an all-interfaces address (help texts that
    mention one are longer strings and pass); `bind(("", port))` is caught too."""
    found = []
    for path in project_files():
        for node in ast.walk(parse(path)):
            if isinstance(node, ast.Constant) and node.value in ALL_INTERFACES:
                found.append(f"{path.relative_to(REPO)}:{node.lineno}: {node.value!r}")
            if (
                isinstance(node, ast.Call)
                and isinstance(node.func, ast.Attribute)
                and node.func.attr == "bind"
                and node.args
                and isinstance(node.args[0], ast.Tuple)
                and isinstance(node.args[0].elts[0], ast.Constant)
                and node.args[0].elts[0].value == ""
            ):
                found.append(f"{path.relative_to(REPO)}:{node.lineno}: bind to ''")
    assert not found, found


def test_live_cache_server_listens_on_loopback_only():
    import socket

    from cache_service.namespace import CacheNamespace
    from cache_service.server import CacheServer, ServerConfig
    from cache_service.store import TieredCache

    ns = CacheNamespace(model_fingerprint="secure-defaults", deployment="bind-test")
    with TieredCache.from_urls(["host://"], capacities=[1 << 20], namespace=ns) as cache:
        server = CacheServer(cache, ServerConfig(port=0))
        server.start()
        try:
            host, port = server.address.rsplit(":", 1)
            assert host == "127.0.0.1"
            others = [
                a[4][0]
                for a in socket.getaddrinfo(socket.gethostname(), None, socket.AF_INET)
                if not a[4][0].startswith("127.")
            ]
            for addr in others[:1]:
                with socket.socket() as s, pytest.raises(OSError):
                    s.settimeout(1)
                    s.connect((addr, int(port)))
        finally:
            server.stop()


# --------------------------------------------------------------------- deserialisation

UNSAFE_MODULES = {"pickle", "cPickle", "_pickle", "dill", "cloudpickle", "marshal", "shelve"}
UNSAFE_CALLS = {"eval", "exec"}
UNSAFE_YAML = {"unsafe_load", "full_load", "unsafe_load_all", "full_load_all"}


def _unsafe_uses(tree: ast.Module) -> list[tuple[int, str]]:
    out = []
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            out += [
                (node.lineno, a.name) for a in node.names if a.name.split(".")[0] in UNSAFE_MODULES
            ]
        elif (
            isinstance(node, ast.ImportFrom) and (node.module or "").split(".")[0] in UNSAFE_MODULES
        ):
            out.append((node.lineno, node.module))
        elif isinstance(node, ast.Call):
            f = node.func
            name = (
                f.id if isinstance(f, ast.Name) else f.attr if isinstance(f, ast.Attribute) else ""
            )
            owner = (
                f.value.id if isinstance(f, ast.Attribute) and isinstance(f.value, ast.Name) else ""
            )
            kwargs = {k.arg: k.value for k in node.keywords}
            if isinstance(f, ast.Name) and name in UNSAFE_CALLS:
                out.append((node.lineno, name))
            if owner == "torch" and name == "load":
                safe = kwargs.get("weights_only")
                if not (isinstance(safe, ast.Constant) and safe.value is True):
                    out.append((node.lineno, "torch.load without weights_only=True"))
            if owner == "yaml" and name in UNSAFE_YAML:
                out.append((node.lineno, f"yaml.{name}"))
            if owner == "yaml" and name == "load":
                loader = ast.unparse(kwargs.get("Loader", ast.Constant(None)))
                if "Safe" not in loader:
                    out.append((node.lineno, f"yaml.load(Loader={loader})"))
            if owner in ("np", "numpy") and name == "load":
                allow = kwargs.get("allow_pickle")
                if isinstance(allow, ast.Constant) and allow.value is True:
                    out.append((node.lineno, "numpy.load(allow_pickle=True)"))
    return out


def test_no_code_executing_deserialisation_in_project_code():
    found = [
        f"{p.relative_to(REPO)}:{line}: {what}"
        for p in project_files()
        for line, what in _unsafe_uses(parse(p))
    ]
    assert not found, found


def test_the_scanner_catches_each_unsafe_form():
    sample = ast.parse(
        "import pickle\nfrom dill import loads\nimport torch, yaml, numpy as np\n"
        "torch.load(f)\ntorch.load(f, weights_only=False)\nyaml.load(t, Loader=yaml.Loader)\n"
        "yaml.unsafe_load(t)\neval('1')\nnp.load(f, allow_pickle=True)\n"
        "torch.load(f, weights_only=True)\nyaml.load(t, Loader=yaml.SafeLoader)\n"
    )
    assert [line for line, _ in _unsafe_uses(sample)] == [1, 2, 4, 5, 6, 7, 8, 9]


# ------------------------------------------------------------------------------ secrets

CACHE_TOKEN = "tok-3f9a1c7e5b2d4a60"
WRONG_TOKEN = "tok-wrong-88c1d0e4b7"
REDIS_PASSWORD = "pw-5e0b9d2c7a1f4e83"


@pytest.fixture
def debug_logs(caplog):
    caplog.set_level(logging.DEBUG)
    root = logging.getLogger()
    old = root.level
    root.setLevel(logging.DEBUG)
    yield caplog
    root.setLevel(old)


def _assert_absent(secrets: list[str], *texts: str) -> None:
    for secret in secrets:
        for text in texts:
            assert secret not in text, f"secret {secret[:6]}... leaked into: {text[:300]!r}"


def test_cache_token_is_never_logged(debug_logs, capfd, monkeypatch):
    from cache_service.client import CacheClient
    from cache_service.errors import CacheError
    from cache_service.namespace import CacheNamespace
    from cache_service.server import CacheServer, ServerConfig
    from cache_service.store import TieredCache

    ns = CacheNamespace(model_fingerprint="secure-defaults", deployment="token-test")
    errors = []
    with TieredCache.from_urls(["host://"], capacities=[1 << 20], namespace=ns) as cache:
        server = CacheServer(cache, ServerConfig(port=0, token=CACHE_TOKEN))
        server.start()
        try:
            with CacheClient(server.address, token=WRONG_TOKEN) as bad:
                with pytest.raises(CacheError) as err:
                    bad.stats()
                errors.append(f"{err.value!s} {err.value!r}")
            monkeypatch.setenv("MOE_CACHE_TOKEN", CACHE_TOKEN)
            with CacheClient(server.address) as good:
                good.stats()
                errors.append(repr(good))
        finally:
            server.stop()
    out, err = capfd.readouterr()
    records = "\n".join(f"{r.getMessage()} {r.args!r}" for r in debug_logs.records)
    assert any("cache" in r.name for r in debug_logs.records), "no cache log was captured"
    _assert_absent([CACHE_TOKEN, WRONG_TOKEN], records, out, err, *errors)


def test_redis_password_is_never_logged(debug_logs, capfd, monkeypatch):
    from cache_service.errors import CacheError
    from cache_service.namespace import CacheNamespace
    from cache_service.store import TieredCache
    from tests.cache_service.redis_servers import RedisServer, have_redis_server

    if not have_redis_server():
        pytest.skip("redis-server is not installed")
    server = RedisServer("--requirepass", REDIS_PASSWORD).start()
    ns = CacheNamespace(model_fingerprint="secure-defaults", deployment="password-test")
    seen = []
    try:
        from cache_service.tiers.redis_tier import PASSWORD_ENV

        monkeypatch.setenv(PASSWORD_ENV, REDIS_PASSWORD)
        url = f"redis://default@127.0.0.1:{server.port}/0"
        with TieredCache.from_urls([url], capacities=[1 << 20], namespace=ns) as cache:
            stats = cache.stats()
            seen.append(repr(stats))
            assert stats["tiers"][0].get("available", True)
        wrong = f"redis://default:not-{REDIS_PASSWORD[3:]}@127.0.0.1:{server.port}/0"
        try:
            with TieredCache.from_urls([wrong], capacities=[1 << 20], namespace=ns) as cache:
                seen.append(repr(cache.stats()))
        except CacheError as exc:
            seen.append(f"{exc!s} {exc!r}")
        inline = f"redis://default:{REDIS_PASSWORD}@127.0.0.1:{server.port}/0"
        with TieredCache.from_urls([inline], capacities=[1 << 20], namespace=ns) as cache:
            seen.append(repr(cache.stats()))
    finally:
        server.cleanup()
    out, err = capfd.readouterr()
    records = "\n".join(f"{r.getMessage()} {r.args!r}" for r in debug_logs.records)
    _assert_absent([REDIS_PASSWORD, REDIS_PASSWORD[3:]], records, out, err, *seen)


def test_server_config_repr_hides_the_token():
    from cache_service.server import ServerConfig

    assert CACHE_TOKEN not in repr(ServerConfig(token=CACHE_TOKEN))
