"""The ``quire`` command line (typer + rich).

Exit codes: 0 every job succeeded; 2 some job (or file) is partial, failed, cancelled or was
refused (each listed with its code); 1 a usage, configuration, authentication or connection
error. Configuration: ``QUIRE_URL`` and ``QUIRE_TOKEN``, or ``--url`` / ``--token``.
"""

from __future__ import annotations

import asyncio
import json
import sys
from pathlib import Path
from typing import Annotated, Any

import click
import typer
from rich.console import Console
from rich.table import Table

from quire_client import errors
from quire_client._core import RetryPolicy
from quire_client.aio import AsyncClient
from quire_client.batch import NOT_SUCCEEDED, RESULT_EXT, Batch, Outcome, collect
from quire_client.client import Client
from quire_client.display import JsonReporter, PlainReporter, RichReporter
from quire_client.models import OUTPUTS, Job, PagesSummary

app = typer.Typer(
    name="quire",
    help="Convert documents with a Quire server. Exit codes: 0 all succeeded, 2 some did not,"
    " 1 error.",
    no_args_is_help=True,
    add_completion=False,
    pretty_exceptions_enable=False,
)
err = Console(stderr=True)

#: the CLI waits longer on a busy server than a library call would (429 while at quota)
CLI_RETRY = RetryPolicy(max_attempts=40, max_wait_s=30.0)


class Config:
    """The server and token of this invocation."""

    def __init__(self, url: str | None, token: str | None) -> None:
        if not url:
            raise click.UsageError("no server: set QUIRE_URL or pass --url")
        self.url = url
        self.token = token

    def client(self) -> Client:
        return Client(self.url, self.token, retry=CLI_RETRY)

    def async_client(self, *, concurrency: int) -> AsyncClient:
        return AsyncClient(
            self.url,
            self.token,
            retry=CLI_RETRY,
            max_connections=concurrency + 4,
            lanes=concurrency,
        )


@app.callback()
def configure(
    ctx: typer.Context,
    url: Annotated[
        str | None, typer.Option(envvar="QUIRE_URL", help="server, e.g. http://127.0.0.1:8000")
    ] = None,
    token: Annotated[
        str | None,
        typer.Option(envvar="QUIRE_TOKEN", help="bearer token (JWT)", show_default=False),
    ] = None,
) -> None:
    """Quire's command line."""
    ctx.obj = (url, token)


def _config(ctx: typer.Context) -> Config:
    url, token = ctx.obj
    return Config(url, token)


def parse_options(pairs: list[str]) -> dict[str, Any]:
    """``k=v`` pairs as the options object: a value that reads as JSON (``200``, ``false``,
    ``[1, 3]``) is that value, anything else (``1-3``) a string."""
    options: dict[str, Any] = {}
    for pair in pairs:
        key, sep, value = pair.partition("=")
        if not sep or not key:
            raise click.BadParameter(f"{pair!r} is not key=value", param_hint="--option")
        try:
            options[key] = json.loads(value)
        except json.JSONDecodeError:
            options[key] = value
    return options


