"""Errors of the I/O side (bytes, brokers), under the product's one base `LoopwatchError`
(detectors/errors.py); the CLI turns any of them into one clear line."""

from __future__ import annotations

from detectors.errors import LoopwatchError


class DecodeError(LoopwatchError):
    """An OTLP record or file, or a stored run state, could not be decoded (names the
    source and why)."""


class InputError(LoopwatchError):
    """A span decoded but cannot be used (missing ids, wrong types)."""


class BrokerError(LoopwatchError):
    """Kafka is missing, unreachable or refused an operation."""
