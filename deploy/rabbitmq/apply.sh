#!/usr/bin/env bash
# Apply Quire's RabbitMQ topology and least-privilege users to a running node.
#
# Idempotent: safe to run any number of times, on a node that was just started
# or on one that already carries the topology. Must run on the broker host as a
# user that can drive `rabbitmqctl` / `rabbitmq-plugins` (root or rabbitmq):
# the CLI authenticates with the Erlang cookie, so no admin password is needed.
#
#   sudo QUIRE_RMQ_PUBLISHER_PASSWORD=... QUIRE_RMQ_WORKER_PASSWORD=... \
#        QUIRE_RMQ_MONITOR_PASSWORD=... deploy/rabbitmq/apply.sh
#
# Environment (all optional; the defaults are development values):
#   QUIRE_RMQ_PUBLISHER_USER / _PASSWORD   default quire_publisher / quire-publisher-dev
#   QUIRE_RMQ_WORKER_USER    / _PASSWORD   default quire_worker    / quire-worker-dev
#   QUIRE_RMQ_MONITOR_USER   / _PASSWORD   default quire_monitor   / quire-monitor-dev
#   QUIRE_RMQ_ADMIN_USER / _PASSWORD       optional: an operator account (tag administrator,
#                                          full permissions on "quire"); only when both are set.
#                                          A node that loads definitions at boot creates no
#                                          default guest user, so this is the way to get one.
#   QUIRE_RMQ_HOST            host printed in the broker URLs     (default 127.0.0.1)
#   QUIRE_RMQ_PORT            AMQP port printed in the URLs       (default 5672)
#   QUIRE_RMQ_MGMT_URL        management API base URL             (default http://127.0.0.1:15672)
#   QUIRE_RMQ_CONSUMER_TIMEOUT_MS  runtime consumer_timeout       (default 7200000 = 2 h)
#   QUIRE_RMQ_WAIT_SECONDS    how long to wait for node / management API (default 120)
#   QUIRE_RMQ_VHOST           vhost to apply to (default quire; others get a renamed copy of the definitions)
#   QUIRE_RMQ_NODE            target node name for the CLI tools, e.g. rabbit@mq1 (default: local default)
#   RABBITMQCTL, RABBITMQ_PLUGINS  CLI paths (default from PATH)
#
# Passwords are passed to rabbitmqctl on stdin (never on argv) and never printed.
set -euo pipefail

HERE="$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)"
DEFINITIONS="${HERE}/definitions.json"
# definitions.json declares everything on vhost "quire". QUIRE_RMQ_VHOST applies
# the same topology to another vhost (e.g. an isolated test vhost).
VHOST="${QUIRE_RMQ_VHOST:-quire}"

RABBITMQCTL="${RABBITMQCTL:-rabbitmqctl}"
RABBITMQ_PLUGINS="${RABBITMQ_PLUGINS:-rabbitmq-plugins}"
WAIT_SECONDS="${QUIRE_RMQ_WAIT_SECONDS:-120}"
AMQP_HOST="${QUIRE_RMQ_HOST:-127.0.0.1}"
AMQP_PORT="${QUIRE_RMQ_PORT:-5672}"
MGMT_URL="${QUIRE_RMQ_MGMT_URL:-http://127.0.0.1:15672}"
CONSUMER_TIMEOUT_MS="${QUIRE_RMQ_CONSUMER_TIMEOUT_MS:-7200000}"
NODE_ARGS=()
[[ -n "${QUIRE_RMQ_NODE:-}" ]] && NODE_ARGS=(-n "${QUIRE_RMQ_NODE}")

PUBLISHER_USER="${QUIRE_RMQ_PUBLISHER_USER:-quire_publisher}"
PUBLISHER_PASSWORD="${QUIRE_RMQ_PUBLISHER_PASSWORD:-quire-publisher-dev}"
WORKER_USER="${QUIRE_RMQ_WORKER_USER:-quire_worker}"
WORKER_PASSWORD="${QUIRE_RMQ_WORKER_PASSWORD:-quire-worker-dev}"
MONITOR_USER="${QUIRE_RMQ_MONITOR_USER:-quire_monitor}"
MONITOR_PASSWORD="${QUIRE_RMQ_MONITOR_PASSWORD:-quire-monitor-dev}"

