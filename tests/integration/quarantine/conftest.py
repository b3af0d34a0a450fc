from tests.integration.execution.jobkit import fast_quire  # noqa: F401
