"""Poison documents among normal work (issue 24, "Poison"): normal jobs' throughput with two
crashing documents in the queue against the same run without them, and what the crashing
documents cost.

    .venv/bin/python bench/poison.py [--n 500] [--rounds 4] [--resubmissions 50]
                                     [--prepare-timeout 5] [--office-pages 6000]

One fresh database and throwaway vhost (``bench/_common.py`` ``quire_stack``); the Procfile's
``beat``, ``sweeper`` and one ``worker`` (``WORKER_CONCURRENCY=2``: 2 slots, and the Procfile's
spare pool process), production settings but ``QUIRE_PREPARE_TIMEOUT_S`` (the limit of
LibreOffice's conversion, 180 s by default: the bench lowers it so that two timeouts fit a run
of this length) and ``QUIRE_ENABLE_TEST_FAULTS=1``.

``--rounds`` (4) rounds, each a clean and a poison phase, in alternating order (clean first,
then poison first: over an even number of rounds a steady drift cancels, e.g. the shared
host's load, or the tables growing by 1,000 jobs a round), each phase on a fresh worker with no
slot rows left by the last; each round's crashing documents are new bytes. The verdict is on
the pooled ratio (all normal jobs over all their seconds, poison / clean); the rounds' own
ratios are printed too.

* phase **clean**: ``--n`` distinct one-page PDF -> text jobs of tenant ``clean``, accepted
  before the worker starts, run to the end. jobs/s = n / (first attempt start -> last finish).
* phase **poison**: ``--n`` distinct one-page PDF -> text jobs of tenant ``poisoned`` and, in
  the middle of the queue, two crashing documents of the same tenant:
  - a PDF whose converter child kills itself with SIGSEGV on every page (the ``segv`` test
    fault, ``conversion_jobs/converters/isolation.py``): retried after its first crash, failed
    ``document_quarantined`` at its second;
  - a real DOCX (``--office-pages`` pages of text, one page break each, made by
    ``tests/testdocs.py``) that keeps LibreOffice busy past ``--prepare-timeout``: its job fails
    ``conversion_timeout`` (a timeout is not retried); the client submits it once more when
    it has failed, and that second job's timeout quarantines it.
  Normal jobs/s = n / (first attempt start -> last normal finish).
* Then ``--resubmissions`` submissions of each crashing document by the same tenant: each must
  be refused ``document_quarantined``; converter starts are counted from outside, as the rows
  of ``conversion_attempt`` (a claim is the only way to a converter), before and after.

Printed: crashes per document (``document_crash`` rows, target <= 2), converter starts for
the resubmissions (target 0) and poison / clean normal jobs/s (target >= 0.9).
"""

from __future__ import annotations

import argparse
import sys
import tempfile
import time
import uuid
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))

import _common as c

DB_NAME = c.bench_db_name("quire_poison")
TARGET_RATIO = 0.9


def _pdfs(n: int, directory: Path) -> list[Path]:
    from tests import testdocs

    directory.mkdir(parents=True, exist_ok=True)
    paths = []
    for i in range(n):
        path = directory / f"doc-{i:06d}.pdf"
        salt = uuid.uuid4().hex
        testdocs.make_pdf(path, pages=1, text_of=lambda page, salt=salt: f"Page {page} {salt}")
        paths.append(path)
    return paths


def _scalar(url: str, query: str) -> object:
    return c.sql_retry(url, query)


def _window(url: str, tenant: str, ids: list[str] | None = None) -> tuple[int, float]:
    """(finished jobs, seconds from the tenant's first attempt start to the last finish of
    ``ids`` (default: all its jobs))."""
    only = "" if ids is None else " AND j.id IN (" + ",".join(f"'{i}'" for i in ids) + ")"
    done = _scalar(
        url,
        f"SELECT count(*) FROM conversion_job j WHERE tenant = '{tenant}'"  # noqa: S608
        f" AND finished_at IS NOT NULL{only}",
    )
    span = _scalar(
        url,
        "SELECT extract(epoch FROM (SELECT max(finished_at) FROM conversion_job j"  # noqa: S608
        f" WHERE tenant = '{tenant}'{only}) - (SELECT min(a.started_at) FROM conversion_attempt a"
        f" JOIN conversion_job j ON j.id = a.job_id WHERE j.tenant = '{tenant}'))",
    )
    return int(done), float("nan") if span is None else float(span)  # type: ignore[arg-type]


