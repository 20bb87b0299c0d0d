import torch


def compute_dtype(t: torch.Tensor) -> torch.dtype:
    """float64 stays float64; every other float type is computed in float32."""
    return torch.float64 if t.dtype == torch.float64 else torch.float32
