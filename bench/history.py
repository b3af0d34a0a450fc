"""Finished-job history for scale benchmarks and plan tests (issue 12 point 6): ``n`` finished
jobs with their attempt, page checkpoint (inline text), published outbox row, idempotency record
and three audit events each (and a refused cancellation request for one in sixteen), written
by ``INSERT … SELECT generate_series`` in a handful of statements, then ``ANALYZE``.

Every other job is expired and purged by retention (no checkpoint row, as retention leaves it);
one job in eight of the others has an inline source (``inline_source``, 1 KB each: ADR 0017
session 10; production's are up to ``QUIRE_INLINE_SOURCE_MAX_BYTES`` and TOASTed out of line,
so the heap the joins touch is the same);
``finished_at`` is spread over the last 60 days, so retention's cutoffs select a realistic part.
The rows satisfy every constraint; the audit hashes are placeholders (``verify_audit`` would
report these chains: benchmark databases only).

    from bench.history import seed_history
    seed_history(cursor, jobs=1_000_000)      # any DB-API cursor on the Quire database
"""

from __future__ import annotations

from typing import Any

TENANTS = 16

_STATEMENTS = [
    # The jobs: distinct content identities, terminal, every other one expired and purged.
    """
    INSERT INTO conversion_job (
        id, tenant, state, generation, state_version, source_key, source_sha256, source_size,
        source_media_type, source_page_count, pages_done, pages_failed, output, options,
        options_digest, policy_version, attempts, max_attempts, next_attempt_at, queued_at,
        lease_token, traceparent, result_key, result_sha256, result_size, result_media_type,
        error_code, error_retryable, error_detail, created_at, updated_at, finished_at,
        expired_at, purged_at, audit_seq, audit_head)
    SELECT md5('job' || i || %(salt)s)::uuid, 'history-' || (i %% {tenants}), 'succeeded', 1, 3,
           CASE WHEN i %% 8 = 1 THEN 'inline:' ELSE '' END
           || 'sources/' || left(h, 2) || '/' || h || h, h || h, 10000, 'application/pdf', 1, 1, 0,
           'text', '{{"dpi": null, "pages": null, "allow_partial": true}}'::jsonb,
           md5('options'), 1, 1, 5, NULL, t - interval '2 seconds', NULL, '',
           'results/' || md5('job' || i || %(salt)s)::uuid || '/result.g1.txt', h || h, 40,
           'text/plain; charset=utf-8', NULL, false, '', t - interval '2 seconds', t, t,
           CASE WHEN i %% 2 = 0 THEN t + interval '1 day' END,
           CASE WHEN i %% 2 = 0 THEN t + interval '1 day' END, 3, h || h
    FROM generate_series(1, %(n)s) AS i,
         LATERAL (SELECT md5('src' || i || %(salt)s) AS h,
                         now() - (i %% 5184000) * interval '1 second' AS t) AS x
    """,
    """
    INSERT INTO conversion_attempt (job_id, generation, number, worker, started_at, heartbeat_at,
                                    finished_at, outcome, error_code, pages_converted)
    SELECT id, 1, 1, 'history', created_at, created_at, finished_at, 'succeeded', NULL, 1
    FROM conversion_job WHERE worker_marker(tenant)
    """,
    """
    INSERT INTO page_checkpoint (job_id, page_number, state, attempts, artifact_key,
                                 artifact_sha256, artifact_size, media_type, error_code,
                                 generation, updated_at, content)
    SELECT id, 1, 'done', 1, 'inline:pages/' || id || '/00001.g1.txt', result_sha256, 40,
           'text/plain; charset=utf-8', NULL, 1, finished_at,
           convert_to('Page 1 of a finished job ' || id, 'UTF8')
    FROM conversion_job WHERE worker_marker(tenant) AND expired_at IS NULL
    """,
    """
    INSERT INTO inline_source (job_id, content)
    SELECT id, decode(repeat(source_sha256, 32), 'hex')
    FROM conversion_job WHERE worker_marker(tenant) AND source_key LIKE 'inline:%%'
    """,
    """
    INSERT INTO conversion_outbox (job_id, generation, traceparent, created_at, published_at,
                                   publish_attempts, last_error_code)
    SELECT id, 1, '', created_at, created_at, 1, NULL
    FROM conversion_job WHERE worker_marker(tenant)
    """,
    """
    INSERT INTO idempotency_record (tenant, key, fingerprint, job_id, created_at)
    SELECT tenant, 'history-' || id, source_sha256, id, created_at
    FROM conversion_job WHERE worker_marker(tenant)
    """,
    """
    INSERT INTO cancellation_request (job_id, tenant, actor, generation_seen, state_seen,
                                      requested_at, resolved_at, outcome)
    SELECT id, tenant, 'history', 1, 'succeeded', finished_at, finished_at, 'too_late'
    FROM conversion_job WHERE worker_marker(tenant) AND right(id::text, 1) = '0'
    """,
    """
    INSERT INTO execution_audit_event (job_id, seq, event_type, generation, attempt_id, actor,
                                       details, created_at, prev_hash, hash)
    SELECT j.id, e.seq, e.kind, 1, NULL, 'system', '{{}}'::jsonb, j.finished_at,
           repeat('0', 64), j.audit_head
    FROM conversion_job j,
         (VALUES (1, 'accepted'), (2, 'claimed'), (3, 'published')) AS e(seq, kind)
    WHERE worker_marker(j.tenant)
    """,
]

#: Rows of this seed (and no others): a tenant named ``history-<n>``.
_MARKER = "tenant LIKE 'history-%%'"


def seed_history(cursor: Any, *, jobs: int, salt: str = "", vacuum: bool = False) -> None:
    """Insert ``jobs`` finished jobs and what hangs off them, then ANALYZE (``vacuum``: VACUUM
    ANALYZE, needs an autocommit connection: history in production is old and vacuumed, so a
    benchmark must not measure autovacuum's first pass over freshly inserted rows)."""
    for statement in _STATEMENTS:
        sql = statement.format(tenants=TENANTS)
        sql = sql.replace("worker_marker(j.tenant)", "j." + _MARKER).replace(
            "worker_marker(tenant)", _MARKER
        )
        cursor.execute(sql, {"n": jobs, "salt": salt})
    cursor.execute("VACUUM ANALYZE" if vacuum else "ANALYZE")
    if vacuum:  # and the seed's dirty pages written now, not during the measured phase
        cursor.execute("CHECKPOINT")
