"""The Python client and the ``quire`` CLI (client/, issue 27) against a live stack: the
Procfile's web, worker, sweeper and beat on real Postgres and RabbitMQ.

The CLI runs as a real process (in a pseudo-terminal where its display is checked), is killed
with SIGKILL mid-run and re-run; the jobs are counted in the database.
"""

from __future__ import annotations

import asyncio
import fcntl
import hashlib
import json
import os
import pty
import select
import signal
import sqlite3
import struct
import subprocess
import termios
import time
import uuid
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
from quire_client import AsyncClient, Client, RetryPolicy, errors
from quire_client.manifest import MANIFEST_NAME

from conversion_jobs.api.auth import token_mint
from conversion_jobs.models import ConversionJob
from tests import testdocs
from tests.e2e import harness

pytestmark = [pytest.mark.e2e, pytest.mark.postgres]

QUIRE = str(harness.VENV_BIN / "quire")
SCOPES = ["jobs:read", "jobs:submit", "jobs:cancel"]


def token(tenant: str) -> str:
    return token_mint(tenant=tenant, subject="e2e", scopes=SCOPES, ttl_s=900)


@pytest.fixture
def stack(start: Callable[..., harness.Proc]) -> dict[str, Any]:
    """web + worker (2 slots) + sweeper + beat; the web's URL."""
    web = start("web", WEB_CONCURRENCY="1")
    start("worker", WORKER_CONCURRENCY="2")
    start("sweeper")
    start("beat")
    return {"url": f"http://127.0.0.1:{web.port}", "start": start}


def cli_env(url: str, tenant: str) -> dict[str, str]:
    return {**os.environ, "QUIRE_URL": url, "QUIRE_TOKEN": token(tenant), "COLUMNS": "120"}


def quire(*args: str, env: dict[str, str], timeout: float = 60) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [QUIRE, *args], env=env, capture_output=True, text=True, timeout=timeout, check=False
    )


def sha256(path: Path) -> str:
    return hashlib.sha256(path.read_bytes()).hexdigest()


def jobs_of(tenant: str) -> list[ConversionJob]:
    return list(ConversionJob.objects.filter(tenant=tenant))


def assert_results_verified(tenant: str, out: Path, names: list[str], ext: str) -> None:
    """Every named result is on disk with the digest the server recorded for its job."""
    by_digest = {j.source_sha256: j for j in jobs_of(tenant)}
    manifest = sqlite3.connect(out / MANIFEST_NAME)
    rows = dict(
        manifest.execute("SELECT result_path, sha256 FROM files WHERE result_path IS NOT NULL")
    )
    manifest.close()
    for name in names:
        result = out / f"{name}.{ext}"
        assert result.is_file(), f"{result} missing"
        assert not Path(f"{result}.part").exists()
        job = by_digest[rows[str(result)]]
        assert sha256(result) == job.result_sha256


def mixed_dir(root: Path, salt: str) -> dict[str, str]:
    """PDF, DOCX, PNG and two corrupt files; name -> expected outcome code (None: success)."""
    root.mkdir()
    testdocs.make_pdf(root / "report.pdf", pages=2, text_of=lambda n: f"Report {salt} page {n}")
    testdocs.make_docx(root / "memo.docx", paragraphs=[f"Memo {salt}"])
    (root / "scans").mkdir()
    testdocs.make_png(root / "scans" / "scan.png", text=f"SCAN {salt[:6]}")
    testdocs.make_truncated_pdf(root / "broken.pdf")
    testdocs.make_wrong_magic(root / "junk.bin")
    return {
        "report.pdf": None,
        "memo.docx": None,
        "scans/scan.png": None,
        "broken.pdf": "invalid_input",
        "junk.bin": "unsupported_media_type",
    }


