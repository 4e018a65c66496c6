"""The compiled-graph step path: a graph whose channels are gone is a rebuildable fault."""

from __future__ import annotations

import pytest

from actors.comm.errors import CommError
from actors.engine.factory import build_engine
from actors.engine.recovery import is_worker_fault
from actors.engine.sampler import SamplingParams
from tests.actors.checkpoints import make_tiny_checkpoint
from tests.actors.engine.test_engine import prompt

pytestmark = pytest.mark.ray

KW = {"num_blocks": 16, "block_size": 4, "max_num_batched_tokens": 16, "max_num_seqs": 2}


def test_torn_down_graph_channel_is_a_comm_error(ray_session, tmp_path):
    path = make_tiny_checkpoint("mixtral", tmp_path / "ckpt", num_hidden_layers=2)
    engine = build_engine(
        path, layout="single", num_cpus=0.25, compiled_graph=True, cache_key_secret=b"s", **KW
    )
    try:
        engine.add_request("a", prompt(6, 1), SamplingParams(max_tokens=4, ignore_eos=True))
        engine.step()
        replica = engine.runner
        assert replica._dag is not None
        replica._dag.teardown()  # its channels close, as when a graph breaks
        with pytest.raises(CommError, match="compiled graph") as caught:
            engine.step()
        assert is_worker_fault(caught.value)
        replica.build()  # the recovery path's rebuild: a fresh graph at the next step
        engine.reset()
        engine.add_request("b", prompt(6, 1), SamplingParams(max_tokens=2, ignore_eos=True))
        while engine.has_unfinished():
            engine.step()
        assert replica._dag is not None
    finally:
        engine.runner.shutdown()
