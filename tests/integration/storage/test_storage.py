"""The artifact store's interface, the same tests on both backends (docs/ARCHITECTURE.md §6)."""

from __future__ import annotations

import io
import os
import socket
import stat
import urllib.error
import urllib.request
import uuid
from pathlib import Path

import pytest

from conversion_jobs import storage
from conversion_jobs.storage import s3put


def _file(tmp_path: Path, data: bytes) -> Path:
    path = tmp_path / uuid.uuid4().hex
    path.write_bytes(data)
    return path


def test_store__put_open_exists_delete(backend, tmp_path):
    key = storage.result_key(job_id=uuid.uuid4(), generation=3, ext="txt")
    assert key.endswith("/result.g3.txt")
    assert not storage.exists(key)

    put = storage.put_file(key, _file(tmp_path, b"hello"))
    assert put.pending is None and put.local.read_bytes() == b"hello"
    assert storage.exists(key)
    with storage.open_object(key) as body:
        assert body.read() == b"hello"
    storage.download(key, tmp_path / "copy")
    assert (tmp_path / "copy").read_bytes() == b"hello"
    assert stat.S_IMODE((tmp_path / "copy").stat().st_mode) == 0o600

    storage.delete(key)
    storage.delete(key)  # a missing object is not an error
    assert not storage.exists(key)
    with pytest.raises(FileNotFoundError):
        storage.open_object(key)
    with pytest.raises(FileNotFoundError):
        storage.download(key, tmp_path / "gone")


def test_store__source_is_stored_once_by_content(backend, tmp_path):
    """A source is created only where its content address is free (S3: one conditional PUT,
    refused with 412 when the object exists); a second upload of the same bytes reuses it."""
    data = uuid.uuid4().bytes * 64
    sha, _size = storage.sha256_file(_file(tmp_path, data))
    first = storage.put_source(_file(tmp_path, data), sha)
    again = storage.put_source(_file(tmp_path, data), sha)
    assert first == (storage.source_key(sha), True)
    assert again == (storage.source_key(sha), False)
    with storage.open_object(first[0]) as body:
        assert body.read() == data


def test_s3__conditional_writes_probed__a_server_without_them_gets_head_then_put(
    s3_store, tmp_path
):
    """SeaweedFS refuses If-None-Match: * on an existing key (412), so sources are created
    with one conditional PUT; where a server ignores the condition the store falls back to
    HEAD + PUT (an ignored condition would overwrite outside the source's lock)."""
    target = storage.store()
    assert target._conditional_writes() is True
    assert not list(storage.list_objects("_probe"))  # the probe object is gone
    target._conditional = False
    data = uuid.uuid4().bytes * 32
    sha, _size = storage.sha256_file(_file(tmp_path, data))
    assert storage.put_source(_file(tmp_path, data), sha) == (storage.source_key(sha), True)
    assert storage.put_source(_file(tmp_path, data), sha) == (storage.source_key(sha), False)


def test_store__unwaited_puts_are_complete_once_settled(backend, tmp_path):
    job = uuid.uuid4()
    puts = [
        storage.put_file(
            storage.page_key(job_id=job, page=n, generation=1, ext="txt"),
            _file(tmp_path, f"page {n}".encode()),
            wait=False,
        )
        for n in range(1, 21)
    ]
    storage.settle(puts)
    assert all(p.pending is None for p in puts)
    listed = sorted(storage.list_objects(f"pages/{job}"), key=lambda o: o.key)
    assert [o.key for o in listed] == [p.key for p in puts]
    assert [storage.open_object(p.key).read() for p in puts] == [
        f"page {n}".encode() for n in range(1, 21)
    ]
    assert all(p.local.read_bytes() == f"page {n}".encode() for n, p in enumerate(puts, 1))