def test_quire_submit__mixed_directory_verified_corrupt_listed_exit_2(stack, tmp_path):
    tenant = f"cli-{uuid.uuid4().hex[:8]}"
    expected = mixed_dir(tmp_path / "docs", uuid.uuid4().hex)
    out = tmp_path / "out"
    env = cli_env(stack["url"], tenant)

    done = quire(
        "submit",
        str(tmp_path / "docs"),
        "--output",
        "text",
        "--out",
        str(out),
        "--concurrency",
        "4",
        env=env,
        timeout=120,
    )

    assert done.returncode == 2, done.stdout + done.stderr
    good = [name for name, code in expected.items() if code is None]
    assert_results_verified(tenant, out, good, "txt")
    assert "Report" in (out / "report.pdf.txt").read_text()
    summary = done.stdout[done.stdout.index("quire: 3/5 succeeded") :]
    for name, code in expected.items():
        if code is not None:
            assert any(code in line and name in line for line in summary.splitlines()), summary
    assert len(jobs_of(tenant)) == 4  # the 415 created no job

    # A re-run with --json: results skipped, failures listed again, still four jobs.
    again = quire(
        "submit",
        str(tmp_path / "docs"),
        "--output",
        "text",
        "--out",
        str(out),
        "--json",
        env=env,
        timeout=60,
    )
    assert again.returncode == 2, again.stderr
    events = [json.loads(line) for line in again.stdout.splitlines()]
    assert {e["file"] for e in events if e["event"] == "skipped"} == set(good)
    summary_event = events[-1]
    assert summary_event["event"] == "summary"
    assert summary_event["exit_code"] == 2
    assert {(f["file"], f["error_code"]) for f in summary_event["not_succeeded"]} == {
        (name, code) for name, code in expected.items() if code is not None
    }
    assert len(jobs_of(tenant)) == 4


def run_in_pty(argv: list[str], env: dict[str, str]) -> tuple[subprocess.Popen[bytes], int]:
    """Start ``argv`` with a new pseudo-terminal (120 x 30) as its stdin, stdout and stderr;
    (process, the terminal's master fd)."""
    master, slave = pty.openpty()
    fcntl.ioctl(slave, termios.TIOCSWINSZ, struct.pack("HHHH", 30, 120, 0, 0))
    proc = subprocess.Popen(
        argv,
        stdin=slave,
        stdout=slave,
        stderr=slave,
        env={**env, "LINES": "30", "TERM": "xterm-256color"},
        start_new_session=True,
    )
    os.close(slave)
    return proc, master


def read_available(fd: int, screen: bytearray, seconds: float) -> None:
    deadline = time.monotonic() + seconds
    while (left := deadline - time.monotonic()) > 0:
        ready, _, _ = select.select([fd], [], [], left)
        if not ready:
            return
        try:
            chunk = os.read(fd, 65536)
        except OSError:
            return
        if not chunk:
            return
        screen.extend(chunk)


def submitted_count(out: Path) -> int:
    path = out / MANIFEST_NAME
    if not path.exists():
        return 0
    try:
        with sqlite3.connect(path, timeout=1) as db:
            return int(db.execute("SELECT count(job_id) FROM files").fetchone()[0])
    except sqlite3.OperationalError:
        return 0


def test_quire_submit__progress_in_a_terminal_then_kill_9_and_rerun_makes_no_second_job(
    stack, tmp_path
):
    tenant = f"cli-{uuid.uuid4().hex[:8]}"
    docs = tmp_path / "docs"
    docs.mkdir()
    salt = uuid.uuid4().hex
    names = [f"doc-{i:02d}.pdf" for i in range(10)]
    for i, name in enumerate(names):
        testdocs.make_pdf(docs / name, pages=4, text_of=lambda n, i=i: f"Doc {i} {salt} p{n}")
    out = tmp_path / "out"
    env = cli_env(stack["url"], tenant)
    slow = '_test_fault={"kind": "slow", "seconds": 0.25}'
    argv = [
        QUIRE,
        "submit",
        str(docs),
        "--output",
        "text",
        "--out",
        str(out),
        "--concurrency",
        "3",
        "--option",
        slow,
    ]

    proc, fd = run_in_pty(argv, env)
    screen = bytearray()
    deadline = time.monotonic() + 60
    try:
        while time.monotonic() < deadline:
            read_available(fd, screen, 0.5)
            text = screen.decode("utf-8", "replace")
            if (
                submitted_count(out) >= 4
                and "━" in text
                and " pages" in text
                and "/4 pages" in text
            ):
                break
        os.killpg(proc.pid, signal.SIGKILL)  # mid-run: some submitted, not all results fetched
        proc.wait()
    finally:
        os.close(fd)
    text = screen.decode("utf-8", "replace")
    assert "━" in text, text[-2000:]  # the bars as rendered on the terminal
    assert "files" in text and "pages" in text, text[-2000:]
    assert "/4 pages" in text, text[-2000:]  # a file's bar: pages done out of its 4, from SSE
    fetched_before = len(list(out.glob("*.txt")))
    assert fetched_before < len(names), "the CLI finished before it was killed"

    rerun = quire(*argv[1:], env=env, timeout=120)

    assert rerun.returncode == 0, rerun.stdout + rerun.stderr
    assert len(jobs_of(tenant)) == len(names)  # the re-run created no second job
    assert_results_verified(tenant, out, names, "txt")
    assert not list(out.glob("*.part"))


