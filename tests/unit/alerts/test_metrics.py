"""alerts.metrics against a fresh CollectorRegistry: exact sample values, bounded labels."""

from __future__ import annotations

import pytest
from prometheus_client import CollectorRegistry, generate_latest

from alerts.metrics import LATENCY_BUCKETS, LabelLimiter, Metrics


def _event(**over: object) -> dict[str, object]:
    event: dict[str, object] = {
        "event": "loop_detected",
        "run_id": "run-1",
        "trace_id": "0af7651916cd43dd8448eb211c80319c",
        "shape": "identical_repetition",
        "severity": "warning",
        "prompt_version": "support-v12",
        "tool_name": "lookup_order",
        "tool_version": "3",
        "wasted_steps": 2,
        "wasted_tokens": 1500,
    }
    event.update(over)
    return event


@pytest.fixture
def registry() -> CollectorRegistry:
    return CollectorRegistry()


@pytest.fixture
def metrics(registry: CollectorRegistry) -> Metrics:
    return Metrics(registry)


def test_fresh_registry_holds_only_loopwatch_metrics(
    registry: CollectorRegistry, metrics: Metrics
) -> None:
    names = {m.name for m in registry.collect()}
    assert names and all(n.startswith("loopwatch_") for n in names)
    # the names the rules and the dashboard depend on
    for name in [
        "loopwatch_loop_events",
        "loopwatch_runs_finished",
        "loopwatch_wasted_steps",
        "loopwatch_wasted_tokens",
        "loopwatch_records_consumed",
        "loopwatch_spans_consumed",
        "loopwatch_duplicate_spans",
        "loopwatch_late_spans",
        "loopwatch_spans_after_finalize",
        "loopwatch_dead_letters",
        "loopwatch_decode_errors",
        "loopwatch_active_runs",
        "loopwatch_evicted_runs",
        "loopwatch_processing_latency_seconds",
        "loopwatch_consumer_lag",
        "loopwatch_last_processed_timestamp_seconds",
        "loopwatch_label_overflow",
    ]:
        assert name in names, name


def test_two_instances_on_separate_registries_do_not_clash() -> None:
    a, b = Metrics(CollectorRegistry()), Metrics(CollectorRegistry())
    a.observe_event(_event())
    assert b.registry.get_sample_value("loopwatch_loop_events_total", _labels()) is None


def test_same_registry_twice_is_an_error(registry: CollectorRegistry, metrics: Metrics) -> None:
    with pytest.raises(ValueError):
        Metrics(registry)


def _labels(**over: str) -> dict[str, str]:
    labels = {
        "shape": "identical_repetition",
        "severity": "warning",
        "prompt_version": "support-v12",
        "tool_name": "lookup_order",
        "tool_version": "3",
    }
    labels.update(over)
    return labels


def test_observe_event_counts_event_and_waste(
    registry: CollectorRegistry, metrics: Metrics
) -> None:
    metrics.observe_event(_event())
    metrics.observe_event(_event(wasted_steps=3, wasted_tokens=500))
    metrics.observe_event(_event(shape="retry_storm", severity="critical", tool_version=4))

    get = registry.get_sample_value
    assert get("loopwatch_loop_events_total", _labels()) == 2.0
    assert (
        get(
            "loopwatch_loop_events_total",
            _labels(shape="retry_storm", severity="critical", tool_version="4"),
        )
        == 1.0
    )
    waste = {
        "shape": "identical_repetition",
        "prompt_version": "support-v12",
        "tool_name": "lookup_order",
    }
    assert get("loopwatch_wasted_steps_total", waste) == 5.0
    assert get("loopwatch_wasted_tokens_total", waste) == 2000.0
    storm = dict(waste, shape="retry_storm")
    assert get("loopwatch_wasted_steps_total", storm) == 2.0
    assert get("loopwatch_wasted_tokens_total", storm) == 1500.0


def test_event_without_versions_or_tool_uses_unknown(
    registry: CollectorRegistry, metrics: Metrics
) -> None:
    metrics.observe_event(
        {
            "shape": "delegation_ping_pong",
            "severity": "warning",
            "prompt_version": "",
            "tool_name": None,
        }
    )
    labels = {
        "shape": "delegation_ping_pong",
        "severity": "warning",
        "prompt_version": "unknown",
        "tool_name": "unknown",
        "tool_version": "unknown",
    }
    assert registry.get_sample_value("loopwatch_loop_events_total", labels) == 1.0
    # missing waste counts add nothing but the series exists (a 0 on the dashboard)
    waste = {"shape": "delegation_ping_pong", "prompt_version": "unknown", "tool_name": "unknown"}
    assert registry.get_sample_value("loopwatch_wasted_steps_total", waste) == 0.0
    assert registry.get_sample_value("loopwatch_wasted_tokens_total", waste) == 0.0


