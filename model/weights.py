"""Loading MiniMind weights: `.pth` and `.safetensors` weight files, resume checkpoints
and exported HF folders, into a model. Every file here is untrusted input: nothing is
unpickled beyond tensors and plain containers.

A weights file may have its model config beside it as JSON, `x.pth` -> `x.json` (the
trainer writes one with every `.pth`), so that it loads without shape flags. The
`.pth` itself stays MiniMind's plain state_dict.

All of it lives here so that scripts/convert_model.py, scripts/eval_llm.py and the
tests accept the same files and reject bad ones with the same one-line messages.
"""
import json
import os
import pickle
import re
from pathlib import Path

import torch

from common.errors import WeightsError
from common.storage import atomic_torch_save, atomic_write_text

from .hf_format import hf_to_state_dict, read_json, read_safetensors_file, split_fused_experts
from .model_minimind import MiniMindConfig, MiniMindForCausalLM
from .shape_flags import format_flags, guess_flags, resolve_config, shape_problem

# -----------------------------------------------------------------------------
# .pth weights and resume checkpoints

def is_resume_checkpoint(obj):
    return isinstance(obj, dict) and "model" in obj and "model_config" in obj


def read_checkpoint(path):
    """(state_dict, stored model_config dict or None) from a weights file (.pth or
    .safetensors) or a resume checkpoint.

    The file is untrusted: a .pth is unpickled with weights_only=True only, which
    rebuilds tensors and plain containers and nothing else, so a crafted file cannot
    run code here. Everything the trainer writes loads that way.
    """
    path = Path(path)
    if path.is_dir():
        raise WeightsError(f"{path}: is a folder (a sharded .dcp checkpoint?): pass --weight_path the .pth "
                           f"weights the trainer writes to --save_dir")
    if not path.is_file():
        raise WeightsError(f"{path}: not found: pass a .pth or .safetensors weights file written by the trainer "
                           f"or by scripts/convert_model.py")
    if path.suffix == ".safetensors":
        return _strip_wrapper_prefixes(split_fused_experts(read_safetensors_file(path))), read_sidecar(path)
    try:
        obj = torch.load(path, map_location="cpu", weights_only=True)
    except pickle.UnpicklingError as e:
        if not _looks_like_torch_save(path):
            raise WeightsError(f"{path}: not a weights file (torch.save writes a zip archive or a pickle, and this "
                               f"is neither): pass a .pth or .safetensors weights file") from None
        found = re.search(r"GLOBAL ([\w.]+)", str(e))
        raise WeightsError(f"{path}: refused: it holds Python objects other than tensors and plain containers "
                           f"({found[1] if found else 'an unsupported pickle opcode'}), and unpickling them could "
                           f"run code: pass weights saved as a state_dict of tensors, or a .safetensors file") from None
    except Exception as e:
        raise WeightsError(f"{path}: cannot be read by torch.load ({type(e).__name__}): "
                           f"pass a .pth written by the trainer") from None
    if is_resume_checkpoint(obj) and _is_state_dict(obj["model"]):
        state, stored = obj["model"], obj["model_config"]
    elif _is_state_dict(obj):
        state, stored = obj, read_sidecar(path)
    else:
        raise WeightsError(f"{path}: neither a weights file (name -> tensor) nor a resume checkpoint "
                           f"(dict with 'model' and 'model_config'): pass a .pth written by the trainer")
    return _strip_wrapper_prefixes(state), stored


def _looks_like_torch_save(path: Path) -> bool:
    """What torch.save writes begins as a zip archive does, or (the legacy format) with pickle's PROTO."""
    with open(path, "rb") as f:
        head = f.read(4)
    return head == b"PK\x03\x04" or head[:1] == b"\x80"


def _is_state_dict(obj) -> bool:
    return isinstance(obj, dict) and bool(obj) and all(isinstance(k, str) and torch.is_tensor(v) for k, v in obj.items())


def sidecar_path(weight_path):
    """Where the model config of a weights file lives: `x.pth` -> `x.json`."""
    return Path(weight_path).with_suffix(".json")


def sidecar_text(config):
    """What the trainer writes to sidecar_path: the whole config, as JSON."""
    return json.dumps(config.to_dict(), indent=2, sort_keys=True) + "\n"