def test_quire_commands__status_wait_get_cancel_ls(stack, tmp_path):
    tenant = f"cli-{uuid.uuid4().hex[:8]}"
    env = cli_env(stack["url"], tenant)
    src = testdocs.make_pdf(tmp_path / "a.pdf", pages=3, text_of=lambda n: f"{tenant} page {n}")
    with Client(stack["url"], token(tenant)) as client:
        job = client.submit(src, output="text")
        slow = client.submit(
            testdocs.make_pdf(tmp_path / "b.pdf", pages=30, text_of=lambda n: f"{tenant} b{n}"),
            output="text",
            options={"_test_fault": {"kind": "slow", "seconds": 1.0}},
        )

    waited = quire("wait", job.id, env=env)
    assert waited.returncode == 0, waited.stdout + waited.stderr
    assert "succeeded" in waited.stdout.splitlines()[-1]

    status = quire("status", job.id, "--json", env=env)
    assert status.returncode == 0
    assert json.loads(status.stdout)["state"] == "succeeded"

    got = quire("get", job.id, "--out", str(tmp_path / "got"), env=env)
    assert got.returncode == 0, got.stdout + got.stderr
    result = tmp_path / "got" / f"{job.id}.txt"
    assert sha256(result) == ConversionJob.objects.get(id=job.id).result_sha256

    cancelled = quire("cancel", slow.id, env=env)
    assert cancelled.returncode == 0, cancelled.stdout + cancelled.stderr
    assert "cancel" in cancelled.stdout
    too_late = quire("cancel", job.id, env=env)
    assert too_late.returncode == 2
    assert "too_late" in too_late.stdout

    listed = quire("ls", "--json", env=env)
    assert listed.returncode == 0
    assert {json.loads(line)["id"] for line in listed.stdout.splitlines()} == {job.id, slow.id}
    only = quire("ls", "--state", "succeeded", "--json", env=env)
    assert [json.loads(line)["id"] for line in only.stdout.splitlines()] == [job.id]

    wait_cancelled = quire("wait", slow.id, env=env)
    assert wait_cancelled.returncode == 2
    assert "cancelled" in wait_cancelled.stdout

    missing = quire("status", str(uuid.uuid4()), env=env)
    assert missing.returncode == 1
    assert "not_found" in missing.stderr
    unreachable = quire(
        "status", job.id, env={**env, "QUIRE_URL": f"http://127.0.0.1:{harness.free_port()}"}
    )
    assert unreachable.returncode == 1
    assert "connection_error" in unreachable.stderr
    usage = quire("submit", str(src), "--output", "docx", "--out", str(tmp_path / "x"), env=env)
    assert usage.returncode == 1


