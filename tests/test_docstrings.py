"""Every public name has a numpydoc docstring with an example, and every
example runs and prints what it says (doctest, with ``np`` and ``mhattn``
in scope; examples marked ``# doctest: +SKIP`` need an optional package)."""
import doctest
import inspect

import numpy as np
import pytest

import mhattn


def _public():
    for name in mhattn.__all__:
        obj = getattr(mhattn, name)
        if inspect.ismodule(obj):
            for sub in getattr(obj, "__all__", []):
                yield f"{name}.{sub}", getattr(obj, sub)
        else:
            yield name, obj


PUBLIC = sorted(_public())


@pytest.mark.parametrize("name,obj", PUBLIC, ids=[n for n, _ in PUBLIC])
def test_public_name_has_an_example(name, obj):
    doc = inspect.getdoc(obj) or ""
    assert doc.strip(), f"{name} has no docstring"
    assert ">>>" in doc, f"{name}'s docstring has no example"


@pytest.mark.parametrize("name,obj", PUBLIC, ids=[n for n, _ in PUBLIC])
def test_examples_run(name, obj):
    # A class's methods and properties too (PackedWeights.replace's example
    # printed np.True_ under NumPy 2 and no test ran it).
    finder = doctest.DocTestFinder(recurse=inspect.isclass(obj))
    module = inspect.getmodule(obj)
    globs = dict(vars(module)) if module else {}
    globs.update(np=np, mhattn=mhattn)
    runner = doctest.DocTestRunner(optionflags=doctest.NORMALIZE_WHITESPACE
                                   | doctest.ELLIPSIS)
    for test in finder.find(obj, name, globs=globs):
        runner.run(test)
    res = runner.summarize(verbose=False)
    mhattn.set_num_threads(None)
    assert res.failed == 0, f"{name}: {res.failed} of {res.attempted} examples failed"