@app.command()
def submit(
    ctx: typer.Context,
    paths: Annotated[list[Path], typer.Argument(help="files, or directories to walk", exists=True)],
    output: Annotated[str, typer.Option("--output", "-o", help="text, png or pdf")],
    out: Annotated[Path, typer.Option("--out", help="directory for the results and the manifest")],
    option: Annotated[
        list[str] | None, typer.Option("--option", help="conversion option k=v (repeatable)")
    ] = None,
    concurrency: Annotated[
        int, typer.Option(min=1, max=256, help="files submitted / followed at once")
    ] = 8,
    as_json: Annotated[bool, typer.Option("--json", help="JSON lines on stdout")] = False,
) -> None:
    """Convert files: submit, follow live progress, download and verify each result into OUT.

    Resumable: a re-run with the same OUT skips results already downloaded and verified and
    never creates a second job for a file (the Idempotency-Key is the file's digest plus the
    options)."""
    if output not in OUTPUTS:
        raise click.BadParameter(f"must be one of {', '.join(OUTPUTS)}", param_hint="--output")
    config = _config(ctx)
    options = parse_options(option or [])
    try:
        items = collect(paths, out, output)
    except FileNotFoundError as exc:
        raise click.UsageError(str(exc)) from exc
    if not items:
        raise click.UsageError("no files to submit")
    if as_json:
        reporter: Any = JsonReporter()
    elif sys.stdout.isatty():
        reporter = RichReporter()
    else:
        reporter = PlainReporter()

    async def run() -> Outcome:
        async with config.async_client(concurrency=concurrency) as client:
            batch = Batch(
                client,
                items=items,
                output=output,
                options=options,
                out=out,
                concurrency=concurrency,
                reporter=reporter,
            )
            return await batch.run()

    outcome = _guard(lambda: _run_loop(run))
    _summary(outcome, as_json=as_json)
    raise typer.Exit(outcome.exit_code)


def _run_loop(main: Any) -> Any:
    """``asyncio.run(main())``, on uvloop when it is installed (``pip install
    quire-client[fast]``): less CPU per request on a busy batch (bench/cli.py)."""
    try:
        import uvloop
    except ImportError:
        return asyncio.run(main())
    with asyncio.Runner(loop_factory=uvloop.new_event_loop) as runner:
        return runner.run(main())


def _summary(outcome: Outcome, *, as_json: bool) -> None:
    failures = outcome.failures
    succeeded = len(outcome.items) - len(failures)
    skipped = sum(1 for i in outcome.items if i.skipped)
    if as_json:
        JsonReporter().emit(
            "summary",
            files=len(outcome.items),
            succeeded=succeeded,
            skipped=skipped,
            not_succeeded=[
                {"file": i.name, "job_id": i.job_id, "state": i.state, "error_code": i.error_code}
                for i in failures
            ],
            exit_code=outcome.exit_code,
        )
        return
    print(f"quire: {succeeded}/{len(outcome.items)} succeeded ({skipped} already done)")
    for item in failures:
        print(f"  {item.state:<9} {item.error_code or '-':<24} {item.name}  {item.job_id or ''}")


def _guard(call: Any) -> Any:
    """Run ``call``; an error that stops the whole command exits 1 with its code."""
    try:
        return call()
    except errors.ConnectionFailed as exc:
        err.print(f"quire: cannot reach the server ({exc.code}): {exc}")
    except (errors.NotAuthenticated, errors.InvalidToken, errors.InsufficientScope) as exc:
        err.print(f"quire: {exc.code}: check QUIRE_TOKEN / --token ({exc})")
    except errors.NotFound as exc:
        err.print(f"quire: {exc.code}: no such job")
    except errors.QuireError as exc:
        err.print(f"quire: {exc.code}: {exc}")
    except KeyboardInterrupt:
        err.print("quire: interrupted (re-run the same command to resume)")
    raise typer.Exit(1)


#: The arguments several commands take.
JobId = Annotated[str, typer.Argument(help="job id")]
AsJson = Annotated[bool, typer.Option("--json")]


def _done_of(pages: PagesSummary) -> str:
    """A job's or a snapshot's pages as ``done/total`` (``?``: not counted yet)."""
    return f"{pages.done}/{pages.total if pages.total is not None else '?'}"


def _job_line(job: Job) -> str:
    code = f" {job.error.code}" if job.error else ""
    pages = f"pages {_done_of(job.pages)} failed {job.pages.failed}"
    return f"{job.id} {job.state}{code} {pages} output {job.output}"


def _print_job(job: Job, *, as_json: bool) -> None:
    print(json.dumps(job.to_dict(), default=str) if as_json else _job_line(job))


def _job_exit(job: Job) -> int:
    return 2 if job.state in NOT_SUCCEEDED else 0


