"""CPU of parsing one acceptance request body: Django's ``MultiPartParser`` with Quire's
``StagingUploadHandler`` (what POST /jobs runs) against python-multipart's streaming parser
(hashing and writing the file part the same way), when it is importable. The question it
answers (ADR 0017, session 5 closing): is a faster multipart parser a lever for the accept path?

    .venv/bin/python bench/multipart_parse.py [--kb 10] [--n 3000]
    # python-multipart is not a Quire dependency; to include it:
    #   .venv/bin/python -m pip install --target /tmp/pm python-multipart
    #   PYTHONPATH=/tmp/pm .venv/bin/python bench/multipart_parse.py
"""

from __future__ import annotations

import argparse
import hashlib
import io
import os
import sys
import tempfile
import time
from collections.abc import Callable
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
os.environ.setdefault("DJANGO_SETTINGS_MODULE", "project.settings")


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--kb", type=int, default=10, help="size of the file part (accept.py: 10)")
    parser.add_argument("--n", type=int, default=3000)
    parser.add_argument("--rounds", type=int, default=5)
    args = parser.parse_args()

    scratch = tempfile.mkdtemp(prefix="quire-mp-")
    os.environ.setdefault("QUIRE_VAR_DIR", scratch)
    import django

    django.setup()
    from django.http.multipartparser import MultiPartParser

    from conversion_jobs.api.uploads import StagingUploadHandler

    boundary = "----quirebench1234567890"
    body = (
        (
            f'--{boundary}\r\nContent-Disposition: form-data; name="output"\r\n\r\ntext\r\n'
            f'--{boundary}\r\nContent-Disposition: form-data; name="file"; filename="bench.pdf"\r\n'
            "Content-Type: application/pdf\r\n\r\n"
        ).encode()
        + os.urandom(args.kb * 1024)
        + f"\r\n--{boundary}--\r\n".encode()
    )
    meta = {
        "CONTENT_TYPE": f"multipart/form-data; boundary={boundary}",
        "CONTENT_LENGTH": str(len(body)),
    }

    def django_parse() -> None:
        handler = StagingUploadHandler(max_bytes=1 << 30)
        _, files = MultiPartParser(meta, io.BytesIO(body), [handler], "utf-8").parse()
        files["file"].staged.path.unlink()

    def django_parse_inline() -> None:
        # What POST /jobs runs for a source up to QUIRE_INLINE_SOURCE_MAX_BYTES: the handler
        # keeps the bytes in memory, no staged file.
        handler = StagingUploadHandler(max_bytes=1 << 30, inline_max=1 << 20)
        MultiPartParser(meta, io.BytesIO(body), [handler], "utf-8").parse()

    candidates: list[tuple[str, Callable[[], None]]] = [
        ("Django MultiPartParser + StagingUploadHandler", django_parse),
        ("Django MultiPartParser + StagingUploadHandler, inline", django_parse_inline),
    ]
    try:
        from conversion_jobs.api.uploads import small_form_parse
    except ImportError:
        pass  # removed by issue 23 (ADR 0024)
    else:
        content_type = meta["CONTENT_TYPE"].encode()

        def small_form_split() -> None:
            form = small_form_parse(content_type, body)
            assert form is not None
            hashlib.sha256(form.file or b"").hexdigest()

        candidates.append(("small_form_parse (hand-written split) + sha256", small_form_split))
    try:
        import python_multipart
    except ImportError:
        print("python-multipart not importable: Django's parser only (see the docstring)")
    else:
        staged = Path(scratch) / "staged"

        def python_multipart_parse() -> None:
            digest = hashlib.sha256()
            with staged.open("wb") as fh:

                def on_part_data(data: bytes, start: int, end: int) -> None:
                    chunk = data[start:end]
                    digest.update(chunk)
                    fh.write(chunk)

                parser = python_multipart.MultipartParser(
                    boundary.encode(), callbacks={"on_part_data": on_part_data}
                )
                parser.write(body)
                parser.finalize()
            staged.unlink()

        candidates.append(("python-multipart MultipartParser", python_multipart_parse))

    # Rounds alternate the candidates (ABAB...): on a shared host the load moves between them.
    per: dict[str, list[float]] = {name: [] for name, _ in candidates}
    for _ in range(200):
        for _, parse in candidates:
            parse()
    for _ in range(args.rounds):
        for name, parse in candidates:
            start = time.process_time()
            for _ in range(args.n // args.rounds):
                parse()
            per[name].append((time.process_time() - start) / (args.n // args.rounds) * 1000)
    first = candidates[0][0]
    base = sorted(per[first])[len(per[first]) // 2]
    for name, figures in per.items():
        median = sorted(figures)[len(figures) // 2]
        print(
            f"{name}: {median:.3f} ms CPU per {args.kb} KB request (median of {args.rounds} "
            f"rounds: {', '.join(f'{f:.3f}' for f in figures)}); {median / base:.2f}x {first}"
        )


if __name__ == "__main__":
    main()
