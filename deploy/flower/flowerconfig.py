"""Flower's configuration file (``celery -A project flower --conf=deploy/flower/flowerconfig.py``).

Flower executes this file in its own process before it starts serving; its public names become
Flower options. It keeps every secret off the command line (docs/THREAT_MODEL.md §3: ``ps`` shows
every process's arguments to every local user) and closes what Flower leaves open:

* ``basic_auth`` from ``FLOWER_BASIC_AUTH`` (``user:password[,user2:password2]``) or the file
  named by ``FLOWER_BASIC_AUTH_FILE``; Flower refuses to start without it;
* ``broker_api`` (the management API URL with the monitor user's password) from
  ``FLOWER_BROKER_API`` or ``FLOWER_BROKER_API_FILE``; required;
* the broker connection from ``QUIRE_BROKER_MONITOR_URL`` (or ``…_FILE``) when set, so the
  monitor user's password never passes through an ``env VAR=…`` argument either;
* ``/metrics``, which Flower serves without authentication, behind the same basic auth;
* the event capture's reconnect delay, which Flower doubles without bound (2, 4, 8 … s: after a
  long broker outage it would show no events for many minutes), capped at
  ``QUIRE_FLOWER_RECONNECT_MAX_S`` (default 5 s).
"""

import os as _os


def _secret(name: str) -> str:
    path = _os.environ.get(f"{name}_FILE")
    if path:
        with open(path, encoding="utf-8") as handle:
            return handle.read().strip()
    return _os.environ.get(name, "").strip()


def _configure() -> tuple[list[str], str]:
    from flower.views import monitor
    from tornado import web

    credentials = _secret("FLOWER_BASIC_AUTH")
    if not credentials or any(":" not in c for c in credentials.split(",")):
        raise SystemExit("flower: set FLOWER_BASIC_AUTH=user:password (or FLOWER_BASIC_AUTH_FILE)")
    management_api = _secret("FLOWER_BROKER_API")
    if not management_api:
        raise SystemExit(
            "flower: set FLOWER_BROKER_API=http://monitor:password@host:15672/api/ "
            "(or FLOWER_BROKER_API_FILE)"
        )
    # Same check as every other Flower page: get_current_user answers 401 for missing or wrong
    # basic-auth credentials.
    if not getattr(monitor.Metrics.get, "__quire_authenticated__", False):
        monitor.Metrics.get = web.authenticated(monitor.Metrics.get)
        monitor.Metrics.get.__quire_authenticated__ = True

    broker_url = _secret("QUIRE_BROKER_MONITOR_URL")
    if broker_url:
        from project.celery import app

        app.conf.update(
            broker_url=broker_url, broker_read_url=broker_url, broker_write_url=broker_url
        )
    return credentials.split(","), management_api


def _reconnect_delays(cap: float):  # type: ignore[no-untyped-def]
    """Flower's delays before reconnecting the event capture (2, 4, 8 …), capped at ``cap``."""
    delay = 1.0
    while True:
        delay = min(delay * 2, cap)
        yield delay


def _cap_event_capture_backoff(cap: float) -> None:
    """``flower.events.Events.run`` as in Flower 2, with the delay from ``_reconnect_delays``."""
    import _thread
    import logging
    import time

    from celery.events import EventReceiver
    from flower import events

    if getattr(events.Events.run, "__quire_cap__", None) == cap:
        return
    logger = logging.getLogger("flower.events")

    def run(self):  # type: ignore[no-untyped-def]
        delays = _reconnect_delays(cap)
        while True:
            try:
                with self.capp.connection() as conn:
                    recv = EventReceiver(conn, handlers={"*": self.on_event}, app=self.capp)
                    delays = _reconnect_delays(cap)
                    logger.debug("Capturing events...")
                    recv.capture(limit=None, timeout=None, wakeup=True)
            except (KeyboardInterrupt, SystemExit):
                _thread.interrupt_main()
            except Exception as exc:
                delay = next(delays)
                logger.error(
                    "Failed to capture events: %s, trying again in %s seconds.",
                    type(exc).__name__,
                    delay,
                )
                time.sleep(delay)

    run.__quire_cap__ = cap  # type: ignore[attr-defined]
    events.Events.run = run


basic_auth, broker_api = _configure()
_cap_event_capture_backoff(float(_os.environ.get("QUIRE_FLOWER_RECONNECT_MAX_S", "5")))
