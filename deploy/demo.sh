#!/usr/bin/env bash
# Quire's main job on a fresh machine: set up, start the whole stack (web, worker, sweeper,
# beat) in the standalone profile (SQLite + server-less broker, published development secrets;
# set DATABASE_URL, CELERY_BROKER_URL and the secrets of docs/OPERABILITY.md §2 for the
# production profile), submit the bundled sample documents through
# the real HTTP API, follow them to the end and save the results under var/demo-results/.
set -euo pipefail
cd "$(dirname "$0")/.."
bash deploy/setup.sh
export PATH="$PWD/.venv/bin:$PATH"
export QUIRE_BIND=${QUIRE_BIND:-127.0.0.1:8765}
export QUIRE_LOG_FORMAT=${QUIRE_LOG_FORMAT:-text}
mkdir -p var
python manage.py migrate --noinput >/dev/null
python manage.py install_beat_schedule
LOG=var/demo-stack.log
honcho -f Procfile start web worker sweeper beat >"$LOG" 2>&1 &
STACK=$!
trap 'kill $STACK 2>/dev/null; wait $STACK 2>/dev/null || true' EXIT
for _ in $(seq 1 60); do
    if curl -fsS "http://$QUIRE_BIND/health/ready" >/dev/null 2>&1; then break; fi
    sleep 1
done
curl -fsS "http://$QUIRE_BIND/health/ready" || { echo "stack did not become ready; see $LOG"; tail -50 "$LOG"; exit 1; }
echo
python manage.py demo_submit --url "http://$QUIRE_BIND" docs/samples/contract.pdf docs/samples/scan.png docs/samples/memo.docx
echo "demo: done (stack log: $LOG)"
