"""The training step: AdamW with the gradients' global-norm clipping fused in, and clip_grad_norm_,
on multi-tensor kernels (csrc/include/flashkern/kernels/optim.cuh).

- ``AdamW(params, lr=1e-3, betas=(0.9, 0.999), eps=1e-8, weight_decay=1e-2, amsgrad=False, *,
  maximize=False, foreach=None, capturable=False, differentiable=False, fused=None, max_grad_norm=None,
  norm_type=2.0, clip="global", master_weights=False, error_if_nonfinite=False)`` (torch's arguments,
  then this one's):
  a torch.optim.Optimizer whose update is torch.optim.AdamW's (decoupled weight decay, bias
  correction, eps added to sqrt(v_hat)) after torch.nn.utils.clip_grad_norm_(params, max_grad_norm)
  when max_grad_norm is set, or, with ``clip="per_tensor"``, after clipping each tensor by its own
  norm. One step is a norm launch (partials per chunk, one reduction block) and one AdamW launch per
  param group: each gradient is read twice, each parameter and moment once, the host never waits.
  The gradients themselves are not modified (torch's clip_grad_norm_ scales them in place).
- State: ``step`` (a float32 tensor on the parameter's device), ``exp_avg`` and ``exp_avg_sq`` in
  float32 for every parameter dtype (16-bit moments underflow: eps = 1e-8 is below float16's range
  and a tiny v_hat turns into a huge update), and with ``master_weights=True`` a float32
  ``master_param`` for each 16-bit parameter, rounded to nearest even into the parameter after each
  step. Without master weights a 16-bit parameter is updated in float32 and rounded each step, so
  updates smaller than half its spacing are lost. ``state_dict()`` has torch AdamW's keys: a
  checkpoint loads into either optimizer (torch casts the moments to the parameter's dtype; this
  one keeps float32).
- A non-finite gradient norm (only computed with max_grad_norm) skips the step on the device:
  parameters, state and steps are untouched, and ``optimizer.found_inf`` (a float32 device tensor,
  1.0) says so; ``optimizer.grad_norm`` is the total norm before clipping. With
  ``error_if_nonfinite=True`` the step waits for the norm and raises RuntimeError (a host sync).
- ``lr`` may be a float32 tensor on the parameters' device (read by the kernel: a captured step
  follows a scheduler that writes it). A whole step, or clip_grad_norm_, can be captured in a CUDA
  graph once an eager call has run with the same tensors, gradients included (the tensors' address
  tables are uploaded when addresses change, not each call, and never during a capture).
- Tables and graphs: a table a capture used is never rewritten nor freed afterwards (the library
  cannot see when a graph dies), so eager steps between replays are safe: the first eager call
  after a capture uploads into a new table, and a later capture with the same addresses shares the
  captured one. The optimizer keeps its tables (a graph of its step reads its state, so cannot
  outlive it): one per param group and device and one for the norm per device, each two after a
  capture. clip_grad_norm_ keeps a table per parameter list and device for the last 8, and the
  captured ones for the life of the process. A table is 72 bytes a tensor.
- Parameters of float32, float16 and bfloat16, mixed within a group; on any devices (each device's
  gradients get one norm launch; with several devices the norms are combined on the first one's,
  a host sync, as in torch); dense gradients (sparse ones raise ValueError); parameters without a
  gradient are skipped, as in torch.
  ``amsgrad`` and ``differentiable`` are not supported (ValueError).
"""

import collections
import functools
import math

import torch

from . import _backend, _C, ref
from ._validate import check_adamw, check_grad_norm

_ops = torch.ops.flashkern
_ENTRY = _C.OPTIM_TABLE_ENTRY_BYTES


def _capturing(device):
    """Whether work on `device` is being captured into a CUDA graph (tests fake a capture here)."""
    return device.type == "cuda" and torch.cuda.is_current_stream_capturing()