def test_store__put_from_a_stream_and_delete_a_prefix(backend):
    job = uuid.uuid4()
    for n in (1, 2, 3):
        storage.put(storage.page_key(job_id=job, page=n, generation=2, ext="txt"), io.BytesIO(b"x"))
    other = storage.page_key(job_id=uuid.uuid4(), page=1, generation=1, ext="txt")
    storage.put(other, io.BytesIO(b"y"))

    assert storage.delete_prefix(f"pages/{job}") == 3
    assert list(storage.list_objects(f"pages/{job}")) == []
    assert storage.exists(other)


def test_store__multipart_upload_round_trips(backend, tmp_path):
    """Above the part size an S3 put is a multipart upload read from disk part by part."""
    data = os.urandom(1024) * (20 * 1024)  # 20 MiB
    key = storage.source_key("ab" * 32)
    storage.put_file(key, _file(tmp_path, data))
    storage.download(key, tmp_path / "back")
    assert (tmp_path / "back").read_bytes() == data


def test_store__a_put_with_its_sha256_round_trips_unwaited_or_not(backend, tmp_path):
    job = uuid.uuid4()
    data = [os.urandom(200_000) for _ in range(4)]
    puts = []
    for n, body in enumerate(data, 1):
        path = _file(tmp_path, body)
        sha, _size = storage.sha256_file(path)
        key = storage.page_key(job_id=job, page=n, generation=1, ext="png")
        puts.append(storage.put_file(key, path, wait=n % 2 == 0, sha256=sha))
    storage.settle(puts)
    assert [storage.open_object(p.key).read() for p in puts] == data


def test_s3__a_put_whose_bytes_do_not_match_its_sha256_is_refused(s3_store, tmp_path):
    """The SHA-256 a page's row records travels with its PUT; the server checks it, so an
    object never holds other bytes than its row names."""
    key = storage.page_key(job_id=uuid.uuid4(), page=1, generation=1, ext="png")
    path = _file(tmp_path, b"the page")
    wrong = "0" * 64
    with pytest.raises(storage.StorageError):
        storage.put_file(key, path, sha256=wrong)
    put = storage.put_file(key, path, wait=False, sha256=wrong)
    with pytest.raises(storage.StorageError):
        storage.settle([put])
    assert not storage.exists(key)


def test_s3__a_source_whose_bytes_do_not_match_its_sha256_is_refused(s3_store, tmp_path):
    """The source PUT (signed by ``storage/s3put.py``, not boto3) carries the SHA-256 the row
    will name; the server refuses other bytes, and nothing is stored under the key."""
    path = _file(tmp_path, b"the source")
    wrong = "ab" * 32
    with pytest.raises(storage.StorageError):
        storage.put_source(path, wrong)
    assert not storage.exists(storage.source_key(wrong))


def test_s3__the_source_put_bypasses_the_boto3_client(s3_store, tmp_path):
    """The conditional source PUT is the signed request of ``s3put`` (no boto3 PutObject
    call), and the server accepts its signature, its checksum and its condition; object
    parameters it does not know send it back to boto3, with the same answers."""
    target = storage.store()
    calls: list[str] = []
    target._client.meta.events.register(
        "before-call.s3.PutObject", lambda **kw: calls.append("put")
    )
    target._conditional_writes()  # the probe: two PUTs of its own, through s3put
    data = uuid.uuid4().bytes * 64
    sha, _size = storage.sha256_file(_file(tmp_path, data))
    assert storage.put_source(_file(tmp_path, data), sha) == (storage.source_key(sha), True)
    assert storage.put_source(_file(tmp_path, data), sha) == (storage.source_key(sha), False)
    assert calls == []
    with storage.open_object(storage.source_key(sha)) as body:
        assert body.read() == data

    kept = target.backend.object_parameters
    target.backend.object_parameters = {"Metadata": {"origin": "test"}}
    try:
        other = uuid.uuid4().bytes * 64
        sha2, _size = storage.sha256_file(_file(tmp_path, other))
        again = storage.source_key(sha2)
        assert storage.put_source(_file(tmp_path, other), sha2) == (again, True)
        assert storage.put_source(_file(tmp_path, other), sha2) == (again, False)
    finally:
        target.backend.object_parameters = kept  # the store outlives this test
    assert calls == ["put", "put"]


