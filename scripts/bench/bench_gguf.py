"""Speed of our model in llama.cpp: generated tokens/s and time to first token, f16 against q8_0.

    python scripts/bench/bench_gguf.py --weight_path out/pretrain_256.pth        # exports both, then measures
    python scripts/bench/bench_gguf.py --hidden_size 256 --num_hidden_layers 4   # random weights of that shape
    python scripts/bench/bench_gguf.py --gguf f16=model.gguf --gguf q8_0=model-q8.gguf

One client (llama-cpp-python runs one sequence at a time), greedy, EOS ignored so every run
generates --new_tokens tokens after a --prompt_tokens prompt. Each row is the median of --repeats
runs after a warm-up (the range in brackets), the files taking turns; the prompt is evaluated
afresh in every run (no prefix cache).
tokens/s counts the generated tokens over the whole request, prompt evaluation included;
time to first token is from the request to the first generated token.
llama_cpp_rows() is the measurement for other benchmarks to call (scripts/bench/bench_serve.py).
"""
import argparse
import os
import statistics
import sys
import tempfile
import time
from pathlib import Path

REPO_ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(REPO_ROOT))

import torch  # noqa: E402

from common.errors import UserError, report_user_errors  # noqa: E402
from model.shape_flags import SHAPE_FLAGS  # noqa: E402
from scripts.dev.launching import row, table  # noqa: E402

COLUMNS = ("engine", "quant", "clients", "tokens/s", "time to first token")


def llama_cpp_rows(export_paths, prompt_tokens=128, new_tokens=128, threads=None, repeats=3):
    """One row per GGUF file ({quant: path}): dicts with COLUMNS' keys (time to first token in
    seconds) and "tokens/s range" (min, max). The files take turns run by run, so that load
    from other work on a shared machine falls on all of them alike."""
    try:
        from llama_cpp import Llama
    except ImportError:
        raise UserError("llama-cpp-python is not installed: pip install -r requirements-gguf.txt") from None
    models = {}
    for quant, path in export_paths.items():
        if not Path(path).is_file():
            raise UserError(f"{path}: no such GGUF file: pass --gguf QUANT=FILE of a file that exists")
        models[quant] = Llama(model_path=str(path), n_ctx=prompt_tokens + new_tokens + 8, n_batch=512,
                              n_threads=threads, verbose=False)
    n_vocab = min(llm.n_vocab() for llm in models.values())
    # Token ids past the special ones, fixed: every file gets the same prompt.
    prompt = (torch.randint(3, n_vocab, (prompt_tokens,), generator=torch.Generator().manual_seed(0))).tolist()
    runs = {quant: [] for quant in models}
    for llm in models.values():
        _generate(llm, prompt, min(8, new_tokens))  # warm-up: first-call allocations
    for _ in range(repeats):
        for quant, llm in models.items():
            runs[quant].append(_generate(llm, prompt, new_tokens))
    rows = []
    for quant, times in runs.items():
        rates = [new_tokens / total for total, _ in times]
        rows.append({"engine": "llama.cpp", "quant": quant, "clients": 1, "tokens/s": statistics.median(rates),
                     "time to first token": statistics.median(first for _, first in times),
                     "tokens/s range": (min(rates), max(rates))})
    return rows


def _generate(llm, prompt, new_tokens):
    """(seconds for the request, seconds to its first token)."""
    llm.reset()  # otherwise llama-cpp-python reuses the prompt's cached prefix
    start = time.perf_counter()
    first = None
    for i, _ in enumerate(llm.generate(prompt, top_k=1, temp=0.0, reset=True)):
        if first is None:
            first = time.perf_counter() - start
        if i + 1 == new_tokens:
            break
    return time.perf_counter() - start, first


def machine_line():
    """The CPU, whether it has the bf16 / AMX instructions llama.cpp can use, and the load that
    other work puts on it (a shared machine's numbers swing with it)."""
    try:
        info = Path("/proc/cpuinfo").read_text()
    except OSError:
        return "cpu: unknown (no /proc/cpuinfo)"
    name = next((line.split(":", 1)[1].strip() for line in info.splitlines() if line.startswith("model name")), "?")
    flags = set(next((line.split(":", 1)[1].split() for line in info.splitlines() if line.startswith("flags")), []))
    has = [f for f in ("avx2", "avx512f", "avx512_bf16", "amx_tile", "amx_bf16") if f in flags]
    return (f"cpu: {name}, {os.cpu_count()} cores, flags {' '.join(has) or 'none of avx2/avx512/amx'}, "
            f"load average {os.getloadavg()[0]:.1f} before the runs")


def export_both(args, folder):
    from model.gguf_export import write_gguf
    from model.model_minimind import MiniMindConfig, MiniMindForCausalLM
    from model.weights import load_model

    flags = {name: getattr(args, name) for name in SHAPE_FLAGS}
    if args.weight_path:
        model, source = load_model(args.weight_path, **flags)
    else:
        torch.manual_seed(0)
        given = {k: v for k, v in flags.items() if v is not None}
        model, source = MiniMindForCausalLM(MiniMindConfig(**given)).eval(), "random weights"
    paths = {}
    for quant in ("f16", "q8_0"):
        paths[quant] = Path(folder) / f"model-{quant}.gguf"
        write_gguf(model, paths[quant], REPO_ROOT / "model", quant)
    config = model.config
    print(f"model: {source}, hidden {config.hidden_size} x {config.num_hidden_layers} layers, "
          f"{sum(p.numel() for p in model.parameters()) / 1e6:.1f}M parameters")
    return paths


def parse_args(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--weight_path", help="weights to export (.pth / .safetensors / resume checkpoint)")
    p.add_argument("--gguf", action="append", default=[], metavar="QUANT=FILE",
                   help="measure this GGUF file instead of exporting (repeatable)")
    for name in SHAPE_FLAGS:
        p.add_argument(f"--{name}", type=int, default=None, help="model shape (a stored config wins)")
    p.add_argument("--prompt_tokens", type=int, default=128)
    p.add_argument("--new_tokens", type=int, default=128)
    p.add_argument("--threads", type=int, default=None, help="llama.cpp threads (default: its own choice)")
    p.add_argument("--repeats", type=int, default=3)
    args = p.parse_args(argv)
    if any("=" not in g for g in args.gguf):
        p.error("--gguf takes QUANT=FILE, e.g. --gguf q8_0=model-q8.gguf")
    if min(args.prompt_tokens, args.new_tokens, args.repeats) < 1:
        p.error("--prompt_tokens, --new_tokens and --repeats must be >= 1")
    return args


@report_user_errors
def main(argv=None):
    args = parse_args(argv)
    print(machine_line())
    with tempfile.TemporaryDirectory() as folder:
        paths = dict(g.split("=", 1) for g in args.gguf) or export_both(args, folder)
        rows = llama_cpp_rows(paths, args.prompt_tokens, args.new_tokens, args.threads, args.repeats)
    print(f"{args.prompt_tokens} prompt tokens, {args.new_tokens} generated, median of {args.repeats}, "
          f"threads {args.threads or 'llama.cpp default'}")
    table(*COLUMNS)
    for r in rows:
        low, high = r["tokens/s range"]
        row(r["engine"], r["quant"], r["clients"], f"{r['tokens/s']:.1f} ({low:.0f}-{high:.0f})",
            f"{r['time to first token'] * 1000:.1f} ms")


if __name__ == "__main__":
    main()
