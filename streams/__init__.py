"""Everything that touches bytes, brokers and time: decoding, normalization, drivers, CLI."""
