"""
A long sequence on a Dask cluster
=================================

:mod:`mhattn.dask` computes exact attention over Dask arrays: one task per
(query chunk, key chunk) block that some query may see, each an
``mhattn.attention(..., return_lse=True)`` on NumPy blocks, and a fixed
tree of :func:`mhattn.merge_attention` tasks per query chunk. Here a
``LocalCluster`` of two worker processes, one thread each, computes causal
attention over 8192 tokens cut into chunks of 1024, and its gradients; the
results are those of one :func:`mhattn.attention` call on the whole arrays.
The figures then draw the task graph the call built. This example needs
``pip install 'mhattn[dask]'`` and matplotlib; it starts two processes, so
it takes a few seconds rather than one.
"""
import time

import dask.array as da
import numpy as np
from distributed import Client, LocalCluster
from matplotlib.figure import Figure

import mhattn
import mhattn.dask

T, chunk, heads, d_k = 8192, 1024, 4, 64
cluster = LocalCluster(n_workers=2, threads_per_worker=1, processes=True,
                       dashboard_address=":0", silence_logs=40)
client = Client(cluster)
print(len(client.scheduler_info()["workers"]), "workers; the dashboard would be at",
      client.dashboard_link.split("/status")[0] + "/status")

# The inputs live on the workers, cut along time: (B, h, T, d_k) in chunks
# of (1, h, 1024, d_k).
rs = da.random.RandomState(0)
q, k, v = (rs.standard_normal((1, heads, T, d_k), chunks=(1, heads, chunk, d_k))
           .astype(np.float32) for _ in range(3))
q, k, v = client.persist([q, k, v])
qn, kn, vn = client.compute([q, k, v], sync=True)      # the same, as NumPy

out, lse = mhattn.dask.attention(q, k, v, causal=True, return_lse=True)
t0 = time.perf_counter()
got_out, got_lse = client.compute([out, lse], sync=True)
t_dask = time.perf_counter() - t0

t0 = time.perf_counter()
want_out, want_lse = mhattn.attention(qn, kn, vn, causal=True, return_lse=True)
t_one = time.perf_counter() - t0
print(f"out: max abs difference from one call {np.abs(got_out - want_out).max():.1e}, "
      f"lse: {np.abs(got_lse - want_lse).max():.1e}")
print(f"this run: dask {t_dask:.2f} s (graph, tasks, moving the result here), "
      f"one call on {mhattn.get_num_threads()} threads {t_one:.2f} s")

# %%
# The gradients
# -------------
# :func:`mhattn.dask.attention_grad` reads the forward's ``out`` and ``lse``
# (no second forward) and sums dq over a query chunk's key chunks, dk and
# dv over a key chunk's query chunks, each by a fixed tree, so the bits do
# not depend on which worker ran what or when.
g = rs.standard_normal(q.shape, chunks=q.chunks).astype(np.float32)
grads = mhattn.dask.attention_grad(g, q, k, v, out, lse, causal=True)
got = client.compute(grads, sync=True)
want = mhattn.attention_grad(g.compute(), qn, kn, vn, causal=True)
for name in ("q", "k", "v"):
    err = np.abs(got[name] - want[name]).max() / np.abs(want[name]).max()
    print(f"d{name}: max relative difference {err:.1e}")
again = client.compute(grads, sync=True)
print("a second run gives the same bits:",
      all(np.array_equal(got[n], again[n]) for n in ("q", "k", "v")))
client.close()
cluster.close()

# %%
# The task graph
# --------------
# The graph holds a block task only where some query of the chunk sees a
# key of the chunk: causal attention over 8 chunks has 8 * 9 / 2 = 36
# blocks, not 64 (left). Each query chunk's partials meet in a binary tree
# over its key chunks in increasing order, adjacent pairs first (right:
# every task of the forward's graph, placed by its depth; an edge is a
# dependency). The tree's shape depends on the chunks alone, which is why
# every run on every cluster gives the same bits.
graph = dict(out.__dask_graph__())
name = next(key[0] for key in graph if isinstance(key, tuple)
            and str(key[0]).endswith("-block"))[:-len("-block")]
blocks = [key for key in graph if isinstance(key, tuple) and key[0] == name + "-block"]
merges = [key for key in graph if isinstance(key, tuple) and key[0] == name + "-merge"]
n = T // chunk
print(f"{len(blocks)} block tasks (n(n+1)/2 = {n * (n + 1) // 2}), {len(merges)} merges")

seen = np.zeros((n, n), bool)
for _, _, _, i, j in blocks:
    seen[i, j] = True

# A merge key is (name-merge, b, h, query chunk, level, index); its inputs
# are the two keys it names.
place = {}
for i in range(n):
    row = sorted(key for key in blocks if key[3] == i)
    for m, key in enumerate(row):
        place[key] = (0, i + 0.8 * m / n)
for key in sorted(merges, key=lambda key: key[4]):
    _, a, b = graph[key]
    place[key] = (key[4] + 1, (place[a][1] + place[b][1]) / 2)

fig = Figure(figsize=(10, 4.2))
ax1, ax2 = fig.subplots(1, 2, gridspec_kw=dict(width_ratios=(1, 1.6)))
ax1.imshow(seen, cmap="Blues", vmin=0, vmax=1.4)
ax1.set(title=f"block tasks: {len(blocks)} of {n * n}", xlabel="key chunk",
        ylabel="query chunk", xticks=range(n), yticks=range(n))
for key in merges:
    _, a, b = graph[key]
    for src in (a, b):
        (x0, y0), (x1, y1) = place[src], place[key]
        ax2.plot([x0, x1], [y0, y1], color="0.7", lw=0.8, zorder=1)
for keys, marker, label in ((blocks, "o", "mhattn.attention block"),
                            (merges, "s", "merge_attention")):
    xy = np.array([place[key] for key in keys])
    ax2.scatter(xy[:, 0], xy[:, 1], marker=marker, s=28, zorder=2, label=label)
ax2.invert_yaxis()
ax2.set(title="the forward's tasks, by depth", xlabel="depth (0: the blocks)",
        ylabel="query chunk", yticks=range(n),
        xticks=range(1 + max(place[key][0] for key in merges)), xlim=(-0.3, None))
ax2.legend(loc="upper right", fontsize=8)
fig.tight_layout()

# %%
# Speed and memory at full size
# -----------------------------
# ``python benchmarks/bench_dask.py`` runs T = 32768, 8 heads of 64,
# causal, chunks of 4096 (36 block tasks) on two worker processes of one
# thread each, against one ``mhattn.attention`` call on two threads, with
# the inputs already on the workers. On a 2-core AMD EPYC (Zen 4,
# ``avx512``), shared with other work, one run:
#
# ======================================  ============  ==============
# run                                     seconds       vs one call
# ======================================  ============  ==============
# one ``mhattn.attention``, 2 threads     5.86          1.00
# ``mhattn.dask``, 2 workers x 1 thread   6.79          1.16
# ======================================  ============  ==============
#
# Each worker held 96 MB of input chunks before the compute; the data Dask
# held there peaked at 233 and 209 MB (2.4x and 2.2x its inputs), and the
# workers' resident memory rose by 166 and 148 MB, so input chunks plus
# the rise came to 2.7x and 2.5x. The rise is the output chunks the worker
# keeps, copies of chunks fetched from the other worker, partials waiting
# for their merge and the blocks' working memory, which is bounded by one
# query chunk times one key chunk.
