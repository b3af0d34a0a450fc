"""End-to-end checks of deploy/rabbitmq/ against the real broker.

Needs a RabbitMQ node on 127.0.0.1:5672 that this process can administer with
``rabbitmqctl`` (the broker host, as root). Nothing is mocked and nothing is
skipped: an unreachable broker or a failing ``apply.sh`` fails the module.

Run: ``.venv/bin/python -m pytest -q -p no:django tests/e2e/test_rabbitmq_topology.py``
"""

from __future__ import annotations

import os
import signal
import socket
import subprocess
import sys
import time
import uuid
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import amqp
import pytest
import requests
from amqp.exceptions import AccessRefused

from tests.e2e import harness
from tests.polling import wait_for

pytestmark = pytest.mark.e2e

HERE = Path(__file__).resolve().parent
REPO = HERE.parents[1]
APPLY = REPO / "deploy" / "rabbitmq" / "apply.sh"

HOST = os.environ.get("QUIRE_RMQ_HOST", "127.0.0.1")
PORT = int(os.environ.get("QUIRE_RMQ_PORT", "5672"))
MGMT = os.environ.get("QUIRE_RMQ_MGMT_URL", "http://127.0.0.1:15672").rstrip("/")
ADMIN = (
    os.environ.get("QUIRE_TEST_MGMT_USER", "guest"),
    os.environ.get("QUIRE_TEST_MGMT_PASSWORD", "guest"),
)
# apply.sh applies the identical topology to an isolated vhost for this module, so
# other suites' workers on "quire" cannot steal these messages and the purges here
# cannot touch theirs. QUIRE_TEST_RMQ_VHOST=quire tests the production vhost itself.
VHOST = os.environ.get(
    "QUIRE_TEST_RMQ_VHOST", os.environ.get("QUIRE_RMQ_VHOST", "quire") + "_e2e_topology"
)

USERS = {
    "publisher": (
        os.environ.get("QUIRE_RMQ_PUBLISHER_USER", "quire_publisher"),
        os.environ.get("QUIRE_RMQ_PUBLISHER_PASSWORD", "quire-publisher-dev"),
    ),
    "worker": (
        os.environ.get("QUIRE_RMQ_WORKER_USER", "quire_worker"),
        os.environ.get("QUIRE_RMQ_WORKER_PASSWORD", "quire-worker-dev"),
    ),
    "monitor": (
        os.environ.get("QUIRE_RMQ_MONITOR_USER", "quire_monitor"),
        os.environ.get("QUIRE_RMQ_MONITOR_PASSWORD", "quire-monitor-dev"),
    ),
}

PLUMBING = r"celeryev|celery\.pidbox|reply\.celery\.pidbox|celeryev\..+|.+\.celery\.pidbox"
EXPECTED_PERMISSIONS = {
    "publisher": (r"^$", r"^(quire\.conversion|quire\.sweeps)$", r"^$"),
    "worker": (
        rf"^({PLUMBING})$",
        rf"^({PLUMBING})$",
        rf"^(conversion\.v1|quire\.sweeps|{PLUMBING})$",
    ),
    "monitor": (
        r"^(celeryev|celery\.pidbox|reply\.celery\.pidbox|celeryev\..+|.+\.reply\.celery\.pidbox)$",
        r"^(celery\.pidbox|celeryev\..+|.+\.reply\.celery\.pidbox)$",
        r"^(celeryev|reply\.celery\.pidbox|celeryev\..+|.+\.reply\.celery\.pidbox)$",
    ),
}
EXPECTED_TAGS = {"publisher": [], "worker": [], "monitor": ["monitoring"]}

BUSINESS_QUEUES = ("conversion.v1", "conversion.v1.dead", "quire.sweeps")


# --------------------------------------------------------------------------- helpers
def url(role: str) -> str:
    user, password = USERS[role]
    return f"amqp://{user}:{password}@{HOST}:{PORT}/{VHOST}"


