"""Loading MiniMind weights: `.pth` and `.safetensors` weight files, resume checkpoints
and exported HF folders. Every file here is untrusted input: nothing is unpickled
beyond tensors and plain containers.

A weights file may have its model config beside it as JSON, `x.pth` -> `x.json` (the
trainer writes one with every `.pth`), so that it loads without shape flags. The
`.pth` itself stays MiniMind's plain state_dict.

All of it lives here so that scripts/convert_model.py, scripts/eval_llm.py and the
tests accept the same files and reject bad ones with the same one-line messages.
The Qwen3 <-> MiniMind config mapping is here too, next to the checks that make
it exact.
"""
import json
import pickle
import re
from pathlib import Path

import torch
from safetensors.torch import load_file

from common.errors import UserError

from .model_minimind import MiniMindConfig, MiniMindForCausalLM

# The config fields the scripts expose as --flags; everything else comes from the defaults.
SHAPE_FLAGS = ("hidden_size", "num_hidden_layers", "num_attention_heads", "num_key_value_heads", "use_moe")
# The default model of every script, trainer/args.py included: hidden 512 x 8 layers
# (MiniMindConfig's own default hidden size is 768). One table, so that a default
# training run and default script runs find each other's files.
FLAG_DEFAULTS = {"hidden_size": 512, "num_hidden_layers": 8}


class WeightsError(UserError, ValueError):
    """Bad weights, folder or flags. str(e) is one line that names the culprit and says what to do."""


def flag_default(name):
    """What a shape flag means when it is not given and no stored config decides."""
    return int(FLAG_DEFAULTS.get(name, getattr(MiniMindConfig(), name)))


def run_prefix(save_weight, hidden_size, use_moe):
    """The name of a run's files: `{save_weight}_{hidden}[_moe]` + .pth, .json, _metrics.jsonl, _resume..."""
    return f"{save_weight}_{hidden_size}{'_moe' if use_moe else ''}"


def default_weight_path(save_dir, hidden_size=None, use_moe=None, save_weight="pretrain"):
    """The trainer's weights for these flags: {save_dir}/{run_prefix}.pth."""
    return Path(save_dir) / f"{run_prefix(save_weight, hidden_size or FLAG_DEFAULTS['hidden_size'], use_moe)}.pth"


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
        return _strip_wrapper_prefixes(_split_fused_experts(_read_safetensors_file(path))), read_sidecar(path)
    try:
        obj = torch.load(path, map_location="cpu", weights_only=True)
    except pickle.UnpicklingError as e:
        found = re.search(r"GLOBAL ([\w.]+)", str(e))
        raise WeightsError(f"{path}: refused: it holds Python objects other than tensors and plain containers "
                           f"({found[1] if found else 'an unsupported pickle opcode'}), and unpickling them could "
                           f"run code: pass weights saved as a state_dict of tensors, or a .safetensors file") from None
    except Exception as e:
        raise WeightsError(f"{path}: cannot be read by torch.load ({type(e).__name__}): "
                           f"pass a .pth written by the trainer") from None
    if is_resume_checkpoint(obj):
        state, stored = obj["model"], obj["model_config"]
    elif isinstance(obj, dict) and obj and all(torch.is_tensor(v) for v in obj.values()):
        state, stored = obj, read_sidecar(path)
    else:
        raise WeightsError(f"{path}: neither a weights file (name -> tensor) nor a resume checkpoint "
                           f"(dict with 'model' and 'model_config'): pass a .pth written by the trainer")
    return _strip_wrapper_prefixes(state), stored


def sidecar_path(weight_path):
    """Where the model config of a weights file lives: `x.pth` -> `x.json`."""
    return Path(weight_path).with_suffix(".json")


def sidecar_text(config):
    """What the trainer writes to sidecar_path: the whole config, as JSON."""
    return json.dumps(config.to_dict(), indent=2, sort_keys=True) + "\n"


def read_sidecar(weight_path):
    """The MiniMindConfig stored beside a weights file, or None when there is none.
    JSON only, and checked: the sidecar is as untrusted as the weights."""
    path = sidecar_path(weight_path)
    if not path.is_file():
        return None
    what_to_do = f"rewrite or delete it (without it, shape flags describe the weights in {Path(weight_path).name})"
    try:
        stored = json.loads(path.read_text(encoding="utf-8"))
    except (OSError, UnicodeDecodeError, ValueError) as e:
        raise WeightsError(f"{path}: the model config beside the weights is not readable JSON "
                           f"({type(e).__name__}): {what_to_do}") from None
    problem = _sidecar_problem(stored)
    if problem is None:
        try:
            return MiniMindConfig.from_dict(stored)
        except Exception as e:  # the config's own checks, e.g. heads that do not divide hidden_size
            problem = f"{type(e).__name__}: {str(e).splitlines()[0] if str(e) else ''}"
    raise WeightsError(f"{path}: not a MiniMind model config ({problem}): {what_to_do}")


