"""MiniMind: a small decoder-only transformer (Qwen3-like).

Pre-norm blocks of grouped-query attention (with RMSNorm on q and k, RoPE, SDPA)
and a SwiGLU MLP, or a top-k routed mixture of SwiGLU experts when `use_moe`.
The weight names follow transformers' Qwen3 so a dense model exports to the
stock `Qwen3ForCausalLM` by renaming nothing (see scripts/convert_model.py).
"""
import math
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn
from torch.nn.attention.flex_attention import BlockMask, create_mask, flex_attention
from transformers import AutoConfig, AutoModelForCausalLM, GenerationMixin, PretrainedConfig, PreTrainedModel
from transformers import initialization as hf_init

# Package-relative, so the same file also works as trust_remote_code inside an
# exported folder (scripts/convert_model.py --format minimind copies it there).
from .generation import KVCacheGeneration
from .loss import causal_lm_loss
from .moe import MoEFeedForward


# The config fields that fix the shape of the model's tensors: weights load, and a checkpoint
# resumes, only into a model that agrees on every one. The one list; the scripts' and the
# trainer's shape flags are the ones of these they expose (model/shape_flags.py, trainer/config.py).
SHAPE_FIELDS = ("hidden_size", "num_hidden_layers", "num_attention_heads", "num_key_value_heads", "intermediate_size",
                "vocab_size", "use_moe")


class MiniMindConfig(PretrainedConfig):
    model_type = "minimind"

    def __init__(
        self,
        hidden_size: int = 768,
        num_hidden_layers: int = 8,
        num_attention_heads: int = 8,
        num_key_value_heads: int = 4,
        head_dim: int | None = None,
        intermediate_size: int | None = None,
        vocab_size: int = 6400,
        rope_theta: float = 1e6,
        max_position_embeddings: int = 32768,
        rms_norm_eps: float = 1e-6,
        dropout: float = 0.0,
        hidden_act: str = "silu",
        tie_word_embeddings: bool = True,
        bos_token_id: int = 1,
        eos_token_id: int = 2,
        pad_token_id: int = 0,
        flash_attn: bool = True,
        use_moe: bool = False,
        num_experts: int = 4,
        num_experts_per_tok: int = 1,
        moe_intermediate_size: int | None = None,
        norm_topk_prob: bool = True,
        router_aux_loss_coef: float = 5e-4,
        **kwargs,
    ):
        self.hidden_size = hidden_size
        self.num_hidden_layers = num_hidden_layers
        self.num_attention_heads = num_attention_heads
        self.num_key_value_heads = num_key_value_heads
        self.head_dim = head_dim or hidden_size // num_attention_heads
        # ~pi x hidden, rounded up to a multiple of 64 so matmuls tile well.
        self.intermediate_size = intermediate_size or math.ceil(hidden_size * math.pi / 64) * 64
        self.vocab_size = vocab_size
        self.rope_theta = rope_theta
        self.max_position_embeddings = max_position_embeddings
        self.rms_norm_eps = rms_norm_eps
        self.dropout = dropout
        self.hidden_act = hidden_act
        self.flash_attn = flash_attn
        self.use_moe = bool(use_moe)
        self.num_experts = num_experts
        self.num_experts_per_tok = num_experts_per_tok
        self.moe_intermediate_size = moe_intermediate_size or self.intermediate_size
        self.norm_topk_prob = norm_topk_prob
        self.router_aux_loss_coef = router_aux_loss_coef
        super().__init__(
            tie_word_embeddings=tie_word_embeddings,
            bos_token_id=bos_token_id,
            eos_token_id=eos_token_id,
            pad_token_id=pad_token_id,
            **kwargs,
        )


class RMSNorm(nn.Module):
    def __init__(self, dim: int, eps: float = 1e-6):
        super().__init__()
        self.eps = eps
        self.weight = nn.Parameter(torch.ones(dim))

    def forward(self, x):
        # Normalise in fp32: under bf16 autocast the mean of squares loses too much precision.
        x32 = x.float()
        x32 = x32 * torch.rsqrt(x32.pow(2).mean(-1, keepdim=True) + self.eps)
        return self.weight * x32.to(x.dtype)


def rope_cos_sin(head_dim: int, max_positions: int, theta: float):
    """Precomputed rotate-half RoPE tables, each (max_positions, head_dim)."""
    inv_freq = 1.0 / theta ** (torch.arange(0, head_dim, 2, dtype=torch.float32) / head_dim)
    angles = torch.outer(torch.arange(max_positions, dtype=torch.float32), inv_freq)
    angles = torch.cat([angles, angles], dim=-1)
    return angles.cos(), angles.sin()