@app.command()
def status(
    ctx: typer.Context,
    job_id: JobId,
    as_json: AsJson = False,
) -> None:
    """Show a job's state, page counters and error."""
    with _config(ctx).client() as client:
        job = _guard(lambda: client.get(job_id))
    _print_job(job, as_json=as_json)


@app.command()
def wait(
    ctx: typer.Context,
    job_id: JobId,
    as_json: AsJson = False,
) -> None:
    """Follow a job until it ends (live page progress); exit 0 if it succeeded, 2 if not."""

    def show(snapshot: Any) -> None:
        if as_json:
            print(
                json.dumps(
                    {
                        "event": "progress",
                        "job_id": snapshot.id,
                        "state": snapshot.state,
                        "pages_total": snapshot.pages.total,
                        "pages_done": snapshot.pages.done,
                        "pages_failed": snapshot.pages.failed,
                    }
                ),
                flush=True,
            )
        else:
            print(f"{snapshot.state} pages {_done_of(snapshot.pages)}", flush=True)

    with _config(ctx).client() as client:
        job = _guard(lambda: client.wait(job_id, on_progress=show))
    _print_job(job, as_json=as_json)
    raise typer.Exit(_job_exit(job))


@app.command()
def get(
    ctx: typer.Context,
    job_id: JobId,
    out: Annotated[Path, typer.Option("--out", help="directory to write the result to")],
) -> None:
    """Download a finished job's result into OUT (verified against its sha256)."""
    with _config(ctx).client() as client:
        job = _guard(lambda: client.get(job_id))
        if job.result is None:
            code = (
                job.error.code if job.error else ("not_ready" if not job.terminal else "no_result")
            )
            print(f"{job.id} {job.state} {code}: no result to download")
            raise typer.Exit(2)
        result = job.result
        dest = out / f"{job.id}.{RESULT_EXT[job.output]}"
        path = _guard(lambda: client.download(job_id, dest, sha256=result.sha256))
    print(f"{job.id} {job.state} -> {path} (sha256 {result.sha256})")
    raise typer.Exit(_job_exit(job))


@app.command()
def cancel(
    ctx: typer.Context,
    job_id: JobId,
) -> None:
    """Cancel a job; exit 2 if it had already finished (too_late)."""
    with _config(ctx).client() as client:

        def call() -> Job:
            try:
                return client.cancel(job_id)
            except errors.TooLate as exc:
                print(f"{job_id} {exc.code}: the job already ended ({exc.extras.get('job_state')})")
                raise typer.Exit(2) from exc

        job = _guard(call)
    print(_job_line(job))


@app.command("ls")
def list_jobs(
    ctx: typer.Context,
    state: Annotated[str | None, typer.Option(help="only jobs in this state")] = None,
    limit: Annotated[int, typer.Option(min=1, help="at most this many jobs")] = 50,
    as_json: AsJson = False,
) -> None:
    """List the tenant's jobs, newest first."""

    def fetch() -> list[Job]:
        with _config(ctx).client() as client:
            jobs: list[Job] = []
            for job in client.list(state=state, page_size=min(limit, 100)):
                jobs.append(job)
                if len(jobs) >= limit:
                    break
            return jobs

    jobs = _guard(fetch)
    if as_json:
        for job in jobs:
            print(json.dumps(job.to_dict(), default=str))
        return
    table = Table("id", "state", "output", "pages", "error", "created")
    for job in jobs:
        table.add_row(
            job.id,
            job.state,
            job.output,
            _done_of(job.pages),
            job.error.code if job.error else "",
            job.created_at.isoformat(timespec="seconds"),
        )
    Console().print(table)


def main() -> None:
    """The ``quire`` entry point: click's usage errors exit 1 (not click's 2, which means
    "some did not succeed" here)."""
    try:
        code = app(standalone_mode=False)
    except click.exceptions.UsageError as exc:
        exc.show()
        sys.exit(1)
    except click.exceptions.Abort:
        sys.exit(1)
    except click.exceptions.Exit as exc:
        sys.exit(exc.exit_code)
    sys.exit(code if isinstance(code, int) else 0)
