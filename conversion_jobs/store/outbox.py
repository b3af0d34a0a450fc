"""The statements of ``conversion_outbox`` that the dispatch paths share (docs/ARCHITECTURE.md
§2): a published row marked, a failed publish recorded."""

from __future__ import annotations

from django.db.models import F
from django.db.models.functions import Now

from conversion_jobs.models import ConversionOutbox
from conversion_jobs.store.prepared import id_batch

#: The rows whose messages the broker confirmed, marked published (a row already marked stays as
#: it is). Server-bound and prepared once per connection (``prepared.prepared_cursor``): the
#: array's cast keeps one statement whatever integer width psycopg picks for the batch's ids.
#: Its commit does not wait for its WAL flush (``set_config(..., true)``: this statement's own
#: transaction, run only when a row matches): a mark lost with a Postgres crash leaves the row
#: for the outbox sweep, whose second message the claim's CAS ignores, exactly as a crash
#: between the confirm and the mark always did (ADR 0017, session 8). The fast paths run it in
#: autocommit after their commit, the outbox sweep in its transaction (a lost mark: the same).
MARK_PUBLISHED = (
    "UPDATE conversion_outbox SET published_at = CURRENT_TIMESTAMP,"
    " publish_attempts = publish_attempts + 1"
    " WHERE id = ANY(%(ids)s::bigint[]) AND published_at IS NULL"
    " AND set_config('synchronous_commit', 'off', true) IS NOT NULL"
)


def mark_published(ids: list[int]) -> int:
    """``MARK_PUBLISHED`` (SQLite: its ORM twin). Row count: the rows this call marked."""
    return id_batch(
        MARK_PUBLISHED,
        ids,
        twin=lambda: ConversionOutbox.objects.filter(id__in=ids, published_at__isnull=True).update(
            published_at=Now(), publish_attempts=F("publish_attempts") + 1
        ),
    )


def failure_record(ids: list[int], code: str) -> int:
    """A failed publish of still unpublished rows: one more attempt, its error code. Row count."""
    return int(
        ConversionOutbox.objects.filter(id__in=ids, published_at__isnull=True).update(
            publish_attempts=F("publish_attempts") + 1, last_error_code=code
        )
    )
