#!/usr/bin/env python3
"""Half precision (issue 36): mhattn in bfloat16 and float16 against mhattn
in float32 and against torch in the same dtype.

    python benchmarks/half_precision.py             # T = 128, 1024, 4096
    python benchmarks/half_precision.py --quick     # tiny sizes, seconds
    python benchmarks/half_precision.py --threads 1 --repeats 11
    python benchmarks/half_precision.py --only decode   # one of the two tables

A script that prints figures, not a timed test.  It prints:

1. the machine: mhattn's ISA, the CPU flags that decide a half path
   (avx2, f16c, avx512f, avx512_bf16, avx512_fp16; amx_bf16, amx_fp16 for
   torch's oneDNN), the thread count and how many repeats a median takes;
   and one thread's multiply-add rate with float32 FMAs against AVX512-BF16's
   vdpbf16ps where the CPU has it (benchmarks/peak.c): mhattn widens half
   values and uses FMAs, and this line says whether vdpbf16ps would do more
   multiply-adds per second on this machine;
2. prefill: the layer ``multi_head_attention(x, w_q, w_k, w_v, w_o,
   num_heads=8, causal=...)`` on one unbatched sequence x (T, 512), T in
   128, 1024, 4096, causal and not, with x and the weights in float32,
   bfloat16 and float16; "bf16/f32" and "f16/f32" are mhattn's half time
   over its float32 time (target <= 1.1x).  torch runs the same layer in
   the same dtype, the faster of nn.MultiheadAttention (eval, no_grad,
   need_weights=False; the causal mask with is_causal=True) and F.linear +
   F.scaled_dot_product_attention + F.linear (named MHA / SDPA), and
   "vs torch" is torch's time over mhattn's in that dtype (target >= 5x
   for the halves);
3. decode, when this build's KVCache holds bfloat16 or int8 keys and
   values: one cached layer step (``multi_head_attention(x_new, ...,
   cache=cache)``, T_q = 1) over 32768 cached tokens of 8 kv heads of 64,
   with 8 query heads and with 32 (GQA), for a float32, a bfloat16 and an
   int8 cache.  d_model is 64, so that the projections' weights (~1.3 MB in
   float32) are a small part of what a step reads.  "ms/token" is the
   step's median time (of 3 x --repeats steps); "vs f32" its ratio to the
   float32 cache's (targets: bfloat16 <= 0.6x, int8 <= 0.4x); "GB/s" the
   bytes a step reads (the
   held rows of the cache's storage, whatever it keeps per row, plus the
   weights) over that time; "% stream" that rate over the read bandwidth of
   benchmarks/stream.c on the same threads (compiled at start, as
   bench_decode.py does).  Otherwise it says that the caches are not in
   this build.

Timing: every variant of a row is checked once against mhattn float32
(before any timing), then timed in interleaved rounds (mhbench.timing:
each call timed alone, a pause between variants so that one pool's spinning
threads do not slow the next); each figure is the median of at least
--repeats calls, and every ratio is between medians of the same run.  The
machine may be shared: read the load line under the header.
"""
from __future__ import annotations

import argparse
import os
import re
import subprocess
import sys
from typing import Any, Callable, Dict, List, Optional

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, HERE)
sys.path.insert(0, os.path.join(os.path.dirname(HERE), "python"))

from mhbench.threads import early_thread_count, set_blas_env, usable_cpus  # noqa: E402

set_blas_env(early_thread_count(sys.argv[1:]))

import numpy as np  # noqa: E402

import mhattn  # noqa: E402
from mhbench import machine  # noqa: E402
from mhbench.optional import import_torch  # noqa: E402
from mhbench.peak import dot_rates  # noqa: E402
from mhbench.tables import Column, fmt_ms, fmt_ratio, print_table  # noqa: E402
from mhbench.timing import Timed, time_interleaved  # noqa: E402

try:
    import ml_dtypes
    BF16 = np.dtype(ml_dtypes.bfloat16)
except ImportError:          # float16 needs nothing; bfloat16 columns say n/a
    BF16 = None

DTYPES = ("float32", "bfloat16", "float16")
SHORT = {"float32": "f32", "bfloat16": "bf16", "float16": "f16", "int8": "int8"}
HALF_TARGET = 1.1            # mhattn half time / mhattn float32 time, at most
TORCH_TARGET = 5.0           # torch time / mhattn time in the same half dtype, at least
DECODE_TARGET = {"bfloat16": 0.6, "int8": 0.4}   # cache step time / float32 cache's
FLAGS = ("avx2", "f16c", "avx512f", "avx512_bf16", "avx512_fp16", "amx_bf16", "amx_fp16")
# agreement with mhattn float32, relative to its largest |output|: a few
# ulps of the dtype (inputs rounded, then the result)
AGREE = {"float32": 2e-3, "bfloat16": 6e-2, "float16": 8e-3}


