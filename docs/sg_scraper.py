"""A sphinx-gallery image scraper for figures made without pyplot.

mhattn draws with matplotlib's object API (``Figure()``), never pyplot, so
that importing it never picks a backend. sphinx-gallery's own matplotlib
scraper sees pyplot's figures only; this one saves every other matplotlib
Figure that a code block left in the example's namespace, once each.
conf.py names it as a string (``"sg_scraper.figures"``), which keeps the
configuration picklable.
"""
from sphinx_gallery.scrapers import figure_rst

_seen = {}   # example file -> ids of the figures already saved


def figures(block, block_vars, gallery_conf):
    """Save the block's new pyplot-free figures; their reST."""
    from matplotlib.figure import Figure

    seen = _seen.setdefault(block_vars["src_file"], set())
    paths = []
    for value in list(block_vars["example_globals"].values()):
        if (isinstance(value, Figure) and id(value) not in seen
                and getattr(value.canvas, "manager", None) is None):  # pyplot's: its scraper
            seen.add(id(value))
            path = next(block_vars["image_path_iterator"])
            value.savefig(path, bbox_inches="tight")
            paths.append(path)
    return figure_rst(paths, gallery_conf["src_dir"])
