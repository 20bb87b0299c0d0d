"""Sampling: one token per row from probabilities, optionally restricted to the top-k tokens, the
top-p nucleus or the min-p set, without sorting the vocabulary; top-k / top-p renormalization and
top-k logit masking; chain speculative sampling. FlashInfer's names and signatures
(flashinfer.sampling).

Semantics, on every backend (csrc/include/flashkern/ops.h has the same words):
- Order: token j comes before token x when p_j > p_x, or p_j == p_x and j < x (ties go to the lower
  index). top-k keeps the first k tokens of that order, exactly k, even when probabilities tie at
  the boundary; top-p keeps the tokens whose probability mass before them is below top_p times the
  row's mass (the smallest prefix whose mass reaches top_p); min-p keeps p >= min_p * max(p). The
  first token is always kept. Negative probabilities count as 0. A row is taken as the
  distribution it is: it need not sum to 1 (a kernel pays one more pass over such a row).
- top_k, top_p, min_p: a scalar (checked: top_k >= 1, 0 < top_p <= 1, 0 <= min_p <= 1) or a
  [batch] tensor, one value per output row, not checked on the host (a device sync): there,
  top_k <= 0 or >= vocab and top_p >= 1 mean no filter.
- A row with no mass to sample from (all zeros, NaN or inf, or an index outside probs) gives token
  0 and valid = False (``return_valid=True``); ``check_nan=True`` raises ValueError on a NaN first
  (a host sync, as in FlashInfer).
- Random numbers: with ``seed`` and ``offset`` unset, one 64-bit seed is drawn from ``generator``
  (or the default generator of the device) on the device, by torch: no host sync, and a CUDA graph
  replay draws a new seed and new tokens. The kernels draw Philox4x32-10 numbers keyed by the seed,
  with counters from ``offset`` on, so the same seed gives the same tokens on the same device, and
  explicit ``seed`` / ``offset`` (ints, or [1] / [batch] int64 tensors that a graph reads when it
  replays) give the caller control. With one seed for the batch the row index is part of the
  counter (rows differ); with a seed per row ([batch]: a request's own seed, as serving engines keep
  them) it is not, so a request draws the same numbers at any row of any batch. One call uses at
  most 1024 counters a row (sampling: up to 4096 numbers, four a counter; the speculative functions:
  ceil((nodes + 64) / 4)): a caller that reuses a seed must advance ``offset`` by at least that
  between calls, or draws repeat. The CPU reference draws with torch.Generators seeded from the
  same values (one per row for a seed per row): the same distribution, other tokens.
- Batch-invariant mode (flashkern.invariance): a batch of more than one row needs a seed per row
  (a [batch] seed tensor) and an offset, else ValueError; a request then draws the same numbers alone
  (its seed as an int or a [1] tensor) and at any row of any batch. Every row must start on a 16-byte
  boundary (ValueError otherwise; fp32 rows of a vocabulary that is a multiple of 4 do): the kernels' sums
  over a row follow where its 16-byte vectors start. The same holds for softmax and renormalization.
- ``deterministic``: accepted for FlashInfer's signature; every kernel here is deterministic.
"""

import torch

from . import _backend, invariance, ref
from ._validate import (
    check_enable_pdl,
    check_probs,
    check_random,
    check_renorm,
    check_sampling,
    check_softmax,
    check_speculative,
    check_tensor,
)

_ops = torch.ops.flashkern


def _random_args(op, device, generator, seed, offset, batch):
    """(seed_arr, seed, offset_arr, offset) for the ops: a seed drawn on the device from the
    generator when seed or offset is unset, else the caller's values or tensors."""
    if invariance.is_batch_invariant() and batch > 1 and not (isinstance(seed, torch.Tensor) and seed.numel() == batch
                                                               and offset is not None):
        raise ValueError(f"{op}: batch-invariant mode needs a seed per request: seed a [batch={batch}] int64 tensor "
                         "and an offset (with one seed for the batch a row's random numbers follow its row index)")
    if seed is None or offset is None:
        if generator is not None and not isinstance(generator, torch.Generator):
            raise TypeError(f"{op}: generator must be a torch.Generator or None, got {type(generator).__name__}")
        seed_arr = torch.randint(-(2**63), 2**63 - 1, (1,), dtype=torch.int64, device=device, generator=generator)
        return seed_arr, 0, None, 0
    values = []
    for name, v in (("seed", seed), ("offset", offset)):
        if isinstance(v, torch.Tensor):
            values += [v.view(torch.int64) if v.dtype == torch.uint64 else v, 0]
        elif isinstance(v, int) and not isinstance(v, bool):
            if not -(2**63) <= v < 2**64:  # an int64 or a uint64: 64 bits, never wrapped
                raise ValueError(f"{op}: {name} must fit 64 bits (in [-2^63, 2^64)), got {v}")
            values += [None, (v + 2**63) % 2**64 - 2**63]  # as the int64 of its 64 bits
        else:
            raise TypeError(f"{op}: {name} must be an int or an int64 tensor, got {type(v).__name__}")
    check_random(op, torch.empty(0, device=device), batch, values[0], values[2])
    return tuple(values)


