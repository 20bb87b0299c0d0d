"""Sampling and renormalization on every device: the tokens a filter keeps, computed here in float64
from a stable sort (ties to the lower index), are the only ones drawn; the drawn tokens follow the
renormalized kept probabilities (chi-square, p = 1e-3, with the power to reject an off-by-one filter);
renormalization equals the float64 reference bit for bit in which tokens it keeps; seeds repeat;
invalid rows and bad arguments. The emulated kernels draw fewer samples (each row is a 1024-thread
block run on fibers, about 50 ms), the reference many."""

import pytest
import torch
from conftest import emulated, requires_gpu

import flashkern
from flashkern import ref
from flashkern.ref.sampling import kept

FILTERS = ["none", "top_k", "top_p", "min_p", "joint"]


def chi2_pvalue(counts, probs):
    """p-value of observed counts against expected probabilities (chi-square, cells with mass)."""
    counts, probs = counts.double(), probs.double() / probs.sum()
    n = counts.sum()
    cells = probs > 0
    if (counts[~cells] > 0).any():
        return 0.0  # a token without mass was drawn
    expected = n * probs[cells]
    stat = ((counts[cells] - expected) ** 2 / expected).sum()
    dof = max(int(cells.sum()) - 1, 1)
    return float(torch.special.gammaincc(torch.tensor(dof / 2.0, dtype=torch.float64), stat / 2))


def distribution(vocab, seed, ties=True):
    """A peaked row with a tie run at the top-k boundary, a near-zero tail and zeros."""
    g = torch.Generator().manual_seed(seed)
    logits = torch.randn(vocab, generator=g, dtype=torch.float64) * 1.5
    if ties:
        logits[3:9] = logits.sort(descending=True).values[4]  # six equal values around rank 5
    p = torch.softmax(logits, 0)
    p[-3:] = torch.tensor([1e-12, 0.0, 0.0], dtype=torch.float64)
    return (p / p.sum()).float()


def call(filter, probs, params, **kw):
    if filter == "none":
        return flashkern.sampling_from_probs(probs, **kw)
    if filter == "top_k":
        return flashkern.top_k_sampling_from_probs(probs, params["top_k"], **kw)
    if filter == "top_p":
        return flashkern.top_p_sampling_from_probs(probs, params["top_p"], **kw)
    if filter == "min_p":
        return flashkern.min_p_sampling_from_probs(probs, params["min_p"], **kw)
    return flashkern.top_k_top_p_sampling_from_probs(probs, params["top_k"], params["top_p"],
                                                     filter_apply_order="joint", **kw)


def kept_of(filter, probs, params):
    rows = probs.shape[0]

    def per_row(name, dtype):
        v = params[name]
        return v.cpu().to(dtype) if isinstance(v, torch.Tensor) else torch.full((rows,), v, dtype=dtype)

    return kept(probs.cpu(),
                top_k=per_row("top_k", torch.int64) if filter in ("top_k", "joint") else None,
                top_p=per_row("top_p", torch.float64) if filter in ("top_p", "joint") else None,
                min_p=per_row("min_p", torch.float64) if filter == "min_p" else None)


