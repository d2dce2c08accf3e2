"""GGUF export: one file that llama.cpp (and so Ollama) loads as `qwen3`, or `qwen3moe` for
`--use_moe 1`, holding the weights, our byte-level BPE tokenizer and the chat template.

The names come from the `gguf` package's tensor-name map for the architecture, so they
follow llama.cpp's own; everything else here is the mapping of our config and tokenizer.
Every file written is read back with gguf.GGUFReader and checked tensor by tensor.
"""
import json
import os
from pathlib import Path

import numpy as np
import torch

from common.errors import UserError, WeightsError

GGUF_TYPES = ("f16", "q8_0")

# Our tokenizer.json pre-tokenizes with ByteLevel(use_regex=True): GPT-2's regex. Of
# llama.cpp's pre-types that split with exactly this regex (gpt-2, mpt, olmo, jais, trillion,
# granite-docling), "trillion" is one that also decodes without "cleaning" spaces (" 's" -> "'s",
# " ," -> ","), as our tokenizer_config's clean_up_tokenization_spaces false asks; "gpt-2" would
# tokenize the same but decode "to 'strict'" as "to'strict'". tests/test_gguf.py checks both directions.
LLAMA_CPP_PRE_TOKENIZER = "trillion"


class GGUFExportError(RuntimeError):
    """A GGUF file that read back wrong; str(e) is one line."""


def _gguf():
    try:
        import gguf
    except ImportError:
        raise UserError("--format gguf needs the gguf package: pip install -r requirements-gguf.txt") from None
    return gguf


def check_llama_cpp_can_run(config):
    """llama.cpp's qwen3moe always renormalises the top-k routing weights to sum to 1; a model
    that does not (one expert per token, or norm_topk_prob off) would compute something else."""
    if config.use_moe and not (config.norm_topk_prob and config.num_experts_per_tok > 1):
        k = config.num_experts_per_tok
        raise UserError(f"--format gguf: this MoE model weights its {k} chosen expert(s) per token by the router's "
                        f"probability without renormalising, but "
                        f"llama.cpp's qwen3moe always renormalises them to sum to 1 (one expert: weight 1.0), so it "
                        f"would compute other logits: GGUF needs num_experts_per_tok >= 2 with norm_topk_prob in "
                        f"the model's config; use --format native for this model")


def write_gguf(model, out_path, tokenizer_dir, gguf_type="f16"):
    """Write `model` (a MiniMindForCausalLM) as GGUF to `out_path`, atomically; returns the
    architecture llama.cpp will load it as. The tokenizer folder is required: llama.cpp
    takes its vocabulary from the file."""
    gguf = _gguf()
    if gguf_type not in GGUF_TYPES:
        raise UserError(f"--gguf_type {gguf_type}: one of {', '.join(GGUF_TYPES)}")
    config = model.config
    check_llama_cpp_can_run(config)
    vocab = read_vocab(tokenizer_dir, config.vocab_size)  # fail before writing anything
    arch = gguf.MODEL_ARCH.QWEN3MOE if config.use_moe else gguf.MODEL_ARCH.QWEN3
    arch_name = gguf.MODEL_ARCH_NAMES[arch]
    tensors = gguf_tensors(model, arch, gguf_type)
    out_path = Path(out_path)
    out_path.parent.mkdir(parents=True, exist_ok=True)
    tmp = out_path.with_name(out_path.name + ".tmp")
    try:
        writer = gguf.GGUFWriter(tmp, arch_name)
        _add_hparams(writer, config, gguf_type)
        _add_tokenizer(writer, vocab)
        for name, (array, qtype, _) in tensors.items():
            writer.add_tensor(name, array, raw_dtype=qtype)
        writer.write_header_to_file()
        writer.write_kv_data_to_file()
        writer.write_tensors_to_file()
        writer.close()
        verify_gguf(tmp, arch_name, tensors, len(vocab["tokens"]))
        os.replace(tmp, out_path)
    finally:
        tmp.unlink(missing_ok=True)
    return arch_name


