"""The session's Ray instance: a head and two labelled fake nodes."""

from __future__ import annotations

import pytest


@pytest.mark.ray
def test_ray_session_has_three_labelled_nodes(ray_session):
    ray = ray_session
    alive = [n for n in ray.nodes() if n["Alive"]]
    labels = sorted(n["Labels"].get("moe.io/node") for n in alive)
    assert labels == ["fake-a", "fake-b", "head"]
