"""Convert MiniMind weights to a Hugging Face folder, and back.

    # .pth (or resume checkpoint) -> folder that stock transformers loads as Qwen3 / Qwen3-MoE
    python scripts/convert_model.py --weight_path out/pretrain_64.pth --out_dir hf_out [--format native|minimind]

    # folder (either format) -> .pth (or .safetensors) for `--from_weight`, with its config beside it
    python scripts/convert_model.py --to_pth --hf_dir hf_out --out_path out/pretrain_64.pth

    # .pth -> one GGUF file for llama.cpp / Ollama (qwen3, or qwen3moe), f16 or q8_0
    python scripts/convert_model.py --weight_path out/pretrain_64.pth --format gguf --out_path model.gguf

The model's shape comes from the config beside the weights (out/pretrain_64.json, which
the trainer writes); shape flags (--hidden_size 64 --num_hidden_layers 2 [--use_moe 1])
are needed only for a .pth without one, such as MiniMind's own.

--format native writes a transformers Qwen3 (dense) or Qwen3-MoE config plus model.safetensors
under the same tensor names as ours: `AutoModelForCausalLM.from_pretrained(dir)` needs no
trust_remote_code. Qwen3-MoE routes exactly like our MoE (fp32 softmax over all experts,
top-k, optional renormalisation, no shared expert), so MoE exports natively too.
--format minimind saves our own classes with their source files and an auto_map, for
`from_pretrained(dir, trust_remote_code=True)`. Every export is loaded back and its
logits compared with ours.
--format gguf writes model/gguf_export.py's file, with our tokenizer and chat template inside,
and reads it back tensor by tensor (tests/test_gguf.py runs it in llama.cpp itself).
"""
import math
import os
import shutil
import sys
from contextlib import contextmanager
from pathlib import Path
from typing import NamedTuple

REPO_ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO_ROOT))

import torch
from safetensors.torch import save, save_file
from transformers import AutoModelForCausalLM, GenerationConfig
from transformers.utils import logging as hf_logging

from common.errors import UserError, WeightsError, os_error_of, report_user_errors, storage_error
from common.storage import atomic_torch_save, atomic_write_bytes, atomic_write_text, remove_quietly
from model.model_minimind import MiniMindForCausalLM, register_auto_classes
from model.gguf_export import GGUF_TYPES, GGUFExportError, write_gguf
from model.hf_format import hf_to_state_dict, qwen3_config_from_minimind
from model.shape_flags import SHAPE_FLAGS, config_flags, flag_default, format_flags
from model.weights import build_model, load_model, sidecar_path, sidecar_text
from common.cli import OneLineArgumentParser
from trainer.config import default_weight_path

TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "special_tokens_map.json", "vocab.json",
                   "merges.txt", "added_tokens.json", "chat_template.jinja")
DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}
REMOTE_CODE_FILES = ("model_minimind.py", "moe.py", "generation.py", "loss.py")


class ExportError(RuntimeError):
    """An export that loaded back wrong; str(e) is one line."""


# -----------------------------------------------------------------------------
# exports

def export_native(model, out_dir, tokenizer_path=None, dtype=torch.float32, atol=1e-4):
    """Write a stock transformers Qwen3 / Qwen3-MoE folder; returns its verification."""
    out_dir = Path(out_dir)
    tokenizer_files = find_tokenizer_files(tokenizer_path)  # fail before writing anything
    out_dir.mkdir(parents=True, exist_ok=True)
    config = qwen3_config_from_minimind(model.config, dtype=str(dtype).removeprefix("torch."))
    config.save_pretrained(out_dir)
    # lm_head is tied to the embedding and transformers re-ties it on load, as in Qwen's own files.
    state = {k: v.detach().to(dtype).contiguous() for k, v in model.state_dict().items() if k != "lm_head.weight"}
    save_file(state, out_dir / "model.safetensors", metadata={"format": "pt"})
    _finish_folder(model.config, out_dir, tokenizer_files)
    return verify_export(model, out_dir, dtype, atol, trust_remote_code=False)


def export_minimind(model, out_dir, tokenizer_path=None, dtype=torch.float32, atol=1e-4):
    """Write our own classes + source (auto_map) for trust_remote_code; returns its verification."""
    out_dir = Path(out_dir)
    tokenizer_files = find_tokenizer_files(tokenizer_path)  # fail before writing anything
    rounded = _rounded_copy(model, dtype)
    # save_pretrained copies model_minimind.py and the modules it imports relatively
    # (moe.py, generation.py, loss.py) next to the weights, once the auto classes are registered.
    register_auto_classes()
    rounded.to(dtype).save_pretrained(out_dir)
    missing = [name for name in REMOTE_CODE_FILES if not (out_dir / name).is_file()]
    if missing:
        raise ExportError(f"{out_dir}: save_pretrained did not copy {', '.join(missing)}: remote code would not load")
    _finish_folder(model.config, out_dir, tokenizer_files)
    return verify_export(model, out_dir, dtype, atol, trust_remote_code=True)


