"""The documentation's API reference lists every public name (issue 37).

docs/reference/index.rst's autosummary tables give each public name of
mhattn, its submodules and mhattn.reference a generated page. A name added
to an ``__all__`` without a page there fails here, before a reader finds
it missing; so does a page for a name that is no longer public.
"""
import importlib.util
import os
import re

import mhattn
import mhattn.learn
import mhattn.nn
import mhattn.reference

INDEX = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))),
                     "docs", "reference", "index.rst")


def documented():
    """{full name} of every autosummary entry, under its currentmodule."""
    module, names, in_table = None, set(), False
    with open(INDEX, encoding="utf-8") as f:
        for line in f:
            m = re.match(r"\.\. currentmodule:: (\S+)", line)
            if m:
                module, in_table = m.group(1), False
            elif line.startswith(".. autosummary::"):
                in_table = True
            elif in_table and re.match(r"   [A-Za-z_]\w*$", line.rstrip()):
                names.add(f"{module}.{line.strip()}")
            elif line.strip() and not line.startswith("   "):
                in_table = False
    return names


def test_every_public_name_has_a_reference_page():
    pages = documented()
    public = {f"mhattn.{n}" for n in mhattn.__all__ if n != "reference"}   # a module
    public |= {f"mhattn.reference.{n}" for n in mhattn.reference.__all__}
    # the optional mhattn.dask (pip install mhattn[dask]) when Dask is here
    dask_pages = {p for p in pages if p.startswith("mhattn.dask.")}
    assert dask_pages, "mhattn.dask has no reference pages"
    if importlib.util.find_spec("dask") is not None:
        md = importlib.import_module("mhattn.dask")
        public |= {f"mhattn.dask.{n}" for n in md.__all__}
    else:
        pages = pages - dask_pages
    # the layer's and the learner's names are re-exported at the top level
    assert set(mhattn.nn.__all__) <= set(mhattn.__all__)
    assert set(mhattn.learn.__all__) <= set(mhattn.__all__)
    assert public - pages == set(), "public names without a reference page"
    extra = {p for p in pages if not p.startswith("mhattn.learn.trace.")} - public
    assert extra == set(), "reference pages for names that are not public"
    assert len(pages) >= len(mhattn.__all__) - 1 + len(mhattn.reference.__all__)
