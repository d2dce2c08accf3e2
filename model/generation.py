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
        max_new_tokens: int | None = None,
        do_sample: bool = False,
        temperature: float = 1.0,
        top_k: int = 0,
        top_p: float = 1.0,
        eos_token_id: int | list[int] | None = None,
        pad_token_id: int | None = None,
        use_cache: bool = True,
        streamer=None,
        max_length: int | None = None,
        stopping_criteria=None,
        **unsupported,
    ):
        """Greedy or sampled decoding with a KV cache; returns prompt + new tokens.

        The arguments keep transformers' meanings, so lm-eval and transformers' streamers can
        call it as they call GenerationMixin.generate: max_new_tokens wins over max_length (the
        prompt included), 64 new tokens where neither is given; stopping_criteria(tokens, None)
        ends rows as EOS does; the streamer gets the prompt first, then each new token. Finished
        rows keep emitting the pad token. Other keywords (beams, penalties, ...) are refused, not
        ignored: this loop has no such options."""
        if unsupported:
            raise TypeError(f"generate() does not take {', '.join(sorted(unsupported))}: this model's own loop "
                            f"decodes greedily or by sampling (temperature, top_k, top_p) and nothing else")
        eos = self.config.eos_token_id if eos_token_id is None else eos_token_id
        eos = torch.tensor(eos if isinstance(eos, (list, tuple)) else [eos], device=input_ids.device)
        pad = self.config.pad_token_id if pad_token_id is None else pad_token_id
        if max_new_tokens is None:
            max_new_tokens = 64 if max_length is None else max(0, max_length - input_ids.shape[1])
        tokens = input_ids
        mask = attention_mask
        finished = torch.zeros(tokens.shape[0], dtype=torch.bool, device=tokens.device)
        past, step_input = None, tokens
        if streamer is not None:
            streamer.put(input_ids.cpu())
        for _ in range(max_new_tokens):
            out = self(step_input, attention_mask=mask, past_key_values=past, use_cache=use_cache, logits_to_keep=1)
            next_token = pick_next_token(out.logits[:, -1].float(), do_sample, temperature, top_k, top_p)
            next_token = torch.where(finished, torch.full_like(next_token, pad), next_token)
            tokens = torch.cat([tokens, next_token[:, None]], dim=1)
            if mask is not None:
                mask = torch.cat([mask, (~finished).to(mask.dtype)[:, None]], dim=1)
            if streamer is not None:
                streamer.put(next_token.cpu())
            finished |= torch.isin(next_token, eos)
            if stopping_criteria is not None:
                finished |= torch.as_tensor(stopping_criteria(tokens, None), device=tokens.device)
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
        drop[..., 0] = False  # even at top_p <= 0
        logits = logits.masked_fill(torch.zeros_like(drop).scatter(-1, order, drop), float("-inf"))
    return torch.multinomial(logits.softmax(-1), 1).squeeze(-1)