class _Table:
    """The device table of tensor addresses an op reads, with its host mirror, as pairs (device, host).
    Eager calls get the eager pair, which the op rewrites when an address changes. A capture gets a
    pair that is never rewritten nor dropped afterwards, since the library cannot see when the graph
    dies: one already captured with the bytes the last call left, else the pair the last call used,
    which then leaves the eager role (the next eager call makes and uploads a new one). `captured`
    may be shared between tables (clip_grad_norm_'s, kept by the module)."""

    def __init__(self, captured=None):
        self.eager = self.latest = None  # latest: the pair of the last call, whose bytes a capture needs
        self.captured = [] if captured is None else captured

    def get(self, entries, device):
        """(table, table_host, allow_upload) for an op over `entries` tensors on `device`."""
        need = max(entries, 1) * _ENTRY

        def fits(pair):
            return pair is not None and pair[0].device == device and pair[0].numel() >= need

        def new():
            return torch.zeros(need, dtype=torch.uint8, device=device), torch.zeros(need, dtype=torch.uint8)

        if not _capturing(device):
            if not fits(self.eager):
                self.eager = new()
            self.latest = self.eager
            return *self.eager, True
        latest = self.latest if fits(self.latest) else None
        pair = None
        if latest is not None:  # a captured pair with the same first `need` bytes serves as well as latest
            pair = next((p for p in self.captured if fits(p) and torch.equal(p[1][:need], latest[1][:need])), None)
        if pair is None:
            pair = latest if latest is not None else new()  # new: no addresses, the op asks for an eager call
            if pair is self.eager:
                self.eager = None
            self.captured.append(pair)
        self.latest = pair
        return *pair, False


def _norm_type(op, norm_type):
    norm_type = float(norm_type)
    if not norm_type > 0:
        raise ValueError(f"{op}: norm_type must be positive or inf, got {norm_type}")
    return norm_type


def _grad_norm(grads, norm_type, max_norm, per_tensor, table):
    if _backend.use_reference(grads[0].device):
        return ref.optim.grad_norm(grads, norm_type, max_norm, per_tensor)
    return _ops.grad_norm(grads, norm_type, max_norm, per_tensor, *table.get(len(grads), grads[0].device))


def _by_device(grads):
    """[(device, its gradients in order)], devices in order of first appearance."""
    out = {}
    for g in grads:
        out.setdefault(g.device, []).append(g)
    return list(out.items())


def _clip_coefficients(parts, norm_type, max_norm, per_tensor, tables):
    """The gradients' total norm over parts [(device, grads)] and, per part, the clip coefficients
    ([1], or one per gradient) and found_inf. One part: one norm launch. More (parameters on
    several devices): each part's norm on its device, combined on the first in float64 (moving
    the scalars is a host sync, as in torch), the coefficients computed there in float32."""
    if len(parts) == 1:
        device, grads = parts[0]
        total, _, coef, found_inf = _grad_norm(grads, norm_type, max_norm, per_tensor, tables(device, 0))
        return total, [coef], [found_inf]
    results = [_grad_norm(grads, norm_type, None, per_tensor, tables(device, i)) for i, (device, grads) in
               enumerate(parts)]
    first = parts[0][0]
    totals = torch.stack([r[0].to(first, torch.float64) for r in results])
    combined = totals.max() if math.isinf(norm_type) else totals.pow(norm_type).sum().pow(1.0 / norm_type)
    total = combined.float()
    found_inf = (~torch.isfinite(total)).float()
    coefs = []
    for (device, _), (_, norms, _, _) in zip(parts, results):
        norm = norms if per_tensor else total.to(device).reshape(1)
        coefs.append((max_norm / (norm + 1e-6)).clamp(max=1.0))
    return total, coefs, [found_inf.to(device) for device, _ in parts]


# clip_grad_norm_'s tables: the eager ones of the last _CLIP_LISTS parameter lists, by the parameters'
# ids and the device (a list reusing a dead list's ids shares its table: the op compares addresses
# before trusting it), and every one a capture got, kept for the life of the process, as its graph may be.
_CLIP_LISTS = 8
_clip_tables = collections.OrderedDict()
_clip_captured = []