def np_dtype(name: str) -> Optional[np.dtype]:
    return BF16 if name == "bfloat16" else np.dtype(name)


# ---- 1. the machine -------------------------------------------------------------

def cpu_flags() -> Dict[str, bool]:
    try:
        with open("/proc/cpuinfo") as f:
            text = f.read()
        m = re.search(r"^(flags|Features)\s*:(.*)$", text, re.M)
        have = set(m.group(2).split()) if m else set()
    except OSError:
        have = set()
    return {f: f in have for f in FLAGS}


def machine_lines(threads: int, repeats: int, torch) -> List[str]:
    flags = " ".join(f"{f}={'yes' if v else 'no'}" for f, v in cpu_flags().items())
    torch_line = "torch not installed" if torch is None else \
        f"torch {torch.__version__}, {torch.get_num_threads()} threads"
    return [f"mhattn {mhattn.__version__} ({machine.git_revision()}), ISA {mhattn.get_isa()}, "
            f"{mhattn.get_num_threads()} threads (of {usable_cpus()} usable CPUs); {torch_line}",
            f"CPU: {machine.cpu_model()}",
            f"flags: {flags}",
            f"each figure: the median of >= {repeats} calls (a decode step: {3 * repeats}), "
            "interleaved (see the docstring)"]


def dot_line(cc: str) -> str:
    """The multiply-add rates of one thread that decide the bfloat16 kernels'
    instruction: vfmadd231ps on widened values (what mhattn does) against
    AVX512-BF16's vdpbf16ps, where the CPU has it."""
    r = dot_rates(cc)
    if r["error"]:
        return f"multiply-adds: benchmarks/peak.c not built ({r['error']})"
    line = f"multiply-adds, 1 thread (benchmarks/peak.c): float32 FMA {r['fma']:.1f} GMAC/s"
    if r["vdpbf16ps"] is None:
        return line + "; no AVX512-BF16 here (vdpbf16ps not measured)"
    return line + (f", vdpbf16ps {r['vdpbf16ps']:.1f} GMAC/s ({r['vdpbf16ps'] / r['fma']:.2f}x): "
                   + ("a vdpbf16ps kernel would do fewer multiply-adds per second here"
                      if r["vdpbf16ps"] < r["fma"] else
                      "a vdpbf16ps kernel could do more multiply-adds per second here"))


# ---- 2. prefill -------------------------------------------------------------------

def layer_inputs(T: int, d: int, seed: int = 0):
    """x (T, d) and four (d, d) weights in float32, scaled so that scores and
    outputs stay O(1)."""
    r = np.random.default_rng(seed)
    x = r.standard_normal((T, d), dtype=np.float32)
    ws = [r.standard_normal((d, d), dtype=np.float32) * np.float32(d ** -0.5) for _ in range(4)]
    return x, ws


def mhattn_call(x, ws, h, causal, dtype) -> Callable[[], np.ndarray]:
    dt = np_dtype(dtype)
    xd, wd = x.astype(dt), [w.astype(dt) for w in ws]
    return lambda: mhattn.multi_head_attention(xd, *wd, num_heads=h, causal=causal)


