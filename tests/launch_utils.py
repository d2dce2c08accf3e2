"""Launch train_pretrain.py the ways users do, on tiny CPU configs, for the tests:
as processes, or in this process where the process itself is not what a test shows."""
import fcntl
import io
import json
import os
import random
import signal
import subprocess
import sys
import tempfile
import traceback
import warnings
from contextlib import redirect_stderr, redirect_stdout
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import torch
from torch.utils._python_dispatch import TorchDispatchMode

from trainer.preflight import MAX_WORKER_TMPDIR

REPO_ROOT = Path(__file__).resolve().parents[1]
TRAIN = REPO_ROOT / "trainer" / "train_pretrain.py"
PYTHON = sys.executable
_TORCHRUN_BIN = Path(PYTHON).parent / "torchrun"
TORCHRUN = [str(_TORCHRUN_BIN)] if _TORCHRUN_BIN.exists() else [PYTHON, "-m", "torch.distributed.run"]

# hidden 64, 2 layers, seq 64: a step takes milliseconds, so process start-up dominates.
# CPU and gloo everywhere, also on a GPU machine (where rank 1 would pick cuda:1).
# fp32, not what --dtype auto picks on a CPU with native bf16: these tests compare runs across
# world sizes and DDP/FSDP to float noise, and bf16 rounds sums taken in another order ~1e-3
# apart. The tests then mean the same on every CPU; tests/test_bf16.py tests bf16 training on
# its own terms. The optimizer is the default's, Muon (fp32 Newton-Schulz in an fp32 run).
TINY = ["--hidden_size", "64", "--num_hidden_layers", "2", "--max_seq_len", "64", "--batch_size", "4",
        "--num_workers", "0", "--learning_rate", "2e-3", "--log_interval", "1", "--val_fraction", "0",
        "--dist_timeout", "60", "--device", "cpu", "--dtype", "float32"]


def run_env(tmp_path, extra=None) -> dict:
    env = dict(os.environ)
    # One thread per process: two ranks on two cores must not oversubscribe them. Each
    # run's temp files stay in its folder, unless that path is too long for the sockets
    # of DataLoader workers (trainer/preflight.py), as under a long user name or xdist.
    tmp = str(tmp_path) if len(os.fsencode(str(tmp_path))) <= MAX_WORKER_TMPDIR else tempfile.gettempdir()
    env.update(OMP_NUM_THREADS="1", TMPDIR=tmp, PYTHONUNBUFFERED="1")
    # torch.compile keeps its kernels under the temp folder by default; the folder this
    # process would use, for every run, as a user's runs share theirs: compiled runs do
    # not all start cold (a test of compile then checks cached kernels after its first run).
    from torch._inductor.runtime.cache_dir_utils import default_cache_dir

    env.setdefault("TORCHINDUCTOR_CACHE_DIR", default_cache_dir())
    # The launched runs are CPU runs: with a GPU visible, a 2-process job would put rank 1
    # on cuda:1 (absent on a 1-GPU machine), and scripts without --device would use cuda:0.
    env["CUDA_VISIBLE_DEVICES"] = ""
    for key in [k for k in env if k.startswith(("MINIMIND_FAULT", "MINIMIND_STEP_HOOKS"))]:
        del env[key]
    env.update(extra or {})
    return env


def out_args(run_dir) -> list[str]:
    return ["--save_dir", str(Path(run_dir) / "out"), "--checkpoint_dir", str(Path(run_dir) / "ckpt")]


def train_cmd(nproc: int, args, launcher: str = "torchrun") -> list[str]:
    """No --master_port: on one node both launchers then host the rendezvous store on a
    port the kernel picks (torch/distributed/run.py turns it into c10d on localhost:0),
    where a port picked by the test (bound, then released) could be lost to another process."""
    if nproc == 1 and launcher == "python":
        return [PYTHON, str(TRAIN), *args]
    if launcher == "legacy":
        return [PYTHON, "-m", "torch.distributed.launch", f"--nproc_per_node={nproc}", str(TRAIN), *args]
    return [*TORCHRUN, f"--nproc_per_node={nproc}", str(TRAIN), *args]


def run_training(nproc, args, tmp_path, launcher="torchrun", env=None, timeout=240, cwd=None):
    """Run to completion and return the CompletedProcess (stdout and stderr merged).
    Past `timeout` the launcher and its workers are killed, and TimeoutExpired raised."""
    with start_training(nproc, args, tmp_path, launcher, env, cwd) as proc:
        try:
            stdout, _ = proc.communicate(timeout=timeout)
        except subprocess.TimeoutExpired:
            kill_tree(proc.pid)
            proc.communicate(timeout=30)
            raise
    return subprocess.CompletedProcess(proc.args, proc.returncode, stdout)


