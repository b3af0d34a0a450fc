"""The deterministic PNG-result ZIP: zipfile reads it back, its length is known up front."""

from __future__ import annotations

import io
import zipfile
from contextlib import AbstractContextManager

import pytest

from conversion_jobs.converters import zipstream


def _entries(pages: dict[int, bytes]) -> list[zipstream.Entry]:
    def opener(data: bytes):  # type: ignore[no-untyped-def]
        return lambda: io.BytesIO(data)

    return [zipstream.Entry(page=p, size=len(d), open=opener(d)) for p, d in pages.items()]


def test_zipstream__zipfile_reads_back_the_pages_in_order():
    pages = {1: b"\x89PNG first", 2: b"", 10: b"\x89PNG" + bytes(range(256)) * 5000}
    body = b"".join(zipstream.zip_chunks(_entries(pages)))
    archive = zipfile.ZipFile(io.BytesIO(body))
    assert archive.testzip() is None
    assert archive.namelist() == ["page-0001.png", "page-0002.png", "page-0010.png"]
    assert [archive.read(n) for n in archive.namelist()] == list(pages.values())
    assert {i.compress_type for i in archive.infolist()} == {zipfile.ZIP_STORED}
    assert len(body) == zipstream.zip_length([(p, len(d)) for p, d in pages.items()])


def test_zipstream__output_is_a_pure_function_of_the_pages():
    pages = {1: b"a" * 10, 2: b"b" * 20}
    first = b"".join(zipstream.zip_chunks(_entries(pages)))
    assert first == b"".join(zipstream.zip_chunks(_entries(dict(pages))))
    empty = b"".join(zipstream.zip_chunks([]))
    assert zipfile.ZipFile(io.BytesIO(empty)).namelist() == []
    assert len(empty) == zipstream.zip_length([])


def test_zipstream__zip64_end_records_when_the_entry_count_needs_them():
    pages = {p: bytes([p % 251]) for p in range(1, 65537)}
    body = b"".join(zipstream.zip_chunks(_entries(pages)))
    assert len(body) == zipstream.zip_length([(p, 1) for p in pages])
    archive = zipfile.ZipFile(io.BytesIO(body))
    names = archive.namelist()
    assert len(names) == 65536
    assert archive.read("page-65536.png") == bytes([65536 % 251])


@pytest.mark.parametrize("actual", [b"short", b"much too long!"])
def test_zipstream__a_page_of_another_size_than_announced_breaks_the_stream(actual):
    class _Opener(AbstractContextManager[io.BytesIO]):
        def __enter__(self) -> io.BytesIO:
            return io.BytesIO(actual)

        def __exit__(self, *exc: object) -> None:
            return None

    entries = [zipstream.Entry(page=1, size=8, open=_Opener)]
    with pytest.raises(zipstream.PageChanged):
        b"".join(zipstream.zip_chunks(entries))
