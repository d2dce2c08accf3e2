"""Nodes that each have their own disk: two "nodes" on 127.0.0.1, each a torchrun started
from its own copy of the repository, with relative --checkpoint_dir and --data_path.
Only node 0 ever holds a checkpoint; a resume must not need one on node 1."""
import re
import shutil
from pathlib import Path

import pytest

from tests.support.assertions import assert_clean_exit
from tests.support import REPO_ROOT
from tests.support.jobs import run_nodes
from tests.support.run_outputs import checkpoint_name, latest_link_name, read_metrics
from tests.support.tiny import TINY
from tests.support.helpers_data import SAMPLE_TEXTS, write_jsonl
from tests.support.fault_injection import fault_env

STEPS, SAVE, KILL = 16, 5, 13  # saves at 5 and 10, rank 1 dies before step 13
RUN = [*TINY, "--data_path", "dataset/small.jsonl", "--checkpoint_dir", "ckpt", "--save_dir", "out",
       "--max_steps", str(STEPS), "--save_interval", str(SAVE)]
TRAIN_IN_NODE = "trainer/train_pretrain.py"  # each node runs its own copy


def copy_repo(dest: Path) -> Path:
    """What a node needs to train: the code, the tokenizer and its own data file (and the
    test's fault injection, which tests/support/inject/sitecustomize.py imports from the node's copy)."""
    skip = shutil.ignore_patterns("__pycache__", "*.jsonl", "*.bin")
    for package in ("common", "trainer", "model", "dataset"):
        shutil.copytree(REPO_ROOT / package, dest / package, ignore=skip)
    (dest / "tests" / "support").mkdir(parents=True)
    for hook_file in ("__init__.py", "support/__init__.py", "support/fault_injection.py"):
        shutil.copy(REPO_ROOT / "tests" / hook_file, dest / "tests" / hook_file)
    write_jsonl(dest / "dataset" / "small.jsonl", [f"{SAMPLE_TEXTS[i % len(SAMPLE_TEXTS)]} #{i}" for i in range(300)])
    return dest


def checkpoint_files(node: Path) -> list[str]:
    """Every checkpoint file anywhere on the node's disk ({prefix}_resume...; not trainer/resume_config.py)."""
    return sorted(str(p.relative_to(node)) for p in node.rglob("*_resume*"))


@pytest.fixture(scope="module")
def nodes(tmp_path_factory):
    root = tmp_path_factory.mktemp("nodes")
    return [copy_repo(root / f"node{rank}") for rank in (0, 1)]


@pytest.mark.slow
def test_resume_after_a_kill_needs_the_checkpoint_on_node_0_only(nodes):
    node0, node1 = nodes
    fault = fault_env("kill", at=KILL, rank=1)
    killed = run_nodes(RUN, nodes, env=fault, script=TRAIN_IN_NODE)
    assert f"rank 1 SIGKILLs itself at step {KILL}" in killed[1].stdout, killed[1].stdout[-3000:]
    assert all(r.returncode != 0 for r in killed), [r.stdout[-2000:] for r in killed]
    assert checkpoint_files(node0) == [
        f"ckpt/{latest_link_name()}",
        *[f"ckpt/{checkpoint_name(s)}{suffix}" for s in (SAVE, 2 * SAVE) for suffix in ("", ".json")]]
    assert checkpoint_files(node1) == []

    resumed = run_nodes([*RUN, "--from_resume", "1"], nodes, script=TRAIN_IN_NODE)
    for rank, result in enumerate(resumed):
        assert_clean_exit(result.returncode, result.stdout, f"node {rank}")
    out0 = resumed[0].stdout
    assert f"resumed from ckpt/{checkpoint_name(2 * SAVE)} at step {2 * SAVE}/{STEPS}" in out0
    trained = [int(m) for m in re.findall(r"^epoch \d+/\d+ step (\d+)/", out0, re.M)]
    assert trained == list(range(2 * SAVE + 1, STEPS + 1))
    assert read_metrics(node0)[-1]["step"] == STEPS
    assert f"ckpt/{checkpoint_name(STEPS)}" in checkpoint_files(node0)
    # Node 1 never had a checkpoint (nor weights) of its own, before or after.
    assert checkpoint_files(node1) == [] and not (node1 / "ckpt").exists() and not (node1 / "out").exists()


# ---------------------------------------------------------------------------- per-node artefacts
@pytest.mark.parametrize("local_rank, exists, builds", [(0, False, True), (1, False, False), (0, True, False)])
def test_demo_corpus_is_built_by_local_rank_0_of_each_node_and_every_rank_waits(
        tmp_path, monkeypatch, local_rank, exists, builds):
    """Rank 2 of 4 on two nodes is local rank 0 of node 1: it builds its node's copy. Every
    rank takes the one barrier, whether it built, waited or found the file on its disk."""
    import dataclasses

    from dataset.demo_corpus import DEMO_CORPUS, ensure_demo_corpus
    from trainer import loop
    from trainer.config import TrainConfig
    from trainer.train_pretrain import PRETRAIN

    assert (PRETRAIN.demo_data, PRETRAIN.build_demo) == (DEMO_CORPUS, ensure_demo_corpus)
    corpus = tmp_path / "demo_pretrain.jsonl"
    if exists:
        corpus.write_text('{"text": "x"}\n')
    built, barriers = [], []
    stage = dataclasses.replace(PRETRAIN, demo_data=corpus, build_demo=built.append)
    monkeypatch.setattr(loop, "barrier", lambda: barriers.append(1))
    monkeypatch.setattr(loop, "is_main_process", lambda: False)  # a rank of node 1

    loop.ensure_data(TrainConfig.of(data_path=str(corpus)), local_rank, stage)
    assert built == ([corpus] if builds else [])
    assert barriers == [1]
