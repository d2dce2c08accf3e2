"""The model-shape flags every script shares (--hidden_size, --num_hidden_layers, ...), what
they mean when not given, and how given flags meet a config stored beside the weights: the
stored config wins, and a given flag must agree with it."""
from common.errors import WeightsError

from .model_minimind import SHAPE_FIELDS, MiniMindConfig

# The shape fields the scripts take as --flags, for weights without a config beside them
# (MiniMind's own .pth): all but the two that such weights never change, the MLP width (derived
# from the hidden size) and the vocabulary (MiniMind's tokenizer's 6400).
SHAPE_FLAGS = tuple(name for name in SHAPE_FIELDS if name not in ("intermediate_size", "vocab_size"))


def flag_default(name):
    """What a shape flag means when it is not given and no stored config decides: MiniMindConfig's
    default, the one owner of the default model (MiniMind's 768 x 8, 64M parameters) for the
    trainer and every script, so that their default runs find each other's files."""
    return int(getattr(MiniMindConfig(), name))


# Sizes a model cannot be built without, each a positive integer; the None-able ones may be absent
# (MiniMindConfig derives them).
SIZES = ("hidden_size", "num_hidden_layers", "num_attention_heads", "num_key_value_heads", "vocab_size",
         "max_position_embeddings", "num_experts", "num_experts_per_tok")
DERIVED_SIZES = ("head_dim", "intermediate_size", "moe_intermediate_size")


def shape_problem(values: dict) -> str | None:
    """What keeps these config values (a stored config, or the shape flags) from making a model,
    in a few words; None where nothing does. An absent field takes MiniMindConfig's default."""
    for name in (*SIZES, *DERIVED_SIZES):
        if name not in values or (values[name] is None and name in DERIVED_SIZES):
            continue  # MiniMindConfig's default, or derived from the others
        value = values[name]
        if isinstance(value, bool) or not isinstance(value, int) or value < 1:
            return f"{name} is {value!r}, not a positive integer"
    hidden, heads, kv_heads = (values.get(name, flag_default(name))
                               for name in ("hidden_size", "num_attention_heads", "num_key_value_heads"))
    if heads % kv_heads:
        return f"num_attention_heads {heads} is not a multiple of num_key_value_heads {kv_heads}"
    head_dim = values.get("head_dim") or hidden // heads
    if head_dim < 2 or head_dim % 2:  # RoPE rotates the two halves of each head
        return (f"each head has {head_dim} dimensions (hidden_size {hidden} / num_attention_heads {heads}), "
                f"not an even number of at least 2")
    return None


def resolve_config(stored, flags, source):
    """The MiniMindConfig to build: a stored config wins, and flags passed explicitly
    (not None) must agree with it; without a stored config the flags decide."""
    flags = {k: v for k, v in flags.items() if v is not None}
    if stored is None:
        if problem := shape_problem(flags):
            raise WeightsError(f"{source}: the shape flags make no model ({problem}): pass the flags the weights "
                               f"were trained with (--hidden_size, --num_attention_heads, ...)")
        return MiniMindConfig(**flags)
    if not isinstance(stored, (dict, MiniMindConfig)):
        raise WeightsError(f"{source}: its stored model config is a {type(stored).__name__}, not a mapping: it was "
                           f"not written by this trainer; convert the weights, or pass another file")
    if isinstance(stored, dict) and (problem := shape_problem(stored)):
        raise WeightsError(f"{source}: its stored model config makes no model ({problem}): it was not written by "
                           f"this trainer; convert the weights, or pass another file")
    config = MiniMindConfig.from_dict(dict(stored)) if isinstance(stored, dict) else stored  # a copy: from_dict may pop
    for name, value in flags.items():
        have = getattr(config, name)
        if (bool(value) != have) if name == "use_moe" else (value != have):
            have = int(have) if name == "use_moe" else have
            raise WeightsError(f"{source}: the model was trained with --{name} {have} but --{name} {value} "
                               f"was passed: drop the flag or pass --{name} {have}")
    return config


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
