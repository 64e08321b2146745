"""The end-to-end benchmark's Flower app (benchmarks/bench_end_to_end.py)."""
