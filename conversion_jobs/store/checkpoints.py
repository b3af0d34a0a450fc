"""The statements of ``page_checkpoint`` (docs/ARCHITECTURE.md §5): the one column list, the
done-pages upsert (``UPSERT_DONE_PAGES``, also a member of ``store/jobs.py``'s publish) and the
fenced checkpoint batch with its ORM twin."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from django.db import transaction
from django.db.models import Count, F, Subquery
from django.db.models.functions import Now

from conversion_jobs.models import PageCheckpoint, PageState
from conversion_jobs.states import State
from conversion_jobs.store import db
from conversion_jobs.store.leases import FENCE, Fence, fence_params, held
from conversion_jobs.store.prepared import Byteas, Int4s, Int8s, Texts, prepared_cursor

#: ``page_checkpoint``'s columns in the model's field order, the one list: the runner builds
#: rows positionally in this order (``services.checkpoints.page_checkpoint_done``; a test holds
#: it to the model), the upserts write every column but the key.
CHECKPOINT_COLUMNS = (
    "id",
    "job_id",
    "page_number",
    "state",
    "attempts",
    "artifact_key",
    "artifact_sha256",
    "artifact_size",
    "media_type",
    "error_code",
    "generation",
    "updated_at",
    "content",
)
#: What a conflicting upsert rewrites: every column but the row's identity and key.
UPSERTED = tuple(c for c in CHECKPOINT_COLUMNS if c not in ("id", "job_id", "page_number"))

#: Each upserted column's value in ``UPSERT_DONE_PAGES`` (``p``: the unnested arrays).
_DONE_VALUES = {
    "state": "'done'",
    "error_code": "NULL",
    "generation": "%(generation)s",
    "updated_at": "now()",
}

_COMMA_NL = ",\n        "

#: The done pages of a batch (the ``p_*`` arrays of :func:`done_pages_params`), upserted from
#: the row that ``moved`` returned: part of ``DONE_PAGES`` and of ``store.jobs.PUBLISH``. The
#: arrays are bound by the server and sent in binary (``%(…)b``, ``prepared.prepared_cursor``):
#: a page's text as it is.
UPSERT_DONE_PAGES = f"""
    INSERT INTO page_checkpoint (job_id, page_number, {", ".join(UPSERTED)})
    SELECT m.id, p.page_number, {", ".join(_DONE_VALUES.get(c, f"p.{c}") for c in UPSERTED)}
    FROM moved m, unnest(%(p_number)b::int[], %(p_attempts)b::int[], %(p_key)b::text[],
                         %(p_sha)b::text[], %(p_size)b::bigint[], %(p_media)b::text[],
                         %(p_content)b::bytea[])
         AS p(page_number, attempts, artifact_key, artifact_sha256, artifact_size, media_type,
              content)
    ON CONFLICT (job_id, page_number) DO UPDATE SET
        {_COMMA_NL.join(f"{c} = EXCLUDED.{c}" for c in UPSERTED)}
