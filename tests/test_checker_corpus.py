"""check_prototype on the corpus tests/prototypes/: every planted mistake is
named (both of a pair), nothing else, and the correct prototypes pass.

Each corpus file declares its planted mistakes (EXPECTED) and, optionally,
the dtype to check it in (DTYPE).  tools/checker_corpus.py prints the same
table against an older checker.
"""
import importlib.util
from pathlib import Path

import numpy as np
import pytest

import mhattn
from mhattn.learn.checker import MISTAKES

CORPUS = Path(__file__).parent / "prototypes"


def _load(path):
    spec = importlib.util.spec_from_file_location(f"_corpus_{path.stem}", path)
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


FILES = sorted(p for p in CORPUS.glob("*.py") if not p.name.startswith("_"))


def test_corpus_is_large_and_varied():
    mods = [_load(p) for p in FILES]
    assert len(mods) >= 40
    expected = [tuple(m.EXPECTED) for m in mods]
    assert sum(1 for e in expected if not e) >= 5          # correct ones
    assert sum(1 for e in expected if len(e) == 1) >= 25   # single mistakes
    assert sum(1 for e in expected if len(e) == 2) >= 8    # pairs
    attention_only = {"causal_top_left", "softcap_after_mask", "sink_in_numerator",
                      "rope_not_offset"}
    assert {m for e in expected for m in e} == set(MISTAKES) - attention_only
    styles = {p.stem.split("_")[0] for p in FILES}
    assert {"loop", "reshape", "einsum", "split", "dict", "pair", "correct"} <= styles


@pytest.mark.parametrize("path", FILES, ids=[p.stem for p in FILES])
def test_planted_mistakes_are_named(path):
    mod = _load(path)
    expected = tuple(mod.EXPECTED)
    dtype = np.dtype(getattr(mod, "DTYPE", "float64"))
    rep = mhattn.check_prototype(mod.prototype, dtype=dtype)
    if not expected:
        assert rep.ok, str(rep)
        return
    assert not rep.ok
    assert set(rep.mistakes) == set(expected), str(rep)
    assert rep.exact, str(rep)
    assert rep.mistake == rep.mistakes[0]
    text = str(rep)
    for m in expected:
        assert m in text and MISTAKES[m][0] in text
    failing = [t for t in rep.trials if not t.ok]
    assert all(t.matching for t in failing)
    assert all(not t.matching for t in rep.trials if t.ok)