def _sidecar_problem(stored):
    if not isinstance(stored, dict):
        return f"a JSON {type(stored).__name__}, not an object"
    if stored.get("model_type", MiniMindConfig.model_type) != MiniMindConfig.model_type:
        return f"model_type {stored['model_type']!r}"
    for name in ("hidden_size", "num_hidden_layers", "num_attention_heads", "num_key_value_heads", "vocab_size"):
        value = stored.get(name, 1)  # absent: the config's default
        if isinstance(value, bool) or not isinstance(value, int) or value < 1:
            return f"{name} is {value!r}, not a positive integer"
    if not isinstance(stored.get("use_moe", False), bool):
        return f"use_moe is {stored['use_moe']!r}, not true or false"
    return None


def _read_safetensors_file(path):
    try:
        return load_file(path)
    except Exception as e:  # safetensors raises its own SafetensorError on a bad header
        raise WeightsError(f"{path}: not a readable .safetensors file ({type(e).__name__}): "
                           f"pass a .safetensors or .pth weights file") from None


def load_weights(path):
    """The model state_dict stored in a weights file or a resume checkpoint."""
    return read_checkpoint(path)[0]


def _strip_wrapper_prefixes(state):
    # DDP ("module.") and torch.compile ("_orig_mod.") prefix every name when a
    # wrapped model is saved as is; the weights underneath are the same.
    clean = {}
    for name, tensor in state.items():
        for prefix in ("module.", "_orig_mod."):
            name = name.removeprefix(prefix)
        clean[name] = tensor
    return clean


def resolve_config(stored, flags, source):
    """The MiniMindConfig to build: a stored config wins, and flags passed explicitly
    (not None) must agree with it; without a stored config the flags decide."""
    flags = {k: v for k, v in flags.items() if v is not None}
    if stored is None:
        return MiniMindConfig(**{**FLAG_DEFAULTS, **flags})
    config = stored if isinstance(stored, MiniMindConfig) else MiniMindConfig.from_dict(dict(stored))
    for name, value in flags.items():
        have = getattr(config, name)
        if (bool(value) != have) if name == "use_moe" else (value != have):
            have = int(have) if name == "use_moe" else have
            raise WeightsError(f"{source}: the model was trained with --{name} {have} but --{name} {value} "
                               f"was passed: drop the flag or pass --{name} {have}")
    return config


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


def guess_flags(state):
    """The shape flags a state_dict was trained with, read off its tensor shapes (None if unsure)."""
    try:
        head_dim = state["model.layers.0.self_attn.q_norm.weight"].shape[0]
        return {
            "hidden_size": state["model.embed_tokens.weight"].shape[1],
            "num_hidden_layers": 1 + max(int(n.split(".")[2]) for n in state if n.startswith("model.layers.")),
            "num_attention_heads": state["model.layers.0.self_attn.q_proj.weight"].shape[0] // head_dim,
            "num_key_value_heads": state["model.layers.0.self_attn.k_proj.weight"].shape[0] // head_dim,
            "use_moe": int(any(".mlp.experts." in n for n in state)),
        }
    except (KeyError, ValueError, IndexError, AttributeError):
        return None


def format_flags(flags):
    return " ".join(f"--{k} {int(v) if isinstance(v, bool) else v}" for k, v in flags.items())


def config_flags(config):
    return {name: (int(config.use_moe) if name == "use_moe" else getattr(config, name)) for name in SHAPE_FLAGS}


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


# -----------------------------------------------------------------------------
# Hugging Face folders (both formats written by scripts/convert_model.py)

# Config fields that mean the same in MiniMindConfig and in transformers' Qwen3Config
# (dense) or Qwen3MoeConfig (MoE), under the same name: copied as they are both ways.
# The rest (rope_theta, use_moe, norm_topk_prob, eos as a list, the features we lack)
# is mapped by hand in the two functions below.
QWEN3_SAME_FIELDS = ("vocab_size", "hidden_size", "intermediate_size", "num_hidden_layers", "num_attention_heads",
                     "num_key_value_heads", "head_dim", "max_position_embeddings", "rms_norm_eps",
                     "bos_token_id", "eos_token_id", "pad_token_id")
QWEN3_MOE_SAME_FIELDS = ("num_experts", "num_experts_per_tok", "moe_intermediate_size", "router_aux_loss_coef")


def qwen3_config_from_minimind(config, dtype="float32"):
    """The transformers Qwen3Config / Qwen3MoeConfig that computes exactly what our model does."""
    from transformers import Qwen3Config, Qwen3MoeConfig

    common = dict(
        {name: getattr(config, name) for name in QWEN3_SAME_FIELDS},
        hidden_act="silu",  # our MLPs always use SiLU
        rope_parameters={"rope_type": "default", "rope_theta": float(config.rope_theta)},
        tie_word_embeddings=True,
        attention_bias=False,
        use_sliding_window=False,
        dtype=dtype,
    )
    if not config.use_moe:
        return Qwen3Config(**common, architectures=["Qwen3ForCausalLM"])
    return Qwen3MoeConfig(
        **common,
        **{name: getattr(config, name) for name in QWEN3_MOE_SAME_FIELDS},
        architectures=["Qwen3MoeForCausalLM"],
        # Ours renormalises only when top_k > 1; Qwen3-MoE whenever asked, which
        # for top_k == 1 would turn the routing weight into 1.0.
        norm_topk_prob=bool(config.norm_topk_prob and config.num_experts_per_tok > 1),
        decoder_sparse_step=1,  # every layer is MoE, like ours
        mlp_only_layers=[],
    )


