"""Worker faults in the middle of generation: a ShardWorker actor is killed with `ray.kill` and
the engine rebuilds the replica and resumes every request in flight.

The reference is the fault-free in-process engine (`build_engine` (`actors.engine.factory`), itself checked
against transformers in tests/actors/engine/test_engine.py) fed the same requests: a resumed greedy or
seeded stream must equal it token for token, with no token repeated or dropped, and text deltas
must concatenate to the fault-free text. The CI size is three faults; the 20-fault series is
bench/fault_series.py (RELIABILITY.md).
"""

from __future__ import annotations

import asyncio
import shutil
import threading

import pytest

from actors.engine.async_engine import AsyncEngine
from actors.engine.factory import build_engine
from actors.engine.recovery import (
    RecoveringEngine,
    RecoveryPolicy,
    ReplicaRebuilder,
    ReplicaUnavailable,
    is_worker_fault,
)
from actors.engine.sampler import SamplingParams
from tests.actors.checkpoints import make_tiny_checkpoint
from tests.actors.engine.test_engine import prompt, run, tokens
from tests.actors.tiny_tokenizer import install

pytestmark = pytest.mark.ray

SECRET = b"fault-secret"
KW = {"num_blocks": 48, "block_size": 4, "max_num_batched_tokens": 16, "max_num_seqs": 4}
REQUESTS = {
    "greedy": (prompt(11, 1), SamplingParams(max_tokens=14, ignore_eos=True)),
    "seeded": (
        prompt(7, 2),
        SamplingParams(max_tokens=12, ignore_eos=True, temperature=0.9, seed=5),
    ),
    "topk": (
        prompt(19, 3),
        SamplingParams(max_tokens=10, ignore_eos=True, temperature=0.7, top_k=8, seed=11),
    ),
}


@pytest.fixture(scope="module")
def ckpt(tmp_path_factory):
    path = make_tiny_checkpoint("mixtral", tmp_path_factory.mktemp("faults"), num_hidden_layers=2)
    install(path)
    return path


@pytest.fixture(scope="module")
def reference(ckpt):
    engine = build_engine(ckpt, cache_key_secret=SECRET, **KW)
    return run(engine, REQUESTS)


def recovering(path, **policy):
    engine = build_engine(path, layout="ep2", num_cpus=0.25, cache_key_secret=SECRET, **KW)
    return RecoveringEngine(
        engine,
        rebuild=ReplicaRebuilder(engine.runner, num_cpus=0.25),
        policy=RecoveryPolicy(backoff_s=0.2, **policy),
    )


def kill_rank(engine, rank: int) -> None:
    import ray

    ray.kill(engine.runner.actors[rank], no_restart=True)


def test_three_kills_mid_generation_resume_token_for_token(ckpt, reference, ray_session):
    engine = recovering(ckpt)
    try:
        for rid, (ids, params) in REQUESTS.items():
            engine.add_request(rid, ids, params)
        outs = {rid: [] for rid in REQUESTS}
        kills = {2: 1, 7: 0, 15: 1}  # step -> rank: during prefill, early and late decode
        steps = 0
        while engine.has_unfinished() and steps < 400:
            if steps in kills:
                kill_rank(engine, kills[steps])
            for o in engine.step():
                outs[o.request_id].append(o)
            steps += 1
        assert len(engine.events) == 3, engine.events
        assert all(e.resumed > 0 and e.failed == 0 for e in engine.events)
        assert [e.rebuild["replaced_ranks"] for e in engine.events] == [[1], [0], [1]]
        for rid in REQUESTS:
            assert tokens(outs[rid]) == tokens(reference[rid]), rid
            assert "".join(o.text_delta for o in outs[rid]) == "".join(
                o.text_delta for o in reference[rid]
            ), rid
            assert [o.finished for o in outs[rid]].count(True) == 1
            assert outs[rid][-1].finish_reason == "length"
        stats = engine.stats()
        assert stats["recovery"]["faults"] == 3
        assert stats["free_blocks"] == stats["total_blocks"]
    finally:
        engine.runner.shutdown()


def test_kill_while_a_step_runs_through_async_engine(ckpt, reference, ray_session):
    """A kill from another thread while steps are in flight; streams end, none hangs."""
    engine = recovering(ckpt)
    async_engine = AsyncEngine(engine)
    killed = threading.Event()

    async def one(rid):
        ids, params = REQUESTS[rid]
        got = []
        async for out in async_engine.generate(rid, ids, params):
            got.append(out)
            if rid == "greedy" and len(got) == 4 and not killed.is_set():
                killed.set()
                threading.Thread(target=kill_rank, args=(engine, 1)).start()
        return got

    async def main():
        return await asyncio.wait_for(asyncio.gather(*(one(r) for r in REQUESTS)), 240)

    try:
        results = dict(zip(REQUESTS, asyncio.run(main()), strict=True))
        assert killed.is_set() and len(engine.events) >= 1
        for rid in REQUESTS:
            assert tokens(results[rid]) == tokens(reference[rid]), rid
    finally:
        async_engine.shutdown()
        engine.runner.shutdown()


def test_unrebuildable_replica_fails_requests_retryably_then_heals(ckpt, tmp_path, ray_session):
    """The checkpoint disappears, so the rebuild cannot load shards: every request in flight ends
    with ReplicaUnavailable (retryable, Retry-After) instead of hanging; once the checkpoint is
    back, the next request rebuilds the replica and is served."""
    path = tmp_path / "ckpt"
    shutil.copytree(ckpt, path)
    engine = recovering(path, max_rebuilds=1)
    async_engine = AsyncEngine(engine)
    ids, params = REQUESTS["greedy"]

    async def stream(rid):
        return [o async for o in async_engine.generate(rid, ids, params)]

    async def first():
        agen = async_engine.generate("a", ids, params)
        got = [await agen.__anext__()]
        shutil.rmtree(path)
        kill_rank(engine, 0)
        with pytest.raises(ReplicaUnavailable) as err:
            async for out in agen:
                got.append(out)
        return err.value

    try:
        err = asyncio.run(asyncio.wait_for(first(), 240))
        assert err.retry_after_s == 5.0 and "retry" in str(err)
        assert engine.events[-1].failed == 1 and engine.events[-1].attempts == 1
        shutil.copytree(ckpt, path)
        healed = asyncio.run(asyncio.wait_for(stream("b"), 240))
        assert len(tokens(healed)) == params.max_tokens and healed[-1].finished
        assert engine.events[-1].failed == 0
    finally:
        async_engine.shutdown()
        engine.runner.shutdown()


def test_only_worker_faults_are_recovered():
    from actors.comm.errors import CollectiveTimeout

    assert is_worker_fault(CollectiveTimeout("all_to_all did not complete"))
    assert not is_worker_fault(ValueError("a bug"))
    assert not is_worker_fault(RuntimeError("no rank sampled rows [0] of the step"))
    with pytest.raises(Exception, match="max_rebuilds"):
        RecoveryPolicy(max_rebuilds=0)
    err = ReplicaUnavailable("gone", 3.0)
    import pickle  # the exception crosses Ray/Serve by pickle (trusted, in-cluster objects)

    again = pickle.loads(pickle.dumps(err))
    assert isinstance(again, ReplicaUnavailable) and again.retry_after_s == 3.0