"""  # noqa: S608 (text built from this module's constants)

#: A batch of done pages on Postgres, one statement (its own transaction): the fenced UPDATE
#: of the job row takes the row lock first (a recovery or a cancel that committed before us
#: makes it match zero rows after the lock wait), and the upsert inserts only from its
#: returned row, so a lost fence writes nothing. Row: how many job rows moved (1 or 0).
DONE_PAGES = f"""
WITH moved AS (
    UPDATE conversion_job SET pages_done = pages_done + %(n_done)s, updated_at = now()
    WHERE {FENCE} AND state = 'running'
    RETURNING id
), pages AS ({UPSERT_DONE_PAGES})
SELECT count(*) FROM moved
"""  # noqa: S608 (text built from this module's constants)


def done_pages_params(checkpoints: list[PageCheckpoint]) -> dict[str, Any]:
    """The ``p_*`` arrays ``UPSERT_DONE_PAGES`` reads, one element per page."""
    return {
        "p_number": Int4s([c.page_number for c in checkpoints]),
        "p_attempts": Int4s([c.attempts for c in checkpoints]),
        "p_key": Texts([c.artifact_key for c in checkpoints]),
        "p_sha": Texts([c.artifact_sha256 for c in checkpoints]),
        "p_size": Int8s([c.artifact_size for c in checkpoints]),
        "p_media": Texts([c.media_type for c in checkpoints]),
        "p_content": Byteas([c.content for c in checkpoints]),
    }


def one_statement(checkpoints: list[PageCheckpoint]) -> bool:
    """Whether ``checkpoints`` go in one statement here (Postgres, every page done)."""
    return db.postgres() and all(c.state == PageState.DONE for c in checkpoints)


def done_pages_record(fence: Fence, checkpoints: list[PageCheckpoint]) -> int:
    """``DONE_PAGES`` (Postgres): a checkpoint batch of done pages, fenced. Row count: 1, or 0
    when the fence matched nothing (nothing written)."""
    params: dict[str, Any] = {
        **fence_params(fence),
        "n_done": len(checkpoints),
        **done_pages_params(checkpoints),
    }
    with prepared_cursor() as cursor:
        cursor.execute(DONE_PAGES, params)
        (moved,) = cursor.fetchone()
    return int(moved)


def batch_record(
    fence: Fence,
    checkpoints: list[PageCheckpoint],
    *,
    also: Callable[[], None] = lambda: None,
) -> int:
    """A fenced checkpoint batch: the job row's page counters moved under the fence (running),
    the pages upserted, and ``also`` (the failed pages' audit events) in the same transaction.
    Postgres with every page done: ``DONE_PAGES``, one statement (no failed page: ``also`` is
    not called); otherwise the ORM twin, in a transaction (a savepoint in the caller's). Row count:
    1, or 0 when the fence matched nothing (nothing written)."""
    if one_statement(checkpoints):
        return done_pages_record(fence, checkpoints)
    with transaction.atomic():
        if not held(fence, State.RUNNING).update(updated_at=Now(), **counters(checkpoints)):
            return 0
        upsert(checkpoints)
        also()
    return 1


def counters(checkpoints: list[PageCheckpoint]) -> dict[str, Any]:
    """The job row's page counters moved by ``checkpoints`` (for its guarded UPDATE)."""
    done = sum(1 for c in checkpoints if c.state == PageState.DONE)
    failed = sum(1 for c in checkpoints if c.state == PageState.FAILED)
    moved: dict[str, Any] = {}
    if done:
        moved["pages_done"] = F("pages_done") + done
    if failed:
        moved["pages_failed"] = F("pages_failed") + failed
    return moved


def upsert(checkpoints: list[PageCheckpoint]) -> None:
    """The ORM twin of ``UPSERT_DONE_PAGES`` for pages in any state; the caller holds the fenced
    row."""
    PageCheckpoint.objects.bulk_create(
        checkpoints,
        update_conflicts=True,
        unique_fields=["job", "page_number"],
        update_fields=list(UPSERTED),
    )


def pages_converted_by(*, job_id: Any, generation: Any) -> Subquery:
    """Pages an attempt checkpointed as done (one attempt per generation, so the generation
    stamped on the checkpoint names the attempt): computed when the attempt closes rather than
    counted with an extra UPDATE per page."""
    return Subquery(
        PageCheckpoint.objects.filter(job_id=job_id, generation=generation, state=PageState.DONE)
        .values("job_id")
        .annotate(n=Count("id"))
        .values("n")[:1]
    )


def failed_reset(job_id: Any) -> int:
    """An operator retry's fresh budget: the job's failed pages pending again, their tries 0."""
    return int(
        PageCheckpoint.objects.filter(job_id=job_id, state=PageState.FAILED).update(
            state=PageState.PENDING, attempts=0, error_code=None
        )
    )
