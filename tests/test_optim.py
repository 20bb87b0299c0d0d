"""flashkern.optim: AdamW with fused gradient clipping and clip_grad_norm_, on every device (the
reference, the emulated kernels, a GPU), against torch.optim.AdamW and torch.nn.utils.clip_grad_norm_
run in float64: ragged parameter lists, two param groups, learning rates changing between steps,
clipping on and off, 16-bit parameters with and without master weights, the eps trap, non-finite
gradients, checkpoints moving between the two optimizers, a tiny model training."""

import copy
import gc
import weakref

import pytest
import torch
from conftest import GPU, emulated, requires_gpu

import flashkern
from flashkern.optim import AdamW

SIZES = [1, 7, 4097, 65536 + 3, 3 * 65536 + 5]  # the last spans four chunks of the multi-tensor kernels
# float32 updates against the float64 trajectory after STEPS steps: each step's relative error is a few
# float32 ulps of an update of about lr, so the parameters drift by about STEPS * lr * 1e-6.
FP32_TOL = {"atol": 2e-6, "rtol": 2e-5}


def steps_for(device, full=50):
    return 10 if emulated(device) else full  # the emulation runs every GPU thread of every block on the host


@pytest.fixture(autouse=True)
def _one_emulated_build(request):
    """The optimizer through the CUDA launchers' emulation; the HIP launchers' kernels (wave64 and
    wave32 norms) are run directly by tests/test_emulated_kernels.py (CI time)."""
    device = getattr(request.node, "callspec", None) and request.node.callspec.params.get("device")
    if getattr(device, "backend", None) == "emulate-wave64":
        pytest.skip("emulate-wave64: the CUDA build's emulation runs it (CI time)")


def make_params(device, dtype=torch.float32, seed=0):
    g = torch.Generator().manual_seed(seed)
    return [torch.nn.Parameter(torch.randn(n, generator=g, dtype=torch.float64).to(device=device, dtype=dtype))
            for n in SIZES]


def gradients(step, params, scale=1.0):
    g = torch.Generator().manual_seed(1000 + step)
    return [torch.randn(p.shape, generator=g, dtype=torch.float64) * scale for p in params]


def groups(params, lr=(1e-2, 3e-3), weight_decay=0.1):
    """Two param groups with their own lr, betas, eps and weight decay."""
    return [{"params": params[:3], "lr": lr[0], "weight_decay": weight_decay},
            {"params": params[3:], "lr": lr[1], "betas": (0.8, 0.99), "eps": 1e-6, "weight_decay": weight_decay / 2}]


def run_both(device, steps, weight_decay, max_grad_norm, scale=1.0):
    """flashkern's AdamW (float32, on device) and torch's AdamW + clip_grad_norm_ (float64, CPU), the
    same gradients, lr decayed between steps; returns both optimizers and parameter lists."""
    ours_p, ref_p = make_params(device), [torch.nn.Parameter(p.detach().double().cpu()) for p in make_params("cpu")]
    ours = AdamW(groups(ours_p, weight_decay=weight_decay), max_grad_norm=max_grad_norm)
    theirs = torch.optim.AdamW(groups(ref_p, weight_decay=weight_decay))
    for step in range(steps):
        grads = gradients(step, ours_p, scale)
        for p, g in zip(ours_p, grads):
            p.grad = g.to(device=device, dtype=p.dtype)
        for p, g in zip(ref_p, grads):
            p.grad = g.clone()
        ours.step()
        if max_grad_norm is not None:
            torch.nn.utils.clip_grad_norm_(ref_p, max_grad_norm)
        theirs.step()
        for opt in (ours, theirs):
            for group in opt.param_groups:
                group["lr"] *= 0.97
    return ours, ours_p, theirs, ref_p