# ---------------------------------------------------------------------------
# Permission regexes (configure / write / read) on vhost "quire".
# RabbitMQ matches one regex against both exchange and queue names, so the
# Celery plumbing names are spelled out exactly. See README.md for the
# operation -> permission table these were derived from.
#
# Celery plumbing (defaults of Celery 5.7):
#   celery.pidbox              fanout exchange, remote-control broadcast
#   reply.celery.pidbox        direct exchange, remote-control replies
#   celeryev                   topic exchange, task/worker events
#   <hostname>.celery.pidbox   a worker's control queue (exclusive)
#   <oid>.reply.celery.pidbox  a controller's reply queue (exclusive)
#   celeryev.<uuid>            an event receiver's queue (exclusive)
# Nothing grants celery_delayed_* (native delayed delivery is removed from the
# worker consumer; Quire uses no ETA/countdown).
# ---------------------------------------------------------------------------
PLUMBING_WORKER='celeryev|celery\.pidbox|reply\.celery\.pidbox|celeryev\..+|.+\.celery\.pidbox'

# web + beat: publish to the two business exchanges, nothing else.
PUBLISHER_CONFIGURE='^$'
PUBLISHER_WRITE='^(quire\.conversion|quire\.sweeps)$'
PUBLISHER_READ='^$'

# conversion workers + sweeper: consume the two business queues; declare, bind,
# publish and consume only their own control/event plumbing. No configure on
# business objects (cannot declare/delete conversion.v1), no write on
# quire.conversion / quire.sweeps (cannot publish jobs).
WORKER_CONFIGURE="^(${PLUMBING_WORKER})\$"
WORKER_WRITE="^(${PLUMBING_WORKER})\$"
WORKER_READ="^(conversion\\.v1|quire\\.sweeps|${PLUMBING_WORKER})\$"

# Flower: receive events (own celeryev.<uuid> queue bound to celeryev) and run
# inspect/control (publish to celery.pidbox, own <oid>.reply.celery.pidbox
# queue bound to reply.celery.pidbox). No business queue access.
MONITOR_CONFIGURE='^(celeryev|celery\.pidbox|reply\.celery\.pidbox|celeryev\..+|.+\.reply\.celery\.pidbox)$'
MONITOR_WRITE='^(celery\.pidbox|celeryev\..+|.+\.reply\.celery\.pidbox)$'
MONITOR_READ='^(celeryev|reply\.celery\.pidbox|celeryev\..+|.+\.reply\.celery\.pidbox)$'

log() { printf '[quire-rmq] %s\n' "$*" >&2; }
die() { log "ERROR: $*"; exit 1; }
ctl() { "${RABBITMQCTL}" "${NODE_ARGS[@]}" --quiet "$@"; }
plugins() { "${RABBITMQ_PLUGINS}" "${NODE_ARGS[@]}" --quiet "$@"; }

command -v "${RABBITMQCTL}" >/dev/null 2>&1 || die "rabbitmqctl not found (set RABBITMQCTL)"
command -v "${RABBITMQ_PLUGINS}" >/dev/null 2>&1 || die "rabbitmq-plugins not found (set RABBITMQ_PLUGINS)"
[[ -r "${DEFINITIONS}" ]] || die "missing ${DEFINITIONS}"

# 1. Node up (a freshly started node may still be booting). ---------------------
log "waiting for the RabbitMQ node to finish booting (up to ${WAIT_SECONDS}s)"
# await_startup fails at once while the node is not yet registered with epmd,
# so retry it until the deadline.
deadline=$((SECONDS + WAIT_SECONDS))
until ctl await_startup --timeout 10 >/dev/null 2>&1; do
  (( SECONDS < deadline )) || die "RabbitMQ node did not come up within ${WAIT_SECONDS}s"
  sleep 1
done

# 2. Management plugin (Flower --broker-api and the monitoring tag need it). ----
if plugins is_enabled rabbitmq_management >/dev/null 2>&1; then
  log "rabbitmq_management already enabled"
else
  log "enabling rabbitmq_management"
  plugins enable rabbitmq_management >/dev/null
fi

mgmt_answers() {
  # Any HTTP status (401 without credentials) means the API listener is up.
  if command -v curl >/dev/null 2>&1; then
    local code
    code="$(curl -s -o /dev/null -m 3 -w '%{http_code}' "${MGMT_URL}/api/overview" 2>/dev/null || true)"
    [[ -n "${code}" && "${code}" != "000" ]]
  else
    local hostport="${MGMT_URL#*://}"; hostport="${hostport%%/*}"
    (exec 3<>"/dev/tcp/${hostport%%:*}/${hostport##*:}") 2>/dev/null
  fi
}
log "waiting for the management API at ${MGMT_URL}"
deadline=$((SECONDS + WAIT_SECONDS))
until mgmt_answers; do
  (( SECONDS < deadline )) || die "management API did not answer at ${MGMT_URL} within ${WAIT_SECONDS}s"
  sleep 1
done

