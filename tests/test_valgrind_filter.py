"""tools/valgrind_filter.py tells mhattn's frames from the interpreter's:
the glue's csrc/python/call.c and module.c share their names with CPython's
Objects/call.c and Python/module.c, and a memcheck run of a clean build must
not count CPython's frames as ours (CI's valgrind step counted 4401 of them
once the glue had a call.c)."""
import os
import sys
import xml.etree.ElementTree as ET

import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
if not os.path.isdir(os.path.join(ROOT, "csrc")):
    pytest.skip("no csrc/ here (an installed copy of the tests)", allow_module_level=True)
sys.path.insert(0, os.path.join(ROOT, "tools"))
valgrind_filter = pytest.importorskip("valgrind_filter")


def frame(obj, folder, name):
    return ET.fromstring(f"<frame><obj>{obj}</obj><dir>{folder}</dir><file>{name}</file></frame>")


@pytest.mark.parametrize("obj, folder, name, want", [
    ("/usr/bin/python3.11", "/usr/src/Python-3.11/Objects", "call.c", False),
    ("/usr/bin/python3.11", "/usr/src/Python-3.11/Python", "module.c", False),
    ("/usr/lib/libc.so.6", "", "", False),
    ("/venv/site-packages/mhattn/_C.so", "", "", True),                 # the extension itself
    ("/elsewhere/inlined.so", "/tmp/pip-build-1/csrc/python", "call.c", True),
    ("/elsewhere/inlined.so", "/work/other/csrc/core", "forward.c", True),
    ("/elsewhere/inlined.so", "/work/other/csrc/core", "call.c", False),   # no such file of ours
])
def test_ours(obj, folder, name, want):
    assert valgrind_filter.ours(frame(obj, folder, name), "_C.so") is want
