"""One exception base for the whole product; the CLI turns any of these into one clear line.
Errors of bytes and brokers (decode, input, broker) are in streams/errors.py."""


class LoopwatchError(Exception):
    """Base of every error loopwatch raises on purpose."""


class ConfigError(LoopwatchError):
    """The policy / tool-contract configuration is invalid (names file, key and expectation)."""
