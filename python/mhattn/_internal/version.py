"""The version of mhattn, written once: pyproject.toml reads it from here
(``[tool.setuptools.dynamic]``, without importing the package) and
``mhattn.__version__`` re-exports it."""
__version__ = "0.1.0"