def write_weights(weights: dict, config, path, elsewhere: str = "write elsewhere", then: str = ""):
    """MiniMind's inference format: a half-precision state_dict at `path` (x.pth), written
    atomically, with the model config beside it (x.json), so that the scripts need no shape
    flags. A failed write is one line (common/storage.py): `elsewhere` and `then` say what to do."""
    os.makedirs(os.path.dirname(os.path.abspath(path)), exist_ok=True)
    atomic_torch_save({k: v.half() for k, v in weights.items()}, path, "the weights", elsewhere, then)
    atomic_write_text(sidecar_path(path), sidecar_text(config), "the weights' config", elsewhere=elsewhere,
                      then=then)


def read_sidecar(weight_path):
    """The MiniMindConfig stored beside a weights file, or None when there is none.
    JSON only, and checked: the sidecar is as untrusted as the weights."""
    path = sidecar_path(weight_path)
    if not path.is_file():
        return None
    what_to_do = f"rewrite or delete it (without it, shape flags describe the weights in {Path(weight_path).name})"
    stored = read_json(path, "the model config beside the weights", what_to_do)
    problem = _sidecar_problem(stored)
    if problem is None:
        try:
            return MiniMindConfig.from_dict(stored)
        except Exception as e:  # what else transformers' PretrainedConfig refuses
            problem = f"{type(e).__name__}: {str(e).splitlines()[0] if str(e) else ''}"
    raise WeightsError(f"{path}: not a MiniMind model config ({problem}): {what_to_do}")


def _sidecar_problem(stored):
    if not isinstance(stored, dict):
        return f"a JSON {type(stored).__name__}, not an object"
    if stored.get("model_type", MiniMindConfig.model_type) != MiniMindConfig.model_type:
        return f"model_type {stored['model_type']!r}"
    if not isinstance(stored.get("use_moe", False), bool):
        return f"use_moe is {stored['use_moe']!r}, not true or false"
    return shape_problem(stored)


def load_weights(path):
    """The model state_dict stored in a weights file or a resume checkpoint."""
    return read_checkpoint(path)[0]


def _strip_wrapper_prefixes(state):
    # DDP ("module.") and torch.compile ("_orig_mod.") prefix every name when a
    # wrapped model is saved as is; the weights underneath are the same. Both may be there, in
    # either order: a compiled DDP model and a DDP-wrapped compiled one.
    clean = {}
    for name, tensor in state.items():
        while name.startswith(("module.", "_orig_mod.")):
            name = name.partition(".")[2]
        clean[name] = tensor
    return clean


def build_model(state, config, source):
    """A MiniMindForCausalLM in fp32 eval mode holding `state`, or a one-line error
    when the tensors do not fit the config (usually: wrong --flags)."""
    model = MiniMindForCausalLM(config)
    state = dict(state)
    if config.tie_word_embeddings and "model.embed_tokens.weight" in state:
        state.setdefault("lm_head.weight", state["model.embed_tokens.weight"])
    expected = model.state_dict()
    problem = _first_mismatch(state, expected)
    if problem:
        guess = guess_flags(state)
        hint = f"the weights look like {format_flags(guess)}" if guess else "check the file and the flags"
        raise WeightsError(f"{source}: weights do not fit the model flags ({problem}): {hint}")
    model.load_state_dict(state)  # copies, casting half weights to the fp32 parameters
    return model.eval()


def _first_mismatch(state, expected):
    for name, tensor in expected.items():
        if name not in state:
            return f"{name} missing from the file"
        if state[name].shape != tensor.shape:
            return f"{name} is {list(state[name].shape)} in the file, {list(tensor.shape)} for these flags"
    extra = [name for name in state if name not in expected]
    return f"unexpected tensor {extra[0]}" if extra else None


def load_model(weight_path=None, hf_dir=None, **flags):
    """(model, source) from a .pth / resume checkpoint, or from an exported HF folder.

    `flags` are the SHAPE_FLAGS; None means "not given". A stored config (resume
    checkpoint, HF folder, the JSON beside a weights file) wins and given flags must agree with it.
    """
    if hf_dir is not None:
        state, stored = hf_to_state_dict(hf_dir)
        source = str(hf_dir)
    else:
        state, stored = read_checkpoint(weight_path)
        source = str(weight_path)
    config = resolve_config(stored, flags, source)
    return build_model(state, config, source), source


