"""Serve a trained MiniMind behind an OpenAI-compatible HTTP API (transformers' `serve` engine).

    python scripts/serve_openai_api.py --weight_path out/quickstart/sft/quickstart_sft_128.pth
    # then any OpenAI client: base_url http://127.0.0.1:8998/v1, model: what /v1/models lists

--weight_path takes what training leaves: a .pth / .safetensors (the config beside it, or shape
flags, as for MiniMind's own), a resume checkpoint, or a folder convert_model.py wrote. It is
exported once to a stock Qwen3 folder with convert_model.py's own export and check (logits
against our model), under --cache_dir/<sha256 of the weights>, so the next start with the same
weights loads the export directly. The server then holds that model in memory and answers
/v1/chat/completions (streaming or not), /v1/completions, /v1/responses, /v1/models, /health.

Thinking: a request turns it on with "chat_template_kwargs": {"open_thinking": true} (Qwen3's
"enable_thinking" is read as the same switch); --thinking 1 makes it the default. The reasoning
comes back apart from the answer, as "reasoning_content".

The engine is transformers' own (`transformers serve`); scripts/serve_guard.py answers the bad
requests it would fail on (a 500, a hang) with a 4xx and one line.
"""
import hashlib
import json
import os
import re
import socket
import sys
from pathlib import Path

REPO_ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO_ROOT))

from common.cli import OneLineArgumentParser
from common.errors import UserError, WeightsError, report_user_errors
from common.storage import atomic_write_text
from model.shape_flags import SHAPE_FLAGS, flag_default

SERVE_REQUIREMENTS = "pip install -r requirements-serve.txt"
EXPORT_RECORD = "serve_export.json"  # written last into a cached export: its files are complete
DTYPES = ("auto", "float32", "bfloat16", "float16")
# How a reply of our chat template splits into reasoning and answer (transformers' response-template
# format). The engine's Qwen3 default strips whitespace from a whole reply but not from a streamed
# one, so the two differ; it reads the empty <think> block of a non-thinking prompt as "\n\n" of
# reasoning, and a "<think>" a small model writes mid-answer as the start of reasoning. This keeps
# the text as generated: reasoning is only the block the prompt opens (\A: the assistant turn's
# start), the answer every character after its "</think>" (the whole reply when thinking is off).
RESPONSE_TEMPLATE = {
    "defaults": {"role": "assistant"},
    "start_anchor": "<|im_start|>assistant\n",
    "fields": {
        "reasoning_content": {"open_pattern": r"\A<think>\n?", "close_pattern": r"\n?</think>\n{0,2}",
                              "content": "text", "content_args": {"strip": False}},
        "content": {"close": "<|im_end|>", "content": "text", "content_args": {"strip": False}},
    },
}


# -----------------------------------------------------------------------------
# weights -> a verified, cached export

def weights_digest(weight_path: Path, tokenizer_path: Path | None, flags: dict) -> str:
    """sha256 over everything the export is made of: the weights (every file of a folder), the
    config beside a .pth, the tokenizer's files and the shape flags given."""
    from model.weights import sidecar_path
    from scripts.convert_model import find_tokenizer_files

    files = sorted(p for p in weight_path.rglob("*") if p.is_file()) if weight_path.is_dir() else [weight_path]
    if weight_path.is_file() and sidecar_path(weight_path).is_file():
        files.append(sidecar_path(weight_path))
    files += find_tokenizer_files(tokenizer_path)
    digest = hashlib.sha256(json.dumps(flags, sort_keys=True).encode())
    for file in files:
        digest.update(file.name.encode() + b"\0")
        with open(file, "rb") as f:
            for block in iter(lambda: f.read(1 << 20), b""):
                digest.update(block)
    return digest.hexdigest()


def is_complete(folder: Path) -> bool:
    record = folder / EXPORT_RECORD
    if not record.is_file():
        return False
    try:
        files = json.loads(record.read_text())["files"]
    except (ValueError, KeyError):
        return False
    return all((folder / name).is_file() for name in files)


