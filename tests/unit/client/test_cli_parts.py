"""The CLI's pure parts: option parsing, the options fingerprint and idempotency key, the
manifest's resume decision, and how a directory is walked (client/quire_client/)."""

from __future__ import annotations

import click
import pytest
from quire_client.batch import collect
from quire_client.cli import parse_options
from quire_client.manifest import (
    MANIFEST_NAME,
    Manifest,
    Written,
    idempotency_key,
    options_fingerprint,
)


def test_parse_options__json_values_and_plain_strings():
    assert parse_options(["dpi=200", "allow_partial=false", "pages=2-3", "x=[1, 3]"]) == {
        "dpi": 200,
        "allow_partial": False,
        "pages": "2-3",
        "x": [1, 3],
    }


@pytest.mark.parametrize("bad", ["dpi", "=3"])
def test_parse_options__refuses_a_pair_without_key_or_equals(bad):
    with pytest.raises(click.BadParameter):
        parse_options([bad])


def test_options_fingerprint__order_free_and_output_bound():
    a = options_fingerprint("png", {"dpi": 200, "pages": "1-2"})
    assert a == options_fingerprint("png", {"pages": "1-2", "dpi": 200})
    assert a != options_fingerprint("text", {"dpi": 200, "pages": "1-2"})
    assert a != options_fingerprint("png", {"dpi": 201, "pages": "1-2"})
    key = idempotency_key("ab" * 32, a)
    assert len(key) <= 255
    assert all(0x21 <= ord(ch) <= 0x7E for ch in key)


def test_manifest__verified_result_survives_a_reopen_and_a_changed_file_starts_afresh(tmp_path):
    result = tmp_path / "out" / "a.pdf.txt"
    manifest = Manifest(tmp_path / "out")
    manifest.begin("/src/a.pdf", sha256="1" * 64, fingerprint="f")
    manifest.submitted("/src/a.pdf", job_id="job-1")
    result.write_text("hello")
    manifest.finished(
        "/src/a.pdf",
        state="succeeded",
        error_code=None,
        result=Written(path=result, sha256="2" * 64, size=5),
    )
    manifest.close()
    reopened = Manifest(tmp_path / "out")
    entry = reopened.begin("/src/a.pdf", sha256="1" * 64, fingerprint="f")
    assert entry.job_id == "job-1"
    assert entry.verified_result(sha256="1" * 64, fingerprint="f")
    assert not entry.verified_result(sha256="1" * 64, fingerprint="g")
    result.write_text("truncated")  # another size: not the verified file any more
    assert not entry.verified_result(sha256="1" * 64, fingerprint="f")
    fresh = reopened.begin("/src/a.pdf", sha256="3" * 64, fingerprint="f")
    assert fresh.job_id is None and fresh.state == "pending"


def test_collect__walks_directories_skipping_hidden_files_and_the_output(tmp_path):
    src = tmp_path / "src"
    (src / "sub").mkdir(parents=True)
    (src / "a.pdf").write_bytes(b"%PDF")
    (src / "sub" / "b.docx").write_bytes(b"PK")
    (src / ".hidden").write_bytes(b"x")
    out = src / "results"
    out.mkdir()
    (out / "old.txt").write_text("x")
    (out / MANIFEST_NAME).write_text("x")
    items = collect([src], out, "text")
    assert [i.name for i in items] == ["a.pdf", "sub/b.docx"]
    assert [i.dest for i in items] == [out / "a.pdf.txt", out / "sub" / "b.docx.txt"]