def test_s3__source_puts_reuse_one_kept_alive_connection(s3_store, tmp_path):
    """``s3put``'s own connections: sequential source PUTs reuse one kept-alive connection
    (no connection per request), small and large (streamed) bodies alike."""
    target = storage.store()
    target._conditional_writes()
    connections = target._signed_put()._connections
    for data in (b"small " * 100, os.urandom(3 * s3put.INLINE_BODY)):
        sha, _size = storage.sha256_file(_file(tmp_path, data))
        assert storage.put_source(_file(tmp_path, data), sha) == (storage.source_key(sha), True)
        with storage.open_object(storage.source_key(sha)) as body:
            assert body.read() == data
    assert len(connections._idle) == 1
    assert connections._idle[0].sock is not None


def test_s3__a_source_put_on_a_dead_kept_alive_connection_is_retried(s3_store, tmp_path):
    """A kept-alive connection the server (or the network) has closed fails the request on
    it; the PUT is sent again on a new connection, and the source is stored once."""
    target = storage.store()
    target._conditional_writes()
    connections = target._signed_put()._connections
    assert connections._idle
    for conn in connections._idle:
        conn.sock.shutdown(socket.SHUT_RDWR)  # dead, and the pool does not know it
    data = uuid.uuid4().bytes * 64
    sha, _size = storage.sha256_file(_file(tmp_path, data))
    assert storage.put_source(_file(tmp_path, data), sha) == (storage.source_key(sha), True)
    assert storage.put_source(_file(tmp_path, data), sha) == (storage.source_key(sha), False)
    with storage.open_object(storage.source_key(sha)) as body:
        assert body.read() == data


@pytest.mark.parametrize("key", ["../etc/passwd", "/abs", "pages/../x", "a//b", "", "a b"])
def test_store__refuses_keys_outside_the_scheme(backend, key, tmp_path):
    with pytest.raises(ValueError):
        storage.put_file(key, _file(tmp_path, b"x"))


def test_keys__generation_is_an_explicit_part_of_the_key():
    job = uuid.uuid4()
    assert storage.page_key(job_id=job, page=7, generation=12, ext="png") == (
        f"pages/{job}/00007.g12.png"
    )
    parsed = storage.parse_key(f"pages/{job}/00007.g12.png")
    assert parsed == storage.ParsedKey(kind="pages", job_id=job, page=7, generation=12)
    assert storage.parse_key(f"results/{job}/result.g2.zip") == storage.ParsedKey(
        kind="results", job_id=job, generation=2
    )
    assert storage.parse_key("sources/ab/" + "ab" * 32) == storage.ParsedKey(
        kind="sources", sha256="ab" * 32
    )
    assert storage.parse_key("pages/not-a-job/1.txt") is None


def test_filesystem__objects_are_0600_in_0700_directories(settings, tmp_path):
    """Page and result files came out of converter children as 0644 in 0755 directories."""
    settings.QUIRE = {**settings.QUIRE, "STORAGE": "filesystem"}
    os.umask(0o022)
    job = uuid.uuid4()
    page = _file(tmp_path, b"p")
    page.chmod(0o644)
    storage.settle(
        [
            storage.put_file(
                storage.page_key(job_id=job, page=1, generation=1, ext="txt"), page, wait=False
            )
        ]
    )
    result = _file(tmp_path, b"r")
    result.chmod(0o644)
    storage.put_file(storage.result_key(job_id=job, generation=1, ext="txt"), result)
    fh, staged = storage.stage()
    fh.close()
    storage.put_source(staged, "cd" * 32)

    root = Path(settings.QUIRE["STORAGE_DIR"])
    files = [p for p in root.rglob("*") if p.is_file()]
    dirs = [root, *(p for p in root.rglob("*") if p.is_dir())]
    assert len(files) == 3
    assert {oct(stat.S_IMODE(p.stat().st_mode)) for p in files} == {"0o600"}
    assert {oct(stat.S_IMODE(p.stat().st_mode)) for p in dirs} == {"0o700"}