# 3. Topology: vhost, exchanges, queues, bindings. ------------------------------
# import_definitions only creates/updates; it never deletes, so re-running is safe.
[[ "${VHOST}" =~ ^[A-Za-z0-9_.-]+$ ]] || die "QUIRE_RMQ_VHOST must match [A-Za-z0-9_.-]+"
# The definitions go in on standard input: given a path, the node reads the file itself as the
# `rabbitmq` user, which cannot read a checkout in a private directory (mode 0700, as `mktemp -d`
# or a home directory makes). definitions.json names vhost "quire"; another QUIRE_RMQ_VHOST gets a
# renamed copy of the same topology.
log "importing ${DEFINITIONS} into vhost ${VHOST}"
sed -e "s/\"vhost\": \"quire\"/\"vhost\": \"${VHOST}\"/g" \
    -e "s/{\"name\": \"quire\"}/{\"name\": \"${VHOST}\"}/" "${DEFINITIONS}" \
  | ctl import_definitions --format json >/dev/null

# 4. Users and permissions. -------------------------------------------------------
existing_users="$(ctl list_users --no-table-headers 2>/dev/null | awk '{print $1}')"

ensure_user() {  # name password tags configure write read
  local name="$1" password="$2" tags="$3" conf="$4" write="$5" read="$6"
  [[ -n "${password}" ]] || die "empty password for ${name}"
  if grep -qxF -- "${name}" <<<"${existing_users}"; then
    log "user ${name}: exists, resetting password"
    printf '%s' "${password}" | ctl change_password -- "${name}" >/dev/null
  else
    log "user ${name}: creating"
    printf '%s' "${password}" | ctl add_user -- "${name}" >/dev/null
  fi
  # shellcheck disable=SC2086  # tags is a (possibly empty) word list
  ctl set_user_tags -- "${name}" ${tags} >/dev/null
  ctl set_permissions -p "${VHOST}" -- "${name}" "${conf}" "${write}" "${read}" >/dev/null
  log "user ${name}: tags=[${tags}] configure=${conf} write=${write} read=${read}"
}

ensure_user "${PUBLISHER_USER}" "${PUBLISHER_PASSWORD}" "" \
  "${PUBLISHER_CONFIGURE}" "${PUBLISHER_WRITE}" "${PUBLISHER_READ}"
ensure_user "${WORKER_USER}" "${WORKER_PASSWORD}" "" \
  "${WORKER_CONFIGURE}" "${WORKER_WRITE}" "${WORKER_READ}"
ensure_user "${MONITOR_USER}" "${MONITOR_PASSWORD}" "monitoring" \
  "${MONITOR_CONFIGURE}" "${MONITOR_WRITE}" "${MONITOR_READ}"

if [[ -n "${QUIRE_RMQ_ADMIN_USER:-}" && -n "${QUIRE_RMQ_ADMIN_PASSWORD:-}" ]]; then
  ensure_user "${QUIRE_RMQ_ADMIN_USER}" "${QUIRE_RMQ_ADMIN_PASSWORD}" "administrator" '.*' '.*' '.*'
fi

for var in PUBLISHER WORKER MONITOR; do
  pw_var="QUIRE_RMQ_${var}_PASSWORD"
  [[ -n "${!pw_var:-}" ]] || log "WARNING: ${pw_var} not set, using the development default"
done

# 5. consumer_timeout at runtime (rabbitmq.conf carries the persistent value). --
# Jobs run up to 1 h with acks_late; the broker must not close the channel of a
# worker that holds an unacked delivery for that long. Applies to channels
# opened after this call.
if [[ "${CONSUMER_TIMEOUT_MS}" =~ ^[0-9]+$ ]]; then
  if ctl eval "application:set_env(rabbit, consumer_timeout, ${CONSUMER_TIMEOUT_MS})." >/dev/null; then
    log "consumer_timeout set to ${CONSUMER_TIMEOUT_MS} ms at runtime"
  else
    log "WARNING: could not set consumer_timeout at runtime; rely on rabbitmq.conf"
  fi
else
  die "QUIRE_RMQ_CONSUMER_TIMEOUT_MS must be an integer (ms)"
fi

# 6. Broker URLs (passwords masked). ---------------------------------------------
cat <<EOF
Quire RabbitMQ topology applied on vhost '${VHOST}'.
  web + beat  CELERY_BROKER_URL=amqp://${PUBLISHER_USER}:****@${AMQP_HOST}:${AMQP_PORT}/${VHOST}
  worker      CELERY_BROKER_URL=amqp://${WORKER_USER}:****@${AMQP_HOST}:${AMQP_PORT}/${VHOST}
  sweeper     CELERY_BROKER_URL=amqp://${WORKER_USER}:****@${AMQP_HOST}:${AMQP_PORT}/${VHOST}
  flower      CELERY_BROKER_URL=amqp://${MONITOR_USER}:****@${AMQP_HOST}:${AMQP_PORT}/${VHOST}
              FLOWER_BROKER_API=${MGMT_URL%/}/api/  (user ${MONITOR_USER}, tag monitoring)
EOF
