"""Options normalisation and request fingerprints (conversion_jobs/options.py)."""

from __future__ import annotations

import pytest

from conversion_jobs.exceptions import InvalidOptions
from conversion_jobs.options import (
    DEFAULT_DPI,
    canonical_json,
    normalize_options,
    options_digest,
    request_fingerprint,
)

SHA = "a" * 64


@pytest.mark.parametrize("raw", [None, "", {}, "{}", b"{}"])
def test_normalize_options__empty_fills_defaults(raw):
    assert normalize_options(raw, output="text") == {
        "dpi": None,
        "pages": None,
        "allow_partial": True,
    }
    assert normalize_options(raw, output="png") == {
        "dpi": DEFAULT_DPI,
        "pages": None,
        "allow_partial": True,
    }


@pytest.mark.parametrize("pages", ["3-7", [3, 7], '"3-7"'])
def test_normalize_options__page_range_forms_are_equal(pages):
    raw = {"pages": pages} if pages != '"3-7"' else '{"pages": "3-7"}'
    assert normalize_options(raw, output="text")["pages"] == [3, 7]


@pytest.mark.parametrize("pages", ["4", [4], [4, 4], "4-4"])
def test_normalize_options__single_page(pages):
    assert normalize_options({"pages": pages}, output="text")["pages"] == [4, 4]


@pytest.mark.parametrize(
    ("raw", "output"),
    [
        ({"dpi": 300}, "text"),  # dpi only for png
        ({"dpi": 10}, "png"),
        ({"dpi": 601}, "png"),
        ({"dpi": "150"}, "png"),
        ({"dpi": True}, "png"),
        ({"dpi": 150.0}, "png"),
        ({"pages": "7-3"}, "text"),
        ({"pages": "0-3"}, "text"),
        ({"pages": "a-b"}, "text"),
        ({"pages": "1-2-3"}, "text"),
        ({"pages": [1, True]}, "text"),
        ({"pages": 3}, "text"),
        ({"allow_partial": "yes"}, "text"),
        ({"password": ""}, "text"),
        ({"password": 1234}, "text"),
        ({"password": "x" * 257}, "text"),
        ({"password": "nul\x00byte"}, "text"),
        ({"colour": "red"}, "text"),
        ("[1, 2]", "text"),
        ("not json", "text"),
        ([], "text"),
        (42, "text"),
    ],
)
def test_normalize_options__invalid(raw, output):
    with pytest.raises(InvalidOptions) as info:
        normalize_options(raw, output=output)
    assert info.value.code == "invalid_options"
    assert info.value.status == 400


def test_normalize_options__max_dpi_is_a_parameter():
    assert normalize_options({"dpi": 1200}, output="png", max_dpi=1200)["dpi"] == 1200
    with pytest.raises(InvalidOptions):
        normalize_options({"dpi": 1200}, output="png")


def test_options_digest__key_order_and_spelling_do_not_matter():
    a = normalize_options('{"allow_partial": true, "pages": "2-5"}', output="text")
    b = normalize_options({"pages": [2, 5]}, output="text")
    assert options_digest(a) == options_digest(b)
    assert canonical_json(a) == canonical_json(b)


def test_options_digest__different_meaning_differs():
    digests = {
        options_digest(normalize_options(raw, output="png"))
        for raw in ({}, {"dpi": 300}, {"pages": "1-2"}, {"allow_partial": False})
    }
    assert len(digests) == 4


def test_request_fingerprint__same_request_same_fingerprint():
    opts = normalize_options({"pages": "1-3"}, output="text")
    again = normalize_options({"pages": [1, 3], "allow_partial": True}, output="text")
    assert request_fingerprint(
        source_sha256=SHA, output="text", options=opts
    ) == request_fingerprint(source_sha256=SHA, output="text", options=again)


def test_request_fingerprint__bytes_output_or_options_change_it():
    opts = normalize_options({}, output="text")
    base = request_fingerprint(source_sha256=SHA, output="text", options=opts)
    assert base != request_fingerprint(source_sha256="b" * 64, output="text", options=opts)
    assert base != request_fingerprint(source_sha256=SHA, output="pdf", options=opts)
    other = normalize_options({"allow_partial": False}, output="text")
    assert base != request_fingerprint(source_sha256=SHA, output="text", options=other)
    assert len(base) == 64


def test_normalize_options__test_fault_option_needs_the_env_switch(monkeypatch):
    monkeypatch.delenv("QUIRE_ENABLE_TEST_FAULTS", raising=False)
    with pytest.raises(InvalidOptions):
        normalize_options({"_test_fault": {"kind": "hang"}}, output="text")


def test_normalize_options__password_is_kept_for_acceptance_to_seal():
    assert normalize_options({"password": "s3cret"}, output="pdf")["password"] == "s3cret"
    assert "password" not in normalize_options({}, output="pdf")