def cached_export(weight_path, cache_dir, tokenizer_path=None, flags=None) -> tuple[Path, bool]:
    """(the export folder for these weights, whether it was made now). The model is loaded and
    exported only when the cache holds no complete export of the same content."""
    from model.weights import load_model
    from scripts.convert_model import DTYPES as EXPORT_DTYPES, export_folder, export_native

    weight_path = Path(weight_path)
    if not weight_path.exists():
        raise WeightsError(f"--weight_path {weight_path}: no such file or folder: pass the .pth your training "
                           f"wrote (--save_dir), a resume checkpoint or an exported folder")
    flags = {name: value for name, value in (flags or {}).items() if value is not None}
    if weight_path.is_dir() and tokenizer_path is not None and (weight_path / "tokenizer.json").is_file():
        tokenizer_path = weight_path  # an export carries its own tokenizer
    folder = Path(cache_dir) / weights_digest(weight_path, tokenizer_path, flags)[:32]
    if is_complete(folder):
        return folder, False
    if weight_path.is_dir():
        model, source = load_model(hf_dir=weight_path, **flags)
    else:
        model, source = load_model(weight_path, **flags)
    model = model.float().eval()
    needed = sum(p.numel() for p in model.parameters()) * EXPORT_DTYPES["float32"].itemsize
    with export_folder(folder, needed, "--cache_dir") as staging:
        verified = export_native(model, staging, tokenizer_path)
        files = sorted(p.name for p in staging.iterdir())
        record = dict(source=os.path.abspath(source), loaded_as=verified.loaded_as,
                      max_logit_diff=verified.max_logit_diff, files=files)
        # export_folder moves the files in one by one, the record maybe before the rest: is_complete checks its list
        atomic_write_text(staging / EXPORT_RECORD, json.dumps(record, indent=1) + "\n", "the export's record")
    return folder, True


# -----------------------------------------------------------------------------
# the server

def check_serving_installed():
    missing = []
    for module in ("fastapi", "uvicorn", "openai", "pydantic", "accelerate"):  # accelerate: device_map
        try:
            __import__(module)
        except ImportError:
            missing.append(module)
    if missing:
        raise UserError(f"serving needs {', '.join(missing)}, which are not installed: {SERVE_REQUIREMENTS}")


def check_port_free(host: str, port: int):
    """Bind the port once before loading anything, so a port in use is one line at start."""
    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    with socket.socket(family, socket.SOCK_STREAM) as probe:
        probe.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        try:
            probe.bind((host, port))
        except OSError as e:
            raise UserError(f"--host {host} --port {port}: cannot listen there ({e.strerror}): "
                            f"stop what uses it or pass another --port") from None


def batching_config(gib, weight):
    """Continuous batching's memory budget: `gib` GiB for its KV cache and buffers (None: on a GPU
    the engine's own sizing, by free memory). The engine reads a CPU's free memory as the whole
    machine's RAM, and its attention masks grow as batch tokens x cache tokens: left alone it took
    14 GiB for a 2-layer model here, so a CPU server gets 1 GiB and batches of 1024 tokens
    (a longer prompt is prefilled in several) unless told otherwise."""
    from transformers import ContinuousBatchingConfig

    on_cpu = weight.device.type == "cpu"
    if gib is None and not on_cpu:
        return None
    if on_cpu:
        total = os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
    else:
        import torch

        total = torch.cuda.mem_get_info(weight.device)[0]
    share = min(0.9, (gib or 1.0) * (1 << 30) / total)
    return ContinuousBatchingConfig(max_memory_percent=share, max_batch_tokens=1024 if on_cpu else None)


def build_app(export_dir: Path, args):
    """transformers' serve app with the model preloaded, wrapped in our request guard."""
    from transformers.cli.serving.chat_completion import ChatCompletionHandler
    from transformers.cli.serving.completion import CompletionHandler
    from transformers.cli.serving.model_manager import ModelManager
    from transformers.cli.serving.response import ResponseHandler
    from transformers.cli.serving.server import build_server
    from transformers.cli.serving.systemone import SystemOneHandler
    from transformers.cli.serving.transcription import TranscriptionHandler
    from transformers.cli.serving.utils import GenerationState

    from scripts.serve_guard import guard

    model_id = str(export_dir)
    manager = ModelManager(device=args.device, dtype=args.dtype, continuous_batching=bool(args.continuous_batching),
                           force_model=model_id)  # loads it now
    model, tokenizer = manager.load_model_and_processor(model_id)  # the loaded pair, from the manager's cache
    tokenizer.response_template = RESPONSE_TEMPLATE
    state = GenerationState(continuous_batching=bool(args.continuous_batching),
                            cb_config=batching_config(args.kv_cache_gib, next(model.parameters())))
    template_kwargs = {"open_thinking": bool(args.thinking)}
    app = build_server(
        manager,
        ChatCompletionHandler(model_manager=manager, generation_state=state, chat_template_kwargs=template_kwargs),
        completion_handler=CompletionHandler(model_manager=manager, generation_state=state),
        response_handler=ResponseHandler(model_manager=manager, generation_state=state,
                                         chat_template_kwargs=template_kwargs),
        transcription_handler=TranscriptionHandler(manager, state),
        systemone_handler=SystemOneHandler(model_manager=manager, generation_state=state,
                                           chat_template_kwargs=template_kwargs),
        generation_state=state,
    )
    context = min(args.max_model_len or model.config.max_position_embeddings, model.config.max_position_embeddings)
    return guard(app, model_id, context, tokenizer, template_kwargs), state


