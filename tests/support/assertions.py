"""What the tests assert about runs: equal weights and states, a clean exit, and the
tracebacks, error lines and files a run left."""
import hashlib
import os
import re
from pathlib import Path

import torch

def max_abs_diff(state_a: dict, state_b: dict) -> float:
    assert state_a.keys() == state_b.keys()
    return max((state_a[k].double() - state_b[k].double()).abs().max().item() for k in state_a)


def assert_bitwise_equal(state_a: dict, state_b: dict):
    assert state_a.keys() == state_b.keys()
    differing = [k for k in state_a if not torch.equal(state_a[k], state_b[k])]
    assert not differing, f"tensors differ: {differing[:5]}"


def assert_same_state(a, b, where="state"):
    """Recursive equality; tensors bitwise (torch.equal)."""
    if isinstance(a, torch.Tensor):
        assert isinstance(b, torch.Tensor) and torch.equal(a, b), f"{where} differs"
    elif isinstance(a, dict):
        assert a.keys() == b.keys(), f"{where}: keys differ"
        for key in a:
            assert_same_state(a[key], b[key], f"{where}[{key!r}]")
    elif isinstance(a, (list, tuple)):
        assert len(a) == len(b), f"{where}: lengths differ"
        for i, (x, y) in enumerate(zip(a, b)):
            assert_same_state(x, y, f"{where}[{i}]")
    else:
        assert a == b, f"{where}: {a!r} != {b!r}"


# gloo's abort at exit ("terminate called without an active exception"), as the worker
# or torchrun ("Signal 6 (SIGABRT)") reports it.
ABORT_SIGNS = ("terminate called", "SIGABRT")


def assert_clean_exit(returncode, output: str, what: str = "job"):
    """A job that should succeed exited 0 and no rank aborted on the way out."""
    signs = [sign for sign in ABORT_SIGNS if sign in output]
    assert returncode == 0 and not signs, f"{what}: rc {returncode}, {signs}\n{output[-3000:]}"


def tree_digest(root) -> dict:
    """{relative path: sha256 of the bytes, or '-> target' for a symlink} of every file under root."""
    root, digest = Path(root), {}
    for path in sorted(root.rglob("*")):
        rel = str(path.relative_to(root))
        if path.is_symlink():
            digest[rel] = "-> " + os.readlink(path)
        elif path.is_file():
            digest[rel] = hashlib.sha256(path.read_bytes()).hexdigest()
    return digest


# The elastic agent's own log records start "E1201 20:48:28.419000 29741 torch/distributed/
# elastic/agent/server/api.py:1008] ...". An agent logs (and survives, rc 0) an exception in
# its exit barrier when the agent hosting the rendezvous store exits first: a race inside
# torch seen under load after both nodes had finished, not a failure of the trainer's.
AGENT_LOG_RECORD = re.compile(r"^[EWI]\d{4} [\d:.]+ \d+ \S*torch/distributed/elastic/\S+\] ")


def worker_tracebacks(output: str) -> list[str]:
    """Python tracebacks in a job's output, except the launcher's: torchrun's ChildFailedError
    report (which torchrun prints whenever any worker exits non-zero) and the exceptions an
    elastic agent logs about itself (AGENT_LOG_RECORD)."""
    lines = output.splitlines()
    found = []
    for i, line in enumerate(lines):
        if "Traceback (most recent call last)" in line and not AGENT_LOG_RECORD.match(line):
            frame = lines[i + 1] if i + 1 < len(lines) else ""
            if not ("bin/torchrun" in frame or "torch/distributed/run.py" in frame):
                found.append("\n".join(lines[i:i + 8]))
    return found


def error_lines(output: str) -> list[str]:
    return [line for line in output.splitlines() if line.startswith("error: ")]


def outputs_digest(run_dir) -> dict:
    """tree_digest of a run's checkpoint and output folders (TMPDIR litter elsewhere is ignored)."""
    return {sub: tree_digest(Path(run_dir) / sub) for sub in ("ckpt", "out")}


def one_line_stop(main, capsys, *argv) -> str:
    """A script's main(argv) stopping with exit code 2 and one line on stderr, no traceback: that line."""
    import pytest

    with pytest.raises(SystemExit) as exit_info:
        main(list(argv))
    err = capsys.readouterr().err.strip()
    assert exit_info.value.code == 2 and "\n" not in err and "Traceback" not in err, err
    return err
