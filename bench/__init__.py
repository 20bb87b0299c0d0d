"""flashkern's benchmark suite (pytest-benchmark) and its report: python -m bench.report."""
