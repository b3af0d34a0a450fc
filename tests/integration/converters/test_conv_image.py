import pypdfium2 as pdfium
from convhelpers import convert_all
from PIL import Image

from conversion_jobs.converters import assemble_result
from tests import testdocs


def test_png_to_png__same_pixels(tmp_path):
    source = testdocs.make_png(tmp_path / "in.png", width=321, height=123, text="Hi")
    _prepared, [artifact] = convert_all(source, tmp_path, output="png")
    with Image.open(artifact.path) as out, Image.open(source) as original:
        assert out.size == (321, 123)
        assert out.convert("RGB").tobytes() == original.convert("RGB").tobytes()


def test_tiff_to_png__one_page_per_frame(tmp_path):
    sizes = [(200, 80), (240, 90), (260, 100), (280, 110)]
    source = testdocs.make_tiff(tmp_path / "in.tiff", sizes=sizes)
    prepared, artifacts = convert_all(source, tmp_path, output="png")
    assert prepared.page_count == 4
    for artifact, size in zip(artifacts, sizes, strict=True):
        with Image.open(artifact.path) as image:
            assert image.size == size


def test_tiff_to_pdf__page_count_and_pixel_size_kept(tmp_path):
    sizes = [(200, 80), (240, 90), (260, 100)]
    source = testdocs.make_tiff(tmp_path / "in.tiff", sizes=sizes)
    prepared, artifacts = convert_all(source, tmp_path, output="pdf")
    dest = tmp_path / "result.pdf"
    media_type = assemble_result(
        output="pdf",
        pages=[(n, a.path) for n, a in enumerate(artifacts, start=1)],
        dest=dest,
        prepared_document=prepared.document,
    )
    assert media_type == "application/pdf"
    doc = pdfium.PdfDocument(str(dest))
    assert [tuple(round(v) for v in doc.get_page_size(i)) for i in range(len(doc))] == sizes


def test_jpeg_to_pdf__pixel_size_is_page_size(tmp_path):
    source = testdocs.make_jpeg(tmp_path / "in.jpg", width=640, height=480)
    _prepared, [artifact] = convert_all(source, tmp_path, output="pdf")
    doc = pdfium.PdfDocument(str(artifact.path))
    assert len(doc) == 1
    assert doc.get_page_size(0) == (640, 480)


def test_rgba_and_palette_png_to_pdf(tmp_path):
    rgba = tmp_path / "rgba.png"
    Image.new("RGBA", (50, 40), (255, 0, 0, 128)).save(rgba)
    palette = tmp_path / "p.png"
    Image.new("RGB", (30, 20), "blue").convert("P").save(palette)
    for source in (rgba, palette):
        _prepared, [artifact] = convert_all(source, tmp_path / source.stem, output="pdf")
        doc = pdfium.PdfDocument(str(artifact.path))
        assert doc.get_page_size(0) == Image.open(source).size


def test_png_ocr__large_clear_text(tmp_path):
    source = testdocs.make_png(
        tmp_path / "ocr.png",
        width=1400,
        height=260,
        text="QUIRE CONVERTS\nHELLO WORLD",
        font_size=72,
    )
    _prepared, [artifact] = convert_all(source, tmp_path, output="text")
    text = artifact.path.read_text(encoding="utf-8")
    for word in ("QUIRE", "CONVERTS", "HELLO", "WORLD"):
        assert word in text
