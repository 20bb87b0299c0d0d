"""Batch-invariant mode: a request's output bits do not depend on what else is in its batch.

    flashkern.set_batch_invariant(True)      # process-wide
    with flashkern.batch_invariant():        # or for a block (restores the previous setting)
        ...
    wrapper.plan(..., batch_invariant=True)  # or one wrapper's plans (None: the process-wide setting)

In the mode, for every op, one request's output (a row of a norm, activation or RoPE; a request's
queries in decode, prefill and cascade attention; its sampled tokens, drawn with its own seed) has
the same bits whatever the other requests are, however many, however long, at whatever position,
and whatever the device's multiprocessor count (docs/design.md, "Batch invariance", says why each
op holds it and what it does not promise):
- attention plans split a sequence into chunks of a fixed number of tokens counted from its own
  start (INVARIANT_CHUNK, or the plan's fixed_split_size), never chosen from the batch or the
  device, and never grown to fit the workspace (the plan raises instead); a request's tile is
  chosen from its own queries; a cascade's shared levels use one fixed tile; states merge in a fixed
  order. Attention is read at the time of plan(): the mode is part of the plan.
- sampling and the speculative functions need a seed per request (seed: a [batch] int64 tensor), or
  raise ValueError: with one seed for the batch a row's random numbers depend on its row index; they,
  softmax and renormalization need every row on a 16-byte boundary, or raise ValueError (the kernels'
  sums over a row follow where its 16-byte vectors start).
- PrefixCache.plan_cascade raises ValueError (its levels follow which requests share a prefix);
  plan_decode's flat tables are invariant.
- norms, activations and RoPE are invariant in either mode: a row's reduction tree follows its
  length only (rows.h).
Outside the mode nothing changes. It is not a promise across devices, dtypes, builds or backends,
nor between a token decoded and the same token inside a prefill (other kernels).
"""

import contextlib

INVARIANT_CHUNK = 1024  # tokens: the split-KV chunk of batch-invariant attention plans

_enabled = False


def set_batch_invariant(enabled=True):
    """Turn batch-invariant mode on or off for the whole process (module docstring)."""
    global _enabled
    if not isinstance(enabled, bool):
        raise TypeError(f"set_batch_invariant: enabled must be a bool, got {type(enabled).__name__}")
    _enabled = enabled


def is_batch_invariant():
    """Whether batch-invariant mode is on."""
    return _enabled


@contextlib.contextmanager
def batch_invariant(enabled=True):
    """Batch-invariant mode on (or off) inside the block; the previous setting afterwards."""
    previous = _enabled
    set_batch_invariant(enabled)
    try:
        yield
    finally:
        set_batch_invariant(previous)


def resolve(op, batch_invariant):
    """A plan()'s batch_invariant argument: None -> the process-wide setting."""
    if batch_invariant is None:
        return _enabled
    if not isinstance(batch_invariant, bool):
        raise TypeError(f"{op}: batch_invariant must be a bool or None, got {type(batch_invariant).__name__}")
    return batch_invariant