@pytest.mark.parametrize("bad", [-3, "many", None, True, [1]])
def test_malformed_or_negative_waste_adds_nothing(
    registry: CollectorRegistry, metrics: Metrics, bad: object
) -> None:
    metrics.observe_event(_event(wasted_steps=bad, wasted_tokens=bad))
    waste = {
        "shape": "identical_repetition",
        "prompt_version": "support-v12",
        "tool_name": "lookup_order",
    }
    assert registry.get_sample_value("loopwatch_wasted_steps_total", waste) == 0.0
    assert registry.get_sample_value("loopwatch_loop_events_total", _labels()) == 1.0


def test_no_run_or_trace_ids_in_any_label(registry: CollectorRegistry, metrics: Metrics) -> None:
    metrics.observe_event(_event())
    metrics.observe_run({"run_id": "run-1", "outcome": "complete", "prompt_version": "v1"})
    text = generate_latest(registry).decode()
    assert "run-1" not in text
    assert "0af7651916cd43dd8448eb211c80319c" not in text
    label_names = {k for m in registry.collect() for s in m.samples for k in s.labels}
    assert not label_names & {"run_id", "trace_id", "span_id", "session_id", "event_id"}


def test_observe_run(registry: CollectorRegistry, metrics: Metrics) -> None:
    metrics.observe_run(
        {
            "outcome": "complete",
            "termination_reason": "final_answer",
            "prompt_version": "v1",
            "steps": 4,
            "shapes": [],
        }
    )
    metrics.observe_run(
        {
            "outcome": "complete",
            "termination_reason": "final_answer",
            "prompt_version": "v1",
            "steps": 12,
            "shapes": ["identical_repetition"],
        }
    )
    metrics.observe_run(
        {"outcome": "incomplete_trace", "termination_reason": None, "prompt_version": "v1"}
    )
    get = registry.get_sample_value
    assert (
        get(
            "loopwatch_runs_finished_total",
            {"outcome": "complete", "termination_reason": "final_answer", "prompt_version": "v1"},
        )
        == 2.0
    )
    assert (
        get(
            "loopwatch_runs_finished_total",
            {
                "outcome": "incomplete_trace",
                "termination_reason": "unknown",
                "prompt_version": "v1",
            },
        )
        == 1.0
    )
    assert get("loopwatch_runs_with_loops_total", {"prompt_version": "v1"}) == 1.0
    assert get("loopwatch_run_steps_count", {"prompt_version": "v1"}) == 2.0
    assert get("loopwatch_run_steps_sum", {"prompt_version": "v1"}) == 16.0
    assert get("loopwatch_run_steps_bucket", {"prompt_version": "v1", "le": "5.0"}) == 1.0


def test_clean_run_creates_zero_runs_with_loops(
    registry: CollectorRegistry, metrics: Metrics
) -> None:
    metrics.observe_run(
        {"outcome": "complete", "termination_reason": "final_answer", "prompt_version": "v2"}
    )
    assert (
        registry.get_sample_value("loopwatch_runs_with_loops_total", {"prompt_version": "v2"})
        == 0.0
    )


def test_label_cap_folds_into_other_and_counts_overflow(registry: CollectorRegistry) -> None:
    metrics = Metrics(registry, label_cap=3)
    for i in range(5):
        metrics.observe_event(_event(prompt_version=f"v{i}"))
    metrics.observe_event(_event(prompt_version="v4"))  # still over the cap
    metrics.observe_event(_event(prompt_version="v0"))  # admitted earlier: keeps its series
    get = registry.get_sample_value
    for i in range(3):
        expected = 2.0 if i == 0 else 1.0
        assert get("loopwatch_loop_events_total", _labels(prompt_version=f"v{i}")) == expected
    for i in (3, 4):
        assert get("loopwatch_loop_events_total", _labels(prompt_version=f"v{i}")) is None
    assert get("loopwatch_loop_events_total", _labels(prompt_version="other")) == 3.0
    # one overflow per folded observation, per label name
    assert get("loopwatch_label_overflow_total", {"label": "prompt_version"}) == 3.0
    assert get("loopwatch_label_overflow_total", {"label": "tool_name"}) is None
    # the waste counters fold the same value the same way
    waste = {
        "shape": "identical_repetition",
        "prompt_version": "other",
        "tool_name": "lookup_order",
    }
    assert get("loopwatch_wasted_steps_total", waste) == 6.0


