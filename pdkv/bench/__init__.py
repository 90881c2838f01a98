"""Benchmarks behind `pdkv bench`: each prints JSON with ratios against a same-run baseline."""
