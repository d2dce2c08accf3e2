"""Serving speed: generated tokens/s and time to first token for 1 and 8 concurrent clients, with
transformers' continuous batching on and off, through scripts/serve_openai_api.py and the openai
client, as a user's clients would see it. Prints one table.

    python scripts/bench/bench_serve.py                                   # random hidden 256 x 4 layers
    python scripts/bench/bench_serve.py --weight_path out/full_sft_512.pth --max_tokens 128

Without --weight_path it builds a randomly initialised model of the shape flags (speed does not
depend on what the weights learnt; a random model also never stops early at <|im_end|>). Each
client streams --requests replies of --max_tokens, one after another; tokens/s is all clients'
generated tokens (the server's own usage count) over the wall time, TTFT the median time from a
request to its first generated text.

The same weights in llama.cpp (exported to GGUF, q8_0 and f16) are rows of the same table: ENGINES
maps an engine's name to the function that measures it.
"""
import argparse
import socket
import statistics
import subprocess
import sys
import tempfile
import time
import urllib.request
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import NamedTuple

REPO_ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(REPO_ROOT))

from model.shape_flags import SHAPE_FLAGS, flag_default  # noqa: E402

PROMPTS = ["Tell me about the sea.", "What is 12 times 7?", "Write a line of Python.", "你好，介绍一下你自己。",
           "Why is the sky blue?", "Name three colours.", "What does a compiler do?", "Say something kind."]


class Row(NamedTuple):
    engine: str
    setting: str
    clients: int
    tokens_per_s: float
    ttft_ms: float


def random_model(folder: Path, flags: dict) -> Path:
    """A randomly initialised MiniMind of `flags`, saved as the trainer saves (.pth and its config)."""
    import torch

    from common.storage import atomic_write_text
    from model.model_minimind import MiniMindConfig, MiniMindForCausalLM
    from model.weights import sidecar_path, sidecar_text
    from scripts.convert_model import save_pth

    torch.manual_seed(0)
    model = MiniMindForCausalLM(MiniMindConfig(**{k: v for k, v in flags.items() if v is not None}))
    path = folder / "bench.pth"
    save_pth(model.state_dict(), path)
    atomic_write_text(sidecar_path(path), sidecar_text(model.config))
    return path


def one_client(client, model, prompts, max_tokens):
    """Stream each prompt's reply in turn: (generated tokens, [time to first text per request])."""
    tokens, ttfts = 0, []
    for prompt in prompts:
        start, first = time.perf_counter(), None
        stream = client.chat.completions.create(model=model, messages=[{"role": "user", "content": prompt}],
                                                max_tokens=max_tokens, temperature=0, stream=True)
        for chunk in stream:
            delta = chunk.choices[0].delta if chunk.choices else None
            if first is None and delta is not None and (delta.content or getattr(delta, "reasoning_content", None)):
                first = time.perf_counter() - start
            if chunk.usage is not None:
                tokens += chunk.usage.completion_tokens
        ttfts.append(first if first is not None else time.perf_counter() - start)
    return tokens, ttfts


def measure(client, model, clients, requests, max_tokens):
    jobs = [[PROMPTS[(c + r) % len(PROMPTS)] for r in range(requests)] for c in range(clients)]
    start = time.perf_counter()
    with ThreadPoolExecutor(clients) as pool:
        results = list(pool.map(lambda prompts: one_client(client, model, prompts, max_tokens), jobs))
    wall = time.perf_counter() - start
    tokens = sum(t for t, _ in results)
    return tokens / wall, 1000 * statistics.median(x for _, ttfts in results for x in ttfts)


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def start_server(weight_path, cache_dir, batching: bool, log):
    """scripts/serve_openai_api.py in a subprocess; returns (process, base URL) once /health answers."""
    port = free_port()
    proc = subprocess.Popen([sys.executable, str(REPO_ROOT / "scripts" / "serve_openai_api.py"),
                             "--weight_path", str(weight_path), "--cache_dir", str(cache_dir), "--port", str(port),
                             "--continuous_batching", str(int(batching))], stdout=log, stderr=subprocess.STDOUT)
    deadline = time.monotonic() + 300
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            raise SystemExit(f"error: the server exited ({proc.returncode}); its log: {log.name}")
        try:
            with urllib.request.urlopen(f"http://127.0.0.1:{port}/health", timeout=2):
                return proc, f"http://127.0.0.1:{port}/v1"
        except OSError:
            time.sleep(0.5)
    proc.kill()
    raise SystemExit(f"error: the server did not start within 300 s; its log: {log.name}")