def _add_hparams(writer, config, gguf_type):
    gguf = _gguf()
    writer.add_name("MiniMind")
    writer.add_context_length(config.max_position_embeddings)
    writer.add_embedding_length(config.hidden_size)
    writer.add_block_count(config.num_hidden_layers)
    writer.add_feed_forward_length(config.intermediate_size)
    writer.add_head_count(config.num_attention_heads)
    writer.add_head_count_kv(config.num_key_value_heads)
    # head_dim need not be hidden / heads here, so llama.cpp must not derive it.
    writer.add_key_length(config.head_dim)
    writer.add_value_length(config.head_dim)
    writer.add_rope_dimension_count(config.head_dim)
    writer.add_rope_freq_base(float(config.rope_theta))
    writer.add_layer_norm_rms_eps(config.rms_norm_eps)
    if config.use_moe:
        writer.add_expert_count(config.num_experts)
        writer.add_expert_used_count(config.num_experts_per_tok)
        writer.add_expert_feed_forward_length(config.moe_intermediate_size)
    ftype = gguf.LlamaFileType.MOSTLY_Q8_0 if gguf_type == "q8_0" else gguf.LlamaFileType.MOSTLY_F16
    writer.add_file_type(ftype)
    writer.add_quantization_version(gguf.GGML_QUANT_VERSION)


# -----------------------------------------------------------------------------
# tensors

def gguf_tensors(model, arch, gguf_type):
    """{gguf name: (numpy array, raw GGML type or None, logical shape)} in llama.cpp's names and layouts."""
    gguf = _gguf()
    config = model.config
    names = gguf.get_tensor_name_map(arch, config.num_hidden_layers)
    state = {k: v.detach().float().cpu() for k, v in model.state_dict().items()}
    if config.tie_word_embeddings:
        # Without output.weight llama.cpp's qwen3 / qwen3moe use token_embd for the output
        # projection, as a tied lm_head does: the file holds the matrix once.
        state.pop("lm_head.weight", None)
    out = {}
    for hf_name, tensor in _stack_experts(state, config).items():
        base = hf_name.removesuffix(".weight")
        name = names.get_name(base)
        if name is None:
            raise GGUFExportError(f"{hf_name}: the gguf tensor-name map has no name for it in {arch.name}")
        out[name + ".weight"] = (*_encode(tensor.numpy(), name, gguf_type), tuple(tensor.shape))
    return out


def _stack_experts(state, config):
    # llama.cpp keeps a layer's experts as one 3-D tensor per projection (experts first).
    if not config.use_moe:
        return state
    out = {k: v for k, v in state.items() if ".mlp.experts." not in k}
    for layer in range(config.num_hidden_layers):
        for proj in ("gate_proj", "up_proj", "down_proj"):
            prefix = f"model.layers.{layer}.mlp.experts"
            experts = [state[f"{prefix}.{e}.{proj}.weight"] for e in range(config.num_experts)]
            out[f"{prefix}.{proj}.weight"] = torch.stack(experts)
    return out


def _encode(array, name, gguf_type):
    gguf = _gguf()
    # Norms and the MoE router stay fp32: they are tiny, and rounding the router can flip
    # which expert a token goes to.
    if array.ndim == 1 or name.endswith("ffn_gate_inp"):
        return array.astype(np.float32), None
    if gguf_type == "q8_0" and array.shape[-1] % gguf.GGML_QUANT_SIZES[gguf.GGMLQuantizationType.Q8_0][0] == 0:
        qtype = gguf.GGMLQuantizationType.Q8_0
        return gguf.quants.quantize(array, qtype), qtype
    return array.astype(np.float16), None  # also q8_0's fallback for rows not a whole number of blocks


# -----------------------------------------------------------------------------
# tokenizer

def read_vocab(tokenizer_dir, vocab_size):
    """Tokens (by id), token types, merges, special ids and chat template from a tokenizer
    folder holding tokenizer.json (byte-level BPE) and tokenizer_config.json."""
    if tokenizer_dir is None:
        raise UserError("--format gguf needs the tokenizer: llama.cpp reads it from the file; "
                        "pass --tokenizer_path the tokenizer folder (default: model/)")
    gguf = _gguf()
    folder = Path(tokenizer_dir)
    tok, cfg = _read_json(folder / "tokenizer.json"), _read_json(folder / "tokenizer_config.json")
    bpe = tok.get("model") or {}
    pre = tok.get("pre_tokenizer") or {}
    if bpe.get("type") != "BPE" or pre.get("type") != "ByteLevel" or not pre.get("use_regex", True):
        raise WeightsError(f"{folder / 'tokenizer.json'}: not a byte-level BPE tokenizer with GPT-2's "
                           f"pre-tokenizer (model {bpe.get('type')}, pre_tokenizer {pre.get('type')}): "
                           f"--format gguf carries only that kind")
    ids = dict(bpe["vocab"])
    added = {t["content"]: t for t in tok.get("added_tokens", [])}
    ids.update({content: t["id"] for content, t in added.items()})
    if max(ids.values()) >= vocab_size:
        raise WeightsError(f"{folder}: the tokenizer has ids up to {max(ids.values())} but the model's vocab_size "
                           f"is {vocab_size}: pass --tokenizer_path the tokenizer the model was trained with")
    # Rows of the embedding no token names still need a token each: llama.cpp sizes the vocab by the list.
    tokens = [f"[PAD{i}]" for i in range(vocab_size)]
    types = [gguf.TokenType.UNUSED] * vocab_size
    for token, i in ids.items():
        tokens[i] = token
        special = added.get(token, {}).get("special")
        types[i] = (gguf.TokenType.NORMAL if token not in added else
                    gguf.TokenType.CONTROL if special else gguf.TokenType.USER_DEFINED)
    merges = [m if isinstance(m, str) else " ".join(m) for m in bpe.get("merges", [])]
    return dict(tokens=tokens, types=types, merges=merges, special=_special_ids(cfg, ids, folder),
                chat_template=_chat_template(folder, cfg))


