"""Image work done inside the isolated child (Pillow, img2pdf, tesseract). Page = frame.

Runs only in ``conversion_jobs.converters.child``; never import it in the worker.
"""

from __future__ import annotations

import os
import subprocess
import warnings
from contextlib import contextmanager
from pathlib import Path

from PIL import Image, ImageSequence

from .base import JPEG, PDF, PNG, TEXT_PLAIN, TIFF, Limits
from .errors import ConverterCrashed, InputTooLarge, InvalidInput

_PIL_FORMATS = {"PNG": PNG, "JPEG": JPEG, "TIFF": TIFF}


@contextmanager
def open_image(path: Path, limits: Limits):
    """Open with Pillow's decompression-bomb guard set to our pixel limit (warnings are errors)."""
    Image.MAX_IMAGE_PIXELS = limits.max_pixels
    with warnings.catch_warnings():
        warnings.simplefilter("error", Image.DecompressionBombWarning)
        try:
            image = Image.open(path)
        except (Image.DecompressionBombError, Image.DecompressionBombWarning) as exc:
            raise InputTooLarge(f"image too large: {exc}") from None
        except MemoryError:
            raise
        except Exception as exc:
            raise InvalidInput(f"not a readable image ({type(exc).__name__})") from None
        try:
            if image.format not in _PIL_FORMATS:
                raise InvalidInput(f"unsupported image format {image.format}")
            yield image
        finally:
            image.close()


def _check_frame(image: Image.Image, frame: int, limits: Limits) -> None:
    width, height = image.size
    if width < 1 or height < 1:
        raise InvalidInput(f"frame {frame} has no pixels")
    if width * height > limits.max_pixels:
        raise InputTooLarge(
            f"frame {frame} is {width} x {height} px; the limit is {limits.max_pixels} pixels"
        )


def image_prepare(*, path: str, limits: Limits) -> dict:
    with open_image(Path(path), limits) as image:
        count = getattr(image, "n_frames", 1)
        if count > limits.max_pages:
            raise InputTooLarge(f"{count} frames; the limit is {limits.max_pages}")
        try:
            for number, _frame in enumerate(ImageSequence.Iterator(image), start=1):
                _check_frame(image, number, limits)
        except (InputTooLarge, InvalidInput, MemoryError):
            raise
        except Exception as exc:
            raise InvalidInput(f"unreadable frame ({type(exc).__name__})") from None
        return {"page_count": count, "format": _PIL_FORMATS[image.format]}


def _load_frame(image: Image.Image, page: int, limits: Limits) -> Image.Image:
    count = getattr(image, "n_frames", 1)
    if not 1 <= page <= count:
        raise InvalidInput(f"frame {page} does not exist (the image has {count})")
    try:
        image.seek(page - 1)
        _check_frame(image, page, limits)
        image.load()
        frame = image.copy()
    except (InputTooLarge, InvalidInput, MemoryError):
        raise
    except Exception as exc:
        raise InvalidInput(f"frame {page} cannot be decoded ({type(exc).__name__})") from None
    return _normalized(frame)


def _normalized(frame: Image.Image) -> Image.Image:
    """A mode PNG, img2pdf and tesseract all accept: L or RGB (alpha flattened onto white)."""
    if frame.mode in ("L", "RGB"):
        return frame
    if frame.mode in ("1", "I;16", "I;16B", "I;16L", "I", "F"):
        return frame.convert("L")
    if frame.mode in ("LA", "PA", "RGBA", "P", "La", "RGBa"):
        rgba = frame.convert("RGBA")
        background = Image.new("RGBA", rgba.size, (255, 255, 255, 255))
        return Image.alpha_composite(background, rgba).convert("RGB")
    return frame.convert("RGB")


def image_page(*, path: str, page: int, output: str, dpi: int, dest: str, limits: Limits) -> dict:
    dest_path = Path(dest)
    with open_image(Path(path), limits) as image:
        if output == "pdf" and image.format == "JPEG":
            # img2pdf embeds a JPEG as is: no generation loss.
            _check_frame(image, 1, limits)
            return _to_pdf(Path(path), dest_path)
        frame = _load_frame(image, page, limits)
    if output == "png":
        frame.save(dest_path, format="PNG", compress_level=6)
        return {"media_type": PNG, "width": frame.width, "height": frame.height}
    scratch = dest_path.with_name(dest_path.name + ".frame.png")
    try:
        frame.save(scratch, format="PNG", compress_level=1)
        if output == "pdf":
            return _to_pdf(scratch, dest_path)
        if output == "text":
            return _ocr(scratch, dest_path)
    finally:
        scratch.unlink(missing_ok=True)
    raise ValueError(output)


def _to_pdf(image_path: Path, dest: Path) -> dict:
    import img2pdf  # (function-level: ~0.2 s to import, preloaded children need it rarely)

    # 72 dpi: one pixel is one point, so the page keeps the image's pixel size.
    layout = img2pdf.get_fixed_dpi_layout_fun((72, 72))
    try:
        data = img2pdf.convert(
            str(image_path), layout_fun=layout, rotation=img2pdf.Rotation.ifvalid
        )
    except MemoryError:
        raise
    except Exception as exc:
        raise InvalidInput(f"image cannot be put in a PDF ({type(exc).__name__})") from None
    dest.write_bytes(data)
    return {"media_type": PDF}


def _ocr(image_path: Path, dest: Path) -> dict:
    env = {
        "PATH": os.environ.get("PATH", "/usr/bin:/bin"),
        "OMP_THREAD_LIMIT": "1",
        "LANG": "C.UTF-8",
    }
    # Inherits this child's process group, so a timeout or cancellation kills tesseract too.
    done = subprocess.run(  # noqa: S603
        ["tesseract", str(image_path), "stdout", "-l", "eng"],  # noqa: S607
        env=env,
        stdin=subprocess.DEVNULL,
        capture_output=True,
        check=False,
    )
    if done.returncode < 0:
        raise ConverterCrashed(f"tesseract killed by signal {-done.returncode}")
    if done.returncode != 0:
        message = done.stderr.decode("utf-8", "replace").strip().splitlines()[-1:]
        raise InvalidInput(f"OCR failed: {' '.join(message)}")
    text = done.stdout.decode("utf-8", "replace").replace("\f", "").strip()
    dest.write_text(text, encoding="utf-8")
    return {"media_type": TEXT_PLAIN}
