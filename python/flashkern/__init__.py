"""flashkern: hand-written CUDA and HIP kernels for LLM inference and training, as PyTorch ops.

Every op runs the kernel for its tensors' device (CUDA on NVIDIA, HIP on AMD ROCm) and the
pure-torch reference on CPU; see flashkern.info() for what this build has.
"""

import torch  # noqa: F401  (loads libtorch before the extension)

from . import _C  # noqa: F401  (registers the op schemas: torch.ops.flashkern.*)
from . import ref
from ._backend import get_backend, set_backend
from .attention import merge_state, merge_state_in_place, merge_states
from .cascade import MultiLevelCascadeAttentionWrapper
from .decode import BatchDecodeWithPagedKVCacheWrapper, single_decode_with_kv_cache
from .activation import act_mul, gelu_and_mul, gelu_tanh_and_mul, silu_and_mul
from .check import check
from .info import info
from .invariance import batch_invariant, is_batch_invariant, set_batch_invariant
from .norm import fused_add_rmsnorm, gemma_fused_add_rmsnorm, gemma_rmsnorm, rmsnorm
from . import page  # noqa: E402  (flashkern.page: appending to a paged KV cache)
from .page import append_paged_kv_cache, get_batch_indices_positions
from .prefill import (
    BatchPrefillWithPagedKVCacheWrapper,
    BatchPrefillWithRaggedKVCacheWrapper,
    single_prefill_with_kv_cache,
    single_prefill_with_kv_cache_return_lse,
)
from .rope import (
    apply_llama31_rope,
    apply_llama31_rope_inplace,
    apply_llama31_rope_pos_ids,
    apply_llama31_rope_pos_ids_inplace,
    apply_rope,
    apply_rope_inplace,
    apply_rope_pos_ids,
    apply_rope_pos_ids_inplace,
    apply_rope_with_cos_sin_cache,
    apply_rope_with_cos_sin_cache_inplace,
)
from .rope_scaling import cos_sin_cache, rope_frequencies, rope_frequencies_from_config
from . import spec  # noqa: E402  (flashkern.spec: tree masks, positions and verification)
from . import optim  # noqa: E402  (flashkern.optim: AdamW, clip_grad_norm_)
from .optim import clip_grad_norm_
from . import kv_compress  # noqa: E402  (flashkern.kv_compress: SnapKV, H2O, StreamingLLM)
from . import comm  # noqa: E402  (flashkern.comm: the all-reduce fused with add + RMSNorm)
from .sampling import (
    chain_speculative_sampling,
    min_p_sampling_from_probs,
    sampling_from_logits,
    sampling_from_probs,
    softmax,
    top_k_mask_logits,
    top_k_renorm_probs,
    top_k_sampling_from_probs,
    top_k_top_p_sampling_from_logits,
    top_k_top_p_sampling_from_probs,
    top_p_renorm_probs,
    top_p_sampling_from_probs,
)

__version__ = "0.1.0"

__all__ = [
    "BatchDecodeWithPagedKVCacheWrapper",
    "BatchPrefillWithPagedKVCacheWrapper",
    "BatchPrefillWithRaggedKVCacheWrapper",
    "MultiLevelCascadeAttentionWrapper",
    "act_mul",
    "append_paged_kv_cache",
    "apply_llama31_rope",
    "apply_llama31_rope_inplace",
    "apply_llama31_rope_pos_ids",
    "apply_llama31_rope_pos_ids_inplace",
    "apply_rope",
    "apply_rope_inplace",
    "apply_rope_pos_ids",
    "apply_rope_pos_ids_inplace",
    "apply_rope_with_cos_sin_cache",
    "apply_rope_with_cos_sin_cache_inplace",
    "batch_invariant",
    "chain_speculative_sampling",
    "check",
    "clip_grad_norm_",
    "cos_sin_cache",
    "fused_add_rmsnorm",
    "gelu_and_mul",
    "gelu_tanh_and_mul",
    "gemma_fused_add_rmsnorm",
    "gemma_rmsnorm",
    "get_backend",
    "get_batch_indices_positions",
    "info",
    "is_batch_invariant",
    "merge_state",
    "merge_state_in_place",
    "merge_states",
    "min_p_sampling_from_probs",
    "ref",
    "rmsnorm",
    "rope_frequencies",
    "rope_frequencies_from_config",
    "sampling_from_logits",
    "sampling_from_probs",
    "set_backend",
    "set_batch_invariant",
    "silu_and_mul",
    "single_decode_with_kv_cache",
    "single_prefill_with_kv_cache",
    "single_prefill_with_kv_cache_return_lse",
    "softmax",
    "top_k_mask_logits",
    "top_k_renorm_probs",
    "top_k_sampling_from_probs",
    "top_k_top_p_sampling_from_logits",
    "top_k_top_p_sampling_from_probs",
    "top_p_renorm_probs",
    "top_p_sampling_from_probs",
]