@pytest.mark.parametrize("weight_decay", [0.0, 0.1])
@pytest.mark.parametrize("clip", ["active", "inactive", "none"])
def test_matches_torch_adamw(device, weight_decay, clip):
    max_grad_norm = {"active": 50.0, "inactive": 1e6, "none": None}[clip]  # the gradients' norm is about 470
    ours, ours_p, theirs, ref_p = run_both(device, steps_for(device), weight_decay, max_grad_norm)
    for p, q in zip(ours_p, ref_p):
        torch.testing.assert_close(p.detach().double().cpu(), q.detach(), **FP32_TOL)
        for key in ("exp_avg", "exp_avg_sq"):
            s = ours.state[p][key]
            assert s.dtype == torch.float32
            expected = theirs.state[q][key]  # a moment near 0 keeps the float32 error of its larger terms
            torch.testing.assert_close(s.double().cpu(), expected, rtol=1e-5, atol=1e-6 * float(expected.abs().max()))
        assert float(ours.state[p]["step"]) == float(theirs.state[q]["step"])
    if max_grad_norm is not None:
        assert ours.grad_norm is not None and float(ours.found_inf) == 0.0


def test_clip_grad_norm_matches_torch(device):
    for norm_type in (1.0, 2.0, 3.0, float("inf")):
        ours_p, ref_p = make_params(device), make_params("cpu", torch.float64)
        for p, q, g in zip(ours_p, ref_p, gradients(0, ours_p)):
            p.grad, q.grad = g.to(device=device, dtype=torch.float32), g.clone()
        total = flashkern.clip_grad_norm_(ours_p, 3.0, norm_type)
        expected = torch.nn.utils.clip_grad_norm_(ref_p, 3.0, norm_type)
        assert total.dtype == torch.float32 and total.device == ours_p[0].device
        torch.testing.assert_close(total.double().cpu(), expected, rtol=1e-6, atol=0)
        for p, q in zip(ours_p, ref_p):
            torch.testing.assert_close(p.grad.double().cpu(), q.grad, rtol=1e-6, atol=1e-9)


def test_many_tensors_and_parameters_without_gradients(device):
    """2000 small tensors in one launch; parameters without a gradient keep their value and get no state."""
    g = torch.Generator().manual_seed(5)
    target = torch.empty(0, device=device).device
    params = [torch.nn.Parameter(torch.randn(3 + i % 5, generator=g).to(target)) for i in range(2000)]
    reference = [torch.nn.Parameter(p.detach().double().cpu()) for p in params]
    for i, (p, q) in enumerate(zip(params, reference)):
        if i % 7 != 3:
            grad = torch.randn(p.shape, generator=g, dtype=torch.float64)
            p.grad, q.grad = grad.to(device=p.device, dtype=torch.float32), grad
    ours, theirs = AdamW(params, max_grad_norm=5.0), torch.optim.AdamW(reference, foreach=True)
    ours.step()
    torch.nn.utils.clip_grad_norm_(reference, 5.0)
    theirs.step()
    torch.testing.assert_close(torch.cat([p.detach().double().cpu() for p in params]),
                               torch.cat([q.detach() for q in reference]), **FP32_TOL)
    assert [p in ours.state for p in params] == [i % 7 != 3 for i in range(len(params))]


def test_norm_is_the_same_every_run(device):
    params = make_params(device)
    for p, g in zip(params, gradients(0, params)):
        p.grad = g.to(device=device, dtype=torch.float32)
    grads = [p.grad for p in params]
    table = flashkern.optim._Table()
    runs = [flashkern.optim._grad_norm(grads, 2.0, 1.0, False, table) for _ in range(3)]
    for total, norms, coef, _ in runs[1:]:
        assert torch.equal(total, runs[0][0]) and torch.equal(norms, runs[0][1]) and torch.equal(coef, runs[0][2])


@pytest.mark.parametrize("per_tensor", [False, True])
def test_norms_of_several_devices_combine(device, per_tensor):
    """Parameters on several devices: a norm per device, combined. Two parts on one device take the
    same path as two devices, and give the coefficients of one part."""
    params = make_params(device)
    grads = [g.to(device=device, dtype=torch.float32) for g in gradients(0, params)]
    tables = lambda device, i: flashkern.optim._Table()  # noqa: E731
    one = flashkern.optim._clip_coefficients([(grads[0].device, grads)], 2.0, 50.0, per_tensor, tables)
    two = flashkern.optim._clip_coefficients([(grads[0].device, grads[:2]), (grads[0].device, grads[2:])], 2.0, 50.0,
                                             per_tensor, tables)
    torch.testing.assert_close(two[0], one[0], rtol=1e-6, atol=0)
    expected = [one[1][0][:2], one[1][0][2:]] if per_tensor else [one[1][0], one[1][0]]
    for got, want in zip(two[1], expected):
        torch.testing.assert_close(got, want, rtol=1e-6, atol=0)
    assert [float(f) for f in two[2]] == [0.0, 0.0]


