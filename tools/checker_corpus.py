"""Run mhattn.check_prototype on the prototype corpus, tests/prototypes/.

    PYTHONPATH=python python tools/checker_corpus.py [--before REV] [-v]

Each file there defines ``prototype(x, w_q, w_k, w_v, w_o, num_heads, ...)``
and declares its planted mistakes, ``EXPECTED = ("no_scaling",)`` (() for a
correct one; ``DTYPE = "float32"`` to check it in float32).  The table says,
per prototype, what the checker names AFTER (this tree's checker) and BEFORE
(the checker of git revision REV, default the last one before issue 15,
loaded from ``git show`` as a module of this mhattn: python/mhattn/checker.py
before the package had subpackages, python/mhattn/learn/checker.py since),
and counts:

* prototypes fully named: correct ones reported ok, every planted mistake
  named and nothing else;
* planted mistakes named, of all planted.
"""
from __future__ import annotations

import argparse
import importlib.util
import subprocess
import sys
import time
from pathlib import Path

import numpy as np

ROOT = Path(__file__).resolve().parents[1]
CORPUS = ROOT / "tests" / "prototypes"


def load_corpus():
    out = []
    for path in sorted(CORPUS.glob("*.py")):
        if path.name.startswith("_"):
            continue
        spec = importlib.util.spec_from_file_location(f"_proto_{path.stem}", path)
        mod = importlib.util.module_from_spec(spec)
        spec.loader.exec_module(mod)
        out.append((path.stem, tuple(mod.EXPECTED), np.dtype(getattr(mod, "DTYPE", "float64")),
                    mod.prototype))
    return out


# Where the modules of the flat package (before the subpackages) live now,
# relative to mhattn: an old checker's or trace's relative imports are
# rewritten to these.
FLAT_HOMES = {"_api": "compute.forward", "_grad": "compute.grad",
              "attention": "compute.attention", "cache": "compute.cache",
              "packed": "compute.packed", "_steps": "learn.steps", "_html": "learn.html",
              "plot": "learn.plot", "layer": "nn.layer", "interop": "nn.interop",
              "_core": "_internal.core", "_args": "_internal.args",
              "_arrays": "_internal.arrays", "_variants": "_internal.variants",
              "_runtime": "_internal.runtime", "_threadpool": "_internal.threadpool"}


def _git(*args, check=True):
    return subprocess.run(["git", "-C", str(ROOT), *args], check=check,
                          capture_output=True, text=True)


def _module_at(rev: str, path: str, package: str, name: str, replace=()):
    """The file ``path`` at git revision ``rev``, as the module <package>.<name>."""
    src = _git("show", f"{rev}:{path}").stdout
    for old, new in replace:
        src = src.replace(old, new)
    pkg = importlib.import_module(package)
    spec = importlib.util.spec_from_loader(f"{package}.{name}", loader=None)
    mod = importlib.util.module_from_spec(spec)
    mod.__package__ = package
    mod.__file__ = str(Path(pkg.__file__).parent / f"{name}.py")
    sys.modules[spec.name] = mod
    exec(compile(src, mod.__file__, "exec"), mod.__dict__)
    return mod


def _flat_imports():
    """(old, new) source replacements that point a flat-package module's
    relative imports at the modules' homes in this tree."""
    out = []
    for old, new in FLAT_HOMES.items():
        parent, _, leaf = new.rpartition(".")
        out += [(f"from .{old} import", f"from .{new} import"),
                (f"from . import {old}\n", f"from .{parent} import {leaf} as {old}\n")]
    return out


def old_checker(rev: str):
    """The checker at ``rev`` with the trace of ``rev`` (its key aliases),
    the rest of mhattn being this tree's. Revisions before the subpackages
    (python/mhattn/checker.py) have their imports pointed at the new homes."""
    if _git("cat-file", "-e", f"{rev}:python/mhattn/learn/checker.py", check=False).returncode == 0:
        _module_at(rev, "python/mhattn/learn/trace.py", "mhattn.learn", "_trace_before")
        return _module_at(rev, "python/mhattn/learn/checker.py", "mhattn.learn",
                          "_checker_before",
                          [("from .trace import", "from ._trace_before import")])
    flat = _flat_imports()
    _module_at(rev, "python/mhattn/trace.py", "mhattn", "_trace_before", flat)
    return _module_at(rev, "python/mhattn/checker.py", "mhattn", "_checker_before",
                      [("from .trace import", "from ._trace_before import")] + flat)


def named(rep) -> tuple:
    return tuple(getattr(rep, "mistakes", None) or ((rep.mistake,) if rep.mistake else ()))


def score(expected, rep):
    """(fully named?, planted mistakes named)"""
    got = named(rep)
    if not expected:
        return bool(rep.ok), 0
    hits = sum(m in got for m in expected)
    return set(got) == set(expected), hits


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    # the last revision before issue 15's checker (the step model)
    ap.add_argument("--before", default="8f54e053842a47e65d0f81a19823a936eb73875d",
                    help="git revision of the old checker (default: the one before issue 15)")
    ap.add_argument("-v", action="store_true", help="print every row")
    args = ap.parse_args(argv)
    import mhattn
    corpus = load_corpus()
    before = old_checker(args.before)
    rows, tot = [], dict(b_full=0, a_full=0, b_hits=0, a_hits=0, planted=0)
    times = []
    for name, expected, dtype, fn in corpus:
        rb = before.check_prototype(fn, dtype=dtype)
        t0 = time.perf_counter()
        ra = mhattn.check_prototype(fn, dtype=dtype)
        times.append(time.perf_counter() - t0)
        fb, hb = score(expected, rb)
        fa, ha = score(expected, ra)
        tot["b_full"] += fb
        tot["a_full"] += fa
        tot["b_hits"] += hb
        tot["a_hits"] += ha
        tot["planted"] += len(expected)
        rows.append((name, "+".join(expected) or "(correct)",
                     "ok" if rb.ok else "+".join(named(rb)) or "-", fb,
                     "ok" if ra.ok else "+".join(named(ra)) or "-", fa))
    w = max(len(r[0]) for r in rows)
    print(f"{'prototype':<{w}}  {'planted':<48} {'BEFORE':<30}   {'AFTER':<48}")
    for name, exp, b, fb, a, fa in rows:
        print(f"{name:<{w}}  {exp:<48} {b:<30} {'Y' if fb else '.'} "
              f"{a:<48} {'Y' if fa else '.'}")
    n = len(rows)
    n_c = sum(1 for _, e, _, _ in corpus if not e)
    print()
    print(f"{n} prototypes ({n_c} correct, {n - n_c} with planted mistakes: "
          f"{tot['planted']} mistakes)")
    print(f"fully named (correct = ok; every planted mistake and nothing else): "
          f"BEFORE {tot['b_full']}/{n}, AFTER {tot['a_full']}/{n}")
    print(f"planted mistakes named: BEFORE {tot['b_hits']}/{tot['planted']}, "
          f"AFTER {tot['a_hits']}/{tot['planted']}")
    print(f"AFTER's time per report: median {np.median(times) * 1e3:.0f} ms, "
          f"max {max(times) * 1e3:.0f} ms")
    return 0


if __name__ == "__main__":
    sys.exit(main())
