"""An ETag names one representation (issue 22 point 4, docs/API_CONTRACT.md §2.2), seen from
outside: a real worker converts a 50-page job page by page (the ``slow`` test fault: each page
waits 0.1 s in the converter child, so the page counters move about 20 times), while clients
read it from the real ``web`` process with ``If-None-Match``:

* a poller never gets a 304 once the job's representation moved past the last 200 it saw
  (before each request the test reads the job's representation from the database; progress
  only moves forward, so a 304 is right only if that reading is still the last body seen);
* a long-poller (``?wait``) is woken by page progress, not only by the state changes.
"""

from __future__ import annotations

import itertools
import json
import threading
import time
from typing import Any

import requests
from django.db import connections

from conversion_jobs.models import ConversionJob
from conversion_jobs.representation import job_representation
from tests.e2e.conftest import role_env
from tests.e2e.webproc import start_web

PAGES = 50
SLOW = {"_test_fault": {"kind": "slow", "seconds": 0.1}}


def _representation_now(job_id: str) -> dict[str, Any]:
    """The body a GET would answer now, read from the row (as JSON carries it)."""
    return json.loads(json.dumps(job_representation(ConversionJob.objects.get(id=job_id))))


def _done(body: dict[str, Any]) -> int:
    return int(body["pages"]["done"])


def test_etag__no_304_after_pages_moved_and_the_long_poll_wakes_on_progress(cluster, start):
    web = start_web(cluster, **role_env("web"))
    start("worker")
    accepted = web.submit(pages=PAGES, options=SLOW)
    assert accepted.status_code == 202, accepted.text
    job_id = accepted.json()["id"]
    url = f"{web.base}/api/v1/jobs/{job_id}"
    seen: dict[str, list[Any]] = {"poll": [], "wait": []}
    failures: list[BaseException] = []

    def poller() -> None:
        """Conditional GETs as fast as they come back; each 304 checked against the row."""
        try:
            first = requests.get(url, headers=web.headers, timeout=10)
            last_body, last_etag = first.json(), first.headers["ETag"]
            while last_body["state"] not in ("succeeded", "partial", "failed", "cancelled"):
                before = _representation_now(job_id)
                r = requests.get(
                    url, headers={**web.headers, "If-None-Match": last_etag}, timeout=10
                )
                if r.status_code == 304:
                    assert r.headers["ETag"] == last_etag
                    # The representation had already moved on before this request was sent:
                    # a 304 here would hand the client stale progress.
                    assert before == last_body, (
                        f"304 for {last_etag} while the job was at pages={before['pages']}, "
                        f"state_version={before['state_version']} (last 200: "
                        f"pages={last_body['pages']})"
                    )
                    seen["poll"].append(("304", _done(last_body)))
                else:
                    assert r.status_code == 200, r.text
                    assert r.headers["ETag"] != last_etag
                    assert r.json() != last_body  # a new validator names a new body
                    last_body, last_etag = r.json(), r.headers["ETag"]
                    seen["poll"].append(("200", _done(last_body)))
                time.sleep(0.01)
        except BaseException as exc:
            failures.append(exc)
        finally:
            connections.close_all()

    def long_poller() -> None:
        """``?wait`` with the current ETag: every answer while the job runs is a new body."""
        try:
            first = requests.get(url, headers=web.headers, timeout=10)
            body, etag = first.json(), first.headers["ETag"]
            while body["state"] not in ("succeeded", "partial", "failed", "cancelled"):
                r = requests.get(
                    f"{url}?wait=10", headers={**web.headers, "If-None-Match": etag}, timeout=20
                )
                # the job changes far more often than every 10 s: never a timed-out 304
                assert r.status_code == 200, (r.status_code, _done(body))
                assert r.headers["ETag"] != etag and r.json() != body
                body, etag = r.json(), r.headers["ETag"]
                seen["wait"].append((body["state"], body["state_version"], _done(body)))
        except BaseException as exc:
            failures.append(exc)

    threads = [threading.Thread(target=poller), threading.Thread(target=long_poller)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join(timeout=60)
    assert not any(t.is_alive() for t in threads), "a client did not see the job finish in 60 s"
    if failures:
        raise failures[0]

    assert ConversionJob.objects.get(id=job_id).state == "succeeded"
    polled = [done for kind, done in seen["poll"] if kind == "200"]
    assert polled == sorted(polled) and polled[-1] == PAGES
    assert len({done for done in polled if 0 < done < PAGES}) >= 3, seen["poll"]
    assert any(kind == "304" for kind, _ in seen["poll"]), "the poller never got a 304 at all"
    # Woken by progress: several answers within one state (same state_version, more pages).
    running = [(v, done) for state, v, done in seen["wait"] if state == "running"]
    progress_wakes = sum(
        1 for (v0, d0), (v1, d1) in itertools.pairwise(running) if v0 == v1 and d1 > d0
    )
    assert progress_wakes >= 3, seen["wait"]
