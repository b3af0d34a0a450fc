"""Celery entry points only: parse ids, call one service, return."""