def connect(role: str) -> amqp.Connection:
    user, password = USERS[role]
    conn = amqp.Connection(
        f"{HOST}:{PORT}",
        userid=user,
        password=password,
        virtual_host=VHOST,
        connect_timeout=5,
        confirm_publish=True,  # basic_publish waits for the broker's ack
    )
    conn.connect()
    return conn


def queue_depths() -> dict[str, int]:
    """Message counts (ready + unacked) from the node: live for the classic queues, up to 5 s
    old for the quorum queue ``conversion.v1`` (``harness.queue_depths``; live:
    ``harness.ready_now``)."""
    return harness.queue_depths(VHOST)


def mgmt_get(path: str, auth=ADMIN):
    resp = requests.get(f"{MGMT}/api/{path}", auth=auth, timeout=5)
    resp.raise_for_status()
    return resp.json()


def stray_bodies(queue: str) -> list[bytes]:
    """For an assertion's message (evaluated only when it fails): the bodies of the ready
    messages in ``queue`` (up to 10, fetched as the worker user and requeued when its
    connection closes)."""
    conn = connect("worker")
    try:
        ch = conn.channel()
        bodies: list[bytes] = []
        while len(bodies) < 10 and (msg := ch.basic_get(queue, no_ack=False)) is not None:
            bodies.append(msg.body)
    finally:
        conn.close()  # unacked: every fetched message goes back
    return bodies


def delayed_delivery_objects() -> list[str]:
    names = [e["name"] for e in mgmt_get(f"exchanges/{VHOST}?columns=name")]
    names += [q["name"] for q in mgmt_get(f"queues/{VHOST}?columns=name")]
    return sorted(n for n in names if n.startswith("celery_delayed"))


def publish(conn: amqp.Connection, exchange: str, routing_key: str, body: bytes) -> None:
    ch = conn.channel()
    try:
        ch.basic_publish(
            amqp.Message(body, delivery_mode=2, content_type="application/octet-stream"),
            exchange=exchange,
            routing_key=routing_key,
            mandatory=True,
        )
    finally:
        if ch.is_open:
            ch.close()


def refused(fn) -> AccessRefused:
    """Run fn(channel) on a fresh channel and return the AccessRefused it raises."""

    def run(conn: amqp.Connection):
        ch = conn.channel()
        with pytest.raises(AccessRefused) as info:
            fn(ch)
        return info.value

    return run


def get_one(conn: amqp.Connection, queue: str, timeout: float = 5.0):
    ch = conn.channel()
    msg = wait_for(lambda: ch.basic_get(queue, no_ack=False), timeout, what=f"a message on {queue}")
    return ch, msg


# --------------------------------------------------------------------------- fixtures
@pytest.fixture(autouse=True)
def _isolated_storage():
    """Overrides tests/conftest.py's autouse fixture of the same name, which needs
    pytest-django's ``settings``: this module touches no Django, so it also runs
    under ``-p no:django``."""


@pytest.fixture(scope="session")
def applied() -> str:
    # Fail (never skip) when the broker is not there.
    try:
        socket.create_connection((HOST, PORT), timeout=5).close()
    except OSError as exc:
        pytest.fail(f"RabbitMQ is not reachable at {HOST}:{PORT}: {exc}")
    env = dict(os.environ, QUIRE_RMQ_VHOST=VHOST)
    for role, key in (("publisher", "PUBLISHER"), ("worker", "WORKER"), ("monitor", "MONITOR")):
        env[f"QUIRE_RMQ_{key}_USER"], env[f"QUIRE_RMQ_{key}_PASSWORD"] = USERS[role]
    proc = subprocess.run(
        ["bash", str(APPLY)], capture_output=True, text=True, env=env, timeout=300
    )
    assert proc.returncode == 0, f"apply.sh failed:\n{proc.stdout}\n{proc.stderr}"
    for _, password in USERS.values():
        assert password not in proc.stdout + proc.stderr, "apply.sh leaked a password"
    return proc.stdout


