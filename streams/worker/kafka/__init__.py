"""The worker's side of the broker: topics, delivery of outputs, the broker's state as the
worker sees it, the input clock, and records the stream skipped (read again)."""