def rotate_half(x):
    x1, x2 = x.chunk(2, dim=-1)
    return torch.cat([-x2, x1], dim=-1)


def apply_rope(x, cos, sin):
    # x: (B, heads, T, head_dim); cos/sin: (T, head_dim), broadcast over batch and heads.
    return (x * cos + rotate_half(x) * sin).to(x.dtype)


def build_attention_mask(attention_mask, q_len: int, past_len: int, device):
    """Boolean (B or 1, 1, q_len, past_len + q_len) mask, True where a query may attend.

    Combines causality with a (B, S) padding mask. A 4-D mask (e.g. the packed
    path's block-diagonal document mask) is taken as it is.
    """
    if attention_mask is not None and attention_mask.dim() == 4:
        return attention_mask.bool()
    kv_len = past_len + q_len
    query_pos = torch.arange(past_len, kv_len, device=device).view(-1, 1)
    key_pos = torch.arange(kv_len, device=device).view(1, -1)
    mask = (key_pos <= query_pos)[None, None]
    if attention_mask is not None:
        mask = mask & attention_mask.bool()[:, None, None, :kv_len]
        # A padded query would see no key at all and SDPA would return NaN, which
        # then leaks through later layers; letting it see itself keeps it finite.
        mask = mask | (key_pos == query_pos)[None, None]
    return mask


class Attention(nn.Module):
    def __init__(self, config: MiniMindConfig):
        super().__init__()
        self.num_heads = config.num_attention_heads
        self.num_kv_heads = config.num_key_value_heads
        self.head_dim = config.head_dim
        self.dropout = config.dropout
        self.use_sdpa = config.flash_attn
        hidden = config.hidden_size
        self.q_proj = nn.Linear(hidden, self.num_heads * self.head_dim, bias=False)
        self.k_proj = nn.Linear(hidden, self.num_kv_heads * self.head_dim, bias=False)
        self.v_proj = nn.Linear(hidden, self.num_kv_heads * self.head_dim, bias=False)
        self.o_proj = nn.Linear(self.num_heads * self.head_dim, hidden, bias=False)
        self.q_norm = RMSNorm(self.head_dim, config.rms_norm_eps)
        self.k_norm = RMSNorm(self.head_dim, config.rms_norm_eps)

    def forward(self, x, cos, sin, attention_mask=None, past_kv=None, use_cache=False):
        B, T, _ = x.shape
        q = self.q_norm(self.q_proj(x).view(B, T, self.num_heads, self.head_dim)).transpose(1, 2)
        k = self.k_norm(self.k_proj(x).view(B, T, self.num_kv_heads, self.head_dim)).transpose(1, 2)
        v = self.v_proj(x).view(B, T, self.num_kv_heads, self.head_dim).transpose(1, 2)
        q, k = apply_rope(q, cos, sin), apply_rope(k, cos, sin)
        past_len = 0
        if past_kv is not None:
            past_len = past_kv[0].shape[2]
            k = torch.cat([past_kv[0], k], dim=2)
            v = torch.cat([past_kv[1], v], dim=2)
        # Only returned when asked: these are views, and FSDP warns about view outputs.
        present = (k, v) if use_cache else None
        dropout = self.dropout if self.training else 0.0
        if isinstance(attention_mask, BlockMask):
            out = self._flex_attend(q, k, v, attention_mask, dropout)
        elif attention_mask is None and past_len == 0:
            out = self._attend(q, k, v, None, dropout, is_causal=True)
        else:
            mask = build_attention_mask(attention_mask, T, past_len, x.device)
            out = self._attend(q, k, v, mask, dropout, is_causal=False)
        out = out.transpose(1, 2).reshape(B, T, self.num_heads * self.head_dim)
        return self.o_proj(out), present

    def _attend(self, q, k, v, mask, dropout, is_causal):
        # GQA: each group of query heads shares one key/value head.
        groups = self.num_heads // self.num_kv_heads
        if self.use_sdpa:
            # SDPA reads the shared K/V heads itself (no copies) where its fused kernel can:
            # always without a mask; with one only on CPU, since CUDA's memory-efficient
            # kernel, the one that takes masks, has no GQA and would fall back to plain math.
            gqa_in_kernel = mask is None or q.device.type == "cpu"
            if not gqa_in_kernel:
                k, v = k.repeat_interleave(groups, dim=1), v.repeat_interleave(groups, dim=1)
            return F.scaled_dot_product_attention(q, k, v, attn_mask=mask, dropout_p=dropout, is_causal=is_causal,
                                                  enable_gqa=gqa_in_kernel and groups > 1)
        # Plain-math attention, kept for reading and for debugging SDPA itself.
        k, v = k.repeat_interleave(groups, dim=1), v.repeat_interleave(groups, dim=1)
        scores = (q @ k.transpose(-2, -1)) / math.sqrt(self.head_dim)
        if is_causal:
            T, S = q.shape[2], k.shape[2]
            mask = torch.ones(T, S, dtype=torch.bool, device=q.device).tril(S - T)
        scores = scores.masked_fill(~mask, float("-inf"))
        weights = F.dropout(scores.float().softmax(-1).to(q.dtype), dropout, self.training)
        return weights @ v

    def _flex_attend(self, q, k, v, block_mask, dropout):
        """FlexAttention with a block-sparse mask (the packed path's document mask): fully
        masked blocks are skipped, where a dense (B,1,T,T) mask would rule out flash kernels."""
        if dropout or not self.use_sdpa:
            # FlexAttention has no dropout; the dense mask gives the same attention.
            dense = create_mask(block_mask.mask_mod, q.shape[0], 1, q.shape[2], k.shape[2], device=q.device)
            return self._attend(q, k, v, dense, dropout, is_causal=False)
        # Under autocast q and k leave the fp32 RMSNorm in fp32 and v is bf16; SDPA's autocast
        # rule casts them alike, FlexAttention needs it done here.
        q, k = q.to(v.dtype), k.to(v.dtype)
        # Inside a torch.compile'd model (--use_compile 1) dynamo traces flex_attention itself.
        attend = flex_attention if torch.compiler.is_compiling() else compiled_flex_attention()
        return attend(q, k, v, block_mask=block_mask, enable_gqa=self.num_heads != self.num_kv_heads)


