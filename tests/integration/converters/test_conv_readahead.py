"""Read-ahead: one request for several pages, answered page by page, charged page by page."""

import os
import signal
import time

import pytest
from convhelpers import alive, convert_page, prepare, session_of

from conversion_jobs.converters import (
    ConversionStopped,
    ConversionTimeout,
    ConverterCrashed,
    InvalidInput,
    Limits,
    PageRequest,
    process_group_members,
)
from conversion_jobs.converters.registry import READ_AHEAD_PAGES
from tests import testdocs

LIMITS = Limits(page_timeout_s=3, prepare_timeout_s=20)


pytestmark = pytest.mark.usefixtures("no_children_left_behind")


@pytest.fixture
def doc(tmp_path):
    source = testdocs.make_pdf(tmp_path / "doc.pdf", pages=40)
    return prepare(source, tmp_path / "attempt", output="text", limits=LIMITS)


def _page(doc, tmp_path, page, lookahead=(), *, fault=None):
    return convert_page(
        doc, tmp_path / "attempt", page, limits=LIMITS, fault=fault, lookahead=lookahead
    )


def _session(doc, tmp_path):
    return session_of(doc, tmp_path / "attempt", limits=LIMITS)


def test_read_ahead__the_child_converts_the_next_pages_before_they_are_asked_for(doc, tmp_path):
    plan = list(range(1, 11))
    first = _page(doc, tmp_path, 1, plan[1:])
    assert first.path.read_text() == "Page 1 of the Quire test document"
    session = _session(doc, tmp_path)
    assert session.ahead == plan[1:]
    later = session.inside("page-0010.txt")  # the child's private directory
    deadline = time.monotonic() + 5
    while not later.exists() and time.monotonic() < deadline:
        time.sleep(0.01)
    assert later.exists()  # written by the child while page 1 was being handled here
    for index, page in enumerate(plan[1:], start=1):
        artifact = _page(doc, tmp_path, page, plan[index + 1 :])
        assert artifact.path.read_text() == f"Page {page} of the Quire test document"
    assert session.ahead == []
    assert _session(doc, tmp_path) is session  # one child served all ten pages


def test_read_ahead__asks_for_at_most_the_configured_number_of_pages(doc, tmp_path):
    _page(doc, tmp_path, 1, list(range(2, 41)))
    assert _session(doc, tmp_path).ahead == list(range(2, READ_AHEAD_PAGES + 1))


def test_read_ahead__the_next_pages_are_queued_when_half_are_collected(doc, tmp_path):
    plan = list(range(1, 41))
    _page(doc, tmp_path, 1, plan[1:])
    session = _session(doc, tmp_path)
    half = READ_AHEAD_PAGES // 2
    collected = 1
    while len(session.ahead) > half:
        collected += 1
        _page(doc, tmp_path, collected, plan[collected:])
    # The next call finds half the window collected: it queues the next window behind it.
    collected += 1
    _page(doc, tmp_path, collected, plan[collected:])
    assert session.ahead == plan[collected : collected + half - 1 + READ_AHEAD_PAGES]
    for page in plan[collected:]:
        artifact = _page(doc, tmp_path, page, plan[page:])
        assert artifact.path.read_text() == f"Page {page} of the Quire test document"
    assert session.ahead == []
    assert _session(doc, tmp_path) is session  # one child, no request ever mixed up


def test_read_ahead__small_text_pages_come_back_inline_without_a_file(doc, tmp_path):
    plan = list(range(1, 6))
    for page in plan:
        artifact = convert_page(
            doc,
            tmp_path / "attempt",
            page,
            limits=LIMITS,
            lookahead=plan[page:],
            inline_max_bytes=1024,
        )
        assert artifact.path is None
        assert artifact.content == f"Page {page} of the Quire test document".encode()
    session = _session(doc, tmp_path)
    assert not list(session.inside().glob("page-*"))  # the child wrote no page file
    assert not list((tmp_path / "attempt").glob("page-*"))
    # Above the limit a page is a file, as without it.
    big = convert_page(doc, tmp_path / "attempt", 6, limits=LIMITS, inline_max_bytes=10)
    assert big.content is None
    assert big.path.read_text() == "Page 6 of the Quire test document"