def _finish_folder(config, out_dir, tokenizer_files):
    GenerationConfig(
        bos_token_id=config.bos_token_id, eos_token_id=config.eos_token_id, pad_token_id=config.pad_token_id
    ).save_pretrained(out_dir)
    for file in tokenizer_files:
        shutil.copy2(file, Path(out_dir) / file.name)


def find_tokenizer_files(tokenizer_path):
    """The tokenizer's files in `tokenizer_path` (not model/'s source files); [] for None."""
    if tokenizer_path is None:
        return []
    tokenizer_path = Path(tokenizer_path)
    files = [tokenizer_path / name for name in TOKENIZER_FILES if (tokenizer_path / name).is_file()]
    if not files:
        raise WeightsError(f"{tokenizer_path}: no tokenizer files (tokenizer.json, tokenizer_config.json) there: "
                           f"pass --tokenizer_path the tokenizer folder, or --tokenizer_path none to skip it")
    return files


def _rounded_copy(model, dtype):
    # Our model in fp32 holding exactly the weights an export in `dtype` holds, so the
    # comparison measures the code paths, not the rounding of a half/bf16 export.
    copy = MiniMindForCausalLM(model.config)
    copy.load_state_dict({k: v.detach().to(dtype).float() for k, v in model.state_dict().items()})
    return copy.eval()


class Verified(NamedTuple):
    loaded_as: str  # the class AutoModelForCausalLM.from_pretrained built from the folder
    max_logit_diff: float


def verify_export(model, out_dir, dtype=torch.float32, atol=1e-4, trust_remote_code=False):
    """Load `out_dir` with AutoModelForCausalLM in fp32, as a user would, and compare its logits with ours."""
    reference = _rounded_copy(model, dtype)
    loaded = AutoModelForCausalLM.from_pretrained(out_dir, dtype=torch.float32, trust_remote_code=trust_remote_code)
    loaded.eval()
    gen = torch.Generator().manual_seed(0)
    input_ids = torch.randint(0, model.config.vocab_size, (2, 32), generator=gen)
    with torch.no_grad():
        diff = (reference(input_ids).logits - loaded(input_ids).logits).abs().max().item()
    if not diff <= atol:
        raise ExportError(f"{out_dir}: logits of the exported model differ from ours by {diff:.3g} > {atol}")
    return Verified(type(loaded).__name__, diff)


@contextmanager
def export_folder(out_dir, needed: int, flag: str = "--out_dir"):
    """A folder beside `out_dir` to write and verify the export in; its files move into out_dir
    (os.replace, file by file) only once all are there, so out_dir never holds half an export.
    `flag`: the command line's name for where out_dir came from, for the error lines.
    A write the disk refuses removes the folder and becomes one line (safetensors and transformers
    report a full disk in their own words: common/errors.py's os_error_of finds it)."""
    out_dir = Path(out_dir).absolute()  # "." has no name to put the staging folder's beside
    if not out_dir.name:
        raise UserError(f"{flag} {out_dir}: name a folder to export into, not the root of the file system")
    staging = out_dir.with_name(f"{out_dir.name}.export.tmp")
    remove_quietly(staging)
    try:
        staging.mkdir(parents=True)
        yield staging
        out_dir.mkdir(parents=True, exist_ok=True)
        for file in sorted(staging.iterdir()):
            os.replace(file, out_dir / file.name)
        staging.rmdir()
    except Exception as exc:
        remove_quietly(staging)
        cause = None if isinstance(exc, (UserError, ExportError)) else os_error_of(exc)
        if cause is None:
            raise
        raise storage_error(cause, "the Hugging Face export", out_dir, needed, f"pass another {flag}") from None


def save_pth(state, out_path):
    """Our .pth weight format: half-precision state_dict with our names, lm_head.weight included,
    written atomically. An out_path ending in .safetensors gets the same tensors as a safetensors file."""
    out_path = Path(out_path)
    out_path.parent.mkdir(parents=True, exist_ok=True)
    half = {k: v.detach().half().contiguous() for k, v in state.items()}  # separate copies: no shared storage
    if out_path.suffix == ".safetensors":
        atomic_write_bytes(out_path, save(half, metadata={"format": "pt"}))
    else:
        atomic_torch_save(half, out_path)


# -----------------------------------------------------------------------------
# command line

