"""ResumableDistributedSampler: sharding and set_start; resuming on another world size
with the trainer's own plan and train state (no sample seen twice or skipped); then the same
end to end: 2 processes to step 4, resumed by 1 process."""
import math
import re
import shutil
from collections import Counter

import pytest
from torch.utils.data import Dataset

from tests.support.assertions import assert_clean_exit
from tests.support.jobs import run_trainer
from tests.support.run_outputs import latest_checkpoint, out_args, read_metrics
from tests.support.tiny import TINY
from trainer.data import ResumableDistributedSampler, make_train_loader
from trainer.config import TrainConfig
from trainer.train_state import TrainState, plan_steps, resume_step

N = 203  # odd, and not a multiple of any global batch below: DistributedSampler pads, steps leave a tail
SEED = 42


class Indices(Dataset):
    """Sample i is the number i, so a batch says which samples it holds."""

    def __init__(self, n):
        self.n = n

    def __len__(self):
        return self.n

    def __getitem__(self, i):
        return i


def shares(world, epoch=0, start=0, n=N):
    out = []
    for rank in range(world):
        sampler = ResumableDistributedSampler(Indices(n), world, rank, seed=SEED)
        sampler.set_epoch(epoch)
        sampler.set_start(start)
        out.append(list(sampler))
    return out


