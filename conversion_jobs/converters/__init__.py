"""Document converters (docs/API_CONTRACT.md §2.7), isolated in child processes (ADR 0009).

``prepare`` starts one child per document and attempt — a fresh fork of the worker process's
fork server (``zygote``) — and the document's pages are converted in that child (see
``sessions``). Call ``release(prepared)`` (or ``release()`` for all of the calling
thread's sessions) when the attempt ends.

Importing this package is cheap and Django-free; pypdfium2, Pillow, img2pdf, tesseract and
LibreOffice are only ever used inside the child process.
"""

from . import sandbox
from .assemble import assemble_result, inline_text_result, join_text_pages
from .base import (
    OFFICE_TYPES,
    OUTPUTS,
    Converter,
    FirstPages,
    Limits,
    PageArtifact,
    PageRequest,
    Prepared,
    PrepareRequest,
    StepAside,
    limits_description,
    process_group_members,
)
from .errors import (
    ConversionError,
    ConversionStarved,
    ConversionStopped,
    ConversionTimeout,
    ConverterCrashed,
    EncryptedInput,
    InputTooLarge,
    InvalidInput,
    InvalidPassword,
    PasswordRequired,
    UnsupportedConversion,
)
from .isolation import TEST_FAULTS_ENV, kill_process_group
from .registry import READ_AHEAD_PAGES, capabilities, converter_for, engine_version
from .sandbox import SandboxUnavailable
from .sessions import ReuseSettings, begin_attempt, configure_reuse, release, run_isolated, warm
from .sniff import sniff_media_type, sniff_media_type_bytes

__all__ = [
    "OFFICE_TYPES",
    "OUTPUTS",
    "READ_AHEAD_PAGES",
    "TEST_FAULTS_ENV",
    "ConversionError",
    "ConversionStarved",
    "ConversionStopped",
    "ConversionTimeout",
    "Converter",
    "ConverterCrashed",
    "EncryptedInput",
    "FirstPages",
    "InputTooLarge",
    "InvalidInput",
    "InvalidPassword",
    "Limits",
    "PageArtifact",
    "PageRequest",
    "PasswordRequired",
    "PrepareRequest",
    "Prepared",
    "ReuseSettings",
    "SandboxUnavailable",
    "StepAside",
    "UnsupportedConversion",
    "assemble_result",
    "begin_attempt",
    "capabilities",
    "configure_reuse",
    "converter_for",
    "engine_version",
    "inline_text_result",
    "join_text_pages",
    "kill_process_group",
    "limits_description",
    "process_group_members",
    "release",
    "run_isolated",
    "sandbox",
    "sniff_media_type",
    "sniff_media_type_bytes",
    "warm",
]