def _clip_table(ids, device):
    table = _clip_tables.pop((ids, device), None)
    _clip_tables[ids, device] = table = table if table is not None else _Table(_clip_captured)
    while len(_clip_tables) > _CLIP_LISTS:
        _clip_tables.popitem(last=False)
    return table


def _nonfinite_error(norm_type):
    return RuntimeError(f"The total norm of order {norm_type} for gradients from `parameters` is non-finite, so it "
                        "cannot be clipped. To disable this error and scale the gradients by the non-finite norm "
                        "anyway, set `error_if_nonfinite=False`")


def clip_grad_norm_(parameters, max_norm, norm_type=2.0, error_if_nonfinite=False, foreach=None, per_tensor=False):
    """torch.nn.utils.clip_grad_norm_ on the multi-tensor norm kernel: scales the gradients in place
    by min(1, max_norm / (total_norm + 1e-6)) (computed in float32; max_norm 0 zeroes them, as in
    torch) and returns the total norm (a device tensor, the gradients' promoted dtype, as torch).
    ``per_tensor=True`` scales each gradient by its own norm instead (the return value is still the
    total). norm_type: any p > 0 or inf. ``foreach`` is accepted for torch's signature. A call can be
    captured in a CUDA graph after an eager one with the same parameters and gradients (the address
    table of each parameter list is kept between calls)."""
    if isinstance(parameters, torch.Tensor):
        parameters = [parameters]
    params = [p for p in parameters if p.grad is not None]
    grads = [p.grad for p in params]
    norm_type = _norm_type("clip_grad_norm_", norm_type)
    if not grads:
        return torch.tensor(0.0)
    parts = _by_device(grads)
    ids = tuple(map(id, params))
    total, coefs, found_inf = _clip_coefficients(parts, norm_type, float(max_norm), per_tensor,
                                                 lambda device, i: _clip_table(ids, device))
    if error_if_nonfinite and bool(found_inf[0]):
        raise _nonfinite_error(norm_type)
    with torch.no_grad():
        for (_, part), coef in zip(parts, coefs):
            if per_tensor:
                for g, c in zip(part, coef):
                    g.mul_(c)
            else:
                torch._foreach_mul_(part, coef[0])
    return total.to(functools.reduce(torch.promote_types, [g.dtype for g in grads]))


