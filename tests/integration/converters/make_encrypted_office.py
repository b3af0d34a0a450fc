"""Test helper, run by LibreOffice's Python (``/usr/bin/python3``, python3-uno): save a document
with a password in other formats.

    /usr/bin/python3 make_encrypted_office.py <source> <password> <dest> <filter> [<dest> <filter>]

Filters: ``writer8`` (an encrypted ODT), ``MS Word 97`` (an encrypted .doc); a filter name
ending in ``!plain`` saves without the password. Starts its own
LibreOffice (private profile next to the source) on a pipe and kills its process group after.
"""

import os
import signal
import subprocess
import sys
import time
import uuid

import uno
from com.sun.star.beans import PropertyValue

PLAIN = "!plain"


def _props(**values):
    out = []
    for name, value in values.items():
        prop = PropertyValue()
        prop.Name, prop.Value = name, value
        out.append(prop)
    return tuple(out)


def main(argv):
    source, password = os.path.abspath(argv[1]), argv[2]
    root = os.path.dirname(source)
    pipe = "quire-test-" + uuid.uuid4().hex
    office = subprocess.Popen(
        ["soffice", "--headless", "--norestore", "--nologo", "--nodefault", "--nolockcheck",
         f"-env:UserInstallation=file://{root}/encrypt-profile", f"--accept=pipe,name={pipe};urp;"],
        stdin=subprocess.DEVNULL, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL,
        start_new_session=True,
    )  # fmt: skip
    try:
        local = uno.getComponentContext()
        resolver = local.ServiceManager.createInstanceWithContext(
            "com.sun.star.bridge.UnoUrlResolver", local
        )
        for _ in range(1200):
            try:
                context = resolver.resolve(f"uno:pipe,name={pipe};urp;StarOffice.ComponentContext")
                break
            except Exception:
                time.sleep(0.1)
        desktop = context.ServiceManager.createInstanceWithContext(
            "com.sun.star.frame.Desktop", context
        )
        doc = desktop.loadComponentFromURL(
            uno.systemPathToFileUrl(source), "_blank", 0, _props(Hidden=True)
        )
        for dest, filter_name in zip(argv[3::2], argv[4::2], strict=True):
            plain = filter_name.endswith(PLAIN)
            protection = {} if plain else {"Password": password}
            doc.storeToURL(
                uno.systemPathToFileUrl(os.path.abspath(dest)),
                _props(FilterName=filter_name.removesuffix(PLAIN), **protection),
            )
        doc.close(True)
    finally:
        sockets = _sockets_of_group(office.pid)
        os.killpg(office.pid, signal.SIGKILL)
        office.wait()
        for path in sockets:  # a killed LibreOffice leaves its sockets behind
            os.unlink(path)
    return 0


def _sockets_of_group(pgid):
    """Paths of the LibreOffice pipe sockets held by processes of group ``pgid``."""
    with open("/proc/net/unix") as fh:
        rows = [row.split() for row in fh]
    by_inode = {f[6]: f[7] for f in rows if len(f) >= 8 and "OSL_PIPE" in f[7]}
    paths = set()
    for pid in filter(str.isdigit, os.listdir("/proc")):
        try:
            if os.getpgid(int(pid)) != pgid:
                continue
            for fd in os.listdir(f"/proc/{pid}/fd"):
                target = os.readlink(f"/proc/{pid}/fd/{fd}")
                if target[8:-1] in by_inode:
                    paths.add(by_inode[target[8:-1]])
        except OSError:
            continue
    return sorted(p for p in paths if os.path.exists(p))


if __name__ == "__main__":
    sys.exit(main(sys.argv))
