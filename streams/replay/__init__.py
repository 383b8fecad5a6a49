"""The run loop without a broker: export files read into span batches (`files.py`), the
replay that holds each run whole until the end of its input (`runs.py`, `loopwatch replay`
and `gate`), and the arrival-order driver and sink shared with tests and benchmarks
(`engine.py`)."""