@pytest.mark.parametrize("filter", FILTERS)
def test_only_kept_tokens(device, filter):
    """Rows of 4099 tokens with ties at the boundaries, per-row parameters and an indices map (two
    samples of some rows): every token drawn is kept by the row's filter; int64 indices give int64."""
    rows, vocab = 6, 4099
    probs = torch.stack([distribution(vocab, seed) for seed in range(rows)])
    probs[1] = 1.0 / vocab                    # flat: the filters need many rounds
    probs[2] *= 0.37                          # a row that does not sum to 1
    indices = torch.tensor([0, 1, 2, 3, 4, 5, 0, 3, 2, 1], dtype=torch.int64)
    batch = indices.shape[0]
    params = {"top_k": torch.tensor([5, 1, 7, 40, 4099, 2], dtype=torch.int32)[indices],
              "top_p": torch.tensor([0.5, 0.01, 0.9, 0.2, 1.0, 0.75])[indices],
              "min_p": torch.tensor([0.3, 1.0, 0.05, 0.5, 0.0, 0.9])[indices]}
    allowed = kept_of(filter, probs[indices], params)
    params = {k: v.to(device) for k, v in params.items()}
    samples, valid = call(filter, probs.to(device), params, indices=indices.to(device), return_valid=True,
                          generator=torch.Generator(device).manual_seed(7))
    assert samples.dtype == torch.int64 and samples.shape == (batch,)
    assert valid.all()
    samples = samples.cpu()
    assert allowed[torch.arange(batch), samples].all(), (filter, samples)
    if filter == "top_k":  # the flat row keeps exactly token 0 (the tie goes to the lowest index)
        assert samples[1] == 0 and samples[9] == 0


@pytest.mark.parametrize("filter", FILTERS)
def test_distribution(device, filter):
    """The drawn tokens follow the renormalized kept probabilities, and the same counts reject the
    distribution of a filter that keeps one token more (or less): an off-by-one boundary."""
    if emulated(device) and (filter != "joint" or device.backend != "emulate"):
        pytest.skip("emulated: joint top-k + top-p on the CUDA build only (50 ms a sample; test_only_kept_tokens "
                    "runs every filter on both builds)")
    vocab, n = 50, (20000 if not emulated(device) else 500)
    probs = distribution(vocab, seed=11)
    params = {"top_k": 8, "top_p": 0.6, "min_p": 0.1}
    indices = torch.zeros(n, dtype=torch.int32)
    samples = call(filter, probs[None].to(device), params, indices=indices.to(device),
                   generator=torch.Generator(device).manual_seed(3)).cpu()
    counts = torch.bincount(samples.long(), minlength=vocab)
    keep = kept_of(filter, probs[None], params)[0]
    assert chi2_pvalue(counts, torch.where(keep, probs, 0.0)) > 1e-3
    if filter in ("top_k", "joint", "top_p"):
        order = torch.sort(probs, descending=True, stable=True).indices
        kept_count = int(keep.sum())
        for wrong in (kept_count - 1, kept_count + 1):
            wrong_keep = torch.zeros(vocab, dtype=torch.bool)
            wrong_keep[order[:wrong]] = True
            assert chi2_pvalue(counts, torch.where(wrong_keep, probs, 0.0)) < 1e-3, wrong


def test_unnormalized_and_large_rows(device):
    """Rows summing to 0.3 and to 3 draw from the row as given (a kernel repeats a pass with the exact
    mass); a 131075-token row (a vector tail) keeps the top 3 exactly."""
    vocab, n = 20, (8000 if not emulated(device) else 150)
    p = distribution(vocab, seed=5, ties=False)
    for scale in (0.3, 3.0):
        samples = flashkern.sampling_from_probs((p * scale)[None].to(device), indices=torch.zeros(n, dtype=torch.int32,
                                                device=device), generator=torch.Generator(device).manual_seed(1))
        assert chi2_pvalue(torch.bincount(samples.cpu().long(), minlength=vocab), p) > 1e-3, scale
    big = torch.stack([distribution(131075, seed=s, ties=False) for s in (1, 2)])
    samples = flashkern.top_k_sampling_from_probs(big.to(device), 3, generator=torch.Generator(device).manual_seed(2))
    top3 = big.topk(3, dim=1).indices
    assert (top3 == samples.cpu().long()[:, None]).any(dim=1).all()


