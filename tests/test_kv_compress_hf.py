"""apply_flashkern(model, attention=True, kv_compression=...) on a seeded tiny Llama (built from a config,
nothing downloaded), against kvpress's SnapKVPress and ObservedAttentionPress, whose scoring is written
here in float64 from kvpress's definitions: kvpress 0.5.5 requires transformers < 5.3 and the project pins
5.24.0, so it cannot be installed beside it (tests/README: the test dependencies).

kvpress, prompt-time, per layer: SnapKV scores each key before the window by the softmax of the last `window`
queries (causal), averaged over the window, average-pooled along the keys (kernel_size, zero padding), averaged
over each GQA group; the window's keys score the maximum. ObservedAttention scores each key by the attention
all prompt queries give it, divided by the number of queries that see it, averaged over the group. Both keep
the int(T * (1 - ratio)) best keys of each KV head."""

import copy

import pytest
import torch
import torch.nn.functional as F

from flashkern.tolerances import MODEL_TOLERANCE

transformers = pytest.importorskip("transformers", reason="transformers is an optional dependency")
from transformers import AttentionInterface, DynamicCache  # noqa: E402
from transformers.integrations.sdpa_attention import sdpa_attention_forward  # noqa: E402
from transformers.masking_utils import ALL_MASK_ATTENTION_FUNCTIONS, sdpa_mask  # noqa: E402

from flashkern.integrations.transformers import apply_flashkern  # noqa: E402
from flashkern.kv_compress import H2O, SnapKV, StreamingLLM  # noqa: E402

CONFIG = dict(vocab_size=96, hidden_size=128, intermediate_size=96, num_hidden_layers=2, num_attention_heads=4,
              num_key_value_heads=2, max_position_embeddings=256, head_dim=64)
PROMPT = 48


def make_model(dtype=torch.float32):
    torch.manual_seed(0)
    model = transformers.AutoModelForCausalLM.from_config(transformers.LlamaConfig(**CONFIG), dtype=dtype).eval()
    return model


_recorded = []


def recording_attention(module, query, key, value, attention_mask, **kwargs):
    """sdpa attention that keeps each layer's post-RoPE query and keys of the prompt pass."""
    _recorded.append((module.layer_idx, query.detach().double(), key.detach().double()))
    return sdpa_attention_forward(module, query, key, value, attention_mask, **kwargs)


def prompt_qk(model, ids):
    """{layer: (query [B, H, T, D], keys [B, Hkv, T, D])} of the uncompressed model's prompt pass."""
    AttentionInterface.register("fk_test_record", recording_attention)
    ALL_MASK_ATTENTION_FUNCTIONS.register("fk_test_record", sdpa_mask)
    recorder = copy.deepcopy(model)
    recorder.set_attn_implementation("fk_test_record")
    _recorded.clear()
    with torch.no_grad():
        recorder(input_ids=ids)
    return {layer: (q, k) for layer, q, k in _recorded}


def probabilities(query, keys, scaling):
    """[B, H, q, T] float64 softmax of the last q queries over T keys, causal."""
    group = query.shape[1] // keys.shape[1]
    logits = query @ keys.repeat_interleave(group, 1).transpose(-1, -2) * scaling
    q, t = logits.shape[-2:]
    hidden = torch.arange(t)[None, :] > torch.arange(q)[:, None] + t - q
    return torch.softmax(logits.masked_fill(hidden, float("-inf")), -1)