def test_client__sync_async_calls_and_429_retry_against_the_live_server(stack, tmp_path):
    tenant = f"cli-{uuid.uuid4().hex[:8]}"
    url = stack["url"]
    docs = [
        testdocs.make_pdf(
            tmp_path / f"{i}.pdf", pages=3, text_of=lambda n, i=i: f"{tenant} {i} {n}"
        )
        for i in range(3)
    ]
    with Client(url, token(tenant)) as client:
        first = client.submit(docs[0], output="png", options={"dpi": 40}, idempotency_key="k-1")
        assert first.state in ("queued", "running") and first.etag
        replay = client.submit(docs[0], output="png", options={"dpi": 40}, idempotency_key="k-1")
        assert replay.id == first.id
        with pytest.raises(errors.IdempotencyKeyReused) as reused:
            client.submit(docs[1], output="png", options={"dpi": 40}, idempotency_key="k-1")
        assert reused.value.status == 422 and isinstance(reused.value, errors.ClientError)

        snapshots = list(client.watch(first.id))
        assert snapshots[-1].terminal and snapshots[-1].state == "succeeded"
        assert snapshots[-1].pages.done == 3
        done = client.get(first.id)
        assert done.result is not None and done.pages.total == 3
        assert client.poll(first.id, etag=done.etag, wait=1) is None  # 304: nothing changed

        result = client.download(first.id, tmp_path / "r.zip")
        assert sha256(result) == done.result.sha256
        pages = client.pages(first.id)
        assert [p.page for p in pages] == [1, 2, 3]
        page = client.download_page(first.id, 2, tmp_path / "p2.png", sha256=pages[1].sha256)
        assert sha256(page) == pages[1].sha256
        with pytest.raises(errors.DigestMismatch):
            client.download(first.id, tmp_path / "bad.zip", sha256="0" * 64)
        assert not (tmp_path / "bad.zip").exists() and not (tmp_path / "bad.zip.part").exists()

        partial = client.submit(
            docs[1], output="text", options={"_test_fault": {"kind": "fail", "page": 2}}
        )
        partial = client.wait(partial.id, timeout=60)
        assert partial.state == "partial" and partial.pages.failed == 1
        assert [p.error_code for p in client.pages(partial.id) if p.state == "failed"] == [
            "invalid_input"
        ]

        with pytest.raises(errors.NotFound) as missing:
            client.get(str(uuid.uuid4()))
        assert missing.value.code == "not_found" and missing.value.status == 404
        with pytest.raises(errors.TooLate):
            client.cancel(first.id)
        with pytest.raises(errors.UnsupportedMediaType):
            client.submit(b"\x00" * 2048, output="text")

        listed = list(client.list(page_size=1))  # a cursor per job
        assert [j.id for j in listed] == [partial.id, first.id]

    async def run_async() -> None:
        async with AsyncClient(url, token(tenant)) as client:
            job = await client.submit(docs[2], output="text")
            seen = [s async for s in client.watch(job.id)]
            assert seen[-1].state == "succeeded"
            final = await client.wait(job.id, timeout=30)
            assert final.result is not None
            path = await client.download(job.id, tmp_path / "async.txt")
            assert sha256(path) == final.result.sha256
            newest = [j.id async for j in client.list(state="succeeded", page_size=1)]
            assert newest[0] == job.id
            with pytest.raises(errors.InvalidOptions):
                await client.submit(docs[2], output="text", options={"nope": 1})

    asyncio.run(run_async())
    check_quota_retry(stack, tmp_path)


def check_quota_retry(stack: dict[str, Any], tmp_path: Path) -> None:
    """A second web whose tenant quota is 1 (same database): the second submission is refused
    with 429 and a Retry-After until the first job ends; the client waits as told and then gets
    its 202 (one stack for both checks keeps the module's time down)."""
    quota_web = stack["start"](
        "web",
        WEB_CONCURRENCY="1",
        QUIRE_TENANT_QUOTA="1",
        QUIRE_RETRY_AFTER_MIN_S="1",
        QUIRE_RETRY_AFTER_MAX_S="1",
    )
    tenant = f"cli-{uuid.uuid4().hex[:8]}"
    answers: list[tuple[int, str | None]] = []
    with Client(
        f"http://127.0.0.1:{quota_web.port}",
        token(tenant),
        retry=RetryPolicy(max_attempts=30, max_wait_s=2.0),
    ) as client:
        client._http.event_hooks["response"].append(
            lambda r: answers.append((r.status_code, r.headers.get("Retry-After")))
        )
        slow = {"_test_fault": {"kind": "slow", "seconds": 0.5}}
        first = client.submit(
            testdocs.make_pdf(tmp_path / "1.pdf", pages=3, text_of=lambda n: f"{tenant} 1 {n}"),
            output="text",
            options=slow,
        )
        second = client.submit(
            testdocs.make_pdf(tmp_path / "2.pdf", pages=1, text_of=lambda n: f"{tenant} 2 {n}"),
            output="text",
        )
    assert second.id != first.id
    refused = [a for a in answers if a[0] == 429]
    assert refused, answers
    assert all(after == "1" for _, after in refused)
    assert answers[-1][0] == 202
    assert ConversionJob.objects.get(id=first.id).finished_at is not None