@requires_gpu
def test_parameters_on_two_devices():
    """Some parameters on the GPU, some on the CPU, as torch allows: the same steps as torch's."""
    ours_p = make_params("cpu")[:2] + make_params("cuda")[2:]
    ref_p = [torch.nn.Parameter(p.detach().double().cpu()) for p in ours_p]
    ours, theirs = AdamW(ours_p, max_grad_norm=50.0), torch.optim.AdamW(ref_p)
    for step in range(3):
        for p, q, g in zip(ours_p, ref_p, gradients(step, ours_p)):
            p.grad, q.grad = g.to(device=p.device, dtype=torch.float32), g.clone()
        ours.step()
        torch.nn.utils.clip_grad_norm_(ref_p, 50.0)
        theirs.step()
    for p, q in zip(ours_p, ref_p):
        torch.testing.assert_close(p.detach().double().cpu(), q.detach(), **FP32_TOL)


def test_clip_per_tensor(device):
    params = make_params(device)
    grads = gradients(0, params)
    for p, g in zip(params, grads):
        p.grad = g.to(device=device, dtype=torch.float32)
    total = flashkern.clip_grad_norm_(params, 10.0, per_tensor=True)
    torch.testing.assert_close(total.double().cpu(), torch.linalg.vector_norm(torch.cat(grads)), rtol=1e-6, atol=0)
    for p, g in zip(params, grads):
        expected = g * min(1.0, 10.0 / (float(g.norm()) + 1e-6))
        torch.testing.assert_close(p.grad.double().cpu(), expected, rtol=1e-6, atol=1e-9)


def test_16_bit_parameters_and_master_weights(device):
    """bfloat16 parameters: with master weights the float32 copy follows the float32 trajectory (the same
    arithmetic; the kernels sum a bfloat16 gradient's squares in another order, so the clip coefficient
    may differ in its last bit) and the parameter is its rounding; without, each step's update is
    rounded into the parameter, so the error is at most half a bfloat16 ulp per step (updates smaller
    than that are lost)."""
    steps = steps_for(device, 20)
    start = [p.detach().to(torch.bfloat16) for p in make_params("cpu")]
    runs = {}
    for name, dtype, master in (("fp32", torch.float32, False), ("master", torch.bfloat16, True),
                                ("plain", torch.bfloat16, False)):
        params = [torch.nn.Parameter(s.to(device=device, dtype=dtype, copy=True)) for s in start]
        opt = AdamW(params, lr=1e-2, weight_decay=0.1, max_grad_norm=50.0, master_weights=master)
        for step in range(steps):
            for p, g in zip(params, gradients(step, params)):
                p.grad = g.to(torch.bfloat16).to(device=device, dtype=dtype)  # the same bfloat16 gradients
            opt.step()
        runs[name] = (params, opt)
    fp32, _ = runs["fp32"]
    master, opt = runs["master"]
    for p, q in zip(master, fp32):
        torch.testing.assert_close(opt.state[p]["master_param"], q.detach(), rtol=1e-6, atol=1e-7)
        assert torch.equal(p.detach(), opt.state[p]["master_param"].to(torch.bfloat16))
    for p, q in zip(runs["plain"][0], fp32):
        bound = steps * 2.0**-9 * float(q.detach().abs().max()) * 2  # half an ulp of |p| <= 2 |p| 2^-9, per step
        assert float((p.detach().float() - q.detach()).abs().max()) <= bound


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
def test_eps_trap(device, dtype):
    """Gradients around 1e-5: v_hat about 1e-10, below float16's smallest normal. With float32 state the
    update equals torch's float32 AdamW on float32 copies (about lr per step), not a blow-up."""
    params = [torch.nn.Parameter(torch.full((257,), 0.5, dtype=dtype, device=device))]
    reference = [torch.nn.Parameter(params[0].detach().float().cpu())]
    ours = AdamW(params, lr=1e-3, weight_decay=0.0, master_weights=True)
    theirs = torch.optim.AdamW(reference, lr=1e-3, weight_decay=0.0)
    g = torch.Generator().manual_seed(3)
    for _ in range(5):
        grad = (torch.randn(257, generator=g) * 1e-5).to(dtype)
        params[0].grad, reference[0].grad = grad.to(device), grad.float()
        ours.step()
        theirs.step()
    master = ours.state[params[0]]["master_param"]
    assert torch.isfinite(master).all() and torch.isfinite(ours.state[params[0]]["exp_avg_sq"]).all()
    torch.testing.assert_close(master.cpu(), reference[0].detach(), rtol=1e-6, atol=1e-7)
    assert float((master.cpu() - 0.5).abs().max()) < 6e-3  # five steps of at most about lr each


