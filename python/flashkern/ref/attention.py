import torch

from ._compute import compute_dtype


def merge_states(v, s):
    """Merge attention states: v [tokens, num_states, heads, head_dim], s [tokens, num_states, heads]
    (natural-log sum-exp) -> (v [tokens, heads, head_dim], s [tokens, heads]). All-empty (-inf) gives
    (0, -inf); a NaN anywhere in a row gives NaN."""
    c = compute_dtype(v)
    s = s.to(torch.float64 if c == torch.float64 else torch.float32)
    m = s.amax(dim=1)
    empty = m == float("-inf")
    w = torch.exp(s - torch.where(empty, 0.0, m).unsqueeze(1))
    total = w.sum(dim=1)
    merged = (w.unsqueeze(-1) * v.to(c)).sum(dim=1) / total.unsqueeze(-1).to(c)
    merged = torch.where(empty.unsqueeze(-1), 0.0, merged)
    s_out = torch.where(empty, float("-inf"), m + torch.log(total))
    return merged.to(v.dtype), s_out.to(torch.float64 if c == torch.float64 else torch.float32)


def merge_state(v_a, s_a, v_b, s_b):
    """Merge two attention states [tokens, heads, head_dim] / [tokens, heads]."""
    return merge_states(torch.stack([v_a, v_b], dim=1), torch.stack([s_a, s_b], dim=1))
