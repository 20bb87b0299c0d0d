"""Speculative decoding with a tree of candidates (Medusa, EAGLE): the tree's attention mask and
positions for the verification pass, and the acceptance step, greedy or by rejection sampling.

A tree of N nodes is given by ``parents`` ([N] or [batch, N], int): node 0 is the root, the last
token already accepted; node i > 0 is a candidate token whose parent is ``parents[i] < i``
(``parents[0]`` is ignored, -1 by convention). The candidates' token ids are ``candidate_ids``
[batch, N] (entry 0: the root's token, not read). The verification pass runs the target model on
the N tokens (prefill attention with ``tree_attention_mask``, positions from ``tree_positions``)
and gives one distribution per node: the target's next token after the path root..node.

The children of a node are tried in index order. The acceptance step walks from the root: greedy,
to the first child whose token is the target's argmax; sampling, by SpecInfer's rule (see
tree_speculative_sampling). Both return a TreeVerification: ``tokens`` [batch, N] (the accepted
candidates' tokens, then the token the target emits after them, then -1), ``nodes`` [batch, N - 1]
(the accepted candidates' node indices, for the KV cache, then -1), ``num_accepted`` [batch].
"""

from typing import NamedTuple

import torch

from .sampling import _speculative


class TreeVerification(NamedTuple):
    tokens: torch.Tensor
    nodes: torch.Tensor
    num_accepted: torch.Tensor


def _parents(op, parents, device=None):
    if not isinstance(parents, torch.Tensor):
        parents = torch.tensor(parents, dtype=torch.int32)
    if parents.dim() not in (1, 2) or parents.shape[-1] < 1:
        raise ValueError(f"{op}: parents must be [nodes] or [batch, nodes] with at least the root, got shape "
                         f"{tuple(parents.shape)}")
    if parents.dtype not in (torch.int32, torch.int64):
        raise TypeError(f"{op}: parents must be int32 or int64, got {parents.dtype}")
    return parents.to(device=device if device is not None else parents.device, dtype=torch.int32).contiguous()


def _check_tree(op, parents):
    """The tree's shape, checked on the host (parents[i] < i); a device tensor is copied (a sync)."""
    p = parents.cpu().long().reshape(-1, parents.shape[-1])
    n = p.shape[1]
    bad = (p[:, 1:] < 0) | (p[:, 1:] >= torch.arange(1, n))
    if bad.any():
        raise ValueError(f"{op}: parents[i] must be in [0, i) for every node i > 0 (node 0 is the root)")
    return p


def tree_positions(parents, start=0):
    """Each node's depth in the tree (the root 0) plus ``start``: the positions of the N verified
    tokens when the root sits at position ``start``. [N] or [batch, N] int64, on parents' device."""
    parents = _parents("tree_positions", parents)
    p = _check_tree("tree_positions", parents)
    depth = torch.zeros_like(p)
    for i in range(1, p.shape[1]):  # parents come first: one pass in index order
        depth[:, i] = depth.gather(1, p[:, i:i + 1]).squeeze(1) + 1
    return (depth + start).reshape(parents.shape).to(parents.device)


def tree_attention_mask(parents, prefix_len=0):
    """The boolean attention mask of the verification pass: [N, prefix_len + N] (or [batch, N,
    prefix_len + N]); node i sees the ``prefix_len`` tokens before the root and its own ancestors
    and itself. Flattened row-major per request (``mask.flatten()``, or the concatenation of the
    requests' masks) it is the ``custom_mask`` of the prefill wrappers' plan()."""
    parents = _parents("tree_attention_mask", parents)
    p = _check_tree("tree_attention_mask", parents)
    batch, n = p.shape
    ancestor = torch.eye(n, dtype=torch.bool).repeat(batch, 1, 1)
    for i in range(1, n):  # node i sees what its parent sees, and itself
        ancestor[:, i] |= ancestor[torch.arange(batch), p[:, i]]
    mask = torch.cat([torch.ones(batch, n, prefix_len, dtype=torch.bool), ancestor], dim=2)
    return mask.reshape(*parents.shape[:-1], n, prefix_len + n).to(parents.device)


def _candidates(op, candidate_ids):
    if not isinstance(candidate_ids, torch.Tensor):
        raise TypeError(f"{op}: candidate_ids must be a torch.Tensor, got {type(candidate_ids).__name__}")
    if candidate_ids.dtype == torch.int64:
        candidate_ids = candidate_ids.int()
    return candidate_ids.contiguous()


def verify_tree_greedy(candidate_ids, parents, target_logits):
    """Greedy verification: from the root, move to the first child whose token is the argmax of the
    target at the current node (ties: the lowest token id); stop at a node without one and emit that
    argmax. Equals running greedy decoding with the target model on the accepted path.

    candidate_ids [batch, N] int32/int64, parents [N] or [batch, N], target_logits [batch, N, vocab]
    (float16, bfloat16 or float32; logits or probabilities). One block per request reads the target
    rows of the nodes on its path only. Returns a TreeVerification."""
    op = "verify_tree_greedy"
    parents = _parents(op, parents, target_logits.device)
    result = _speculative(op, target_logits, None, _candidates(op, candidate_ids), 0, parents, "greedy", None, 0, 0)
    return TreeVerification(*result[:3])


def tree_speculative_sampling(candidate_ids, parents, target_probs, draft_probs=None, generator=None, seed=None,
                              offset=None):
    """Rejection sampling along the tree (SpecInfer, Miao et al. 2024): at node u with target
    distribution p, child c is accepted with probability min(1, r(c) / q(c)), where r is the residual
    (at first p) and q the draft distribution at u; after a rejection r becomes norm(max(0, r - q)) and
    the next sibling is tried; when none is accepted, a token is drawn from r (at a leaf, from p).
    The emitted tokens follow the target distribution exactly when the children of u were drawn
    independently from ``draft_probs[:, u]``; with ``draft_probs=None`` the children are fixed
    proposals (a point mass each, e.g. the draft's top-k, as EAGLE's trees): a rejected child's token
    is removed from r, and again the output follows the target.

    candidate_ids [batch, N], parents [N] or [batch, N], target_probs [batch, N, vocab] float32,
    draft_probs [batch, N (or N - 1: leaves need none), vocab] float32 or None. Random numbers as in
    flashkern.sampling (generator, or explicit seed and offset). Returns a TreeVerification."""
    op = "tree_speculative_sampling"
    parents = _parents(op, parents, target_probs.device)
    result = _speculative(op, target_probs, draft_probs, _candidates(op, candidate_ids), 0, parents, "sample",
                          generator, seed, offset)
    return TreeVerification(*result[:3])
