"""Optional API-key auth on the ingress: `http.api_key_env` names the variable holding the key."""

from __future__ import annotations

from types import SimpleNamespace

import pytest

from deploy.openai_protocol import ProtocolError


def _authorise():
    from deploy.app import OpenAIIngress

    return getattr(OpenAIIngress, "func_or_class", OpenAIIngress)._authorise


def test_the_right_bearer_key_passes_and_anything_else_is_a_401():
    authorise = _authorise()
    ingress = SimpleNamespace(api_key="s3cret-key")
    authorise(ingress, SimpleNamespace(headers={"authorization": "Bearer s3cret-key"}))
    for headers in (
        {},
        {"authorization": "Bearer wrong"},
        {"authorization": "Bearer s3cret-ke"},
        {"authorization": "Bearer s3cret-key-and-more"},
    ):
        with pytest.raises(ProtocolError) as info:
            authorise(ingress, SimpleNamespace(headers=headers))
        assert info.value.status == 401
        assert info.value.code == "invalid_api_key"
        assert "s3cret" not in str(info.value)


def test_without_a_configured_key_every_request_passes():
    _authorise()(SimpleNamespace(api_key=None), SimpleNamespace(headers={}))


def test_every_admin_route_needs_the_key_when_one_is_configured():
    """Each /admin/* endpoint of the ingress refuses a request without the key (401) before it
    touches a replica; a route added later without `_authorise` fails here."""
    import asyncio
    import inspect
    import re

    from deploy import app

    cls = getattr(app.OpenAIIngress, "func_or_class", app.OpenAIIngress)
    # Serve moves the routes off `fastapi_app`: read them from the decorators in the source.
    routes = re.findall(
        r'@fastapi_app\.\w+\("(/admin[^"]*)"\)\s+async def (\w+)', inspect.getsource(app)
    )
    assert {path for path, _ in routes} >= {"/admin/stats", "/admin/handoffs"}

    class NoReplica:
        def __getattr__(self, name):
            raise AssertionError(f"/admin reached the replica ({name}) without the key")

    ingress = SimpleNamespace(
        api_key="s3cret-key", model=NoReplica(), prefill=None, handoffs=[],
        _authorise=lambda request: _authorise()(ingress, request),
    )  # fmt: skip
    for path, name in routes:
        with pytest.raises(ProtocolError) as info:
            asyncio.run(getattr(cls, name)(ingress, SimpleNamespace(headers={})))
        assert info.value.status == 401, path
