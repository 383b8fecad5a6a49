"""Pure loop detection: steps in, findings out. No I/O, no clocks, no brokers."""