def kill_tree(pid: int):
    """SIGKILL a process and everything under it. Killing a launcher alone is not enough:
    torchrun starts each worker in a session of its own, so a worker outlives it. Each
    process is stopped before its children are listed, so none can start another unseen."""
    stopped, todo = [], [pid]
    while todo:
        each = todo.pop()
        try:
            os.kill(each, signal.SIGSTOP)
        except ProcessLookupError:
            continue
        stopped.append(each)
        todo += children(each)
    for each in stopped:
        try:
            os.kill(each, signal.SIGKILL)
        except ProcessLookupError:
            pass


def descendants(pid: int) -> list[int]:
    """pid and every process under it, parents before children."""
    return [pid] + [d for child in children(pid) for d in descendants(child)]


def children(pid: int) -> list[int]:
    try:
        return [int(c) for task in os.listdir(f"/proc/{pid}/task")
                for c in Path(f"/proc/{pid}/task/{task}/children").read_text().split()]
    except (FileNotFoundError, ProcessLookupError):
        return []


@dataclass
class InProcessRun:
    returncode: int
    stdout: str  # stdout and stderr merged, as run_training returns them


class InProcessTimeout(Exception):
    """An in-process run that went past its time limit (a hang fails the test, not the suite)."""


def run_in_process(fn, run_dir, env=None, timeout: int = 240) -> InProcessRun:
    """Call fn() here as a process launched by run_training would run it: in run_dir,
    under run_env's environment, on one thread (as OMP_NUM_THREADS=1 does, so results equal
    a launched run's), with stdout and stderr merged and Python warnings shown as a fresh
    process shows them. sys.exit(code) gives the return code; an exception gives 1 and
    its traceback in the output. Afterwards every global the trainer sets is put back:
    the environment, the working directory, the SIGTERM/SIGINT handlers (the preemption
    flag installs its own), the thread count and the random generators it seeds.
    Past `timeout` seconds a SIGALRM raises InProcessTimeout inside fn(), as the timeout of
    a launched run would kill it: the run ends with code 1 instead of hanging the suite."""
    run_dir = Path(run_dir)
    run_dir.mkdir(parents=True, exist_ok=True)
    saved_env, saved_cwd, saved_threads = dict(os.environ), os.getcwd(), torch.get_num_threads()
    saved_handlers = {sig: signal.getsignal(sig) for sig in (signal.SIGTERM, signal.SIGINT, signal.SIGALRM)}
    saved_rng = random.getstate(), np.random.get_state(), torch.get_rng_state()
    out = io.StringIO()
    try:
        new_env = run_env(run_dir, env)
        os.environ.clear()
        os.environ.update(new_env)
        os.chdir(run_dir)
        torch.set_num_threads(1)
        signal.signal(signal.SIGALRM, _raise_timeout)
        signal.alarm(timeout)
        with redirect_stdout(out), redirect_stderr(out), warnings.catch_warnings():
            warnings.resetwarnings()
            warnings.showwarning = _show_warning
            try:
                fn()
                code = 0
            except SystemExit as exc:
                code = exc.code if isinstance(exc.code, int) else 0 if exc.code is None else 1
                if not isinstance(exc.code, (int, type(None))):
                    print(exc.code, file=sys.stderr)
            except Exception:
                traceback.print_exc()
                code = 1
    finally:
        signal.alarm(0)
        os.environ.clear()
        os.environ.update(saved_env)
        os.chdir(saved_cwd)
        torch.set_num_threads(saved_threads)
        for sig, handler in saved_handlers.items():
            signal.signal(sig, handler)
        random.setstate(saved_rng[0])
        np.random.set_state(saved_rng[1])
        torch.set_rng_state(saved_rng[2])
    return InProcessRun(code, out.getvalue())


def _raise_timeout(signum, frame):
    raise InProcessTimeout("the in-process run went past its time limit")


def _show_warning(message, category, filename, lineno, file=None, line=None):
    sys.stderr.write(warnings.formatwarning(message, category, filename, lineno, line))


def train_in_process(args, run_dir, env=None, timeout: int = 240) -> InProcessRun:
    """`python trainer/train_pretrain.py ARGS` as run_training(1, ARGS, run_dir, "python")
    runs it, as trainer.train_pretrain.main(ARGS) in this process: about a second for
    the tiny configs instead of the 5-8 s a process spends importing torch and transformers."""
    from trainer.train_pretrain import main

    return run_in_process(lambda: main([str(a) for a in args]), run_dir, env, timeout)


