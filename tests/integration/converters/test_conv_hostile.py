"""Hostile input ends in its terminal code, quickly, never in a crash or a hang."""

import pytest
from convhelpers import Stopwatch, convert_all, never

from conversion_jobs.converters import (
    ConversionError,
    EncryptedInput,
    InputTooLarge,
    InvalidInput,
    Limits,
    converter_for,
)
from conversion_jobs.converters.base import DOCX, PDF, PNG, PrepareRequest
from tests import testdocs

LIMITS = Limits(page_timeout_s=10, prepare_timeout_s=10)


def _prepare(source, media_type, workdir, limits=LIMITS):
    converter = converter_for(media_type, "text")
    return converter.prepare(
        PrepareRequest(
            source=source, media_type=media_type, workdir=workdir, limits=limits, should_stop=never
        )
    )


@pytest.mark.parametrize(
    ("make", "media_type", "error"),
    [
        (testdocs.make_encrypted_pdf, PDF, EncryptedInput),
        (testdocs.make_truncated_pdf, PDF, InvalidInput),
        (testdocs.make_malformed_xref_pdf, PDF, InvalidInput),
        (testdocs.make_zero_page_pdf, PDF, InvalidInput),
        (testdocs.make_wrong_magic, PDF, InvalidInput),
        (testdocs.make_zip_as_pdf, PDF, InvalidInput),
        (testdocs.make_huge_page_pdf, PDF, InputTooLarge),
        (testdocs.make_png_bomb, PNG, InputTooLarge),
        (lambda p: testdocs.make_pdf(p, pages=1), PNG, InvalidInput),  # declared PNG, is a PDF
        (lambda p: p.write_bytes(b"\x89PNG\r\n\x1a\n" + b"\x00" * 100), PNG, InvalidInput),
    ],
)
def test_hostile__prepare_ends_in_terminal_code(tmp_path, make, media_type, error):
    source = tmp_path / "upload"
    make(source)
    with Stopwatch() as watch, pytest.raises(error) as info:
        _prepare(source, media_type, tmp_path)
    assert watch.elapsed < 5
    assert not info.value.retryable
    assert info.value.code == error.code
    assert not list(tmp_path.glob(".isolated-*"))  # the child's scratch space is gone


def test_hostile__too_many_pages(tmp_path):
    source = testdocs.make_pdf(tmp_path / "many.pdf", pages=30)
    with pytest.raises(InputTooLarge):
        _prepare(source, PDF, tmp_path, Limits(max_pages=10))


def test_hostile__too_many_tiff_frames(tmp_path):
    source = testdocs.make_tiff(tmp_path / "many.tiff", frames=5)
    with pytest.raises(InputTooLarge):
        _prepare(source, "image/tiff", tmp_path, Limits(max_pages=3))


def test_hostile__image_over_max_pixels(tmp_path):
    source = testdocs.make_png(tmp_path / "big.png", width=1000, height=500)
    with pytest.raises(InputTooLarge):
        _prepare(source, PNG, tmp_path, Limits(max_pixels=100_000))


def test_hostile__tiff_frame_over_max_pixels(tmp_path):
    # The first frame is small; a later frame is over the limit.
    source = testdocs.make_tiff(tmp_path / "t.tiff", sizes=[(10, 10), (1000, 500)])
    with pytest.raises(InputTooLarge):
        _prepare(source, "image/tiff", tmp_path, Limits(max_pixels=100_000))


def test_hostile__corrupt_docx_is_invalid_input(tmp_path):
    import zipfile

    source = tmp_path / "bad.docx"
    with zipfile.ZipFile(source, "w") as zf:
        zf.writestr("[Content_Types].xml", "<Types><not-closed>")
        zf.writestr("word/document.xml", "\x00\x01garbage" * 100)
    with pytest.raises(ConversionError) as info:
        _prepare(source, DOCX, tmp_path, Limits(prepare_timeout_s=60))
    assert info.value.code == "invalid_input"


def test_hostile__large_page_renders_within_pixel_limit(tmp_path):
    # 14 000 pt sides are legal; at 150 dpi they would be 850 megapixels: the scale is reduced.
    source = testdocs.make_pdf(tmp_path / "wide.pdf", pages=1, page_size=(14_000, 14_000))
    limits = Limits(max_pixels=4_000_000, page_timeout_s=20)
    _prepared, [artifact] = convert_all(source, tmp_path, output="png", limits=limits)
    from PIL import Image

    with Image.open(artifact.path) as image:
        assert image.size == (2000, 2000)
