"""LibreOffice headless conversions (real soffice; the first start may take ~10 s)."""

import pypdfium2 as pdfium
import pytest
from convhelpers import convert_all, never, private_dirs

from conversion_jobs.converters import (
    ConversionError,
    Limits,
    assemble_result,
    converter_for,
    engines,
    release,
)
from conversion_jobs.converters.base import DOCX, PrepareRequest
from tests import testdocs

SLOW_START = Limits(page_timeout_s=30, prepare_timeout_s=120)


def test_docx_to_text__contains_source_text(tmp_path):
    source = testdocs.make_docx(
        tmp_path / "in.docx", paragraphs=["Quire converts documents", "Second paragraph here"]
    )
    prepared, artifacts = convert_all(source, tmp_path, output="text", limits=SLOW_START)
    assert prepared.media_type == "application/pdf"
    assert prepared.document.is_file()
    text = "\f".join(a.path.read_text(encoding="utf-8") for a in artifacts)
    assert "Quire converts documents" in text
    assert "Second paragraph here" in text
    # LibreOffice's PDF was handed out; its profile and the copy of the input went with its
    # child's private directory.
    assert prepared.document.parent == tmp_path and prepared.document.name.startswith("office-")
    assert sorted(p.name for p in tmp_path.iterdir()) == sorted(
        ["in.docx", "pages", prepared.document.name]
    )
    release()  # the PDF's session ends with the attempt: nothing of LibreOffice's run is left
    assert private_dirs(tmp_path) == []


def test_docx_to_pdf__pages_and_subset(tmp_path):
    paragraphs = ["Alpha page", "Bravo page", "Charlie page"]
    source = testdocs.make_docx(
        tmp_path / "in.docx", paragraphs=paragraphs, page_break_after_each=True
    )
    prepared, artifacts = convert_all(source, tmp_path, output="pdf", limits=SLOW_START)
    assert prepared.page_count == 3
    for artifact, word in zip(artifacts, paragraphs, strict=True):
        assert artifact.media_type == "application/pdf"
        page_doc = pdfium.PdfDocument(str(artifact.path))
        assert len(page_doc) == 1
        assert word in page_doc[0].get_textpage().get_text_range()
    full = tmp_path / "full.pdf"
    assemble_result(
        output="pdf",
        pages=[(n, a.path) for n, a in enumerate(artifacts, start=1)],
        dest=full,
        prepared_document=prepared.document,
    )
    assert full.read_bytes() == prepared.document.read_bytes()
    subset = tmp_path / "subset.pdf"
    assemble_result(
        output="pdf",
        pages=[(3, artifacts[2].path), (1, artifacts[0].path)],
        dest=subset,
        prepared_document=prepared.document,
    )
    doc = pdfium.PdfDocument(str(subset))
    texts = [doc[i].get_textpage().get_text_range() for i in range(len(doc))]
    assert len(texts) == 2
    assert "Alpha" in texts[0]
    assert "Charlie" in texts[1]


def test_odt_and_rtf_to_text(tmp_path):
    odt = testdocs.make_odt(tmp_path / "in.odt", paragraphs=["Open document words"])
    rtf = testdocs.make_rtf(tmp_path / "in.rtf", paragraphs=["Rich text words"])
    for source, words in ((odt, "Open document words"), (rtf, "Rich text words")):
        _prepared, artifacts = convert_all(
            source, tmp_path / source.suffix[1:], output="text", limits=SLOW_START
        )
        assert words in artifacts[0].path.read_text(encoding="utf-8")


def test_docx_to_png(tmp_path):
    source = testdocs.make_docx(tmp_path / "in.docx", paragraphs=["Picture this"])
    _prepared, artifacts = convert_all(
        source, tmp_path, output="png", options={"dpi": 50}, limits=SLOW_START
    )
    assert artifacts[0].media_type == "image/png"


@pytest.fixture(params=["warm", "fresh"])
def office_engine(request, tmp_path):
    """The Office path under test: the warm engine (configured as the runner does) or a fresh
    soffice per document."""
    if request.param == "warm":
        engines.configure(engines.EngineSettings(scratch_dir=tmp_path / "engines"))
    yield request.param
    engines.stop("test")
    engines.configure(engines.EngineSettings())


@pytest.mark.parametrize("memory_mb", [300, 380])
def test_libreoffice_out_of_memory_at_the_limit__is_a_crash_not_invalid_input(
    tmp_path, office_engine, memory_mb
):
    """Under the child's RLIMIT_AS, soffice.bin aborts when an allocation fails (the soffice
    script reports status 128 + SIGABRT; here at 300 MB), or catches it and reports that the
    document "could not be loaded" (here at 380 MB, with its address space at the limit). Like
    pdfium past the memory limit, both end ``converter_crashed`` (retryable), never
    ``invalid_input`` (a fault of the document)."""
    source = testdocs.make_docx(tmp_path / "in.docx", paragraphs=["memory"] * 50)
    with pytest.raises(ConversionError) as failed:
        converter_for(DOCX, "text").prepare(
            PrepareRequest(
                source=source,
                media_type=DOCX,
                workdir=tmp_path,
                limits=Limits(memory_bytes=memory_mb * 1_000_000, prepare_timeout_s=60),
                should_stop=never,
            )
        )
    release()
    assert failed.value.code == "converter_crashed", str(failed.value)
    assert failed.value.retryable


def test_a_document_libreoffice_cannot_load__is_invalid_input_after_the_probe_loads(
    tmp_path, office_engine
):
    """A package LibreOffice cannot load, under the ordinary limits (its address space far from
    the limit): the document is at fault (``invalid_input``, final), on both Office paths."""
    import zipfile

    source = tmp_path / "bad.docx"
    with zipfile.ZipFile(source, "w") as zf:
        zf.writestr("[Content_Types].xml", "<Types><not-closed>")
        zf.writestr("word/document.xml", "\x00\x01garbage" * 100)
    with pytest.raises(ConversionError) as failed:
        converter_for(DOCX, "text").prepare(
            PrepareRequest(
                source=source,
                media_type=DOCX,
                workdir=tmp_path,
                limits=Limits(prepare_timeout_s=60),
                should_stop=never,
            )
        )
    release()
    assert failed.value.code == "invalid_input", str(failed.value)
    assert not failed.value.retryable
