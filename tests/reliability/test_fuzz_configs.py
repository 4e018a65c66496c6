"""The config parsers under random and mutated input: a clear error or a value, never a traceback.

Each parser (model config.json, topology YAML, serve YAML, plan YAML) gets two kinds of input
from hypothesis: a real example document with one to three mutations (a key deleted, a value
replaced by a random JSON value, a list emptied, the document cut short as text), and random
text. The only exception allowed out is the project's own `InputError` (one line, no newline);
anything else (KeyError, TypeError, AttributeError, ValidationError, a YAML error) is a bug.
"""

from __future__ import annotations

import json
import tempfile
from pathlib import Path
from typing import Any

import pytest
import yaml
from hypothesis import HealthCheck, Phase, given, settings
from hypothesis import strategies as st

from cluster.errors import InputError
from tests.conftest import REPO

SETTINGS = settings(
    max_examples=120,
    deadline=None,
    suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large],
    derandomize=True,
    # No shrinking: a failure prints its draws (path, operation, value), which is enough, and
    # shrinking a parser crash can take minutes.
    phases=(Phase.explicit, Phase.generate),
)

JSON_SCALARS = (
    st.none()
    | st.booleans()
    | st.integers(min_value=-(1 << 70), max_value=1 << 70)
    | st.floats(allow_nan=True, allow_infinity=True)
    | st.text(max_size=12)
)
JSON_VALUES = st.recursive(
    JSON_SCALARS,
    lambda inner: (
        st.lists(inner, max_size=3) | st.dictionaries(st.text(max_size=6), inner, max_size=3)
    ),
    max_leaves=6,
)


def _paths(data: Any, prefix: tuple = ()) -> list[tuple]:
    """Every path (tuple of keys / indices) inside nested dicts and lists, the root included."""
    out = [prefix]
    if isinstance(data, dict):
        for k, v in data.items():
            out += _paths(v, (*prefix, k))
    elif isinstance(data, list):
        for i, v in enumerate(data):
            out += _paths(v, (*prefix, i))
    return out


def _mutate(data: Any, draw) -> Any:
    """One mutation at a random path: delete it, replace it, or empty a container."""
    paths = [p for p in _paths(data) if p]
    if not paths:
        return draw(JSON_VALUES)
    path = draw(st.sampled_from(paths))
    parent = data
    for key in path[:-1]:
        parent = parent[key]
    op = draw(st.sampled_from(["delete", "replace", "replace", "empty", "negate"]))
    key = path[-1]
    if op == "delete":
        del parent[key]
    elif op == "empty" and isinstance(parent[key], (dict, list)):
        parent[key] = type(parent[key])()
    elif (
        op == "negate"
        and isinstance(parent[key], (int, float))
        and not isinstance(parent[key], bool)
    ):
        parent[key] = -parent[key] - 1
    else:
        parent[key] = draw(JSON_VALUES)
    return data


def _mutated_text(base: Any, draw, dump) -> str:
    data = json.loads(json.dumps(base))
    for _ in range(draw(st.integers(1, 3))):
        data = _mutate(data, draw)
    text = dump(data)
    if draw(st.booleans()) and draw(st.booleans()):
        text = text[: draw(st.integers(0, len(text)))]
    return text


def _check_error(exc: InputError) -> None:
    message = str(exc)
    assert message and "\n" not in message, f"error message is not one line: {message!r}"


def _run(parse, text: str) -> None:
    """parse(text) returns or raises InputError; any other exception fails the test."""
    try:
        parse(text)
    except InputError as exc:
        _check_error(exc)


def _yaml(data: Any) -> str:
    return yaml.safe_dump(data, sort_keys=False)


RANDOM_TEXT = st.text(max_size=200) | st.binary(max_size=200).map(lambda b: b.decode("latin-1"))

# ------------------------------------------------------------------------------ model config

MODEL_EXAMPLES = sorted((REPO / "placement" / "examples").glob("*.config.json"))


