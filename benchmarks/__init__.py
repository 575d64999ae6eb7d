"""Reproducible performance measurements: ratios and rates within one run (see BENCHMARKS.md)."""
