import pytest

from conversion_jobs.converters import (
    OUTPUTS,
    ConversionError,
    ConverterCrashed,
    EncryptedInput,
    InputTooLarge,
    Limits,
    UnsupportedConversion,
    capabilities,
    converter_for,
    limits_description,
)
from conversion_jobs.converters.base import DOCX, IMAGE_TYPES, OFFICE_TYPES, PDF, PNG
from conversion_jobs.converters.errors import error_from_code
from conversion_jobs.converters.pdfops import render_size


def test_capabilities__installed_machine():
    caps = capabilities()
    assert caps[PDF] == ["text", "png"]
    for media_type in IMAGE_TYPES | OFFICE_TYPES:
        assert caps[media_type] == list(OUTPUTS)  # tesseract and soffice are installed here


def test_converter_for__pdf_to_pdf_is_unsupported():
    with pytest.raises(UnsupportedConversion) as info:
        converter_for(PDF, "pdf")
    assert info.value.code == "unsupported_conversion"
    assert not info.value.retryable


@pytest.mark.parametrize(
    ("media_type", "output"), [(None, "text"), ("text/html", "png"), (PNG, "docx")]
)
def test_converter_for__unknown_is_unsupported(media_type, output):
    with pytest.raises(UnsupportedConversion):
        converter_for(media_type, output)


@pytest.mark.parametrize(
    ("media_type", "output", "name"),
    [(PDF, "png", "pdfium"), (PNG, "text", "image"), (DOCX, "pdf", "libreoffice")],
)
def test_converter_for__picks_converter(media_type, output, name):
    converter = converter_for(media_type, output)
    assert converter.name == name
    assert media_type in converter.media_types
    assert converter.available()


def test_errors__codes_and_retryability():
    assert (EncryptedInput().code, EncryptedInput().retryable) == ("encrypted_input", False)
    assert (ConverterCrashed().code, ConverterCrashed().retryable) == ("converter_crashed", True)
    assert isinstance(error_from_code("input_too_large", "x"), InputTooLarge)
    unknown = error_from_code("no_such_code")
    assert isinstance(unknown, ConverterCrashed)
    assert isinstance(unknown, ConversionError)


def test_limits_description__has_all_limits():
    description = limits_description(Limits(max_pages=7))
    assert description["max_pages"] == 7
    assert {"max_pixels", "page_timeout_s", "prepare_timeout_s", "memory_bytes", "max_dpi"} <= set(
        description
    )


@pytest.mark.parametrize(
    ("size_pt", "dpi", "expected"),
    [((612, 792), 72, (612, 792)), ((595, 842), 100, (826, 1169)), ((595, 842), 150, (1240, 1754))],
)
def test_render_size__rounds_points_at_dpi(size_pt, dpi, expected):
    assert render_size(*size_pt, dpi, 40_000_000) == expected


def test_render_size__shrinks_to_max_pixels():
    width, height = render_size(612, 792, 600, 1_000_000)
    assert width * height <= 1_000_000
    assert abs(width / height - 612 / 792) < 0.01
