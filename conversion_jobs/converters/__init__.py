"""Document converters (DESIGN §10), isolated per call in a child process (DESIGN §7.7).

Importing this package is cheap and Django-free; pypdfium2, Pillow, img2pdf, tesseract and
LibreOffice are only ever used inside the child process.
"""

from .assemble import assemble_result
from .base import OUTPUTS, Converter, Limits, PageArtifact, Prepared, limits_description
from .errors import (
    ConversionError,
    ConversionStopped,
    ConversionTimeout,
    ConverterCrashed,
    EncryptedInput,
    InputTooLarge,
    InvalidInput,
    UnsupportedConversion,
)
from .isolation import TEST_FAULTS_ENV, kill_process_group, process_group_members, run_isolated
from .registry import capabilities, converter_for
from .sniff import sniff_media_type

__all__ = [
    "OUTPUTS",
    "TEST_FAULTS_ENV",
    "ConversionError",
    "ConversionStopped",
    "ConversionTimeout",
    "Converter",
    "ConverterCrashed",
    "EncryptedInput",
    "InputTooLarge",
    "InvalidInput",
    "Limits",
    "PageArtifact",
    "Prepared",
    "UnsupportedConversion",
    "assemble_result",
    "capabilities",
    "converter_for",
    "kill_process_group",
    "limits_description",
    "process_group_members",
    "run_isolated",
    "sniff_media_type",
]
