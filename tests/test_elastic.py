"""Elastic training: torchrun --nnodes=1:2 with c10d rendezvous, two agents on
127.0.0.1 standing in for two nodes. A node lost for good leaves the survivor to
re-form the group at world size 1 and finish; a node that joins later is taken in at
the next restart. Either way the weights end where an uninterrupted single-process run
ends, since --global_batch_size fixes the batch and the sample order at any world size."""
import os
import re
import signal
import socket
import time


import pytest

from scripts.dev.elastic_agents import ElasticAgent, agreed_port, wait_until
from tests.support.assertions import assert_clean_exit, max_abs_diff, worker_tracebacks
from tests.support.jobs import JobSpec, run_env, start_trainer
from tests.support.run_outputs import checkpoint_name, checkpoint_steps, latest_checkpoint, out_args
from tests.support.tiny import TINY

STEPS, SAVE = 100, 10
# lr 2e-4: Adam's early updates are ~lr * sign(g), so the float noise of another world
# size's summation order in near-zero gradients grows with lr (2e-3 gave 3e-5 here).
ARGS = [*TINY, "--learning_rate", "2e-4", "--max_steps", str(STEPS), "--save_interval", str(SAVE),
        "--global_batch_size", "8", "--from_resume", "1"]
# The rendezvous timeouts the README recommends: a dead node is dropped after 3 missed
# 1 s heartbeats, and a round closes 5 s after the fewest nodes (1) have joined.
RDZV_CONF = "join_timeout=120,last_call_timeout=5,keep_alive_interval=1,keep_alive_max_attempt=3"
STEP_LINE = r"^epoch \d+/\d+ step \d+/"


@pytest.fixture(scope="module")
def reference(tmp_path_factory):
    """The same run in one plain process, never interrupted. It starts at once and trains
    while the elastic agents below wait out their rendezvous; reference() waits for it
    and returns its final checkpoint."""
    run = tmp_path_factory.mktemp("reference")
    job = start_trainer(JobSpec([*ARGS, *out_args(run)], run, nproc=1, mode="python"))
    final = {}

    def wait():
        if not final:
            code = job.wait(timeout=480)
            assert_clean_exit(code, job.output(), "reference")
            assert "accumulation=2" in job.output()
            final.update(latest_checkpoint(run))
        return final
    yield wait
    if job.poll() is None:
        job.kill()


@pytest.fixture
def port():
    """The rendezvous endpoint's port, which every agent must know before it starts."""
    with agreed_port() as agreed:
        yield agreed


def start_first_agent(run, port) -> ElasticAgent:
    """The agent that hosts the rendezvous store (the first to bind the endpoint does)."""
    agent = ElasticAgent(port, [*ARGS, *out_args(run)], run, run_env(run), RDZV_CONF)

    def listening():
        with socket.socket() as s:
            return s.connect_ex(("127.0.0.1", port)) == 0
    wait_until(listening, 60, "rendezvous store on the endpoint", [agent])
    return agent


def checkpoints(run) -> set[str]:
    return {checkpoint_name(step) for step in checkpoint_steps(run)}


def resumed_at(output) -> list[int]:
    return [int(s) for s in re.findall(r"resumed from \S+ at step (\d+)/", output)]


def group_output(agents) -> str:
    """What rank 0 printed, wherever it ran: the rendezvous orders nodes by (address, agent
    pid), so a group's rank 0 may sit under either agent (a later agent usually has the larger
    pid, but pids wrap on a busy machine)."""
    return "".join(agent.output for agent in agents)


@pytest.mark.slow
def test_losing_a_node_the_survivor_resumes_alone_and_matches(tmp_path, reference, port):
    survivor = start_first_agent(tmp_path, port)
    doomed = ElasticAgent(port, [*ARGS, *out_args(tmp_path)], tmp_path, run_env(tmp_path), RDZV_CONF)
    agents = [survivor, doomed]
    wait_until(lambda: "world_size=2" in group_output(agents), 120, "group of 2", agents)
    before = checkpoints(tmp_path)
    wait_until(lambda: checkpoints(tmp_path) - before, 120, "checkpoint by the group of 2", agents)
    saved = max(int(re.search(r"step(\d+)", n).group(1)) for n in checkpoints(tmp_path))
    killed_at = time.monotonic()
    doomed.kill_node()

    rc = survivor.wait(timeout=480)
    out = survivor.output
    assert rc == 0, out[-4000:]
    # One line about the lost peer, no stack trace.
    lost = [line for line in out.splitlines() if "lost a peer process" in line]
    assert len(lost) == 1 and lost[0].startswith("error: lost a peer process ("), out[-4000:]
    assert "torchrun restarts the group" in lost[0]
    assert not worker_tracebacks(out), worker_tracebacks(out)[0]
    # Re-formed alone, with the accumulation re-derived, from the newest checkpoint.
    resumed = resumed_at(out)
    assert resumed and resumed[-1] >= saved and resumed[-1] % SAVE == 0, out[-4000:]
    assert re.search(r"world_size=1 micro_batch=4 accumulation=2 global_batch=8", out)
    final = latest_checkpoint(tmp_path)
    assert final["global_step"] == STEPS and final["world_size"] == 1
    assert max_abs_diff(final["model"], reference()["model"]) < 1e-5

    resumed_line = survivor.first_line_after(r"resumed from", killed_at)
    first_step = survivor.first_line_after(STEP_LINE, resumed_line)
    print(f"\nrecovery: node lost -> first step after resume {first_step - killed_at:.1f}s "
          f"(rdzv_conf {RDZV_CONF})")


