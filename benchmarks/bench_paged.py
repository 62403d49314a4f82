"""What reading keys through pages costs: a decode step of many sequences
of mixed lengths through a :class:`mhattn.PagedKVCache` against the same
tokens in a :class:`mhattn.KVCache`, in one process.

    python benchmarks/bench_paged.py [--seqs 64] [--min-len 64] [--max-len 8192]
                                     [--page-sizes 16,128] [--heads 8] [--kv-heads 2]
                                     [--dk 64] [--dtype float32] [--rounds 5] [--stat median]

The lengths are spread log-uniformly from --min-len to --max-len (seeded),
the pages of the sequences interleaved in the pool as a server's would be
(each sequence appended in chunks of --chunk tokens, round robin: with 256,
runs of pages follow one another in the pool, which the kernels read as
one run of memory; with 16 or less, no two pages of a sequence do, and
every row is read through its own address).  The timed
call is one decode step on projected queries, every sequence at once:
``mhattn.attention(q, cache=paged, sequence_ids=ids)`` (q (n, H, 1, d_k))
against the core's attention on the KVCache's storage with the sequences'
lengths (the call a KVCache's cached step makes), which give the same bits
(checked before timing).  Each round times every variant once (rotating
which goes first) and keeps each one's median call (``--stat min``: the
fastest call); the table gives the median (or fastest) round and the
ratio to the KVCache.  Issue 39's target: at most 1.1.  The ISA is printed
first; quote ratios of one run.
"""
import argparse
import statistics

import numpy as np

import mhattn
from mhattn._internal import core
from mhattn._internal.args import head_scales
from bench_dropout import round_time as timed   # one call's time, `stat` over a budget


def storage(name):
    if name == "bfloat16":
        import ml_dtypes
        return ml_dtypes.bfloat16
    return {"float32": np.float32, "float16": np.float16, "int8": "int8"}[name]


def main():
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--seqs", type=int, default=64)
    ap.add_argument("--min-len", type=int, default=64)
    ap.add_argument("--max-len", type=int, default=8192)
    ap.add_argument("--page-sizes", default="16,128")
    ap.add_argument("--chunk", type=int, default=256,
                    help="tokens appended to each sequence per round (round robin): 16 or "
                         "less interleaves every page of a sequence with the others'")
    ap.add_argument("--heads", type=int, default=8)
    ap.add_argument("--kv-heads", type=int, default=2)
    ap.add_argument("--dk", type=int, default=64)
    ap.add_argument("--dtype", choices=("float32", "float16", "bfloat16", "int8"),
                    default="float32")
    ap.add_argument("--threads", type=int, default=None, help="mhattn.set_num_threads")
    ap.add_argument("--rounds", type=int, default=5)
    ap.add_argument("--budget", type=float, default=1.0, help="seconds per variant per round")
    ap.add_argument("--stat", choices=("median", "min"), default="median")
    a = ap.parse_args()
    stat = statistics.median if a.stat == "median" else min
    if a.threads:
        mhattn.set_num_threads(a.threads)
    rng = np.random.default_rng(0)
    n, H, G, dk = a.seqs, a.heads, a.kv_heads, a.dk
    lens = np.exp(rng.uniform(np.log(a.min_len), np.log(a.max_len), n)).astype(np.int64)
    lens[0], lens[-1] = a.min_len, a.max_len
    dt = storage(a.dtype)
    kv = mhattn.KVCache(n, G, int(lens.max()), dk, dtype=dt)
    chunk = a.chunk
    for t0 in range(0, int(lens.max()), chunk):
        rows = rng.standard_normal((n, G, chunk, dk)).astype(np.float32)
        take = np.clip(lens - t0, 0, chunk)
        kv.append(rows if dt != np.float32 else rows, rows, lengths=take)
    scales = np.asarray(head_scales(H, H, [dk] * H, None), np.float64)
    q = rng.standard_normal((n, H, 1, dk)).astype(np.float32)

    def kv_call():
        return core.attention_in_layer_words(q, kv.key_storage, kv.value_storage, scales, None,
                                             False, kv._lengths.copy(), None, True, False,
                                             False, False, kv.key_scales, kv.value_scales)[0]

    variants = {"KVCache": kv_call}
    for ps in (int(p) for p in a.page_sizes.split(",")):
        pages = int(sum(-(-lens // ps)))
        paged = mhattn.PagedKVCache(pages, ps, G, dk, dtype=dt)
        ids = [paged.add_sequence() for _ in range(n)]
        # Round robin in chunks, as a server's appends interleave the pages.
        for t0 in range(0, int(lens.max()), chunk):
            take = np.clip(lens - t0, 0, chunk)
            live = [i for i in range(n) if take[i] > 0]
            sel = np.array(live)
            k = np.ascontiguousarray(kv.key_storage[sel][:, :, t0:t0 + chunk])
            v = np.ascontiguousarray(kv.value_storage[sel][:, :, t0:t0 + chunk])
            if kv.key_scales is not None:
                # An int8 cache: the stored rows, dequantised, quantise back
                # to themselves only approximately; copy the pages instead.
                k = k.astype(np.float32)
                v = v.astype(np.float32)
            paged.append([ids[i] for i in live], k, v, lengths=take[sel])
        if kv.key_scales is not None:
            for i, s in enumerate(ids):
                for p, page in enumerate(paged.pages(s)):
                    rows = slice(p * ps, min((p + 1) * ps, int(lens[i])))
                    m = rows.stop - rows.start
                    paged.key_pages[page, :, :m] = kv.key_storage[i, :, rows]
                    paged.value_pages[page, :, :m] = kv.value_storage[i, :, rows]
                    paged.key_scales[page, :, :m] = kv.key_scales[i, :, rows]
                    paged.value_scales[page, :, :m] = kv.value_scales[i, :, rows]
        got = mhattn.attention(q, cache=paged, sequence_ids=ids)
        assert np.array_equal(got, kv_call()), f"page_size {ps}: not the KVCache's bits"
        variants[f"paged, page_size={ps}"] = (
            lambda paged=paged, ids=ids: mhattn.attention(q, cache=paged, sequence_ids=ids))
        # The core's call alone, its block table made once: what the
        # pages cost, apart from the Python around the call.
        bt, plens = paged.block_table(ids), paged.lengths(ids)
        variants[f"paged core call, page_size={ps}"] = (
            lambda paged=paged, bt=bt, plens=plens: core.attention_in_layer_words(
                q, paged.key_pages, paged.value_pages, scales, None, False, plens.copy(), None,
                True, False, False, False, paged.key_scales, paged.value_scales, bt)[0])

    held = int(lens.sum())
    print(f"ISA {mhattn.get_isa()}, {mhattn.get_num_threads()} threads; decode step of {n} "
          f"sequences of {a.min_len} to {a.max_len} tokens ({held} held, mean "
          f"{held / n:.0f}); H = {H}, G = {G}, d_k = {dk}, {a.dtype} storage, appended "
          f"{a.chunk} tokens a round, stat {a.stat}")
    rounds = {name: [] for name in variants}
    names = list(variants)
    for r in range(a.rounds):
        for name in names[r % len(names):] + names[:r % len(names)]:
            rounds[name].append(timed(variants[name], a.budget, stat))
    print("\n| variant | ms | / KVCache |")
    print("|---|---|---|")
    base = stat(rounds["KVCache"])
    for name in names:
        t = stat(rounds[name])
        print(f"| {name} | {t * 1e3:.3f} | {t / base:.3f} |")


if __name__ == "__main__":
    main()
