"""One call to run a loaded Hugging Face model's RMSNorm, gated MLP activation and rotary embedding
on flashkern's kernels:

    model = AutoModelForCausalLM.from_pretrained(...)
    replaced = apply_flashkern(model)          # {"rmsnorm": [...], "swiglu": [...], "rope": [...]}

Families: Llama, Mistral, Qwen2, Qwen3 (including its per-head q/k norms) and Gemma, Gemma2 (whose
norm multiplies by 1 + weight, in float32, then casts: flashkern's gemma_rmsnorm does the same).
With attention=True the model's attention runs through flashkern's prefill attention too (the
prompt pass and every generation step): transformers' attention interface under the name
"fk_attention" (also usable as attn_implementation="fk_attention" once registered_attention() ran).
With kv_compression (a flashkern.kv_compress policy: SnapKV, H2O or StreamingLLM) each layer's KV cache
is compressed right after the prompt pass, from the scores the prompt's attention gives (SnapKV: the
last window's votes; H2O: every prompt query's probabilities), and generate() decodes from the
compressed cache (positions stay the prompt's: transformers counts them, not the cache).
RMSNorm and MLP modules are patched one by one, in this model only. The rotary embedding is the
module-level apply_rotary_pos_emb of the family's modeling file, so that patch applies to every
model of the family in the process (as the attention layers look it up there).
Training works: every replacement is differentiable.
"""

import importlib
import types
import warnings

import torch

import flashkern
from flashkern._validate import ATTENTION_HEAD_DIMS, HEAD_DIMS, KERNEL_DTYPES

FAMILIES = {
    # model_type: (modeling module, RMSNorm class, MLP class, norm weight offset)
    "llama": ("transformers.models.llama.modeling_llama", "LlamaRMSNorm", "LlamaMLP", 0.0),
    "mistral": ("transformers.models.mistral.modeling_mistral", "MistralRMSNorm", "MistralMLP", 0.0),
    "qwen2": ("transformers.models.qwen2.modeling_qwen2", "Qwen2RMSNorm", "Qwen2MLP", 0.0),
    "qwen3": ("transformers.models.qwen3.modeling_qwen3", "Qwen3RMSNorm", "Qwen3MLP", 0.0),
    "gemma": ("transformers.models.gemma.modeling_gemma", "GemmaRMSNorm", "GemmaMLP", 1.0),
    "gemma2": ("transformers.models.gemma2.modeling_gemma2", "Gemma2RMSNorm", "Gemma2MLP", 1.0),
}

# transformers' activation modules (ACT2FN) -> flashkern's activation names
ACTIVATIONS = {
    "SiLU": "silu",
    "SiLUActivation": "silu",
    "GELUActivation": "gelu",
    "GELUTanh": "gelu_tanh",
    "PytorchGELUTanh": "gelu_tanh",
    "NewGELUActivation": "gelu_tanh",
}


def _rmsnorm_forward(offset, original):
    def forward(self, hidden_states):
        # dtypes the kernels do not take (e.g. a bf16 weight on fp32 activations under autocast): as before
        if hidden_states.dtype not in KERNEL_DTYPES or self.weight.dtype not in (hidden_states.dtype, torch.float32):
            return original(hidden_states)
        eps = getattr(self, "variance_epsilon", None)
        eps = getattr(self, "eps", 1e-6) if eps is None else eps
        shape = hidden_states.shape
        x = hidden_states.reshape(-1, shape[-1])  # any rank: rows of the last dimension
        y = flashkern.gemma_rmsnorm(x, self.weight, eps) if offset else flashkern.rmsnorm(x, self.weight, eps)
        return y.view(shape)

    return forward


def _mlp_forward(activation):
    def forward(self, x):
        return self.down_proj(flashkern.act_mul(self.gate_proj(x), self.up_proj(x), activation))

    return forward


