"""The worker's state: the `runs` and `finished` tables (`store.py`), the run state's binary
format (`codec.py` over `packing.py` and `unpacking.py`), and the local state directory."""
