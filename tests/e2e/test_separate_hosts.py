"""Web and workers on separate hosts with no shared filesystem (issue 14): three network
namespaces, each with its own directories, reaching Postgres, RabbitMQ and the S3 server over
their own links. Submit through host A, convert on host B, download from host A; then kill -9
host B's worker mid-job and watch a worker on host C finish it without redoing a page."""

from __future__ import annotations

import json
import os
import urllib.request
import uuid
from pathlib import Path
from typing import Any
from urllib.parse import urlsplit

import pytest
from django.db import connection

from conversion_jobs import storage
from conversion_jobs.models import (
    ConversionAttempt,
    ConversionJob,
    InlineSource,
    PageCheckpoint,
)
from conversion_jobs.services.checkpoints import is_inline_result
from tests import testdocs
from tests.conftest import token
from tests.e2e import harness, netns

pytestmark = [pytest.mark.e2e, pytest.mark.postgres, pytest.mark.django_db(transaction=True)]

SLOW = {"kind": "slow", "seconds": 1.0}
PAGES = 12


@pytest.fixture
def network(tmp_path: Path):
    why = netns.available()
    if why is not None:  # a missing capability is a failure, never a skip
        pytest.fail(f"separate-host test cannot run: {why}")
    net = netns.Network(tmp_path / "hosts")
    try:
        yield net
    finally:
        net.close()


def _host_env(host: netns.Host, *, db: str, s3: dict[str, str], prefix: str) -> dict[str, str]:
    pg = urlsplit(os.environ["DATABASE_URL"])
    s3_port = urlsplit(s3["QUIRE_S3_ENDPOINT_URL"]).port
    return harness.process_env(
        DATABASE_URL=f"postgres://{pg.username}@{host.gateway}:{pg.port or 5432}/{db}",
        QUIRE_STORAGE="s3",
        QUIRE_S3_ENDPOINT_URL=f"http://{host.gateway}:{s3_port}",
        QUIRE_S3_BUCKET=s3["QUIRE_S3_BUCKET"],
        QUIRE_S3_ADDRESSING_STYLE="path",
        QUIRE_S3_PREFIX=prefix,
        QUIRE_VAR_DIR=str(host.home / "var"),
        QUIRE_STORAGE_DIR=str(host.home / "var" / "storage"),
        QUIRE_WORK_DIR=str(host.home / "var" / "work"),
        QUIRE_UPLOAD_DIR=str(host.home / "var" / "uploads"),
        PROMETHEUS_MULTIPROC_DIR=str(host.home / "var" / "metrics"),
    )


def _roles(kind: str, host: netns.Host) -> dict[str, str]:
    def url(role: str) -> str:
        user, password = harness.USERS[role]
        return f"amqp://{user}:{password}@{host.gateway}:{harness.RMQ_PORT}/{harness.VHOST}"

    return {
        "CELERY_BROKER_URL": url("worker" if kind in ("worker", "sweeper") else "publisher"),
        "QUIRE_BROKER_PUBLISHER_URL": url("publisher"),
        "QUIRE_BROKER_WORKER_URL": url("worker"),
    }


def _http(url: str, *, data: bytes | None = None, headers: dict[str, str] | None = None) -> Any:
    request = urllib.request.Request(  # noqa: S310 - our own test host
        url, data=data, headers={"Authorization": f"Bearer {token()}", **(headers or {})}
    )
    return urllib.request.urlopen(request, timeout=30)  # noqa: S310


def _submit(base: str, pdf: Path, options: dict[str, Any] | None = None) -> str:
    boundary = uuid.uuid4().hex
    parts = [
        f'--{boundary}\r\nContent-Disposition: form-data; name="output"\r\n\r\ntext\r\n'.encode(),
        f'--{boundary}\r\nContent-Disposition: form-data; name="options"\r\n\r\n'
        f"{json.dumps(options or {})}\r\n".encode(),
        f'--{boundary}\r\nContent-Disposition: form-data; name="file"; filename="d.pdf"\r\n'
        f"Content-Type: application/pdf\r\n\r\n".encode()
        + pdf.read_bytes()
        + f"\r\n--{boundary}--\r\n".encode(),
    ]
    with _http(
        f"{base}/api/v1/jobs",
        data=b"".join(parts),
        headers={"Content-Type": f"multipart/form-data; boundary={boundary}"},
    ) as response:
        assert response.status == 202
        return str(json.loads(response.read())["id"])


def _state(job_id: str) -> str:
    connection.close_if_unusable_or_obsolete()
    return str(ConversionJob.objects.get(id=job_id).state)