def purge_business_queues() -> None:
    with ThreadPoolExecutor(len(BUSINESS_QUEUES)) as pool:
        list(
            pool.map(lambda q: harness.rabbitmqctl("purge_queue", "-p", VHOST, q), BUSINESS_QUEUES)
        )


@pytest.fixture(scope="session")
def purge_at_end(applied):
    yield
    purge_business_queues()


@pytest.fixture(autouse=True)
def clean_queues(applied, purge_at_end):
    purge_business_queues()  # as the node admin (rabbitmqctl), never as a Quire user


@pytest.fixture
def publisher():
    conn = connect("publisher")
    yield conn
    conn.collect()


@pytest.fixture
def worker():
    conn = connect("worker")
    yield conn
    conn.collect()


# --------------------------------------------------------------------------- topology
def test_apply_prints_role_urls_and_topology_is_declared(applied):
    for role in ("publisher", "worker", "monitor"):
        user = USERS[role][0]
        assert f"amqp://{user}:****@" in applied

    queues = {q["name"]: q for q in mgmt_get(f"queues/{VHOST}")}
    cv1 = queues["conversion.v1"]
    assert cv1["durable"] and cv1["type"] == "quorum"
    assert cv1["arguments"] == {
        "x-queue-type": "quorum",
        "x-delivery-limit": 5,
        "x-dead-letter-exchange": "quire.dlx",
        "x-dead-letter-strategy": "at-most-once",
    }
    assert (
        queues["conversion.v1.dead"]["durable"]
        and queues["conversion.v1.dead"]["type"] == "classic"
    )
    sweeps = queues["quire.sweeps"]
    assert sweeps["durable"] and sweeps["type"] == "classic"
    assert sweeps["arguments"] == {
        "x-queue-type": "classic",
        "x-message-ttl": 5000,
        "x-max-length": 100,
        "x-overflow": "drop-head",
    }

    exchanges = {e["name"]: e for e in mgmt_get(f"exchanges/{VHOST}")}
    assert (
        exchanges["quire.conversion"]["type"] == "direct"
        and exchanges["quire.conversion"]["durable"]
    )
    assert exchanges["quire.sweeps"]["type"] == "direct" and exchanges["quire.sweeps"]["durable"]
    assert exchanges["quire.dlx"]["type"] == "fanout" and exchanges["quire.dlx"]["internal"]

    bindings = {
        (b["source"], b["destination"], b["routing_key"])
        for b in mgmt_get(f"bindings/{VHOST}")
        if b["source"]
    }
    assert ("quire.conversion", "conversion.v1", "conversion.v1") in bindings
    assert ("quire.dlx", "conversion.v1.dead", "") in bindings
    assert ("quire.sweeps", "quire.sweeps", "quire.sweeps") in bindings


def test_users_have_exactly_the_documented_permissions(applied):
    perms = {p["user"]: p for p in mgmt_get(f"vhosts/{VHOST}/permissions")}
    users = {u["name"]: u for u in mgmt_get("users")}
    for role, (configure, write, read) in EXPECTED_PERMISSIONS.items():
        user = USERS[role][0]
        assert (perms[user]["configure"], perms[user]["write"], perms[user]["read"]) == (
            configure,
            write,
            read,
        )
        tags = users[user]["tags"]
        tags = tags if isinstance(tags, list) else [t for t in tags.split(",") if t]
        assert tags == EXPECTED_TAGS[role]
    # guest is left alone: still the administrator, never granted on "quire".
    guest_tags = users["guest"]["tags"]
    assert "administrator" in (
        guest_tags if isinstance(guest_tags, list) else guest_tags.split(",")
    )
    assert "guest" not in perms


