"""Headless Chromium (Debian's ``chromium``) driven by its command line: a page's DOM after its
scripts ran, and screenshots, read back as pixels. No driver, nothing downloaded."""

from __future__ import annotations

import asyncio
import contextlib
import shutil
import struct
import tempfile
import zlib
from collections import Counter
from dataclasses import dataclass
from pathlib import Path

#: Headless, as root (no sandbox), and quiet: no GPU, no QUIC, no first-run, no background
#: fetches, no component updates, no sync. Host names resolve to nothing (but 127.0.0.1, where
#: the page is served), so the page cannot load anything from anywhere else.
FLAGS = (
    "--headless",
    "--no-sandbox",
    "--disable-gpu",
    "--disable-quic",
    "--no-first-run",
    "--disable-background-networking",
    "--disable-component-update",
    "--disable-sync",
    "--disable-extensions",
    "--hide-scrollbars",
    "--mute-audio",
    "--host-resolver-rules=MAP * ~NOTFOUND, EXCLUDE 127.0.0.1",
)
#: A run of Chromium (start, load, render, exit) takes 1-3 s here; a loaded machine more.
RUN_TIMEOUT_S = 120.0


def find_chromium() -> str | None:
    """The path of Debian's ``chromium``, or None."""
    return shutil.which("chromium")


#: A profile's preferences that block every page's scripts, as a person who turned
#: JavaScript off has it (``--blink-settings=scriptEnabled=false`` also stops --dump-dom and
#: --screenshot in this headless mode: they run scripts of their own).
NO_SCRIPTS = '{"profile": {"default_content_setting_values": {"javascript": 2}}}'


async def run_chromium(chromium: str, *args: str, scripts: bool = True) -> bytes:
    """Chromium with FLAGS, ``args`` and a fresh profile of its own (pages' scripts off
    unless ``scripts``); its stdout."""
    with tempfile.TemporaryDirectory(prefix="chromium-") as profile:
        if not scripts:
            (Path(profile) / "Default").mkdir()
            (Path(profile) / "Default" / "Preferences").write_text(NO_SCRIPTS, encoding="utf-8")
        process = await asyncio.create_subprocess_exec(
            chromium,
            *FLAGS,
            f"--user-data-dir={profile}",
            *args,
            stdin=asyncio.subprocess.DEVNULL,
            stdout=asyncio.subprocess.PIPE,
            stderr=asyncio.subprocess.PIPE,
            start_new_session=True,
        )
        try:
            async with asyncio.timeout(RUN_TIMEOUT_S):
                out, err = await process.communicate()
        finally:
            if process.returncode is None:
                with contextlib.suppress(ProcessLookupError):
                    process.kill()
                await process.wait()
    if process.returncode != 0:
        raise AssertionError(f"chromium {args} exited {process.returncode}: {err[-2000:]!r}")
    return out


async def dump_dom(
    chromium: str, url: str, *, scripts: bool = True, virtual_time_ms: int | None = None
) -> str:
    """The DOM of ``url`` once loaded (and, with ``virtual_time_ms``, after that much virtual
    time ran its timers), serialized; with ``scripts=False``, as a browser without JavaScript
    has it."""
    args = ["--dump-dom"]
    if virtual_time_ms is not None:
        args.append(f"--virtual-time-budget={virtual_time_ms}")
    return (await run_chromium(chromium, *args, url, scripts=scripts)).decode("utf-8")


async def screenshot(
    chromium: str, url: str, path: Path, width: int, height: int, *, scripts: bool = True
) -> Path:
    """A PNG of ``url`` in a ``width`` x ``height`` window, written to ``path``."""
    size = f"--window-size={width},{height}"
    await run_chromium(chromium, f"--screenshot={path}", size, url, scripts=scripts)
    if not path.is_file():
        raise AssertionError(f"chromium wrote no screenshot at {path}")
    return path


@dataclass
class Image:
    """A decoded PNG: its size and the count of each RGB colour."""

    width: int
    height: int
    colours: Counter[tuple[int, int, int]]

    def count(self, hex_colour: str) -> int:
        """Pixels of exactly ``#rrggbb``."""
        rgb = bytes.fromhex(hex_colour.removeprefix("#"))
        return self.colours[(rgb[0], rgb[1], rgb[2])]


def png_size(path: Path) -> tuple[int, int]:
    """Width and height of the PNG at ``path``, from its header alone."""
    data = path.read_bytes()[:24]
    if data[:8] != b"\x89PNG\r\n\x1a\n" or data[12:16] != b"IHDR":
        raise AssertionError(f"{path} is not a PNG")
    width, height = struct.unpack(">II", data[16:24])
    return width, height


def read_png(path: Path) -> Image:
    """Decode an 8-bit RGB or RGBA, non-interlaced PNG (as Chromium writes them)."""
    data = path.read_bytes()
    if data[:8] != b"\x89PNG\r\n\x1a\n":
        raise AssertionError(f"{path} is not a PNG")
    pos, chunks, header = 8, [], b""
    while pos < len(data):
        (length,) = struct.unpack(">I", data[pos : pos + 4])
        kind, body = data[pos + 4 : pos + 8], data[pos + 8 : pos + 8 + length]
        if kind == b"IHDR":
            header = body
        elif kind == b"IDAT":
            chunks.append(body)
        pos += 12 + length
    width, height, depth, colour_type, _, _, interlace = struct.unpack(">IIBBBBB", header)
    if depth != 8 or colour_type not in (2, 6) or interlace:
        raise AssertionError(f"{path}: PNG of a kind not decoded here ({depth}, {colour_type})")
    channels = 3 if colour_type == 2 else 4
    raw = zlib.decompress(b"".join(chunks))
    stride = width * channels
    previous = bytearray(stride)
    colours: Counter[tuple[int, int, int]] = Counter()
    for y in range(height):
        start = y * (stride + 1)
        kind, line = raw[start], bytearray(raw[start + 1 : start + 1 + stride])
        _unfilter(kind, line, previous, channels)
        for x in range(0, stride, channels):
            colours[(line[x], line[x + 1], line[x + 2])] += 1
        previous = line
    return Image(width, height, colours)


def _unfilter(kind: int, line: bytearray, above: bytearray, bpp: int) -> None:
    """Undo one scanline's PNG filter in place (RFC 2083, 6.2-6.6)."""
    if kind == 0:
        return
    for i in range(len(line)):
        left = line[i - bpp] if i >= bpp else 0
        up = above[i]
        corner = above[i - bpp] if i >= bpp else 0
        if kind == 1:
            line[i] = (line[i] + left) & 0xFF
        elif kind == 2:
            line[i] = (line[i] + up) & 0xFF
        elif kind == 3:
            line[i] = (line[i] + (left + up) // 2) & 0xFF
        elif kind == 4:
            p = left + up - corner
            pa, pb, pc = abs(p - left), abs(p - up), abs(p - corner)
            pred = left if pa <= pb and pa <= pc else up if pb <= pc else corner
            line[i] = (line[i] + pred) & 0xFF
        else:
            raise AssertionError(f"unknown PNG filter {kind}")
