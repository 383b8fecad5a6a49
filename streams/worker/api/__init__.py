"""The on-call HTTP API: its query parameters, one contract with `loopwatch query`
(`params.py`), the answers (`answers.py`, `versions.py`: pure), the routes (`views.py`
`ROUTES`) and the holds' routes (`holds.py`)."""
