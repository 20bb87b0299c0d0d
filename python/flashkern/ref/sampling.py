"""References of the sampling, renormalization and speculative-verification ops (the CPU
implementations and the test oracles), in float64.

The kept set of a filter, in the order of csrc/include/flashkern/ops.h (larger probability first,
ties to the lower index; negative probabilities count as 0):
  top-k  the first k tokens (k <= 0 or k >= vocab: all)
  top-p  the tokens whose mass before them is below top_p times the row's mass (top_p >= 1: all)
  min-p  the tokens with p >= min(min_p, 1) * max(p)
and the first token always. Random numbers come from a torch.Generator seeded from the op's seed and
offset, so a CPU run repeats with the same seed (the GPU kernels draw Philox numbers instead: the
same distribution, other tokens).
"""

import torch


def _mass(probs):
    return probs.double().clamp_min(0)


def kept(probs, top_k=None, top_p=None, min_p=None):
    """Boolean [rows, vocab]: the tokens each row's filters keep. top_k / top_p / min_p: None or a
    [rows] tensor (one value a row)."""
    p = _mass(probs)
    keep = torch.ones_like(p, dtype=torch.bool)
    if min_p is not None:
        threshold = min_p.double().nan_to_num(0.0).clamp(max=1).unsqueeze(1) * p.amax(dim=1, keepdim=True)
        keep &= p >= threshold
    if top_k is not None or top_p is not None:
        values, order = torch.sort(p, dim=1, descending=True, stable=True)  # ties: lower index first
        rank = torch.arange(p.shape[1]).expand_as(p)
        keep_sorted = torch.ones_like(keep)
        if top_k is not None:
            k = top_k.long().unsqueeze(1)
            keep_sorted &= (rank < k) | (k <= 0)
        if top_p is not None:
            before = torch.cumsum(values, dim=1) - values
            total = values.sum(dim=1, keepdim=True)
            keep_sorted &= (before < top_p.double().unsqueeze(1) * total) | (top_p.unsqueeze(1) >= 1)
        keep_sorted[:, 0] = True
        keep &= torch.zeros_like(keep).scatter(1, order, keep_sorted)
    return keep


def generator_for(seed, offset):
    """A CPU generator for one call: seeded from the op's seed and offset values or tensors."""
    seed = int(seed.flatten()[0]) if isinstance(seed, torch.Tensor) else int(seed)
    offset = int(offset.flatten()[0]) if isinstance(offset, torch.Tensor) else int(offset)
    return torch.Generator().manual_seed((seed * 0x9E3779B97F4A7C15 + offset) % (1 << 63))


def draw(weights, generator):
    """One index per row with probability weights / weights.sum() (float64 inverse transform); rows
    without mass give -1."""
    cdf = torch.cumsum(weights, dim=1)
    total = cdf[:, -1:]
    u = torch.rand(weights.shape[0], 1, dtype=torch.float64, generator=generator)
    index = torch.searchsorted(cdf, u * total, right=True).clamp(max=weights.shape[1] - 1).squeeze(1)
    ok = (total.squeeze(1) > 0) & torch.isfinite(total.squeeze(1))
    return torch.where(ok, index, -1)


def sampling(probs, indices, filter, top_k, top_p, min_p, generator):
    """The sampling op: (tokens, valid) for output rows probs[indices] (or probs); top_k / top_p /
    min_p are [batch] tensors or None per the filter ('none', 'top_k', 'top_p', 'min_p',
    'top_k_top_p'); invalid rows (no mass, NaN, an index outside probs) give token 0."""
    rows = probs.shape[0]
    index = torch.arange(rows) if indices is None else indices.long().cpu()
    inside = (index >= 0) & (index < rows)
    p = _mass(probs.cpu())[index.clamp(0, max(rows - 1, 0))]
    keep = kept(p, top_k if "top_k" in filter else None, top_p if "top_p" in filter else None,
                min_p if filter == "min_p" else None)
    token = draw(torch.where(keep, p, 0.0), generator)
    valid = (token >= 0) & inside
    token = torch.where(valid, token, 0)
    return token, valid


def renorm(input, kind, top_k=None, top_p=None):
    """top_k_probs / top_p_probs: the kept probabilities over their sum, 0 elsewhere; top_k_logits:
    the kept logits, -inf elsewhere (the order of the logits, as of the probabilities)."""
    x = input.double()
    if kind == "top_k_logits":
        keep = kept(torch.softmax(x, dim=1), top_k=top_k)
        return torch.where(keep, x, float("-inf")).to(input.dtype)
    keep = kept(x, top_k=top_k) if kind == "top_k_probs" else kept(x, top_p=top_p)
    kept_p = torch.where(keep, _mass(x), 0.0)
    return (kept_p / kept_p.sum(dim=1, keepdim=True)).to(input.dtype)


def children(parents, u):
    return [c for c in range(u + 1, len(parents)) if parents[c] == u]


def speculative(target, draft, candidates, first_candidate, parents, mode, generator):
    """The speculative op (csrc/include/flashkern/ops.h: SpeculativeParams) as a Python walk per
    request in float64: (tokens [batch, nodes], nodes [batch, nodes - 1], num_accepted [batch],
    independent_accepted [batch])."""
    batch, nodes, vocab = target.shape
    tokens = torch.full((batch, nodes), -1, dtype=torch.int32)
    path = torch.full((batch, max(nodes - 1, 0)), -1, dtype=torch.int32)
    accepted = torch.zeros(batch, dtype=torch.int32)
    independent = torch.zeros(batch, dtype=torch.int32)
    coins = torch.rand(batch, nodes, dtype=torch.float64, generator=generator)
    target = target.double().cpu()
    draft = None if draft is None else draft.double().cpu()
    for b in range(batch):
        par = list(range(-1, nodes - 1)) if parents is None else (parents[b] if parents.dim() == 2 else parents).tolist()

        def token_of(c):
            return int(candidates[b, c - first_candidate])

        u, n, emitted = 0, 0, None
        while emitted is None:
            kids = children(par, u)
            if mode == "greedy":
                best = int(torch.argmax(torch.nan_to_num(target[b, u], nan=float("-inf"))))  # first of the maxima
                nxt = next((c for c in kids if token_of(c) == best), None)
                if nxt is None:
                    emitted = best
            else:
                p = target[b, u].clamp_min(0)
                q = None if draft is None or not kids else draft[b, u]
                residual, nxt = p.clone(), None
                for c in kids:
                    t = token_of(c)
                    r = residual / residual.sum() if residual.sum() > 0 else residual
                    if q is not None:
                        if 0 <= t < vocab and coins[b, c] * q[t] < r[t]:
                            nxt = c
                            break
                        residual = (r - q).clamp_min(0)
                    else:
                        if 0 <= t < vocab and coins[b, c] < r[t]:
                            nxt = c
                            break
                        if 0 <= t < vocab:
                            residual[t] = 0
                if nxt is None:
                    weights = residual if residual.sum() > 0 else p
                    emitted = max(int(draw(weights[None], generator)[0]), 0)
            if nxt is not None:
                tokens[b, n], path[b, n] = token_of(nxt), nxt
                n, u = n + 1, nxt
        tokens[b, n] = emitted
        accepted[b] = n
        if parents is None and mode == "sample":
            for c in range(1, nodes):
                t = token_of(c)
                q_t = 1.0 if draft is None else float(draft[b, c - 1, t]) if 0 <= t < vocab else 0.0
                if 0 <= t < vocab and float(coins[b, c]) * q_t < float(target[b, c - 1, t]):
                    independent[b] += 1
    return tokens, path, accepted, independent
