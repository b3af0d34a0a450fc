"""Every labelled counter and histogram has its series from the first scrape (docs/OPERABILITY.md
§8): the label values initialised at import are the ones the code can set."""

from __future__ import annotations

from prometheus_client import generate_latest

from conversion_jobs.models import AttemptOutcome, CancellationOutcome, PageState
from conversion_jobs.observability import metrics
from conversion_jobs.states import TERMINAL_STATES


def values(metric, label: str) -> set[str]:
    return {series[label] for series in metrics.KNOWN_SERIES[metric]}


def test_known_series__follow_the_enums_they_come_from():
    assert values(metrics.ATTEMPT_DURATION, "outcome") == set(AttemptOutcome.values)
    assert values(metrics.CANCELLATIONS, "outcome") == set(CancellationOutcome.values)
    assert values(metrics.TERMINAL, "state") == {str(s) for s in TERMINAL_STATES}
    assert values(metrics.PAGES, "outcome") <= set(PageState.values)


def test_known_series__every_labelled_metric_is_listed():
    labelled = {
        value
        for value in vars(metrics).values()
        if isinstance(value, metrics.Counter | metrics.Histogram) and value._labelnames
    }
    assert labelled == set(metrics.KNOWN_SERIES)


def test_known_series__exposed_at_zero_without_any_event():
    text = generate_latest().decode()
    assert 'quire_admissions_total{reason="",result="accepted"}' in text
    assert 'quire_attempt_duration_seconds_count{outcome="succeeded"}' in text
    assert 'quire_jobs_finished_total{state="succeeded"}' in text
