"""Build the final result from page artifacts. Runs in the worker on our own artifacts only."""

from __future__ import annotations

import shutil
import zipfile
from pathlib import Path

from .base import PDF, TEXT_PLAIN, ZIP
from .sniff import sniff_media_type


def assemble_result(
    *,
    output: str,
    pages: list[tuple[int, Path | bytes]],
    dest: Path,
    prepared_document: Path | None,
) -> str:
    """Write the result to ``dest`` and return its media type. A page is its artifact's path, or
    its bytes (a text page stored inline in its checkpoint row).

    text -> UTF-8 pages joined by form feed in page order; png -> ZIP of page-0001.png ...;
    pdf -> LibreOffice's PDF (only the selected pages if a subset) when ``prepared_document``
    is a PDF, else the page PDFs merged in page order.
    """
    ordered = sorted(pages, key=lambda item: item[0])
    dest = Path(dest)
    if output == "text":
        with open(dest, "w", encoding="utf-8", newline="") as out:
            for index, (_page, artifact) in enumerate(ordered):
                if index:
                    out.write("\f")
                if isinstance(artifact, bytes):
                    out.write(artifact.decode("utf-8"))
                else:
                    out.write(Path(artifact).read_text(encoding="utf-8"))
        return TEXT_PLAIN
    files = [(page, artifact) for page, artifact in ordered if isinstance(artifact, Path)]
    if len(files) != len(ordered):
        raise ValueError(f"{output} pages are files")
    if output == "png":
        # PNG is already compressed; storing avoids burning CPU for nothing.
        with zipfile.ZipFile(dest, "w", compression=zipfile.ZIP_STORED, allowZip64=True) as zf:
            for page, path in files:
                zf.write(path, arcname=f"page-{page:04d}.png")
        return ZIP
    if output == "pdf":
        _assemble_pdf(files, dest, prepared_document)
        return PDF
    raise ValueError(f"unknown output {output!r}")


def _assemble_pdf(
    ordered: list[tuple[int, Path]], dest: Path, prepared_document: Path | None
) -> None:
    from pypdf import PdfReader, PdfWriter

    if prepared_document is not None and sniff_media_type(Path(prepared_document)) == PDF:
        reader = PdfReader(prepared_document)
        numbers = [page for page, _path in ordered]
        if numbers == list(range(1, len(reader.pages) + 1)):
            shutil.copyfile(prepared_document, dest)
            return
        writer = PdfWriter()
        for page in numbers:
            writer.add_page(reader.pages[page - 1])
    else:
        writer = PdfWriter()
        for _page, path in ordered:
            writer.append(str(path))
    with open(dest, "wb") as out:
        writer.write(out)
