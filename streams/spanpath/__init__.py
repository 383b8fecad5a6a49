"""The span path: OTLP export messages to normalized steps, grouped by run.

- `entry.py`: `SpanPath`, the one entry (native when it can, else Python), `StepBatch`,
  `group_steps`; re-exported here.
- `otlp/`: the OTLP protobuf and JSON decoders (Python, and the native ones when built).
- `normalize.py`: span to step in Python, the recognition profiles and tool contracts
  applied (the fallback, and the oracle of the native normalizer).
- `native.py`: whether the compiled extension (`native/`, loopwatch_native) is there;
  `native_spec.py`: the policy handed to it as plain data.
- `spans.py`: the decoded span record.
"""

from streams.spanpath.entry import SpanPath, group_steps
from streams.spanpath.spans import StepBatch

__all__ = ["SpanPath", "StepBatch", "group_steps"]