def parse_args(argv=None):
    p = OneLineArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--weight_path", help="weights .pth / .safetensors or resume checkpoint "
                                        "(default: out/pretrain_{hidden}[_moe].pth)")
    p.add_argument("--out_dir", default=str(REPO_ROOT / "hf_out"), help="folder to write (default: hf_out)")
    p.add_argument("--format", choices=("native", "minimind", "gguf"), default="native",
                   help="native: stock transformers Qwen3 / Qwen3-MoE; minimind: our classes via trust_remote_code; "
                        "gguf: one file for llama.cpp / Ollama (--out_path, default OUT_DIR/model.gguf)")
    p.add_argument("--gguf_type", choices=GGUF_TYPES, default=None,
                   help="with --format gguf: f16 (default), or q8_0 (8-bit blocks; norms and the router stay fp32)")
    p.add_argument("--tokenizer_path", default=str(REPO_ROOT / "model"),
                   help="tokenizer folder whose files are copied into the export ('none' to skip)")
    p.add_argument("--dtype", choices=tuple(DTYPES), default="float32", help="dtype of the exported weights")
    p.add_argument("--atol", type=float, default=1e-4, help="largest logit difference the verification accepts")
    for name in SHAPE_FLAGS:
        p.add_argument(f"--{name}", type=int, default=None,
                       help=f"model shape (default {flag_default(name)}; a stored config wins)")
    p.add_argument("--to_pth", action="store_true", help="convert --hf_dir back to a .pth at --out_path")
    p.add_argument("--hf_dir", help="with --to_pth: the folder to convert")
    p.add_argument("--out_path", help="with --to_pth: the .pth to write; with --format gguf: the .gguf to write")
    args = p.parse_args(argv)
    if args.to_pth and not (args.hf_dir and args.out_path):
        p.error("--to_pth needs --hf_dir FOLDER and --out_path FILE.pth")
    if args.to_pth and Path(args.out_path).suffix not in (".pth", ".safetensors"):  # its config goes beside it
        p.error(f"--out_path {args.out_path}: with --to_pth it names the weights file to write, and their config "
                f"goes beside it as .json: pass a path ending in .pth (or .safetensors)")
    if not args.to_pth and args.hf_dir:
        p.error("--hf_dir only goes with --to_pth")
    if args.gguf_type and (args.to_pth or args.format != "gguf"):
        p.error("--gguf_type only goes with --format gguf")
    if not args.to_pth and args.out_path and args.format != "gguf":
        p.error("--out_path only goes with --to_pth or --format gguf")
    if args.use_moe not in (None, 0, 1):
        p.error(f"--use_moe must be 0 or 1, got {args.use_moe}")
    if not (math.isfinite(args.atol) and args.atol >= 0):
        p.error(f"--atol must be a finite number >= 0, got {args.atol}")
    return args


def to_pth(args):
    state, config = hf_to_state_dict(args.hf_dir)
    model = build_model(state, config, args.hf_dir)  # checks every name and shape
    save_pth(model.state_dict(), args.out_path)
    atomic_write_text(sidecar_path(args.out_path), sidecar_text(config))  # so loading it needs no flags
    print(f"wrote {args.out_path} ({len(state)} tensors, fp16) and its config {sidecar_path(args.out_path)}")
    print(f"its model flags: {format_flags(config_flags(config))}")


def export(args):
    flags = {name: getattr(args, name) for name in SHAPE_FLAGS}
    weight_path = args.weight_path or default_weight_path(REPO_ROOT / "out", args.hidden_size, args.use_moe)
    model, source = load_model(weight_path, **flags)
    tokenizer_path = None if args.tokenizer_path.lower() == "none" else args.tokenizer_path
    if args.format == "gguf":
        return export_gguf(args, model, source, tokenizer_path)
    exporter = export_native if args.format == "native" else export_minimind
    needed = sum(p.numel() for p in model.parameters()) * DTYPES[args.dtype].itemsize
    with export_folder(args.out_dir, needed) as folder:
        verified = exporter(model, folder, tokenizer_path, DTYPES[args.dtype], args.atol)
    if args.format == "native":
        kind = "transformers Qwen3-MoE" if model.config.use_moe else "transformers Qwen3"
        remote = ""
    else:
        kind, remote = "minimind (trust_remote_code)", ", trust_remote_code=True"
    print(f"wrote {args.out_dir} from {source} as {kind}, {args.dtype}")
    print(f"verified: AutoModelForCausalLM.from_pretrained({str(args.out_dir)!r}{remote}) -> {verified.loaded_as}, "
          f"max logit diff vs our model = {verified.max_logit_diff:.3g}")


def export_gguf(args, model, source, tokenizer_path):
    out_path = Path(args.out_path or Path(args.out_dir) / "model.gguf")
    if out_path.is_dir():
        raise UserError(f"--out_path {out_path}: is a folder: pass the .gguf file to write")
    gguf_type = args.gguf_type or "f16"
    arch = write_gguf(model, out_path, tokenizer_path, gguf_type)
    print(f"wrote {out_path} from {source} as GGUF {gguf_type}, llama.cpp architecture {arch}")
    print("verified: read back with gguf.GGUFReader, every tensor's name, shape, type and bytes as written")


@report_user_errors
def main(argv=None):
    args = parse_args(argv)
    hf_logging.disable_progress_bar()  # tiny folders; the bars are only noise
    try:
        to_pth(args) if args.to_pth else export(args)
    except OSError as e:  # reading is checked above, so this is --out_dir / --out_path
        raise UserError(f"{e.filename}: cannot write there ({e.strerror}): pass --out_dir / --out_path "
                        f"a place you can write to") from None
    except (ExportError, GGUFExportError) as e:  # a conversion bug, not the user's fault
        print(f"error: {e}", file=sys.stderr)
        sys.exit(1)


if __name__ == "__main__":
    main()
