"""Speculative decoding on every device: chain speculative sampling (FlashInfer's example exactly; the
emitted tokens follow the target, the acceptance counts match their expectation), greedy tree
verification against a Python walk, tree rejection sampling's output distribution (with a draft and
with fixed proposals), the tree's attention mask and positions, bad input."""

import pytest
import torch
from conftest import emulated
from test_sampling import chi2_pvalue

import flashkern
from flashkern import spec


def test_chain_flashinfer_example(device):
    """FlashInfer's docstring example is deterministic: token 2 is always accepted (p >= q), token 1 never
    (p = 0), the residual max(0, p - q) at position 1 is all on token 0."""
    draft = torch.tensor([[[0.1, 0.2, 0.3, 0.4], [0.2, 0.3, 0.4, 0.1]]], device=device)
    ids = torch.tensor([[2, 1]], dtype=torch.int32, device=device)
    target = torch.tensor([[[0.0, 0.1, 0.6, 0.3], [1.0, 0.0, 0.0, 0.0], [0.7, 0.1, 0.1, 0.1]]], device=device)
    accepted, emitted = torch.full((1,), 5, dtype=torch.int32, device=device), torch.zeros(1, dtype=torch.int32,
                                                                                           device=device)
    out, a, e = flashkern.chain_speculative_sampling(draft, ids, target, accepted, emitted, seed=1, offset=0)
    assert out.tolist() == [[2, 0, -1]]
    assert a is accepted and a.tolist() == [6] and e.tolist() == [1]  # added in place: 5 + 1


def test_chain_distribution(device):
    """Drafts drawn from q: the first emitted token follows the target at position 0 whatever q is; the
    mean number of accepted draft tokens is sum_i prod_{j<=i} alpha_j (alpha = sum min(p, q)), the
    independent count sum_i alpha_i (5 standard errors)."""
    batch, n, vocab = (4000 if not emulated(device) else 400), 3, 12
    g = torch.Generator().manual_seed(0)
    q = torch.softmax(torch.randn(n, vocab, generator=g) * 1.5, -1)
    p = torch.softmax(torch.randn(n + 1, vocab, generator=g) * 1.5, -1)
    ids = torch.multinomial(q, batch, replacement=True, generator=g).T.int()
    draft, target = q.expand(batch, n, vocab).contiguous(), p.expand(batch, n + 1, vocab).contiguous()
    out, accepted, emitted = flashkern.chain_speculative_sampling(
        draft.to(device), ids.to(device), target.to(device), generator=torch.Generator(device).manual_seed(4))
    out, accepted, emitted = out.cpu(), accepted.cpu().double(), emitted.cpu().double()
    assert chi2_pvalue(torch.bincount(out[:, 0].long(), minlength=vocab), p[0]) > 1e-3
    alpha = torch.minimum(p[:n], q).sum(1).double()
    for observed, expected_mean, values in ((emitted, torch.cumprod(alpha, 0).sum(), emitted),
                                            (accepted, alpha.sum(), accepted)):
        se = values.std() / batch**0.5
        assert abs(observed.mean() - expected_mean) < 5 * se + 1e-9
    for b in range(min(batch, 50)):  # accepted prefix, then the emitted token, then -1
        k = int(emitted[b])
        assert out[b, :k].tolist() == ids[b, :k].tolist()
        assert 0 <= out[b, k] < vocab and (out[b, k + 1:] == -1).all()


def random_tree(nodes, seed):
    g = torch.Generator().manual_seed(seed)
    return [-1] + [int(torch.randint(0, i, (1,), generator=g)) for i in range(1, nodes)]