def bench_transformers(weight_path, args, work: Path) -> list[Row]:
    import openai

    rows = []
    for batching in args.batching:
        with open(work / f"server_cb{int(batching)}.log", "w") as log:
            proc, url = start_server(weight_path, work / "cache", batching, log)
            try:
                client = openai.OpenAI(base_url=url, api_key="none", max_retries=0, timeout=600)
                model = client.models.list().data[0].id
                measure(client, model, 2, 1, 8)  # warm-up: first-call allocations, the batching worker
                for clients in args.clients:
                    tokens_per_s, ttft = measure(client, model, clients, args.requests, args.max_tokens)
                    setting = "continuous batching" if batching else "one generate() at a time"
                    rows.append(Row("transformers serve", setting, clients, tokens_per_s, ttft))
            finally:
                proc.terminate()
                proc.wait(timeout=60)
    return rows


def bench_llama_cpp(weight_path, args, work: Path) -> list[Row]:
    """The same weights exported to GGUF (q8_0, f16) and run in llama.cpp (scripts/bench/bench_gguf.py's
    measurement): one client, since llama-cpp-python runs one sequence at a time."""
    from model.gguf_export import write_gguf
    from model.weights import load_model
    from scripts.bench.bench_gguf import llama_cpp_rows

    model, _ = load_model(weight_path)
    paths = {quant: work / f"model-{quant}.gguf" for quant in ("q8_0", "f16")}
    for quant, path in paths.items():
        write_gguf(model, path, REPO_ROOT / "model", quant)
    rows = llama_cpp_rows(paths, new_tokens=args.max_tokens, repeats=args.requests)
    return [Row("llama.cpp", r["quant"], r["clients"], r["tokens/s"], r["time to first token"] * 1000) for r in rows]


# Engine name -> function(weight_path, args, work folder) -> [Row], on the same model.
ENGINES = {"transformers": bench_transformers, "llama.cpp": bench_llama_cpp}


def table(rows: list[Row]) -> str:
    one = {(r.engine, r.setting): r.tokens_per_s for r in rows if r.clients == 1}
    lines = ["| engine | setting | clients | generated tokens/s | x one client | TTFT median (ms) |",
             "|---|---|---:|---:|---:|---:|"]
    for r in rows:
        base = one.get((r.engine, r.setting))
        ratio = f"{r.tokens_per_s / base:.2f}" if base else "-"
        lines.append(f"| {r.engine} | {r.setting} | {r.clients} | {r.tokens_per_s:.1f} | {ratio} | {r.ttft_ms:.0f} |")
    return "\n".join(lines)


def parse_args(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--weight_path", help="weights to serve (default: a random model of the shape flags)")
    p.add_argument("--clients", type=int, nargs="+", default=[1, 8], help="concurrent clients (default 1 8)")
    p.add_argument("--requests", type=int, default=3, help="replies each client asks for in turn (default 3)")
    p.add_argument("--max_tokens", type=int, default=64, help="tokens per reply (default 64)")
    p.add_argument("--batching", type=int, nargs="+", default=[1, 0], choices=(0, 1),
                   help="continuous batching on (1) and off (0) (default: both)")
    p.add_argument("--engines", nargs="+", default=list(ENGINES), choices=list(ENGINES), help="engines to measure")
    defaults = {"hidden_size": 256, "num_hidden_layers": 4}
    for name in SHAPE_FLAGS:
        p.add_argument(f"--{name}", type=int, default=defaults.get(name),
                       help=f"random model's shape (default {defaults.get(name, flag_default(name))})")
    return p.parse_args(argv)


def main(argv=None):
    args = parse_args(argv)
    with tempfile.TemporaryDirectory(prefix="bench_serve_") as tmp:
        work = Path(tmp)
        flags = {name: getattr(args, name) for name in SHAPE_FLAGS}
        weight_path = args.weight_path or random_model(work, flags)
        rows = [row for name in args.engines for row in ENGINES[name](weight_path, args, work)]
    what = args.weight_path or f"random MiniMind {format_shape(flags)}"
    print(f"{what}, {args.requests} streamed replies of {args.max_tokens} tokens per client, greedy")
    print(table(rows))


def format_shape(flags) -> str:
    return " ".join(f"--{k} {v}" for k, v in flags.items() if v is not None)


if __name__ == "__main__":
    main()