def parse_args(argv=None):
    p = OneLineArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--weight_path", required=True,
                   help="a .pth / .safetensors from --save_dir (ours or MiniMind's), a resume checkpoint, "
                        "or a folder convert_model.py wrote")
    p.add_argument("--tokenizer_path", default=str(REPO_ROOT / "model"),
                   help="tokenizer folder for a .pth (default: model/; an exported folder brings its own)")
    p.add_argument("--cache_dir", default=str(REPO_ROOT / "out" / "serve_cache"),
                   help="where exports are kept, by the weights' content hash (default: out/serve_cache)")
    p.add_argument("--host", default="127.0.0.1", help="address to listen on (default 127.0.0.1: this machine only)")
    p.add_argument("--port", type=int, default=8998, help="port to listen on (default 8998)")
    p.add_argument("--device", default="auto", help="auto, cpu, cuda or cuda:N (default auto: a GPU if there is one)")
    p.add_argument("--dtype", choices=DTYPES, default="auto",
                   help="weights' dtype in memory (auto: the export's, float32)")
    p.add_argument("--continuous_batching", type=int, choices=(0, 1), default=1,
                   help="1: requests share the model's forward passes (paged KV cache); 0: one generate() at a time")
    p.add_argument("--kv_cache_gib", type=float, default=None,
                   help="memory for continuous batching's KV cache and buffers, in GiB (default: 1 on a CPU; "
                        "on a GPU the engine's sizing by free memory)")
    p.add_argument("--max_model_len", type=int, default=None,
                   help="longest prompt + reply a request may ask for, in tokens (default: the model's "
                        "max_position_embeddings); longer ones get a 400")
    p.add_argument("--thinking", type=int, choices=(0, 1), default=0,
                   help="default of the thinking switch; a request's chat_template_kwargs open_thinking wins")
    for name in SHAPE_FLAGS:
        p.add_argument(f"--{name}", type=int, default=None,
                       help=f"model shape for a .pth without its config (default {flag_default(name)})")
    args = p.parse_args(argv)
    if not re.fullmatch(r"auto|cpu|mps|cuda(:\d+)?", args.device):
        p.error(f"--device must be auto, cpu, cuda, cuda:N or mps, got {args.device!r}")
    if args.kv_cache_gib is not None and not args.kv_cache_gib > 0:
        p.error(f"--kv_cache_gib must be a number above 0, got {args.kv_cache_gib}")
    if args.max_model_len is not None and args.max_model_len < 2:
        p.error(f"--max_model_len must be at least 2, got {args.max_model_len}")
    if not 0 < args.port < 65536:
        p.error(f"--port must be 1..65535, got {args.port}")
    return args


@report_user_errors
def main(argv=None):
    args = parse_args(argv)
    check_serving_installed()
    check_port_free(args.host, args.port)
    if args.device.startswith("cuda"):  # the trainer's check: a GPU there, and GPU N among them
        from trainer.device import resolve_device

        resolve_device(args.device, environ={})
    if args.device == "mps":
        import torch

        if not torch.backends.mps.is_available():
            raise UserError("--device mps: no Apple GPU (MPS) is visible to torch here: pass --device cpu")
    from transformers.utils import logging as hf_logging

    hf_logging.disable_progress_bar()
    flags = {name: getattr(args, name) for name in SHAPE_FLAGS}
    tokenizer_path = None if args.tokenizer_path.lower() == "none" else Path(args.tokenizer_path)
    export_dir, made = cached_export(args.weight_path, args.cache_dir, tokenizer_path, flags)
    record = json.loads((export_dir / EXPORT_RECORD).read_text())
    print(f"{'exported' if made else 'cached export'} {export_dir} ({record['loaded_as']}, "
          f"max logit diff vs our model {record['max_logit_diff']:.3g})", flush=True)
    app, state = build_app(export_dir, args)
    import uvicorn

    print(f"serving model {export_dir} at http://{args.host}:{args.port}/v1 "
          f"(continuous batching {'on' if args.continuous_batching else 'off'})", flush=True)
    try:
        uvicorn.run(app, host=args.host, port=args.port, log_level="warning")
    finally:
        state.shutdown()


if __name__ == "__main__":
    main()