def test_s3__bucket_is_private(s3_server, settings, tmp_path):
    """An anonymous request (no signature) can neither read an object nor list the bucket."""
    settings.QUIRE = {
        **settings.QUIRE,
        "STORAGE": "s3",
        "S3": {
            **settings.QUIRE["S3"],
            "BUCKET": s3_server["QUIRE_S3_BUCKET"],
            "ENDPOINT_URL": s3_server["QUIRE_S3_ENDPOINT_URL"],
            "ADDRESSING_STYLE": "path",
            "PREFIX": f"test-{uuid.uuid4().hex}",
        },
    }
    key = storage.source_key("ef" * 32)
    storage.put_file(key, _file(tmp_path, b"secret"))
    endpoint, bucket = s3_server["QUIRE_S3_ENDPOINT_URL"], s3_server["QUIRE_S3_BUCKET"]
    name = f"{settings.QUIRE['S3']['PREFIX']}/{key}"
    for url in (f"{endpoint}/{bucket}/{name}", f"{endpoint}/{bucket}", f"{endpoint}/{bucket}/"):
        with pytest.raises(urllib.error.HTTPError) as denied:
            urllib.request.urlopen(url, timeout=10)  # noqa: S310 - our own test server
        assert denied.value.code == 403
    # The signed request succeeds, so the 403 is about the signature, not the key.
    assert storage.open_object(key).read() == b"secret"
    # And a presigned URL is a signed request a client can use without credentials.
    settings.QUIRE = {
        **settings.QUIRE,
        "S3": {**settings.QUIRE["S3"], "PRESIGN_TTL_S": 30.0},
    }
    url = storage.presigned_url(key, filename="x.txt", media_type="text/plain")
    assert url is not None and "Signature" in url
    with urllib.request.urlopen(url, timeout=10) as response:  # noqa: S310
        assert response.read() == b"secret"


def test_filesystem__has_no_presigned_urls(settings):
    settings.QUIRE = {**settings.QUIRE, "STORAGE": "filesystem"}
    assert storage.presigned_url("sources/ab/" + "ab" * 32, filename="x", media_type="x") is None


def test_store__choice_follows_settings(settings):
    settings.QUIRE = {**settings.QUIRE, "STORAGE": "nfs"}
    with pytest.raises(storage.StorageError):
        storage.store()
    settings.QUIRE = {**settings.QUIRE, "STORAGE": "filesystem"}
    assert storage.store().kind == "filesystem"


@pytest.mark.django_db(transaction=True)
def test_results__redirect_to_a_short_lived_presigned_url_when_configured(
    s3_server, settings, tmp_path, api, no_broker_publish, fast_quire
):
    import hashlib

    from tests import testdocs
    from tests.integration.execution.jobkit import execute, submit, unique_text

    settings.QUIRE = {
        **settings.QUIRE,
        "STORAGE": "s3",
        "S3": {
            **settings.QUIRE["S3"],
            "BUCKET": s3_server["QUIRE_S3_BUCKET"],
            "ENDPOINT_URL": s3_server["QUIRE_S3_ENDPOINT_URL"],
            "ADDRESSING_STYLE": "path",
            "PREFIX": f"test-{uuid.uuid4().hex}",
            "PRESIGN_TTL_S": 30.0,
        },
    }
    source = testdocs.make_pdf(tmp_path / "d.pdf", pages=2, text_of=unique_text())
    office = testdocs.make_docx(tmp_path / "d.docx", paragraphs=["Quire presigned"])
    job, png_job = submit(office, output="pdf"), submit(source, output="png")
    assert execute(job) == execute(png_job) == "succeeded"
    job.refresh_from_db()
    png_job.refresh_from_db()
    client = api()

    # A PNG result is the ZIP of its page objects, no object of its own: it is streamed.
    streamed = client.get(f"/api/v1/jobs/{png_job.id}/result")
    assert streamed.status_code == 200
    body = b"".join(streamed.streaming_content)
    assert hashlib.sha256(body).hexdigest() == png_job.result_sha256

    response = client.get(f"/api/v1/jobs/{job.id}/result")
    assert response.status_code == 302
    assert response["Cache-Control"] == "private, no-store"
    assert response["ETag"] == f'"{job.result_sha256}"'
    location = response["Location"]
    assert location.startswith(s3_server["QUIRE_S3_ENDPOINT_URL"])
    assert "X-Amz-Expires=30" in location
    with urllib.request.urlopen(location, timeout=10) as fetched:  # noqa: S310
        body = fetched.read()
        assert fetched.headers["Content-Type"] == "application/pdf"
    assert hashlib.sha256(body).hexdigest() == job.result_sha256

    page = client.get(f"/api/v1/jobs/{png_job.id}/pages/1")
    assert page.status_code == 302
    with urllib.request.urlopen(page["Location"], timeout=10) as fetched:  # noqa: S310
        assert fetched.read().startswith(b"\x89PNG")
    cached = client.get(f"/api/v1/jobs/{job.id}/result", HTTP_IF_NONE_MATCH=response["ETag"])
    assert cached.status_code == 304