def _wait(url: str, query: str, target: int, timeout: float, what: str) -> None:
    deadline = time.monotonic() + timeout
    while int(_scalar(url, query)) < target:  # type: ignore[call-overload]
        if time.monotonic() > deadline:
            raise RuntimeError(f"timed out waiting for {what}")
        time.sleep(0.25)


def _tree_cpu_s(proc: object) -> float:
    """CPU seconds of a started process's tree: each live member's own and that of the children
    it has reaped (converter children, recycled LibreOffice engines)."""
    total = 0.0
    for pid in proc.tree():  # type: ignore[attr-defined]
        try:
            fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
        except OSError:
            continue
        total += sum(int(f) for f in fields[11:15]) / c.CLK_TCK
    return total


def _poison_attempts(url: str, job_ids: list[str]) -> tuple[int, float, str]:
    """(attempts, slot-seconds they held, their error codes) of the crashing documents' jobs."""
    ids = ",".join(f"'{i}'" for i in job_ids)
    row = _scalar(
        url,
        "SELECT count(*) || ' ' || coalesce(sum(extract(epoch FROM finished_at - started_at)), 0)"  # noqa: S608
        " || ' ' || coalesce(string_agg(error_code || ':' ||"
        " round(extract(epoch FROM finished_at - started_at)::numeric, 1), ',' ORDER BY"
        f" started_at), '-') FROM conversion_attempt WHERE job_id IN ({ids})",
    )
    n, held, codes = str(row).split(" ", 2)
    return int(n), float(held), codes


def _timeline(url: str, office_ids: list[str], normal: list[str], tenant: str) -> list[str]:
    """Where the office attempts sat in the poison phase: each attempt's start and end in seconds
    from the phase's first attempt start, the normal jobs finished by then, and the normal jobs'
    rate before, during and after the first office attempt (one slot held)."""
    ids = ",".join(f"'{i}'" for i in office_ids)
    normal_ids = ",".join(f"'{i}'" for i in normal)
    t0 = (
        "(SELECT min(a.started_at) FROM conversion_attempt a JOIN conversion_job j"  # noqa: S608
        f" ON j.id = a.job_id WHERE j.tenant = '{tenant}')"
    )
    rows = str(
        _scalar(
            url,
            "SELECT string_agg(round(extract(epoch FROM a.started_at - t0)::numeric, 2) || ' '"  # noqa: S608
            " || round(extract(epoch FROM a.finished_at - t0)::numeric, 2), ',' ORDER BY"
            f" a.started_at) FROM conversion_attempt a, {t0} AS t0(t0)"
            f" WHERE a.job_id IN ({ids})",
        )
    )
    last = float(
        _scalar(  # type: ignore[arg-type]
            url,
            f"SELECT extract(epoch FROM max(finished_at) - {t0}) FROM conversion_job"  # noqa: S608
            f" WHERE id IN ({normal_ids})",
        )
    )
    lines = []
    for n, pair in enumerate(rows.split(",")):
        start, end = (float(x) for x in pair.split())
        done_start, done_end = (
            int(
                _scalar(  # type: ignore[call-overload]
                    url,
                    f"SELECT count(*) FROM conversion_job WHERE id IN ({normal_ids})"  # noqa: S608
                    f" AND finished_at <= {t0} + interval '{t} seconds'",
                )
            )
            for t in (start, end)
        )
        lines.append(
            f"office attempt {n + 1}: {start:.2f} -> {end:.2f} s (normal jobs done then:"
            f" {done_start} -> {done_end}; last normal finish {last:.2f} s)"
        )
        if n == 0:
            held = min(end, last) - start
            during = done_end - done_start if end < last else len(normal) - done_start
            rates = [
                f"before {done_start / start:.1f}" if start > 0 else "before -",
                f"while held {during / held:.1f}" if held > 0 else "while held -",
            ]
            if end < last:
                rates.append(f"after {(len(normal) - done_end) / (last - end):.1f}")
            lines.append(f"normal jobs/s around the first office attempt: {', '.join(rates)}")
    return lines


