"""Central differences, for the tests that check a gradient numerically."""
import numpy as np


def central_differences(f, a: np.ndarray, eps: float = 1e-6) -> np.ndarray:
    """df/da of a scalar function f of the float64 array a, element by
    element: (f(a + eps e_i) - f(a - eps e_i)) / (2 eps), a of its shape."""
    g = np.zeros_like(a)
    for idx in np.ndindex(a.shape):
        p, m = a.copy(), a.copy()
        p[idx] += eps
        m[idx] -= eps
        g[idx] = (f(p) - f(m)) / (2 * eps)
    return g
