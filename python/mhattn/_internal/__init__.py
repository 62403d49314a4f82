"""mhattn's internals, the bottom layer: nothing here imports ``compute``,
``learn``, ``nn`` or ``reference``.

- :mod:`.core`: the one door to the C core, the only module of the package
  that imports ``mhattn._C`` (its entry points as named functions, and the
  fast and slow branches that canonicalise a call's arguments);
- :mod:`.args`: every argument checked and normalised once (a ``Call``);
- :mod:`.arrays`: array conversion and dtype checks;
- :mod:`.variants`: the attention variants (windows, softcap, ALiBi, sinks,
  RoPE, ...);
- :mod:`.runtime`: the ISA and the thread count;
- :mod:`.threadpool`: mhattn's pool as seen by threadpoolctl.
"""
