"""Benchmarks: `make bench` (python -m bench). Prints a table, writes bench/results/*.json."""
