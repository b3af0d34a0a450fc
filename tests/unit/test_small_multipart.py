"""The small-form split of a job submission (conversion_jobs/api/uploads.small_form_parse):
where it answers, it sees exactly what Django's ``MultiPartParser`` sees; everything else it
leaves to Django (None)."""

from __future__ import annotations

import io

import pytest
from django.core.files.uploadhandler import MemoryFileUploadHandler
from django.http.multipartparser import MultiPartParser

from conversion_jobs.api.uploads import small_form_parse

B = "quire-test-boundary"
TYPE = f"multipart/form-data; boundary={B}"
PDF = b"%PDF-1.7\r\n" + bytes(range(256)) * 8 + b"\r\n--not-the-boundary\r\n%%EOF\n"


def field(name: str, value: bytes, *, boundary: str = B) -> bytes:
    return f'--{boundary}\r\nContent-Disposition: form-data; name="{name}"\r\n\r\n'.encode() + (
        value + b"\r\n"
    )


def file(name: str, value: bytes, *, filename: str = "doc.pdf", head: str = "") -> bytes:
    return (
        f'--{B}\r\nContent-Disposition: form-data; name="{name}"; filename="{filename}"\r\n'
        f"Content-Type: application/pdf\r\n{head}\r\n"
    ).encode() + (value + b"\r\n")


def closing(boundary: str = B, tail: bytes = b"\r\n") -> bytes:
    return f"--{boundary}--".encode() + tail


def django_parse(content_type: str, body: bytes) -> tuple[dict[str, list[str]], dict[str, bytes]]:
    meta = {"CONTENT_TYPE": content_type, "CONTENT_LENGTH": str(len(body))}
    parser = MultiPartParser(meta, io.BytesIO(body), [MemoryFileUploadHandler()], "utf-8")
    post, files = parser.parse()
    return {k: post.getlist(k) for k in post}, {k: f.read() for k, f in files.items()}


PLAIN = {
    "bench": field("output", b"text") + file("file", PDF, filename="bench.pdf") + closing(),
    "file_first_options": file("file", PDF)
    + field("output", b"png")
    + field("options", b'{"dpi": 100}')
    + closing(),
    "no_trailing_crlf": field("output", b"text") + file("file", PDF) + closing(tail=b""),
    "non_utf8_field": field("output", b"te\xffxt") + file("file", PDF) + closing(),
    "empty_file": field("output", b"text") + file("file", b"") + closing(),
    "field_only": field("output", b"text") + closing(),
    "field_with_crlf_inside": field("options", b'{\r\n"dpi": 1}') + file("file", PDF) + closing(),
}


@pytest.mark.parametrize("case", sorted(PLAIN))
def test_small_form_parse__plain_shape_matches_django(case):
    body = PLAIN[case]
    form = small_form_parse(TYPE.encode(), body)
    assert form is not None
    post, files = django_parse(TYPE, body)
    assert {k: [v] for k, v in form.fields.items()} == post
    assert ({"file": form.file} if form.file is not None else {}) == files


def test_small_form_parse__quoted_boundary():
    body = field("output", b"text") + file("file", PDF) + closing()
    form = small_form_parse(f'multipart/form-data; boundary="{B}"'.encode(), body)
    assert form is not None
    assert form.file == PDF


OTHER = {
    # Django decides all of these (its answer may be a part, a skipped part or an error).
    "boundary_inside_file": field("output", b"text")
    + file("file", PDF + f"\r\n--{B}x".encode())
    + closing(),
    "lf_boundary_inside_file": field("output", b"text")
    + file("file", PDF + f"\n--{B}\n".encode())
    + closing(),
    "preamble": b"hello\r\n" + field("output", b"text") + closing(),
    "epilogue": field("output", b"text") + closing(tail=b"\r\nbye"),
    "unclosed": field("output", b"text") + file("file", PDF),
    "transfer_encoding": field("output", b"text")
    + file("file", b"JVBERi0=", head="Content-Transfer-Encoding: base64\r\n")
    + closing(),
    "content_length_header": field("output", b"text")
    + file("file", PDF, head="Content-Length: 3\r\n")
    + closing(),
    "duplicate_field": field("output", b"text") + field("output", b"png") + closing(),
    "two_files": file("file", PDF) + file("file", PDF) + closing(),
    "other_file_part": file("attachment", PDF) + closing(),
    "empty_filename": file("file", PDF, filename="") + closing(),
    "dot_filename": file("file", PDF, filename="..") + closing(),
    "path_filename": file("file", PDF, filename="a/b.pdf") + closing(),
    "escaped_name": (
        f'--{B}\r\nContent-Disposition: form-data; name="out\\"put"\r\n\r\ntext\r\n'.encode()
        + closing()
    ),
    "rfc2231_name": (
        f"--{B}\r\nContent-Disposition: form-data; name*=utf-8''output\r\n\r\ntext\r\n".encode()
        + closing()
    ),
    "no_disposition": f"--{B}\r\nContent-Type: text/plain\r\n\r\ntext\r\n".encode() + closing(),
    "field_content_type": (
        f'--{B}\r\nContent-Disposition: form-data; name="output"\r\n'
        "Content-Type: text/plain; charset=latin-1\r\n\r\ntext\r\n".encode()
        + closing()
    ),
    "lf_line_ends": field("output", b"text").replace(b"\r\n", b"\n") + closing(tail=b"\n"),
    "no_blank_line": f'--{B}\r\nContent-Disposition: form-data; name="output"\r\n'.encode()
    + closing(),
    "folded_header": (
        f'--{B}\r\nContent-Disposition: form-data;\r\n name="output"\r\n\r\ntext\r\n'.encode()
        + closing()
    ),
    "too_many_parts": b"".join(field(f"f{i}", b"x") for i in range(9)) + closing(),
}


@pytest.mark.parametrize("case", sorted(OTHER))
def test_small_form_parse__other_shapes_are_left_to_django(case):
    assert small_form_parse(TYPE.encode(), OTHER[case]) is None


@pytest.mark.parametrize(
    "content_type",
    [
        "multipart/form-data",
        'multipart/form-data; boundary=""',
        f"multipart/form-data; boundary={B}; charset=utf-8",
        f"multipart/mixed; boundary={B}",
        f"multipart/form-data; boundary={B} x",
    ],
)
def test_small_form_parse__other_content_types_are_left_to_django(content_type):
    body = field("output", b"text") + closing()
    assert small_form_parse(content_type.encode(), body) is None
