"""The on-call HTTP API: its query parameters, one contract with `loopwatch query`
(`params.py`), the windowed count tables' keys (`keys.py`), and the routes (`views.py`)."""