def _check_invariant_rows(op, name, t):
    """Batch-invariant mode: every row of t on a 16-byte boundary. The kernels read a row in 16-byte vectors
    from its first boundary, so the order of its sums follows where the row starts; rows that all start on
    one give a row the same bits at any position of any batch."""
    if not invariance.is_batch_invariant() or not isinstance(t, torch.Tensor):
        return
    strides = [s * t.element_size() for s in t.stride()[:-1]]
    if t.data_ptr() % 16 or any(s % 16 for s in strides):
        raise ValueError(f"{op}: batch-invariant mode needs every row of {name} on a 16-byte boundary (its address and "
                         f"row strides multiples of 16 bytes; got strides {strides} bytes): pad the vocabulary to a "
                         f"multiple of {16 // t.element_size()}")


def _row_param(op, name, value, batch, device):
    """A scalar (checked) or a [batch] tensor (converted to the kernel's dtype) -> (tensor or None, scalar)."""
    dtype = torch.int32 if name == "top_k" else torch.float32
    if isinstance(value, torch.Tensor):  # FlashInfer's phrases, which its callers match on
        if value.dim() == 0:
            raise ValueError(f"{op}: Expected a 1D tensor of shape (batch_size,) or scalar for the sampling "
                             f"parameter {name}, but got a 0-dimensional tensor")
        if value.dim() > 1:
            raise ValueError(f"{op}: Expected a 1D tensor or scalar for the sampling parameter {name}, but got a "
                             f"{value.dim()}D tensor")
        if value.shape[0] != batch:
            raise ValueError(f"{op}: Sampling parameter tensor batch size mismatch: {name} has length "
                             f"{value.shape[0]}, expected the batch size {batch}")
        if value.device != device:
            raise ValueError(f"{op}: {name} is on {value.device} but probs is on {device}")
        return value.to(dtype).contiguous(), 0
    if name == "top_k":
        if not isinstance(value, int) or isinstance(value, bool) or value < 1:
            raise ValueError(f"{op}: top_k must be an int >= 1 or a tensor, got {value!r}")
        return None, min(value, 2**31 - 1)
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        raise TypeError(f"{op}: {name} must be a float or a tensor, got {type(value).__name__}")
    lowest_ok = value > 0 if name == "top_p" else value >= 0
    if not (lowest_ok and value <= 1):
        bounds = "(0, 1]" if name == "top_p" else "[0, 1]"
        raise ValueError(f"{op}: {name} must be in {bounds}, got {value!r}")
    return None, float(value)


def _sample(op, probs, indices, filter, generator, check_nan, seed, offset, return_valid,
            top_k=None, top_p=None, min_p=None):
    check_tensor(op, "probs", probs)
    check_probs(op, "probs", probs)
    _check_invariant_rows(op, "probs", probs)
    if check_nan and torch.isnan(probs).any():
        raise ValueError(f"{op}: probs contains NaN")
    batch = probs.shape[0] if indices is None else indices.shape[0]
    k_arr, k = _row_param(op, "top_k", top_k, batch, probs.device) if top_k is not None else (None, 0)
    p_arr, p = _row_param(op, "top_p", top_p, batch, probs.device) if top_p is not None else (None, 1.0)
    m_arr, m = _row_param(op, "min_p", min_p, batch, probs.device) if min_p is not None else (None, 0.0)
    rng = _random_args(op, probs.device, generator, seed, offset, batch)
    args = (probs, indices, filter, k_arr, k, p_arr, p, m_arr, m, *rng)
    if _backend.use_reference(probs.device):
        samples, valid = _sampling_cpu(*args)
        samples, valid = samples.to(probs.device), valid.to(probs.device)
    else:
        samples, valid = _ops.sampling(*args)
    return (samples, valid) if return_valid else samples


