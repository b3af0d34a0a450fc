"""Office containers with the real converter children and the real LibreOffice (issue 22 point
6): a zip bomb, honest or with lying headers, is refused by the child's container check before
any LibreOffice reads it (a warm engine is not even started for it), and a PDF that lost all of
a document's text fails ``conversion_lost_content`` while a picture-only document converts."""

from __future__ import annotations

import pypdfium2 as pdfium
import pytest
from convhelpers import Stopwatch, never, private_dirs

from conversion_jobs.converters import InputTooLarge, InvalidInput, Limits, engines
from conversion_jobs.converters.base import DOCX, PrepareRequest
from conversion_jobs.converters.errors import ConversionLostContent
from conversion_jobs.converters.registry import OfficeConverter
from tests import testdocs

pytestmark = pytest.mark.engine

LIMITS = Limits(page_timeout_s=30, prepare_timeout_s=120)

HOSTILE = [
    pytest.param(testdocs.make_docx_bomb, InputTooLarge, "declares", id="gib-bomb"),
    pytest.param(
        lambda path: testdocs.make_docx_bomb(path, declared=4096),
        InvalidInput,
        "inflates past its declared size",
        id="lying-headers",
    ),
]


def _prepare(source, workdir):
    workdir.mkdir(parents=True, exist_ok=True)
    return OfficeConverter().prepare(
        PrepareRequest(
            source=source, media_type=DOCX, workdir=workdir, limits=LIMITS, should_stop=never
        )
    )


def _text(path) -> str:
    doc = pdfium.PdfDocument(str(path))
    try:
        return "".join(doc[i].get_textpage().get_text_range() for i in range(len(doc)))
    finally:
        doc.close()


@pytest.fixture
def engine_dir(tmp_path):
    root = tmp_path / "engines"
    engines.configure(engines.EngineSettings(scratch_dir=root))
    yield root
    engines.stop("test")
    engines.configure(engines.EngineSettings())


@pytest.mark.parametrize(("make", "error", "detail"), HOSTILE)
def test_office_bomb__fresh_libreoffice__refused_by_the_child_first(tmp_path, make, error, detail):
    source = make(tmp_path / "bomb.docx")
    assert source.stat().st_size < 2 << 20
    with Stopwatch() as watch, pytest.raises(error, match=detail) as info:
        _prepare(source, tmp_path / "attempt")
    assert not info.value.retryable
    # The container check answers before LibreOffice would start (several seconds here).
    assert watch.elapsed < 5
    assert private_dirs(tmp_path / "attempt") == []


def test_office_bomb__warm_engine__never_started_for_it_and_kept(tmp_path, engine_dir):
    for index, (make, error, detail) in enumerate(p.values for p in HOSTILE):
        with pytest.raises(error, match=detail):
            _prepare(make(tmp_path / f"bomb-{index}.docx"), tmp_path / f"a{index}")
        # The host's Python refused it; no LibreOffice was started to read it.
        assert engines.host_pgid() is not None
        assert not engines.host_engine_started()
    pgid = engines.host_pgid()
    words = "Words after the bombs"
    prepared = _prepare(
        testdocs.make_docx(tmp_path / "ok.docx", paragraphs=[words]), tmp_path / "ok"
    )
    assert words in _text(prepared.document)
    assert (engines.host_pgid(), engines.host_conversions()) == (pgid, 1)
    assert engines.host_engine_started()


def test_office_engine_lost_all_text__conversion_lost_content(tmp_path):
    source = testdocs.make_docx_unknown_root(tmp_path / "lost.docx", paragraphs=["Lost words"])
    with pytest.raises(ConversionLostContent) as info:
        _prepare(source, tmp_path / "attempt")
    assert (info.value.code, info.value.retryable) == ("conversion_lost_content", False)


def test_office_picture_only__converts_without_text(tmp_path):
    prepared = _prepare(testdocs.make_docx_image_only(tmp_path / "pic.docx"), tmp_path / "a")
    assert prepared.page_count == 1
    assert _text(prepared.document).strip() == ""