def test_nonfinite_gradient_skips_the_step(device):
    params = make_params(device)
    opt = AdamW(groups(params), max_grad_norm=1.0)
    for p, g in zip(params, gradients(0, params)):
        p.grad = g.to(device=device, dtype=torch.float32)
    opt.step()
    before = copy.deepcopy([p.detach() for p in params]), copy.deepcopy(opt.state_dict()["state"])
    params[4].grad[70000] = float("nan")
    opt.step()
    assert float(opt.found_inf) == 1.0 and torch.isnan(opt.grad_norm)
    after = [p.detach() for p in params], opt.state_dict()["state"]
    for p, q in zip(*[b[0] for b in (before,)], after[0]):
        assert torch.equal(p, q)
    for i, state in before[1].items():
        for key, value in state.items():
            assert torch.equal(value, after[1][i][key]), key
    params[4].grad[70000] = 0.0
    opt.step()  # a finite step again
    assert float(opt.found_inf) == 0.0 and float(opt.state[params[0]]["step"]) == 2.0
    params[0].grad[0] = float("inf")
    strict = AdamW(params, max_grad_norm=1.0, error_if_nonfinite=True)
    with pytest.raises(RuntimeError, match="non-finite"):
        strict.step()
    with pytest.raises(RuntimeError, match="non-finite"):
        flashkern.clip_grad_norm_(params, 1.0, error_if_nonfinite=True)


def test_norm_beyond_float32_is_nonfinite(device):
    """An l1 norm whose float64 sum is finite but whose float32 value is not: the step is skipped."""
    params = [torch.nn.Parameter(torch.zeros(200, device=torch.empty(0, device=device).device))]
    params[0].grad = torch.full_like(params[0], 3e36)
    opt = AdamW(params, max_grad_norm=1.0, norm_type=1.0, weight_decay=0.1)
    opt.step()
    assert float(opt.found_inf) == 1.0 and torch.isinf(opt.grad_norm)
    assert torch.equal(params[0].detach(), torch.zeros_like(params[0])) and float(opt.state[params[0]]["step"]) == 0.0


def test_clip_to_zero_like_torch(device):
    params = make_params(device)[:3]
    for p in params:
        p.grad = torch.ones_like(p)
    total = flashkern.clip_grad_norm_(params, 0.0)
    assert float(total) > 0 and all(float(p.grad.abs().max()) == 0.0 for p in params)


def test_no_upload_while_capturing(device):
    """The glue refuses to rewrite the address table when told a graph is being captured (on a GPU
    the optimizer says so; here the op is called directly). The reference has no table."""
    if not (emulated(device) or device == "cuda"):
        pytest.skip("the reference backend has no address table")
    grads = [p.detach() for p in make_params(device)[:2]]
    table = torch.zeros(2 * flashkern._C.OPTIM_TABLE_ENTRY_BYTES, dtype=torch.uint8, device=grads[0].device)
    host = torch.zeros_like(table, device="cpu")
    with pytest.raises(ValueError, match="captured"):
        torch.ops.flashkern.grad_norm(grads, 2.0, None, False, table, host, False)
    torch.ops.flashkern.grad_norm(grads, 2.0, None, False, table, host, True)
    torch.ops.flashkern.grad_norm(grads, 2.0, None, False, table, host, False)  # unchanged: no upload needed


