#!/usr/bin/env python3
"""Execute python/mhattn/notebooks/walkthrough.ipynb and write every picture it shows to PNG.

    python tools/render_notebook.py [--notebook PATH] [--out DIR] [--width PX]

Each figure output (image/png) is written as ``cellNN_M.png``; each HTML
output (text/html: traces, comparisons, checker reports) is written as
``cellNN_M.html`` and rendered to ``cellNN_M.png`` with headless Chromium
(Debian's ``chromium`` package) when it is installed.  The page wraps the
output in nothing but a plain sans-serif body, so what it shows is what the
output's own inline styles give, as in a notebook that has no mhattn CSS.

Needs nbclient, nbformat and ipykernel (pip install nbclient nbformat
ipykernel), matplotlib for the figures, and mhattn importable (run it with
PYTHONPATH=python from a built checkout).
"""
from __future__ import annotations

import argparse
import base64
import os
import pathlib
import shutil
import subprocess
import sys
import tempfile

ROOT = pathlib.Path(__file__).resolve().parent.parent
PAGE = """<!DOCTYPE html>
<html><head><meta charset="utf-8"><style>
body {{ font-family: -apple-system, "Segoe UI", Roboto, "DejaVu Sans", sans-serif;
       font-size: 14px; margin: 12px; background: white; color: #222; }}
</style></head><body>
{body}
</body></html>
"""


def chromium() -> str | None:
    for name in ("chromium", "chromium-browser", "google-chrome", "chrome"):
        path = shutil.which(name)
        if path:
            return path
    return None


def screenshot(browser: str, page: pathlib.Path, png: pathlib.Path, width: int) -> None:
    """Render ``page`` at ``width`` px, then crop the blank bottom and right."""
    with tempfile.TemporaryDirectory() as profile:
        subprocess.run([browser, "--headless", "--no-sandbox", "--disable-gpu",
                        "--hide-scrollbars", f"--user-data-dir={profile}",
                        f"--window-size={width},4000", f"--screenshot={png}",
                        page.as_uri()],
                       check=True, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL,
                       timeout=120)
    try:
        from PIL import Image, ImageChops
    except ImportError:
        return
    img = Image.open(png).convert("RGB")
    bg = Image.new("RGB", img.size, (255, 255, 255))
    box = ImageChops.difference(img, bg).getbbox()
    if box:
        img.crop((0, 0, min(img.width, box[2] + 12), min(img.height, box[3] + 12))).save(png)


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--notebook", default=str(ROOT / "python" / "mhattn" / "notebooks" / "walkthrough.ipynb"))
    ap.add_argument("--out", default=str(ROOT / "build" / "notebook_pictures"))
    ap.add_argument("--width", type=int, default=1000,
                    help="page width in px for the HTML outputs (a notebook's width)")
    args = ap.parse_args(argv)

    import nbclient
    import nbformat

    nb_path = pathlib.Path(args.notebook).resolve()
    out = pathlib.Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    nb = nbformat.read(nb_path, as_version=4)
    env_path = os.environ.get("PYTHONPATH", "")
    if str(ROOT / "python") not in env_path.split(os.pathsep):
        os.environ["PYTHONPATH"] = os.pathsep.join(p for p in (str(ROOT / "python"),
                                                               env_path) if p)
    nbclient.NotebookClient(nb, timeout=300, kernel_name="python3",
                            resources={"metadata": {"path": str(nb_path.parent)}}).execute()

    browser = chromium()
    if browser is None:
        print("no chromium found: HTML outputs are written as .html only "
              "(apt-get install -y chromium)", file=sys.stderr)
    written = []
    for c, cell in enumerate(nb.cells):
        if cell.cell_type != "code":
            continue
        for m, o in enumerate(cell.get("outputs", [])):
            data = o.get("data", {})
            stem = out / f"cell{c:02d}_{m}"
            if "image/png" in data:
                png = stem.with_suffix(".png")
                png.write_bytes(base64.b64decode(data["image/png"]))
                written.append(png)
            elif "text/html" in data:
                page = stem.with_suffix(".html")
                page.write_text(PAGE.format(body=data["text/html"]), encoding="utf-8")
                written.append(page)
                if browser:
                    png = stem.with_suffix(".png")
                    screenshot(browser, page, png, args.width)
                    written.append(png)
    for p in written:
        print(p)
    return 0


if __name__ == "__main__":
    sys.exit(main())