def test_millions_of_samples_of_a_few_rows():
    """5M samples over a 32K vocabulary through `indices` (three rows, top-k 40) on the reference: each
    distribution is built once (as [5M, 32K] float64 it would be 1.3 TB). Only kept tokens, and each
    row's token counts within 6 standard deviations of the renormalized top 40."""
    vocab, n = 32000, 5_000_000
    probs = torch.stack([distribution(vocab, seed=s, ties=False) for s in (7, 8, 9)])
    indices = torch.randint(0, 3, (n,), generator=torch.Generator().manual_seed(3), dtype=torch.int32)
    samples = flashkern.top_k_sampling_from_probs(probs, 40, indices=indices, seed=11, offset=0).long()
    for row in range(3):
        drawn = samples[indices == row]
        expected = torch.where(kept(probs[row : row + 1], top_k=torch.tensor([40]))[0], probs[row].double(), 0.0)
        expected = expected / expected.sum() * drawn.numel()
        counts = torch.bincount(drawn, minlength=vocab).double()
        assert counts[expected == 0].sum() == 0
        assert ((counts - expected).abs() <= 6 * expected.sqrt() + 1).all()


@pytest.mark.parametrize("op,param,value", [
    (flashkern.min_p_sampling_from_probs, "min_p", 0.1), (flashkern.top_p_renorm_probs, "top_p", 0.5),
    (flashkern.top_k_renorm_probs, "top_k", 10), (flashkern.top_k_sampling_from_probs, "top_k", 10)])
def test_flashinfer_error_phrases(device, op, param, value):
    """A per-row parameter tensor of the wrong rank or length: ValueError in the words FlashInfer's tests
    match (tests/utils/test_sampling.py there)."""
    probs = torch.softmax(torch.randn(5, 111, generator=torch.Generator().manual_seed(0)), -1).to(device)
    dtype = torch.int32 if param == "top_k" else torch.float32
    with pytest.raises(ValueError, match=r"Expected a 1D tensor or scalar.*got a 2D tensor"):
        op(probs, torch.full((5, 111), value, dtype=dtype, device=device))
    with pytest.raises(ValueError, match=r"Expected a 1D tensor of shape \(batch_size,\) or scalar.*got a "
                                         r"0-dimensional tensor"):
        op(probs, torch.tensor(value, dtype=dtype, device=device))
    with pytest.raises(ValueError, match="Sampling parameter.*batch size mismatch"):
        op(probs, torch.tensor([value], dtype=dtype, device=device))


def test_seeds_repeat(device):
    """The same generator state, seed or offset gives the same tokens; another gives others."""
    probs = torch.stack([distribution(300, seed=s, ties=False) for s in range(8)]).to(device)

    def draw(**kw):
        return flashkern.top_p_sampling_from_probs(probs, 0.95, **kw).cpu()

    a = draw(generator=torch.Generator(device).manual_seed(5))
    assert torch.equal(a, draw(generator=torch.Generator(device).manual_seed(5)))
    assert not torch.equal(a, draw(generator=torch.Generator(device).manual_seed(6)))
    b = draw(seed=123, offset=4)
    assert torch.equal(b, draw(seed=torch.tensor([123], device=device), offset=torch.tensor([4], device=device)))
    assert not torch.equal(b, draw(seed=123, offset=5))
    # a seed per row: each row's own stream (test_seed_per_row_is_a_request_of_its_own), repeatable
    per_row = draw(seed=torch.arange(8, device=device) + 123, offset=torch.full((8,), 4, device=device))
    assert torch.equal(per_row, draw(seed=torch.arange(8, device=device) + 123, offset=torch.full((8,), 4, device=device)))


def test_seed_past_64_bits_is_refused(device):
    """A seed or offset past 64 bits wrapped (2^64 + 123 drew seed 123's tokens): ValueError. 2^64 - 1 (a
    uint64's largest) and -2^63 are taken."""
    probs = torch.stack([distribution(50, seed=s, ties=False) for s in range(2)]).to(device)
    for bad in (2**64, 2**64 + 123, -(2**63) - 1):
        with pytest.raises(ValueError, match=r"seed must fit 64 bits \(in \[-2\^63, 2\^64\)\)"):
            flashkern.sampling_from_probs(probs, seed=bad, offset=0)
        with pytest.raises(ValueError, match=r"offset must fit 64 bits"):
            flashkern.sampling_from_probs(probs, seed=1, offset=bad)
    for fine in (2**64 - 1, -(2**63)):
        flashkern.sampling_from_probs(probs, seed=fine, offset=0)


