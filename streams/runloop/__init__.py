"""The one run loop both drivers share (the replay and the worker): steps of runs in,
findings and run summaries out (`loop.py`), and the deadline schedules it keeps
(`deadlines.py`). Store, clock and sink are passed in; nothing here touches a broker."""
