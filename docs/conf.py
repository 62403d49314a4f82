"""Sphinx configuration of mhattn's documentation site.

Build (offline: nothing is fetched, no intersphinx):

    pip install '.[docs]'
    sphinx-build -W -b html docs docs/_build/html

The API reference is generated from the docstrings (autosummary +
numpydoc), and the gallery's examples (docs/examples) are executed at
build time by sphinx-gallery, so every figure and number on the site is
what the code prints today.
"""
import os
import sys

import mhattn


project = "mhattn"
author = "the mhattn developers"
copyright = "2026, the mhattn developers"
release = mhattn.__version__
version = ".".join(release.split(".")[:2])

extensions = [
    "sphinx.ext.autodoc",
    "sphinx.ext.autosummary",
    "sphinx.ext.doctest",
    "sphinx.ext.mathjax",
    "numpydoc",
    "sphinx_gallery.gen_gallery",
]

# Every reference must resolve (-W makes a miss fail the build).
nitpicky = True
nitpick_ignore_regex = [
    # NumPy's and the standard library's types, named in docstrings: no
    # intersphinx here (a build machine has no network).
    (r"py:.*", r"(numpy|np|ml_dtypes|torch|threadpoolctl|dask)(\..*)?"),
    # private helpers that some docstrings name for the curious reader
    (r"py:.*", r"mhattn\._internal\..*"),
    (r"py:.*", r"(int|float|bool|str|tuple|list|dict|callable|object|None|optional|"
               r"array_like|array|ndarray|sequence|iterable|generator|slice|"
               r"default|shape|dtype|or|of|and)"),
]

templates_path = ["_templates"]
autosummary_generate = True
# sphinx-build -b doctest runs the pages' ``.. doctest::`` blocks (the
# tutorials'). The docstrings' examples, which autodoc puts on the pages
# too, run in tests/test_docstrings.py, each in its module's namespace, so
# they are not run again here.
doctest_test_doctest_blocks = ""
doctest_global_setup = "import numpy as np\nimport mhattn"
autodoc_typehints = "none"
# Methods' docstrings open with "name(args) -> what: summary" for help();
# that line is the summary here, not a signature to parse.
autodoc_docstring_signature = False
numpydoc_show_class_members = False
numpydoc_class_members_toctree = False
numpydoc_xref_param_type = False
# Checked on every documented object at build time (-W fails the build):
# a docstring (GL08) with a summary (SS01), every parameter documented
# (PR01) and none that does not exist (PR02), a Returns section (RT01)
# and an Examples section (EX01).
numpydoc_validation_checks = {"GL08", "SS01", "PR01", "PR02", "RT01", "EX01"}
# The exceptions, each with its reason:
numpydoc_validation_exclude = {
    # property(lambda ...): numpydoc 1.11's validate finds no def line, raises StopIteration
    r"^mhattn\.KVCache\.(batch|num_kv_heads|capacity|d_k|d_v|dtype)$",
    r"^mhattn\.PagedKVCache\.(num_pages|page_size|num_kv_heads|d_k|d_v|dtype|pages_free)$",
    r"^mhattn\.MultiHeadAttention\.w_[qkvo]$",
    # an attribute's one-line #: comment has no room for Examples; CompareReport documents it
    r"^mhattn\.learn\.trace\.CompareReport\.unused$",
}

exclude_patterns = ["_build", "gen_modules", "examples", "auto_examples/*.ipynb",
                    "auto_examples/*.py", "auto_examples/*.zip", "auto_examples/*.md5",
                    "auto_examples/*.codeobj.json", "sg_execution_times.rst"]

html_theme = "pydata_sphinx_theme"
html_title = f"mhattn {release}"
html_static_path = []
html_theme_options = {
    "navigation_with_keys": False,
    "show_toc_level": 2,
}

sphinx_gallery_conf = {
    "examples_dirs": "examples",
    "gallery_dirs": "auto_examples",
    "filename_pattern": r"/plot_",
    # a reading order, from the document's example to the benchmarks
    "within_subsection_order": "sg_scraper.Order",
    "download_all_examples": False,
    "remove_config_comments": True,
    "abort_on_example_error": True,
    "only_warn_on_example_error": False,
    "plot_gallery": "True",
    "matplotlib_animations": False,
    "show_memory": False,
    "write_computation_times": False,
    # pyplot's figures, and the ones mhattn draws without pyplot
    "image_scrapers": ("matplotlib", "sg_scraper.figures"),
}

# The examples draw with matplotlib, off screen.
os.environ.setdefault("MPLBACKEND", "Agg")
sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))   # sg_scraper


def _signature_as_literal(app, what, name, obj, options, lines):
    """mhattn's docstrings restate the call's signature after their summary
    (``multi_head_attention(x, w_q, ..., *, num_heads=None, ...)``), for
    ``help()``; reST would read its ``*`` as emphasis. Shown as a literal
    block instead."""
    short = name.rsplit(".", 1)[-1]
    if lines and lines[0].startswith(short + "("):
        # a method's "name(args) -> what: summary": the call as code
        call, sep, summary = lines[0].partition(": ")
        lines[0] = f"``{call}``{sep}{summary}"
    for i, line in enumerate(lines):
        if line.startswith(short + "(") and i > 0 and not lines[i - 1].strip():
            j = i
            while j < len(lines) and lines[j].strip():
                j += 1
            lines[i:j] = ["::", ""] + ["    " + text for text in lines[i:j]]
            return


def setup(app):
    # before numpydoc's own handler (priority 500) parses the sections
    app.connect("autodoc-process-docstring", _signature_as_literal, priority=100)