def test_cap_is_per_label_and_shared_across_metrics(registry: CollectorRegistry) -> None:
    metrics = Metrics(registry, label_cap=2)
    metrics.observe_run(
        {"outcome": "complete", "termination_reason": "final_answer", "prompt_version": "a"}
    )
    metrics.observe_run(
        {"outcome": "complete", "termination_reason": "final_answer", "prompt_version": "b"}
    )
    # "a" was admitted via the run counter, so the event counter keeps it too: the
    # loop-rate join (events / runs by prompt_version) never mixes 'other' and a real value
    metrics.observe_event(_event(prompt_version="a"))
    metrics.observe_event(_event(prompt_version="c"))
    get = registry.get_sample_value
    assert get("loopwatch_loop_events_total", _labels(prompt_version="a")) == 1.0
    assert get("loopwatch_loop_events_total", _labels(prompt_version="other")) == 1.0
    assert get("loopwatch_label_overflow_total", {"label": "prompt_version"}) == 1.0
    # other labels have their own budget: two tools are fine, a third folds
    metrics.observe_event(_event(tool_name="t2"))
    metrics.observe_event(_event(tool_name="t3"))
    assert get("loopwatch_label_overflow_total", {"label": "tool_name"}) == 1.0


def test_unknown_and_other_do_not_use_up_the_cap() -> None:
    limiter = LabelLimiter(cap=1)
    assert limiter.value("x", None) == "unknown"
    assert limiter.value("x", "") == "unknown"
    assert limiter.value("x", "other") == "other"
    assert limiter.value("x", "a") == "a"
    assert limiter.value("x", "b") == "other"
    assert limiter.value("x", 7) == "other"
    assert limiter.seen("x") == frozenset({"a"})
    assert limiter.value("y", 7) == "7"


def test_label_cap_must_be_positive() -> None:
    with pytest.raises(ValueError):
        Metrics(CollectorRegistry(), label_cap=0)


def test_pipeline_health(registry: CollectorRegistry, metrics: Metrics) -> None:
    metrics.record_consumed("otlp_spans", spans=280, latency_seconds=0.02, now=1_700_000_000.0)
    metrics.record_consumed("otlp_spans", spans=20, latency_seconds=12.0, now=1_700_000_005.0)
    metrics.duplicate_spans.inc(3)
    metrics.late_spans.inc()
    metrics.spans_after_finalize.inc(2)
    metrics.dead_letter("decode_error")
    metrics.dead_letter("decode_error")
    metrics.decode_error("truncated_protobuf")
    metrics.run_evicted("idle_timeout")
    metrics.active_runs.set(17)
    metrics.set_consumer_lag("otlp_spans", 0, 120)
    metrics.set_consumer_lag("otlp_spans", 1, 5)

    get = registry.get_sample_value
    assert get("loopwatch_records_consumed_total", {"topic": "otlp_spans"}) == 2.0
    assert get("loopwatch_spans_consumed_total") == 300.0
    assert get("loopwatch_duplicate_spans_total") == 3.0
    assert get("loopwatch_late_spans_total") == 1.0
    assert get("loopwatch_spans_after_finalize_total") == 2.0
    assert get("loopwatch_dead_letters_total", {"reason": "decode_error"}) == 2.0
    assert get("loopwatch_decode_errors_total", {"reason": "truncated_protobuf"}) == 1.0
    assert get("loopwatch_evicted_runs_total", {"reason": "idle_timeout"}) == 1.0
    assert get("loopwatch_active_runs") == 17.0
    assert get("loopwatch_consumer_lag", {"topic": "otlp_spans", "partition": "0"}) == 120.0
    assert get("loopwatch_consumer_lag", {"topic": "otlp_spans", "partition": "1"}) == 5.0
    assert get("loopwatch_last_processed_timestamp_seconds") == 1_700_000_005.0
    assert get("loopwatch_processing_latency_seconds_count") == 2.0
    assert get("loopwatch_processing_latency_seconds_sum") == pytest.approx(12.02)
    assert get("loopwatch_processing_latency_seconds_bucket", {"le": "0.025"}) == 1.0
    assert get("loopwatch_processing_latency_seconds_bucket", {"le": "10.0"}) == 1.0
    assert get("loopwatch_processing_latency_seconds_bucket", {"le": "30.0"}) == 2.0

    metrics.forget_consumer_lag("otlp_spans", 1)
    metrics.forget_consumer_lag("otlp_spans", 9)  # never set: no error
    assert get("loopwatch_consumer_lag", {"topic": "otlp_spans", "partition": "1"}) is None