def _special_ids(cfg, ids, folder):
    special = {}
    for role in ("bos", "eos", "pad", "unk"):
        token = cfg.get(f"{role}_token")
        token = token.get("content") if isinstance(token, dict) else token
        if token is None:
            continue
        if token not in ids:
            raise WeightsError(f"{folder / 'tokenizer_config.json'}: {role}_token {token!r} is not in the "
                               f"vocabulary: fix the tokenizer folder")
        special[role] = ids[token]
    return special


def _chat_template(folder, cfg):
    if (folder / "chat_template.jinja").is_file():
        return (folder / "chat_template.jinja").read_text(encoding="utf-8")
    return cfg.get("chat_template")


def _read_json(path):
    try:
        return json.loads(path.read_text(encoding="utf-8"))
    except (OSError, UnicodeDecodeError, ValueError) as e:
        raise WeightsError(f"{path}: not readable JSON ({type(e).__name__}): pass --tokenizer_path a folder "
                           f"with tokenizer.json and tokenizer_config.json (such as model/)") from None


def _add_tokenizer(writer, vocab):
    writer.add_tokenizer_model("gpt2")  # llama.cpp's name for byte-level BPE
    writer.add_tokenizer_pre(LLAMA_CPP_PRE_TOKENIZER)
    writer.add_token_list(vocab["tokens"])
    writer.add_token_types(vocab["types"])
    writer.add_token_merges(vocab["merges"])
    adders = {"bos": writer.add_bos_token_id, "eos": writer.add_eos_token_id,
              "pad": writer.add_pad_token_id, "unk": writer.add_unk_token_id}
    for role, token_id in vocab["special"].items():
        adders[role](token_id)
    # Our tokenizer adds no bos/eos to a text (tokenizer_config: add_bos_token false).
    writer.add_add_bos_token(False)
    writer.add_add_eos_token(False)
    if vocab["chat_template"]:
        writer.add_chat_template(vocab["chat_template"])


# -----------------------------------------------------------------------------
# verification

def verify_gguf(path, arch_name, tensors, n_tokens):
    """Read the file back: its architecture, vocabulary size and every tensor's name, shape,
    type and bytes must be what was meant to be written."""
    gguf = _gguf()
    reader = gguf.GGUFReader(path)
    arch = reader.get_field(gguf.Keys.General.ARCHITECTURE).contents()
    if arch != arch_name:
        raise GGUFExportError(f"{path}: general.architecture reads back as {arch!r}, not {arch_name!r}")
    read_tokens = len(reader.get_field(gguf.Keys.Tokenizer.LIST).data)
    if read_tokens != n_tokens:
        raise GGUFExportError(f"{path}: {read_tokens} tokens read back, {n_tokens} written")
    found = {t.name: t for t in reader.tensors}
    if found.keys() != tensors.keys():
        raise GGUFExportError(f"{path}: tensors read back differ: missing {sorted(tensors.keys() - found.keys())}, "
                              f"extra {sorted(found.keys() - tensors.keys())}")
    plain = {np.dtype(np.float32): gguf.GGMLQuantizationType.F32, np.dtype(np.float16): gguf.GGMLQuantizationType.F16}
    for name, (array, qtype, shape) in tensors.items():
        got = found[name]
        want_type = qtype if qtype is not None else plain[array.dtype]
        got_shape = tuple(int(n) for n in reversed(got.shape))  # GGUF lists dimensions fastest first
        same_bytes = np.array_equal(np.asarray(got.data).reshape(-1).view(np.uint8), array.reshape(-1).view(np.uint8))
        if got.tensor_type != want_type or got_shape != shape or not same_bytes:
            raise GGUFExportError(f"{path}: tensor {name} reads back as {got.tensor_type.name} {list(got_shape)}, "
                                  f"written as {want_type.name} {list(shape)}{'' if same_bytes else ', other bytes'}")
