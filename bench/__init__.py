"""Benchmarks: ratios measured side by side in one run, never absolute claims. Run them from the repository root as
``python -m bench.<name>`` (bench/harness.py holds what they share)."""
