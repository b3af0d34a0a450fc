"""The job state machine (docs/ARCHITECTURE.md §3), as data.

The database guards enforce it (every transition is one guarded UPDATE); this table documents
it and lets the unit tests check that every service's guard is a legal edge.
"""

from __future__ import annotations

from django.db import models


class State(models.TextChoices):
    #: Accepted and durable; a message for the current generation is (or will be) in the queue.
    QUEUED = "queued"
    #: Claimed by a worker that holds the lease for the current generation.
    RUNNING = "running"
    #: A retryable error happened; beat re-dispatches it at ``next_attempt_at``.
    RETRY_WAIT = "retry_wait"
    #: Cancel requested while running; the worker stops at its next page or heartbeat.
    CANCELLING = "cancelling"
    #: Terminal: cancelled before completion; never has a published result.
    CANCELLED = "cancelled"
    #: Terminal: every selected page converted; the result is published.
    SUCCEEDED = "succeeded"
    #: Terminal: some pages failed permanently; the good pages are published.
    PARTIAL = "partial"
    #: Terminal: terminal error or attempts exhausted; an operator may retry it.
    FAILED = "failed"


LIVE_STATES = frozenset({State.QUEUED, State.RUNNING, State.RETRY_WAIT, State.CANCELLING})
TERMINAL_STATES = frozenset({State.CANCELLED, State.SUCCEEDED, State.PARTIAL, State.FAILED})
#: States whose job holds a worker lease (the fence for every worker write).
LEASED_STATES = frozenset({State.RUNNING, State.CANCELLING})

#: What every edge into a terminal state does, the one list (one terminal hook): the lease ended
#: and its attempt closed (when the job held one), pending cancellation requests resolved, the
#: audit event, the webhook messages, the terminal metric after commit. ``services/transitions.py``
#: runs one Python hook per effect; the publish statement (``store/jobs.py``, ``PUBLISH``) is built
#: from one CTE member per effect (the metric: its caller, after commit). Both fail at import when
#: they lack one; ``tests/integration/store/test_statements.py`` holds them to it.
TERMINAL_EFFECTS = ("lease_end", "cancellations", "audit", "webhooks", "metric")

#: (from, to) -> who moves it.
TRANSITIONS: dict[tuple[State, State], str] = {
    (State.QUEUED, State.RUNNING): "worker claim (CAS on generation)",
    (State.QUEUED, State.CANCELLED): "cancel API",
    (State.RETRY_WAIT, State.QUEUED): "beat: due retry timer (generation + 1)",
    (State.RETRY_WAIT, State.CANCELLED): "cancel API",
    (State.RUNNING, State.SUCCEEDED): "worker finalize (fenced)",
    (State.RUNNING, State.PARTIAL): "worker finalize (fenced)",
    (State.RUNNING, State.FAILED): "worker: terminal error / attempts exhausted (fenced); "
    "beat: lease expired with attempts exhausted",
    (State.RUNNING, State.RETRY_WAIT): "worker: retryable error (backoff in next_attempt_at)",
    (State.RUNNING, State.QUEUED): "beat: lease expired, re-dispatch at once (generation + 1)",
    (State.RUNNING, State.CANCELLING): "cancel API",
    (State.CANCELLING, State.CANCELLED): "worker at page boundary / heartbeat; beat: lease expired",
    (State.FAILED, State.QUEUED): "operator retry (generation + 1)",
    (State.CANCELLED, State.QUEUED): "operator retry (generation + 1)",
}


#: A second edge between two states the table already joins, told apart by its name:
#: (from, to, name) -> who moves it. Bound, fenced and tested like every edge above.
NAMED_TRANSITIONS: dict[tuple[State, State, str], str] = {
    (State.RUNNING, State.QUEUED, "yield"): "worker: used its fair-share slice while another "
    "tenant waits with no free slot (generation + 1, not counted as an attempt)",
}


def can_transition(source: State, target: State) -> bool:
    return (source, target) in TRANSITIONS
