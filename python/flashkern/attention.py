"""Attention states and their merge operator (the first piece of the attention ops).

A state (v, s) of a query over a key set: v = softmax-weighted sum of the values, s = the
natural-log sum-exp of the scaled logits (as FlashAttention, vLLM and torch.logsumexp; FlashInfer
uses base 2). An empty key set is (0, -inf) and merging with it is exact, never NaN.
Order in this file: public functions, CPU reference registration, fake functions.
"""

import torch

from . import _backend, ref
from ._validate import check_same, check_state, check_tensor

_ops = torch.ops.flashkern


def merge_state(v_a, s_a, v_b, s_b):
    """Merge two attention states: v_a, v_b [tokens, heads, head_dim] (fp16, bf16, fp32), s_a, s_b
    [tokens, heads] float32 -> (v, s) with s = log(exp(s_a) + exp(s_b)),
    v = (exp(s_a - s) v_a + exp(s_b - s) v_b)."""
    check_tensor("merge_state", "v_a", v_a)
    if _backend.use_reference(v_a.device):
        _check_pair("merge_state", v_a, s_a, v_b, s_b, reference=True)
        return ref.merge_state(v_a, s_a, v_b, s_b)
    return _ops.merge_state(v_a, s_a, v_b, s_b)


def merge_state_in_place(v, s, v_other, s_other, mask=None):
    """merge_state into (v, s), in place; with mask [tokens] (bool), only the tokens where it is True."""
    check_tensor("merge_state_in_place", "v", v)
    if _backend.use_reference(v.device):
        _check_pair("merge_state_in_place", v, s, v_other, s_other, True, mask, _IN_PLACE_NAMES)
        merged_v, merged_s = ref.merge_state(v, s, v_other, s_other)
        keep = mask if mask is not None else torch.ones(v.shape[0], dtype=torch.bool, device=v.device)
        v.copy_(torch.where(keep[:, None, None], merged_v, v))
        s.copy_(torch.where(keep[:, None], merged_s, s))
        return
    _ops.merge_state_in_place(v, s, v_other, s_other, mask)


def merge_states(v, s):
    """Merge num_states states per token and head: v [tokens, num_states, heads, head_dim], s [tokens,
    num_states, heads] float32 -> (v [tokens, heads, head_dim], s [tokens, heads]). Any number of states
    and heads, any head_dim."""
    check_tensor("merge_states", "v", v)
    if _backend.use_reference(v.device):
        check_state("merge_states", "v", v, "s", s, reference=True, stacked=True)
        return ref.merge_states(v, s)
    return _ops.merge_states(v, s)


def _check_pair(op, v_a, s_a, v_b, s_b, reference, mask=None, names=("v_a", "s_a", "v_b", "s_b")):
    check_state(op, names[0], v_a, names[1], s_a, reference)
    check_same(op, names[2], v_b, names[0], v_a)
    check_state(op, names[2], v_b, names[3], s_b, reference)
    if mask is not None:
        check_tensor(op, "mask", mask)
        if mask.dtype != torch.bool or tuple(mask.shape) != (v_a.shape[0],) or mask.device != v_a.device:
            raise ValueError(
                f"{op}: mask must be a bool tensor of shape ({v_a.shape[0]},) on {v_a.device}, "
                f"got {mask.dtype} of shape {tuple(mask.shape)} on {mask.device}"
            )


_IN_PLACE_NAMES = ("v", "s", "v_other", "s_other")


# ---- CPU: the reference, with the same checks as the kernels ----


@_backend.register_cpu("merge_state")
def _merge_state_cpu(v_a, s_a, v_b, s_b):
    _check_pair("merge_state", v_a, s_a, v_b, s_b, reference=True)
    return tuple(t.contiguous() for t in ref.merge_state(v_a, s_a, v_b, s_b))


@_backend.register_cpu("merge_state_in_place")
def _merge_state_in_place_cpu(v, s, v_other, s_other, mask):
    _check_pair("merge_state_in_place", v, s, v_other, s_other, True, mask, _IN_PLACE_NAMES)
    merged_v, merged_s = ref.merge_state(v, s, v_other, s_other)
    keep = mask if mask is not None else torch.ones(v.shape[0], dtype=torch.bool)
    v.copy_(torch.where(keep[:, None, None], merged_v, v))
    s.copy_(torch.where(keep[:, None], merged_s, s))


@_backend.register_cpu("merge_states")
def _merge_states_cpu(v, s):
    check_state("merge_states", "v", v, "s", s, reference=True, stacked=True)
    return tuple(t.contiguous() for t in ref.merge_states(v, s))


# ---- fake functions ----


@torch.library.register_fake("flashkern::merge_state")
def _merge_state_fake(v_a, s_a, v_b, s_b):
    _check_pair("merge_state", v_a, s_a, v_b, s_b, reference=v_a.device.type == "cpu")
    return v_a.new_empty(v_a.shape), s_a.new_empty(s_a.shape)


@torch.library.register_fake("flashkern::merge_state_in_place")
def _merge_state_in_place_fake(v, s, v_other, s_other, mask):
    _check_pair("merge_state_in_place", v, s, v_other, s_other, v.device.type == "cpu", mask, _IN_PLACE_NAMES)


@torch.library.register_fake("flashkern::merge_states")
def _merge_states_fake(v, s):
    check_state("merge_states", "v", v, "s", s, reference=v.device.type == "cpu", stacked=True)
    return v.new_empty(v.shape[0], v.shape[2], v.shape[3]), s.new_empty(s.shape[0], s.shape[2])
