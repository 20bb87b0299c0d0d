"""examples/prefix_cache_generate.py: greedy generation through the prefix cache, prefill attention and
the planned cascade equals transformers' generate() on a tiny random Llama (16 requests, two system
prompts), up to float16 near-ties (the example's TIE), on every device."""

import sys
from pathlib import Path

import pytest

pytest.importorskip("transformers")
sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "examples"))

import prefix_cache_generate as example  # noqa: E402


def test_prefix_cache_generate_matches_transformers(device):
    if getattr(device, "backend", None) == "emulate-wave64":
        pytest.skip("emulate-wave64: the CUDA build's emulation runs it (CI time)")
    verdicts, paged = example.main(str(device))
    assert all(v == "equal" or v.startswith("tie") for v in verdicts), verdicts
    assert verdicts.count("equal") >= 14
    assert paged.shared_tokens >= 14 * 32  # the system prompts' full pages were shared, not prefilled
    assert paged.cache.running == [] and paged.cache.free_pages + len(list(paged.cache._nodes())) == paged.cache.num_pages