def minimind_config_from_qwen3(hf, source):
    """The inverse of qwen3_config_from_minimind; refuses Qwen3 features we do not implement."""
    moe = hf.model_type == "qwen3_moe"
    rope = hf.rope_parameters or {}
    unsupported = {
        "rope_type other than default": rope.get("rope_type", "default") != "default",
        "sliding window attention": bool(getattr(hf, "use_sliding_window", False)),
        "attention bias": bool(getattr(hf, "attention_bias", False)),
        "untied lm_head": not hf.tie_word_embeddings,
        f"hidden_act {hf.hidden_act}": hf.hidden_act != "silu",
        "dense layers between MoE layers": moe and (hf.decoder_sparse_step != 1 or bool(hf.mlp_only_layers)),
        "norm_topk_prob with one expert per token": moe and hf.num_experts_per_tok == 1 and hf.norm_topk_prob,
    }
    for feature, present in unsupported.items():
        if present:
            raise WeightsError(f"{source}: uses {feature}, which MiniMind does not implement: cannot convert")
    kwargs = {name: getattr(hf, name) for name in QWEN3_SAME_FIELDS}
    if isinstance(hf.eos_token_id, list):
        kwargs["eos_token_id"] = hf.eos_token_id[0]
    kwargs.update(rope_theta=rope["rope_theta"], use_moe=moe)
    if moe:
        kwargs.update({name: getattr(hf, name) for name in QWEN3_MOE_SAME_FIELDS})
        # For top_k == 1 both settings mean the same to our router; keep our default.
        kwargs["norm_topk_prob"] = hf.norm_topk_prob or hf.num_experts_per_tok == 1
    return MiniMindConfig(**kwargs)


def hf_to_state_dict(hf_dir):
    """(state_dict with our names incl. lm_head.weight, MiniMindConfig) of an HF folder
    in either exported format: native Qwen3 / Qwen3-MoE, or minimind (remote code)."""
    hf_dir = Path(hf_dir)
    config_file = hf_dir / "config.json"
    if not config_file.is_file():
        raise WeightsError(f"{hf_dir}: no config.json there: "
                           f"pass --hf_dir a folder written by scripts/convert_model.py")
    model_type = json.loads(config_file.read_text()).get("model_type")
    if model_type == "minimind":
        config = MiniMindConfig.from_pretrained(hf_dir)
    elif model_type in ("qwen3", "qwen3_moe"):
        from transformers import AutoConfig

        config = minimind_config_from_qwen3(AutoConfig.from_pretrained(hf_dir), hf_dir)
    else:
        raise WeightsError(f"{hf_dir}: model_type {model_type!r} is not one of minimind, qwen3, qwen3_moe: "
                           f"cannot convert")
    state = _split_fused_experts(_read_safetensors(hf_dir))
    state.setdefault("lm_head.weight", state.get("model.embed_tokens.weight"))
    return state, config


def _read_safetensors(hf_dir):
    index = hf_dir / "model.safetensors.index.json"
    if index.is_file():
        files = sorted(set(json.loads(index.read_text())["weight_map"].values()))
    elif (hf_dir / "model.safetensors").is_file():
        files = ["model.safetensors"]
    else:
        raise WeightsError(f"{hf_dir}: no model.safetensors there: re-export the folder with scripts/convert_model.py")
    state = {}
    for name in files:
        state.update(_read_safetensors_file(hf_dir / name))
    return state


def _split_fused_experts(state):
    # In memory, transformers 5 keeps Qwen3-MoE experts fused as (experts, 2*inter, hidden)
    # gate_up_proj and (experts, hidden, inter) down_proj. save_pretrained writes them back
    # per expert (our names), but a folder saved from raw tensors may hold the fused form.
    out = {}
    for name, tensor in state.items():
        if name.endswith("mlp.experts.gate_up_proj"):
            prefix = name.removesuffix("gate_up_proj")
            for e, (gate, up) in enumerate(t.chunk(2, dim=0) for t in tensor):
                out[f"{prefix}{e}.gate_proj.weight"] = gate
                out[f"{prefix}{e}.up_proj.weight"] = up
        elif name.endswith("mlp.experts.down_proj"):
            prefix = name.removesuffix("down_proj")
            for e, down in enumerate(tensor):
                out[f"{prefix}{e}.down_proj.weight"] = down
        else:
            out[name] = tensor
    return out
