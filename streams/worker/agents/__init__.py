"""The worker's stream processors, faust-free at their core: the ingest agent (unkeyed input
grouped by run, `ingest.py`), the detect agent (`detect.py`, over `driver.py`), the timers,
the deadline clock, dead letters, and the steps topic's message format (`messages.py`)."""
