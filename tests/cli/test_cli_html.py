"""``python -m fsdptx plan --html FILE``: one self-contained page that parses,
holds the step's SVG, and renders in a real browser without a JS error."""

from __future__ import annotations

import html.parser
import shutil
import struct
import subprocess
import zlib
from pathlib import Path

import pytest

from fsdptx.cli._main import main

ARGV = ("--preset", "llama", "--layers", "2", "--seq", "128", "--mesh", "dp=2,tp=2", "--sp")


class Elements(html.parser.HTMLParser):
    """Tags, attributes and the text of ``<script>`` elements."""

    def __init__(self) -> None:
        super().__init__()
        self.tags: list[tuple[str, dict[str, str | None]]] = []

    def handle_starttag(self, tag: str, attrs: list[tuple[str, str | None]]) -> None:
        self.tags.append((tag, dict(attrs)))


@pytest.fixture(scope="module")
def page(tmp_path_factory: pytest.TempPathFactory) -> Path:
    path = tmp_path_factory.mktemp("html") / "report.html"
    assert main(["plan", *ARGV, "--html", str(path)]) == 0
    return path


def parsed(page: Path) -> Elements:
    parser = Elements()
    parser.feed(page.read_text(encoding="utf-8"))
    parser.close()
    return parser


def test_the_page_parses_and_holds_the_step_svg(page: Path) -> None:
    tags = parsed(page).tags
    names = [t for t, _ in tags]
    assert names[0] == "html" and "svg" in names
    svg = next(a for t, a in tags if t == "svg")
    assert svg.get("id") == "step"
    assert names.count("polygon") >= 3  # stacked memory categories
    assert names.count("rect") > 10  # phase bands, units, collectives


def test_the_page_needs_no_network(page: Path) -> None:
    for tag, attrs in parsed(page).tags:
        for name in ("src", "href"):
            value = attrs.get(name) or ""
            assert not value.startswith(("http:", "https:", "//")), (tag, value)


def test_the_page_shows_the_peak_and_the_plan(page: Path) -> None:
    text = page.read_text(encoding="utf-8")
    assert 'class="peak"' in text and "peak " in text
    assert "tp_replica_sync" in text and "<h2>Plan</h2>" in text


def test_html_refuses_an_unwritable_path(capsys: pytest.CaptureFixture[str], tmp_path: Path) -> None:
    target = tmp_path / "missing" / "report.html"
    assert main(["plan", *ARGV, "--html", str(target)]) == 2
    assert "cannot write --html" in capsys.readouterr().err


# --------------------------------------------------------------------------- in a real browser

CHROMIUM = shutil.which("chromium") or shutil.which("chromium-browser")
needs_chromium = pytest.mark.skipif(
    CHROMIUM is None, reason="Chromium is not installed (Debian: apt-get install -y chromium)"
)


def chromium(*args: str) -> subprocess.CompletedProcess[str]:
    assert CHROMIUM is not None
    flags = ("--headless", "--no-sandbox", "--disable-gpu", "--hide-scrollbars", "--enable-logging=stderr", "--v=0")
    return subprocess.run([CHROMIUM, *flags, *args], capture_output=True, text=True, timeout=120, check=False)


def png_pixels(path: Path) -> tuple[int, int, bytes]:
    """Width, height and the decompressed scanlines of an 8-bit PNG."""
    data = path.read_bytes()
    assert data[:8] == b"\x89PNG\r\n\x1a\n"
    pos, idat, width, height = 8, b"", 0, 0
    while pos < len(data):
        (length,) = struct.unpack(">I", data[pos : pos + 4])
        kind, body = data[pos + 4 : pos + 8], data[pos + 8 : pos + 8 + length]
        if kind == b"IHDR":
            width, height = struct.unpack(">II", body[:8])
        elif kind == b"IDAT":
            idat += body
        pos += 12 + length
    return width, height, zlib.decompress(idat)


@needs_chromium
def test_a_headless_screenshot_is_not_blank(page: Path, tmp_path: Path) -> None:
    shot = tmp_path / "shot.png"
    result = chromium("--window-size=1200,900", f"--screenshot={shot}", page.as_uri())
    assert shot.exists(), result.stderr[-2000:]
    width, height, pixels = png_pixels(shot)
    assert (width, height) == (1200, 900)
    distinct = len(set(pixels))
    non_white = sum(1 for b in pixels if b < 0xF0) / len(pixels)
    assert distinct > 50 and non_white > 0.05, (distinct, non_white)


@needs_chromium
def test_the_page_script_runs_without_a_javascript_error(page: Path) -> None:
    result = chromium("--dump-dom", page.as_uri())
    assert 'data-ready="1"' in result.stdout, "the page script did not finish"
    console = [line for line in result.stderr.splitlines() if "CONSOLE" in line or "Uncaught" in line]
    assert not console, console
