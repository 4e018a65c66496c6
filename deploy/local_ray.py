"""A local Ray closed to other processes and machines: the Ray that `moectl demo`, `moectl serve`
without --address and `moectl bench serving` start on this machine.

    local = LocalRayEnv.create()           # before ray.init
    ray.init(address="local", **LOOPBACK_INIT, runtime_env=with_loopback_hook(env))
    ...
    ray.shutdown(); local.undo()

Step 1: token authentication on (RAY_AUTH_MODE=token), whatever the environment says: a token
        made for this one Ray (256 random bits) in a file of mode 0600 inside a fresh folder of
        mode 0700, named by RAY_AUTH_TOKEN_PATH. Both variables are set in this process's
        environment before `ray.init`, so the GCS, the raylet, the agents and every worker inherit
        them; an inherited RAY_AUTH_TOKEN is dropped (Ray reads it before the file). A process
        that connects without this token (another driver, a job client, a raw gRPC call) is
        refused with UNAUTHENTICATED.
Step 2: the node address 127.0.0.1. `ray.init(_node_ip_address="127.0.0.1")` alone does not do it:
        Ray turns a loopback node address into the machine's reachable one
        (ray/_private/services.py `resolve_ip_for_localhost`) unless multi-node clusters are off,
        which is Ray's own switch RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER=0 (the default on macOS and
        Windows; its constant `ray_constants.ENABLE_RAY_CLUSTER` is set too when Ray is already
        imported). With a loopback node address Ray 2.60 binds its gRPC servers (GCS, raylet node
        manager, object manager, the core worker of the driver and of every worker), the
        dashboard agent, the runtime-env agent and the Prometheus exporter to 127.0.0.1; with any
        other, to that address or to every interface. The dashboard is not started.
Step 3: Serve's replicas open an inter-deployment gRPC server on `[::]:0` whatever the node address
        (ray/serve/_private/replica.py passes that literal to ray._common.tls_utils'
        `add_port_to_grpc_server`). `bind_loopback`, installed as the job's worker-process setup
        hook, runs first in every worker of this Ray and rewrites a wildcard host given to that
        helper to 127.0.0.1; the replica reports its node address (127.0.0.1) to its callers, so
        they reach it there.

`LocalRayEnv.undo()` (after `ray.shutdown`) removes the token and puts this process's
environment back as it was, so one process can start local Rays in turn.
"""

from __future__ import annotations

import os
import secrets
import shutil
import tempfile
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

LOOPBACK = "127.0.0.1"
LOOPBACK_INIT: dict[str, Any] = {"include_dashboard": False, "_node_ip_address": LOOPBACK}
"""`ray.init` arguments of a local Ray bound to the loopback interface (Step 2)."""
SETUP_HOOK = "deploy.local_ray.bind_loopback"
CLUSTER_ENV = "RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER"
MANAGED_ENV = ("RAY_AUTH_MODE", "RAY_AUTH_TOKEN_PATH", "RAY_AUTH_TOKEN", CLUSTER_ENV)


@dataclass
class LocalRayEnv:
    """The token and environment of one local Ray (Steps 1-2), and what they replaced."""

    folder: Path
    """A fresh folder of mode 0700 holding `auth_token` (mode 0600)."""
    previous_env: dict[str, str | None] = field(default_factory=dict)
    previous_cluster: bool | None = None

    @property
    def token_file(self) -> Path:
        return self.folder / "auth_token"

    @classmethod
    def create(cls) -> LocalRayEnv:
        """Make the token and switch this process's environment to it (before `ray.init`).
        EnvironmentMissing when this process is already connected to a Ray: its config would
        change under it, and a second `ray.init` would fail anyway."""
        import ray
        from ray._private import ray_constants

        from cluster.errors import EnvironmentMissing

        if ray.is_initialized():
            raise EnvironmentMissing(
                "this process is already connected to a Ray; a local stack starts its own"
            )

        folder = Path(tempfile.mkdtemp(prefix="moe-ray-auth-"))  # mode 0700
        local = cls(
            folder=folder,
            previous_env={k: os.environ.get(k) for k in MANAGED_ENV},
            previous_cluster=ray_constants.ENABLE_RAY_CLUSTER,
        )
        fd = os.open(local.token_file, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
        with os.fdopen(fd, "w") as f:
            f.write(secrets.token_hex(32))
        # Step 1: the token.
        os.environ.pop("RAY_AUTH_TOKEN", None)
        os.environ["RAY_AUTH_MODE"] = "token"
        os.environ["RAY_AUTH_TOKEN_PATH"] = str(local.token_file)
        _reload_ray_auth()
        # Step 2: a local-only Ray, so the node address stays 127.0.0.1.
        os.environ[CLUSTER_ENV] = "0"
        ray_constants.ENABLE_RAY_CLUSTER = False
        return local

    def token(self) -> str:
        return self.token_file.read_text().strip()

    def undo(self) -> None:
        """Remove the token and restore the environment (after `ray.shutdown`)."""
        from ray._private import ray_constants

        shutil.rmtree(self.folder, ignore_errors=True)
        for name, value in self.previous_env.items():
            if value is None:
                os.environ.pop(name, None)
            else:
                os.environ[name] = value
        if self.previous_cluster is not None:
            ray_constants.ENABLE_RAY_CLUSTER = self.previous_cluster
        _reload_ray_auth()


def _reload_ray_auth() -> None:
    """Make Ray in this process read the authentication variables again: Ray caches its config
    and the token loaded (what ray's own `_enable_token_auth` and `ensure_token_if_auth_enabled`
    refresh the same way), and a driver may start more than one local Ray in turn."""
    from ray._raylet import AuthenticationTokenLoader, Config

    Config.initialize("")
    AuthenticationTokenLoader.instance().reset_cache()


def with_loopback_hook(runtime_env: dict[str, Any]) -> dict[str, Any]:
    """`runtime_env` with `bind_loopback` as the job's worker-process setup hook (Step 3)."""
    return {**runtime_env, "worker_process_setup_hook": SETUP_HOOK}


def bind_loopback() -> None:
    """Worker-process setup hook (Step 3): a gRPC port that Ray code in this worker asks for on
    every interface is opened on 127.0.0.1 instead; an explicit host is left alone."""
    import sys

    from ray._common import tls_utils

    original = getattr(tls_utils.add_port_to_grpc_server, "__wrapped__", None)
    if original is not None:  # already installed in this process
        return
    original = tls_utils.add_port_to_grpc_server

    def add_port_to_grpc_server(server: Any, address: str) -> int:
        host, sep, port = address.rpartition(":")
        if sep and _unspecified(host):
            address = f"{LOOPBACK}:{port}"
        return original(server, address)

    add_port_to_grpc_server.__wrapped__ = original  # type: ignore[attr-defined]
    tls_utils.add_port_to_grpc_server = add_port_to_grpc_server
    # A module that imported the helper by name before this hook ran holds the original.
    replica = sys.modules.get("ray.serve._private.replica")
    if replica is not None:
        replica.add_port_to_grpc_server = add_port_to_grpc_server


def _unspecified(host: str) -> bool:
    """True for an every-interface host (IPv4 or IPv6, bracketed or not)."""
    import ipaddress

    try:
        return ipaddress.ip_address(host.strip("[]")).is_unspecified
    except ValueError:
        return False
