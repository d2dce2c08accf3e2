"""Mixture-of-experts feed-forward: a softmax router sends each token to its top-k experts."""
import torch
import torch.nn.functional as F
from torch import nn


class MoEFeedForward(nn.Module):
    def __init__(self, config, expert_cls):
        super().__init__()
        self.num_experts = config.num_experts
        self.top_k = config.num_experts_per_tok
        self.norm_topk_prob = config.norm_topk_prob
        self.aux_loss_coef = config.router_aux_loss_coef
        self.gate = nn.Linear(config.hidden_size, config.num_experts, bias=False)
        self.experts = nn.ModuleList(
            expert_cls(config.hidden_size, config.moe_intermediate_size, config.dropout)
            for _ in range(config.num_experts)
        )
        self.aux_loss = None

    def forward(self, x):
        B, T, H = x.shape
        tokens = x.reshape(-1, H)
        probs = F.softmax(self.gate(tokens), dim=-1, dtype=torch.float32)
        weights, expert_idx = probs.topk(self.top_k, dim=-1)
        if self.norm_topk_prob and self.top_k > 1:
            weights = weights / weights.sum(dim=-1, keepdim=True)
        weights = weights.to(x.dtype)

        out = torch.zeros_like(tokens)
        for e, expert in enumerate(self.experts):
            token_ids, slot = torch.where(expert_idx == e)
            if token_ids.numel() == 0:
                # An expert that got no token this step still joins the graph with a
                # zero contribution, so DDP sees a gradient for every parameter and
                # never needs find_unused_parameters.
                out = out + sum(p.sum() for p in expert.parameters()) * 0.0
                continue
            expert_out = expert(tokens[token_ids]) * weights[token_ids, slot, None]
            out = out.index_add(0, token_ids, expert_out)
        self.aux_loss = self._load_balancing_loss(probs, expert_idx) if self.training else probs.new_zeros(())
        return out.view(B, T, H)

    def _load_balancing_loss(self, probs, expert_idx):
        """Switch-style balance loss: num_experts * sum_e(fraction routed to e * mean prob of e).

        It is 1 x coef when routing is perfectly uniform and grows as experts get skewed.
        """
        routed = F.one_hot(expert_idx, self.num_experts).float().sum(dim=1)  # (tokens, experts)
        fraction_routed = routed.mean(dim=0) / self.top_k
        mean_prob = probs.mean(dim=0)
        return self.num_experts * (fraction_routed * mean_prob).sum() * self.aux_loss_coef
