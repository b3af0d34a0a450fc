"""The statements of a document's quarantine (``document_quarantine``, ``document_crash``;
``services/quarantine.py`` decides): one text for both profiles (SQLite has ``ON CONFLICT`` and
``RETURNING`` too)."""

from __future__ import annotations

import uuid
from datetime import datetime
from typing import NamedTuple

from django.db import connection

from conversion_jobs.models import DocumentCrash

#: The key's row, created or touched: the upsert takes its lock (held until commit), so the
#: recorders of one key run one after the other from here on.
KEY_UPSERT = """
INSERT INTO document_quarantine
    (tenant, source_sha256, engine_version, crashes, hosts, lifted_by, created_at, updated_at)
VALUES (%s, %s, %s, 0, 0, '', %s, %s)
ON CONFLICT (tenant, source_sha256, engine_version)
DO UPDATE SET updated_at = excluded.updated_at
RETURNING id, quarantined_at
"""

CRASH_INSERT = """
INSERT INTO document_crash (quarantine_id, job_id, attempt_id, host, code, at)
VALUES (%s, %s, %s, %s, %s, %s)
ON CONFLICT (attempt_id) DO NOTHING
"""

#: Read after the key's lock is held: each statement sees every crash committed before it.
CRASH_COUNT = """
SELECT count(*), count(DISTINCT host) FROM document_crash WHERE quarantine_id = %s
"""


class Crashes(NamedTuple):
    key_id: int
    #: when the key was quarantined before this crash (None: it was not)
    quarantined_at: datetime | None
    #: this crash was new (a second record of one attempt counts nothing)
    counted: bool
    crashes: int
    hosts: int


def crash_record(
    *,
    tenant: str,
    source_sha256: str,
    engine_version: str,
    job_id: uuid.UUID,
    attempt_id: int,
    host: str,
    code: str,
    now: datetime,
) -> Crashes:
    """The key upserted (its lock taken), the crash inserted once per attempt, the key's crashes
    and hosts counted. Runs inside the caller's transaction."""
    with connection.cursor() as cursor:
        cursor.execute(KEY_UPSERT, [tenant, source_sha256, engine_version, now, now])
        key_id, quarantined_at = cursor.fetchone()
        job = DocumentCrash._meta.get_field("job_id").get_db_prep_value(job_id, connection)
        cursor.execute(CRASH_INSERT, [key_id, job, attempt_id, host, code, now])
        counted = cursor.rowcount == 1
        cursor.execute(CRASH_COUNT, [key_id])
        crashes, hosts = cursor.fetchone()
    return Crashes(key_id, quarantined_at, counted, crashes, hosts)
