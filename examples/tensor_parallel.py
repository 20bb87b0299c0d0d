"""Tensor-parallel greedy generation with flashkern.comm: a small random Llama (built from a config, nothing
downloaded) split across the ranks, attention heads and MLP columns, and every layer's all-reduce fused with
the residual add and the next RMSNorm (flashkern.comm.fused_allreduce_add_rmsnorm). Rank 0 checks the tokens
against transformers' generate() of the whole model in one process.

    torchrun --nproc-per-node 2 --master-addr 127.0.0.1 --master-port 29511 examples/tensor_parallel.py

gloo on CPU tensors, NCCL (RCCL on ROCm) on GPUs (one per rank). Column-parallel: q, k, v, gate and up keep
this rank's heads / columns; row-parallel: o_proj and down_proj keep the matching input columns, so each
rank's output is a partial sum that the all-reduce completes.
"""

import os
import sys

import torch
import torch.distributed as dist

import flashkern
from flashkern import comm

CONFIG = dict(vocab_size=128, hidden_size=256, intermediate_size=512, num_hidden_layers=3, num_attention_heads=8,
              num_key_value_heads=4, max_position_embeddings=128, head_dim=32, rms_norm_eps=1e-6,
              initializer_range=0.1)  # larger than the default 0.02: peaked logits, tokens that vary


def tiny_llama(device):
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(0)  # the same weights on every rank
    return LlamaForCausalLM(LlamaConfig(**CONFIG)).to(device).eval()


class TensorParallelLlama:
    """This rank's shard of a Llama: rows of the column-parallel weights, columns of the row-parallel ones."""

    def __init__(self, model, rank, world):
        cfg = model.config
        if cfg.num_key_value_heads % world or cfg.intermediate_size % world:
            raise ValueError(f"{world} ranks must divide the KV heads and the MLP width")
        self.model, self.eps = model, cfg.rms_norm_eps
        self.head_dim = cfg.head_dim
        self.heads, self.kv_heads = cfg.num_attention_heads // world, cfg.num_key_value_heads // world
        inv_freq, factor = flashkern.rope_frequencies_from_config(cfg)
        self.cos_sin = flashkern.cos_sin_cache(inv_freq, cfg.max_position_embeddings, factor).to(model.device)
        q_rows = slice(rank * self.heads * self.head_dim, (rank + 1) * self.heads * self.head_dim)
        kv_rows = slice(rank * self.kv_heads * self.head_dim, (rank + 1) * self.kv_heads * self.head_dim)
        width = cfg.intermediate_size // world
        mlp = slice(rank * width, (rank + 1) * width)
        # collective: every rank makes it. "auto": the fused kernels where they run (GPUs, float16 / bfloat16),
        # else dist.all_reduce + flashkern's norm (this float32 model, gloo on the CPU)
        self.workspace = comm.create_allreduce_fusion_workspace(max_token_num=cfg.max_position_embeddings,
                                                                hidden_dim=cfg.hidden_size, dtype=model.dtype)
        self.layers = []
        for layer in model.model.layers:
            a, m = layer.self_attn, layer.mlp
            self.layers.append(dict(
                q=a.q_proj.weight[q_rows], k=a.k_proj.weight[kv_rows], v=a.v_proj.weight[kv_rows],
                o=a.o_proj.weight[:, q_rows], gate=m.gate_proj.weight[mlp], up=m.up_proj.weight[mlp],
                down=m.down_proj.weight[:, mlp], input_norm=layer.input_layernorm.weight,
                post_norm=layer.post_attention_layernorm.weight))

    @torch.no_grad()
    def logits(self, tokens):
        """The next-token logits after `tokens` (the whole sequence again: no KV cache, to keep it short)."""
        x = self.model.model.embed_tokens(tokens)
        residual, h = x, flashkern.rmsnorm(x, self.layers[0]["input_norm"], self.eps)
        positions = torch.arange(len(tokens), device=tokens.device)
        norms = [w["post_norm"] for w in self.layers]
        next_norms = [w["input_norm"] for w in self.layers[1:]] + [self.model.model.norm.weight]
        for w, post_norm, next_norm in zip(self.layers, norms, next_norms):
            q = (h @ w["q"].t()).view(-1, self.heads, self.head_dim)
            k = (h @ w["k"].t()).view(-1, self.kv_heads, self.head_dim)
            v = (h @ w["v"].t()).view(-1, self.kv_heads, self.head_dim)
            q, k = flashkern.apply_rope_with_cos_sin_cache(positions, q, k, self.head_dim, self.cos_sin)
            attn = flashkern.single_prefill_with_kv_cache(q, k, v, causal=True).reshape(len(tokens), -1)
            h = attn @ w["o"].t()  # a partial sum: this rank's heads
            # residual += the sum over the ranks; h = rmsnorm(residual)
            comm.fused_allreduce_add_rmsnorm(h, residual, post_norm, self.eps, workspace=self.workspace)
            h = flashkern.silu_and_mul(torch.cat([h @ w["gate"].t(), h @ w["up"].t()], -1)) @ w["down"].t()
            comm.fused_allreduce_add_rmsnorm(h, residual, next_norm, self.eps, workspace=self.workspace)
        return self.model.lm_head(h[-1])

    def generate(self, prompt, new_tokens):
        tokens = prompt
        for _ in range(new_tokens):
            tokens = torch.cat([tokens, self.logits(tokens).argmax().view(1)])
        return tokens[len(prompt):]


def main(new_tokens=12):
    use_gpu = torch.cuda.is_available()
    rank, world = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])
    if use_gpu:
        torch.cuda.set_device(int(os.environ.get("LOCAL_RANK", rank)))
    dist.init_process_group("nccl" if use_gpu else "gloo")
    try:
        device = torch.device("cuda", torch.cuda.current_device()) if use_gpu else torch.device("cpu")
        model = tiny_llama(device)
        prompt = torch.randint(0, CONFIG["vocab_size"], (10,), generator=torch.Generator().manual_seed(1)).to(device)
        tp = TensorParallelLlama(model, rank, world)
        logits, ours = tp.logits(prompt), tp.generate(prompt, new_tokens)
        if rank == 0:
            with torch.no_grad():
                gap = (logits - model(prompt[None]).logits[0, -1]).abs().max().item()
            whole = model.generate(prompt[None], max_new_tokens=new_tokens, do_sample=False,
                                   pad_token_id=0)[0, len(prompt):]
            verdict = "matches" if torch.equal(ours, whole) and gap < 1e-4 else "differs from"
            print(f"tensor parallel over {world} ranks: {ours.tolist()} {verdict} generate() "
                  f"{whole.tolist()} (next-token logits {gap:.1e} apart; engine {tp.workspace.engine})")
            return verdict == "matches"
        return True
    finally:
        dist.destroy_process_group()


if __name__ == "__main__":
    sys.exit(0 if main() else 1)
