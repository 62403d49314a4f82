"""python -m mhattn: the document's worked example, computed by the C core.

    python -m mhattn                    print the worked example, step by step
    python -m mhattn --notebook [PATH]  write the walkthrough notebook to PATH
                                        (a folder, . by default, or a .ipynb file)
"""
from __future__ import annotations

import argparse
import os
import sys
from importlib import resources

import numpy as np

from ._internal.args import normalize
from ._internal.core import run_core
from .reference import param_count, worked_example

NOTEBOOK = "walkthrough.ipynb"


def _fmt(v) -> str:
    v = np.atleast_1d(np.asarray(v, dtype=float))
    if v.ndim == 1:
        return "[" + ", ".join(f"{e:.4f}" for e in v) + "]"
    return "[" + ", ".join(_fmt(row) for row in v) + "]"


def notebook():
    """The walkthrough notebook shipped in the package (package data), as an
    importlib.resources Traversable: ``notebook().read_bytes()``."""
    return resources.files("mhattn.learn") / NOTEBOOK


def write_notebook(path, out=sys.stdout) -> int:
    """Write the walkthrough notebook to ``path``: into it when it is a
    folder, else to that file. An existing file is left alone."""
    target = os.path.normpath(os.path.join(path, NOTEBOOK) if os.path.isdir(path) else path)
    try:
        with open(target, "xb") as f:
            f.write(notebook().read_bytes())
    except FileExistsError:
        print(f"{target} already exists: remove it or give another path", file=sys.stderr)
        return 1
    except OSError as e:
        print(f"cannot write {target}: {e.strerror}", file=sys.stderr)
        return 1
    print(f"wrote {target}; open it with: jupyter lab {target}", file=out)
    print("(it needs matplotlib and Jupyter: pip install jupyterlab matplotlib)", file=out)
    return 0


def main(out=sys.stdout, argv=None) -> int:
    """``python -m mhattn [--notebook [PATH]]``; ``argv`` None means no arguments."""
    ap = argparse.ArgumentParser(prog="python -m mhattn", description=__doc__.splitlines()[0])
    ap.add_argument("--notebook", nargs="?", const=".", metavar="PATH",
                    help="write the walkthrough notebook into the folder PATH "
                         "(default: the current one) or to the file PATH, then stop")
    args = ap.parse_args([] if argv is None else argv)
    if args.notebook is not None:
        return write_notebook(args.notebook, out)
    return worked_example_steps(out)


def worked_example_steps(out=sys.stdout) -> int:
    """Print the document's worked example, step by step, as the core computes it."""
    tokens, X, w_q, w_k, w_v, w_o = worked_example()
    call = normalize(X, w_q, w_k, w_v, w_o)
    res, weights, (q, k, v, concat, lse) = run_core(call, want_weights=True, keep=True)
    p = lambda *a: print(*a, file=out)  # noqa: E731
    p("mhattn - the worked example of multi-head attention, computed by the C core")
    p("")
    p("Tokens and their embeddings (entity, adjective, number/verb, bias):")
    for t, row in zip(tokens, X):
        p(f"  x_{t:<5}= {_fmt(row)}")
    p("")
    it = tokens.index("it")
    p(f"h = {call.H} heads, d_k = d_v = {call.dk[0]}; the query is the token 'it'.")
    for h in range(call.H):
        g = call.kv_head(h)
        dk = call.dk[g]
        q_it = q[0, it, call.q_cols(h)]
        K = k[0, :, call.k_cols(g)]
        raw = K @ q_it
        scaled = raw * call.scales[h]
        p("")
        p(f"Head {h + 1}:")
        p(f"  q (it)          = {_fmt(q_it)}")
        p(f"  K               = {_fmt(K)}")
        p(f"  V               = {_fmt(v[0, :, call.v_cols(g)])}")
        p(f"  scores K.q      = {_fmt(raw)}    on ({', '.join(tokens)})")
        p(f"  scaled / sqrt({dk}) = {_fmt(scaled)}")
        p(f"  weights         = {_fmt(weights[0, h, it])}")
        p(f"  output          = {_fmt(concat[0, it, call.concat_cols(h)])}")
    p("")
    p(f"Concat(head_1, head_2) for 'it' = {_fmt(concat[0, it])}")
    p(f"MultiHead output (W^O = I)      = {_fmt(res[0, it])}")
    p("")
    p("Parameter count of W^Q, W^K, W^V and W^O with d_k = d_v = d_model / h:")
    d_model = 512
    for h in (1, 2, 4, 8, 16):
        p(f"  d_model = {d_model}, h = {h:>2}, d_k = {d_model // h:>3}: "
          f"{param_count(d_model, h):>9,d} = 4 * {d_model}^2 = {4 * d_model ** 2:,d}")
    p("The count does not depend on h: more heads split the same budget.")
    p("")
    p("Next: the tutorials, in docs/tutorials/ of the source tree; the whole site")
    p("builds with: pip install '.[docs]' && sphinx-build -b html docs docs/_build/html")
    return 0


if __name__ == "__main__":
    sys.exit(main(argv=sys.argv[1:]))