def test_upload_that_raises_leaves_a_mirror_claiming_nothing(device):
    """The host mirror is written after the copy to the device table: an upload whose copy raises (into
    an inference tensor outside inference mode: torch copies, then refuses the version bump) leaves a
    mirror that matches no entries, so the next call uploads again instead of trusting the table."""
    if not (emulated(device) or device == "cuda"):
        pytest.skip("the reference backend has no address table")
    grads = [p.detach() for p in make_params(device)[:2]]
    table = torch.zeros(2 * flashkern._C.OPTIM_TABLE_ENTRY_BYTES, dtype=torch.uint8, device=grads[0].device)
    uploaded = torch.zeros_like(table, device="cpu")
    torch.ops.flashkern.grad_norm(grads, 2.0, None, False, table, uploaded, True)  # the entries, once uploaded
    with torch.inference_mode():
        refused = torch.zeros_like(table)
    mirror = torch.zeros_like(uploaded)
    with pytest.raises(RuntimeError, match="inference"):
        torch.ops.flashkern.grad_norm(grads, 2.0, None, False, refused, mirror, True)
    assert uploaded.any() and not torch.equal(mirror, uploaded)


class TableSpy:
    """Records what each _Table.get hands out. take(), after the op: for each, (allow_upload, a weak
    reference to the device table, its bytes and its host mirror's bytes then); no table is held after."""

    def __init__(self, monkeypatch):
        self.handed = []
        get = flashkern.optim._Table.get

        def spy(table, entries, device):
            got = get(table, entries, device)
            self.handed.append(got)
            return got

        monkeypatch.setattr(flashkern.optim._Table, "get", spy)

    def take(self):
        handed, self.handed = self.handed, []
        return [(allow, weakref.ref(table), table.cpu().clone(), host.clone()) for table, host, allow in handed]


def fake_capture(monkeypatch, capturing):
    """The tables see a CUDA graph being captured (or not); the step itself runs, with uploads refused."""
    monkeypatch.setattr(flashkern.optim, "_capturing", lambda device: capturing)


def test_captured_tables_outlive_eager_steps(device, monkeypatch):
    """Eager step, capture, an eager step with other gradient tensors: the tables the capture got are
    still held, with the captured addresses, and the eager step uploads into tables of its own (it once
    replaced a captured table and dropped it, so a replay read freed memory). A later capture with the
    addresses of an earlier one shares its tables: repeated captures do not grow them."""
    if not (emulated(device) or device == "cuda"):
        pytest.skip("the reference backend has no address table")
    params = make_params(device)[:3]
    opt = AdamW([{"params": params[:2]}, {"params": params[2:], "lr": 3e-3}], max_grad_norm=1.0)
    spy = TableSpy(monkeypatch)
    kept = []  # every gradient tensor used, so that no address is reused by a later one

    def step(seed, capture=False, grads=None):
        """A step with new gradient tensors (`grads`: these), or with the same ones under a capture."""
        if capture:
            for p, g in zip(params, gradients(seed, params)):
                p.grad.copy_(g)
        else:
            grads = grads or [g.to(device=p.device, dtype=torch.float32)
                              for p, g in zip(params, gradients(seed, params))]
            for p, g in zip(params, grads):
                p.grad = g
            kept.append(grads)
        fake_capture(monkeypatch, capture)
        opt.step()
        handed = spy.take()
        assert len(handed) == 3 and all(allow is not capture for allow, *_ in handed)  # the norm, two groups
        return handed

    step(0)
    first = step(1, capture=True)
    eager = step(2)
    gc.collect()
    for (_, captured, data, host), (_, table, _, eager_host) in zip(first, eager):
        assert captured() is not None, "a captured table was dropped by the eager step after the capture"
        assert torch.equal(captured().cpu(), data) and torch.equal(host, data)  # neither rewritten
        assert table() is not captured() and not torch.equal(eager_host, host)  # the new addresses, elsewhere
    second = step(3, capture=True)  # the addresses of step 2: new tables for the graph
    assert all(table() is not captured() for (_, table, *_), (_, captured, *_) in zip(second, first))
    step(4, grads=kept[0])
    third = step(5, capture=True)  # the addresses of the first capture: its tables
    assert all(table() is captured() for (_, table, *_), (_, captured, *_) in zip(third, first))
    tables = [*opt._norm_tables.values(), *opt._tables.values()]
    assert len(tables) == 3 and all(len(t.captured) == 2 for t in tables)


