"""Hand-built multipart bodies (the test client and requests both refuse to build broken ones)."""

from __future__ import annotations

BOUNDARY = "quire-test-boundary"
CONTENT_TYPE = f"multipart/form-data; boundary={BOUNDARY}"


def part(name: str, value: bytes, *, filename: str | None = None) -> bytes:
    head = f'--{BOUNDARY}\r\nContent-Disposition: form-data; name="{name}"'
    if filename is not None:
        head += f'; filename="{filename}"\r\nContent-Type: application/octet-stream'
    return head.encode() + b"\r\n\r\n" + value + b"\r\n"


def body(*parts: bytes, closed: bool = True) -> bytes:
    return b"".join(parts) + (f"--{BOUNDARY}--\r\n".encode() if closed else b"")


def hostile_bodies(pdf: bytes) -> dict[str, tuple[bytes, str]]:
    """Each body starts with a valid ``file`` part and fails after it: name -> (body, code)."""
    first = part("file", pdf, filename="doc.pdf") + part("output", b"text")
    return {
        "deep_options": (
            body(first, part("options", b"[" * 30_000 + b"]" * 30_000)),
            "invalid_options",
        ),
        "deep_options_object": (
            body(first, part("options", b'{"a":' * 10_000 + b"1" + b"}" * 10_000)),
            "invalid_options",
        ),
        "too_many_fields": (
            body(first, *(part(f"f{i}", b"x") for i in range(1_100))),
            "too_many_fields",
        ),
        "oversized_field": (
            body(first, part("options", b" " * 70_000 + b"{}")),
            "request_data_too_large",
        ),
        "second_file_part": (
            body(first, part("file", pdf, filename="again.pdf")),
            "unexpected_file_part",
        ),
        "101_file_parts": (
            body(first, *(part(f"g{i}", b"x", filename="x.bin") for i in range(101))),
            "unexpected_file_part",
        ),
        "oversized_part_header": (
            body(first, part("x" * 10_000, b"1")),
            "malformed_body",
        ),
    }


def malformed_content_types() -> list[str]:
    """Multipart content types Django refuses before reading a byte of the body."""
    return ["multipart/form-data", 'multipart/form-data; boundary=""']
