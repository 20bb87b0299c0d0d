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


def _generator(seed, offset):
    return torch.Generator().manual_seed((int(seed) * 0x9E3779B97F4A7C15 + int(offset)) % (1 << 63))


class RowStreams:
    """The reference's random numbers for `batch` output rows, from the op's seed and offset (values or
    [1] / [batch] tensors): one torch.Generator for all rows, or, with a seed per row, one per row from its
    own seed and offset, so that a row's draws depend on neither its position nor the other rows (as the
    kernels' Philox streams, philox.h)."""

    def __init__(self, seed, offset, batch):
        seeds = seed.flatten().tolist() if isinstance(seed, torch.Tensor) else [seed]
        offsets = offset.flatten().tolist() if isinstance(offset, torch.Tensor) else [offset]
        self.per_row = len(seeds) > 1
        if self.per_row:
            self.rows = [_generator(seeds[b], offsets[b if len(offsets) > 1 else 0]) for b in range(batch)]
        else:
            self.shared = _generator(seeds[0], offsets[0])

    def generator(self, b):
        return self.rows[b] if self.per_row else self.shared

    def uniforms(self, n):
        """One float64 number in [0, 1) for each of the n rows."""
        if not self.per_row:
            return torch.rand(n, dtype=torch.float64, generator=self.shared)
        return torch.cat([torch.rand(1, dtype=torch.float64, generator=g) for g in self.rows[:n]])


def draw(weights, generator):
    """One index per row with probability weights / weights.sum() (float64 inverse transform); rows
    without mass give -1."""
    cdf = torch.cumsum(weights, dim=1)
    total = cdf[:, -1:]
    u = torch.rand(weights.shape[0], 1, dtype=torch.float64, generator=generator)
    index = torch.searchsorted(cdf, u * total, right=True).clamp(max=weights.shape[1] - 1).squeeze(1)
    ok = (total.squeeze(1) > 0) & torch.isfinite(total.squeeze(1))
    return torch.where(ok, index, -1)


def sampling(probs, indices, filter, top_k, top_p, min_p, streams, chunk_bytes=1 << 25):
    """The sampling op: (tokens, valid) for output rows probs[indices] (or probs); top_k / top_p /
    min_p are [batch] tensors or None per the filter ('none', 'top_k', 'top_p', 'min_p',
    'top_k_top_p'); invalid rows (no mass, NaN, an index outside probs) give token 0.

    Memory is bounded whatever the number of samples: the distributions are built once per distinct
    (row, parameters), chunk_bytes of float64 at a time, and each sample draws from its own by one
    search of a number drawn for it first (so the draws do not depend on the chunking)."""
    rows, vocab = probs.shape
    index = torch.arange(rows) if indices is None else indices.long().cpu()
    n = index.shape[0]
    inside = (index >= 0) & (index < rows)
    u = streams.uniforms(n)
    params = {"top_k": top_k if "top_k" in filter else None, "top_p": top_p if "top_p" in filter else None,
              "min_p": min_p if filter == "min_p" else None}
    columns = [index.clamp(0, max(rows - 1, 0)).double()] + [v.cpu().double() for v in params.values() if v is not None]
    distinct, which = torch.unique(torch.stack(columns, 1), dim=0, return_inverse=True)
    order = torch.argsort(which, stable=True)  # the samples grouped by their distribution
    ends = torch.cumsum(torch.bincount(which, minlength=distinct.shape[0]), 0).tolist()
    mass = _mass(probs.cpu())
    token = torch.full((n,), -1, dtype=torch.long)
    chunk = max(1, chunk_bytes // (8 * max(vocab, 1)))
    for c0 in range(0, distinct.shape[0], chunk):
        c1 = min(c0 + chunk, distinct.shape[0])
        d = distinct[c0:c1]
        columns = iter(d[:, 1:].unbind(1))
        args = {name: next(columns) if v is not None else None for name, v in params.items()}
        if args["top_k"] is not None:
            args["top_k"] = args["top_k"].long()
        p = mass[d[:, 0].long()]
        weights = torch.where(kept(p, **args), p, 0.0)
        cdf = torch.cumsum(weights, dim=1)
        total = cdf[:, -1]
        ok = (total > 0) & torch.isfinite(total)
        # each distribution's cdf in [0, 1], shifted by its number: one sorted sequence for all of them
        local = torch.arange(c1 - c0, dtype=torch.float64)[:, None]
        flat = (cdf / torch.where(ok, total, 1.0)[:, None] + local).reshape(-1)
        samples = order[(ends[c0 - 1] if c0 else 0) : ends[c1 - 1]]
        r = which[samples] - c0
        t = torch.searchsorted(flat, r + u[samples], right=True) - r * vocab
        last_kept = vocab - 1 - torch.argmax(torch.flip(weights > 0, [1]).int(), dim=1)  # u near 1 may round past it
        token[samples] = torch.where(ok[r], torch.minimum(t.clamp(min=0), last_kept[r]), -1)
    valid = (token >= 0) & inside
    return torch.where(valid, token, 0), valid


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


def softmax(logits, temperature):
    """softmax(logits / temperature) of each row in float64: temperature [rows] (or a value). NaN, +inf and
    rows of -inf only give NaN rows, as torch.softmax."""
    t = temperature.double()[:, None] if isinstance(temperature, torch.Tensor) else float(temperature)
    return torch.softmax(logits.double() / t, dim=1)


def children(parents, u):
    return [c for c in range(u + 1, len(parents)) if parents[c] == u]


def speculative(target, draft, candidates, first_candidate, parents, mode, streams):
    """The speculative op (csrc/include/flashkern/ops.h: SpeculativeParams) as a Python walk per
    request in float64: (tokens [batch, nodes], nodes [batch, nodes - 1], num_accepted [batch],
    independent_accepted [batch])."""
    batch, nodes, vocab = target.shape
    tokens = torch.full((batch, nodes), -1, dtype=torch.int32)
    path = torch.full((batch, max(nodes - 1, 0)), -1, dtype=torch.int32)
    accepted = torch.zeros(batch, dtype=torch.int32)
    independent = torch.zeros(batch, dtype=torch.int32)
    coins = [torch.rand(nodes, dtype=torch.float64, generator=streams.generator(b)) for b in range(batch)] \
        if mode == "sample" else None  # greedy draws nothing
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
                        if 0 <= t < vocab and coins[b][c] * q[t] < r[t]:
                            nxt = c
                            break
                        residual = (r - q).clamp_min(0)
                    else:
                        if 0 <= t < vocab and coins[b][c] < r[t]:
                            nxt = c
                            break
                        if 0 <= t < vocab:
                            residual[t] = 0
                if nxt is None:
                    weights = residual if residual.sum() > 0 else p
                    emitted = max(int(draw(weights[None], streams.generator(b))[0]), 0)
            if nxt is not None:
                tokens[b, n], path[b, n] = token_of(nxt), nxt
                n, u = n + 1, nxt
        tokens[b, n] = emitted
        accepted[b] = n
        if parents is None and mode == "sample":
            for c in range(1, nodes):
                t = token_of(c)
                q_t = 1.0 if draft is None else float(draft[b, c - 1, t]) if 0 <= t < vocab else 0.0
                if 0 <= t < vocab and float(coins[b][c]) * q_t < float(target[b, c - 1, t]):
                    independent[b] += 1
    return tokens, path, accepted, independent