def test_read_ahead__inline_texts_travel_raw_and_every_answer_stays_in_step(tmp_path):
    # The child sends an inline page's UTF-8 as it is after its answer's line: text that
    # looks like protocol (newlines, braces, quotes) or is not ASCII comes back unchanged, and
    # the answers after it are read from where it ends.
    def text_of(n: int) -> str:
        return f'Page {n} {{"ok": true, "page": {n + 1}}}\nGr\u00fc\u00dfe "{n}"\n}}'

    source = testdocs.make_pdf(tmp_path / "raw.pdf", pages=12, text_of=text_of)
    doc = prepare(source, tmp_path / "attempt", output="text", limits=LIMITS)
    plan = list(range(1, 13))
    for page in plan:
        artifact = convert_page(
            doc,
            tmp_path / "attempt",
            page,
            limits=LIMITS,
            lookahead=plan[page:],
            inline_max_bytes=1024,
        )
        assert artifact.path is None
        assert artifact.content == text_of(page).encode("utf-8")
    assert _session(doc, tmp_path).ahead == []


def test_read_ahead__out_of_order_request_gets_a_fresh_child_and_the_right_page(doc, tmp_path):
    _page(doc, tmp_path, 1, [2, 3, 4])
    first = _session(doc, tmp_path)
    artifact = _page(doc, tmp_path, 7)
    assert artifact.path.read_text() == "Page 7 of the Quire test document"
    assert first.closed and process_group_members(first.pgid) == []
    second = _session(doc, tmp_path)
    assert second is not first and alive(second.proc.pid)


def test_read_ahead__a_failing_page_fails_alone(doc, tmp_path, faults_enabled):
    fault = {"kind": "fail", "page": 3}
    _page(doc, tmp_path, 1, [2, 3, 4, 5], fault=fault)
    assert _page(doc, tmp_path, 2, [3, 4, 5], fault=fault).path.exists()
    with pytest.raises(InvalidInput):
        _page(doc, tmp_path, 3, [4, 5], fault=fault)
    assert not (tmp_path / "attempt" / "page-0003.txt").exists()
    session = _session(doc, tmp_path)
    assert session.ahead == [4, 5]  # a structured error keeps the child and its read-ahead
    assert _page(doc, tmp_path, 4, [5], fault=fault).path.read_text().startswith("Page 4")
    assert _session(doc, tmp_path) is session


def test_read_ahead__a_crash_is_charged_to_the_page_being_converted(doc, tmp_path, faults_enabled):
    fault = {"kind": "segv", "page": 4}
    for page in (1, 2, 3):
        assert _page(doc, tmp_path, page, list(range(page + 1, 8)), fault=fault).path.exists()
    crashed = _session(doc, tmp_path)
    with pytest.raises(ConverterCrashed):
        _page(doc, tmp_path, 4, [5, 6, 7], fault=fault)
    assert process_group_members(crashed.pgid) == []
    # The next page is served by a fresh child.
    assert _page(doc, tmp_path, 5, [6, 7], fault=fault).path.read_text().startswith("Page 5")


def test_read_ahead__a_child_dying_inside_an_inline_text_is_charged_to_that_page(
    doc, tmp_path, faults_enabled
):
    # Half of page 4's raw bytes reached the pipe: never a shorter page, a crash of page 4.
    fault = {"kind": "cut", "page": 4}
    plan = list(range(1, 8))

    def page(number: int):
        return convert_page(
            doc,
            tmp_path / "attempt",
            number,
            limits=LIMITS,
            fault=fault,
            lookahead=plan[number:],
            inline_max_bytes=1024,
        )

    for number in (1, 2, 3):
        assert page(number).content == f"Page {number} of the Quire test document".encode()
    cut = _session(doc, tmp_path)
    with pytest.raises(ConverterCrashed):
        page(4)
    assert cut.closed and process_group_members(cut.pgid) == []
    assert page(5).content == b"Page 5 of the Quire test document"  # a fresh child