def sampling_from_probs(probs, indices=None, deterministic=True, generator=None, check_nan=False, seed=None,
                        offset=None, return_valid=False):
    """A token per row of ``probs`` [batch, vocab] float32 (or per entry of ``indices``, a [batch]
    int32/int64 map from output rows to rows of probs: several samples of one prompt); int32 tokens,
    or indices' dtype. See the module docstring for ties, invalid rows and random numbers."""
    return _sample("sampling_from_probs", probs, indices, "none", generator, check_nan, seed, offset, return_valid)


def sampling_from_logits(logits, indices=None, deterministic=True, generator=None, check_nan=False, seed=None,
                         offset=None, return_valid=False):
    """sampling_from_probs(softmax(logits)): the softmax is torch's, in float32. ``return_valid``: as the
    probs functions (a row of NaN or of -inf logits has no mass)."""
    check_tensor("sampling_from_logits", "logits", logits)
    if check_nan and torch.isnan(logits).any():
        raise ValueError("sampling_from_logits: logits contains NaN")
    return _sample("sampling_from_logits", torch.softmax(logits.float(), dim=-1), indices, "none", generator, False,
                   seed, offset, return_valid)


def top_k_sampling_from_probs(probs, top_k, indices=None, deterministic=True, generator=None, check_nan=False,
                              seed=None, offset=None, return_valid=False):
    """A token from the top_k most probable tokens of each row (exactly k: ties to the lower index),
    renormalized; top_k an int >= 1 or a [batch] tensor."""
    return _sample("top_k_sampling_from_probs", probs, indices, "top_k", generator, check_nan, seed, offset,
                   return_valid, top_k=top_k)


def top_p_sampling_from_probs(probs, top_p, indices=None, deterministic=True, generator=None, check_nan=False,
                              seed=None, offset=None, return_valid=False):
    """A token from the top-p nucleus of each row (the smallest prefix of the sorted row whose mass
    reaches top_p), renormalized; top_p in (0, 1] or a [batch] tensor."""
    return _sample("top_p_sampling_from_probs", probs, indices, "top_p", generator, check_nan, seed, offset,
                   return_valid, top_p=top_p)


def min_p_sampling_from_probs(probs, min_p, indices=None, deterministic=True, generator=None, check_nan=False,
                              seed=None, offset=None, return_valid=False):
    """A token from the tokens with p >= min_p * max(p) of each row, renormalized; min_p in [0, 1] or
    a [batch] tensor."""
    return _sample("min_p_sampling_from_probs", probs, indices, "min_p", generator, check_nan, seed, offset,
                   return_valid, min_p=min_p)


def _check_order(op, filter_apply_order):
    if filter_apply_order not in ("top_k_first", "joint"):
        raise ValueError(f"{op}: filter_apply_order must be 'top_k_first' or 'joint', got {filter_apply_order!r}")


def top_k_top_p_sampling_from_probs(probs, top_k, top_p, indices=None, filter_apply_order="top_k_first",
                                    deterministic=True, generator=None, check_nan=False, seed=None, offset=None,
                                    return_valid=False):
    """top_k_first: top-p sampling from top_k_renorm_probs(probs, top_k) (top-p of the renormalized
    top-k); joint: a token kept by both filters on the row itself, in one kernel."""
    op = "top_k_top_p_sampling_from_probs"
    _check_order(op, filter_apply_order)
    if filter_apply_order == "joint":
        return _sample(op, probs, indices, "top_k_top_p", generator, check_nan, seed, offset, return_valid,
                       top_k=top_k, top_p=top_p)
    check_probs(op, "probs", probs)
    if check_nan and torch.isnan(probs).any():
        raise ValueError(f"{op}: probs contains NaN")
    if indices is not None:  # top_k is per output row: renormalize the output rows
        probs, indices = probs[indices.long()], None
    return _sample(op, top_k_renorm_probs(probs, top_k), None, "top_p", generator, False, seed, offset, return_valid,
                   top_p=top_p)


