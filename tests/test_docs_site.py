"""The built documentation site, opened in headless Chromium (issue 37).

tools/ci/docs.sh builds the site (sphinx-build -W) and runs this file with
MHATTN_DOCS_HTML set to the built HTML directory. Three pages (the index, a
tutorial, a gallery example) are loaded in headless Chromium: a JavaScript
exception or a resource that fails to load fails the test, and so does an
<img> whose file is missing or is not an image. A screenshot of each page
goes to MHATTN_DOCS_SHOTS when it is set, for a person to look at.

Without MHATTN_DOCS_HTML (a plain pytest run, no site built) the page tests
are skipped; the checker itself is tested on a broken page wherever
Chromium is installed, so that it is known to fail when it should.
"""
from __future__ import annotations

import html.parser
import os
import shutil
import subprocess
import tempfile
import urllib.parse

import pytest

PAGES = ["index.html", "tutorials/worked_example.html",
         "auto_examples/plot_worked_example_heads.html"]
# What headless Chromium writes to stderr (--enable-logging=stderr) for an
# uncaught exception in a page's script and for a resource it cannot load.
PROBLEMS = ("Uncaught", "Failed to load resource")


def _chromium():
    for name in ("chromium", "chromium-browser", "google-chrome"):
        path = shutil.which(name)
        if path:
            return path
    return None


class _Images(html.parser.HTMLParser):
    def __init__(self):
        super().__init__()
        self.srcs = []

    def handle_starttag(self, tag, attrs):
        if tag == "img":
            self.srcs.append(dict(attrs).get("src"))


def _image_problems(page: str) -> list:
    """Each <img> of the page whose src is absent, missing or not an image."""
    with open(page, encoding="utf-8") as f:
        parser = _Images()
        parser.feed(f.read())
    problems = []
    for src in parser.srcs:
        if not src:
            problems.append("an <img> without src")
            continue
        if src.startswith("data:"):
            continue
        path = os.path.join(os.path.dirname(page), urllib.parse.unquote(src.split("#")[0]))
        if not os.path.isfile(path):
            problems.append(f"missing image {src}")
            continue
        with open(path, "rb") as f:
            head = f.read(512)
        if not (head.startswith(b"\x89PNG\r\n\x1a\n") or b"<svg" in head
                or head.startswith((b"GIF8", b"\xff\xd8\xff"))):
            problems.append(f"not an image: {src}")
    return problems


def check_page(page: str, shot: str | None = None) -> list:
    """Problems found when Chromium loads the page: its console's exceptions
    and failed loads, then the <img> checks. [] when there are none."""
    # Its own profile (two Chromiums at once, under pytest-xdist, would share
    # the default one), and none of the sanitizer run's preloads, under
    # which Chromium hangs (tools/sanitize.sh runs this file too).
    env = {k: v for k, v in os.environ.items()
           if k not in ("LD_PRELOAD", "ASAN_OPTIONS", "UBSAN_OPTIONS", "PYTHONMALLOC")}
    with tempfile.TemporaryDirectory(prefix="mhattn-chromium-") as profile:
        cmd = [_chromium(), "--headless", "--no-sandbox", "--disable-gpu",
               f"--user-data-dir={profile}", "--enable-logging=stderr", "--v=0",
               "--window-size=1280,1000", "--virtual-time-budget=5000"]
        cmd.append(f"--screenshot={shot}" if shot else "--dump-dom")
        res = subprocess.run(cmd + ["file://" + os.path.abspath(page)], capture_output=True,
                             text=True, timeout=120, env=env)
    problems = [line.split("] ", 1)[-1] for line in res.stderr.splitlines()
                if "CONSOLE" in line and any(p in line for p in PROBLEMS)]
    if res.returncode != 0:
        problems.append(f"chromium exited with {res.returncode}: {res.stderr[-300:]}")
    return problems + _image_problems(page)


needs_chromium = pytest.mark.skipif(_chromium() is None, reason="no Chromium installed")


@needs_chromium
def test_the_checker_finds_a_script_error_and_a_missing_image(tmp_path):
    page = tmp_path / "broken.html"
    (tmp_path / "fine.png").write_bytes(b"\x89PNG\r\n\x1a\n" + b"\0" * 32)
    page.write_text('<html><body><img src="fine.png"><img src="nowhere.png">'
                    "<script>no_such_function()</script></body></html>")
    problems = check_page(str(page))
    assert any("Uncaught ReferenceError" in p for p in problems), problems
    assert "missing image nowhere.png" in problems, problems
    assert not any("fine.png" in p for p in problems), problems


@needs_chromium
@pytest.mark.parametrize("name", PAGES)
def test_built_page_loads_without_errors(name):
    root = os.environ.get("MHATTN_DOCS_HTML")
    if not root:
        pytest.skip("MHATTN_DOCS_HTML is not set: no built site (tools/ci/docs.sh sets it)")
    page = os.path.join(root, name)
    assert os.path.isfile(page), f"{name} was not built"
    shots = os.environ.get("MHATTN_DOCS_SHOTS")
    shot = None
    if shots:
        os.makedirs(shots, exist_ok=True)
        shot = os.path.join(shots, name.replace("/", "_").replace(".html", ".png"))
    assert check_page(page, shot) == []
    if name.startswith("auto_examples/"):
        with open(page, encoding="utf-8") as f:
            parser = _Images()
            parser.feed(f.read())
        assert any("sphx_glr_" in (s or "") and "thumb" not in s for s in parser.srcs), \
            "the gallery example shows no figure"