def test_seed_per_row_is_a_request_of_its_own(device):
    """With a [batch] seed (a serving engine's per-request seeds), a row's token depends on its own seed,
    offset and probabilities only: the same at any position, in any batch, alone."""
    probs = torch.stack([distribution(300, seed=s, ties=False) for s in range(6)]).to(device)
    seeds, offsets = torch.tensor([11, 22, 33, 44, 55, 66], device=device), torch.tensor([3, 1, 4, 1, 5, 9], device=device)

    def draw(rows):
        return flashkern.top_p_sampling_from_probs(probs[rows], 0.9, seed=seeds[rows], offset=offsets[rows]).cpu()

    tokens = draw([0, 1, 2, 3, 4, 5])
    order = [4, 2, 5, 0, 3, 1]
    assert torch.equal(draw(order), tokens[order])
    assert torch.equal(draw([3, 1]), tokens[[3, 1]])
    assert int(draw([2])[0]) == int(tokens[2])
    target = torch.softmax(torch.randn(6, 4, 50, generator=torch.Generator().manual_seed(7)), -1).to(device)
    draft = torch.softmax(torch.randn(6, 3, 50, generator=torch.Generator().manual_seed(8)), -1).to(device)
    ids = torch.randint(0, 50, (6, 3), dtype=torch.int32, generator=torch.Generator().manual_seed(9)).to(device)

    def chain(rows):
        return flashkern.chain_speculative_sampling(draft[rows], ids[rows], target[rows], seed=seeds[rows],
                                                    offset=offsets[rows])[0].cpu()

    assert torch.equal(chain(order), chain(list(range(6)))[order])


def test_invalid_rows(device):
    """No mass, NaN (a whole row, or one probability of a good row), inf or an index outside probs: token 0
    and valid False, on every backend; check_nan raises."""
    one_nan = distribution(64, seed=2)
    one_nan[17] = float("nan")
    probs = torch.stack([distribution(64, seed=1), torch.zeros(64), torch.full((64,), float("nan")),
                         torch.full((64,), float("inf")), one_nan]).to(device)
    for fn in (lambda **kw: flashkern.sampling_from_probs(probs, **kw),
               lambda **kw: flashkern.top_k_sampling_from_probs(probs, 3, **kw),
               lambda **kw: flashkern.top_p_sampling_from_probs(probs, 0.5, **kw),
               lambda **kw: flashkern.min_p_sampling_from_probs(probs, 0.1, **kw)):
        samples, valid = fn(return_valid=True, seed=1, offset=0)
        assert valid.tolist() == [True, False, False, False, False]
        assert samples[1:].tolist() == [0, 0, 0, 0]
    samples, valid = flashkern.sampling_from_probs(probs, indices=torch.tensor([0, 9, -1], device=device),
                                                   return_valid=True, seed=1, offset=0)
    assert valid.tolist() == [True, False, False] and samples[1:].tolist() == [0, 0]
    with pytest.raises(ValueError, match="NaN"):
        flashkern.sampling_from_probs(probs, check_nan=True)