def test_separate_hosts__submit_on_a_convert_on_b_recover_on_c_download_from_a(
    network, rabbitmq_topology, e2e_settings, s3_server, settings, tmp_path
):
    prefix = f"hosts-{uuid.uuid4().hex}"
    settings.QUIRE = {
        **settings.QUIRE,
        "STORAGE": "s3",
        "S3": {
            **settings.QUIRE["S3"],
            "BUCKET": s3_server["QUIRE_S3_BUCKET"],
            "ENDPOINT_URL": s3_server["QUIRE_S3_ENDPOINT_URL"],
            "ADDRESSING_STYLE": "path",
            "PREFIX": prefix,
        },
    }
    harness.queues_purge()
    from django.core.management import call_command

    call_command("install_beat_schedule", stdout=open(os.devnull, "w"))
    db = connection.settings_dict["NAME"]
    a, b, c = network.host("a"), network.host("b"), network.host("c")
    pg_port = urlsplit(os.environ["DATABASE_URL"]).port or 5432
    s3_port = urlsplit(s3_server["QUIRE_S3_ENDPOINT_URL"]).port or 80
    network.forward([pg_port, harness.RMQ_PORT, s3_port])
    clusters = {
        h.name: harness.Cluster(
            log_dir=h.home, env=_host_env(h, db=db, s3=s3_server, prefix=prefix), wrap=h.wrap()
        )
        for h in (a, b, c)
    }
    host_a, host_b, host_c = clusters[a.name], clusters[b.name], clusters[c.name]
    texts_one = [uuid.uuid4().hex for _ in range(2)]
    one = testdocs.make_pdf(tmp_path / "one.pdf", pages=2, text_of=lambda n: texts_one[n - 1])
    texts_many = [uuid.uuid4().hex for _ in range(PAGES)]
    many = testdocs.make_pdf(
        tmp_path / "many.pdf", pages=PAGES, text_of=lambda n: texts_many[n - 1]
    )
    # The small document's source is inline (it reaches host B in its claim, through Postgres
    # alone); the larger one is stored in the bucket.
    assert one.stat().st_size < many.stat().st_size
    inline_max = str(one.stat().st_size)
    try:
        host_a.start(
            "web",
            QUIRE_BIND=f"{a.address}:8000",
            WEB_CONCURRENCY="2",
            QUIRE_INLINE_SOURCE_MAX_BYTES=inline_max,
            **_roles("web", a),
        )
        host_a.start("sweeper", **_roles("sweeper", a))
        host_a.start("beat", **_roles("beat", a))
        base = f"http://{a.address}:8000"
        harness.wait_until(
            lambda: urllib.request.urlopen(f"{base}/health/live", timeout=2).status == 200,  # noqa: S310
            timeout=60,
            what="web on host A",
        )
        # PORT names each worker node apart (worker.<hostname>.<PORT>): the hosts share a name.
        worker_b = host_b.ready(host_b.worker(PORT="21", **_roles("worker", b)))

        # 1. Submitted through A, converted on B, downloaded from A; the source inline.
        first = _submit(base, one)
        harness.wait_until(lambda: _state(first) == "succeeded", timeout=60, what="first job")
        attempt = ConversionAttempt.objects.get(job_id=first)
        assert host_b.owner_of(attempt.worker) is worker_b
        with _http(f"{base}/api/v1/jobs/{first}/result") as response:
            assert response.read().decode().split("\f") == texts_one
        first_job = ConversionJob.objects.get(id=first)
        assert storage.is_inline_source(first_job.source_key)
        assert InlineSource.objects.filter(job_id=first).exists()
        assert not storage.exists(storage.source_key(first_job.source_sha256))

        # 2. Host B's worker killed mid-job; a worker on host C finishes it.
        texts = texts_many
        second = _submit(base, many, {"_test_fault": SLOW})
        harness.wait_until(
            lambda: PageCheckpoint.objects.filter(job_id=second, state="done").exists(),
            timeout=60,
            interval=0.05,
            what="a page done on host B",
        )
        b_pids = set(worker_b.tree())
        worker_b.kill9()
        before = dict(
            PageCheckpoint.objects.filter(job_id=second, state="done").values_list(
                "page_number", "generation"
            )
        )
        assert before and set(before.values()) == {1} and len(before) < PAGES
        worker_c = host_c.ready(host_c.worker(PORT="31", **_roles("worker", c)))
        harness.wait_until(
            lambda: _state(second) == "succeeded", timeout=120, interval=0.5, what="recovered"
        )

        after = dict(
            PageCheckpoint.objects.filter(job_id=second).values_list("page_number", "generation")
        )
        assert sorted(after) == list(range(1, PAGES + 1))
        # No page redone: what generation 1 finished on B is still generation 1's.
        assert {n: after[n] for n in before} == before
        assert {g for n, g in after.items() if n not in before} == {2}
        attempts = {a.generation: a for a in ConversionAttempt.objects.filter(job_id=second)}
        assert attempts[1].outcome == "lease_lost"
        assert int(attempts[1].worker.rsplit(":", 1)[1]) in b_pids
        assert attempts[2].outcome == "succeeded"
        assert host_c.owner_of(attempts[2].worker) is worker_c
        assert attempts[2].pages_converted == PAGES - len(before)
        with _http(f"{base}/api/v1/jobs/{second}/result") as response:
            assert response.read().decode().split("\f") == texts

        # Nothing was stored on any host's disk: every artifact is in the bucket.
        for host in (a, b, c):
            assert not (host.home / "var" / "storage").exists(), host.name
        job = ConversionJob.objects.get(id=second)
        assert not storage.is_inline_source(job.source_key) and storage.exists(job.source_key)
        # Small text pages ride in their checkpoint rows, and so does the result made of them.
        assert is_inline_result(job.result_key) and not storage.exists(
            (job.result_key or "").removeprefix("inline:")
        )
    except BaseException:
        for cluster in clusters.values():
            print(cluster.tails())
        raise
    finally:
        for cluster in clusters.values():
            cluster.stop_all()
        connection.close()
