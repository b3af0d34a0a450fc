"""A bare Django view that inserts one row: the same-run baseline of ``bench/accept.py``.

Never part of the product: only ``bench/baseline_app/settings.py`` installs it.
"""