class AdamW(torch.optim.Optimizer):
    """torch.optim.AdamW with fused gradient clipping, float32 state and optional master weights (the
    module docstring says how)."""

    def __init__(self, params, lr=1e-3, betas=(0.9, 0.999), eps=1e-8, weight_decay=1e-2, amsgrad=False, *,
                 maximize=False, foreach=None, capturable=False, differentiable=False, fused=None, max_grad_norm=None,
                 norm_type=2.0, clip="global", master_weights=False, error_if_nonfinite=False):
        if isinstance(lr, torch.Tensor):
            if lr.numel() != 1:
                raise ValueError(f"AdamW: a tensor lr must have one element, got shape {tuple(lr.shape)}")
        elif not lr >= 0.0:
            raise ValueError(f"AdamW: invalid learning rate {lr}")
        if not eps >= 0.0:
            raise ValueError(f"AdamW: invalid eps {eps}")
        if not (0.0 <= betas[0] < 1.0 and 0.0 <= betas[1] < 1.0):
            raise ValueError(f"AdamW: invalid betas {betas}")
        if not weight_decay >= 0.0:
            raise ValueError(f"AdamW: invalid weight_decay {weight_decay}")
        if max_grad_norm is not None and not max_grad_norm > 0:
            raise ValueError(f"AdamW: max_grad_norm must be positive or None, got {max_grad_norm}")
        if clip not in ("global", "per_tensor"):
            raise ValueError(f"AdamW: clip must be 'global' or 'per_tensor', got {clip!r}")
        if amsgrad:
            raise ValueError("AdamW: amsgrad is not supported")
        if differentiable:
            raise ValueError("AdamW: differentiable is not supported")
        self.max_grad_norm, self.norm_type = max_grad_norm, _norm_type("AdamW", norm_type)
        self.clip, self.master_weights, self.error_if_nonfinite = clip, master_weights, error_if_nonfinite
        self.found_inf = self.grad_norm = None
        self._norm_tables, self._tables = {}, {}  # address tables by device, by (group, device)
        defaults = dict(lr=lr, betas=tuple(betas), eps=eps, weight_decay=weight_decay, amsgrad=False,
                        maximize=maximize, foreach=foreach, capturable=capturable, differentiable=False, fused=fused,
                        decoupled_weight_decay=True)  # torch's AdamW keys: a checkpoint's groups load into it
        super().__init__(params, defaults)

    def _init_state(self, p):
        state = self.state[p]
        if "step" not in state:
            state["step"] = torch.zeros((), dtype=torch.float32, device=p.device)
            state["exp_avg"] = torch.zeros_like(p, dtype=torch.float32, memory_format=torch.contiguous_format)
            state["exp_avg_sq"] = torch.zeros_like(p, dtype=torch.float32, memory_format=torch.contiguous_format)
            if self.master_weights and p.dtype != torch.float32:
                state["master_param"] = p.detach().float().contiguous()
        return state

    def load_state_dict(self, state_dict):
        """torch's, then the floating-point state back in float32 (torch casts it to the parameter's
        dtype) and each step as a float32 tensor on its parameter's device."""
        saved = state_dict["state"]
        super().load_state_dict(state_dict)
        ids = [i for group in state_dict["param_groups"] for i in group["params"]]
        params = [p for group in self.param_groups for p in group["params"]]
        for i, p in zip(ids, params):
            if i not in saved:
                continue
            state = self.state[p]
            for key in ("exp_avg", "exp_avg_sq", "master_param"):
                if key in saved[i]:
                    state[key] = saved[i][key].to(device=p.device, dtype=torch.float32, copy=True).contiguous()
            if not self.master_weights:
                state.pop("master_param", None)  # it would go stale
            if "step" in saved[i]:
                state["step"] = torch.tensor(float(saved[i]["step"]), dtype=torch.float32, device=p.device)
            if self.master_weights and p.dtype != torch.float32 and "master_param" not in state:
                state["master_param"] = p.detach().float().contiguous()

    @torch.no_grad()
    def step(self, closure=None):
        loss = None
        if closure is not None:
            with torch.enable_grad():
                loss = closure()
        groups = []
        for group in self.param_groups:
            if group.get("amsgrad") or group.get("differentiable") or not group.get("decoupled_weight_decay", True):
                raise ValueError("AdamW: amsgrad, differentiable and coupled weight decay are not supported (a param "
                                 "group has one set, perhaps from a loaded state_dict)")
            params = [p for p in group["params"] if p.grad is not None]
            for p in params:
                if p.grad.is_sparse:
                    raise ValueError("AdamW: sparse gradients are not supported")
            groups.append((group, params, [self._init_state(p) for p in params]))
        parts = _by_device([p.grad for _, params, _ in groups for p in params])
        if not parts:
            return loss
        per_tensor = self.clip == "per_tensor"
        part_of = {device: i for i, (device, _) in enumerate(parts)}
        coefs = found = [None] * len(parts)
        if self.max_grad_norm is not None:
            self.grad_norm, coefs, found = _clip_coefficients(
                parts, self.norm_type, float(self.max_grad_norm), per_tensor,
                lambda device, i: self._norm_tables.setdefault(device, _Table()))
            self.found_inf = found[0]
            if self.error_if_nonfinite and bool(found[0]):
                raise _nonfinite_error(self.norm_type)
        offsets = [0] * len(parts)  # a group's gradients on a device follow the previous group's there
        for index, (group, all_params, all_states) in enumerate(groups):
            for device in dict.fromkeys(p.device for p in all_params):
                i = part_of[device]
                params = [p for p in all_params if p.device == device]
                states = [s for p, s in zip(all_params, all_states) if p.device == device]
                coef = coefs[i][offsets[i]:offsets[i] + len(params)] if coefs[i] is not None and per_tensor else coefs[i]
                offsets[i] += len(params)
                self._update(index, group, device, params, states, coef, per_tensor, found[i])
        return loss

    def _update(self, index, group, device, params, states, group_coef, per_tensor, found_inf):
        """One AdamW launch: the parameters of one group on one device."""
        lr = group["lr"]
        lr_tensor = None
        if isinstance(lr, torch.Tensor):
            if lr.device == device:
                lr_tensor, lr = lr.reshape(()).float(), 0.0
            else:
                lr = float(lr)
        masters = [s.get("master_param", _empty(device)) for s in states] if self.master_weights else []
        args = ([p for p in params], [p.grad for p in params], [s["exp_avg"] for s in states],
                [s["exp_avg_sq"] for s in states], masters, [s["step"] for s in states], lr_tensor, float(lr),
                float(group["betas"][0]), float(group["betas"][1]), float(group["eps"]),
                float(group["weight_decay"]), bool(group["maximize"]), group_coef, per_tensor, found_inf)
        table = self._tables.setdefault((index, device), _Table())
        if _backend.use_reference(device):
            check_adamw(*args[:6], lr_tensor, group_coef, per_tensor, found_inf, *table.get(len(params), device)[:2])
            ref.optim.adamw(*args[:6], float(lr_tensor) if lr_tensor is not None else float(lr), *args[8:13],
                            group_coef, per_tensor, found_inf)
        else:
            _ops.adamw(*args, *table.get(len(params), device))