def test_clip_grad_norm_keeps_its_table(device, monkeypatch):
    """clip_grad_norm_ keeps an address table per parameter list, so that a call can be captured after an
    eager one (a new table each call never matched and was refused); the table a capture got outlives
    the eager calls after it."""
    if not (emulated(device) or device == "cuda"):
        pytest.skip("the reference backend runs clip_grad_norm_ without a table")
    params, others = make_params(device)[:3], make_params(device, seed=1)[:2]
    spy = TableSpy(monkeypatch)

    def clip(params, capture=False, new_grads=False):
        if new_grads:
            for p, g in zip(params, gradients(7, params)):
                p.grad = g.to(device=p.device, dtype=torch.float32)
        fake_capture(monkeypatch, capture)
        flashkern.clip_grad_norm_(params, 1e9)
        (handed,) = spy.take()
        return handed

    _, first, data, _ = clip(params, new_grads=True)
    grads = [p.grad for p in params]  # held, so that no later gradient takes their addresses
    _, again, again_data, _ = clip(iter(params))  # the same parameters, as a generator
    assert first() is not None and again() is first() and torch.equal(again_data, data)
    assert clip(others, new_grads=True)[1]() is not first()
    allow, captured, captured_data, _ = clip(params, capture=True)
    assert not allow and torch.equal(captured_data, data)
    _, eager, eager_data, _ = clip(params, new_grads=True)
    gc.collect()
    assert captured() is not None and torch.equal(captured().cpu(), data)
    assert eager() is not captured() and not torch.equal(eager_data, data) and len(grads) == 3


def test_state_dict_moves_between_the_optimizers(device):
    steps = steps_for(device, 10)
    ours_p = make_params(device)
    ours = AdamW(groups(ours_p))
    for step in range(steps):
        for p, g in zip(ours_p, gradients(step, ours_p)):
            p.grad = g.to(device=device, dtype=torch.float32)
        ours.step()
    # ours -> torch: the same keys; both continue with the same gradients
    theirs_p = [torch.nn.Parameter(p.detach().clone()) for p in ours_p]
    theirs = torch.optim.AdamW(groups(theirs_p))
    theirs.load_state_dict(copy.deepcopy(ours.state_dict()))  # as through torch.save / torch.load
    # torch -> ours
    back_p = [torch.nn.Parameter(p.detach().clone()) for p in ours_p]
    back = AdamW(groups(back_p))
    back.load_state_dict(copy.deepcopy(theirs.state_dict()))
    assert all(back.state[p]["step"].device == p.device and back.state[p]["exp_avg"].dtype == torch.float32
               for p in back_p)
    for step in range(steps, steps + 3):
        grads = gradients(step, ours_p)
        for params in (ours_p, theirs_p, back_p):
            for p, g in zip(params, grads):
                p.grad = g.to(device=device, dtype=torch.float32)
        for opt in (ours, theirs, back):
            opt.step()
    for p, q, r in zip(ours_p, theirs_p, back_p):
        torch.testing.assert_close(q.detach().cpu(), p.detach().cpu(), rtol=1e-5, atol=1e-6)
        assert torch.equal(r.detach(), p.detach())


