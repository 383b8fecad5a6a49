"""One exception base for the whole product; the CLI turns any of these into one clear line."""


class LoopwatchError(Exception):
    """Base of every error loopwatch raises on purpose."""


class ConfigError(LoopwatchError):
    """The policy / tool-contract configuration is invalid (names file, key and expectation)."""


class DecodeError(LoopwatchError):
    """An OTLP record or file could not be decoded (names the source and why)."""


class InputError(LoopwatchError):
    """A span decoded but cannot be used (missing ids, wrong types)."""


class BrokerError(LoopwatchError):
    """Kafka is missing, unreachable or refused an operation."""