@functools.lru_cache(maxsize=None)
def _empty(device):
    return torch.empty(0, dtype=torch.float32, device=device)


# ---- the ops' CPU implementations (the reference, or the emulated kernels) and fake functions ----


@_backend.register_cpu("grad_norm")
def _grad_norm_cpu(tensors, norm_type, max_norm, per_tensor, table, table_host, allow_upload=True):
    check_grad_norm(tensors, norm_type, table, table_host)
    return ref.optim.grad_norm(tensors, norm_type, max_norm, per_tensor)


@_backend.register_cpu("adamw")
def _adamw_cpu(params, grads, exp_avgs, exp_avg_sqs, masters, steps, lr_tensor, lr, beta1, beta2, eps, weight_decay,
               maximize, clip_coef, per_tensor_clip, found_inf, table, table_host, allow_upload=True):
    check_adamw(params, grads, exp_avgs, exp_avg_sqs, masters, steps, lr_tensor, clip_coef, per_tensor_clip,
                found_inf, table, table_host)
    ref.optim.adamw(params, grads, exp_avgs, exp_avg_sqs, masters, steps,
                    float(lr_tensor) if lr_tensor is not None else lr, beta1, beta2, eps, weight_decay, maximize,
                    clip_coef, per_tensor_clip, found_inf)


@torch.library.register_fake("flashkern::grad_norm")
def _grad_norm_fake(tensors, norm_type, max_norm, per_tensor, table, table_host, allow_upload=True):
    check_grad_norm(tensors, norm_type, table, table_host)
    t = tensors[0]
    n = len(tensors)
    return (t.new_empty((), dtype=torch.float32), t.new_empty((n,), dtype=torch.float32),
            t.new_empty((n if per_tensor else 1) if max_norm is not None else 0, dtype=torch.float32),
            t.new_empty((), dtype=torch.float32))


@torch.library.register_fake("flashkern::adamw")
def _adamw_fake(params, grads, exp_avgs, exp_avg_sqs, masters, steps, lr_tensor, lr, beta1, beta2, eps, weight_decay,
                maximize, clip_coef, per_tensor_clip, found_inf, table, table_host, allow_upload=True):
    check_adamw(params, grads, exp_avgs, exp_avg_sqs, masters, steps, lr_tensor, clip_coef, per_tensor_clip,
                found_inf, table, table_host)


__all__ = ["AdamW", "clip_grad_norm_"]
