"""Quire project package: settings, URLs, the Celery app and WSGI entry point."""

from conversion_jobs import secret_policy

# Every process imports this package first (manage.py through the settings, celery -A project,
# gunicorn's master through the worker class): the production profile refuses development or
# missing secrets here, in one line, before anything binds, connects or forks.
secret_policy.enforce()

from project.celery import app as celery_app  # noqa: E402

__all__ = ["celery_app"]
