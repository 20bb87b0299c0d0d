"""apply_flashkern on tiny random-weight Hugging Face models (built from configs, nothing
downloaded): logits and gradients before and after patching, for every supported family and every
rope_type, on every device."""

import copy

import pytest
import torch
from torch.utils._python_dispatch import TorchDispatchMode

from flashkern.tolerances import MODEL_TOLERANCE

transformers = pytest.importorskip("transformers", reason="transformers is an optional dependency")
from flashkern.integrations.transformers import FAMILIES, apply_flashkern, flashkern_attention  # noqa: E402

SMALL = dict(vocab_size=96, hidden_size=64, intermediate_size=96, num_hidden_layers=2, num_attention_heads=4,
             num_key_value_heads=2, max_position_embeddings=64)

ROPE_PARAMETERS = {
    "default": {},
    "linear": {"factor": 2.0},
    "dynamic": {"factor": 2.0},
    "yarn": {"factor": 4.0, "original_max_position_embeddings": 32},
    "llama3": {"factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0, "original_max_position_embeddings": 32},
    "longrope": {"factor": 4.0, "original_max_position_embeddings": 32,
                 "short_factor": [1.0 + i / 8 for i in range(8)], "long_factor": [1.5 + i / 4 for i in range(8)]},
}


def make_model(model_type, rope_type="default", theta=10000.0):
    config_cls = transformers.AutoConfig.for_model(model_type).__class__
    extra = {"head_dim": 16} if model_type in ("gemma", "gemma2", "qwen3") else {}
    config = config_cls(**SMALL, **extra,
                        rope_parameters={"rope_type": rope_type, "rope_theta": theta, **ROPE_PARAMETERS[rope_type]})
    torch.manual_seed(0)
    model = transformers.AutoModelForCausalLM.from_config(config, torch_dtype=torch.float32)
    return model.eval()


def run(model, ids):
    out = model(input_ids=ids, labels=ids)
    out.loss.backward()
    grads = {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}
    return out.logits.detach(), grads


class OpLog(TorchDispatchMode):
    """The flashkern ops a forward pass dispatches, with their scalar arguments."""

    def __init__(self):
        super().__init__()
        self.calls = []

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        if func.namespace == "flashkern":
            self.calls.append((func.__name__.split(".")[0], [a for a in args if not isinstance(a, torch.Tensor)]))
        return func(*args, **(kwargs or {}))


def compare(model_type, rope_type, device, tokens=24):
    model = make_model(model_type, rope_type).to(device)
    ids = torch.randint(0, SMALL["vocab_size"], (2, tokens), generator=torch.Generator().manual_seed(1)).to(device)
    expected_logits, expected_grads = run(copy.deepcopy(model), ids)
    replaced = apply_flashkern(model)
    with OpLog() as log:
        model(input_ids=ids)
    names = {name for name, _ in log.calls}
    assert {"rmsnorm", "act_mul", "rope"} <= names, names  # the patches are what runs
    offset = FAMILIES[model_type][3]
    assert all(args[-1] == offset for name, args in log.calls if name == "rmsnorm")
    logits, grads = run(model, ids)
    torch.testing.assert_close(logits, expected_logits, **MODEL_TOLERANCE)
    assert grads.keys() == expected_grads.keys()
    for name in grads:
        torch.testing.assert_close(grads[name], expected_grads[name], **MODEL_TOLERANCE, msg=name)
    return replaced


@pytest.mark.parametrize("model_type", sorted(FAMILIES))
def test_family_logits_and_gradients(device, model_type, restore_rope):
    replaced = compare(model_type, "default", device)
    norms_per_layer = 4 if model_type == "qwen3" else (4 if model_type == "gemma2" else 2)  # + q/k norms, + post norms
    assert len(replaced["rmsnorm"]) == 2 * norms_per_layer + 1
    assert len(replaced["swiglu"]) == 2 and len(replaced["rope"]) == 1


@pytest.mark.parametrize("rope_type", sorted(ROPE_PARAMETERS))
def test_every_rope_type_beyond_the_original_context(device, rope_type, restore_rope):
    compare("llama", rope_type, device, tokens=48)  # past original_max_position_embeddings = 32


def test_unknown_family_is_refused():
    config = transformers.GPT2Config(n_layer=1, n_head=2, n_embd=16, vocab_size=32)
    model = transformers.GPT2LMHeadModel(config)
    with pytest.raises(ValueError, match=r"model type 'gpt2' is not supported; supported: gemma, gemma2, llama"):
        apply_flashkern(model)
    with pytest.raises(ValueError, match=r"model type None is not supported"):
        apply_flashkern(torch.nn.Linear(2, 2))


def test_only_what_is_asked(restore_rope):
    model = make_model("llama")
    replaced = apply_flashkern(model, rmsnorm=False, rope=False)
    assert replaced["rmsnorm"] == [] and replaced["rope"] == [] and len(replaced["swiglu"]) == 2


def test_an_activation_without_a_kernel_stays_as_it_was(restore_rope):
    """A ReLU MLP: the norms and RoPE are patched, the MLPs left on their path, named in the result and a
    warning; the logits are the model's."""
    config = transformers.Qwen3Config(**SMALL, head_dim=16, hidden_act="relu")
    torch.manual_seed(0)
    model = transformers.AutoModelForCausalLM.from_config(config).eval()
    ids = torch.randint(0, SMALL["vocab_size"], (2, 12), generator=torch.Generator().manual_seed(4))
    expected = copy.deepcopy(model)(input_ids=ids).logits
    with pytest.warns(UserWarning, match=r"left on their original path: model.layers.0.mlp \(activation ReLU"):
        replaced = apply_flashkern(model)
    assert replaced["swiglu"] == [] and set(replaced["skipped"]) == {"model.layers.0.mlp", "model.layers.1.mlp"}
    assert replaced["rmsnorm"] and replaced["rope"]
    assert not any("forward" in m.__dict__ for m in model.modules() if type(m).__name__ == "Qwen3MLP")
    torch.testing.assert_close(model(input_ids=ids).logits, expected, **MODEL_TOLERANCE)


@pytest.mark.parametrize("dtype", [torch.float16, torch.float32])
def test_attention_at_a_head_dim_the_kernels_do_not_take(dtype, restore_rope):
    """head_dim 32: in float16 the attention stays the model's (the kernels take 64, 128, 256 or 512), the rest is
    patched, and greedy generation matches the unpatched model; in float32 the reference runs attention."""
    config = transformers.LlamaConfig(**SMALL, head_dim=32)
    torch.manual_seed(0)
    model = transformers.AutoModelForCausalLM.from_config(config, dtype=dtype).eval()
    original = copy.deepcopy(model)
    default = model.config._attn_implementation
    ids = torch.randint(0, SMALL["vocab_size"], (2, 6), generator=torch.Generator().manual_seed(5))
    if dtype == torch.float16:
        with pytest.warns(UserWarning, match=r"attention \(head_dim 32: the attention kernels take 64, 128, 256 or 512\)"):
            replaced = apply_flashkern(model, attention=True)
        assert replaced["attention"] == [] and model.config._attn_implementation == default
    else:
        replaced = apply_flashkern(model, attention=True)
        assert replaced["attention"] == [default] and "attention" not in replaced["skipped"]
    assert replaced["rmsnorm"] and replaced["swiglu"] and replaced["rope"]
    with torch.no_grad():
        generated = model.generate(ids, max_new_tokens=8, do_sample=False)
        reference = original.generate(ids, max_new_tokens=8, do_sample=False)
    assert generated.shape == reference.shape
    if dtype == torch.float32:
        assert torch.equal(generated, reference)
    else:  # float16 kernels against float16 torch: the first new tokens agree (later ones may flip on a near-tie)
        assert torch.equal(generated[:, :8], reference[:, :8])


def test_dtypes_the_kernels_do_not_take_run_as_before(restore_rope):
    """A bf16 model under float16 autocast hands norms fp32 activations with bf16 weights: the
    original forward runs there instead of failing."""
    model = make_model("llama").to(torch.bfloat16)
    ids = torch.randint(0, SMALL["vocab_size"], (2, 12), generator=torch.Generator().manual_seed(2))
    norm = model.model.norm
    apply_flashkern(model)
    x = torch.randn(2, 12, SMALL["hidden_size"])
    torch.testing.assert_close(norm(x), type(norm).forward(norm, x))  # fp32 input, bf16 weight
    with torch.autocast("cpu", dtype=torch.float16):
        assert torch.isfinite(model(input_ids=ids).logits.float()).all()


ATTENTION_FAMILIES = {  # config extras: Mistral's sliding window, Gemma2's soft cap and alternating windows
    "llama": {},
    "mistral": {"sliding_window": 9},
    "qwen2": {},
    "qwen3": {},
    "gemma2": {"sliding_window": 9, "attn_logit_softcapping": 5.0, "query_pre_attn_scalar": 64},
}


def make_attention_model(model_type, dtype):
    """A tiny model with head_dim 64 (a size the attention kernels take)."""
    config_cls = transformers.AutoConfig.for_model(model_type).__class__
    config = config_cls(**{**SMALL, "hidden_size": 128}, head_dim=64, **ATTENTION_FAMILIES[model_type])
    torch.manual_seed(0)
    return transformers.AutoModelForCausalLM.from_config(config, dtype=dtype).eval()


@pytest.mark.parametrize("model_type", sorted(ATTENTION_FAMILIES))
@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
def test_attention_logits_and_generate(device, model_type, dtype, restore_rope):
    """attention=True: logits equal the eager model's (sliding windows and soft caps from the config,
    padding through a mask), the prompt and each generation step through flashkern's prefill, and
    greedy generate() gives the same tokens (float32)."""
    model = make_attention_model(model_type, dtype).to(device)
    eager = copy.deepcopy(model)
    eager.set_attn_implementation("eager")
    ids = torch.randint(0, SMALL["vocab_size"], (2, 20), generator=torch.Generator().manual_seed(3)).to(device)
    padding = torch.ones_like(ids)
    padding[1, :3] = 0  # left padding in the second sequence: a custom mask
    with torch.no_grad():
        expected = [eager(input_ids=ids).logits, eager(input_ids=ids, attention_mask=padding).logits]
        default = model.config._attn_implementation
        assert apply_flashkern(model, attention=True)["attention"] == [default]  # what it replaced
        with OpLog() as log:
            logits = [model(input_ids=ids).logits, model(input_ids=ids, attention_mask=padding).logits]
    assert model.config._attn_implementation == "fk_attention"
    assert transformers.AttentionInterface()["fk_attention"] is flashkern_attention
    tolerance = MODEL_TOLERANCE if dtype == torch.float32 else dict(atol=2e-2, rtol=2e-2)
    torch.testing.assert_close(logits[0], expected[0], **tolerance)
    torch.testing.assert_close(logits[1][0], expected[1][0], **tolerance)
    torch.testing.assert_close(logits[1][1, 3:], expected[1][1, 3:], **tolerance)  # past the padding
    if dtype != torch.float32:
        assert "batch_attention" in {name for name, _ in log.calls}  # the attention op is what runs
        return
    with torch.no_grad():
        generated = model.generate(ids[:, :6], max_new_tokens=12, do_sample=False)
        reference = eager.generate(ids[:, :6], max_new_tokens=12, do_sample=False)
    assert torch.equal(generated, reference)
