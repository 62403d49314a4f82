"""mhattn.checker: the path README.md documents for the checker's table of
mistakes (``mhattn.checker.MISTAKES``), kept importable
(``import mhattn.checker``, ``from mhattn.checker import MISTAKES``).

The checker lives in :mod:`mhattn.learn.checker`; this module re-exports its
public names, the very same objects. It is a plain module, found by the
import system in the ordinary way, rather than a second name for
``mhattn.learn.checker`` in ``sys.modules``: one module object per name, and
nothing in ``mhattn/__init__.py`` that rewires imports. The checker is the
one module of the flat package whose import path README.md documents
(besides :mod:`mhattn.reference`, a subpackage); the layer and interop are
documented as ``mhattn.MultiHeadAttention`` and ``mhattn.from_torch_masks``.
The checker's private helpers are in :mod:`mhattn.learn.checker` only.
"""
from .learn.checker import (MISTAKES, PrototypeReport, TrialResult, check_attention_prototype,
                            check_prototype)

__all__ = ["check_prototype", "check_attention_prototype", "PrototypeReport", "TrialResult",
           "MISTAKES"]
