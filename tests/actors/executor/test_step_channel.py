"""The same-node step channel (actors/executor/step_channel.py): engine steps over a Unix socket to the
ShardWorker actors on the driver's Ray node give the plain Ray calls' tokens; a killed worker is
a rebuildable fault; an idle channel costs no CPU; the socket is private and token-gated."""

from __future__ import annotations

import os
import signal
import socket
import stat
import time
from pathlib import Path

import pytest

from actors.comm.errors import CommError
from actors.engine.engine import Engine
from actors.engine.factory import build_engine
from actors.engine.recovery import (
    RecoveringEngine,
    RecoveryPolicy,
    ReplicaRebuilder,
    is_worker_fault,
)
from actors.engine.sampler import SamplingParams
from actors.executor.replica import Replica
from actors.executor.step_channel import ACK, StepChannel, StepChannelError
from actors.model.weights import CheckpointIndex
from placement.parallel_dims import Layout, parse_layout
from tests.actors.checkpoints import make_tiny_checkpoint
from tests.actors.engine.test_engine import prompt, run, tokens
from tests.actors.executor.test_replica_engine import gather_block

pytestmark = pytest.mark.ray

SECRET = b"channel-secret"
KW = {"num_blocks": 48, "block_size": 4, "max_num_batched_tokens": 16, "max_num_seqs": 4}
REQUESTS = {
    "greedy": (prompt(11, 1), SamplingParams(max_tokens=9, ignore_eos=True)),
    "seeded": (
        prompt(7, 2),
        SamplingParams(max_tokens=8, ignore_eos=True, temperature=0.9, seed=5, logprobs=2),
    ),
    "long": (prompt(21, 3), SamplingParams(max_tokens=6, ignore_eos=True)),
}


@pytest.fixture(scope="module")
def ckpt(tmp_path_factory):
    return make_tiny_checkpoint("mixtral", tmp_path_factory.mktemp("channel"), num_hidden_layers=2)


@pytest.fixture(scope="module")
def reference(ckpt):
    return run(build_engine(ckpt, cache_key_secret=SECRET, **KW), REQUESTS)


def head_node(ray) -> str:
    return ray.get_runtime_context().get_node_id()


def engine_on(ray, ckpt, layout: str, **kw) -> Engine:
    """An Engine over a Replica whose ranks all run on the driver's node."""
    arch = CheckpointIndex.open(ckpt).arch()
    plan = Layout.build(
        parse_layout(layout), num_layers=arch.num_layers, num_experts=arch.num_experts
    )
    replica = Replica(
        layout=plan,
        checkpoint_dir=ckpt,
        num_cpus=0.25,
        node_ids=[head_node(ray)] * plan.dims.world,
        timeout_s=30,
        **kw,
    )
    return build_engine(ckpt, runner=replica, cache_key_secret=SECRET, **KW)


def cpu_seconds(pid: int) -> float:
    """User + system CPU time of process `pid` (all its threads), from /proc."""
    fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


def test_channel_tokens_equal_plain_calls(ray_session, ckpt, reference):
    """ep2 with both ranks on the driver's node: every step through the two channels; tokens,
    logprobs and KV blocks (read over plain calls beside the open channels) equal the plain
    path's and the in-process engine's."""
    ray = ray_session
    via_channel = engine_on(ray, ckpt, "ep2")
    plain = engine_on(ray, ckpt, "ep2", step_channel=False)
    try:
        assert via_channel.runner.channel_ranks == (0, 1)
        assert plain.runner.channel_ranks == ()
        got, want = run(via_channel, REQUESTS), run(plain, REQUESTS)
        for rid in REQUESTS:
            assert tokens(got[rid]) == tokens(want[rid]) == tokens(reference[rid]), rid
        for g, w in zip(got["seeded"], want["seeded"], strict=True):
            (gl,), (wl,) = g.logprobs, w.logprobs
            assert [t for t, _ in gl.top] == [t for t, _ in wl.top]
            assert gl.logprob == pytest.approx(wl.logprob, abs=1e-5)
        served = [h["channel_steps"] for h in via_channel.runner.health()]
        assert all(n >= 9 for n in served), served  # the steps went through the sockets
        assert all(h["channel_steps"] is None for h in plain.runner.health())
        for block in range(4):
            a = gather_block(via_channel.runner, block)
            assert a.equal(gather_block(plain.runner, block))
        # A step the worker refuses comes back as a reply (not a fault); the channel stays in step.
        channel = via_channel.runner._channels[1]
        channel.send(bytes(64))
        with pytest.raises(StepChannelError, match="rank 1: ValueError: packed step"):
            channel.recv(time.monotonic() + 30)
        again = run(via_channel, {"again": REQUESTS["greedy"]})["again"]
        assert tokens(again) == tokens(reference["greedy"])
    finally:
        via_channel.runner.shutdown()
        plain.runner.shutdown()