_COMPILED_FLEX = None


def compiled_flex_attention():
    """flex_attention is fast only compiled (eagerly it materialises every score): compiled
    once, on first use, so importing the model costs nothing."""
    global _COMPILED_FLEX
    if _COMPILED_FLEX is None:
        _COMPILED_FLEX = torch.compile(flex_attention, dynamic=False)
    return _COMPILED_FLEX


class FeedForward(nn.Module):
    """SwiGLU: down(silu(gate(x)) * up(x))."""

    def __init__(self, hidden_size: int, intermediate_size: int, dropout: float = 0.0):
        super().__init__()
        self.gate_proj = nn.Linear(hidden_size, intermediate_size, bias=False)
        self.up_proj = nn.Linear(hidden_size, intermediate_size, bias=False)
        self.down_proj = nn.Linear(intermediate_size, hidden_size, bias=False)
        self.dropout = nn.Dropout(dropout)

    def forward(self, x):
        return self.dropout(self.down_proj(F.silu(self.gate_proj(x)) * self.up_proj(x)))


class MiniMindBlock(nn.Module):
    def __init__(self, config: MiniMindConfig):
        super().__init__()
        self.self_attn = Attention(config)
        self.input_layernorm = RMSNorm(config.hidden_size, config.rms_norm_eps)
        self.post_attention_layernorm = RMSNorm(config.hidden_size, config.rms_norm_eps)
        if config.use_moe:
            self.mlp = MoEFeedForward(config, FeedForward)
        else:
            self.mlp = FeedForward(config.hidden_size, config.intermediate_size, config.dropout)

    def forward(self, x, cos, sin, attention_mask=None, past_kv=None, use_cache=False):
        attn_out, present = self.self_attn(self.input_layernorm(x), cos, sin, attention_mask, past_kv, use_cache)
        x = x + attn_out
        x = x + self.mlp(self.post_attention_layernorm(x))
        aux_loss = getattr(self.mlp, "aux_loss", None)
        return x, present, aux_loss


class MiniMindModel(nn.Module):
    def __init__(self, config: MiniMindConfig):
        super().__init__()
        self.config = config
        self.embed_tokens = nn.Embedding(config.vocab_size, config.hidden_size)
        self.dropout = nn.Dropout(config.dropout)
        self.layers = nn.ModuleList(MiniMindBlock(config) for _ in range(config.num_hidden_layers))
        self.norm = RMSNorm(config.hidden_size, config.rms_norm_eps)
        cos, sin = rope_cos_sin(config.head_dim, config.max_position_embeddings, config.rope_theta)
        # Non-persistent: derived from the config, so they stay out of checkpoints.
        self.register_buffer("rope_cos", cos, persistent=False)
        self.register_buffer("rope_sin", sin, persistent=False)
        # Set by the trainer (wrap_model in trainer/distributed.py) for --grad_checkpointing.
        self.gradient_checkpointing = False

    def forward(self, input_ids, attention_mask=None, past_key_values=None, use_cache=False):
        T = input_ids.shape[1]
        past_len = past_key_values[0][0].shape[2] if past_key_values else 0
        if past_len + T > self.config.max_position_embeddings:
            raise ValueError(
                f"sequence of {past_len + T} tokens exceeds max_position_embeddings="
                f"{self.config.max_position_embeddings}"
            )
        cos = self.rope_cos[past_len : past_len + T]
        sin = self.rope_sin[past_len : past_len + T]
        x = self.dropout(self.embed_tokens(input_ids))
        presents, aux_losses = [], []
        for i, layer in enumerate(self.layers):
            past_kv = past_key_values[i] if past_key_values else None
            if self.gradient_checkpointing and self.training:
                x, present, aux = torch.utils.checkpoint.checkpoint(
                    layer, x, cos, sin, attention_mask, past_kv, use_cache, use_reentrant=False
                )
            else:
                x, present, aux = layer(x, cos, sin, attention_mask, past_kv, use_cache)
            if use_cache:
                presents.append(present)
            if aux is not None:
                aux_losses.append(aux)
        aux_loss = torch.stack(aux_losses).sum() if aux_losses else x.new_zeros(())
        return self.norm(x), (presents if use_cache else None), aux_loss