def test_store__download_replaces_an_existing_file_and_copies_large_objects(backend, tmp_path):
    """A download truncates what ``dest`` held, and copies an object of several MB whole (the
    filesystem backend's ``copy_out``: ``sendfile`` until the size read at the start is
    copied, and the file gets the store's mode, as its ``chmod`` gave it)."""
    big = os.urandom(3 * 1024 * 1024 + 17)
    key = storage.result_key(job_id=uuid.uuid4(), generation=1, ext="bin")
    storage.put_file(key, _file(tmp_path, big))
    dest = tmp_path / "dest"
    dest.write_bytes(b"x" * (4 * 1024 * 1024))  # longer than the object
    dest.chmod(0o644)
    storage.download(key, dest)
    assert dest.read_bytes() == big
    if backend == "filesystem":
        assert stat.S_IMODE(dest.stat().st_mode) == 0o600
    small = storage.result_key(job_id=uuid.uuid4(), generation=1, ext="txt")
    storage.put_file(small, _file(tmp_path, b"hi"))
    storage.download(small, dest)
    assert dest.read_bytes() == b"hi"


def test_s3__the_source_download_bypasses_the_boto3_client(s3_store, tmp_path):
    """The worker's download is ``s3put``'s signed GET (no boto3 GetObject call): the server
    accepts its signature, small and streamed bodies arrive whole over one kept-alive
    connection, a missing object is FileNotFoundError, and a dead kept-alive connection is
    retried; customer-key encryption parameters send it back to boto3."""
    target = storage.store()
    calls: list[str] = []
    target._client.meta.events.register(
        "before-call.s3.GetObject", lambda **kw: calls.append("get")
    )
    dest = tmp_path / "dest"
    for data in (b"small " * 100, os.urandom(5 * s3put.BLOCK + 3)):
        key = storage.result_key(job_id=uuid.uuid4(), generation=1, ext="bin")
        storage.put_file(key, _file(tmp_path, data))
        storage.download(key, dest)
        assert dest.read_bytes() == data
        assert stat.S_IMODE(dest.stat().st_mode) == 0o600
    connections = target._signed_put()._connections
    assert len(connections._idle) == 1 and connections._idle[0].sock is not None
    with pytest.raises(FileNotFoundError):
        storage.download(storage.result_key(job_id=uuid.uuid4(), generation=1, ext="x"), dest)
    for conn in connections._idle:
        conn.sock.shutdown(socket.SHUT_RDWR)  # dead, and the pool does not know it
    storage.download(key, dest)
    assert dest.read_bytes() == data
    assert calls == []

    kept = target.backend.object_parameters
    target.backend.object_parameters = {**kept, "SSECustomerAlgorithm": "AES256"}
    try:
        dest.unlink()
        storage.download(key, dest)
    finally:
        target.backend.object_parameters = kept
    assert calls == ["get"]
    assert dest.read_bytes() == data