def test_sigkill_is_a_worker_fault_and_the_replica_recovers(ray_session, ckpt, reference):
    """SIGKILL of the actor's process between two decode steps: the next step raises CommError
    (EOF or a broken pipe on its socket), a worker fault; the recovery path replaces the actor,
    rebuilds, and the resumed streams equal the fault-free ones."""
    ray = ray_session
    engine = engine_on(ray, ckpt, "single")
    replica = engine.runner
    try:
        assert replica.channel_ranks == (0,)
        engine.add_request("x", prompt(6, 9), SamplingParams(max_tokens=4, ignore_eos=True))
        engine.step()
        os.kill(ray.get(replica.actors[0].pid.remote()), signal.SIGKILL)
        with pytest.raises(CommError, match="step channel of rank 0") as caught:
            engine.step()
        assert is_worker_fault(caught.value)
        with pytest.raises(CommError, match="closed; rebuild"):
            engine.step()  # the channel stays closed until a build
        rebuild = ReplicaRebuilder(replica, num_cpus=0.25)
        assert rebuild()["replaced_ranks"] == [0]
        engine.reset()
        recovering = RecoveringEngine(engine, rebuild=rebuild, policy=RecoveryPolicy(backoff_s=0.2))
        for rid, (ids, params) in REQUESTS.items():
            recovering.add_request(rid, ids, params)
        outs = {rid: [] for rid in REQUESTS}
        steps = 0
        while recovering.has_unfinished() and steps < 200:
            if steps == 4:
                pid = ray.get(replica.actors[0].pid.remote())
                if replica.channel_ranks:  # the new actor may be on another node
                    os.kill(pid, signal.SIGKILL)
                else:
                    ray.kill(replica.actors[0], no_restart=True)
            for o in recovering.step():
                outs[o.request_id].append(o)
            steps += 1
        assert len(recovering.events) == 1, recovering.events
        for rid in REQUESTS:
            assert tokens(outs[rid]) == tokens(reference[rid]), rid
    finally:
        replica.shutdown()


def test_idle_channel_costs_no_cpu(ray_session, ckpt):
    """After some steps the channel's thread sleeps in a blocking read: over 2 s idle the actor
    process uses well under 0.2 s of CPU (a compiled graph's actor spins ~1.3 s here)."""
    ray = ray_session
    engine = engine_on(ray, ckpt, "single")
    try:
        assert engine.runner.channel_ranks == (0,)
        run(engine, {"a": REQUESTS["greedy"]})
        assert engine.runner.health()[0]["channel_steps"] >= 9
        pid = ray.get(engine.runner.actors[0].pid.remote())
        time.sleep(0.5)
        before = cpu_seconds(pid)
        time.sleep(2.0)
        used = cpu_seconds(pid) - before
        assert used < 0.2, f"the idle actor used {used:.2f} s of CPU in 2 s"
    finally:
        engine.runner.shutdown()


def test_socket_is_private_and_token_gated(ray_session, ckpt):
    """The socket is 0600 in a fresh 0700 directory; a wrong token is dropped before any step;
    the right one gets in, and then the socket and its directory are gone; an actor on another
    node offers no channel."""
    ray = ray_session
    engine = engine_on(ray, ckpt, "single")
    replica = engine.runner
    actor = replica.actors[0]
    path, token = ray.get(actor.open_step_channel.remote(head_node(ray)))
    try:
        folder = os.path.dirname(path)
        assert stat.S_IMODE(os.stat(folder).st_mode) == 0o700
        assert stat.S_ISSOCK(os.stat(path).st_mode)
        assert stat.S_IMODE(os.stat(path).st_mode) == 0o600
        assert os.stat(folder).st_uid == os.getuid()
        with socket.socket(socket.AF_UNIX, socket.SOCK_STREAM) as sock:
            sock.settimeout(10)
            sock.connect(path)
            sock.sendall(bytes(len(token)))
            assert sock.recv(len(ACK)) == b""  # closed without an ack
        assert os.path.exists(path)
        channel = StepChannel(path, token, rank=0, timeout_s=10)  # the right token is let in
        deadline = time.monotonic() + 10
        while os.path.exists(folder):
            assert time.monotonic() < deadline, "the socket outlived the hello"
            time.sleep(0.01)
        channel.close()
        assert ray.get(actor.open_step_channel.remote("not-this-node")) is None
    finally:
        replica.shutdown()


def test_no_reply_in_time_is_a_comm_error_then_abort_and_rebuild(ray_session, ckpt, reference):
    """A step sent to rank 0 alone blocks in its all-to-all: no reply by the deadline is a
    CommError (a worker fault); abort through the control slot ends the blocked step, and a
    build (which waits for the channel thread to let go of the worker) makes the replica whole."""
    ray = ray_session
    engine = engine_on(ray, ckpt, "ep2")
    replica = engine.runner
    blobs: list[bytes] = []
    through = replica._channel_execute
    replica._channel_execute = lambda blob: (blobs.append(blob), through(blob))[1]
    try:
        run(engine, {"warm": REQUESTS["greedy"]})
        channel = replica._channels[0]
        channel.send(blobs[-1])  # rank 1 never gets this step
        start = time.monotonic()
        with pytest.raises(CommError, match="rank 0: reply: TimeoutError") as caught:
            channel.recv(start + 1.0)
        assert is_worker_fault(caught.value) and channel.closed
        deadline = time.monotonic() + 20
        while not replica.health()[0]["in_step"]:
            assert time.monotonic() < deadline, "the step never started"
            time.sleep(0.05)
        assert replica.abort() == [True, False]
        replica.build()
        assert replica.channel_ranks == (0, 1)
        engine.reset()
        again = run(engine, {"again": REQUESTS["greedy"]})["again"]
        assert tokens(again) == tokens(reference["greedy"])
    finally:
        replica.shutdown()
