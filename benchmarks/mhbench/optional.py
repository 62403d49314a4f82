"""Optional dependencies: a missing one is None, and its figures say so."""


def import_torch():
    """The torch module, or None when it is not installed."""
    try:
        import torch
        import torch.nn.functional  # noqa: F401  (loaded for the variants)
    except ImportError:
        return None
    return torch