# ---------------------------------------------------------------------------- sharding
@pytest.mark.parametrize("world", [1, 2, 3, 4])
def test_ranks_are_disjoint_and_cover_the_dataset(world):
    parts = shares(world)
    padded = math.ceil(N / world) * world
    assert [len(p) for p in parts] == [padded // world] * world
    flat = [i for part in parts for i in part]
    assert set(flat) == set(range(N))
    # Only DistributedSampler's padding (the first padded - N positions, repeated) occurs twice.
    repeats = Counter(flat) - Counter(range(N))
    assert sum(repeats.values()) == padded - N
    for a in range(world):
        for b in range(a + 1, world):
            assert len(set(parts[a]) & set(parts[b])) <= padded - N


def test_set_epoch_reshuffles_deterministically():
    epoch0, epoch1 = shares(2, epoch=0), shares(2, epoch=1)
    assert epoch0 != epoch1
    for part0, part1 in zip(epoch0, epoch1):
        assert part0 != part1
    assert set(sum(epoch1, [])) == set(range(N))
    assert shares(2, epoch=1) == epoch1  # same seed and epoch, same order on every rank and run


@pytest.mark.parametrize("world", [1, 2])
@pytest.mark.parametrize("k", [0, 1, 7, 50])
def test_set_start_skips_exactly_the_first_k_of_a_share(world, k):
    full = shares(world)
    for rank, part in enumerate(shares(world, start=k)):
        assert part == full[rank][k:]
        sampler = ResumableDistributedSampler(Indices(N), world, rank, seed=SEED)
        sampler.set_start(k)
        assert len(sampler) == len(full[rank]) - k


# ---------------------------------------------------------------------------- resume across world sizes
def step_plan(world, batch, accum, n=N):
    """The trainer's own plan for this topology (as plan_steps makes it from the config)."""
    optim = TrainConfig.of(batch_size=batch, accumulation_steps=accum).optim
    return plan_steps(optim, "indices", n, world)


def consumed(world, batch, accum, start_step, end_step, n=N):
    """Section 6 of train_pretrain.py without the model: every rank's sampler and
    loader driven as the loop drives them, placed by the plan's own position(). Returns
    {global step: (epoch, set of samples)} and the plan."""
    dataset = Indices(n)
    plan = step_plan(world, batch, accum, n)
    samplers = [ResumableDistributedSampler(dataset, world, rank, seed=SEED) for rank in range(world)]
    loaders = [make_train_loader(dataset, s, batch, num_workers=0, dist_timeout=60, pin_memory=False) for s in samplers]
    steps, global_step = {}, start_step
    while global_step < end_step:
        where = plan.position(global_step)
        batches = []
        for sampler, loader in zip(samplers, loaders):
            sampler.set_epoch(where.epoch)
            sampler.set_start(where.sampler_start)
            batches.append(iter(loader))
        for _ in range(where.step_in_epoch, plan.steps_per_epoch):
            if global_step >= end_step:
                break
            taken = [i for it in batches for _ in range(accum) for i in next(it).tolist()]
            assert len(taken) == len(set(taken)) == plan.samples_per_step
            steps[global_step] = (where.epoch, set(taken))
            global_step += 1
    return steps, plan


def epoch_order(epoch, n=N):
    return shares(1, epoch=epoch, n=n)[0]


def resume(saved_step, old, new):
    """Train `old` = (world, batch, accum) to saved_step, resume with `new` to the end of
    that epoch through the trainer's TrainState (what a checkpoint saves, and how a
    resume reads it): returns the samples of that epoch in order of use."""
    old_steps, old_plan = consumed(*old, 0, saved_step)
    saved = TrainState(old_plan, global_step=saved_step).state_dict()
    resumed = TrainState(step_plan(*new))
    resumed.load_state_dict(saved)
    epoch, new_plan = saved["epoch"], resumed.plan
    new_steps, _ = consumed(*new, resumed.global_step, (epoch + 1) * new_plan.steps_per_epoch)
    before = [s for e, s in old_steps.values() if e == epoch]
    after = [s for e, s in new_steps.values() if e == epoch]
    return epoch, before, after, new_plan.steps_per_epoch * new_plan.samples_per_step


@pytest.mark.parametrize("saved_step", [5, 25 + 3])  # in epoch 0, and in epoch 1 (25 steps of 8 per epoch)
@pytest.mark.parametrize("new", [(1, 2, 2), (1, 4, 1), (1, 1, 4)], ids=["b2a2", "b4a1", "b1a4"])
def test_two_ranks_to_one_neither_repeats_nor_skips(saved_step, new):
    epoch, before, after, covered = resume(saved_step, old=(2, 2, 2), new=new)
    seen = [i for step in before + after for i in step]
    assert len(seen) == len(set(seen)), "a sample was seen twice in the epoch"
    order = epoch_order(epoch)
    assert set(seen) == set(order[:covered]), "the resumed run skipped samples"
    if epoch:  # and the first epoch was complete before it
        assert len(before) == saved_step - 25


@pytest.mark.parametrize("saved_step", [6, 50 + 8])  # even: the consumed samples fill whole 2-rank steps
def test_one_rank_to_two_neither_repeats_nor_skips(saved_step):
    epoch, before, after, covered = resume(saved_step, old=(1, 2, 2), new=(2, 2, 2))
    seen = [i for step in before + after for i in step]
    assert len(seen) == len(set(seen))
    assert set(seen) == set(epoch_order(epoch)[:covered])


def test_resume_mid_step_redoes_the_partial_step_and_skips_nothing():
    """1 rank stopped after 7 steps of 4 = 28 samples; a 2-rank step holds 8, so the
    resume starts at step 3 (24 samples) and sees samples 24..27 of the epoch again."""
    assert resume_step(7, 4, 8) == 3
    epoch, before, after, covered = resume(7, old=(1, 2, 2), new=(2, 2, 2))
    seen = [i for step in before + after for i in step]
    twice = [i for i, c in Counter(seen).items() if c > 1]
    assert set(twice) == set(epoch_order(epoch)[24:28])
    assert set(seen) == set(epoch_order(epoch)[:covered])


def test_same_global_batch_same_samples_per_step_on_any_topology():
    reference, _ = consumed(2, 2, 2, 0, 30)
    for world, batch, accum in [(1, 8, 1), (1, 2, 4), (4, 1, 2), (8, 1, 1)]:
        steps, _ = consumed(world, batch, accum, 0, 30)
        assert steps == reference, (world, batch, accum)


# ---------------------------------------------------------------------------- end to end
K1, K2 = 4, 12  # 2 processes x batch 4 to step 4 = 32 samples = step 8 of 1 process x batch 4


@pytest.fixture(scope="module")
def resumed(tmp_path_factory):
    run_dir = tmp_path_factory.mktemp("resume")
    first = run_trainer([*TINY, *out_args(run_dir), "--max_steps", str(K1), "--save_interval", str(K1)], run_dir,
                        nproc=2, mode="forked")
    assert_clean_exit(first.returncode, first.stdout, "first run")
    saved = latest_checkpoint(run_dir)
    second = run_trainer([*TINY, *out_args(run_dir), "--from_resume", "1", "--max_steps", str(K2)], run_dir)
    return run_dir, saved, second


@pytest.mark.slow
def test_first_run_saved_a_two_process_checkpoint(resumed):
    _, saved, _ = resumed
    assert (saved["world_size"], saved["global_step"], saved["step_in_epoch"], saved["epoch"]) == (2, K1, K1, 0)
    assert saved["samples_per_step"] == 4 * 2 and len(saved["rng"]) == 2


@pytest.mark.slow
def test_one_process_resume_logs_the_rescale_once(resumed):
    _, _, second = resumed
    assert second.returncode == 0, second.stdout[-3000:]
    lines = [line for line in second.stdout.splitlines() if "samples per step (world size" in line]
    assert lines == [f"resume: 8 -> 4 samples per step (world size 2 -> 1), step {K1} -> {2 * K1} of epoch 0 "
                     f"(step * 8 // 4)"]
    assert re.search(rf"resumed from \S+_resume_step{K1:07d}\.pth at step {2 * K1}/{K2}", second.stdout)


@pytest.mark.slow
def test_max_steps_counts_rescaled_steps(resumed):
    """--max_steps is the run's total in this run's step size, the saved steps included
    after rescaling: 4 steps of 8 samples count as 8 of 4, so --max_steps 12 trains 4 more."""
    run_dir, saved, second = resumed
    assert second.returncode == 0, second.stdout[-3000:]
    final = latest_checkpoint(run_dir)
    assert (final["world_size"], final["global_step"], final["step_in_epoch"]) == (1, K2, K2)
    assert final["samples_per_step"] == 4 and len(final["rng"]) == 1
    assert final["tokens_seen"] > saved["tokens_seen"]
    steps = [row["step"] for row in read_metrics(run_dir)]
    assert steps == [*range(1, K1 + 1), *range(2 * K1 + 1, K2 + 1)]
    assert f"done: {K2} steps" in second.stdout
    assert (run_dir / "out" / "pretrain_64.pth").is_file()


@pytest.mark.slow
def test_a_stored_max_steps_counts_the_checkpoint_s_steps(resumed, tmp_path):
    """Not typed again, the checkpoint's --max_steps 4 (steps of 8 samples) is 8 steps of 4 on one
    process: the run it resumes had trained all of them, so nothing is left (typed, it counts this
    run's steps: the test above). Its schedule would otherwise have gone back to step 8 of 4's."""
    run_dir = tmp_path / "stored"
    shutil.copytree(resumed[0], run_dir, symlinks=True)
    for path in (run_dir / "ckpt").glob(f"*_resume_step{K2:07d}*"):  # back to the 2-process checkpoint
        path.unlink()
    again = run_trainer([*TINY, *out_args(run_dir), "--from_resume", "1"], run_dir)
    assert again.returncode == 0, again.stdout[-3000:]
    assert (f"resume: --max_steps {K1} (the checkpoint's, in steps of 8 samples) is {2 * K1} steps of 4 here"
            in again.stdout)
    assert f"nothing left to train: the checkpoint is at step {2 * K1} of {2 * K1}" in again.stdout


@pytest.mark.slow
def test_a_finished_run_resumed_again_trains_nothing_and_keeps_its_checkpoint(resumed, tmp_path):
    run_dir = tmp_path / "again"
    shutil.copytree(resumed[0], run_dir)
    before = sorted(p.name for p in (run_dir / "ckpt").iterdir())
    again = run_trainer([*TINY, *out_args(run_dir), "--from_resume", "1", "--max_steps", str(K2)], tmp_path)
    assert again.returncode == 0, again.stdout[-3000:]
    assert "nothing left to train" in again.stdout
    assert sorted(p.name for p in (run_dir / "ckpt").iterdir()) == before


@pytest.mark.slow
def test_resume_picks_the_most_trained_checkpoint_not_the_highest_step(resumed, tmp_path):
    """1 process left step 12 (48 samples); 2 processes resume at step 6 and save step 8
    (64 samples). Step 8 is the newer checkpoint although its number is smaller."""
    run_dir = tmp_path / "grow"
    shutil.copytree(resumed[0], run_dir)
    grown = run_trainer([*TINY, *out_args(run_dir), "--from_resume", "1", "--max_steps", "8"], tmp_path, nproc=2,
                        mode="forked")
    assert_clean_exit(grown.returncode, grown.stdout, "grown run")
    assert "at step 6/8" in grown.stdout
    assert latest_checkpoint(run_dir)["global_step"] == 8
    third = run_trainer([*TINY, *out_args(run_dir), "--from_resume", "1", "--max_steps", "10"], tmp_path, nproc=2,
                        mode="forked")
    assert_clean_exit(third.returncode, third.stdout, "third run")
    assert re.search(r"resumed from \S+_resume_step0000008\.pth at step 8/10", third.stdout)
