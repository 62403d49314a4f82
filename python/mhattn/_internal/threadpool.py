"""mhattn's thread pool as seen by threadpoolctl, whichever is imported first.

threadpoolctl (an optional package, never imported here unless the user
already has) finds thread pools by walking the shared libraries loaded in
the process and matching their file names against registered controller
classes.  :func:`install` makes it see mhattn's pool:

- if threadpoolctl is already in ``sys.modules``, it registers
  :class:`MhattnController` at once (``threadpoolctl.register``);
- otherwise it puts a small finder at the head of ``sys.meta_path`` that
  answers only for ``"threadpoolctl"``: it asks the finders behind it for
  the real spec, wraps the spec's loader so that registration runs right
  after the module has executed, and removes itself once registration is
  done.  Until the user imports threadpoolctl nothing of it is loaded; the
  cost of the finder is one string comparison per first import of a module.

The controller's ``filename_prefixes`` is ``("_c.",)`` (threadpoolctl
lower-cases file names; every extension named ``_C`` matches), and the
controller rejects any library that is not the file of ``mhattn._C`` by
raising OSError while it is built, which threadpoolctl takes to mean "not
this controller's library".  mhattn's C symbols are hidden, so
``check_symbols`` could not tell the extensions apart.

A limit set through threadpoolctl is an ordinary
:func:`mhattn.set_num_threads`; on exit threadpoolctl sets the count it
read before, so a default count comes back as the same number set
explicitly.
"""
from __future__ import annotations

import os
import sys
import warnings

__all__ = ["install"]

_registered = False


def _register(tpc) -> None:
    """Registers the controller with the threadpoolctl module ``tpc`` (once)."""
    global _registered
    if _registered or not hasattr(tpc, "register") or not hasattr(tpc, "LibController"):
        return  # threadpoolctl < 3.0 has no third-party controllers

    from . import core, runtime
    from .version import __version__

    own = os.path.realpath(core.library_path())

    class MhattnController(tpc.LibController):
        """mhattn's persistent thread pool (``mhattn.set_num_threads``)."""

        user_api = "mhattn"
        internal_api = "mhattn"
        filename_prefixes = ("_c.",)

        def set_additional_attributes(self):
            # Built for every loaded library named _C.*: keep only ours.
            if os.path.realpath(self.filepath) != own:
                raise OSError(f"{self.filepath} is not mhattn's extension")
            self.architecture = runtime.get_isa()

        def get_num_threads(self):
            return runtime.get_num_threads()

        def set_num_threads(self, num_threads):
            runtime.set_num_threads(num_threads)

        def get_version(self):
            return __version__

    tpc.register(MhattnController)
    _registered = True


class _Loader:
    """The real loader of threadpoolctl, registering once it has executed."""

    def __init__(self, loader, finder):
        self._loader = loader
        self._finder = finder

    def create_module(self, spec):
        return self._loader.create_module(spec)

    def exec_module(self, module):
        self._loader.exec_module(module)
        self._finder.remove()
        try:
            _register(module)
        except Exception as e:  # never break the user's import of threadpoolctl
            warnings.warn(f"mhattn could not register its thread pool with "
                          f"threadpoolctl: {e!r}", RuntimeWarning, stacklevel=2)

    def __getattr__(self, name):  # get_source, get_filename, is_package, ...
        return getattr(self._loader, name)


class _Finder:
    """A sys.meta_path entry that answers only for the name "threadpoolctl"."""

    def find_spec(self, name, path=None, target=None):
        if name != "threadpoolctl":
            return None
        for finder in list(sys.meta_path):
            if finder is self or not hasattr(finder, "find_spec"):
                continue
            spec = finder.find_spec(name, path, target)
            if spec is not None:
                if spec.loader is not None and hasattr(spec.loader, "exec_module"):
                    spec.loader = _Loader(spec.loader, self)
                return spec
        return None

    def remove(self):
        try:
            sys.meta_path.remove(self)
        except ValueError:
            pass

    def invalidate_caches(self):
        pass


def install() -> None:
    """Registers now if threadpoolctl is imported, else when it gets imported."""
    tpc = sys.modules.get("threadpoolctl")
    if tpc is not None:
        _register(tpc)
        return
    if not any(isinstance(f, _Finder) for f in sys.meta_path):
        sys.meta_path.insert(0, _Finder())
