"""One row: every variant timed on one case, checked against mhattn; and
the loop over every row of a run."""
from __future__ import annotations

import gc
import sys
from typing import Any, Callable, Dict, List, Optional

import numpy as np

from .configs import CAUSALS, DTYPES, Case, build_cases
from .figures import derive
from .refmodel import RefModel
from .tables import row_summary
from .timing import Timed, time_interleaved
from .variants import (REFERENCE, TORCH_MHA, Data, Unsupported, Variant, check_mha_fast_path,
                       make_data)

try:
    from tqdm import tqdm
except ImportError:
    tqdm = None

# Output agreement, as max |a - b| / max |b|.  float32 sums of up to 12288
# products and softmax over up to 4096 keys stay well inside 2e-3; float64
# agrees to ~1e-12, so 1e-9 leaves room for a different summation order.
TOLERANCE = {"float32": 2e-3, "float64": 1e-9}


def rel_err(a: np.ndarray, b: np.ndarray) -> float:
    a = np.asarray(a, dtype=np.float64).reshape(b.shape)
    b = np.asarray(b, dtype=np.float64)
    scale = float(np.max(np.abs(b))) if b.size else 0.0
    return float(np.max(np.abs(a - b))) / scale if scale > 0 else float(np.max(np.abs(a - b)))


def reference_plan(case: Case, args, ref_model: RefModel, res: Dict[str, Any]):
    """(min_repeats, warmup) for the NumPy reference on this case, or None
    where it is skipped; records the estimate (and why it is skipped) in res."""
    min_reps, warmup = args.min_repeats, True
    est_s, est_b = ref_model.seconds(case), ref_model.bytes(case)
    res["estimate_s"], res["estimate_gib"] = est_s, est_b / 2**30
    if est_s > args.ref_max_seconds or est_b > args.ref_max_gib * 2**30:
        res["skipped"] = (f"estimated {est_s:.0f} s, {est_b / 2**30:.1f} GiB (limits "
                          f"{args.ref_max_seconds:.0f} s, {args.ref_max_gib:g} GiB)")
        return None
    # A slow reference call is timed a few times, or once.
    if est_s > 2.0:
        min_reps, warmup = 1, False
    elif est_s > args.budget / args.min_repeats:
        min_reps = min(min_reps, 3)
    return min_reps, warmup


def check_agreement(v: Variant, case: Case, out, baseline) -> float:
    """max|diff|/max|out| of a variant's output against mhattn's; an
    AssertionError where they disagree."""
    err = rel_err(out, baseline)
    tol = TOLERANCE[case.dtype]
    assert err <= tol, (
        f"{v.label} disagrees with mhattn on {case}: max|diff|/max|out| = "
        f"{err:.3g} > {tol:g}; the benchmark would compare different computations")
    return err


def measure_row(case: Case, data: Data, variants: List[Variant], args,
                ref_model: Optional[RefModel], notes: List[str]) -> Dict[str, Any]:
    """Time every variant on one case, interleaved; check each warm-up output
    against the first variant's (mhattn), and fail loudly when they disagree."""
    row: Dict[str, Any] = dict(T=case.T, d_model=case.d, h=case.h, B=case.B,
                               dtype=case.dtype, causal=case.causal, flops=case.flops(),
                               results={})
    baseline = None
    timed: Dict[str, Timed] = {}
    for v in variants:
        res: Dict[str, Any] = {}
        row["results"][v.key] = res
        min_reps, warmup = args.min_repeats, True
        if v is REFERENCE:
            plan = reference_plan(case, args, ref_model, res)
            if plan is None:
                continue
            min_reps, warmup = plan
        try:
            fn = v.prepare(data, case)
        except Unsupported as exc:      # a variant that does not run this case
            res["skipped"] = str(exc)
            continue
        t = Timed(fn, min_reps, warmup, v.context)
        try:
            out = v.to_numpy(t.start(args.budget))
        except (MemoryError, RuntimeError, ValueError, OSError) as exc:
            # One failing variant (out of memory at GPT-3 width, say) should
            # not cost the rest of a long run; the table says "error".
            res["error"] = f"{type(exc).__name__}: {exc}"
            notes.append(f"{case.label}: {v.label} raised {res['error']}")
            continue
        timed[v.key] = t
        if t.spent_s > 1.0:     # a long row: say where the time goes
            todo = t.repeats - len(t.samples)
            print(f"      {v.key}: first call {t.spent_s:.1f} s, {todo} timed calls to go",
                  file=sys.stderr, flush=True)
        if baseline is None:
            baseline = out
        else:
            res["max_rel_err"] = check_agreement(v, case, out, baseline)
        del out
    del baseline
    time_interleaved(list(timed.values()), settle_s=args.settle)
    for key, t in timed.items():
        row["results"][key].update(ms=t.median_s * 1e3, repeats=len(t.samples),
                                   seconds_spent=t.spent_s)
    if TORCH_MHA in variants and "ms" in row["results"].get("torch_mha", {}):
        row["mha_fast_path"] = check_mha_fast_path(data, case)
        if not row["mha_fast_path"]:
            notes.append(f"{case.label}: nn.MultiheadAttention did NOT take its fast path")
    return row


def run_rows(args, variants: List[Variant], rng, ref_model: Optional[RefModel], peak,
             save: Callable[[List[Dict[str, Any]], List[str]], None]):
    """Every row of the run, in order; each finished row is derived,
    summarised on stderr and passed to save(rows, notes).  Returns (rows, notes)."""
    causals = CAUSALS[args.causal]
    dtypes = [DTYPES[k] for k in args.dtypes]
    jobs = [(c, dt) for c in build_cases(args.configs) for dt in dtypes]
    rows: List[Dict[str, Any]] = []
    notes: List[str] = []
    total = len(jobs) * len(causals)
    progress = tqdm(total=total, file=sys.stderr, leave=False) if tqdm else None
    done = 0
    for (T, d, h, B), dtype in jobs:
        data = make_data(T, d, h, B, dtype, rng, with_torch=not args.no_torch)
        for causal in causals:
            case = Case(T, d, h, B, dtype, causal)
            done += 1
            if progress:
                progress.set_description(case.label)
            else:
                print(f"[{done}/{total}] {case.label}", file=sys.stderr, flush=True)
            rows.append(measure_row(case, data, variants, args, ref_model, notes))
            derive(rows[-1], peak)
            print(row_summary(rows[-1]), file=sys.stderr, flush=True)
            save(rows, notes)
            if progress:
                progress.update()
        del data
        gc.collect()
    if progress:
        progress.close()
    return rows, notes