@pytest.mark.slow
def test_a_node_that_joins_later_is_taken_in_at_the_next_restart(tmp_path, reference, port):
    first = start_first_agent(tmp_path, port)
    wait_until(lambda: re.search(r"^epoch \d+/\d+ step 3/", first.output, re.M), 120, "step 3 alone", [first])
    assert "world_size=1 micro_batch=4 accumulation=2" in first.output
    # Hold the lone worker still (as a slow one would be) so it cannot finish before the
    # new node is in; its agent stays awake and sees the newcomer.
    worker = first.worker_pids()[0]
    os.kill(worker, signal.SIGSTOP)
    late = ElasticAgent(port, [*ARGS, *out_args(tmp_path)], tmp_path, run_env(tmp_path), RDZV_CONF)
    wait_until(lambda: "closing signal SIGTERM" in first.output, 120, "restart for the new node", [first, late])
    os.kill(worker, signal.SIGCONT)

    rcs = [first.wait(timeout=480), late.wait(timeout=60)]
    assert rcs == [0, 0], first.output[-4000:] + late.output[-2000:]
    # The agent stopped its worker to take the new node in: a preemption save (by the lone
    # worker, rank 0 of the group of 1), then the group of 2 resumed from exactly that step.
    saved = re.search(r"preempted: saved step (\d+)", first.output)
    assert saved, first.output[-4000:]
    out = group_output([first, late])
    assert resumed_at(out) == [int(saved.group(1))], out[-4000:]
    assert re.search(r"world_size=2 micro_batch=4 accumulation=1 global_batch=8", out)
    assert not worker_tracebacks(out)
    final = latest_checkpoint(tmp_path)
    assert final["global_step"] == STEPS and final["world_size"] == 2
    assert max_abs_diff(final["model"], reference()["model"]) < 1e-5


# ---------------------------------------------------------------------------- in-process units
def test_peer_lost_recognises_gloo_and_distributed_errors_only():
    import torch.distributed as dist

    from trainer.distributed import peer_lost

    gloo = RuntimeError("[/pytorch/third_party/gloo/gloo/transport/tcp/pair.cc:537] Read error "
                        "[127.0.0.1]:5863: Connection reset by peer. This is typically caused by ...")
    assert peer_lost(gloo)
    assert peer_lost(dist.DistBackendError("NCCL communicator was aborted"))
    assert peer_lost(dist.DistNetworkError("connection refused"))
    assert not peer_lost(RuntimeError("mat1 and mat2 shapes cannot be multiplied"))
    assert not peer_lost(ValueError("gloo"))


def test_a_new_group_ignores_the_store_address_a_dead_group_left():
    """The agent's store still holds the address rank 0 of the previous group posted;
    nothing answers there any more. Rank 1 must wait for the new one, not use the old."""
    import threading
    from datetime import timedelta

    import torch.distributed as dist

    from trainer.distributed import group_store

    timeout = timedelta(seconds=30)
    agent = dist.TCPStore("127.0.0.1", 0, is_master=True, timeout=timeout, wait_for_workers=False)
    with socket.socket() as dead:  # a port that was free a moment ago and is closed now
        dead.bind(("127.0.0.1", 0))
        dead_port = dead.getsockname()[1]
    agent.set("minimind/group_store", f"{dead_port} old-nonce")

    stores = {}
    rank1 = threading.Thread(target=lambda: stores.update({1: group_store(agent, "127.0.0.1", 1, timeout)}))
    rank1.start()
    time.sleep(1.0)  # rank 1 reads the stale address first
    stores[0] = group_store(agent, "127.0.0.1", 0, timeout)
    rank1.join(timeout=30)
    assert 1 in stores, "rank 1 never found the new group's store"
    stores[0].set("hello", "from rank 0")
    assert stores[1].get("hello") == b"from rank 0"