def test_tiny_model_trains_like_torch(device):
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(16, 32), torch.nn.Tanh(), torch.nn.Linear(32, 1))
    twin = copy.deepcopy(model)
    model.to(device)
    x, y = torch.randn(64, 16), torch.randn(64, 1)
    ours = AdamW(model.parameters(), lr=1e-2, max_grad_norm=1.0)
    theirs = torch.optim.AdamW(twin.parameters(), lr=1e-2)
    losses = []
    for _ in range(steps_for(device, 30)):
        step = []
        for m, opt, clip in ((model, ours, None), (twin, theirs, True)):
            opt.zero_grad()
            loss = torch.nn.functional.mse_loss(m(x.to(next(m.parameters()).device)), y.to(next(m.parameters()).device))
            loss.backward()
            if clip:
                torch.nn.utils.clip_grad_norm_(m.parameters(), 1.0)
            opt.step()
            step.append(float(loss))
        losses.append(step)
    assert losses[-1][0] < 0.8 * losses[0][0]
    for a, b in losses:
        assert abs(a - b) <= 1e-5 * abs(b)


def test_lr_tensor(device):
    params = make_params(device)
    lr = torch.tensor(1e-2, device=params[0].device)
    opt = AdamW(params, lr=lr)
    twin_p = make_params(device)
    twin = AdamW(twin_p, lr=1e-2)
    for params_, opt_ in ((params, opt), (twin_p, twin)):
        for p, g in zip(params_, gradients(0, params_)):
            p.grad = g.to(device=device, dtype=torch.float32)
        opt_.step()
    for p, q in zip(params, twin_p):
        assert torch.equal(p.detach(), q.detach())


def test_bad_input(device):
    params = make_params(device)
    with pytest.raises(ValueError, match="amsgrad"):
        AdamW(params, amsgrad=True)
    with pytest.raises(ValueError, match="max_grad_norm"):
        AdamW(params, max_grad_norm=-1.0)
    with pytest.raises(ValueError, match="clip"):
        AdamW(params, clip="local")
    with pytest.raises(ValueError, match="norm_type"):
        flashkern.clip_grad_norm_(params, 1.0, norm_type=0.0)
    double = [torch.nn.Parameter(torch.randn(5, dtype=torch.float64, device=params[0].device))]
    double[0].grad = torch.randn(5, dtype=torch.float64, device=params[0].device)
    with pytest.raises(TypeError, match="float16, bfloat16 or float32"):
        AdamW(double).step()
    embedding = torch.nn.Embedding(10, 4, sparse=True).to(params[0].device)
    embedding(torch.tensor([1, 2], device=params[0].device)).sum().backward()
    with pytest.raises(ValueError, match="sparse"):
        AdamW(embedding.parameters()).step()
    params[1].grad = torch.randn(14, device=params[0].device)[::2]  # not contiguous
    with pytest.raises(ValueError, match="contiguous"):
        AdamW(params[1:2]).step()


def test_ops_opcheck():
    """The ops' schemas, fake functions and CPU implementations agree (torch.library.opcheck)."""
    tensors = [torch.randn(n) for n in (3, 70000)]
    table, host = torch.zeros(2 * flashkern._C.OPTIM_TABLE_ENTRY_BYTES, dtype=torch.uint8), torch.zeros(
        2 * flashkern._C.OPTIM_TABLE_ENTRY_BYTES, dtype=torch.uint8)
    torch.library.opcheck(torch.ops.flashkern.grad_norm.default, (tensors, 2.0, 1.0, False, table, host, True),
                          test_utils=("test_schema", "test_faketensor"))
    params = [torch.randn(n) for n in (3, 70000)]
    state = ([p.clone() for p in params], [p.abs() for p in params], [torch.zeros(()), torch.zeros(())])
    torch.library.opcheck(torch.ops.flashkern.adamw.default,
                          (params, tensors, *state[:2], [], state[2], None, 1e-3, 0.9, 0.999, 1e-8, 0.0, False, None,
                           False, None, table, host, True), test_utils=("test_schema", "test_faketensor"))


@requires_gpu
def test_step_captured_in_a_cuda_graph():
    """A whole step (norm, clip, update) captured once and replayed equals the eager steps."""
    params, eager_p = make_params("cuda"), make_params("cuda")
    opt, eager = AdamW(params, max_grad_norm=1.0), AdamW(eager_p, max_grad_norm=1.0)
    static = [torch.zeros_like(p) for p in params]
    for p, g in zip(params, static):
        p.grad = g
    for p, g in zip(params, gradients(0, params)):
        p.grad.copy_(g.float())
    opt.step()  # the first step uploads the address tables; replays reuse them
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        opt.step()
    for p, g in zip(eager_p, gradients(0, eager_p)):
        p.grad = g.float().cuda()
    eager.step()
    for step in range(1, 4):
        grads = gradients(step, params)
        for p, q, g in zip(params, eager_p, grads):
            p.grad.copy_(g.float())
            q.grad = g.float().cuda()
        graph.replay()
        eager.step()
    for p, q in zip(params, eager_p):
        assert torch.equal(p.detach(), q.detach())
    assert GPU


