"""Generators of test documents with known content, and of hostile inputs.

Used by the converter tests, e2e tests and benchmarks. Every function takes the target path
and keyword-only parameters, writes the file and returns the path. No Django, no network.

Text in generated PDFs round-trips exactly through pypdfium2 text extraction (and the ``text``
output): lines are joined by "\\n"; keep to printable ASCII.
"""

from __future__ import annotations

import io
import zipfile
from collections.abc import Callable
from pathlib import Path

from PIL import Image, ImageDraw, ImageFont


def default_page_text(n: int) -> str:
    return f"Page {n} of the Quire test document"


# -- PDF ------------------------------------------------------------------------------------------


def _pdf_string(text: str) -> bytes:
    raw = text.encode("cp1252")
    return b"(" + raw.replace(b"\\", b"\\\\").replace(b"(", b"\\(").replace(b")", b"\\)") + b")"


def _content_stream(text: str, height: float) -> bytes:
    lines = text.split("\n")
    parts = [b"BT /F1 12 Tf 14 TL 36 %.2f Td" % (height - 48)]
    for index, line in enumerate(lines):
        if index:
            parts.append(b"T*")
        parts.append(_pdf_string(line) + b" Tj")
    parts.append(b"ET")
    return b"\n".join(parts)


def pdf_bytes(
    *,
    pages: int,
    text_of: Callable[[int], str] = default_page_text,
    page_size: tuple[float, float] = (612, 792),
) -> bytes:
    """A minimal valid PDF (Helvetica, WinAnsi). The catalog and page tree are written last,
    as streaming writers do, so a truncated copy has no document catalog."""
    width, height = page_size
    objects: dict[int, bytes] = {}
    font = 3
    objects[font] = (
        b"<< /Type /Font /Subtype /Type1 /BaseFont /Helvetica /Encoding /WinAnsiEncoding >>"
    )
    kids = []
    for n in range(1, pages + 1):
        page_obj, content_obj = 2 + 2 * n, 3 + 2 * n
        stream = _content_stream(text_of(n), height)
        objects[content_obj] = b"<< /Length %d >>\nstream\n" % len(stream) + stream + b"\nendstream"
        objects[page_obj] = (
            b"<< /Type /Page /Parent 2 0 R /MediaBox [0 0 %s %s] "
            b"/Resources << /Font << /F1 %d 0 R >> >> /Contents %d 0 R >>"
            % (_num(width), _num(height), font, content_obj)
        )
        kids.append(b"%d 0 R" % page_obj)
    objects[2] = b"<< /Type /Pages /Kids [%s] /Count %d >>" % (b" ".join(kids), pages)
    objects[1] = b"<< /Type /Catalog /Pages 2 0 R >>"
    order = [font, *sorted(k for k in objects if k > font), 2, 1]
    out = io.BytesIO()
    out.write(b"%PDF-1.7\n%\xe2\xe3\xcf\xd3\n")
    offsets = {}
    for number in order:
        offsets[number] = out.tell()
        out.write(b"%d 0 obj\n" % number + objects[number] + b"\nendobj\n")
    xref = out.tell()
    size = max(objects) + 1
    out.write(b"xref\n0 %d\n0000000000 65535 f \n" % size)
    for number in range(1, size):
        out.write(b"%010d 00000 n \n" % offsets[number])
    out.write(b"trailer\n<< /Size %d /Root 1 0 R >>\nstartxref\n%d\n%%%%EOF\n" % (size, xref))
    return out.getvalue()


def _num(value: float) -> bytes:
    return (b"%d" % value) if float(value).is_integer() else (b"%.4f" % value)


def make_pdf(
    path: Path,
    *,
    pages: int,
    text_of: Callable[[int], str] = default_page_text,
    page_size: tuple[float, float] = (612, 792),
) -> Path:
    """A ``pages``-page PDF whose page n carries exactly ``text_of(n)``; size in points."""
    Path(path).write_bytes(pdf_bytes(pages=pages, text_of=text_of, page_size=page_size))
    return Path(path)