def test_latency_buckets_are_explicit(registry: CollectorRegistry, metrics: Metrics) -> None:
    assert LATENCY_BUCKETS[0] == 0.005 and LATENCY_BUCKETS[-1] == 30.0
    bounds = [
        s.labels["le"]
        for m in registry.collect()
        if m.name == "loopwatch_processing_latency_seconds"
        for s in m.samples
        if s.name.endswith("_bucket")
    ]
    assert bounds == [*(str(float(b)) for b in LATENCY_BUCKETS), "+Inf"]


def test_partition_label_has_its_own_larger_cap(registry: CollectorRegistry) -> None:
    metrics = Metrics(registry, label_cap=2)
    for p in range(64):
        metrics.set_consumer_lag("otlp_spans", p, p)
    assert (
        registry.get_sample_value(
            "loopwatch_consumer_lag", {"topic": "otlp_spans", "partition": "63"}
        )
        == 63.0
    )
    assert (
        registry.get_sample_value("loopwatch_label_overflow_total", {"label": "partition"}) is None
    )


def test_reason_labels_are_capped(registry: CollectorRegistry) -> None:
    metrics = Metrics(registry, label_cap=2)
    for reason in ["a", "b", "c", "d"]:
        metrics.dead_letter(reason)
    get = registry.get_sample_value
    assert get("loopwatch_dead_letters_total", {"reason": "other"}) == 2.0
    assert get("loopwatch_label_overflow_total", {"label": "reason"}) == 2.0


def test_generic_labels_helper_applies_the_cap(registry: CollectorRegistry) -> None:
    metrics = Metrics(registry, label_cap=1)
    metrics.labels(metrics.evicted_runs, reason="x").inc()
    metrics.labels(metrics.evicted_runs, reason="y").inc()
    assert registry.get_sample_value("loopwatch_evicted_runs_total", {"reason": "other"}) == 1.0


def test_default_registry_is_private_and_exposes_process_metrics() -> None:
    a, b = Metrics(), Metrics()  # no clash with each other or the global REGISTRY
    a.observe_event(_event())
    text = a.exposition().decode()
    assert "loopwatch_loop_events_total{" in text
    assert "process_" in text or "python_info" in text
    assert b.registry.get_sample_value("loopwatch_loop_events_total", _labels()) is None


def test_version_runs_count_every_run_and_every_fold_of_a_capped_label() -> None:
    """observe_version_run keeps the series of admitted slices at hand; a value folded into
    `other` still counts its fold on every run, and an admitted slice is never folded later."""
    registry = CollectorRegistry()
    metrics = Metrics(registry, label_cap=2)
    admitted = ["prompt", "support-bot", "router", None, "support-v14"]
    for looping in (True, False, False):
        metrics.observe_version_run(admitted, looping)
    metrics.observe_version_run(["prompt", "billing-bot", "router", None, "v2"], False)  # 2nd
    for _ in range(2):  # a third service and a third version: both folded, each time
        metrics.observe_version_run(["prompt", "search-bot", "router", None, "v3"], True)
    metrics.observe_version_run(admitted, False)
    get = registry.get_sample_value

    def labels(service: str, version: str) -> dict[str, str]:
        return {
            "kind": "prompt",
            "service_name": service,
            "agent_name": "router",
            "tool_name": "unknown",
            "version": version,
        }

    assert get("loopwatch_version_runs_total", labels("support-bot", "support-v14")) == 4.0
    assert get("loopwatch_version_looping_runs_total", labels("support-bot", "support-v14")) == 1.0
    assert get("loopwatch_version_runs_total", labels("billing-bot", "v2")) == 1.0
    assert get("loopwatch_version_runs_total", labels("other", "other")) == 2.0
    assert get("loopwatch_version_looping_runs_total", labels("other", "other")) == 2.0
    assert get("loopwatch_label_overflow_total", {"label": "service_name"}) == 2.0
    assert get("loopwatch_label_overflow_total", {"label": "prompt_version"}) == 2.0
