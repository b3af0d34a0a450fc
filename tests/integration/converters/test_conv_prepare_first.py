"""The prepare carries the first pages (ADR 0017, session 6): ``prepare(first=...)`` asks the
child for the document's first pages in the prepare's own request, so the first page calls find
them due; pages beyond the count are dropped on both sides; a failed prepare leaves nothing due."""

from __future__ import annotations

from pathlib import Path

import pytest
from convhelpers import FAST, never

from conversion_jobs.converters import (
    EncryptedInput,
    FirstPages,
    InvalidInput,
    PageRequest,
    PrepareRequest,
    sessions,
)
from conversion_jobs.converters.registry import PdfConverter
from tests import testdocs

pytestmark = pytest.mark.usefixtures("no_children_left_behind")


def _prepare(source: Path, workdir: Path, first: FirstPages | None, options=None):
    return PdfConverter().prepare(
        PrepareRequest(
            source=source,
            media_type="application/pdf",
            workdir=workdir,
            limits=FAST,
            should_stop=never,
            options=options,
            first=first,
        )
    )


def _session(prepared) -> sessions.ChildSession:
    return sessions.session_for(document=prepared.document, scratch_dir=Path("/"), limits=FAST)


def _page(prepared, page: int, workdir: Path, *, lookahead=(), inline: int = 0):
    return PdfConverter().convert_page(
        PageRequest(
            prepared=prepared,
            output="text",
            options={},
            dest_dir=workdir / "pages",
            limits=FAST,
            should_stop=never,
            inline_max_bytes=inline,
        ),
        page=page,
        lookahead=lookahead,
    )


def test_prepare_first__pages_due_with_the_prepare_and_beyond_the_count_dropped(tmp_path):
    source = testdocs.make_pdf(tmp_path / "in.pdf", pages=2, text_of=lambda n: f"first {n}")
    try:
        prepared = _prepare(source, tmp_path, FirstPages(pages=(1, 2, 3, 4), output="text"))
        assert (prepared.page_count, prepared.first_requested) == (2, True)
        # No page was asked for since the prepare: the prepare's request carried them.
        assert _session(prepared).ahead == [1, 2]
        one = _page(prepared, 1, tmp_path, lookahead=(2,))
        two = _page(prepared, 2, tmp_path)
        assert one.path is not None and two.path is not None
        assert one.path.read_text().strip() == "first 1"
        assert two.path.read_text().strip() == "first 2"
        assert _session(prepared).ahead == []
    finally:
        sessions.release()


def test_prepare_first__inline_text_page(tmp_path):
    source = testdocs.make_pdf(tmp_path / "in.pdf", pages=1, text_of=lambda n: "inline one")
    try:
        first = FirstPages(pages=(1,), output="text", inline_max_bytes=4096)
        prepared = _prepare(source, tmp_path, first)
        artifact = _page(prepared, 1, tmp_path, inline=4096)
        assert (artifact.path, artifact.content) == (None, b"inline one")
    finally:
        sessions.release()


def test_prepare_first__range_beyond_the_document_leaves_nothing_due(tmp_path):
    source = testdocs.make_pdf(tmp_path / "in.pdf", pages=2, text_of=lambda n: f"p{n}")
    try:
        prepared = _prepare(source, tmp_path, FirstPages(pages=(5, 6), output="text"))
        assert prepared.page_count == 2
        assert _session(prepared).ahead == []
        # The session still serves a page asked for afterwards.
        assert _page(prepared, 2, tmp_path).path.read_text().strip() == "p2"
    finally:
        sessions.release()


@pytest.mark.parametrize(
    ("make", "error"),
    [
        (lambda p: testdocs.make_encrypted_pdf(p), EncryptedInput),
        (lambda p: testdocs.make_zero_page_pdf(p), InvalidInput),
    ],
)
def test_prepare_first__a_failed_prepare_raises_its_error_and_ends_the_session(
    tmp_path, make, error
):
    source = make(tmp_path / "bad.pdf")
    with pytest.raises(error):
        _prepare(source, tmp_path, FirstPages(pages=(1, 2), output="text"))
    assert sessions.session_due(document=source, limits=FAST, page=1) is None
    sessions.release()
