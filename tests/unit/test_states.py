"""The state machine table (conversion_jobs/states.py) against docs/ARCHITECTURE.md §3."""

from __future__ import annotations

import pytest

from conversion_jobs.states import (
    LEASED_STATES,
    LIVE_STATES,
    TERMINAL_STATES,
    TRANSITIONS,
    State,
    can_transition,
)


def _reachable(start: State) -> set[State]:
    seen, todo = {start}, [start]
    while todo:
        here = todo.pop()
        for source, target in TRANSITIONS:
            if source == here and target not in seen:
                seen.add(target)
                todo.append(target)
    return seen


def test_states__live_and_terminal_partition_every_state():
    assert LIVE_STATES.isdisjoint(TERMINAL_STATES)
    assert LIVE_STATES | TERMINAL_STATES == set(State)
    assert LIVE_STATES == {State.QUEUED, State.RUNNING, State.RETRY_WAIT, State.CANCELLING}


def test_states__leased_states_are_live():
    assert LEASED_STATES <= LIVE_STATES
    assert LEASED_STATES == {State.RUNNING, State.CANCELLING}


def test_transitions__every_edge_names_who_moves_it():
    for (source, target), who in TRANSITIONS.items():
        assert isinstance(source, State) and isinstance(target, State)
        assert source != target
        assert who.strip()


def test_transitions__terminal_states_only_leave_by_operator_retry():
    leaving = {(s, t) for (s, t) in TRANSITIONS if s in TERMINAL_STATES}
    assert leaving == {(State.FAILED, State.QUEUED), (State.CANCELLED, State.QUEUED)}
    assert all("operator retry" in TRANSITIONS[edge] for edge in leaving)


def test_transitions__every_live_state_can_reach_a_terminal_state():
    for state in LIVE_STATES:
        assert _reachable(state) & TERMINAL_STATES, state


def test_transitions__every_state_is_reachable_from_queued():
    assert _reachable(State.QUEUED) == set(State)


def test_transitions__only_a_worker_claim_enters_running():
    assert [s for (s, t) in TRANSITIONS if t == State.RUNNING] == [State.QUEUED]


def test_transitions__cancelling_only_ends_cancelled():
    assert {t for (s, t) in TRANSITIONS if s == State.CANCELLING} == {State.CANCELLED}


@pytest.mark.parametrize(
    ("source", "target"),
    [
        (State.QUEUED, State.SUCCEEDED),
        (State.SUCCEEDED, State.QUEUED),
        (State.PARTIAL, State.QUEUED),
        (State.CANCELLED, State.RUNNING),
        (State.CANCELLING, State.RUNNING),
        (State.RETRY_WAIT, State.RUNNING),
        (State.QUEUED, State.CANCELLING),
    ],
)
def test_can_transition__illegal_edge(source, target):
    assert not can_transition(source, target)


@pytest.mark.parametrize(("source", "target"), list(TRANSITIONS))
def test_can_transition__table_edge(source, target):
    assert can_transition(source, target)