def top_k_top_p_sampling_from_logits(logits, top_k, top_p, indices=None, filter_apply_order="top_k_first",
                                     deterministic=True, generator=None, check_nan=False, seed=None, offset=None,
                                     return_valid=False):
    """top_k_first: top-p sampling from softmax(top_k_mask_logits(logits, top_k)); joint: joint top-k
    and top-p sampling from softmax(logits). The softmax is torch's, in float32."""
    op = "top_k_top_p_sampling_from_logits"
    _check_order(op, filter_apply_order)
    check_tensor(op, "logits", logits)
    if check_nan and torch.isnan(logits).any():
        raise ValueError(f"{op}: logits contains NaN")
    if filter_apply_order == "joint":
        return _sample(op, torch.softmax(logits.float(), dim=-1), indices, "top_k_top_p", generator, False, seed,
                       offset, return_valid, top_k=top_k, top_p=top_p)
    if indices is not None:
        logits, indices = logits[indices.long()], None
    probs = torch.softmax(top_k_mask_logits(logits, top_k).float(), dim=-1)
    return _sample(op, probs, None, "top_p", generator, False, seed, offset, return_valid, top_p=top_p)


def _renorm(kind, input, top_k=None, top_p=None):
    op = {"top_k_logits": "top_k_mask_logits", "top_p_probs": "top_p_renorm_probs"}.get(kind, "top_k_renorm_probs")
    check_tensor(op, "input", input)
    if input.dim() != 2:
        raise ValueError(f"{op}: input must be 2-D (batch, vocab), got shape {tuple(input.shape)}")
    _check_invariant_rows(op, "input", input)
    k_arr, k = _row_param(op, "top_k", top_k, input.shape[0], input.device) if top_k is not None else (None, 0)
    p_arr, p = _row_param(op, "top_p", top_p, input.shape[0], input.device) if top_p is not None else (None, 1.0)
    if _backend.use_reference(input.device):
        return _renorm_cpu(input, kind, k_arr, k, p_arr, p)
    return _ops.renorm(input, kind, k_arr, k, p_arr, p)


def top_k_renorm_probs(probs, top_k, is_deterministic=False):
    """The top_k largest probabilities of each row (exactly k, ties to the lower index) over their
    sum, 0 elsewhere; float16, bfloat16 or float32, the dtype of probs. Deterministic always."""
    return _renorm("top_k_probs", probs, top_k=top_k)


def top_p_renorm_probs(probs, top_p, is_deterministic=False):
    """The top-p nucleus of each row over its mass, 0 elsewhere (the module docstring's top-p);
    float16, bfloat16 or float32. Deterministic always (integer mass histograms)."""
    return _renorm("top_p_probs", probs, top_p=top_p)


def top_k_mask_logits(logits, top_k):
    """The top_k largest logits of each row (exactly k, ties to the lower index), -inf elsewhere."""
    return _renorm("top_k_logits", logits, top_k=top_k)


def softmax(logits, temperature=None, enable_pdl=None):
    """FlashInfer's online softmax with temperature: ``softmax(logits / temperature)`` of each row, as
    float32 probabilities ``[batch, vocab]``. logits ``[batch, vocab]`` float16, bfloat16 or float32 (the
    last dimension contiguous); temperature None (1), a number > 0, or a ``[batch]`` tensor (one per row,
    read on the device, not checked: a row's values are what ``logits / t`` gives). A row holding NaN or
    +inf, or only -inf, gives NaN, as torch.softmax. The kernel reads each row twice and writes it once;
    rows longer than 4096 are split over blocks, and a row's bits never depend on the other rows (on its
    address, where it is not on a 16-byte boundary: batch-invariant mode asks for rows on one).
    ``enable_pdl``: as in rmsnorm."""
    op = "softmax"
    pdl = check_enable_pdl(op, enable_pdl)
    check_tensor(op, "logits", logits)
    if logits.dim() != 2:
        raise ValueError(f"{op}: logits must be 2-D (batch, vocab), got shape {tuple(logits.shape)}")
    _check_invariant_rows(op, "logits", logits)
    t_arr, t = None, 1.0
    if isinstance(temperature, torch.Tensor):
        t_arr, _ = _row_param(op, "temperature", temperature, logits.shape[0], logits.device)
    elif temperature is not None:
        if isinstance(temperature, bool) or not isinstance(temperature, (int, float)):
            raise TypeError(f"{op}: temperature must be None, a number or a tensor, got {type(temperature).__name__}")
        t = float(temperature)
    if _backend.use_reference(logits.device):
        return _softmax_cpu(logits, t_arr, t, pdl)
    return _ops.softmax(logits, t_arr, t, pdl)


