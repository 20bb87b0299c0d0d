"""Integrations of flashkern with other libraries: transformers (apply_flashkern), CuPy (flashkern.cupy)."""