def _apply_rotary_pos_emb(q, k, cos, sin, unsqueeze_dim=1, **_):
    """transformers' apply_rotary_pos_emb on flashkern's kernel: q [B, H, T, D], k [B, Hk, T, D],
    cos/sin [B, T, D] (both halves equal, attention scaling included) -> rotated (q, k)."""
    if unsqueeze_dim != 1 or q.dim() != 4:
        raise ValueError(f"apply_flashkern's rotary embedding expects q as [batch, heads, tokens, head_dim], got {tuple(q.shape)}")
    batch, heads, tokens, head_dim = q.shape
    half = cos.shape[-1] // 2
    cos_sin = torch.cat([cos[..., :half].float(), sin[..., :half].float()], dim=-1).expand(batch, tokens, 2 * half)
    cache = cos_sin.reshape(batch * tokens, 2 * half)
    positions = torch.arange(batch * tokens, device=q.device)
    q3 = q.transpose(1, 2).reshape(batch * tokens, heads, head_dim)
    k3 = k.transpose(1, 2).reshape(batch * tokens, k.shape[1], head_dim)
    q_out, k_out = flashkern.rope.rope_with_table(q3, k3, positions, cache)
    return (q_out.view(batch, tokens, heads, head_dim).transpose(1, 2),
            k_out.view(batch, tokens, k.shape[1], head_dim).transpose(1, 2))


def flashkern_attention(module, query, key, value, attention_mask, dropout=0.0, scaling=None, sliding_window=None,
                        softcap=None, **_):
    """transformers' attention interface on flashkern: query [B, H, q, D], key / value [B, Hkv, kv, D]
    -> ([B, q, H, D], None). The queries are the last q tokens of the kv ones (the KV cache's
    layout). No mask: causal, with the layer's sliding window (transformers' sliding_window W: the
    last W keys, i.e. window_left = W - 1) and soft cap. A mask (padding, or any other: transformers
    builds it with its sdpa mask function, window included, True = may attend): each sequence's
    rows as a custom mask; in batch-invariant mode a sequence's padding is cut off first
    (_attention_without_padding)."""
    if dropout and module.training:
        raise ValueError("flashkern attention has no dropout; use the model in eval mode or attn_implementation='eager'")
    batch, heads, q_len, head_dim = query.shape
    window = -1 if sliding_window is None else int(sliding_window) - 1
    policy = getattr(module, "_fk_kv_compression", None)
    prompt = policy is not None and q_len > 1 and q_len == key.shape[2]  # the prompt pass: scores wanted
    if prompt and (attention_mask is not None or window >= 0 or softcap):
        raise ValueError("apply_flashkern(kv_compression=...): the prompt pass must be causal without padding, "
                         "sliding window or soft cap")
    outs, lses = [], []
    for b in range(batch):
        q, k, v = query[b].transpose(0, 1), key[b].transpose(0, 1), value[b].transpose(0, 1)  # NHD views
        mask = None
        if attention_mask is not None:
            rows = attention_mask[b, 0] if attention_mask.dim() == 4 else attention_mask[b]
            mask = rows if rows.dtype == torch.bool else rows == 0  # additive masks: 0 where visible
            mask = mask[-q_len:, -k.shape[0]:]
            if flashkern.is_batch_invariant() and not prompt:
                outs.append(_attention_without_padding(q, k, v, mask, scaling, window, softcap))
                continue
            mask = mask.reshape(-1)
        out = flashkern.single_prefill_with_kv_cache(
            q.contiguous(), k.contiguous(), v.contiguous(), custom_mask=mask, causal=mask is None,
            sm_scale=scaling, window_left=window if mask is None else -1, logits_soft_cap=softcap, return_lse=prompt)
        if prompt:
            out, lse = out
            lses.append(lse)
        outs.append(out)
    if prompt:  # the hook compresses the layer's cache after its forward
        module._fk_prompt = (query, torch.stack(lses), scaling)
    return torch.stack(outs), None


def _attention_without_padding(q, k, v, mask, scaling, window, softcap):
    """Batch-invariant mode: one sequence's attention as if it were alone. Its padding (the leading
    keys no query sees, the leading queries that see nothing) is cut off, and what is left runs as
    causal attention when the mask is the causal one (with the window): the call the sequence makes
    alone, without a mask, and so the same bits. Padding queries give zeros, as under the mask."""
    seen = mask.any(dim=0).nonzero()
    if not seen.numel():
        return flashkern.single_prefill_with_kv_cache(q.contiguous(), k.contiguous(), v.contiguous(),
                                                      custom_mask=mask.reshape(-1), sm_scale=scaling,
                                                      logits_soft_cap=softcap)
    key0, row0 = int(seen[0]), int(mask.any(dim=1).nonzero()[0])
    q, k, v, mask = q[row0:], k[key0:], v[key0:], mask[row0:, key0:]
    diagonal = torch.arange(k.shape[0]) - torch.arange(q.shape[0])[:, None] - (k.shape[0] - q.shape[0])
    causal = (diagonal <= 0) & ((diagonal >= -window) if window >= 0 else True)
    plain = torch.equal(mask.cpu(), causal)
    out = flashkern.single_prefill_with_kv_cache(
        q.contiguous(), k.contiguous(), v.contiguous(), custom_mask=None if plain else mask.reshape(-1), causal=plain,
        sm_scale=scaling, window_left=window if plain else -1, logits_soft_cap=softcap)
    return torch.cat([out.new_zeros((row0, *out.shape[1:])), out])