def test_negative_probabilities_count_as_zero(device):
    """A negative probability is no mass (the module docstring): never drawn, on every backend."""
    p = distribution(50, seed=4, ties=False)
    p[::3] = -p[::3]
    n = 3000 if not emulated(device) else 60
    samples = flashkern.sampling_from_probs(p[None].to(device), indices=torch.zeros(n, dtype=torch.int32, device=device),
                                            seed=5, offset=0)
    assert not bool((p[samples.cpu().long()] <= 0).any())


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16, torch.bfloat16])
def test_renorm(device, dtype):
    """top_k_renorm_probs, top_p_renorm_probs and top_k_mask_logits keep exactly the reference's tokens
    (ties at the boundary to the lowest index), per-row and scalar parameters, a vector tail."""
    rows, vocab = 5, 1027
    probs = torch.stack([distribution(vocab, seed=s) for s in range(rows)])
    probs[1] = 1.0 / vocab
    probs = probs.to(dtype)
    k = torch.tensor([5, 1, 9, 1027, 100], dtype=torch.int32)
    p = torch.tensor([0.5, 0.3, 0.9, 1.0, 0.05])
    for name, fn, param, kw in (("top_k", flashkern.top_k_renorm_probs, k, "top_k"),
                                ("top_p", flashkern.top_p_renorm_probs, p, "top_p")):
        for value in (param, param[0].item()):
            out = fn(probs.to(device), value.to(device) if isinstance(value, torch.Tensor) else value).cpu()
            per_row = value if isinstance(value, torch.Tensor) else torch.full((rows,), value)
            keep = kept(probs.float(), **{kw: per_row})
            assert out.dtype == dtype
            assert torch.equal(out > 0, keep & (probs > 0)), name
            expected = torch.where(keep, probs.double(), 0.0)
            expected = expected / expected.sum(dim=1, keepdim=True)
            torch.testing.assert_close(out.double(), expected, **({} if dtype == torch.float32 else
                                                                   dict(atol=1e-2, rtol=1e-2)))
    logits = torch.log(probs.float()).to(dtype)
    masked = flashkern.top_k_mask_logits(logits.to(device), k.to(device)).cpu()
    keep = kept(torch.softmax(logits.double(), dim=1), top_k=k)  # the order of the rounded logits
    assert torch.equal(torch.isfinite(masked), keep & torch.isfinite(logits))  # log(0) = -inf stays
    assert torch.equal(masked[keep], logits[keep])


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16, torch.float32])
def test_renorm_views_and_special_values(device, dtype):
    """Rows starting off 16 bytes (a short first vector) in a view, so the fresh output does not line up with
    the input (scalar stores); a row shorter than that first vector; -0, subnormals, negative values and
    ties in 16-bit rows (two radix passes): exactly the reference's kept tokens."""
    vocab = 37
    base = torch.rand(4 * vocab + 3, generator=torch.Generator().manual_seed(6), dtype=torch.float64)
    base[5:9] = -0.0
    base[10:14] = torch.finfo(torch.float16).tiny / 4 if dtype == torch.float16 else 1e-40
    base[20:23] = -0.25
    base[30:36] = base[40]  # ties
    x = base.to(dtype)[3:].view(4, vocab)
    for fn, kind, arg in ((flashkern.top_k_renorm_probs, "top_k_probs", 9), (flashkern.top_p_renorm_probs,
                                                                             "top_p_probs", 0.6)):
        got = fn(x.to(device), arg).cpu()
        expected = ref.sampling.renorm(x, kind, **{kind[:5]: torch.full((4,), arg)})
        assert torch.equal(got > 0, expected > 0), kind
        torch.testing.assert_close(got.double(), expected.double(), atol=1e-2 if dtype != torch.float32 else 1e-6,
                                   rtol=1e-2 if dtype != torch.float32 else 1e-5)
    short = x.flatten()[1:4].view(1, 3)  # 3 elements from an odd one: all in the first vector
    got = flashkern.top_k_mask_logits(short.to(device), 2).cpu()
    assert torch.equal(got, ref.sampling.renorm(short, "top_k_logits", top_k=torch.tensor([2])))


