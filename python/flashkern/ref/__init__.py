"""Pure-torch references of every flashkern op.

They are the CPU implementations (registered under the CPU key) and the test oracles. Math is
done in float32 for float16/bfloat16/float32 inputs, as the kernels do, and in float64 for
float64 inputs, so calling them on float64 copies gives the exact answer to compare against.
"""

from .activation import act_and_mul, act_and_mul_backward, act_mul, act_mul_backward
from .attention import batch_attention, batch_decode, cascade_decode, decode_attention, merge_state, merge_states
from .norm import fused_add_rmsnorm, rmsnorm, rmsnorm_backward
from .rope import rope
from . import sampling  # noqa: E402  (ref.sampling.sampling, .renorm, .speculative, .kept)
from . import optim  # noqa: E402  (ref.optim.grad_norm, .adamw)
from . import kv_compress  # noqa: E402  (ref.kv_compress.kv_scores, .kv_select, .kv_compact)
from . import page  # noqa: E402  (ref.page.append_paged_kv_cache, .quantize)

__all__ = [
    "act_and_mul",
    "act_and_mul_backward",
    "act_mul",
    "act_mul_backward",
    "batch_attention",
    "batch_decode",
    "cascade_decode",
    "decode_attention",
    "fused_add_rmsnorm",
    "merge_state",
    "merge_states",
    "rmsnorm",
    "rmsnorm_backward",
    "rope",
    "sampling",
]