def ensure_demo_corpus() -> Path:
    """Build the trainer's default corpus here, once, before launching runs side by side
    (on a fresh checkout each would otherwise build its own copy). The lock keeps pytest-xdist
    workers from building it at the same time: the others wait and then find it built."""
    from dataset.demo_corpus import DEMO_CORPUS, ensure_demo_corpus as build_if_missing

    with open("/tmp/minimind-test-demo-corpus.lock", "w") as lock:  # /tmp: shared by every worker
        fcntl.flock(lock, fcntl.LOCK_EX)
        return build_if_missing(DEMO_CORPUS)


def small_corpus(work: Path, documents: int = 300) -> tuple[Path, Path]:
    """The first `documents` of the demo corpus as (small.jsonl, small.bin) in `work`:
    a few seconds of training data for the padded and the packed path."""
    from scripts.prepare_data import prepare

    small = Path(work) / "small.jsonl"
    small.write_text("".join(ensure_demo_corpus().open().readlines()[:documents]))
    prepare(small, Path(work) / "small.bin", num_proc=1)
    return small, Path(work) / "small.bin"


class CountHostReads(TorchDispatchMode):
    """Counts device-to-host scalar reads (aten._local_scalar_dense: `.item()`, `bool(t)`,
    `float(t)`); on a GPU each one stalls the host until the queued kernels have run."""

    def __init__(self):
        super().__init__()
        self.reads = 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        if func is torch.ops.aten._local_scalar_dense.default:
            self.reads += 1
        return func(*args, **(kwargs or {}))


def start_training(nproc, args, tmp_path, launcher="torchrun", env=None, cwd=None) -> subprocess.Popen:
    """Like run_training, but returns at once; read with .communicate(timeout=...)."""
    return subprocess.Popen(train_cmd(nproc, args, launcher), cwd=cwd or tmp_path, env=run_env(tmp_path, env),
                            stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)


def read_metrics(run_dir, prefix="pretrain_64", kind="train") -> list[dict]:
    """Rows of `kind` from {run_dir}/out/{prefix}_metrics.jsonl, in file order."""
    with open(Path(run_dir) / "out" / f"{prefix}_metrics.jsonl") as f:
        rows = [json.loads(line) for line in f if line.strip()]
    return [row for row in rows if row.get("kind") == kind]


def load_checkpoint(path) -> dict:
    return torch.load(path, map_location="cpu", weights_only=True)


def latest_checkpoint(run_dir, prefix="pretrain_64", suffix=".pth") -> dict:
    """The newest resume checkpoint; for a sharded (.dcp) one, its trainer state."""
    path = Path(run_dir) / "ckpt" / f"{prefix}_resume{suffix}"
    return load_checkpoint(path / "trainer_state.pt" if suffix == ".dcp" else path)


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


# ---------------------------------------------------------------------------- tiny models and tokenizers
# The shape of the tiny models the conversion, evaluation and untrusted-input tests build.
FLAGS = {"hidden_size": 64, "num_hidden_layers": 2, "num_attention_heads": 4, "num_key_value_heads": 2}
CLI_FLAGS = [x for name, value in FLAGS.items() for x in (f"--{name}", str(value))]


def build_tokenizer(out_dir) -> Path:
    """A byte-level BPE tokenizer with the project's layout (pad 0, bos 1, eos 2, 6400 ids),
    trained in under a second on random words, standing in for model/tokenizer.json."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    rng = random.Random(0)
    words = ["".join(rng.choice("abcdefghijklmnopqrstuvwxyz") for _ in range(rng.randint(2, 9))) for _ in range(30000)]
    lines = [" ".join(words[i : i + 20]) for i in range(0, len(words), 20)] + ["你好，世界！MiniMind 是一个小模型。"] * 5
    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=6400, special_tokens=["<|endoftext|>", "<|im_start|>", "<|im_end|>"],
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet(), show_progress=False)
    tok.train_from_iterator(lines, trainer)
    fast = PreTrainedTokenizerFast(tokenizer_object=tok, bos_token="<|im_start|>", eos_token="<|im_end|>",
                                   pad_token="<|endoftext|>", unk_token="<|endoftext|>")
    fast.save_pretrained(out_dir)
    return Path(out_dir)


def train_tiny(use_moe, steps=4):
    """A few AdamW steps on random tokens, so the weights are no longer the init."""
    from model.model_minimind import MiniMindConfig, MiniMindForCausalLM

    torch.manual_seed(0)
    model = MiniMindForCausalLM(MiniMindConfig(**FLAGS, use_moe=use_moe)).train()
    opt = torch.optim.AdamW(model.parameters(), lr=3e-3)
    for _ in range(steps):
        ids = torch.randint(3, 6400, (4, 32))
        out = model(ids, labels=ids)
        (out.loss + out.aux_loss).backward()
        opt.step()
        opt.zero_grad()
    return model.eval()