@dataclass
class MiniMindOutput:
    loss: torch.Tensor | None = None
    aux_loss: torch.Tensor | None = None
    logits: torch.Tensor | None = None
    past_key_values: list | None = None  # one (key, value) pair per layer


class MiniMindForCausalLM(KVCacheGeneration, PreTrainedModel, GenerationMixin):
    config_class = MiniMindConfig
    base_model_prefix = "model"
    _no_split_modules = ["MiniMindBlock"]
    _tied_weights_keys = {"lm_head.weight": "model.embed_tokens.weight"}

    def __init__(self, config: MiniMindConfig | None = None):
        config = config or MiniMindConfig()
        super().__init__(config)
        self.model = MiniMindModel(config)
        self.lm_head = nn.Linear(config.hidden_size, config.vocab_size, bias=False)
        self.post_init()
        if config.tie_word_embeddings:
            self.lm_head.weight = self.model.embed_tokens.weight

    def _init_weights(self, module):
        # transformers' init functions skip tensors that from_pretrained already loaded.
        if isinstance(module, (nn.Linear, nn.Embedding)):
            hf_init.normal_(module.weight, mean=0.0, std=0.02)
        elif isinstance(module, RMSNorm):
            hf_init.ones_(module.weight)
        elif isinstance(module, MiniMindModel):
            # from_pretrained builds on the meta device, which leaves the RoPE tables empty.
            cos, sin = rope_cos_sin(module.config.head_dim, module.config.max_position_embeddings, module.config.rope_theta)
            hf_init.copy_(module.rope_cos, cos)
            hf_init.copy_(module.rope_sin, sin)

    def get_input_embeddings(self):
        return self.model.embed_tokens

    def get_output_embeddings(self):
        return self.lm_head

    def forward(
        self,
        input_ids,
        attention_mask=None,
        labels=None,
        past_key_values=None,
        use_cache=False,
        logits_to_keep: int = 0,
        shift_labels=None,
        num_items_in_batch=None,
        **kwargs,
    ):
        hidden, presents, aux_loss = self.model(input_ids, attention_mask, past_key_values, use_cache)
        # During generation only the last position's logits are needed.
        logits = self.lm_head(hidden[:, -logits_to_keep:] if logits_to_keep else hidden)
        loss = None
        if labels is not None or shift_labels is not None:
            loss = causal_lm_loss(logits, labels, shift_labels, num_items_in_batch)
        return MiniMindOutput(loss=loss, aux_loss=aux_loss, logits=logits, past_key_values=presents)


def count_parameters(model: MiniMindForCausalLM):
    """(total, active) parameter counts; tied weights count once, and for MoE
    `active` counts only the experts a token is routed to."""
    total = sum(p.numel() for p in model.parameters())
    config = model.config
    if not config.use_moe:
        return total, total
    per_expert = sum(p.numel() for p in model.model.layers[0].mlp.experts[0].parameters())
    idle = (config.num_experts - config.num_experts_per_tok) * per_expert * config.num_hidden_layers
    return total, total - idle


def register_auto_classes():
    """Let AutoConfig / AutoModelForCausalLM load MiniMind folders in this process, and make
    save_pretrained write an `auto_map` (and copy our source files) for trust_remote_code users.
    Called by whoever needs it, so that importing the model changes nothing in transformers."""
    AutoConfig.register(MiniMindConfig.model_type, MiniMindConfig, exist_ok=True)
    AutoModelForCausalLM.register(MiniMindConfig, MiniMindForCausalLM, exist_ok=True)
    MiniMindConfig.register_for_auto_class()
    MiniMindForCausalLM.register_for_auto_class("AutoModelForCausalLM")
