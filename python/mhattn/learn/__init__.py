"""The learner's tools: see every step, check your own attention, plot it.

- :mod:`.trace`: :func:`trace`, every intermediate of a call, per head, and
  :class:`Trace`'s comparison of two;
- :mod:`.checker`: :func:`check_prototype` and
  :func:`check_attention_prototype`, which name the mistakes of a learner's
  own attention (the table of mistakes is ``checker.MISTAKES``);
- :mod:`.steps`: the step model the checker re-enacts mistakes on;
- :mod:`.plot`: :func:`plot_attention`;
- :mod:`.html`: the notebook displays of traces and reports.

The reference these tools show is :mod:`mhattn.reference`.
"""
from .trace import trace, Trace
from .plot import plot_attention
from .checker import check_prototype, check_attention_prototype

__all__ = ["trace", "Trace", "plot_attention", "check_prototype", "check_attention_prototype"]
