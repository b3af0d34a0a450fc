"""Fixtures shared by the converter integration tests."""

import pytest

from conversion_jobs.converters import TEST_FAULTS_ENV, sessions


@pytest.fixture
def faults_enabled(monkeypatch):
    """Let ``options["_test_fault"]`` reach the converter child (as QUIRE_ENABLE_TEST_FAULTS=1
    does in a worker)."""
    monkeypatch.setenv(TEST_FAULTS_ENV, "1")


@pytest.fixture
def no_children_left_behind():
    """End every converter session, spare and the fork server after the test."""
    yield
    sessions.release_all()


@pytest.fixture(autouse=True)
def converter_defaults():
    """The converter layer's process-wide settings at their defaults (a fresh LibreOffice per
    document, a fresh child per attempt): an in-process worker test may have configured them
    from Django settings (runner.py) earlier in this session. Tests that want a warm engine or
    reuse configure it themselves."""
    from conversion_jobs.converters import engines

    engines.stop("test")
    engines.configure(engines.EngineSettings())
    sessions.configure_reuse(sessions.ReuseSettings())
    yield
