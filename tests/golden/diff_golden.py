"""Which golden arrays a change moved, and by how much.

    python tests/golden/diff_golden.py OLD.npz NEW.npz

Prints, per output kind (out, weights, lse, concat, each gradient), how many
arrays differ in any bit and the largest difference relative to the array's
largest magnitude, for the float32 and float64 cases apart.
"""
import sys
from collections import defaultdict

import numpy as np


def kind(key):
    case, out = key.split("/", 1)
    dt = case.rsplit("-", 1)[1] if "-" in case else "f64"   # worked_example
    return dt, out.split("[")[0]


def main(old_path, new_path):
    old, new = np.load(old_path), np.load(new_path)
    assert sorted(old.files) == sorted(new.files), "the two files hold other arrays"
    stats = defaultdict(lambda: [0, 0, 0.0])
    for key in old.files:
        a, b = old[key], new[key]
        s = stats[kind(key)]
        s[0] += 1
        if a.tobytes() != b.tobytes():
            s[1] += 1
            fin = np.isfinite(a) & np.isfinite(b)
            scale = max(float(np.max(np.abs(a[fin]), initial=0.0)), 1e-300)
            d = float(np.max(np.abs(a[fin].astype(np.float64) - b[fin]), initial=0.0))
            s[2] = max(s[2], d / scale)
            if not np.array_equal(np.isfinite(a), np.isfinite(b)):
                s[2] = float("inf")
    print(f"{'dtype':6} {'output':14} {'arrays':>6} {'changed':>7} {'max rel diff':>13}")
    for (dt, out), (n, ch, d) in sorted(stats.items()):
        print(f"{dt:6} {out:14} {n:6d} {ch:7d} {d:13.3g}")


if __name__ == "__main__":
    main(*sys.argv[1:3])