def torch_calls(torch, x, ws, h, causal, dtype) -> Dict[str, Callable[[], Any]]:
    """The same layer in torch, in dtype: {"MHA": call, "SDPA": call}."""
    F = torch.nn.functional
    tdt = getattr(torch, dtype)
    T, d = x.shape
    mha = torch.nn.MultiheadAttention(d, h, bias=True, batch_first=True, dtype=tdt).eval()
    with torch.no_grad():
        # torch computes x W^T: in_proj_weight is [w_q | w_k | w_v]^T
        mha.in_proj_weight.copy_(torch.from_numpy(np.concatenate(ws[:3], axis=1).T))
        mha.out_proj.weight.copy_(torch.from_numpy(ws[3].T))
        mha.in_proj_bias.zero_()          # the fast path wants biases: zeros
        mha.out_proj.bias.zero_()
    mha.requires_grad_(False)
    tx = torch.from_numpy(x).to(tdt)[None]
    mask = torch.triu(torch.ones(T, T, dtype=torch.bool), diagonal=1) if causal else None
    w_in, w_out = mha.in_proj_weight, mha.out_proj.weight

    def run_mha():
        with torch.no_grad():
            return mha(tx, tx, tx, need_weights=False, attn_mask=mask, is_causal=causal)[0][0]

    def run_sdpa():
        with torch.no_grad():
            qkv = F.linear(tx, w_in).view(1, T, 3, h, d // h).permute(2, 0, 3, 1, 4)
            o = F.scaled_dot_product_attention(qkv[0], qkv[1], qkv[2], is_causal=causal)
            return F.linear(o.transpose(1, 2).reshape(1, T, d), w_out)[0]
    return {"MHA": run_mha, "SDPA": run_sdpa}


def as_f64(out) -> np.ndarray:
    if hasattr(out, "detach"):
        out = out.detach().float().numpy()
    return np.asarray(out).astype(np.float64)


def prefill_row(T, d, h, causal, torch, args) -> Dict[str, Any]:
    """One row: every variant checked against mhattn float32, then timed."""
    x, ws = layer_inputs(T, d)
    calls: Dict[str, Callable[[], Any]] = {}
    row: Dict[str, Any] = dict(T=T, d_model=d, h=h, causal=causal, ms={}, notes=[])
    for dtype in DTYPES:
        if np_dtype(dtype) is None:
            row["notes"].append(f"mhattn {dtype}: ml_dtypes is not installed")
            continue
        calls[f"mhattn {dtype}"] = mhattn_call(x, ws, h, causal, dtype)
        if torch is not None and not args.no_torch:
            try:
                for kind, fn in torch_calls(torch, x, ws, h, causal, dtype).items():
                    calls[f"torch {dtype} {kind}"] = fn
            except (RuntimeError, TypeError) as e:
                row["notes"].append(f"torch {dtype}: {e}")
    timed = {k: Timed(fn, min_repeats=args.repeats) for k, fn in calls.items()}
    want = None
    for k, t in list(timed.items()):
        try:
            out = as_f64(t.start(args.budget))
        except (RuntimeError, NotImplementedError) as e:     # torch without this op
            row["notes"].append(f"{k}: {str(e).splitlines()[0]}")
            del timed[k]
            continue
        if want is None:
            want = out                       # mhattn float32, first
        err = float(np.abs(out - want).max() / np.abs(want).max())
        dtype = k.split()[1]
        if err > AGREE[dtype]:
            raise AssertionError(f"T={T} causal={causal}: {k} disagrees with mhattn float32: "
                                 f"{err:.3g} > {AGREE[dtype]}")
    time_interleaved(list(timed.values()), rounds=args.rounds, settle_s=args.settle)
    row["ms"] = {k: t.median_s * 1e3 for k, t in timed.items()}
    derive(row)
    return row


def derive(row: Dict[str, Any]) -> None:
    """Ratios and targets from the row's medians (ms)."""
    ms = row["ms"]
    f32 = ms.get("mhattn float32")
    row["misses"] = []
    for dtype in DTYPES:
        mine = ms.get(f"mhattn {dtype}")
        peers = {k.split()[-1]: v for k, v in ms.items() if k.startswith(f"torch {dtype} ")}
        best = min(peers, key=peers.get) if peers else None
        row[f"torch {dtype}"] = (peers[best], best) if best else None
        row[f"vs torch {dtype}"] = peers[best] / mine if best and mine else None
        if dtype != "float32":
            row[f"{dtype}/f32"] = mine / f32 if mine and f32 else None
            if row[f"{dtype}/f32"] is not None and row[f"{dtype}/f32"] > HALF_TARGET:
                row["misses"].append(f"{SHORT[dtype]}/f32")
            if row[f"vs torch {dtype}"] is not None and row[f"vs torch {dtype}"] < TORCH_TARGET:
                row["misses"].append(f"vs torch {SHORT[dtype]}")


def _ms(key):
    return lambda r: fmt_ms(r["ms"].get(key))


def _torch(dtype):
    def cell(r):
        t = r.get(f"torch {dtype}")
        return "n/a" if t is None else f"{fmt_ms(t[0])} {t[1]}"
    return cell


def _ratio(key):
    return lambda r: fmt_ratio(r.get(key))


def _verdict(r):
    checked = any(r.get(k) is not None for k in ("bfloat16/f32", "float16/f32"))
    if not checked:
        return "n/a"
    return "MISS " + ",".join(r["misses"]) if r["misses"] else "PASS"


PREFILL_COLUMNS = [
    Column("T", lambda r: str(r["T"])),
    Column("causal", lambda r: "yes" if r["causal"] else "no"),
    Column("f32 ms", _ms("mhattn float32")),
    Column("bf16 ms", _ms("mhattn bfloat16")),
    Column("bf16/f32", _ratio("bfloat16/f32")),
    Column("f16 ms", _ms("mhattn float16")),
    Column("f16/f32", _ratio("float16/f32")),
    Column("torch f32 ms", _torch("float32")),
    Column("torch bf16 ms", _torch("bfloat16")),
    Column("torch f16 ms", _torch("float16")),
    Column("vs torch f32", _ratio("vs torch float32")),
    Column("vs torch bf16", _ratio("vs torch bfloat16")),
    Column("vs torch f16", _ratio("vs torch float16")),
    Column("target", _verdict, "<"),
]


# ---- 3. decode ---------------------------------------------------------------------

def cache_dtypes_available() -> Dict[str, Optional[str]]:
    """{cache dtype: None if this build's KVCache takes it, else why not}."""
    out = {}
    for name in ("bfloat16", "int8"):
        try:
            mhattn.KVCache(1, 1, 4, 4, dtype=BF16 if name == "bfloat16" else name)
            out[name] = None
        except (TypeError, ValueError, AttributeError) as e:
            out[name] = f"{type(e).__name__}: {e}"
    return out


def decode_row(H, G, Tk, dtypes, args, stream_gbs) -> Dict[str, Any]:
    """One cached step per cache dtype, interleaved; bytes read per step are
    the held rows of the storage (its bytes per row, scales or whatever the
    cache keeps included) plus the weights."""
    d, d_model = 64, 64
    r = np.random.default_rng(2)
    k = r.standard_normal((1, G, Tk, d), dtype=np.float32)
    v = r.standard_normal((1, G, Tk, d), dtype=np.float32)
    x_new = r.standard_normal((1, 1, d_model), dtype=np.float32)
    ws = [r.standard_normal(s, dtype=np.float32) * np.float32(s[0] ** -0.5)
          for s in ((d_model, H * d), (d_model, G * d), (d_model, G * d), (H * d, d_model))]
    w_bytes = sum(w.nbytes for w in ws)
    # every step appends one row: room for the warm-up call and the timed ones
    repeats = 3 * args.repeats
    steps = repeats + 8
    row: Dict[str, Any] = dict(H=H, G=G, Tk=Tk, ms={}, bytes={}, notes=[])
    timed = {}
    want = None
    for name in dtypes:
        cache = mhattn.KVCache(1, G, Tk + steps, d, dtype=BF16 if name == "bfloat16" else name)
        try:
            cache.append(k, v)
        except TypeError:                   # a cache that wants its own dtype
            cache.append(k.astype(cache.dtype), v.astype(cache.dtype))
        per_row = (cache.nbytes - 8 * cache.batch) / cache.capacity
        row["bytes"][name] = per_row * Tk + w_bytes

        def step(cache=cache):
            return mhattn.multi_head_attention(x_new, *ws, num_heads=H, num_kv_heads=G,
                                               cache=cache)
        out = as_f64(step())              # the warm-up, checked below
        # a fixed count (Timed.start's rate estimate would append rows of its own)
        timed[name] = Timed(step, min_repeats=repeats, repeats=repeats)
        if want is None:
            want = out
        err = float(np.abs(out - want).max() / np.abs(want).max())
        if err > 0.1:
            raise AssertionError(f"decode {H}/{G} heads: the {name} cache's step disagrees "
                                 f"with the float32 cache's: {err:.3g}")
    time_interleaved(list(timed.values()), rounds=args.rounds, settle_s=args.settle)
    row["ms"] = {n: t.median_s * 1e3 for n, t in timed.items()}
    f32 = row["ms"].get("float32")
    row["misses"] = []
    for n, ms in row["ms"].items():
        row[f"{n} GB/s"] = row["bytes"][n] / (ms * 1e-3) / 1e9
        row[f"{n} %stream"] = 100 * row[f"{n} GB/s"] / stream_gbs if stream_gbs else None
        if n != "float32" and f32:
            row[f"{n} vs f32"] = ms / f32
            if ms / f32 > DECODE_TARGET[n]:
                row["misses"].append(f"{SHORT[n]} vs f32")
    return row


def decode_columns(dtypes) -> List[Column]:
    cols = [Column("heads", lambda r: f"{r['H']}/{r['G']}"), Column("Tk", lambda r: str(r["Tk"]))]
    for n in dtypes:
        s = SHORT[n]
        cols.append(Column(f"{s} ms/token", _ms(n)))
        if n != "float32":
            cols.append(Column(f"{s} vs f32", _ratio(f"{n} vs f32")))
        cols.append(Column(f"{s} GB/s", lambda r, n=n: f"{r[n + ' GB/s']:.1f}"))
        cols.append(Column(f"{s} % stream", lambda r, n=n: "n/a" if r[n + " %stream"] is None
                           else f"{r[n + ' %stream']:.0f}%"))
    cols.append(Column("target", lambda r: "n/a" if len(r["ms"]) < 2 else "MISS " + ",".join(
        r["misses"]) if r["misses"] else "PASS", "<"))
    return cols


def decode_section(args) -> Optional[List[Dict[str, Any]]]:
    """The decode table, or the line saying why there is none."""
    why = cache_dtypes_available()
    have = [n for n, w in why.items() if w is None]
    if not have:
        print("\ndecode: half/int8 KV caches not available in this build ("
              + "; ".join(f"{n}: {w}" for n, w in why.items()) + ")")
        return None
    return run_decode(["float32"] + have, args)


def run_decode(dtypes, args) -> List[Dict[str, Any]]:
    import bench_decode
    llc = bench_decode.llc_bytes() or (32 << 20)
    stream_gbs = None
    try:
        lib = bench_decode.load_stream(args.cc)
        # beyond the last-level cache, as a 32k-token cache is (--quick: 64 MiB)
        nbytes = (64 << 20) if args.quick else max(8 * llc, 256 << 20)
        stream_gbs = bench_decode.bandwidth(lib, nbytes, args.threads, 5)
    except (OSError, subprocess.SubprocessError) as e:   # no compiler: "% stream" is n/a
        print(f"stream.c not measured: {e}")
    rows = [decode_row(H, G, args.decode_tk, dtypes, args, stream_gbs)
            for H, G in ((8, 8), (32, 8))]
    bw = "n/a" if stream_gbs is None else f"{stream_gbs:.1f} GB/s"
    print_table(f"decode: one cached layer step per token, {args.decode_tk} cached tokens, kv "
                f"heads of 64, d_model 64; stream.c read bandwidth {bw} on {args.threads} "
                f"threads", decode_columns(dtypes), rows)
    return rows


# ---- main --------------------------------------------------------------------------

def parse(argv):
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--quick", action="store_true", help="tiny sizes, a few seconds")
    ap.add_argument("--threads", type=int, default=usable_cpus())
    ap.add_argument("--repeats", type=int, default=None, help="calls per median, at least "
                    "(default 7, --quick 3)")
    ap.add_argument("--budget", type=float, default=None,
                    help="seconds of calls per variant and row (default 0.5, --quick 0.02)")
    ap.add_argument("--rounds", type=int, default=5, help="interleaved rounds")
    ap.add_argument("--settle", type=float, default=None,
                    help="pause between variants, s (default 0.1, --quick 0)")
    ap.add_argument("--no-torch", action="store_true")
    ap.add_argument("--only", choices=("prefill", "decode"), default=None,
                    help="one of the two tables")
    ap.add_argument("--cc", default=os.environ.get("CC", "cc"), help="compiler for stream.c")
    a = ap.parse_args(argv)
    a.repeats = a.repeats or (3 if a.quick else 7)
    a.budget = a.budget if a.budget is not None else (0.02 if a.quick else 0.5)
    a.settle = a.settle if a.settle is not None else (0.0 if a.quick else 0.1)
    a.sizes = (16, 64) if a.quick else (128, 1024, 4096)
    a.d_model, a.heads = (64, 4) if a.quick else (512, 8)
    a.decode_tk = 256 if a.quick else 32768
    return a


def main(argv=None):
    args = parse(sys.argv[1:] if argv is None else argv)
    torch = None if args.no_torch else import_torch()
    mhattn.set_num_threads(args.threads)
    if torch is not None:
        torch.set_num_threads(args.threads)
    meter = machine.CpuMeter()
    for line in machine_lines(args.threads, args.repeats, torch):
        print(line)
    print(dot_line(args.cc))
    rows = [] if args.only == "decode" else [
        prefill_row(T, args.d_model, args.heads, causal, torch, args)
        for T in args.sizes for causal in (False, True)]
    if rows:
        print_table(f"prefill: multi_head_attention, one sequence (T, {args.d_model}), "
                    f"{args.heads} heads; median ms; targets: half/f32 <= {HALF_TARGET}x, "
                    f"vs torch (same half dtype) >= {TORCH_TARGET:g}x", PREFILL_COLUMNS, rows)
    for r in rows:
        for n in r["notes"]:
            print(f"  T={r['T']} causal={r['causal']}: {n}")
    decode = None if args.only == "prefill" else decode_section(args)
    others = meter.others()
    if others is not None:
        print(f"\nother processes kept {others:.2f} CPUs busy during the run"
              + (machine.busy_warning(others) or ""))
    return rows, decode


if __name__ == "__main__":
    main()
