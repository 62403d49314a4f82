#!/usr/bin/env python3
"""Execute the walkthrough notebook and write every picture it shows to PNG.

    python tools/render_notebook.py [--notebook PATH] [--out DIR] [--width PX]

The notebook is this checkout's python/mhattn/walkthrough.ipynb
(else the installed mhattn's); the kernel runs in DIR (build/notebook_pictures).

Each figure output (image/png) is written as ``cellNN_M.png``; each HTML
output (text/html: traces, comparisons, checker reports) is written as
``cellNN_M.html`` and rendered to ``cellNN_M.png`` with headless Chromium
(Debian's ``chromium`` package) when it is installed.  The page wraps the
output in nothing but a plain sans-serif body, so what it shows is what the
output's own inline styles give, as in a notebook that has no mhattn CSS.

Needs nbclient, nbformat and ipykernel (pip install nbclient nbformat
ipykernel, or the test extra), matplotlib for the figures, and mhattn. The
notebook runs with the mhattn that this Python imports (after `pip install .`,
the installed one; PYTHONPATH is honoured). Only when none imports and this
checkout is built in place (`make build`) does it use the checkout's
python/; an unbuilt python/ is never put on the path (it cannot import its
extension). The kernel's mhattn is printed, and checked against that choice.
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
NOTEBOOK = "mhattn/learn/walkthrough.ipynb"     # under python/, or installed
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


# What a browser must not inherit: the sanitizer run (tools/sanitize.sh)
# preloads ASan and UBSan into this process, and Chromium hangs under them.
SANITIZER_ENV = ("LD_PRELOAD", "ASAN_OPTIONS", "UBSAN_OPTIONS", "PYTHONMALLOC")


def browser_env() -> dict:
    """This process's environment without the sanitizer run's variables."""
    return {k: v for k, v in os.environ.items() if k not in SANITIZER_ENV}


def screenshot(browser: str, page: pathlib.Path, png: pathlib.Path, width: int) -> None:
    """Render ``page`` at ``width`` px, then crop the blank bottom and right."""
    with tempfile.TemporaryDirectory() as profile:
        subprocess.run([browser, "--headless", "--no-sandbox", "--disable-gpu",
                        "--hide-scrollbars", f"--user-data-dir={profile}",
                        f"--window-size={width},4000", f"--screenshot={png}",
                        page.as_uri()],
                       check=True, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL,
                       timeout=120, env=browser_env())
    try:
        from PIL import Image, ImageChops
    except ImportError:
        return
    img = Image.open(png).convert("RGB")
    bg = Image.new("RGB", img.size, (255, 255, 255))
    box = ImageChops.difference(img, bg).getbbox()
    if box:
        img.crop((0, 0, min(img.width, box[2] + 12), min(img.height, box[3] + 12))).save(png)


PROBE = "import os, mhattn; print(os.path.dirname(os.path.abspath(mhattn.__file__)))"


def probe(env: dict, cwd: pathlib.Path) -> tuple[str | None, str]:
    """(folder of the mhattn a kernel started with ``env`` in ``cwd`` imports,
    or None; the last line of the error when none does)."""
    done = subprocess.run([sys.executable, "-c", PROBE], env=env, cwd=cwd,
                          capture_output=True, text=True, timeout=300)
    if done.returncode == 0:
        return done.stdout.strip().splitlines()[-1], ""
    return None, (done.stderr.strip().splitlines() or ["?"])[-1]


def kernel_env(root: pathlib.Path, cwd: pathlib.Path) -> tuple[dict, str]:
    """The kernel's environment and the folder of the mhattn it will import:
    the one this Python imports (PYTHONPATH made absolute, since the kernel
    runs in ``cwd``), else a checkout built in place; never an unbuilt one."""
    env = dict(os.environ)
    given = [os.path.abspath(p) for p in env.get("PYTHONPATH", "").split(os.pathsep) if p]
    env["PYTHONPATH"] = os.pathsep.join(given)
    where, error = probe(env, cwd)
    if where is not None:
        return env, where
    tree = root / "python"
    if list((tree / "mhattn").glob("_C*.so")) + list((tree / "mhattn").glob("_C*.pyd")):
        env["PYTHONPATH"] = os.pathsep.join([str(tree)] + given)
        where, error = probe(env, cwd)
        if where is not None:
            return env, where
    sys.exit(f"render_notebook: mhattn does not import ({error}).\n"
             f"Install it (pip install . in {root}), or build this checkout in place "
             "(make build) to render with its python/.")


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--notebook", help="default: this checkout's "
                    "python/mhattn/walkthrough.ipynb, else the installed mhattn's")
    ap.add_argument("--out", default=str(ROOT / "build" / "notebook_pictures"),
                    help="where the pictures go; the kernel runs there")
    ap.add_argument("--width", type=int, default=1000,
                    help="page width in px for the HTML outputs (a notebook's width)")
    args = ap.parse_args(argv)

    out = pathlib.Path(args.out).resolve()
    out.mkdir(parents=True, exist_ok=True)
    env, where = kernel_env(ROOT, out)
    nb_path = pathlib.Path(args.notebook or ROOT / "python" / NOTEBOOK)
    if args.notebook is None and not nb_path.is_file():
        nb_path = pathlib.Path(where) / NOTEBOOK.split("/", 1)[1]

    try:
        import nbclient
        import nbformat
    except ImportError as e:
        sys.exit(f"render_notebook: {e}: pip install nbclient nbformat ipykernel")

    nb = nbformat.read(nb_path, as_version=4)
    os.environ.update(env)          # the kernel inherits it
    # A last cell says which mhattn the kernel imported; it is no output.
    nb.cells.append(nbformat.v4.new_code_cell(PROBE))
    nbclient.NotebookClient(nb, timeout=300, kernel_name="python3",
                            resources={"metadata": {"path": str(out)}}).execute()
    used = nb.cells.pop().outputs[0]["text"].strip()
    print(f"render_notebook: {nb_path} with mhattn from {used}", file=sys.stderr)
    if not os.path.samefile(used, where):
        sys.exit(f"render_notebook: the kernel imported mhattn from {used}, not {where} "
                 "(is the python3 kernelspec another Python's?)")

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
