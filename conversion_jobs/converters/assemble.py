"""Build the final result from page artifacts. Runs in the worker on our own artifacts only."""

from __future__ import annotations

import hashlib
import shutil
from collections.abc import Iterator
from pathlib import Path

from .base import PDF, TEXT_PLAIN
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

    text -> UTF-8 pages joined by form feed in page order (:func:`join_text_pages`); pdf ->
    LibreOffice's PDF (only the selected pages if a subset) when ``prepared_document`` is a PDF,
    else the page PDFs merged in page order. (A png result is never assembled: it is the ZIP of
    its page objects, ``zipstream``.)
    """
    ordered = sorted(pages, key=lambda item: item[0])
    dest = Path(dest)
    if output == "text":
        with open(dest, "wb") as out:
            for chunk in join_text_pages(
                [(page, a if isinstance(a, bytes) else Path(a).read_bytes()) for page, a in ordered]
            ):
                out.write(chunk)
        return TEXT_PLAIN
    files = [(page, artifact) for page, artifact in ordered if isinstance(artifact, Path)]
    if len(files) != len(ordered):
        raise ValueError(f"{output} pages are files")
    if output == "pdf":
        _assemble_pdf(files, dest, prepared_document)
        return PDF
    raise ValueError(f"unknown output {output!r}")


def inline_text_result(*, pages: list[tuple[int, bytes]]) -> tuple[str, str, int]:
    """Media type, sha256 and size of the text result ``assemble_result`` would write from
    these inline pages, without writing it (the bytes are :func:`join_text_pages`'s)."""
    digest, size = hashlib.sha256(), 0
    for chunk in join_text_pages(pages):
        digest.update(chunk)
        size += len(chunk)
    return TEXT_PLAIN, digest.hexdigest(), size


def join_text_pages(pages: list[tuple[int, bytes]]) -> Iterator[bytes]:
    """The text result of these pages, chunk by chunk: each page's UTF-8 (checked, as
    ``assemble_result`` decodes it) in page order, a form feed between two pages."""
    for index, (_page, content) in enumerate(sorted(pages, key=lambda item: item[0])):
        if index:
            yield b"\f"
        content.decode("utf-8")  # a page that is not UTF-8 fails here as in assemble_result
        yield content


def _assemble_pdf(
    ordered: list[tuple[int, Path]], dest: Path, prepared_document: Path | None
) -> None:
    # (function-level: pypdf costs ~0.2 s to import; only a PDF result's assembly needs it)
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