def test_read_ahead__a_hanging_page_times_out_at_its_own_deadline(doc, tmp_path, faults_enabled):
    fault = {"kind": "hang", "page": 3}
    _page(doc, tmp_path, 1, [2, 3, 4], fault=fault)
    time.sleep(LIMITS.page_timeout_s / 2)  # the worker is busy elsewhere for a while
    assert _page(doc, tmp_path, 2, [3, 4], fault=fault).path.exists()
    hung = _session(doc, tmp_path)
    started = time.monotonic()
    with pytest.raises(ConversionTimeout) as info:
        _page(doc, tmp_path, 3, [4], fault=fault)
    waited = time.monotonic() - started
    # The page's clock starts when page 2's answer was read: a full page timeout, not less.
    assert LIMITS.page_timeout_s - 0.2 <= waited <= LIMITS.page_timeout_s + 2
    assert f"{LIMITS.page_timeout_s:g} s" in info.value.detail
    assert process_group_members(hung.pgid) == []


def _request(doc, tmp_path, pages, **extra):
    converter, prepared = doc
    converter.request_pages(
        PageRequest(
            prepared=prepared,
            output="text",
            options={},
            dest_dir=tmp_path / "attempt",
            limits=LIMITS,
            should_stop=lambda: False,
        ),
        pages=pages,
        **extra,
    )


def test_request_pages__the_child_starts_before_the_first_page_is_asked_for(doc, tmp_path):
    plan = list(range(1, 41))
    _request(doc, tmp_path, plan[: 2 * READ_AHEAD_PAGES])
    session = _session(doc, tmp_path)
    assert session.ahead == plan[:READ_AHEAD_PAGES]  # what the first page call would ask for
    first = session.inside("page-0001.txt")
    deadline = time.monotonic() + 5
    while not first.exists() and time.monotonic() < deadline:
        time.sleep(0.01)
    assert first.exists()  # converted while nobody asked for a page yet
    for page in plan:
        artifact = _page(doc, tmp_path, page, plan[page : page + 2 * READ_AHEAD_PAGES - 1])
        assert artifact.path.read_text() == f"Page {page} of the Quire test document"
    assert session.ahead == []
    assert _session(doc, tmp_path) is session  # the pages requested early were used, in order


def test_request_pages__a_changed_plan_gets_the_right_page(doc, tmp_path):
    _request(doc, tmp_path, [1, 2, 3])
    early = _session(doc, tmp_path)
    artifact = _page(doc, tmp_path, 5, [6])
    assert artifact.path.read_text() == "Page 5 of the Quire test document"
    assert early.closed and process_group_members(early.pgid) == []


def test_request_pages__a_failure_is_left_to_the_first_page_call(doc, tmp_path):
    session = _session(doc, tmp_path)
    session.close()  # e.g. the child died after prepare: the early request cannot be sent
    _request(doc, tmp_path, [1, 2, 3])  # raises nothing
    assert _page(doc, tmp_path, 1, [2, 3]).path.read_text().startswith("Page 1")


def test_request_pages__a_stop_is_raised(doc, tmp_path):
    converter, prepared = doc
    with pytest.raises(ConversionStopped):
        converter.request_pages(
            PageRequest(
                prepared=prepared,
                output="text",
                options={},
                dest_dir=tmp_path / "attempt",
                limits=LIMITS,
                should_stop=lambda: True,
            ),
            pages=[1, 2],
        )


def test_read_ahead__a_child_killed_between_pages_is_charged_to_the_next_page(
    doc, tmp_path, faults_enabled
):
    slow = {"kind": "slow", "seconds": 0.5}  # the child is still on page 2 when it is killed
    plan = list(range(1, 6))
    _page(doc, tmp_path, 1, plan[1:], fault=slow)
    session = _session(doc, tmp_path)
    os.killpg(session.pgid, signal.SIGKILL)  # the pages due are read without probing the child
    with pytest.raises(ConverterCrashed):
        _page(doc, tmp_path, 2, plan[2:], fault=slow)
    assert session.closed and process_group_members(session.pgid) == []
    assert _page(doc, tmp_path, 2, plan[2:]).path.read_text().startswith("Page 2")