def _state(url: str, job_id: object) -> tuple[str, str]:
    row = _scalar(
        url,
        f"SELECT state || ' ' || coalesce(error_code, '-') FROM conversion_job"  # noqa: S608
        f" WHERE id = '{job_id}'",
    )
    state, code = str(row).split(" ", 1)
    return state, code


def _office_doc(path: Path, pages: int, salt: str) -> Path:
    from tests import testdocs

    return testdocs.make_docx(
        path,
        paragraphs=[f"Paragraph {i} {salt} " + "lorem ipsum dolor " * 40 for i in range(pages)],
        page_break_after_each=True,
    )


def _clean_phase(stack: object, args: argparse.Namespace, tenant: str, pdfs: list[Path]) -> dict:
    url = stack.db_url  # type: ignore[attr-defined]
    for path in pdfs:
        c.accept_file(path, tenant=tenant)
    busy0 = c.machine_cpu()
    worker = stack.start("worker", WORKER_CONCURRENCY="2")  # type: ignore[attr-defined]
    _wait(
        url,
        f"SELECT count(*) FROM conversion_job WHERE tenant = '{tenant}'"  # noqa: S608
        " AND finished_at IS NOT NULL",
        args.n,
        args.timeout,
        "the clean phase",
    )
    done, seconds = _window(url, tenant)
    cpu = _tree_cpu_s(worker)
    busy1 = c.machine_cpu()
    _stop(worker, url)
    return {
        "done": done,
        "s": seconds,
        "rate": done / seconds,
        "cpu": cpu,
        "busy": (busy1[0] - busy0[0]) / max(1.0, busy1[1] - busy0[1]),
    }


def _stop(worker: object, url: str) -> None:
    worker.stop()  # type: ignore[attr-defined]
    # Its pool processes' slot rows would count for the TTL (QUIRE_FAIR_SLOT_TTL_S) after they
    # stopped: each phase starts with none.
    c.sql_retry(url, "WITH d AS (DELETE FROM worker_slot RETURNING 1) SELECT count(*) FROM d")


def _poison_phase(
    stack: object, args: argparse.Namespace, tenant: str, pdfs: list[Path], docs: dict[str, Path]
) -> dict:
    """Half the normal jobs, the two crashing documents, the other half; the office document is
    submitted once more when its first job failed (a timeout is not retried by Quire)."""
    url = stack.db_url  # type: ignore[attr-defined]
    normal: list[str] = []
    half = args.n // 2
    for path in pdfs[:half]:
        normal.append(str(c.accept_file(path, tenant=tenant).id))  # type: ignore[attr-defined]
    segv_job = c.accept_file(docs["segv"], tenant=tenant, options=SEGV)
    office_jobs = [c.accept_file(docs["office"], tenant=tenant, output="pdf").id]  # type: ignore[attr-defined]
    for path in pdfs[half:]:
        normal.append(str(c.accept_file(path, tenant=tenant).id))  # type: ignore[attr-defined]
    busy0 = c.machine_cpu()
    worker = stack.start("worker", WORKER_CONCURRENCY="2")  # type: ignore[attr-defined]
    deadline = time.monotonic() + args.timeout
    resubmitted = False
    while True:
        if _state(url, office_jobs[-1])[0] == "failed" and not resubmitted:
            office_jobs.append(c.accept_file(docs["office"], tenant=tenant, output="pdf").id)  # type: ignore[attr-defined]
            resubmitted = True
        normal_done, _ = _window(url, tenant, normal)
        if (
            normal_done >= args.n
            and _state(url, segv_job.id)[0] == "failed"  # type: ignore[attr-defined]
            and resubmitted
            and _state(url, office_jobs[-1])[0] == "failed"
        ):
            break
        if time.monotonic() > deadline:
            raise RuntimeError("timed out in the poison phase")
        time.sleep(0.25)
    done, seconds = _window(url, tenant, normal)
    cpu = _tree_cpu_s(worker)
    busy1 = c.machine_cpu()
    result = {
        "done": done,
        "s": seconds,
        "rate": done / seconds,
        "cpu": cpu,
        "busy": (busy1[0] - busy0[0]) / max(1.0, busy1[1] - busy0[1]),
        "held": {
            "segv": _poison_attempts(url, [str(segv_job.id)]),  # type: ignore[attr-defined]
            "office": _poison_attempts(url, [str(j) for j in office_jobs]),
        },
        "segv": (
            _state(url, segv_job.id),
            _scalar(url, f"SELECT attempts FROM conversion_job WHERE id = '{segv_job.id}'"),  # noqa: S608
        ),  # type: ignore[attr-defined]
        "office": [_state(url, job_id) for job_id in office_jobs],
        "timeline": _timeline(url, [str(j) for j in office_jobs], normal, tenant),
    }
    _stop(worker, url)
    return result