def greedy_walk(cand, parents, logits):
    """The Python loop the kernel must equal: per request, tokens, nodes, accepted count."""
    tokens, nodes = [], []
    u = 0
    while True:
        best = int(torch.argmax(logits[u].double()))  # the first maximum: the lowest token id
        child = next((c for c in range(u + 1, len(parents)) if parents[c] == u and int(cand[c]) == best), None)
        if child is None:
            return tokens + [best], nodes
        tokens.append(int(cand[child]))
        nodes.append(child)
        u = child


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_verify_tree_greedy(device, dtype):
    batch, nodes, vocab = 6, 26, 37
    parents = torch.tensor([random_tree(nodes, s) for s in range(batch)], dtype=torch.int32)
    g = torch.Generator().manual_seed(1)
    logits = torch.randn(batch, nodes, vocab, generator=g).to(dtype)
    logits[0, 0, :5] = logits[0, 0].max()  # a tie: the lowest token id wins
    cand = torch.randint(0, vocab, (batch, nodes), generator=g, dtype=torch.int32)
    for b in range(batch):  # plant the argmax along a path so that paths get long
        u = 0
        for c in range(1, nodes):
            if parents[b, c] == u and torch.rand(1, generator=g) < 0.8:
                cand[b, c] = int(torch.argmax(logits[b, u].double()))
                u = c
    result = spec.verify_tree_greedy(cand.to(device), parents.to(device), logits.to(device))
    for b in range(batch):
        tokens, path = greedy_walk(cand[b], parents[b].tolist(), logits[b])
        k = len(path)
        assert result.num_accepted[b] == k
        assert result.tokens[b].tolist() == tokens + [-1] * (nodes - k - 1)
        assert result.nodes[b].tolist() == path + [-1] * (nodes - 1 - k)
    assert max(result.num_accepted.tolist()) >= 2


@pytest.mark.parametrize("with_draft", [True, False])
def test_tree_sampling_distribution(device, with_draft):
    """The first emitted token follows the root's target distribution: with a draft, when the root's
    three children are drawn from it; without, for fixed proposals (the draft's top 3), where a
    rejected child's token leaves the residual. Deeper nodes: a second level under child 1."""
    batch, vocab = (4000 if not emulated(device) else 400), 8
    parents = [-1, 0, 0, 0, 1, 1]
    g = torch.Generator().manual_seed(2)
    p = torch.softmax(torch.randn(6, vocab, generator=g) * 1.5, -1)
    q = torch.softmax(torch.randn(6, vocab, generator=g) * 1.5, -1)
    if with_draft:
        cand = torch.multinomial(q[[0, 0, 0, 0, 1, 1]], batch, replacement=True, generator=g).T.int()
    else:
        top = torch.topk(q, 3, dim=1).indices
        cand = torch.stack([top[0, 0], top[0, 0], top[0, 1], top[0, 2], top[1, 0], top[1, 1]]).int().expand(batch, 6)
    result = spec.tree_speculative_sampling(cand.contiguous().to(device), parents,
                                            p.expand(batch, 6, vocab).contiguous().to(device),
                                            q.expand(batch, 6, vocab).contiguous().to(device) if with_draft else None,
                                            generator=torch.Generator(device).manual_seed(9))
    tokens, accepted = result.tokens.cpu(), result.num_accepted.cpu()
    assert chi2_pvalue(torch.bincount(tokens[:, 0].long(), minlength=vocab), p[0]) > 1e-3
    # given the first accepted node is child 1, the next token follows p[1]
    via1 = (result.nodes.cpu()[:, 0] == 1)
    if via1.sum() > 200:
        assert chi2_pvalue(torch.bincount(tokens[via1, 1].long(), minlength=vocab), p[1]) > 1e-3
    assert (accepted <= 2).all()