def test_top_k_first_and_logits(device):
    """top_k_first is top-p of the renormalized top-k; the logits functions are those of softmax(logits).
    Emulated: a few samples, checked for their support only (the two kernels composed here have their
    distribution tests above)."""
    vocab, n = 40, (6000 if not emulated(device) else 24)
    probs = distribution(vocab, seed=2, ties=False)
    logits = torch.log(probs)
    indices = torch.zeros(n, dtype=torch.int32, device=device)
    gen = torch.Generator(device)
    renormed = flashkern.ref.sampling.renorm(probs[None], "top_k_probs", top_k=torch.tensor([6]))[0]
    expected = torch.where(kept(renormed[None], top_p=torch.tensor([0.7]))[0], renormed, 0.0)
    for samples in (
        flashkern.top_k_top_p_sampling_from_probs(probs[None].to(device), 6, 0.7, indices=indices,
                                                  generator=gen.manual_seed(1)),
        flashkern.top_k_top_p_sampling_from_logits(logits[None].to(device), 6, 0.7, indices=indices,
                                                   generator=gen.manual_seed(2)),
    ):
        counts = torch.bincount(samples.cpu().long(), minlength=vocab)
        assert (counts[expected == 0] == 0).all()
        assert emulated(device) or chi2_pvalue(counts, expected) > 1e-3
    samples = flashkern.sampling_from_logits(logits[None].to(device), indices=indices, generator=gen.manual_seed(3))
    assert emulated(device) or chi2_pvalue(torch.bincount(samples.cpu().long(), minlength=vocab), probs) > 1e-3
    bad = torch.stack([logits, torch.full((vocab,), float("nan"))]).to(device)  # return_valid, as the probs functions
    for order in ("top_k_first", "joint"):
        _, valid = flashkern.top_k_top_p_sampling_from_logits(bad, 6, 0.7, filter_apply_order=order, seed=1, offset=0,
                                                              return_valid=True)
        assert valid.tolist() == [True, False], order
    samples, valid = flashkern.sampling_from_logits(bad, seed=1, offset=0, return_valid=True)
    assert valid.tolist() == [True, False] and samples[1] == 0


def test_bad_input(device):
    probs = torch.softmax(torch.randn(4, 32), -1).to(device)
    with pytest.raises(ValueError, match="top_k"):
        flashkern.top_k_sampling_from_probs(probs, 0)
    with pytest.raises(ValueError, match="top_p"):
        flashkern.top_p_sampling_from_probs(probs, 0.0)
    with pytest.raises(ValueError, match="top_p"):
        flashkern.top_p_sampling_from_probs(probs, 1.5)
    with pytest.raises(ValueError, match="min_p"):
        flashkern.min_p_sampling_from_probs(probs, -0.1)
    with pytest.raises(TypeError, match="float32"):
        flashkern.sampling_from_probs(probs.half())
    with pytest.raises(TypeError, match="float32"):
        flashkern.sampling_from_probs(probs.long())
    with pytest.raises(ValueError, match="2-D"):
        flashkern.sampling_from_probs(probs[0])
    with pytest.raises(ValueError, match=r"top_k has length 3, expected the batch size 4"):
        flashkern.top_k_sampling_from_probs(probs, torch.ones(3, dtype=torch.int32, device=device))
    with pytest.raises(ValueError, match="filter_apply_order"):
        flashkern.top_k_top_p_sampling_from_probs(probs, 3, 0.5, filter_apply_order="top_p_first")
    with pytest.raises(TypeError, match="indices"):
        flashkern.sampling_from_probs(probs, indices=torch.zeros(2, device=device))
    with pytest.raises(ValueError, match="seed"):
        flashkern.sampling_from_probs(probs, seed=torch.zeros(3, dtype=torch.int64, device=device), offset=0)
    with pytest.raises(ValueError, match="top_k"):
        flashkern.top_k_renorm_probs(probs, -1)
    with pytest.raises(TypeError, match="float16, bfloat16 or float32"):
        flashkern.top_k_mask_logits(probs.double(), 2)