def _compress_layer_cache(module, args, kwargs, output):
    """A forward hook on an attention module: after the prompt pass, compress the layer's cache (transformers'
    dynamic cache layer, keys / values [batch, kv_heads, tokens, head_dim]) with the module's policy."""
    from flashkern import kv_compress

    prompt = getattr(module, "_fk_prompt", None)
    if prompt is None:
        return output
    module._fk_prompt = None
    cache = kwargs.get("cache", kwargs.get("past_key_values"))
    if cache is None:
        return output
    layer = cache.layers[module.layer_idx]
    query, lse, scaling = prompt  # [B, H, T, D], [B, T, H]
    batch, heads, tokens, head_dim = query.shape
    # the dense cache as pages: a request a page of `tokens` slots (views, no copy)
    k_pages, v_pages = layer.keys.transpose(1, 2), layer.values.transpose(1, 2)
    device = query.device
    indptr = torch.arange(batch + 1, dtype=torch.int32, device=device)
    table = (indptr, indptr[:-1].contiguous(), torch.full((batch,), tokens, dtype=torch.int32, device=device))
    q = query.transpose(1, 2).reshape(batch * tokens, heads, head_dim)
    lse = lse.reshape(batch * tokens, heads).contiguous()
    qo_indptr = indptr * tokens
    policy = module._fk_kv_compression
    if isinstance(policy, kv_compress.SnapKV):
        new = policy.compress(q, lse, qo_indptr, (k_pages, v_pages), *table, sm_scale=scaling)
    elif isinstance(policy, kv_compress.H2O):
        scores = policy.prompt_scores(q, lse, qo_indptr, (k_pages, v_pages), *table, sm_scale=scaling)
        new = policy.compress(scores, (k_pages, v_pages), *table)
    else:
        new = policy.compress((k_pages, v_pages), *table)
    kept = int(new.kv_last_page_len[0])
    layer.keys, layer.values = layer.keys[:, :, :kept].contiguous(), layer.values[:, :, :kept].contiguous()
    return output


# transformers takes any attn_implementation whose name contains "flash" for a FlashAttention
# variant (and looks for it on the hub), hence not "flashkern".
ATTENTION_NAME = "fk_attention"


def registered_attention():
    """Registers ATTENTION_NAME with transformers' attention and attention-mask interfaces (the mask
    function is transformers' sdpa one: None when causal order alone describes it). Returns the name."""
    from transformers import AttentionInterface
    from transformers.masking_utils import ALL_MASK_ATTENTION_FUNCTIONS, sdpa_mask

    AttentionInterface.register(ATTENTION_NAME, flashkern_attention)
    ALL_MASK_ATTENTION_FUNCTIONS.register(ATTENTION_NAME, sdpa_mask)
    return ATTENTION_NAME


def _attention_refusal(model):
    """Why flashkern's attention cannot run this model, or None: the kernels take fp16 / bf16 with head_dim
    64, 128, 256 or 512 (the reference, float32 with any head_dim), and no dropout."""
    config = model.config
    head_dim = getattr(config, "head_dim", None) or config.hidden_size // config.num_attention_heads
    dtype = next(model.parameters()).dtype
    if dtype not in (torch.float16, torch.bfloat16, torch.float32):
        return f"the model's dtype is {dtype}; flashkern's attention takes float16, bfloat16 or float32"
    if dtype != torch.float32 and head_dim not in ATTENTION_HEAD_DIMS:
        return f"head_dim {head_dim}: the attention kernels take 64, 128, 256 or 512"
    if getattr(config, "attention_dropout", 0.0):
        return f"attention_dropout {config.attention_dropout}: flashkern's attention has no dropout"
    return None


def _compression_refusal(model):
    """Why flashkern's KV compression cannot run on this model's caches, or None (checked before any patch, so
    that model(ids) does not fail inside the forward): its kernels (kv_scores, kv_select, kv_compact) take
    head_dim 64, 128 or 256 (attention alone takes more: float32 at any head_dim, 512)."""
    config = model.config
    head_dim = getattr(config, "head_dim", None) or config.hidden_size // config.num_attention_heads
    if head_dim not in HEAD_DIMS:
        return f"head_dim {head_dim}: KV compression's kernels take 64, 128 or 256"
    return None