top_k_renorm_prob = top_k_renorm_probs
top_p_renorm_prob = top_p_renorm_probs


def chain_speculative_sampling(draft_probs, draft_token_ids, target_probs, maybe_output_accepted_token_num=None,
                               maybe_output_emitted_draft_token_num=None, deterministic=True, generator=None,
                               seed=None, offset=None):
    """Speculative sampling of a chain of n draft tokens per request (Leviathan et al. / Chen et
    al.): draft token i is accepted with probability min(1, p_target(t) / p_draft(t)) while all before
    it were; at the first rejection a token is drawn from norm(max(0, p_target - p_draft)) there,
    and after n acceptances a bonus token from target_probs[:, n]. The emitted tokens follow the
    target distribution exactly.

    draft_probs [batch, n, vocab], draft_token_ids [batch, n] int32, target_probs [batch, n + 1,
    vocab], float32. Returns (output_token_ids [batch, n + 1] int32: the accepted draft tokens, then
    the drawn one, then -1; accepted_token_num [batch]: how many draft tokens pass their own test,
    each as if all before it had; emitted_draft_token_num [batch]: the accepted ones). Given the
    maybe_output_* tensors, the counts are added to them in place (and they are returned)."""
    op = "chain_speculative_sampling"
    for name, t in (("draft_probs", draft_probs), ("draft_token_ids", draft_token_ids), ("target_probs", target_probs)):
        check_tensor(op, name, t)
    if draft_token_ids.dtype == torch.int64:
        draft_token_ids = draft_token_ids.int()
    draft_token_ids = draft_token_ids.contiguous()  # [batch, n]: a few ids
    for name, counts in (("maybe_output_accepted_token_num", maybe_output_accepted_token_num),
                         ("maybe_output_emitted_draft_token_num", maybe_output_emitted_draft_token_num)):
        if counts is not None:  # FlashInfer's int32 [batch] counters, added to in place
            check_tensor(op, name, counts)
            if counts.dtype != torch.int32:
                raise TypeError(f"{op}: {name} must be int32, got {counts.dtype}")
            if tuple(counts.shape) != (draft_token_ids.shape[0],) or counts.device != target_probs.device:
                raise ValueError(f"{op}: {name} must have shape ({draft_token_ids.shape[0]},) on "
                                 f"{target_probs.device}, got {tuple(counts.shape)} on {counts.device}")
    tokens, _, emitted, accepted = _speculative(op, target_probs, draft_probs, draft_token_ids, 1, None, "sample",
                                                generator, seed, offset)
    if maybe_output_accepted_token_num is not None:
        accepted = maybe_output_accepted_token_num.add_(accepted)
    if maybe_output_emitted_draft_token_num is not None:
        emitted = maybe_output_emitted_draft_token_num.add_(emitted)
    return tokens, accepted, emitted


def _speculative(op, target, draft, candidates, first_candidate, parents, mode, generator, seed, offset):
    if target.dim() != 3:
        raise ValueError(f"{op}: the target must be 3-D (batch, nodes, vocab), got shape {tuple(target.shape)}")
    if isinstance(candidates, torch.Tensor) and candidates.device.type == "cpu" and candidates.numel():
        # checked where it costs no device synchronization; on a GPU an id outside the vocabulary is a rejection
        low, high = int(candidates.min()), int(candidates.max())
        if low < 0 or high >= target.shape[2]:
            raise ValueError(f"{op}: token ids must be in [0, vocab={target.shape[2]}), got {low if low < 0 else high}")
    for name, t in (("target", target), ("draft", draft)):
        _check_invariant_rows(op, name, t)
    rng = _random_args(op, target.device, generator, seed, offset, target.shape[0])
    args = (target, draft, candidates, first_candidate, parents, mode, *rng)
    if _backend.use_reference(target.device):
        return tuple(t.to(target.device) for t in _speculative_cpu(*args))
    return _ops.speculative(*args)


