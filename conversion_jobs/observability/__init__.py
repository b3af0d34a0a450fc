"""Metrics, traces and content-free logging."""