SEGV = {"_test_fault": {"kind": "segv"}}


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--n", type=int, default=500)
    parser.add_argument("--rounds", type=int, default=4)
    parser.add_argument("--resubmissions", type=int, default=50)
    parser.add_argument("--prepare-timeout", type=float, default=5.0)
    parser.add_argument("--office-pages", type=int, default=6000)
    parser.add_argument("--timeout", type=float, default=900.0)
    parser.add_argument(
        "--keep", action="store_true", help="keep the database, storage and processes' logs"
    )
    args = parser.parse_args()
    scratch = Path(tempfile.mkdtemp(prefix="poison-"))
    print(f"load before: {c.load_average()}")
    env = {
        "QUIRE_PREPARE_TIMEOUT_S": str(args.prepare_timeout),
        "QUIRE_ENABLE_TEST_FAULTS": "1",
    }
    rounds: list[tuple[dict, dict]] = []
    with c.quire_stack(db_name=DB_NAME, keep=args.keep, **env) as stack:
        url = stack.db_url
        from conversion_jobs.exceptions import DocumentQuarantined

        stack.start("beat")
        stack.start("sweeper")
        for r in range(args.rounds):
            clean_pdfs = _pdfs(args.n, scratch / f"clean{r}")
            poisoned_pdfs = _pdfs(args.n, scratch / f"poisoned{r}")
            docs = {  # new bytes each round: an earlier round's quarantine would refuse them
                "segv": _pdfs(1, scratch / f"segv{r}")[0],
                "office": _office_doc(scratch / f"long{r}.docx", args.office_pages, f"r{r}"),
            }
            # the phases alternate their order, so a drift of the shared host's speed cancels
            if r % 2 == 0:
                clean = _clean_phase(stack, args, f"clean{r}", clean_pdfs)
                poison = _poison_phase(stack, args, f"poisoned{r}", poisoned_pdfs, docs)
            else:
                poison = _poison_phase(stack, args, f"poisoned{r}", poisoned_pdfs, docs)
                clean = _clean_phase(stack, args, f"clean{r}", clean_pdfs)
            rounds.append((clean, poison))
            print(
                f"round {r + 1}: clean {clean['rate']:.1f} jobs/s, poison {poison['rate']:.1f}"
                f" jobs/s, ratio {poison['rate'] / clean['rate']:.3f}",
                flush=True,
            )
        most_crashes = int(
            _scalar(url, "SELECT coalesce(max(crashes), 0) FROM document_quarantine")
        )  # type: ignore[call-overload]

        # --- resubmissions of the last round's documents, with a worker running ---------------
        worker = stack.start("worker", WORKER_CONCURRENCY="2")
        attempts_before = int(_scalar(url, "SELECT count(*) FROM conversion_attempt"))  # type: ignore[call-overload]
        refused = 0
        t0 = time.perf_counter()
        for _ in range(args.resubmissions):
            for path, options, output in (
                (docs["segv"], SEGV, "text"),
                (docs["office"], None, "pdf"),
            ):
                try:
                    c.accept_file(
                        path, tenant=f"poisoned{args.rounds - 1}", options=options, output=output
                    )
                except DocumentQuarantined:
                    refused += 1
        resubmit_s = time.perf_counter() - t0
        time.sleep(2.0)  # anything accepted by mistake would have been claimed by now
        attempts_after = int(_scalar(url, "SELECT count(*) FROM conversion_attempt"))  # type: ignore[call-overload]
        crashes = _scalar(
            url,
            "SELECT string_agg(engine || ': ' || n || ' document(s), ' || q"
            " || ' quarantined, crashes max ' || most, ' | ') FROM (SELECT"
            " split_part(engine_version, ' ', 1) AS engine, count(*) AS n,"
            " count(quarantined_at) AS q, max(crashes) AS most FROM document_quarantine"
            " GROUP BY engine) AS by_engine",
        )
        _stop(worker, url)

    print(f"load after: {c.load_average()}")
    for r, (clean, poison) in enumerate(rounds):
        print(f"--- round {r + 1} ({'clean first' if r % 2 == 0 else 'poison first'})")
        print(f"clean:  {clean['done']} jobs in {clean['s']:.1f} s = {clean['rate']:.1f} jobs/s")
        print(
            f"poison: {poison['done']} normal jobs in {poison['s']:.1f} s ="
            f" {poison['rate']:.1f} jobs/s"
        )
        print(
            f"worker tree CPU: clean {clean['cpu']:.1f} s"
            f" ({1000 * clean['cpu'] / clean['done']:.1f} ms/job), poison phase"
            f" {poison['cpu']:.1f} s; machine busy: clean {clean['busy']:.0%},"
            f" poison {poison['busy']:.0%}"
        )
        for name, (n, seconds, codes) in poison["held"].items():
            print(
                f"{name} attempts: {n}, holding a slot {seconds:.1f} s ="
                f" {seconds / (2 * poison['s']):.1%} of the poison phase's 2 slots ({codes})"
            )
        for line in poison["timeline"]:
            print(line)
        (segv_state, segv_attempts) = poison["segv"]
        print(f"segv job: {_fmt(segv_state)}, attempts {segv_attempts}")
        print(f"office jobs: {', '.join(_fmt(s) for s in poison['office'])}")
    print("---")
    print(f"quarantine rows: {crashes}")
    print(
        f"most crashes before quarantine: {most_crashes} (target <= 2)"
        f" {c.verdict(most_crashes <= 2)}"
    )
    print(
        f"resubmissions: {refused} / {2 * args.resubmissions} refused document_quarantined in"
        f" {resubmit_s:.2f} s; converter starts (new conversion_attempt rows):"
        f" {attempts_after - attempts_before} (target 0) "
        f"{c.verdict(attempts_after == attempts_before and refused == 2 * args.resubmissions)}"
    )
    ratios = sorted(poison["rate"] / clean["rate"] for clean, poison in rounds)
    pooled = (sum(p["done"] for _, p in rounds) / sum(p["s"] for _, p in rounds)) / (
        sum(cl["done"] for cl, _ in rounds) / sum(cl["s"] for cl, _ in rounds)
    )
    print(f"ratios by round: {', '.join(f'{x:.3f}' for x in ratios)}")
    print(c.ratio_line("normal jobs/s poison / clean (pooled)", pooled, TARGET_RATIO))
    return 0


def _fmt(state: tuple[str, str]) -> str:
    return f"{state[0]} ({state[1]})"


if __name__ == "__main__":
    sys.exit(main())
