"""What the tests and the benchmarks share: the real broker (kafka.py), `loopwatch worker`
as a subprocess (worker_proc.py), and deliveries of the same spans in any order and
batching (deliveries.py). bench/ only measures."""
