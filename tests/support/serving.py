"""What the serving tests share: a tiny chat model trained in seconds, a free port, and the
server (scripts/serve_openai_api.py) or the page (scripts/web_demo.py) run as the user runs
them, in a subprocess on 127.0.0.1 that the test stops."""
import os
import socket
import subprocess
import time
import urllib.request
from contextlib import contextmanager
from pathlib import Path

import torch

from scripts.dev.launching import PYTHON
from tests.support import REPO_ROOT
from tests.support.tiny import FLAGS

SERVE = REPO_ROOT / "scripts" / "serve_openai_api.py"
WEB_DEMO = REPO_ROOT / "scripts" / "web_demo.py"


def conversation(i: int) -> list[dict]:
    """Every other one reasons first, so the model writes reasoning when the prompt opens <think>."""
    reply = {"role": "assistant", "content": f"It is the number {i}. " * (1 + i % 3)}
    if i % 2:
        reply["reasoning_content"] = f"Count to {i}."
    return [{"role": "user", "content": f"What is {i}?"}, reply]


def train_tiny_chat(steps: int = 40):
    """The tests' tiny model (tests/support/tiny.py's shape) after a few AdamW steps on short conversations,
    rendered as fine-tuning renders them: its greedy replies differ from prompt to prompt, and some
    stop at <|im_end|>, which a model trained on random tokens never does."""
    from dataset.chat import encode, render
    from dataset.lm_dataset import load_tokenizer
    from model.model_minimind import MiniMindConfig, MiniMindForCausalLM

    tokenizer = load_tokenizer(REPO_ROOT / "model")
    docs = [encode(tokenizer, render(conversation(i))).ids for i in range(64)]
    torch.manual_seed(0)
    model = MiniMindForCausalLM(MiniMindConfig(**FLAGS)).train()
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    for step in range(steps):
        batch = [docs[(step * 8 + j) % len(docs)] for j in range(8)]
        width = max(map(len, batch))
        ids = torch.tensor([d + [0] * (width - len(d)) for d in batch])
        labels = torch.tensor([d + [-100] * (width - len(d)) for d in batch])
        model(ids, labels=labels).loss.backward()
        opt.step()
        opt.zero_grad()
    return model.eval()


def save_with_config(model, path: Path) -> Path:
    """`path` (.pth) and the config beside it, as the trainer leaves them in --save_dir."""
    from common.storage import atomic_write_text
    from model.weights import sidecar_path, sidecar_text
    from scripts.convert_model import save_pth

    save_pth(model.state_dict(), path)
    atomic_write_text(sidecar_path(path), sidecar_text(model.config))
    return path


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def wait_for(url: str, proc: subprocess.Popen, log: Path, timeout: float):
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            raise AssertionError(f"{url}: the process exited ({proc.returncode}):\n{log.read_text()[-3000:]}")
        try:
            with urllib.request.urlopen(url, timeout=2) as reply:
                if reply.status == 200:
                    return
        except OSError:
            pass
        time.sleep(0.3)
    raise AssertionError(f"{url} did not answer within {timeout:.0f} s:\n{log.read_text()[-3000:]}")


@contextmanager
def running(argv, log: Path, ready_url: str, timeout: float = 180, env=None):
    """A subprocess that is up once `ready_url` answers 200, stopped (and waited for) on exit."""
    with open(log, "w") as out:
        proc = subprocess.Popen(argv, stdout=out, stderr=subprocess.STDOUT, cwd=REPO_ROOT,
                                env={**os.environ, **(env or {})})
    try:
        wait_for(ready_url, proc, log, timeout)
        yield proc
    finally:
        proc.terminate()
        try:
            proc.wait(timeout=20)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()


@contextmanager
def server(weight_path, cache_dir, log: Path, *flags):
    """scripts/serve_openai_api.py on a free port: yields its base URL (http://127.0.0.1:PORT/v1)."""
    port = free_port()
    argv = [PYTHON, str(SERVE), "--weight_path", str(weight_path), "--cache_dir", str(cache_dir),
            "--port", str(port), "--device", "cpu", *flags]
    # One thread: the tests run three files at once on two cores.
    with running(argv, log, f"http://127.0.0.1:{port}/health", env={"OMP_NUM_THREADS": "1"}):
        yield f"http://127.0.0.1:{port}/v1"


@contextmanager
def served_tiny_chat(root: Path):
    """train_tiny_chat's model saved in `root` and served there: yields (root, pth, url, client, model)."""
    from argparse import Namespace

    import openai

    pth = save_with_config(train_tiny_chat(), root / "full_sft_64.pth")
    with server(pth, root / "cache", root / "server.log") as base_url:
        client = openai.OpenAI(base_url=base_url, api_key="none", max_retries=0, timeout=120)
        yield Namespace(root=root, pth=pth, url=base_url, client=client, model=client.models.list().data[0].id)
