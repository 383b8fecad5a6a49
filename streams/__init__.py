"""Everything around the pure core (detectors/) that touches bytes, brokers and time, in
parts: spanpath/ (an export message to its steps by run), runloop/ (the run loop both
drivers share), replay/ (the driver without a broker), worker/ (the faust service), cli/
(the `loopwatch` command). docs/ARCHITECTURE.md walks through them."""
