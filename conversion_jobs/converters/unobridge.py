"""The UNO client of the warm LibreOffice engine (ADR 0019), run by LibreOffice's own Python.

``/usr/bin/python3 unobridge.py <pipe name>``: connects to ``soffice
--accept=pipe,name=<pipe name>;urp;`` (a Unix socket in the engine's private directory, no
network), then answers one JSON request per line on stdin with one JSON line on stdout:

* ``{"op": "convert", "source": path, "dest": path, "password": str|null}`` ->
  ``{"ok": true}`` or ``{"ok": false, "code": ..., "detail": ...}`` (codes: ``not_loaded``,
  ``invalid_input``);
* ``{"op": "ping"}`` -> ``{"ok": true}``.

The document is loaded hidden, read-only, without macros, links or previews, stored as PDF with
``writer_pdf_Export`` (or the Calc/Impress variant) and closed. This file imports only the
standard library and ``uno`` (python3-uno): it never sees Django, the worker or the converter
package, and never logs a path, a password or document content.
"""

from __future__ import annotations

import json
import sys
import time

import uno  # type: ignore[import-not-found]
from com.sun.star.beans import PropertyValue  # type: ignore[import-not-found]

CONNECT_TIMEOUT_S = 60.0
_PDF_FILTERS = {
    "com.sun.star.text.TextDocument": "writer_pdf_Export",
    "com.sun.star.text.WebDocument": "writer_web_pdf_Export",
    "com.sun.star.sheet.SpreadsheetDocument": "calc_pdf_Export",
    "com.sun.star.presentation.PresentationDocument": "impress_pdf_Export",
    "com.sun.star.drawing.DrawingDocument": "draw_pdf_Export",
}


def _props(**values: object) -> tuple:
    out = []
    for name, value in values.items():
        prop = PropertyValue()
        prop.Name, prop.Value = name, value
        out.append(prop)
    return tuple(out)


def connect(pipe: str):
    local = uno.getComponentContext()
    resolver = local.ServiceManager.createInstanceWithContext(
        "com.sun.star.bridge.UnoUrlResolver", local
    )
    give_up = time.monotonic() + CONNECT_TIMEOUT_S
    while True:
        try:
            context = resolver.resolve(f"uno:pipe,name={pipe};urp;StarOffice.ComponentContext")
            break
        except Exception:
            if time.monotonic() > give_up:
                raise
            time.sleep(0.05)
    return context.ServiceManager.createInstanceWithContext("com.sun.star.frame.Desktop", context)


def _filter_for(document) -> str:
    for service, name in _PDF_FILTERS.items():
        if document.supportsService(service):
            return name
    return "writer_pdf_Export"


def convert(desktop, *, source: str, dest: str, password: str | None) -> dict:
    load: dict[str, object] = {
        "Hidden": True,
        "ReadOnly": True,
        "MacroExecutionMode": 0,  # NEVER_EXECUTE
        "UpdateDocMode": 0,  # NO_UPDATE: no external links are fetched
        "Preview": False,
        "Silent": True,
    }
    if password is not None:
        load["Password"] = password
    try:
        document = desktop.loadComponentFromURL(
            uno.systemPathToFileUrl(source), "_blank", 0, _props(**load)
        )
        failure = "" if document is not None else "no document"
    except Exception as exc:  # an IOException or IllegalArgumentException: not loadable
        document, failure = None, type(exc).__name__
    if document is None:
        # LibreOffice says no more than "not loaded": whether for want of the right password is
        # decided by the caller, which knows whether the file is encrypted (officeengine).
        return {
            "ok": False,
            "code": "not_loaded",
            "detail": f"LibreOffice could not load the document ({failure})",
        }
    try:
        document.storeToURL(uno.systemPathToFileUrl(dest), _props(FilterName=_filter_for(document)))
    except Exception as exc:
        return {
            "ok": False,
            "code": "invalid_input",
            "detail": f"export failed ({type(exc).__name__})",
        }
    finally:
        try:
            document.close(True)
        except Exception:
            document.dispose()
    return {"ok": True}


def main(argv: list[str]) -> int:
    desktop = connect(argv[1])
    out = sys.stdout
    for line in sys.stdin:
        request = json.loads(line)
        if request.get("op") == "convert":
            answer = convert(
                desktop,
                source=request["source"],
                dest=request["dest"],
                password=request.get("password"),
            )
        else:
            answer = {"ok": True}
        out.write(json.dumps(answer) + "\n")
        out.flush()
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv))
