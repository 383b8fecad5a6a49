"""What every recognition profile reads the same way, from the policy rather than the
instrumentation: the run key (which attribute groups spans into a run), the explicit step
sequence and the task type. One rule for both span paths: the Python normalizer uses it,
and native_spec.py hands its result to the Rust side (`common_fields` in the spec), so
neither language writes it again."""

from __future__ import annotations

from detectors.policy import Policy

# OpenLLMetry copies LangChain run metadata to traceloop.association.properties.<key>.
ASSOCIATION_PREFIX = "traceloop.association.properties."


def run_keys(policy: Policy) -> tuple[str, ...] | None:
    """The attributes (span first, else resource) whose value is the run id; None: the
    trace is the run (`run_key: trace`)."""
    run_key = policy.run_key
    if run_key == "trace":
        return None
    if run_key == "conversation":
        return tuple(policy.conventions["conversation"])
    return (run_key,)


def common_fields(policy: Policy) -> dict[str, tuple[str, ...]]:
    """Field -> attribute keys in rank order, added to every profile's own."""
    sequence = tuple(policy.sequence_attributes)
    fields = {"sequence": sequence + tuple(ASSOCIATION_PREFIX + key for key in sequence)}
    if policy.task_type_attribute is not None:
        fields["task_type"] = (policy.task_type_attribute,)
    keys = run_keys(policy)
    if keys is not None:
        fields["run_key"] = keys
    return fields