# ---- CPU: the reference, with the same checks as the kernels ----


@_backend.register_cpu("sampling")
def _sampling_cpu(probs, indices, filter, top_k_arr, top_k, top_p_arr, top_p, min_p_arr, min_p, seed_arr, seed,
                  offset_arr, offset):
    batch = check_sampling(probs, indices, filter, top_k_arr, top_p_arr, min_p_arr, seed_arr, offset_arr)

    def per_row(arr, value, dtype):
        return arr.cpu() if arr is not None else torch.full((batch,), value, dtype=dtype)

    streams = ref.sampling.RowStreams(seed if seed_arr is None else seed_arr.cpu(),
                                      offset if offset_arr is None else offset_arr.cpu(), batch)
    samples, valid = ref.sampling.sampling(probs, indices, filter, per_row(top_k_arr, top_k, torch.int64),
                                           per_row(top_p_arr, top_p, torch.float64),
                                           per_row(min_p_arr, min_p, torch.float64), streams)
    return samples.to(indices.dtype if indices is not None else torch.int32), valid


@_backend.register_cpu("renorm")
def _renorm_cpu(input, kind, top_k_arr, top_k, top_p_arr, top_p):
    check_renorm(input, kind, top_k_arr, top_p_arr)
    rows = input.shape[0]
    k = top_k_arr.cpu() if top_k_arr is not None else torch.full((rows,), top_k, dtype=torch.int64)
    p = top_p_arr.cpu() if top_p_arr is not None else torch.full((rows,), top_p, dtype=torch.float64)
    if input.shape[1] == 0:
        return input.clone()
    return ref.sampling.renorm(input.cpu(), kind, top_k=k, top_p=p).to(input.device)


@_backend.register_cpu("speculative")
def _speculative_cpu(target, draft, candidates, first_candidate, parents, mode, seed_arr, seed, offset_arr, offset):
    check_speculative(target, draft, candidates, first_candidate, parents, mode, seed_arr, offset_arr)
    streams = ref.sampling.RowStreams(seed if seed_arr is None else seed_arr.cpu(),
                                      offset if offset_arr is None else offset_arr.cpu(), target.shape[0])
    return ref.sampling.speculative(target.cpu(), None if draft is None else draft.cpu(), candidates.cpu(),
                                    first_candidate, None if parents is None else parents.cpu(), mode, streams)


@_backend.register_cpu("softmax")
def _softmax_cpu(logits, temperature_arr, temperature, enable_pdl=False):
    check_softmax(logits, temperature_arr, temperature)
    t = temperature_arr.cpu() if temperature_arr is not None else temperature
    return ref.sampling.softmax(logits.cpu(), t).float().to(logits.device)


# ---- fake functions ----


@torch.library.register_fake("flashkern::sampling")
def _sampling_fake(probs, indices, filter, top_k_arr, top_k, top_p_arr, top_p, min_p_arr, min_p, seed_arr, seed,
                   offset_arr, offset):
    batch = check_sampling(probs, indices, filter, top_k_arr, top_p_arr, min_p_arr, seed_arr, offset_arr)
    dtype = indices.dtype if indices is not None else torch.int32
    return probs.new_empty((batch,), dtype=dtype), probs.new_empty((batch,), dtype=torch.bool)


@torch.library.register_fake("flashkern::renorm")
def _renorm_fake(input, kind, top_k_arr, top_k, top_p_arr, top_p):
    check_renorm(input, kind, top_k_arr, top_p_arr)
    return input.new_empty(input.shape)


@torch.library.register_fake("flashkern::softmax")
def _softmax_fake(logits, temperature_arr, temperature, enable_pdl=False):
    check_softmax(logits, temperature_arr, temperature)
    return logits.new_empty(logits.shape, dtype=torch.float32)


@torch.library.register_fake("flashkern::speculative")
def _speculative_fake(target, draft, candidates, first_candidate, parents, mode, seed_arr, seed, offset_arr, offset):
    check_speculative(target, draft, candidates, first_candidate, parents, mode, seed_arr, offset_arr)
    batch, nodes = target.shape[:2]
    i32 = dict(dtype=torch.int32)
    return (target.new_empty((batch, nodes), **i32), target.new_empty((batch, nodes - 1), **i32),
            target.new_empty((batch,), **i32), target.new_empty((batch,), **i32))
