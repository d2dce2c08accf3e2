"""Text generation with a KV cache: greedy, or sampled with temperature, top-k and top-p.

Our own loop instead of transformers' GenerationMixin.generate keeps the cache a
plain list of (key, value) tensors that anyone can read.
"""
import torch


class KVCacheGeneration:
    @torch.inference_mode()
    def generate(
        self,
        input_ids,
        attention_mask=None,
        max_new_tokens: int = 64,
        do_sample: bool = False,
        temperature: float = 1.0,
        top_k: int = 0,
        top_p: float = 1.0,
        eos_token_id: int | None = None,
        use_cache: bool = True,
        streamer=None,
        **kwargs,
    ):
        """Greedy or sampled decoding with a KV cache; returns prompt + new tokens.

        Finished rows (those that emitted EOS) keep emitting the pad token.
        """
        eos = self.config.eos_token_id if eos_token_id is None else eos_token_id
        pad = self.config.pad_token_id
        tokens = input_ids
        mask = attention_mask
        finished = torch.zeros(tokens.shape[0], dtype=torch.bool, device=tokens.device)
        past, step_input = None, tokens
        for _ in range(max_new_tokens):
            out = self(step_input, attention_mask=mask, past_key_values=past, use_cache=use_cache, logits_to_keep=1)
            next_token = pick_next_token(out.logits[:, -1].float(), do_sample, temperature, top_k, top_p)
            next_token = torch.where(finished, torch.full_like(next_token, pad), next_token)
            tokens = torch.cat([tokens, next_token[:, None]], dim=1)
            if mask is not None:
                mask = torch.cat([mask, (~finished).to(mask.dtype)[:, None]], dim=1)
            if streamer is not None:
                streamer.put(next_token.cpu())
            finished |= next_token == eos
            if finished.all():
                break
            past, step_input = (out.past_key_values, next_token[:, None]) if use_cache else (None, tokens)
        if streamer is not None:
            streamer.end()
        return tokens


def pick_next_token(logits, do_sample, temperature, top_k, top_p):
    """Greedy argmax, or a sample after temperature, top-k and top-p filtering."""
    if not do_sample or temperature <= 0:
        return logits.argmax(-1)
    logits = logits / temperature
    if top_k > 0:
        kth = torch.topk(logits, min(top_k, logits.shape[-1])).values[:, -1:]
        logits = logits.masked_fill(logits < kth, float("-inf"))
    if top_p < 1.0:
        sorted_logits, order = logits.sort(dim=-1, descending=True)
        cum = sorted_logits.softmax(-1).cumsum(-1)
        # Drop a token once the mass before it already reaches top_p; the best one always stays.
        drop = (cum - sorted_logits.softmax(-1)) >= top_p
        logits = logits.masked_fill(torch.zeros_like(drop).scatter(-1, order, drop), float("-inf"))
    return torch.multinomial(logits.softmax(-1), 1).squeeze(-1)


