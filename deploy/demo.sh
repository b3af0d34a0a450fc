#!/usr/bin/env bash
# Quire's main job on a fresh machine: set up, start the whole stack (web, worker, sweeper,
# beat) in the standalone profile (SQLite + server-less broker, published development secrets;
# set DATABASE_URL, CELERY_BROKER_URL and the secrets of docs/OPERABILITY.md §2 for the
# production profile), convert the bundled sample documents with the `quire` CLI
# (client/README.md) through the real HTTP API - live progress over SSE, results downloaded and
# verified against their sha256 - into var/demo-results/.
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
export QUIRE_URL="http://$QUIRE_BIND"
QUIRE_TOKEN=$(python manage.py mint_token --tenant demo --scope jobs:submit jobs:read jobs:cancel)
export QUIRE_TOKEN
# PDF -> text; the scan and the Word memo -> PDF (via LibreOffice). Exit 0: all succeeded.
quire submit docs/samples/contract.pdf --output text --out var/demo-results
quire submit docs/samples/scan.png docs/samples/memo.docx --output pdf --out var/demo-results
ls -l var/demo-results
echo "demo: done (stack log: $LOG)"