# --------------------------------------------------------------------------- publisher
def test_publisher_publishes_persistent_messages_with_confirms(publisher, worker):
    token = uuid.uuid4().bytes
    publish(publisher, "quire.conversion", "conversion.v1", token)  # returns after the broker ack
    publish(publisher, "quire.sweeps", "quire.sweeps", token)

    for queue in ("conversion.v1", "quire.sweeps"):
        ch, msg = get_one(worker, queue)
        assert msg.body == token
        assert msg.properties["delivery_mode"] == 2
        ch.basic_ack(msg.delivery_tag)
        ch.close()
    left = [harness.ready_now(q, vhost=VHOST) for q in ("conversion.v1", "quire.sweeps")]
    assert left == [0, 0]


def test_publisher_cannot_consume_configure_or_reach_other_exchanges(publisher):
    checks = [
        lambda ch: ch.basic_get("conversion.v1"),
        lambda ch: ch.basic_consume("conversion.v1", callback=lambda m: None),
        lambda ch: ch.basic_get("conversion.v1.dead"),
        lambda ch: ch.queue_purge("conversion.v1"),
        lambda ch: ch.queue_delete("conversion.v1"),
        lambda ch: ch.queue_delete("quire.sweeps"),
        lambda ch: ch.queue_declare("quire.rogue", durable=True, auto_delete=False),
        lambda ch: ch.queue_declare(
            "conversion.v1", durable=True, auto_delete=False, arguments={"x-queue-type": "quorum"}
        ),
        lambda ch: ch.exchange_declare("quire.rogue", "fanout", durable=True, auto_delete=False),
        lambda ch: ch.exchange_delete("quire.conversion"),
        # default exchange = "publish to any queue by name": not granted
        lambda ch: ch.basic_publish(amqp.Message(b"x"), exchange="", routing_key="conversion.v1"),
        lambda ch: ch.basic_publish(amqp.Message(b"x"), exchange="quire.dlx", routing_key=""),
        # cannot remote-control workers
        lambda ch: ch.basic_publish(amqp.Message(b"x"), exchange="celery.pidbox", routing_key=""),
        lambda ch: ch.basic_publish(amqp.Message(b"x"), exchange="celeryev", routing_key="task.x"),
    ]
    for check in checks:
        refused(check)(publisher)
    # Passive declares need no permission: this is what no_declare/passive producers rely on.
    ch = publisher.channel()
    assert ch.queue_declare("conversion.v1", passive=True).queue == "conversion.v1"
    ch.close()
    # nothing a refused publish sent is in the queue: read live (list_queues' count of a quorum
    # queue is up to 5 s old: it failed here once with the previous message counted)
    assert harness.ready_now("conversion.v1", vhost=VHOST) == 0, stray_bodies("conversion.v1")


# --------------------------------------------------------------------------- worker
def test_worker_consumes_but_cannot_publish_jobs_or_delete_queues(publisher, worker):
    publish(publisher, "quire.conversion", "conversion.v1", b"job-1")
    ch, msg = get_one(worker, "conversion.v1")
    assert msg.body == b"job-1"
    ch.basic_ack(msg.delivery_tag)
    ch.close()

    checks = [
        lambda ch: ch.basic_publish(
            amqp.Message(b"x", delivery_mode=2),
            exchange="quire.conversion",
            routing_key="conversion.v1",
        ),
        lambda ch: ch.basic_publish(
            amqp.Message(b"x"), exchange="quire.sweeps", routing_key="quire.sweeps"
        ),
        lambda ch: ch.basic_publish(amqp.Message(b"x"), exchange="", routing_key="conversion.v1"),
        lambda ch: ch.queue_delete("conversion.v1"),
        lambda ch: ch.queue_delete("quire.sweeps"),
        lambda ch: ch.queue_declare(
            "conversion.v1", durable=True, auto_delete=False, arguments={"x-queue-type": "quorum"}
        ),
        lambda ch: ch.exchange_delete("quire.conversion"),
        lambda ch: ch.basic_get("conversion.v1.dead"),
        # native delayed delivery topology is not granted
        lambda ch: ch.exchange_declare(
            "celery_delayed_27", "topic", durable=True, auto_delete=False
        ),
        lambda ch: ch.queue_declare(
            "celery_delayed_0",
            durable=True,
            auto_delete=False,
            arguments={"x-queue-type": "quorum"},
        ),
    ]
    for check in checks:
        refused(check)(worker)
    # nothing a refused publish sent is in the queue: read live (list_queues' count of a quorum
    # queue is up to 5 s old: it failed here once with the previous message counted)
    assert harness.ready_now("conversion.v1", vhost=VHOST) == 0, stray_bodies("conversion.v1")