@pytest.fixture(scope="module")
def scratch():
    with tempfile.TemporaryDirectory(prefix="moe-fuzz-") as d:
        yield Path(d)


def _load_model(scratch: Path):
    from placement.model_types import load_model_spec

    def parse(text: str):
        path = scratch / "config.json"
        path.write_text(text, encoding="utf-8", errors="surrogatepass")
        spec = load_model_spec(path)
        # What a caller does next with a spec: inventory and memory figures.
        spec.kv_bytes_per_token("bf16")
        spec.weight_bytes()
        return spec

    return parse


@SETTINGS
@given(data=st.data())
def test_model_config_mutations(scratch, data):
    base = json.loads(data.draw(st.sampled_from(MODEL_EXAMPLES)).read_text())
    _run(_load_model(scratch), _mutated_text(base, data.draw, json.dumps))


@SETTINGS
@given(text=RANDOM_TEXT)
def test_model_config_random_text(scratch, text):
    _run(_load_model(scratch), text)


# --------------------------------------------------------------------------------- topology

TOPOLOGY_EXAMPLES = sorted(
    p for p in (REPO / "cluster" / "examples").glob("*.yaml") if "4096" not in p.name
)


def _parse_topology(text: str):
    from cluster.topology_file import parse_topology

    return parse_topology(text, origin="fuzz.yaml")


@SETTINGS
@given(data=st.data())
def test_topology_mutations(data):
    base = yaml.safe_load(data.draw(st.sampled_from(TOPOLOGY_EXAMPLES)).read_text())
    _run(_parse_topology, _mutated_text(base, data.draw, _yaml))


@SETTINGS
@given(text=RANDOM_TEXT)
def test_topology_random_text(text):
    _run(_parse_topology, text)


# ------------------------------------------------------------------------------ serve YAML

SERVE_EXAMPLE = yaml.safe_load((REPO / "deploy" / "examples" / "serve.yaml").read_text())


def _load_serve(scratch: Path):
    from deploy.config import load_serve_config, to_serve_config

    def parse(text: str):
        path = scratch / "serve.yaml"
        path.write_text(text, encoding="utf-8", errors="surrogatepass")
        cfg = load_serve_config(path)
        to_serve_config(cfg)
        return cfg

    return parse


@SETTINGS
@given(data=st.data())
def test_serve_yaml_mutations(scratch, data):
    _run(_load_serve(scratch), _mutated_text(SERVE_EXAMPLE, data.draw, _yaml))


@SETTINGS
@given(text=RANDOM_TEXT)
def test_serve_yaml_random_text(scratch, text):
    _run(_load_serve(scratch), text)


# ------------------------------------------------------------------------------- plan YAML


@pytest.fixture(scope="module")
def plan_doc() -> dict:
    from cluster.topology_file import load_example
    from placement.model_types import load_model_spec
    from placement.plan import plan
    from placement.strategy import Workload

    spec = load_model_spec(REPO / "placement" / "examples" / "mixtral-8x7b-class.config.json")
    p = plan(spec, load_example("hgx-h200-8gpu"), Workload(context=8192))
    return yaml.safe_load(p.to_yaml())


def _parse_plan(text: str):
    from placement.plan import Plan

    return Plan.from_yaml(text)


@SETTINGS
@given(data=st.data())
def test_plan_yaml_mutations(plan_doc, data):
    _run(_parse_plan, _mutated_text(plan_doc, data.draw, _yaml))


@SETTINGS
@given(text=RANDOM_TEXT)
def test_plan_yaml_random_text(text):
    _run(_parse_plan, text)


def test_the_mutator_reaches_every_parser_error_path(scratch):
    """The harness can fail: a document missing a required field is an InputError, not a pass."""
    with pytest.raises(InputError):
        _load_serve(scratch)(_yaml({"engine": {"block_size": 16}}))
    with pytest.raises(InputError):
        _parse_topology("name: x\n")
