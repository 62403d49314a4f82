"""sphinx-gallery hooks: an image scraper for figures made without pyplot,
and the gallery's order.

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


# The gallery's reading order: the document's example, then what one call
# shows, the patterns of masks, the learner's tools, decoding, a cluster,
# benchmarks.
ORDER = ["plot_worked_example_heads.py", "plot_several_heads.py", "plot_masks.py",
         "plot_window_chunk.py", "plot_rope_alibi.py", "plot_sinks.py", "plot_trace.py",
         "plot_checker.py", "plot_kv_cache.py", "plot_dask.py", "plot_benchmarks.py"]


class Order:
    """sphinx-gallery's within_subsection_order: ORDER first, then any other
    example by file name."""

    def __init__(self, src_dir):
        self.src_dir = src_dir

    def __call__(self, filename):
        return (ORDER.index(filename), filename) if filename in ORDER else (len(ORDER), filename)

    def __repr__(self):
        return "<sg_scraper.Order>"
