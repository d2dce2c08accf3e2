"""Hugging Face's formats: .safetensors files, the folders scripts/convert_model.py exports
(stock Qwen3 / Qwen3-MoE, or our own classes with trust_remote_code), and the exact mapping
between MiniMindConfig and transformers' Qwen3Config / Qwen3MoeConfig. Every file here is
untrusted input: safetensors holds tensors only, and configs are parsed as JSON."""
import json
from pathlib import Path

from safetensors.torch import load_file

from common.errors import WeightsError

from .model_minimind import MiniMindConfig
from .shape_flags import shape_problem

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
    model_type = _json_of(config_file, "the model config").get("model_type")
    if model_type not in ("minimind", "qwen3", "qwen3_moe"):
        raise WeightsError(f"{hf_dir}: model_type {model_type!r} is not one of minimind, qwen3, qwen3_moe: "
                           f"cannot convert")
    redo = "re-export the folder with scripts/convert_model.py"
    try:
        if model_type == "minimind":
            config = MiniMindConfig.from_pretrained(hf_dir)
        else:
            from transformers import AutoConfig

            config = minimind_config_from_qwen3(AutoConfig.from_pretrained(hf_dir), hf_dir)
        problem = shape_problem(config.to_dict())
    except WeightsError:
        raise
    except Exception as e:  # whatever else a config the converter did not write holds
        problem = f"{type(e).__name__}: {str(e).splitlines()[0] if str(e) else ''}"
    if problem:
        raise WeightsError(f"{config_file}: not a model config that makes a model ({problem}): {redo}")
    state = split_fused_experts(_read_safetensors(hf_dir))
    state.setdefault("lm_head.weight", state.get("model.embed_tokens.weight"))
    return state, config


def read_json(path, what: str, what_to_do: str):
    """The JSON value in `path`, a file that travels with the weights (as untrusted as they are),
    or one line naming it, `what` it holds and `what_to_do`."""
    try:
        return json.loads(path.read_text(encoding="utf-8"))
    except (OSError, UnicodeDecodeError, ValueError) as e:
        raise WeightsError(f"{path}: {what} is not readable JSON ({type(e).__name__}): {what_to_do}") from None


def _json_of(path, what) -> dict:
    """A JSON object file of an export, or one line saying what is wrong with it."""
    value = read_json(path, what, "re-export the folder with scripts/convert_model.py")
    if not isinstance(value, dict):
        raise WeightsError(f"{path}: {what} is a JSON {type(value).__name__}, not an object: re-export the folder "
                           f"with scripts/convert_model.py")
    return value


def _read_safetensors(hf_dir):
    index = hf_dir / "model.safetensors.index.json"
    if index.is_file():
        weight_map = _json_of(index, "the safetensors index").get("weight_map")
        if not isinstance(weight_map, dict) or not all(isinstance(f, str) and Path(f).name == f
                                                       for f in weight_map.values()):
            raise WeightsError(f"{index}: the safetensors index has no weight_map of file names in the folder: "
                               f"re-export the folder with scripts/convert_model.py")
        files = sorted(set(weight_map.values()))
    elif (hf_dir / "model.safetensors").is_file():
        files = ["model.safetensors"]
    else:
        raise WeightsError(f"{hf_dir}: no model.safetensors there: re-export the folder with scripts/convert_model.py")
    state = {}
    for name in files:
        state.update(read_safetensors_file(hf_dir / name))
    return state


def split_fused_experts(state):
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


def read_safetensors_file(path):
    try:
        return load_file(path)
    except Exception as e:  # safetensors raises its own SafetensorError on a bad header
        raise WeightsError(f"{path}: not a readable .safetensors file ({type(e).__name__}): "
                           f"pass a .safetensors or .pth weights file") from None
