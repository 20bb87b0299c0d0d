"""References of the training-step ops (the CPU implementations and the test oracles): the
multi-tensor gradient norm and AdamW, with the kernels' arithmetic: norms accumulated in float64,
the AdamW update in float32 with torch's formulas (bias corrections in float64, as torch computes
them on the host), written back to 16-bit parameters rounded to nearest even."""

import math

import torch


def _finish(acc, p):
    if math.isinf(p) or p == 1.0:
        return acc
    return math.sqrt(acc) if p == 2.0 else acc ** (1.0 / p)


def _accumulate(g, p):
    g = g.double().abs()
    if math.isinf(p):
        return float(g.max()) if g.numel() else 0.0
    return float(g.pow(p).sum())


def _clip_coefficient(max_norm, norm):
    c = torch.tensor(max_norm, dtype=torch.float32) / (torch.tensor(norm, dtype=torch.float32) + 1e-6)
    return c.clamp(max=1.0)  # NaN stays NaN


def grad_norm(tensors, norm_type, max_norm, per_tensor):
    """(total_norm, tensor_norms, clip_coef, found_inf) as float32 tensors on the tensors' device;
    max_norm None: no clip coefficients. found_inf: the float32 total is not finite."""
    accs = [_accumulate(t, norm_type) for t in tensors]
    if math.isinf(norm_type):
        total_acc = max(accs, key=lambda a: (math.isnan(a), a))
    else:
        total_acc = sum(accs)
    device = tensors[0].device
    total = torch.tensor(_finish(total_acc, norm_type), dtype=torch.float32)
    norms = torch.tensor([_finish(a, norm_type) for a in accs], dtype=torch.float32)
    if max_norm is not None:
        coef = torch.stack([_clip_coefficient(max_norm, float(n)) for n in (norms if per_tensor else [total])])
    else:
        coef = torch.empty(0)
    return total.to(device), norms.to(device), coef.to(device), torch.tensor(float(not torch.isfinite(total)), device=device)


def _lerp(m, g, w):
    return m + w * (g - m) if w < 0.5 else g - (g - m) * (1.0 - w)


def adamw(params, grads, exp_avgs, exp_avg_sqs, masters, steps, lr, beta1, beta2, eps, weight_decay, maximize,
          clip_coef, per_tensor_clip, found_inf):
    """In place, as the kernel: lr a float; clip_coef / found_inf float32 tensors or None."""
    if found_inf is not None and float(found_inf) != 0:
        return
    f32 = lambda x: torch.tensor(x, dtype=torch.float32)  # noqa: E731
    beta2_, eps_ = f32(beta2), f32(eps)
    for i, p in enumerate(params):
        step = float(steps[i]) + 1.0
        bc1, bc2 = 1.0 - beta1 ** step, 1.0 - beta2 ** step
        decay, step_size, bc2_sqrt = f32(1.0 - lr * weight_decay), f32(lr / bc1), f32(math.sqrt(bc2))
        g = grads[i].float().flatten()
        if clip_coef is not None:
            g = g * clip_coef[i if per_tensor_clip else 0].float()
        if maximize:
            g = -g
        master = masters[i] if masters and masters[i].numel() > 0 else None
        w = (master if master is not None else p).float().flatten()
        m = _lerp(exp_avgs[i].flatten(), g, float(f32(1.0 - beta1)))
        v = exp_avg_sqs[i].flatten() * beta2_ + f32(1.0 - beta2) * g * g
        denom = v.sqrt() / bc2_sqrt + eps_
        w = w * decay + -step_size * m / denom
        exp_avgs[i].copy_(m.view_as(exp_avgs[i]))
        exp_avg_sqs[i].copy_(v.view_as(exp_avg_sqs[i]))
        if master is not None:
            master.copy_(w.view_as(master))
        p.copy_(w.view_as(p))
        steps[i].add_(1.0)