def test_rejected_message_is_dead_lettered(publisher, worker):
    publish(publisher, "quire.conversion", "conversion.v1", b"poison")
    ch, msg = get_one(worker, "conversion.v1")
    ch.basic_reject(msg.delivery_tag, requeue=False)
    ch.close()
    wait_for(lambda: queue_depths().get("conversion.v1.dead") == 1, 10, what="dead letter")
    assert harness.ready_now("conversion.v1", vhost=VHOST) == 0  # live: a quorum queue's
    # list_queues count is up to 5 s old


def test_message_redelivered_past_the_delivery_limit_is_dead_lettered(publisher, worker):
    publish(publisher, "quire.conversion", "conversion.v1", b"crash-loop")
    ch = worker.channel()
    deliveries = 0
    deadline = time.monotonic() + 15
    while time.monotonic() < deadline:
        msg = ch.basic_get("conversion.v1", no_ack=False)
        if msg is None:
            if queue_depths().get("conversion.v1.dead") == 1:
                break
            time.sleep(0.1)
            continue
        deliveries += 1
        assert msg.body == b"crash-loop"
        ch.basic_reject(msg.delivery_tag, requeue=True)  # e.g. worker lost mid-job
    ch.close()
    ready = harness.ready_now("conversion.v1", vhost=VHOST)  # live (list_queues: ≤ 5 s old)
    assert (ready, queue_depths()["conversion.v1.dead"]) == (0, 1)
    # x-delivery-limit 5: the first delivery plus 5 returns, then dead-lettered
    # (x-delivery-count 0..5 on the deliveries).
    assert deliveries == 6, deliveries


@pytest.fixture(autouse=True)
def _own_broker_urls(monkeypatch: pytest.MonkeyPatch) -> None:
    """Celery lets CELERY_BROKER_*URL in the environment override an app's broker_url; the test
    run's own (the quire vhost's publisher) must not redirect these apps away from VHOST."""
    for name in ("CELERY_BROKER_URL", "CELERY_BROKER_READ_URL", "CELERY_BROKER_WRITE_URL"):
        monkeypatch.delenv(name, raising=False)


# --------------------------------------------------------------------------- real celery worker
def start_worker(tmp_path: Path, nodename: str, *, stock_consumer: bool = False):
    # Celery lets CELERY_BROKER_*URL from the environment override the app's broker: the test
    # run's own (the publisher's) must not leak into this worker.
    env = {k: v for k, v in os.environ.items() if not k.startswith("CELERY_BROKER")}
    env.update(
        PYTHONPATH=str(HERE) + os.pathsep + env.get("PYTHONPATH", ""),
        QUIRE_TOPOLOGY_BROKER_URL=url("worker"),
        QUIRE_TOPOLOGY_OUT_DIR=str(tmp_path),
        QUIRE_TOPOLOGY_STOCK_CONSUMER="1" if stock_consumer else "0",
        C_FORCE_ROOT="1",
    )
    env.pop("DJANGO_SETTINGS_MODULE", None)
    log = tmp_path / f"{nodename}.log"
    proc = subprocess.Popen(
        [
            sys.executable,
            "-m",
            "celery",
            "-A",
            "_topology_app",
            "worker",
            "-E",
            "-Q",
            "conversion.v1,quire.sweeps",
            "-n",
            f"{nodename}@%h",
            "-P",
            "solo",
            "-l",
            "INFO",
        ],
        cwd=HERE,
        env=env,
        stdout=log.open("w"),
        stderr=subprocess.STDOUT,
        start_new_session=True,
    )
    return proc, log


