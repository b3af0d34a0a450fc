"""The warm LibreOffice engine (ADR 0019) with the real LibreOffice: recycling, hangs, stops,
``kill -9`` of the worker, one engine per worker process, nothing left between attempts."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import threading
import time
import uuid
from pathlib import Path

import pypdfium2 as pdfium
import pytest

from conversion_jobs.converters import ConversionStopped, ConversionTimeout, engines
from conversion_jobs.converters.base import DOCX, ODT, PPTX, XLSX, Limits, PrepareRequest
from conversion_jobs.converters.isolation import process_group_members
from conversion_jobs.converters.registry import OfficeConverter
from tests import testdocs

REPO = Path(__file__).resolve().parents[3]
LIMITS = Limits(page_timeout_s=30, prepare_timeout_s=120)


def never() -> bool:
    return False


@pytest.fixture
def engine_dir(tmp_path):
    """Warm engines on, hosts under ``tmp_path/engines``; the engine ends after the test."""
    root = tmp_path / "engines"
    engines.configure(engines.EngineSettings(scratch_dir=root, max_conversions=10))
    yield root
    engines.stop("test")
    engines.configure(engines.EngineSettings())


def _configure(root: Path, **changes) -> None:
    engines.configure(engines.EngineSettings(scratch_dir=root, **changes))


def _pdf_pages_text(path: Path) -> list[str]:
    doc = pdfium.PdfDocument(str(path))
    try:
        return [doc[i].get_textpage().get_text_range().strip() for i in range(len(doc))]
    finally:
        doc.close()


def _convert(source: Path, media_type: str, workdir: Path, **kwargs):
    workdir.mkdir(parents=True, exist_ok=True)
    return OfficeConverter().prepare(
        PrepareRequest(
            source=source,
            media_type=media_type,
            workdir=workdir,
            limits=kwargs.pop("limits", LIMITS),
            should_stop=kwargs.pop("should_stop", never),
            **kwargs,
        )
    )


def _office_variants(root: Path) -> list[tuple[Path, str]]:
    """Eight documents: DOCX, ODT, PPTX and XLSX, two of each. PPTX and XLSX are made by a fresh
    LibreOffice from flat ODF / CSV (no Python library for them is installed)."""
    root.mkdir(parents=True, exist_ok=True)
    out: list[tuple[Path, str]] = []
    for n in range(2):
        words = [f"Variant {n} paragraph {i} {uuid.uuid4().hex[:8]}" for i in range(3)]
        out.append(
            (
                testdocs.make_docx(
                    root / f"v{n}.docx", paragraphs=words, page_break_after_each=n == 1
                ),
                DOCX,
            )
        )
        out.append((testdocs.make_odt(root / f"v{n}.odt", paragraphs=words), ODT))
        (root / f"v{n}.csv").write_text(
            "\n".join(f"row{r},{r * (n + 2)},cell {r} of variant {n}" for r in range(40)) + "\n"
        )
        (root / f"v{n}.fodp").write_text(
            _flat_odp([f"Slide {s} of variant {n}" for s in range(n + 2)])
        )
    env = {
        "PATH": os.environ["PATH"],
        "HOME": str(root),
        "LANG": "C.UTF-8",
        "SAL_USE_VCLPLUGIN": "svp",
    }
    profile = f"-env:UserInstallation={(root / 'p').as_uri()}"
    for ext, sources in (("xlsx", "csv"), ("pptx", "fodp")):
        inputs = sorted(str(p) for p in root.glob(f"*.{sources}"))
        argv = ["soffice", "--headless", "--norestore", profile, "--convert-to", ext]
        subprocess.run(
            [*argv, "--outdir", str(root), *inputs],
            env=env,
            capture_output=True,
            check=True,
            timeout=120,
        )
    for n in range(2):
        out.append((root / f"v{n}.xlsx", XLSX))
        out.append((root / f"v{n}.pptx", PPTX))
    return out


def _flat_odp(slides: list[str]) -> str:
    pages = "".join(
        f'<draw:page draw:name="p{i}"><draw:frame svg:x="2cm" svg:y="2cm" svg:width="20cm" '
        f'svg:height="3cm"><draw:text-box><text:p>{text}</text:p></draw:text-box></draw:frame>'
        "</draw:page>"
        for i, text in enumerate(slides)
    )
    return (
        '<?xml version="1.0" encoding="UTF-8"?>'
        '<office:document xmlns:office="urn:oasis:names:tc:opendocument:xmlns:office:1.0" '
        'xmlns:draw="urn:oasis:names:tc:opendocument:xmlns:drawing:1.0" '
        'xmlns:text="urn:oasis:names:tc:opendocument:xmlns:text:1.0" '
        'xmlns:svg="urn:oasis:names:tc:opendocument:xmlns:svg-compatible:1.0" '
        'office:version="1.2" office:mimetype="application/vnd.oasis.opendocument.presentation">'
        f"<office:body><office:presentation>{pages}</office:presentation></office:body>"
        "</office:document>"
    )


def test_fifty_documents_in_a_row__recycled_every_n__equal_to_cold(tmp_path, engine_dir):
    variants = _office_variants(tmp_path / "variants")
    # Cold: a fresh LibreOffice per document (the engine off).
    _configure(engine_dir, mode="fresh")
    cold = {}
    for source, media_type in variants:
        prepared = _convert(source, media_type, tmp_path / "cold" / source.name)
        cold[source] = _pdf_pages_text(prepared.document)
    _configure(engine_dir, max_conversions=10)
    hosts: list[int | None] = []
    sockets: set[str] = set()
    for i in range(50):
        source, media_type = variants[i % len(variants)]
        copy = tmp_path / "warm-in" / f"{i}{source.suffix}"
        copy.parent.mkdir(exist_ok=True)
        copy.write_bytes(source.read_bytes())
        started = engines.host_pgid()
        prepared = _convert(copy, media_type, tmp_path / "warm" / str(i))
        sockets.update(engines.host_sockets())
        assert _pdf_pages_text(prepared.document) == cold[source], (i, source.name)
        hosts.append(started)
        if (i + 1) % 10 == 0:
            assert engines.host_pgid() is None  # recycled after its 10th conversion
            assert process_group_members(hosts[-1]) == []
    # One engine per ten documents; each host served exactly ten.
    started_hosts = [h for h in hosts if h is not None]
    assert len(set(started_hosts)) == 5
    assert all(started_hosts.count(h) == 9 for h in set(started_hosts))
    assert len(sockets) >= 2 * 4  # each engine's listener and instance sockets
    assert [s for s in sockets if os.path.exists(s)] == []  # recycled engines left none


def test_hang__killed_within_its_limit__next_document_converts(
    tmp_path, engine_dir, faults_enabled
):
    source = testdocs.make_docx(tmp_path / "a.docx", paragraphs=["Hang here"])
    limits = Limits(page_timeout_s=30, prepare_timeout_s=8)
    _convert(source, DOCX, tmp_path / "w0", limits=limits)  # a warm engine
    pgid = engines.host_pgid()
    assert pgid is not None and len(process_group_members(pgid)) >= 3  # host, soffice, client
    sockets = engines.host_sockets()
    assert sockets and all(os.path.exists(s) for s in sockets)
    started = time.monotonic()
    with pytest.raises(ConversionTimeout):
        _convert(
            source, DOCX, tmp_path / "w1", limits=limits, options={"_test_fault": {"kind": "hang"}}
        )
    assert time.monotonic() - started < 8 + 2
    assert process_group_members(pgid) == []  # the whole group, stopped soffice included
    assert engines.host_pgid() is None
    assert [s for s in sockets if os.path.exists(s)] == []  # its sockets are gone too
    prepared = _convert(source, DOCX, tmp_path / "w2", limits=limits)
    assert "Hang here" in _pdf_pages_text(prepared.document)[0]
    assert engines.host_pgid() not in (None, pgid)


def test_stop_during_conversion__engine_killed__next_document_converts(
    tmp_path, engine_dir, faults_enabled
):
    source = testdocs.make_docx(tmp_path / "a.docx", paragraphs=["Cancelled then back"])
    _convert(source, DOCX, tmp_path / "w0")
    pgid = engines.host_pgid()
    flag = threading.Event()
    threading.Timer(1.0, flag.set).start()
    with pytest.raises(ConversionStopped):
        _convert(
            source,
            DOCX,
            tmp_path / "w1",
            should_stop=flag.is_set,
            options={"_test_fault": {"kind": "hang"}},
        )
    assert process_group_members(pgid) == []
    prepared = _convert(source, DOCX, tmp_path / "w2")
    assert "Cancelled then back" in _pdf_pages_text(prepared.document)[0]


def _sample(name: str, **labels: str) -> float:
    from prometheus_client import REGISTRY

    return REGISTRY.get_sample_value(name, {"engine": "libreoffice", **labels}) or 0.0


def test_above_memory_mark__engine_recycled__metrics_say_why(tmp_path, engine_dir):
    starts = _sample("quire_engine_starts_total")
    by_memory = _sample("quire_engine_recycles_total", reason="memory")
    lives = _sample("quire_engine_conversions_per_life_count")
    _configure(engine_dir, max_rss_bytes=64 * 1024 * 1024)  # below any running soffice
    source = testdocs.make_docx(tmp_path / "a.docx", paragraphs=["Memory mark"])
    _convert(source, DOCX, tmp_path / "w0")
    assert engines.host_pgid() is None
    assert _sample("quire_engine_starts_total") == starts + 1
    assert _sample("quire_engine_recycles_total", reason="memory") == by_memory + 1
    assert _sample("quire_engine_conversions_per_life_count") == lives + 1
    _configure(engine_dir, max_rss_bytes=4 * 1024 * 1024 * 1024)
    _convert(source, DOCX, tmp_path / "w1")
    assert engines.host_pgid() is not None


def test_nothing_of_one_attempt_is_left_for_the_next(tmp_path, engine_dir):
    secret = f"Confidential-{uuid.uuid4().hex}"
    source = testdocs.make_docx(tmp_path / f"{secret}.docx", paragraphs=[secret] * 3)
    workdir = tmp_path / "attempt"
    prepared = _convert(source, DOCX, workdir)
    assert secret in _pdf_pages_text(prepared.document)[0]
    # The attempt's directory holds the PDF only; the engine's directory nothing of the document.
    assert sorted(workdir.rglob("*")) == [prepared.document]
    private = engines.host_private()
    assert private is not None
    engine_root = private / "engine"
    for folder in (private / "in", private / "out", engine_root / "in", engine_root / "out"):
        assert not folder.exists(), folder
    for path in private.rglob("*"):
        if path.is_file():
            data = path.read_bytes()
            assert secret.encode() not in data, path
            assert b"document.docx" not in data, path  # no recent-documents entry
    assert [p for p in (engine_root / "tmp").rglob("*") if p.is_file()] == []


_WORKER = """
import json, os, sys, time
from pathlib import Path
from conversion_jobs.converters import engines
from tests import testdocs
from conversion_jobs.converters.base import DOCX, Limits, PrepareRequest
from conversion_jobs.converters.registry import OfficeConverter
root = Path(sys.argv[1])
engines.configure(engines.EngineSettings(scratch_dir=root / "engines"))
source = testdocs.make_docx(root / "a.docx", paragraphs=["Worker " + str(os.getpid())])
def convert(name, options=None):
    (root / name).mkdir()
    return OfficeConverter().prepare(PrepareRequest(source=source, media_type=DOCX,
        workdir=root / name, limits=Limits(prepare_timeout_s=60), should_stop=lambda: False,
        options=options))
