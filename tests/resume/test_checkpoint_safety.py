"""Resume checkpoints on disk: rotation, and what --from_resume 1 does with a damaged,
half-written, missing or mismatched checkpoint. One process is enough here (the
checkpoint is written by rank 0 alone), and it need not be a process of its own: every
run is train_pretrain.main() in this process, end to end from the flags to the exit code."""
import os
import re
import shutil
from pathlib import Path

import pytest

from tests.support.assertions import assert_bitwise_equal, error_lines, outputs_digest
from tests.support.jobs import run_trainer
from tests.support.run_outputs import checkpoint_name, checkpoint_path, latest_checkpoint, latest_link_name, out_args
from tests.support.tiny import TINY
from trainer.checkpoint import verify_checkpoint

STEPS, SAVE = 8, 2  # saves at 2, 4, 6, 8; the default --keep_last 3 keeps 4, 6, 8
BASE = [*TINY, "--save_interval", str(SAVE)]


name = checkpoint_name


def ckpt(run_dir, step) -> Path:
    return checkpoint_path(run_dir, step)


def truncate(path):
    with open(path, "r+b") as f:
        f.truncate(os.path.getsize(path) // 2)


def flip_bytes(path):
    size = os.path.getsize(path)
    with open(path, "r+b") as f:
        f.seek(size // 2)
        chunk = f.read(16)
        f.seek(size // 2)
        f.write(bytes(b ^ 0xFF for b in chunk))
    assert os.path.getsize(path) == size


def leave_tmp_files(run_dir):
    d = Path(run_dir) / "ckpt"
    (d / f"{name(10)}.tmp").write_bytes(b"half a checkpoint")  # killed mid-save
    (d / f"{name(8)}.json.tmp").write_text('{"global_step": 8, "fi')  # killed mid-record
    os.symlink(name(4), d / f"{latest_link_name()}.tmp")  # killed mid-swap of the link


# name: (damage, extra flags). Every attempt resumes with --from_resume 1.
SCENARIOS = {
    "truncated_newest": (lambda d: truncate(ckpt(d, 8)), ["--max_steps", "8"]),
    "corrupt_newest": (lambda d: flip_bytes(ckpt(d, 8)), ["--max_steps", "8"]),
    "newest_without_record": (lambda d: os.remove(f"{ckpt(d, 8)}.json"), ["--max_steps", "8"]),
    "tmp_leftovers": (leave_tmp_files, ["--max_steps", "10"]),
    "all_unusable": (lambda d: [truncate(ckpt(d, s)) for s in (4, 6, 8)], ["--max_steps", "8"]),
    "no_checkpoint": (lambda d: shutil.rmtree(Path(d) / "ckpt"), ["--max_steps", "2"]),
    "more_layers": (lambda d: None, ["--max_steps", "8", "--num_hidden_layers", "3"]),
    "wider": (lambda d: None, ["--max_steps", "8", "--hidden_size", "128"]),
}


@pytest.fixture(scope="module")
def base(tmp_path_factory):
    run = tmp_path_factory.mktemp("base")
    result = run_trainer([*BASE, *out_args(run), "--max_steps", str(STEPS)], run)
    assert result.returncode == 0, result.stdout[-3000:]
    return run


@pytest.fixture(scope="module")
def attempts(base, tmp_path_factory):
    root = tmp_path_factory.mktemp("attempts")
    results, before = {}, {}
    for scenario, (damage, extra) in SCENARIOS.items():
        run = root / scenario
        shutil.copytree(base, run, symlinks=True)
        damage(run)
        before[scenario] = outputs_digest(run)
        # BASE's TINY has --num_hidden_layers 2 / --hidden_size 64; a later flag wins in argparse.
        results[scenario] = run_trainer([*BASE, *out_args(run), "--from_resume", "1", *extra], run)
    return {s: (results[s], root / s, before[s]) for s in SCENARIOS}


def skip_lines(output) -> list[str]:
    return [line for line in output.splitlines() if line.startswith("skipping checkpoint")]


def resumed_from(output) -> int | None:
    match = re.search(r"resumed from .*_resume_step(\d+)\.pth at step", output)
    return int(match.group(1)) if match else None


def test_keep_last_three_named_by_step_and_link_to_newest(base):
    d = base / "ckpt"
    assert sorted(p.name for p in d.glob("*_step*.pth")) == [name(4), name(6), name(8)]
    assert sorted(p.name for p in d.glob("*.json")) == [f"{name(s)}.json" for s in (4, 6, 8)]
    assert os.readlink(d / latest_link_name()) == name(8)
    assert not list(d.glob("*.tmp"))
    for step in (4, 6, 8):
        assert verify_checkpoint(str(d / name(step)))["global_step"] == step


def test_a_fresh_run_over_an_earlier_run_s_checkpoints_keeps_its_own(base, tmp_path):
    """--from_resume 0 in a folder holding a longer run's checkpoints (steps 4, 6, 8): the new
    run's step 2 comes first, so the rotation removes the earlier run's oldest, not the step it
    just saved, and a resume continues the new run (as a fresh MiniMind run overwrites its file)."""
    run = tmp_path / "again"
    shutil.copytree(base, run, symlinks=True)
    result = run_trainer([*BASE, *out_args(run), "--max_steps", "2"], run)
    assert result.returncode == 0, result.stdout[-3000:]
    assert ("holds 3 checkpoints of an earlier run of pretrain_64 (the newest at step 8): this run's saves come "
            "first") in result.stdout
    d = run / "ckpt"
    assert sorted(p.name for p in d.glob("*_step*.pth")) == [name(2), name(6), name(8)]
    assert os.readlink(d / latest_link_name()) == name(2)
    newest = latest_checkpoint(run)
    assert (newest["global_step"], newest["run_number"]) == (2, 2)
    assert verify_checkpoint(str(d / name(8)))["run_number"] == 1  # the earlier run, numbered first


@pytest.mark.parametrize("scenario, reason", [
    ("truncated_newest", "truncated?"),
    ("corrupt_newest", "sha256 does not match"),
    # Unrecorded checkpoints sort oldest (newest = most tokens per the record), so it is
    # passed over without a word: it is the normal debris of a kill during a save.
    ("newest_without_record", None),
])
def test_unusable_newest_is_skipped_in_one_line_and_the_previous_used(attempts, scenario, reason):
    result, run, _ = attempts[scenario]
    assert result.returncode == 0, result.stdout[-3000:]
    lines = skip_lines(result.stdout)
    if reason:
        assert len(lines) == 1 and name(8) in lines[0] and reason in lines[0], lines
    else:
        assert not lines
    assert resumed_from(result.stdout) == 6
    # ...and the re-trained step 8, saved beside the bad file, replaced it once whole.
    redone = checkpoint_path(run, 8).with_name(name(8).replace(".pth", "_2.pth"))
    assert verify_checkpoint(str(redone))["global_step"] == 8 and not ckpt(run, 8).exists()
    assert os.readlink(run / "ckpt" / latest_link_name()) == redone.name


def test_leftover_tmp_files_do_not_matter(attempts):
    result, run, _ = attempts["tmp_leftovers"]
    assert result.returncode == 0, result.stdout[-3000:]
    assert not skip_lines(result.stdout)
    assert resumed_from(result.stdout) == 8
    assert verify_checkpoint(str(ckpt(run, 10)))["global_step"] == 10
    assert not (run / "ckpt" / f"{name(10)}.tmp").exists()  # the save at 10 cleared its own debris
    assert os.readlink(run / "ckpt" / latest_link_name()) == name(10)


def test_all_unusable_stops_with_a_message_and_touches_nothing(attempts):
    result, run, before = attempts["all_unusable"]
    assert result.returncode == 2, result.stdout[-3000:]
    assert len(skip_lines(result.stdout)) == 3
    assert error_lines(result.stdout) == [
        f"error: --from_resume 1: none of the 3 checkpoints in {run / 'ckpt'} is usable (see above); "
        f"move them aside to start fresh"]
    assert "Traceback" not in result.stdout
    assert outputs_digest(run) == before


def test_no_checkpoint_at_all_starts_fresh(attempts):
    result, run, _ = attempts["no_checkpoint"]
    assert result.returncode == 0, result.stdout[-3000:]
    assert "resumed from" not in result.stdout
    assert re.search(r"^epoch 1/\d+ step 1/2 ", result.stdout, re.M)
    assert os.readlink(run / "ckpt" / latest_link_name()) == name(2)


@pytest.mark.parametrize("scenario, saved, given", [
    ("more_layers", "trained with --num_hidden_layers 2", "--num_hidden_layers 3"),  # the resume rule (trainer/config.py)
    ("wider", "saved with hidden_size=64", "hidden_size=128"),  # another file prefix (pretrain_128): found all the same
])
def test_resume_with_another_model_config_names_both_values(attempts, scenario, saved, given):
    result, run, before = attempts[scenario]
    assert result.returncode == 2, result.stdout[-3000:]
    [line] = error_lines(result.stdout)
    assert saved in line and given in line and "pretrain_64_resume_step" in line, line
    assert "Traceback" not in result.stdout
    assert outputs_digest(run) == before


# ---------------------------------------------------------------------------- a kill at each point of a save
# A save's renames, in order: the inference weights, their config, the checkpoint's record, the
# checkpoint itself (visible from here on), the link. Killed before the 4th, the run resumes from
# the save before (or, in its first save, starts afresh); from the 4th on, from this one. Never
# refused, never a fallback further back.
SAVE_RENAMES, VISIBLE_FROM = 5, 4
KILLS = [(step, point) for step in (2, 4) for point in range(SAVE_RENAMES + 1)]  # the first save, and a later one


@pytest.fixture(scope="module")
def killed_saves(tmp_path_factory):
    """An uninterrupted run, and one run killed inside its step-2 or step-4 save at each rename
    point, then resumed: {(step, point): (killed, what its folder held then, resumed, run_dir)}, and
    the uninterrupted run's final checkpoint."""
    from tests.support.fault_injection import fault_env
    from tests.support.jobs import JobSpec, run_all
    from tests.support.tiny import ensure_demo_corpus

    ensure_demo_corpus()
    root = tmp_path_factory.mktemp("killed_saves")
    args = [*TINY, "--save_interval", "2", "--max_steps", "6"]
    run_dir = {kill: root / f"step{kill[0]}-point{kill[1]}" for kill in KILLS}
    jobs = {"uninterrupted": JobSpec([*args, *out_args(root / "uninterrupted")], root / "uninterrupted",
                                     mode="forked")}
    jobs.update({(step, point): JobSpec([*args, *out_args(run)], run, mode="forked",
                                        env=fault_env("kill_in_save", at=step, save_point=point))
                 for (step, point), run in run_dir.items()})
    killed = run_all(jobs, timeout=180)
    held = {kill: sorted(p.name for p in (run / "ckpt").iterdir()) for kill, run in run_dir.items()}
    resumed = run_all({kill: JobSpec([*args, *out_args(run), "--from_resume", "1"], run.with_name(run.name + "-on"),
                                     mode="forked") for kill, run in run_dir.items()}, timeout=180)
    final = latest_checkpoint(root / "uninterrupted")
    return {kill: (killed[kill], held[kill], resumed[kill], run) for kill, run in run_dir.items()}, final


@pytest.mark.slow
@pytest.mark.parametrize("step, point", KILLS)
def test_a_kill_at_any_point_of_a_save_leaves_the_previous_state_or_the_new_one(killed_saves, step, point):
    runs, uninterrupted = killed_saves
    killed, held, resumed, run = runs[step, point]
    assert killed.returncode not in (0, None), killed.stdout[-2000:]
    assert f"SIGKILLs itself in a save after {point} renames" in killed.stdout
    unrecorded = [name for name in held if name.endswith(".pth") and f"{name}.json" not in held
                  and not os.path.islink(run / "ckpt" / name)]
    assert not unrecorded, f"a checkpoint was visible before its record: {held}"
    assert resumed.returncode == 0, resumed.stdout[-3000:]
    assert not skip_lines(resumed.stdout), "a checkpoint was refused"
    previous = step - 2 or None  # the first save has none before it: the run starts afresh
    assert resumed_from(resumed.stdout) == (step if point >= VISIBLE_FROM else previous)
    final = latest_checkpoint(run)
    assert final["global_step"] == 6 and final["tokens_seen"] == uninterrupted["tokens_seen"]
    assert_bitwise_equal(final["model"], uninterrupted["model"])
    leftovers = [p.name for p in (run / "ckpt").iterdir() if p.name.endswith(".tmp") or
                 (p.name.endswith(".pth.json") and not (run / "ckpt" / p.name[:-5]).exists())]
    assert not leftovers, leftovers  # what the killed save left, start-up removed
