"""Greedy batched generation over a paged KV cache managed by flashkern.prefix_cache: prompts that
share a system prompt share its KV pages; each prompt is prefilled with
BatchPrefillWithPagedKVCacheWrapper (only the tokens the cache does not hold), and every decode step
of the whole batch is one MultiLevelCascadeAttentionWrapper call planned by PrefixCache.plan_cascade
(each shared prompt read once for all its requests). RMSNorm, RoPE and SwiGLU are flashkern's; the
weights are a Hugging Face Llama's.

    python examples/prefix_cache_generate.py          # a tiny random Llama; checks against generate()

On CPU tensors the ops run flashkern's reference (or the emulated kernels under
FLASHKERN_BACKEND=emulate); on a GPU, the kernels.
"""

import torch

import flashkern
from flashkern import BatchPrefillWithPagedKVCacheWrapper, MultiLevelCascadeAttentionWrapper
from flashkern.prefix_cache import PrefixCache


class PagedLlama:
    """A Llama forward pass over a paged KV cache ([pages, 2, page_size, kv_heads, head_dim] per layer)."""

    def __init__(self, model, num_pages=256, page_size=16):
        cfg = model.config
        self.model, self.page_size = model, page_size
        self.heads, self.kv_heads = cfg.num_attention_heads, cfg.num_key_value_heads
        self.head_dim = getattr(cfg, "head_dim", None) or cfg.hidden_size // cfg.num_attention_heads
        inv_freq, attention_factor = flashkern.rope_frequencies_from_config(cfg)  # transformers' own bits
        self.cos_sin = flashkern.cos_sin_cache(inv_freq, cfg.max_position_embeddings, attention_factor).to(model.device)
        self.device, self.dtype = model.device, model.dtype
        self.kv = [torch.zeros(num_pages, 2, page_size, self.kv_heads, self.head_dim, dtype=self.dtype,
                               device=self.device) for _ in model.model.layers]
        self.cache = PrefixCache(num_pages, page_size, copy_page=self.copy_page)
        workspace = torch.empty(64 << 20, dtype=torch.uint8, device=self.device)
        self.prefill = BatchPrefillWithPagedKVCacheWrapper(workspace)
        self.workspace = workspace
        self.eps = cfg.rms_norm_eps

    def copy_page(self, src, dst):
        for layer in self.kv:
            layer[dst].copy_(layer[src])

    def forward(self, tokens, positions, requests, attend):
        """Logits of `tokens` (at `positions`, the tokens' KV written into `requests`' pages first);
        attend(layer, q) runs attention for one layer."""
        m = self.model.model
        x = m.embed_tokens(tokens)
        pages = torch.tensor([r.pages[p // self.page_size] for r, p in requests], device=self.device)
        slots = torch.tensor([p % self.page_size for _, p in requests], device=self.device)
        for i, layer in enumerate(m.layers):
            h = flashkern.rmsnorm(x, layer.input_layernorm.weight, self.eps)
            a = layer.self_attn
            q = a.q_proj(h).view(-1, self.heads, self.head_dim)
            k = a.k_proj(h).view(-1, self.kv_heads, self.head_dim)
            v = a.v_proj(h).view(-1, self.kv_heads, self.head_dim)
            q, k = flashkern.apply_rope_with_cos_sin_cache(positions, q, k, self.head_dim, self.cos_sin)
            self.kv[i][pages, 0, slots] = k
            self.kv[i][pages, 1, slots] = v
            x = x + a.o_proj(attend(i, q).reshape(len(tokens), -1))
            h = flashkern.rmsnorm(x, layer.post_attention_layernorm.weight, self.eps)
            mlp = layer.mlp
            x = x + mlp.down_proj(flashkern.act_mul(mlp.gate_proj(h), mlp.up_proj(h), "silu"))
        return self.model.lm_head(flashkern.rmsnorm(x, m.norm.weight, self.eps))

    def prefill_one(self, request):
        """The prompt tokens the cache did not hold, through prefill attention over all the request's pages."""
        start, n = request.cached_tokens, len(request.tokens) - request.cached_tokens
        pages = request.pages
        last = len(request.tokens) - (len(pages) - 1) * self.page_size
        self.prefill.plan(torch.tensor([0, n], dtype=torch.int32), torch.tensor([0, len(pages)], dtype=torch.int32),
                          torch.tensor(pages, dtype=torch.int32), torch.tensor([last], dtype=torch.int32),
                          self.heads, self.kv_heads, self.head_dim, self.page_size, causal=True,
                          q_data_type=self.dtype)
        tokens = torch.tensor(request.tokens[start:], device=self.device)
        positions = torch.arange(start, len(request.tokens), device=self.device)
        logits = self.forward(tokens, positions, [(request, p) for p in range(start, len(request.tokens))],
                              lambda i, q: self.prefill.run(q, self.kv[i]))
        return int(logits[-1].argmax())

    def generate(self, prompts, max_new_tokens, progress=print):
        """Greedy continuations of `prompts` (lists of token ids), all requests decoded together; `progress`
        gets a line per prefill and per decode step (None: quiet)."""
        say = progress or (lambda *_: None)
        requests, next_tokens, self.shared_tokens = [], [], 0
        for i, prompt in enumerate(prompts):  # one at a time, published at once: later prompts share cached pages
            r = self.cache.start(prompt)
            self.shared_tokens += r.cached_tokens
            next_tokens.append(self.prefill_one(r))
            self.cache.publish(r)
            requests.append(r)
            say(f"prefill {i + 1}/{len(prompts)}: {len(prompt)} tokens, {r.cached_tokens} from the cache", flush=True)
        out = [[t] for t in next_tokens]
        cascade = None
        for step in range(max_new_tokens - 1):
            say(f"decode step {step + 1}/{max_new_tokens - 1}: {len(requests)} requests through the cascade", flush=True)
            for r, t in zip(requests, next_tokens):
                self.cache.append(r, [t])
            plan = self.cache.plan_cascade(requests)
            if cascade is None or len(plan.qo_indptr_arr) != cascade._num_levels:
                cascade = MultiLevelCascadeAttentionWrapper(len(plan.qo_indptr_arr), self.workspace)
            cascade.plan(plan.qo_indptr_arr, plan.paged_kv_indptr_arr, plan.paged_kv_indices_arr,
                         plan.paged_kv_last_page_len_arr, self.heads, self.kv_heads, self.head_dim, self.page_size,
                         q_data_type=self.dtype)
            batch = [requests[i] for i in plan.order]
            tokens = torch.tensor([r.tokens[-1] for r in batch], device=self.device)
            positions = torch.tensor([len(r.tokens) - 1 for r in batch], device=self.device)
            logits = self.forward(tokens, positions, [(r, len(r.tokens) - 1) for r in batch],
                                  lambda i, q: cascade.run(q, self.kv[i]))
            for k, i in enumerate(plan.order):
                next_tokens[i] = int(logits[k].argmax())
                out[i].append(next_tokens[i])
        for r in requests:
            self.cache.finish(r)
        return out


def tiny_llama(seed=0, dtype=torch.float16, device="cpu"):
    """A random two-layer Llama (GQA: 2 query heads, 1 KV head, head_dim 64), its weights spread wide
    enough (initializer_range 0.1) that greedy choices are not near-ties."""
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(seed)
    config = LlamaConfig(vocab_size=256, hidden_size=128, intermediate_size=256, num_hidden_layers=2,
                         num_attention_heads=2, num_key_value_heads=1, max_position_embeddings=512,
                         initializer_range=0.1, rms_norm_eps=1e-6)
    return LlamaForCausalLM(config).to(device=device, dtype=dtype).eval()


def prompts(seed=0):
    """16 prompts: two system prompts (37 and 70 tokens: off page boundaries) and their own questions."""
    g = torch.Generator().manual_seed(seed)
    systems = [torch.randint(0, 256, (37,), generator=g).tolist(), torch.randint(0, 256, (70,), generator=g).tolist()]
    return [systems[i % 2] + torch.randint(0, 256, (int(torch.randint(1, 20, (1,), generator=g)),), generator=g).tolist()
            for i in range(16)]


# Two float16 pipelines (transformers' eager one and this one) round differently: where the model's
# two best tokens are this close in float32 logits, either may come out, and the rest of the sequence
# differs legitimately. A real error (a wrong page, position or token) diverges at a clear margin.
TIE = 0.01


@torch.no_grad()
def compare(model, batch, ours, max_new_tokens):
    """Per request: "equal", or "tie at step k (float32 logit gap g)" where the first differing token was
    a near-tie, or "differs at step k (float32 logit gap g)"."""
    verdicts = []
    reference = {p: t.float() for p, t in model.state_dict().items()}
    model32 = type(model)(model.config).to(model.device).eval()
    model32.load_state_dict(reference)
    for prompt, tokens in zip(batch, ours):
        ids = torch.tensor([prompt], device=model.device)
        expected = model.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=max_new_tokens,
                                  do_sample=False, pad_token_id=0)[0, len(prompt):].tolist()
        if expected == tokens:
            verdicts.append("equal")
            continue
        k = next(i for i, (a, b) in enumerate(zip(expected, tokens)) if a != b)
        logits = model32(torch.tensor([prompt + expected[:k]], device=model.device)).logits[0, -1]
        gap = float((logits[expected[k]] - logits[tokens[k]]).abs())
        verdicts.append(f"{'tie' if gap < TIE else 'differs'} at step {k} (float32 logit gap {gap:.4f})")
    return verdicts


@torch.no_grad()
def main(device="cpu", max_new_tokens=8):
    model = tiny_llama(device=device)
    paged = PagedLlama(model)
    batch = prompts()
    ours = paged.generate(batch, max_new_tokens)
    print("comparing with Hugging Face generate() ...", flush=True)
    verdicts = compare(model, batch, ours, max_new_tokens)
    print(f"{verdicts.count('equal')} of {len(batch)} requests equal Hugging Face generate() (float16); "
          f"{paged.shared_tokens} prompt tokens were shared, not prefilled")
    for i, v in enumerate(verdicts):
        if v != "equal":
            print(f"  request {i}: {v}")
    return verdicts, paged


if __name__ == "__main__":
    main("cuda" if torch.cuda.is_available() else "cpu")