# -- images ---------------------------------------------------------------------------------------


def _font(size: int) -> ImageFont.ImageFont | ImageFont.FreeTypeFont:
    for candidate in (
        "/usr/share/fonts/truetype/dejavu/DejaVuSans-Bold.ttf",
        "/usr/share/fonts/truetype/dejavu/DejaVuSans.ttf",
    ):
        if Path(candidate).exists():
            return ImageFont.truetype(candidate, size)
    return ImageFont.load_default(size=size)


def image(*, width: int, height: int, text: str | None = None, font_size: int = 48) -> Image.Image:
    """A white RGB image with ``text`` in large black letters (good for OCR)."""
    img = Image.new("RGB", (width, height), "white")
    if text:
        draw = ImageDraw.Draw(img)
        draw.multiline_text(
            (font_size // 2, font_size // 2),
            text,
            fill="black",
            font=_font(font_size),
            spacing=font_size // 2,
        )
    return img


def make_png(
    path: Path, *, width: int = 800, height: int = 200, text: str | None = None, font_size: int = 48
) -> Path:
    image(width=width, height=height, text=text, font_size=font_size).save(path, format="PNG")
    return Path(path)


def make_jpeg(
    path: Path, *, width: int = 800, height: int = 200, text: str | None = None, font_size: int = 48
) -> Path:
    image(width=width, height=height, text=text, font_size=font_size).save(
        path, format="JPEG", quality=92
    )
    return Path(path)


def make_tiff(
    path: Path,
    *,
    sizes: list[tuple[int, int]] | None = None,
    frames: int = 3,
    text_of: Callable[[int], str] | None = None,
) -> Path:
    """A multi-page TIFF; frame n (1-based) has ``sizes[n-1]`` (default 300x100 + n*10 wide)."""
    sizes = sizes or [(300 + n * 10, 100) for n in range(1, frames + 1)]
    images = [
        image(width=w, height=h, text=text_of(n) if text_of else None, font_size=24)
        for n, (w, h) in enumerate(sizes, start=1)
    ]
    images[0].save(
        path, format="TIFF", save_all=True, append_images=images[1:], compression="tiff_deflate"
    )
    return Path(path)


# -- office ---------------------------------------------------------------------------------------


def make_docx(path: Path, *, paragraphs: list[str], page_break_after_each: bool = False) -> Path:
    """A DOCX with one paragraph per string; with ``page_break_after_each`` one page each."""
    import docx

    document = docx.Document()
    for index, paragraph in enumerate(paragraphs):
        document.add_paragraph(paragraph)
        if page_break_after_each and index < len(paragraphs) - 1:
            document.add_page_break()
    document.save(str(path))
    return Path(path)


def make_odt(path: Path, *, paragraphs: list[str]) -> Path:
    """A minimal ODF text document built by hand (no LibreOffice needed)."""
    from xml.sax.saxutils import escape

    body = "".join(f"<text:p>{escape(p)}</text:p>" for p in paragraphs)
    content = (
        '<?xml version="1.0" encoding="UTF-8"?>'
        '<office:document-content xmlns:office="urn:oasis:names:tc:opendocument:xmlns:office:1.0"'
        ' xmlns:text="urn:oasis:names:tc:opendocument:xmlns:text:1.0" office:version="1.2">'
        f"<office:body><office:text>{body}</office:text></office:body></office:document-content>"
    )
    return _odt_package(path, content)


def make_rtf(path: Path, *, paragraphs: list[str]) -> Path:
    body = "".join(
        p.replace("\\", "\\\\").replace("{", "\\{").replace("}", "\\}") + "\\par\n"
        for p in paragraphs
    )
    header = "{\\rtf1\\ansi\\deff0{\\fonttbl{\\f0 Helvetica;}}\\f0\\fs24\n"
    Path(path).write_text(header + body + "}")
    return Path(path)


# -- hostile --------------------------------------------------------------------------------------


def make_encrypted_pdf(path: Path, *, pages: int = 2, password: str = "secret") -> Path:  # noqa: S107
    """Needs a user password to open (expected: encrypted_input)."""
    from pypdf import PdfReader, PdfWriter

    writer = PdfWriter(clone_from=PdfReader(io.BytesIO(pdf_bytes(pages=pages))))
    writer.encrypt(user_password=password, owner_password=password + "-owner", algorithm="RC4-128")
    with open(path, "wb") as fh:
        writer.write(fh)
    return Path(path)


def make_truncated_pdf(path: Path, *, pages: int = 5, keep_fraction: float = 0.5) -> Path:
    """A PDF cut short: no catalog, page tree, xref or trailer (expected: invalid_input)."""
    data = pdf_bytes(pages=pages)
    Path(path).write_bytes(data[: int(len(data) * keep_fraction)])
    return Path(path)


def make_malformed_xref_pdf(path: Path) -> Path:
    """Header and trailer present, but the xref points nowhere and no object is parsable
    (pdfium's repair finds nothing; expected: invalid_input)."""
    Path(path).write_bytes(
        b"%PDF-1.7\n"
        b"1 0 bj << /Type /Catalog /Pages 2 0 R >> endob\n"
        b"2 0 bj << /Type /Pages /Kids [] /Count 1 >> endob\n"
        b"xref\n0 3\n0000000000 65535 f \n0000099999 00000 n \n0000088888 00000 n \n"
        b"trailer\n<< /Size 3 /Root 1 0 R >>\nstartxref\n77777\n%%EOF\n"
    )
    return Path(path)


def make_zero_page_pdf(path: Path) -> Path:
    """A well-formed PDF whose page tree is empty (expected: invalid_input)."""
    data = pdf_bytes(pages=1)
    Path(path).write_bytes(data.replace(b"/Kids [4 0 R] /Count 1", b"/Kids [     ] /Count 0"))
    return Path(path)


def make_wrong_magic(path: Path, *, size: int = 4096) -> Path:
    """Bytes that are no known format, e.g. uploaded as application/pdf (expected:
    sniff None; prepare with a declared type -> invalid_input)."""
    Path(path).write_bytes(b"GIF89a not really" + bytes(range(256)) * (size // 256))
    return Path(path)


def make_png_bomb(path: Path, *, width: int = 100_000, height: int = 100_000) -> Path:
    """A tiny PNG declaring ``width`` x ``height`` pixels (expected: input_too_large)."""
    import struct
    import zlib

    def chunk(kind: bytes, payload: bytes) -> bytes:
        return (
            struct.pack(">I", len(payload))
            + kind
            + payload
            + struct.pack(">I", zlib.crc32(kind + payload) & 0xFFFFFFFF)
        )

    row = b"\x00" + b"\x00" * ((width + 7) // 8)
    compressor = zlib.compressobj(9)
    idat = compressor.compress(row * 16) + compressor.flush()
    Path(path).write_bytes(
        b"\x89PNG\r\n\x1a\n"
        + chunk(b"IHDR", struct.pack(">IIBBBBB", width, height, 1, 0, 0, 0, 0))
        + chunk(b"IDAT", idat)
        + chunk(b"IEND", b"")
    )
    return Path(path)


def _zip_entries(path: Path, entries: list[tuple[str, bytes, int, int]]) -> Path:
    """A ZIP written by hand from (name, raw deflate data, CRC-32, declared size): what a
    hostile tool may write, the local and central headers saying the same."""
    import struct

    body, central = bytearray(), bytearray()
    for name, raw, crc, size in entries:
        encoded = name.encode()
        fields = struct.pack("<HHHHHIII", 20, 0, 8, 0, 0x21, crc, len(raw), size)
        offset = len(body)
        body += b"PK\x03\x04" + fields + struct.pack("<HH", len(encoded), 0) + encoded + raw
        central += (
            b"PK\x01\x02"
            + struct.pack("<H", 20)
            + fields
            + struct.pack("<HHHHHII", len(encoded), 0, 0, 0, 0, 0, offset)
            + encoded
        )
    end = struct.pack("<4sHHHHIIH", b"PK\x05\x06", 0, 0, len(entries), len(entries),
                      len(central), len(body), 0)  # fmt: skip
    Path(path).write_bytes(bytes(body + central) + end)
    return Path(path)


def _deflated(data: bytes) -> bytes:
    import zlib

    compressor = zlib.compressobj(9, zlib.DEFLATED, -zlib.MAX_WBITS)
    return compressor.compress(data) + compressor.flush()


def make_docx_bomb(path: Path, *, inflated: int = 1 << 30, declared: int | None = None) -> Path:
    """A DOCX whose ``word/document.xml`` is one ``<w:t>`` run of about ``inflated`` bytes of
    "A" (1 GiB by default: about 1 MB on disk; expected: input_too_large). Built in a second or
    two: each MiB of "A" is one independent deflate segment (a full flush resets the history),
    compressed once and repeated. ``declared``: the headers lie, giving that size (and the
    CRC-32 of that many first bytes, so a reader trusting them sees a consistent short part);
    expected: invalid_input. The other parts are a real DOCX's (python-docx)."""
    import zlib

    plain = make_docx(Path(path).with_suffix(".plain.docx"), paragraphs=["plain"])
    with zipfile.ZipFile(plain) as zf:
        parts = [
            (i.filename, zf.read(i)) for i in zf.infolist() if i.filename != "word/document.xml"
        ]
    plain.unlink()
    head = (
        b'<?xml version="1.0" encoding="UTF-8" standalone="yes"?>'
        b'<w:document xmlns:w="http://schemas.openxmlformats.org/wordprocessingml/2006/main">'
        b"<w:body><w:p><w:r><w:t>"
    )
    tail = b"</w:t></w:r></w:p></w:body></w:document>"
    block = b"A" * (1 << 20)
    blocks = max(1, inflated // len(block))
    compressor = zlib.compressobj(9, zlib.DEFLATED, -zlib.MAX_WBITS)
    first = compressor.compress(head) + compressor.flush(zlib.Z_FULL_FLUSH)
    segment = compressor.compress(block) + compressor.flush(zlib.Z_FULL_FLUSH)
    last = compressor.compress(tail) + compressor.flush()
    raw = first + segment * blocks + last
    size = len(head) + blocks * len(block) + len(tail)
    if declared is None:
        crc = zlib.crc32(head)
        for _ in range(blocks):
            crc = zlib.crc32(block, crc)
        crc, declared = zlib.crc32(tail, crc), size
    else:
        prefix = (head + block)[:declared]
        crc = zlib.crc32(prefix + b"A" * (declared - len(prefix)))
    entries = [(name, _deflated(data), zlib.crc32(data), len(data)) for name, data in parts]
    entries.append(("word/document.xml", raw, crc, declared))
    return _zip_entries(path, entries)


def make_docx_unknown_root(path: Path, *, paragraphs: list[str]) -> Path:
    """A DOCX whose ``word/document.xml`` has its text under a root element Word does not
    know (``w:documentx``): LibreOffice imports nothing of it and stores a blank page, the text
    is lost (expected: conversion_lost_content)."""
    plain = make_docx(Path(path).with_suffix(".plain.docx"), paragraphs=paragraphs)
    with zipfile.ZipFile(plain) as zin, zipfile.ZipFile(path, "w", zipfile.ZIP_DEFLATED) as zout:
        for info in zin.infolist():
            data = zin.read(info)
            if info.filename == "word/document.xml":
                data = data.replace(b"<w:document ", b"<w:documentx ", 1)
                data = data.replace(b"</w:document>", b"</w:documentx>", 1)
            zout.writestr(info.filename, data)
    plain.unlink()
    return Path(path)


def make_docx_image_only(path: Path) -> Path:
    """A DOCX with one picture and no text (its PDF has no text, and must not need any)."""
    import docx

    picture = make_png(Path(path).with_suffix(".png"), width=400, height=200)
    document = docx.Document()
    document.add_picture(str(picture))
    document.save(str(path))
    picture.unlink()
    return Path(path)


def make_huge_page_pdf(
    path: Path, *, width_pt: float = 200_000, height_pt: float = 200_000
) -> Path:
    """A one-page PDF with an absurd MediaBox (expected: input_too_large)."""
    return make_pdf(path, pages=1, page_size=(width_pt, height_pt))


def make_zip_as_pdf(path: Path) -> Path:
    """A plain ZIP (e.g. uploaded as application/pdf; expected: sniff None -> invalid_input)."""
    with zipfile.ZipFile(path, "w") as zf:
        zf.writestr("document.pdf", pdf_bytes(pages=1))
        zf.writestr("readme.txt", "not a PDF")
    return Path(path)


# -- documents that link to outside content (issue 10: sandbox tests) -----------------------------


def make_rtf_includepicture(path: Path, *, target: str, text: str = "linked picture") -> Path:
    """An RTF whose INCLUDEPICTURE field asks the reader to load ``target`` (a path or URL)."""
    escaped = target.replace("\\", "\\\\")
    field = (
        '{\\field{\\*\\fldinst { INCLUDEPICTURE "' + escaped + '" \\\\* MERGEFORMAT }}{\\fldrslt }}'
    )
    header = "{\\rtf1\\ansi\\deff0{\\fonttbl{\\f0 Helvetica;}}\\f0\\fs24\n"
    Path(path).write_text(header + text + "\\par\n" + field + "\\par\n}")
    return Path(path)


def make_docx_linked_image(path: Path, *, target: str, text: str = "linked picture") -> Path:
    """A DOCX with an image that is not embedded but linked (``a:blip r:link``) to ``target``
    (``file:///…`` or ``http://…``), as Word writes "Link to File"."""
    import docx
    from docx.opc.constants import RELATIONSHIP_TYPE as RT

    document = docx.Document()
    document.add_paragraph(text)
    part = document.part
    rel_id = part.relate_to(target, RT.IMAGE, is_external=True)
    drawing = (
        '<w:r xmlns:w="http://schemas.openxmlformats.org/wordprocessingml/2006/main"'
        ' xmlns:wp="http://schemas.openxmlformats.org/drawingml/2006/wordprocessingDrawing"'
        ' xmlns:a="http://schemas.openxmlformats.org/drawingml/2006/main"'
        ' xmlns:pic="http://schemas.openxmlformats.org/drawingml/2006/picture"'
        ' xmlns:r="http://schemas.openxmlformats.org/officeDocument/2006/relationships">'
        '<w:drawing><wp:inline><wp:extent cx="3000000" cy="3000000"/><wp:docPr id="1" name="p"/>'
        '<a:graphic><a:graphicData uri="http://schemas.openxmlformats.org/drawingml/2006/picture">'
        '<pic:pic><pic:nvPicPr><pic:cNvPr id="1" name="p"/><pic:cNvPicPr/></pic:nvPicPr>'
        f'<pic:blipFill><a:blip r:link="{rel_id}"/><a:stretch><a:fillRect/></a:stretch>'
        '</pic:blipFill><pic:spPr><a:xfrm><a:off x="0" y="0"/><a:ext cx="3000000" cy="3000000"/>'
        '</a:xfrm><a:prstGeom prst="rect"><a:avLst/></a:prstGeom></pic:spPr></pic:pic>'
        "</a:graphicData></a:graphic></wp:inline></w:drawing></w:r>"
    )
    from docx.oxml import parse_xml

    document.add_paragraph()._p.append(parse_xml(drawing))
    document.save(str(path))
    return Path(path)


def make_odt_linked_image(path: Path, *, target: str, text: str = "linked picture") -> Path:
    """An ODT with a ``draw:image`` whose ``xlink:href`` points at ``target`` (not embedded)."""
    from xml.sax.saxutils import escape, quoteattr

    content = (
        '<?xml version="1.0" encoding="UTF-8"?>'
        '<office:document-content xmlns:office="urn:oasis:names:tc:opendocument:xmlns:office:1.0"'
        ' xmlns:text="urn:oasis:names:tc:opendocument:xmlns:text:1.0"'
        ' xmlns:draw="urn:oasis:names:tc:opendocument:xmlns:drawing:1.0"'
        ' xmlns:xlink="http://www.w3.org/1999/xlink"'
        ' xmlns:svg="urn:oasis:names:tc:opendocument:xmlns:svg-compatible:1.0"'
        ' office:version="1.2"><office:body><office:text>'
        f"<text:p>{escape(text)}"
        '<draw:frame draw:name="p" text:anchor-type="as-char" svg:width="8cm" svg:height="8cm">'
        f'<draw:image xlink:href={quoteattr(target)} xlink:type="simple"'
        ' xlink:show="embed" xlink:actuate="onLoad"/></draw:frame></text:p>'
        "</office:text></office:body></office:document-content>"
    )
    return _odt_package(path, content)


def make_pdf_with_actions(path: Path, *, launch: str, uri: str) -> Path:
    """A one-page PDF whose OpenAction launches ``launch`` and whose page has a /URI link
    annotation to ``uri`` (a reader must never act on either while converting)."""
    body = pdf_bytes(pages=1)
    # Rewrite with pypdf: an OpenAction /Launch and a /URI link annotation on page 1.
    from pypdf import PdfReader, PdfWriter
    from pypdf.generic import (
        ArrayObject,
        DictionaryObject,
        FloatObject,
        NameObject,
        TextStringObject,
    )

    writer = PdfWriter(clone_from=PdfReader(io.BytesIO(body)))
    launch_action = DictionaryObject(
        {
            NameObject("/S"): NameObject("/Launch"),
            NameObject("/F"): TextStringObject(launch),
        }
    )
    writer._root_object[NameObject("/OpenAction")] = writer._add_object(launch_action)
    annotation = DictionaryObject(
        {
            NameObject("/Type"): NameObject("/Annot"),
            NameObject("/Subtype"): NameObject("/Link"),
            NameObject("/Rect"): ArrayObject([FloatObject(v) for v in (36, 36, 300, 300)]),
            NameObject("/A"): DictionaryObject(
                {NameObject("/S"): NameObject("/URI"), NameObject("/URI"): TextStringObject(uri)}
            ),
        }
    )
    writer.pages[0][NameObject("/Annots")] = ArrayObject([writer._add_object(annotation)])
    with open(path, "wb") as fh:
        writer.write(fh)
    return Path(path)


def _odt_package(path: Path, content: str) -> Path:
    """An ODT text document at ``path`` with ``content.xml`` = ``content``: the stored mimetype
    first, then the content and a minimal manifest."""
    manifest = (
        '<?xml version="1.0" encoding="UTF-8"?>'
        '<manifest:manifest xmlns:manifest="urn:oasis:names:tc:opendocument:xmlns:manifest:1.0"'
        ' manifest:version="1.2">'
        '<manifest:file-entry manifest:full-path="/"'
        ' manifest:media-type="application/vnd.oasis.opendocument.text"/>'
        '<manifest:file-entry manifest:full-path="content.xml" manifest:media-type="text/xml"/>'
        "</manifest:manifest>"
    )
    with zipfile.ZipFile(path, "w") as zf:
        zf.writestr(
            zipfile.ZipInfo("mimetype"),
            "application/vnd.oasis.opendocument.text",
            compress_type=zipfile.ZIP_STORED,
        )
        zf.writestr("content.xml", content, compress_type=zipfile.ZIP_DEFLATED)
        zf.writestr("META-INF/manifest.xml", manifest, compress_type=zipfile.ZIP_DEFLATED)
    return Path(path)