def junk_over_freed_tables():
    """Small allocations filled with 0xFF: a table freed while a graph still reads it (the caching
    allocator's 512-byte blocks) would be handed to one of these, and a replay would follow its bytes."""
    return [torch.full((512,), 255, dtype=torch.uint8, device="cuda") for _ in range(32)]


@requires_gpu
def test_eager_steps_between_capture_and_replays():
    """Eager step, capture, an eager step with other gradient tensors, replays, another eager step, a
    replay: each step equals an all-eager twin bit for bit and torch's AdamW + clip_grad_norm_ in
    float64 (the eager step after a capture once freed the tables the graph reads: illegal addresses
    or writes into other tensors)."""
    params, twin_p = make_params("cuda"), make_params("cuda")
    ref_p = [torch.nn.Parameter(p.detach().double().cpu()) for p in params]
    opt, twin = AdamW(groups(params), max_grad_norm=50.0), AdamW(groups(twin_p), max_grad_norm=50.0)
    theirs = torch.optim.AdamW(groups(ref_p))
    static = [torch.zeros_like(p) for p in params]
    graph, junk = torch.cuda.CUDAGraph(), []
    for step, how in enumerate(["static", "capture", "eager", "replay", "replay", "eager", "replay"]):
        grads = gradients(step, params)
        for p, s, t, q, g in zip(params, static, twin_p, ref_p, grads):
            s.copy_(g.float())
            p.grad = s if how != "eager" else g.float().cuda()  # the graph reads `static`
            t.grad, q.grad = g.float().cuda(), g.clone()
        if how == "capture":
            with torch.cuda.graph(graph):
                opt.step()
            continue  # a capture runs nothing
        if how == "replay":
            graph.replay()
        else:
            opt.step()
        if how == "eager":
            junk += junk_over_freed_tables()  # held through the replays that follow
        twin.step()
        torch.nn.utils.clip_grad_norm_(ref_p, 50.0)
        theirs.step()
        for p, t, q in zip(params, twin_p, ref_p):
            assert torch.equal(p.detach(), t.detach()), (step, how)
            torch.testing.assert_close(p.detach().double().cpu(), q.detach(), **FP32_TOL)
    assert all(float(opt.state[p]["step"]) == 6.0 for p in params)


@requires_gpu
def test_clip_grad_norm_captured_in_a_cuda_graph():
    """clip_grad_norm_ captured after an eager call, an eager call with other gradient tensors between,
    then replays: each replay clips the static gradients as torch does."""
    params = make_params("cuda")
    ref_p = [torch.nn.Parameter(p.detach().double().cpu()) for p in params]
    static = [torch.zeros_like(p) for p in params]

    def load(step):
        for p, s, q, g in zip(params, static, ref_p, gradients(step, params)):
            s.copy_(g.float())
            p.grad, q.grad = s, g.clone()

    load(0)
    flashkern.clip_grad_norm_(params, 3.0)  # uploads the address table
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        total = flashkern.clip_grad_norm_(params, 3.0)
    for p, g in zip(params, gradients(9, params)):
        p.grad = g.float().cuda()
    flashkern.clip_grad_norm_(params, 3.0)
    junk = junk_over_freed_tables()  # held through the replays
    for step in (1, 2):
        load(step)
        graph.replay()
        expected = torch.nn.utils.clip_grad_norm_(ref_p, 3.0)
        torch.testing.assert_close(total.double().cpu(), expected, rtol=1e-6, atol=0)
        for s, q in zip(static, ref_p):
            torch.testing.assert_close(s.double().cpu(), q.grad, rtol=1e-6, atol=1e-9)
    del junk