def apply_flashkern(model, rmsnorm=True, swiglu=True, rope=True, attention=False, kv_compression=None):
    """Replace, in `model`, the RMSNorm modules, the gated MLPs' activation-and-multiply and the rotary
    application with flashkern ops, and with attention=True its attention implementation (the
    prompt through causal prefill, with the config's sliding window and soft cap; generation steps
    the same way). Returns what was replaced: {"rmsnorm": [module names], "swiglu": [module names],
    "rope": ["module.function"], "attention": [the implementation it replaced], "skipped": {what: why}}.
    What flashkern cannot run (an MLP activation it has no kernel for; attention at a head_dim or dtype
    the kernels do not take, or with dropout) is checked first, left on its original path, named in
    "skipped" and in a warning. Raises ValueError for a model family it does not know.
    kv_compression: a policy of flashkern.kv_compress (SnapKV, H2O, StreamingLLM); needs attention=True
    and compresses every layer's cache after the prompt pass (batches without padding, every sequence
    the same length); "kv_compression" in the result lists the attention modules it applies to. A model
    whose caches the compression kernels cannot take (head_dim other than 64, 128 or 256) keeps its attention patched and its caches whole: "kv_compression" in "skipped" says
    why, and the warning."""
    model_type = getattr(getattr(model, "config", None), "model_type", None)
    if model_type not in FAMILIES:
        raise ValueError(
            f"apply_flashkern: model type {model_type!r} is not supported; supported: {', '.join(sorted(FAMILIES))}"
        )
    module_name, norm_cls, mlp_cls, offset = FAMILIES[model_type]
    modeling = importlib.import_module(module_name)
    norm_type, mlp_type = getattr(modeling, norm_cls), getattr(modeling, mlp_cls)
    # Decide everything first, then patch.
    patches, skipped = [], {}
    for name, module in model.named_modules():
        if rmsnorm and isinstance(module, norm_type):
            patches.append(("rmsnorm", name, module, _rmsnorm_forward(offset, module.forward)))
        elif swiglu and isinstance(module, mlp_type):
            activation = ACTIVATIONS.get(type(module.act_fn).__name__)
            if activation is None:
                skipped[name] = (f"activation {type(module.act_fn).__name__}: flashkern has kernels for "
                                 f"{', '.join(sorted(set(ACTIVATIONS.values())))}")
                continue
            patches.append(("swiglu", name, module, _mlp_forward(activation)))
    refusal = _attention_refusal(model) if attention else None
    if refusal:
        skipped["attention"] = refusal
    if kv_compression is not None:
        from flashkern import kv_compress

        if not isinstance(kv_compression, (kv_compress.SnapKV, kv_compress.H2O, kv_compress.StreamingLLM)):
            raise TypeError(f"apply_flashkern: kv_compression must be a flashkern.kv_compress policy (SnapKV, H2O, "
                            f"StreamingLLM), got {type(kv_compression).__name__}")
        if not attention:
            raise ValueError("apply_flashkern: kv_compression needs attention=True (the scores come from "
                             "flashkern's attention)")
        if refusal:
            skipped["kv_compression"] = "flashkern's attention does not run this model"
        else:
            compression_refusal = _compression_refusal(model)
            if compression_refusal:
                skipped["kv_compression"] = compression_refusal
    replaced = {"rmsnorm": [], "swiglu": [], "rope": [], "attention": [], "kv_compression": [], "skipped": skipped}
    for kind, name, module, forward in patches:
        module.forward = types.MethodType(forward, module)
        replaced[kind].append(name)
    if rope:
        modeling.apply_rotary_pos_emb = _apply_rotary_pos_emb
        replaced["rope"].append(f"{module_name}.apply_rotary_pos_emb")
    if attention and not refusal:
        replaced["attention"].append(model.config._attn_implementation)
        model.set_attn_implementation(registered_attention())
        if kv_compression is not None and "kv_compression" not in skipped:
            for name, module in model.named_modules():
                if hasattr(module, "layer_idx") and hasattr(module, "o_proj"):  # the attention modules
                    module._fk_kv_compression = kv_compression
                    module.register_forward_hook(_compress_layer_cache, with_kwargs=True)
                    replaced["kv_compression"].append(name)
    if skipped:
        warnings.warn("apply_flashkern: left on their original path: " +
                      "; ".join(f"{what} ({why})" for what, why in skipped.items()), stacklevel=2)
    return replaced