convert("w0")
print(json.dumps({"pgid": engines.host_pgid(), "sockets": engines.host_sockets()}), flush=True)
sys.stdin.readline()
convert("w1", {"_test_fault": {"kind": "hang"}})
"""


def _start_worker(root: Path) -> tuple[subprocess.Popen, dict]:
    root.mkdir(parents=True)
    proc = subprocess.Popen(
        [sys.executable, "-c", _WORKER, str(root)],
        env={**os.environ, "PYTHONPATH": str(REPO), "QUIRE_ENABLE_TEST_FAULTS": "1"},
        stdin=subprocess.PIPE,
        stdout=subprocess.PIPE,
    )
    assert proc.stdout is not None
    return proc, json.loads(proc.stdout.readline())


def test_two_worker_processes__own_engines__kill_9_leaves_no_soffice(tmp_path):
    first, one = _start_worker(tmp_path / "one")
    second, two = _start_worker(tmp_path / "two")
    try:
        assert one["pgid"] != two["pgid"]
        assert set(one["sockets"]).isdisjoint(two["sockets"])
        assert len(process_group_members(one["pgid"])) >= 3
        assert len(process_group_members(two["pgid"])) >= 3
        assert first.stdin is not None
        first.stdin.write(b"go\n")  # the first worker is now mid-conversion (a hung LibreOffice)
        first.stdin.flush()
        time.sleep(1.0)
        first.send_signal(signal.SIGKILL)
        first.wait()
        give_up = time.monotonic() + 5
        while process_group_members(one["pgid"]) and time.monotonic() < give_up:
            time.sleep(0.05)
        assert process_group_members(one["pgid"]) == []  # no soffice, no client, no host
        assert [s for s in one["sockets"] if os.path.exists(s)] == []  # no socket either
        assert len(process_group_members(two["pgid"])) >= 3  # the other worker's engine lives on
    finally:
        for proc in (first, second):
            proc.kill()
            proc.wait()
    give_up = time.monotonic() + 5
    while process_group_members(two["pgid"]) and time.monotonic() < give_up:
        time.sleep(0.05)
    assert process_group_members(two["pgid"]) == []