def kvpress_snapkv(query, keys, window, kernel_size, ratio, scaling):
    batch, kv_heads, t, _ = keys.shape
    weights = probabilities(query[:, :, -window:], keys, scaling)[..., : t - window]
    scores = F.avg_pool1d(weights.mean(-2), kernel_size, padding=kernel_size // 2, stride=1)
    scores = scores.view(batch, kv_heads, -1, t - window).mean(2)
    scores = F.pad(scores, (0, window), value=scores.max().item())
    return scores.topk(int(t * (1 - ratio)), dim=-1).indices.sort(-1).values


def kvpress_observed(query, keys, ratio, scaling):
    batch, kv_heads, t, _ = keys.shape
    scores = probabilities(query, keys, scaling).sum(2) / torch.arange(t, 0, -1)
    scores = scores.view(batch, kv_heads, -1, t).mean(2)
    return scores.topk(int(t * (1 - ratio)), dim=-1).indices.sort(-1).values


def next_logits(model, cache, token, position):
    with torch.no_grad():
        return model(input_ids=token, cache=cache, use_cache=True, cache_position=torch.tensor([position]),
                     position_ids=torch.tensor([[position]] * token.shape[0])).logits[:, -1]


@pytest.mark.parametrize("policy", ["snapkv", "observed"])
def test_kept_keys_and_next_logits_match_kvpress(policy, restore_rope):
    model = make_model()
    ids = torch.randint(0, CONFIG["vocab_size"], (2, PROMPT), generator=torch.Generator().manual_seed(1))
    recorded = prompt_qk(model, ids)
    ratio, window, scaling = 0.6, 8, CONFIG["head_dim"] ** -0.5
    press = SnapKV(ratio=ratio, window=window, kernel_size=5) if policy == "snapkv" else H2O(ratio=ratio, normalize=True)
    compressed = copy.deepcopy(model)
    assert apply_flashkern(compressed, attention=True, kv_compression=press)["kv_compression"] == \
        ["model.layers.0.self_attn", "model.layers.1.self_attn"]
    cache = DynamicCache(config=compressed.config)
    with torch.no_grad():
        compressed(input_ids=ids, cache=cache, use_cache=True)
    # the reference: the eager model's own cache, pruned to kvpress's keys
    reference = DynamicCache(config=model.config)
    with torch.no_grad():
        model(input_ids=ids, cache=reference, use_cache=True)
    for layer, (query, keys) in recorded.items():
        kept = kvpress_snapkv(query, keys, window, 5, ratio, scaling) if policy == "snapkv" else \
            kvpress_observed(query, keys, ratio, scaling)
        assert kept.shape[-1] == int(PROMPT * (1 - ratio))
        index = kept[..., None].expand(-1, -1, -1, CONFIG["head_dim"])
        ref_layer = reference.layers[layer]
        ref_layer.keys, ref_layer.values = ref_layer.keys.gather(2, index), ref_layer.values.gather(2, index)
        # the same keys (flashkern's layers round differently from transformers' in the last bits: past layer 0
        # the cached values differ that much; another kept key would differ by the keys' whole size)
        torch.testing.assert_close(cache.layers[layer].keys, ref_layer.keys, **MODEL_TOLERANCE)
        torch.testing.assert_close(cache.layers[layer].values, ref_layer.values, **MODEL_TOLERANCE)
    token = torch.randint(0, CONFIG["vocab_size"], (2, 1), generator=torch.Generator().manual_seed(2))
    torch.testing.assert_close(next_logits(compressed, cache, token, PROMPT), next_logits(model, reference, token, PROMPT),
                               **MODEL_TOLERANCE)


def test_ratio_zero_generates_as_without_compression(restore_rope):
    model = make_model()
    plain, compressed = copy.deepcopy(model), copy.deepcopy(model)
    apply_flashkern(plain, attention=True)
    apply_flashkern(compressed, attention=True, kv_compression=SnapKV(ratio=0.0, window=8))
    ids = torch.randint(0, CONFIG["vocab_size"], (1, PROMPT), generator=torch.Generator().manual_seed(4))
    with torch.no_grad():
        expected = plain.generate(ids, max_new_tokens=10, do_sample=False)
        got = compressed.generate(ids, max_new_tokens=10, do_sample=False)
    assert torch.equal(got, expected)


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
@pytest.mark.parametrize("press", [SnapKV(ratio=0.5, window=8), H2O(heavy=16, recent=8), StreamingLLM(sinks=4, window=12)],
                         ids=["snapkv", "h2o", "streaming"])
def test_generate_end_to_end(device, dtype, press, restore_rope):
    """generate() prefills, compresses every layer's cache to its budget and decodes from it (float16 on the
    emulate backends: the score, selection and compaction kernels)."""
    model = make_model(dtype)
    apply_flashkern(model, attention=True, kv_compression=press)
    ids = torch.randint(0, CONFIG["vocab_size"], (2, PROMPT), generator=torch.Generator().manual_seed(5))
    cache = DynamicCache(config=model.config)
    with torch.no_grad():
        out = model.generate(ids, max_new_tokens=6, do_sample=False, cache=cache)
    assert out.shape == (2, PROMPT + 6)
    budget = {"SnapKV": 24, "H2O": 24, "StreamingLLM": 16}[type(press).__name__]
    assert cache.layers[0].keys.shape[2] == budget + 5  # the compressed prompt, then the generated tokens but the last


def test_kv_compression_needs_flashkern_attention(restore_rope):
    with pytest.raises(ValueError, match="attention=True"):
        apply_flashkern(make_model(), kv_compression=SnapKV(ratio=0.5))
    with pytest.raises(TypeError, match="kv_compress policy"):
        apply_flashkern(make_model(), attention=True, kv_compression="snapkv")


@pytest.mark.parametrize("head_dim", [16, 32])
def test_kv_compression_checks_the_model_up_front(device, head_dim, restore_rope):
    """A float32 model of head_dim 16 or 32: flashkern's attention runs it, its compression kernels do not. The
    compression is left off, with the reason under "skipped" and in the warning, and model(ids) runs (it
    failed inside the forward: "kv_scores: head_dim must be 64, 128 or 256")."""
    torch.manual_seed(0)
    config = transformers.LlamaConfig(**{**CONFIG, "head_dim": head_dim})
    model = transformers.AutoModelForCausalLM.from_config(config, dtype=torch.float32).eval()
    with pytest.warns(UserWarning, match=f"kv_compression \\(head_dim {head_dim}: KV compression's kernels take"):
        replaced = apply_flashkern(model, attention=True, kv_compression=SnapKV(ratio=0.5, window=8))
    assert replaced["attention"] and not replaced["kv_compression"]
    assert "64, 128 or 256" in replaced["skipped"]["kv_compression"]
    ids = torch.randint(0, CONFIG["vocab_size"], (1, 24), generator=torch.Generator().manual_seed(5))
    cache = DynamicCache(config=model.config)
    with torch.no_grad():
        model(input_ids=ids, cache=cache, use_cache=True)
    assert cache.layers[0].keys.shape[2] == 24  # the whole prompt: nothing compressed