def stop_worker(proc: subprocess.Popen) -> None:
    if proc.poll() is None:
        proc.send_signal(signal.SIGTERM)
        try:
            proc.wait(timeout=15)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait(timeout=5)


def wait_ready(proc: subprocess.Popen, log: Path, timeout: float = 30) -> str:
    def ready():
        assert proc.poll() is None, f"worker exited early:\n{log.read_text()}"
        return " ready." in log.read_text()

    wait_for(ready, timeout, what=f"worker ready ({log})")
    return log.read_text()


def test_celery_worker_as_quire_worker_consumes_and_answers_control(tmp_path):
    sys.path.insert(0, str(HERE))
    try:
        import _topology_app
    finally:
        sys.path.remove(str(HERE))

    web = _topology_app.make_app(url("publisher"))  # web + beat
    flower = _topology_app.make_app(url("monitor"))  # Flower
    proc, log = start_worker(tmp_path, "topology")
    try:
        wait_ready(proc, log)
        hostname = f"topology@{socket.gethostname()}"

        # Control/event plumbing is exclusive + auto-delete (works on 3.x and 4.x).
        queues = {
            q["name"]: q
            for q in mgmt_get(f"queues/{VHOST}?columns=name,exclusive,durable,auto_delete")
        }
        pidbox = queues[f"{hostname}.celery.pidbox"]
        assert pidbox["exclusive"] and not pidbox["durable"] and pidbox["auto_delete"], pidbox
        events_queues = [q for n, q in queues.items() if n.startswith("celeryev.")]
        assert events_queues and all(q["exclusive"] and q["auto_delete"] for q in events_queues)

        # web/beat side: publisher user, no_declare queues, explicit exchange routes, confirms.
        job = uuid.uuid4().hex
        sweep = uuid.uuid4().hex
        web.send_task("quire_topology.record", args=[job])
        web.send_task("quire_topology.sweep", args=[sweep])
        wait_for(lambda: (tmp_path / f"{job}.done").exists(), 15, what="conversion task executed")
        wait_for(lambda: (tmp_path / f"{sweep}.done").exists(), 15, what="sweep task executed")

        # Flower side: monitor user pings/inspects the worker and receives its events.
        replies = flower.control.ping(destination=[hostname], timeout=2)
        assert replies == [{hostname: {"ok": "pong"}}], replies
        active = flower.control.inspect(destination=[hostname], timeout=2).active_queues()
        assert {q["name"] for q in active[hostname]} == {"conversion.v1", "quire.sweeps"}
        events: list[dict] = []
        with flower.connection_for_read() as conn:
            recv = flower.events.Receiver(conn, handlers={"*": events.append})
            deadline = time.monotonic() + 10  # worker-heartbeat every 2 s
            while time.monotonic() < deadline:
                if any(e.get("hostname") == hostname for e in events):
                    break
                try:
                    recv.capture(limit=1, timeout=1, wakeup=False)
                except TimeoutError:
                    pass
        assert any(e.get("hostname") == hostname for e in events), events

        # The publisher cannot drive remote control.
        with pytest.raises(AccessRefused):
            web.control.ping(timeout=1)

        assert proc.poll() is None, "worker died"
    finally:
        stop_worker(proc)
        web.close()
        flower.close()

    output = log.read_text()
    assert "ACCESS_REFUSED" not in output, output
    assert "delayed delivery" not in output.lower(), output
    assert "Global QoS is disabled" in output
    assert delayed_delivery_objects() == []


def test_stock_consumer_is_refused_native_delayed_delivery(tmp_path):
    """Guard: the stock consumer tries celery_delayed_* and is refused."""
    proc, log = start_worker(tmp_path, "stock", stock_consumer=True)
    try:
        wait_ready(proc, log)
    finally:
        stop_worker(proc)
    output = log.read_text()
    assert "ACCESS_REFUSED - access to exchange 'celery_delayed_" in output, output
    assert "Native delayed delivery will not be available" in output
    assert delayed_delivery_objects() == []