def test_compile_and_opcheck():
    probs = torch.softmax(torch.randn(3, 64), -1)
    args = (probs, None, "top_k_top_p", None, 5, None, 0.8, None, 0.0, None, 7, None, 0)
    torch.library.opcheck(torch.ops.flashkern.sampling.default, args)
    torch.library.opcheck(torch.ops.flashkern.renorm.default, (probs, "top_p_probs", None, 0, None, 0.5))

    @torch.compile(fullgraph=True)
    def step(p):
        return flashkern.top_k_top_p_sampling_from_probs(p, 5, 0.8, filter_apply_order="joint", seed=7, offset=0)

    assert torch.equal(step(probs), flashkern.top_k_top_p_sampling_from_probs(probs, 5, 0.8, filter_apply_order="joint",
                                                                             seed=7, offset=0))


@requires_gpu
def test_cuda_graph_replay_draws_new_tokens():
    """Captured with the default generator, each replay draws a new seed on the device: new tokens,
    and the distribution stays right."""
    probs = torch.softmax(torch.randn(256, 1000, device="cuda"), -1)
    static = {}
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    s = torch.cuda.Stream()
    with torch.cuda.stream(s):
        flashkern.top_p_sampling_from_probs(probs, 0.9)  # warm up outside the capture
        with torch.cuda.graph(graph):
            static["out"] = flashkern.top_p_sampling_from_probs(probs, 0.9)
    draws = []
    for _ in range(3):
        graph.replay()
        draws.append(static["out"].clone())
    assert not torch.equal(draws[0], draws[1])
    keep = kept(probs.cpu(), top_p=torch.full((256,), 0.9))
    for d in draws:
        assert keep[torch.arange(256), d.cpu().long()].all()



# ---------------------------------------------------------------- softmax

# FlashInfer's grid (batch 1 / 99 / 989, vocab 111 / 32000 / 128256) where a GPU runs it; a float64 reference on
# the CPU and the emulated 256-thread blocks take smaller batches of the same vocabularies, plus a tail of chunks
SOFTMAX_SHAPES = [(1, 111), (99, 111), (3, 32000), (2, 128256), (5, 4097)]
SOFTMAX_GPU_SHAPES = [(b, v) for b in (1, 99, 989) for v in (111, 32000, 128256)]


def logits_like_flashinfer(batch, vocab, kind, seed):
    """FlashInfer's test distributions: normal noise of std 1 or 5, Gumbel noise of beta 0.1."""
    g = torch.Generator().manual_seed(seed)
    if kind == "gumbel":
        u = torch.rand(batch, vocab, generator=g)
        return torch.log(-torch.log(u + 1e-20) + 1e-20) / 0.1
    return torch.randn(batch, vocab, generator=g) * (5.0 if kind == "normal5" else 1.0)


