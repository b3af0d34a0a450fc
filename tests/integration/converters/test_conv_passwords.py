"""Password-protected input (issue 13 point 2) with real pdfium and the real LibreOffice: the
right password opens, a wrong one ends ``invalid_password``, none ends ``encrypted_input``."""

from __future__ import annotations

import subprocess
import uuid
from pathlib import Path

import pytest
from convhelpers import FAST

from conversion_jobs.converters import (
    EncryptedInput,
    InvalidPassword,
    PageRequest,
    engines,
    sniff_media_type,
)
from conversion_jobs.converters.base import DOC, ODT, PrepareRequest
from conversion_jobs.converters.registry import OfficeConverter, PdfConverter
from conversion_jobs.converters.sniff import office_encrypted
from tests import testdocs

HELPER = Path(__file__).with_name("make_encrypted_office.py")
PASSWORD = "correct horse"


def never() -> bool:
    return False


@pytest.fixture(scope="module")
def encrypted_office(tmp_path_factory) -> dict:
    """An encrypted ODT and an encrypted Word 97 .doc, saved by LibreOffice, and their text."""
    root = tmp_path_factory.mktemp("encrypted")
    secret = f"Sealed words {uuid.uuid4().hex}"
    plain = testdocs.make_docx(root / "plain.docx", paragraphs=[secret])
    subprocess.run(
        ["/usr/bin/python3", str(HELPER), str(plain), PASSWORD, str(root / "enc.odt"), "writer8",
         str(root / "enc.doc"), "MS Word 97", str(root / "open.doc"), "MS Word 97!plain"],
        check=True, timeout=180, capture_output=True,
    )  # fmt: skip
    return {"secret": secret, "odt": root / "enc.odt", "doc": root / "enc.doc", "plain": plain}


@pytest.fixture(params=["warm", "fresh"])
def engine_mode(request, tmp_path):
    engines.configure(engines.EngineSettings(mode=request.param, scratch_dir=tmp_path / "eng"))
    yield request.param
    engines.stop("test")
    engines.configure(engines.EngineSettings())


def _pdf_text(path: Path) -> str:
    import pypdfium2 as pdfium

    doc = pdfium.PdfDocument(str(path))
    try:
        return "".join(doc[i].get_textpage().get_text_range() for i in range(len(doc)))
    finally:
        doc.close()


def test_encrypted_pdf__password_opens__wrong_or_none_refused(tmp_path):
    source = testdocs.make_encrypted_pdf(tmp_path / "enc.pdf", pages=2, password=PASSWORD)
    converter = PdfConverter()

    def prepare(workdir: str, options):
        return converter.prepare(
            PrepareRequest(
                source=source,
                media_type="application/pdf",
                workdir=tmp_path / workdir,
                limits=FAST,
                should_stop=never,
                options=options,
            )
        )

    with pytest.raises(EncryptedInput):
        prepare("none", {})
    with pytest.raises(InvalidPassword):
        prepare("wrong", {"password": "not it"})
    options = {"password": PASSWORD}
    prepared = prepare("right", options)
    assert prepared.page_count == 2
    # Pages open the document again in a fresh child if needed: the password goes along.
    artifact = converter.convert_page(
        PageRequest(
            prepared=prepared,
            output="text",
            options=options,
            dest_dir=tmp_path / "pages",
            limits=FAST,
            should_stop=never,
        ),
        page=2,
    )
    assert artifact.path.read_text(encoding="utf-8").strip()


def test_office_encryption_is_detected_before_libreoffice(encrypted_office):
    assert office_encrypted(encrypted_office["odt"]) is True
    assert office_encrypted(encrypted_office["doc"]) is True
    assert office_encrypted(encrypted_office["plain"]) is False
    assert office_encrypted(encrypted_office["doc"].with_name("open.doc")) is False
    assert sniff_media_type(encrypted_office["odt"]) == ODT
    assert sniff_media_type(encrypted_office["doc"]) == DOC


@pytest.mark.parametrize("kind", ["odt", "doc"])
def test_encrypted_office__password_opens__wrong_or_none_refused(
    tmp_path, encrypted_office, engine_mode, kind
):
    source, media_type = encrypted_office[kind], {"odt": ODT, "doc": DOC}[kind]

    def prepare(workdir: str, options):
        (tmp_path / workdir).mkdir()
        return OfficeConverter().prepare(
            PrepareRequest(
                source=source,
                media_type=media_type,
                workdir=tmp_path / workdir,
                limits=FAST,
                should_stop=never,
                options=options,
            )
        )

    with pytest.raises(EncryptedInput):
        prepare("none", {})
    with pytest.raises(InvalidPassword):
        prepare("wrong", {"password": "not it"})
    prepared = prepare("right", {"password": PASSWORD})
    assert encrypted_office["secret"] in _pdf_text(prepared.document)
