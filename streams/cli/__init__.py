"""The `loopwatch` command line: the parser and its one-line errors (`main.py`) and one
module per command (`replay.py` for replay and gate, `inspect.py`, `produce.py`,
`query.py`, `worker.py`). A command's module is imported only when it runs."""
