"""deploy/rabbitmq/apply.sh from a private checkout (issue 11 point 10).

A clone in a mode-0700 directory (what ``mktemp -d`` or a home directory gives) is unreadable to
the ``rabbitmq`` user the node runs as; apply.sh must still import the topology. This copies
deploy/rabbitmq into such a directory and applies it to a scratch vhost, with the real broker.

Run: ``.venv/bin/python -m pytest -q -p no:django tests/e2e/test_rabbitmq_apply_private_dir.py``
"""

from __future__ import annotations

import os
import shutil
import stat
import subprocess
import tempfile
import uuid
from pathlib import Path

import pytest

from tests.e2e import harness

pytestmark = pytest.mark.e2e

REPO = Path(__file__).resolve().parents[2]


def test_apply_from_a_0700_directory_imports_the_topology() -> None:
    vhost = f"{os.environ.get('QUIRE_RMQ_VHOST', 'quire')}_apply_{uuid.uuid4().hex[:8]}"
    private = Path(tempfile.mkdtemp(prefix="quire-private-"))
    try:
        assert stat.S_IMODE(private.stat().st_mode) == 0o700
        shutil.copytree(REPO / "deploy" / "rabbitmq", private / "rabbitmq")
        for path in (private / "rabbitmq").iterdir():
            path.chmod(0o600 if path.suffix == ".json" else 0o700)
        done = subprocess.run(
            ["bash", str(private / "rabbitmq" / "apply.sh")],
            env={**os.environ, "QUIRE_RMQ_VHOST": vhost},
            capture_output=True,
            text=True,
            timeout=300,
            check=False,
        )
        assert done.returncode == 0, done.stderr[-2000:]
        assert set(harness.queue_depths(vhost)) >= set(harness.QUEUES)
        exchanges = harness.rabbitmqctl("list_exchanges", "-p", vhost, "--no-table-headers", "name")
        assert {"quire.conversion", "quire.sweeps", "quire.dlx"} <= set(exchanges.split())
    finally:
        shutil.rmtree(private, ignore_errors=True)
        subprocess.run(
            ["rabbitmqctl", "--quiet", "delete_vhost", vhost],
            capture_output=True,
            timeout=120,
            check=False,
        )