@pytest.mark.parametrize("kind", ["normal1", "normal5", "gumbel"])
@pytest.mark.parametrize("temperature", [1.0, 0.5, 0.1])
@pytest.mark.parametrize("per_row", [False, True])
@pytest.mark.parametrize("neg_inf", [False, True])
def test_softmax(device, kind, temperature, per_row, neg_inf):
    """flashkern.softmax against float64 softmax(logits / t) (FlashInfer's test_softmax: its distributions,
    temperatures, per-row temperature tensors and logits set to -inf at random)."""
    if emulated(device) and (kind, temperature) != ("normal1", 0.5):
        pytest.skip("emulated: one distribution and temperature (every kernel path: test_emulated_kernels.py)")
    shapes = SOFTMAX_GPU_SHAPES if device == "cuda" else [(1, 111), (3, 4099)] if emulated(device) else SOFTMAX_SHAPES
    for i, (batch, vocab) in enumerate(shapes):
        logits = logits_like_flashinfer(batch, vocab, kind, seed=i)
        if neg_inf:
            g = torch.Generator().manual_seed(100 + i)
            hidden = torch.randperm(logits.numel(), generator=g)[: int(torch.randint(0, logits.numel() - 1, (),
                                                                                     generator=g))]
            logits.view(-1)[hidden] = float("-inf")
            logits[:, 0] = 0.0  # no row of -inf only (that row is NaN: test_softmax_edges)
        t = torch.full((batch,), temperature) if per_row else temperature
        probs = flashkern.softmax(logits.to(device), t.to(device) if per_row else t)
        assert probs.dtype == torch.float32 and probs.shape == logits.shape
        torch.testing.assert_close(probs.double().cpu(), ref.sampling.softmax(logits, t), atol=1e-6, rtol=1e-5)


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16, torch.float32])
def test_softmax_edges(device, dtype):
    """16-bit logits read as they are; rows strided and starting anywhere (the scalar heads); a row of -inf
    only, a NaN, a +inf: NaN rows, as torch.softmax; per-row temperatures; None is 1."""
    vocab = 4099 if not emulated(device) else 1031
    buf = torch.randn(4 * (vocab + 5) + 3, generator=torch.Generator().manual_seed(1)).to(dtype) * 4
    x = buf[3:].view(4, vocab + 5)[:, :vocab]  # strided rows, the first one element off 16 bytes for 16-bit dtypes
    x[1] = float("-inf")
    x[2, 5] = float("nan")
    x[3, 7] = float("inf")
    t = torch.tensor([0.3, 1.0, 2.0, 4.0])
    probs = flashkern.softmax(x.to(device), t.to(device)).cpu()
    torch.testing.assert_close(probs[0].double(), ref.sampling.softmax(x[:1], t[:1])[0], atol=1e-6, rtol=1e-5)
    assert probs[1:].isnan().all()
    one = flashkern.softmax(x[:1].to(device)).cpu()
    torch.testing.assert_close(one.double(), ref.sampling.softmax(x[:1], 1.0), atol=1e-6, rtol=1e-5)
    assert flashkern.softmax(x[:0].to(device)).shape == (0, vocab)


def test_softmax_rows_do_not_depend_on_the_batch(device):
    """A row's probabilities are the same bits alone, in another batch, at another position (chunks are
    fixed by the vocabulary, never by the batch)."""
    vocab = 20001 if not emulated(device) else 5000
    x = torch.randn(6, vocab, generator=torch.Generator().manual_seed(2)).to(device) * 3
    whole = flashkern.softmax(x, 0.8)
    assert torch.equal(flashkern.softmax(x[[4, 1, 2]], 0.8), whole[[4, 1, 2]])
    assert torch.equal(flashkern.softmax(x[3:4], 0.8), whole[3:4])


def test_softmax_bad_input(device):
    x = torch.randn(3, 50, device=device)
    with pytest.raises(ValueError, match=r"softmax: logits must be 2-D"):
        flashkern.softmax(x[0])
    with pytest.raises(TypeError, match=r"softmax: logits must be float16, bfloat16 or float32"):
        flashkern.softmax(x.double())
    with pytest.raises(ValueError, match=r"temperature must be a finite float32 number > 0"):
        flashkern.softmax(x, 0.0)
    with pytest.raises(ValueError, match=r"temperature must be a finite float32 number > 0"):
        flashkern.softmax(x, 1e300)
    with pytest.raises(ValueError, match=r"Sampling parameter tensor batch size mismatch"):
        flashkern.softmax(x, torch.ones(2, device=device))
    with pytest.raises(ValueError, match=r"contiguous in its last dimension"):
        flashkern.softmax(x.t())
    with pytest.raises(TypeError, match=r"enable_pdl"):
        flashkern.softmax(x, enable_pdl=1)


def test_softmax_opcheck_and_compile():
    from torch.library import opcheck

    x = torch.randn(3, 50)
    opcheck(torch.ops.flashkern.softmax.default, (x, torch.full((3,), 0.7), 1.0, False))
    compiled = torch.compile(lambda x: flashkern.softmax(x, 0.5), fullgraph=True, backend="aot_eager")
    torch.testing.assert_close(compiled(x), flashkern.softmax(x, 0.5))