def test_tree_mask_and_positions():
    parents = [-1, 0, 0, 1, 1, 2, 4]
    mask = spec.tree_attention_mask(parents, prefix_len=3)
    positions = spec.tree_positions(parents, start=10)
    assert positions.tolist() == [10, 11, 11, 12, 12, 12, 13]
    for i in range(7):
        ancestors, u = {i}, i
        while u > 0:
            u = parents[u]
            ancestors.add(u)
        assert mask[i].tolist() == [True] * 3 + [j in ancestors for j in range(7)]
    batched = spec.tree_attention_mask(torch.tensor([parents, [-1, 0, 1, 2, 3, 4, 5]]))
    assert batched.shape == (2, 7, 7) and torch.equal(batched[1], torch.ones(7, 7, dtype=torch.bool).tril())
    with pytest.raises(ValueError, match="parents"):
        spec.tree_positions([-1, 0, 2])


def test_tree_mask_drives_prefill():
    """The mask is the prefill wrappers' custom_mask: attention over a prefix and a tree equals, per
    node, attention over the prefix and the node's ancestors."""
    parents, prefix, heads, dim = [-1, 0, 0, 1, 2], 6, 2, 64
    n = len(parents)
    g = torch.Generator().manual_seed(0)
    q = torch.randn(n, heads, dim, generator=g).half()
    k = torch.randn(prefix + n, heads, dim, generator=g).half()
    v = torch.randn(prefix + n, heads, dim, generator=g).half()
    mask = spec.tree_attention_mask(parents, prefix_len=prefix)
    out = flashkern.single_prefill_with_kv_cache(q, k, v, custom_mask=mask)
    for i in range(n):
        keys = torch.nonzero(mask[i]).flatten()
        expected = flashkern.single_prefill_with_kv_cache(q[i:i + 1], k[keys], v[keys])
        torch.testing.assert_close(out[i:i + 1].float(), expected.float(), atol=2e-3, rtol=2e-3)


def test_bad_input(device):
    target = torch.softmax(torch.randn(2, 4, 16), -1).to(device)
    cand = torch.zeros(2, 4, dtype=torch.int32, device=device)
    with pytest.raises(TypeError, match="float32"):
        spec.tree_speculative_sampling(cand, [-1, 0, 0, 1], target.half())
    with pytest.raises(ValueError, match="parents"):
        spec.tree_speculative_sampling(cand, [-1, 0, 0], target)
    with pytest.raises(ValueError, match="candidate token ids"):
        spec.verify_tree_greedy(cand[:, :3], [-1, 0, 0, 1], target)
    with pytest.raises(ValueError, match="draft_probs"):
        flashkern.chain_speculative_sampling(target[:, :2], cand[:, :3], target)
    with pytest.raises(TypeError, match="int32"):
        flashkern.chain_speculative_sampling(target[:, :3], cand[:, :3].float(), target)
    with pytest.raises(TypeError, match="maybe_output_accepted_token_num must be int32"):
        flashkern.chain_speculative_sampling(target[:, :3], cand[:, :3], target,
                                             torch.zeros(2, dtype=torch.float16, device=device))
    with pytest.raises(ValueError, match="maybe_output_emitted_draft_token_num must have shape"):
        flashkern.chain_speculative_sampling(target[:, :3], cand[:, :3], target, None,
                                             torch.zeros(3, dtype=torch.int32, device=device))
    if str(device) == "cpu":  # checked without a device synchronization only (on a GPU: a rejection)
        with pytest.raises(ValueError, match=r"token ids must be in \[0, vocab=16\), got 16"):
            flashkern.chain_speculative_sampling(target[:, :3], cand[:, :3] + 16, target)
        with pytest.raises(ValueError, match=r"token ids must be in \[0, vocab=16\), got -1"):
            spec.verify_tree_greedy(cand - 1, [-1, 0, 0, 1], target)


def test_opcheck():
    target = torch.softmax(torch.randn(2, 4, 16), -1)
    draft = torch.softmax(torch.randn(2, 3, 16), -1)
    ids = torch.randint(0, 16, (2, 3), dtype=torch.int32)
    torch.library.opcheck(torch.ops.flashkern.speculative.default,
                          (target, draft, ids, 1, None, "sample", None, 3, None, 0))
