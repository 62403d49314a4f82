"""The backward table: mhattn's forward and backward against torch autograd.

Printed by benchmarks/bench_backward.py, and by benchmarks/bench.py for its
float32 configurations with T >= 1024.  Each row (B = 1,
``MultiHeadAttention`` with biases) times, as medians after a warm-up, the
four calls below interleaved (``timing.time_interleaved``: each takes its
samples in 5 slices, one per round, with a pause at each switch), so that
the load of a shared machine falls on all of them alike and bwd/fwd
compares calls made over the same minutes. (Timed in blocks, one call's
samples all before the next's, the ratio at T = 1024 read 2.65-2.69x in
bench.py's runs of 2026-12-07 and 2.44x interleaved minutes later on the
same Zen 4.)

- fwd: ``out, ctx = layer(x, return_context=True)`` (the forward a training
  loop runs: it keeps q, k, v, concat and lse for the backward);
- bwd: ``layer.backward(grad_out, ctx)`` (every weight's gradient and x's);
- torch MHA and torch SDPA: forward then ``out.backward(grad_out)`` through
  ``nn.MultiheadAttention`` and through ``F.linear`` + SDPA, x requiring grad.
"""
from __future__ import annotations

import numpy as np

import mhattn

from .timing import Timed, time_interleaved

D_MODEL, HEADS = 512, 8
BWD_OVER_FWD_MAX = 2.5     # target: backward <= 2.5 x forward
SPEEDUP_MIN = 1.5          # target: fwd + bwd >= 1.5 x faster than torch


def report(configs, dtype, repeats, causal, torch):
    """Measures and prints the table for configs [(T, d_model, h)], dtype
    np.float32 or np.float64; torch is the module or None. Returns the rows
    (T, d_model, h, figures), times in seconds as (wall, cpu) pairs."""
    rows = [(T, d, h, measure(T, dtype, repeats, causal, torch, d, h)) for T, d, h in configs]
    for clock, k in (("wall time", 0), ("CPU time of all threads", 1)):
        print(f"\n{clock} (medians){', causal' if causal else ''}:")
        print_table(rows, k, dtype)
    print()
    print("bwd/fwd: backward over forward (target <= 2.5); speedup: the faster torch "
          "variant's forward+backward over mhattn's fwd+bwd (target >= 1.5). The\n"
          "targets are on wall time; CPU time is printed too because on a shared "
          "machine it is the steadier figure.")
    return rows


def row_targets(T, row, dtype):
    """(speedup or None, [(target, passed)]) for one row of seconds."""
    fb = row["fwd"] + row["bwd"]
    targets = [("bwd<=2.5fwd", row["bwd"] <= BWD_OVER_FWD_MAX * row["fwd"])]
    speedup = None
    if "mha" in row:
        speedup = min(row["mha"], row["sdpa"]) / fb
        if T >= 1024 and dtype == np.float32:
            targets.append(("f+b>=1.5x torch", speedup >= SPEEDUP_MIN))
    return speedup, targets


def print_table(rows, k, dtype):
    """The table of one clock: k = 0 for wall time, 1 for CPU time."""
    header = (f"{'T x d x h':>14} {'fwd ms':>9} {'bwd ms':>9} {'bwd/fwd':>8} {'f+b ms':>9} "
              f"{'MHA ms':>9} {'SDPA ms':>9} {'speedup':>8}  targets")
    print(header)
    print("-" * len(header))
    for T, d, h, r in rows:
        row = {name: (v[k] if isinstance(v, tuple) else v) for name, v in r.items()}
        fb = row["fwd"] + row["bwd"]
        speedup, targets = row_targets(T, row, dtype)
        tstr = "  ".join(f"{n} {'PASS' if ok else 'MISS'}" for n, ok in targets)
        fmt = lambda v: f"{v * 1e3:9.1f}" if v is not None else f"{'-':>9}"  # noqa: E731
        sp = f"{speedup:7.2f}x" if speedup else f"{'-':>8}"
        print(f"{f'{T}x{d}x{h}':>14} {fmt(row['fwd'])} {fmt(row['bwd'])} "
              f"{row['bwd'] / row['fwd']:7.2f}x {fmt(fb)} {fmt(row.get('mha'))} "
              f"{fmt(row.get('sdpa'))} {sp}  {tstr}")


def make_layer(T, dtype, d_model, heads):
    """The layer (with biases), x and grad_out of one row, seeded by T."""
    rng = np.random.default_rng(T)
    layer = mhattn.MultiHeadAttention(d_model, heads, bias=True, dtype=dtype, seed=T)
    for name in ("b_q", "b_k", "b_v", "b_o"):
        setattr(layer, name, (0.1 * rng.standard_normal(getattr(layer, name).shape))
                .astype(dtype))
    x = rng.standard_normal((T, d_model)).astype(dtype)
    grad_out = rng.standard_normal((T, d_model)).astype(dtype)
    return layer, x, grad_out


def measure(T, dtype, repeats, causal, torch, d_model=D_MODEL, heads=HEADS):
    """{"fwd", "bwd"[, "mha", "sdpa"]: (wall, cpu) medians in seconds}."""
    layer, x, grad_out = make_layer(T, dtype, d_model, heads)
    kw = dict(causal=True) if causal else {}
    state = {}

    def fwd():
        state["out"], state["ctx"] = layer(x, return_context=True, **kw)

    def bwd():
        state["grads"] = layer.backward(grad_out, state["ctx"])

    steps = {"fwd": fwd, "bwd": bwd}    # bwd after fwd: its warm-up needs a context
    if torch is not None:
        module, xt, steps["mha"], steps["sdpa"] = torch_steps(torch, layer, x, grad_out,
                                                              causal)
    timed = {n: Timed(f, min_repeats=repeats) for n, f in steps.items()}
    for t in timed.values():
        t.start(budget=0.0)     # the warm-up; then exactly `repeats` samples each
    time_interleaved(list(timed.values()))
    row = {n: (t.median_s, t.median_cpu_s) for n, t in timed.items()}
    if torch is None:
        return row
    best = steps["sdpa"] if row["sdpa"][0] <= row["mha"][0] else steps["mha"]

    # One check that both sides computed the same gradients.
    best()
    check_gradients(T, dtype, layer, layer.backward(grad_out, state["ctx"]), module, xt)
    return row


def torch_steps(torch, layer, x, grad_out, causal):
    """torch autograd's forward + backward with the layer's weights, through
    nn.MultiheadAttention and through F.linear + SDPA: (module, xt, mha, sdpa),
    where xt is torch's x and mha, sdpa the two zero-argument steps."""
    T, d_model = x.shape
    heads = layer.num_heads
    module = layer.to_torch()
    module.train()   # autograd; dropout is 0
    xt = torch.from_numpy(x).unsqueeze(0).requires_grad_(True)
    gt = torch.from_numpy(grad_out).unsqueeze(0)
    mask = None
    if causal:
        mask = torch.ones((T, T), dtype=torch.bool).triu(1)   # True = blocked

    def zero():
        xt.grad = None
        for p in module.parameters():
            p.grad = None

    def mha():
        zero()
        out, _ = module(xt, xt, xt, need_weights=False, attn_mask=mask,
                        is_causal=causal)
        out.backward(gt)

    w_in, b_in = module.in_proj_weight, module.in_proj_bias
    w_out, b_out = module.out_proj.weight, module.out_proj.bias

    def sdpa():
        zero()
        qkv = torch.nn.functional.linear(xt, w_in, b_in)       # (1, T, 3E)
        q, k, v = (t.view(1, T, heads, d_model // heads).transpose(1, 2)
                   for t in qkv.split(d_model, dim=-1))
        o = torch.nn.functional.scaled_dot_product_attention(q, k, v,
                                                             is_causal=causal)
        out = torch.nn.functional.linear(o.transpose(1, 2).reshape(1, T, d_model),
                                         w_out, b_out)
        out.backward(gt)
    return module, xt, mha, sdpa


def check_gradients(T, dtype, layer, ours, module, xt):
    """mhattn's gradients (ours, from layer.backward) against the ones torch
    left in module's parameters and in xt; an AssertionError where they differ."""
    theirs = {n: p.grad.numpy() for n, p in module.named_parameters()}
    shadow = mhattn.MultiHeadAttention.__new__(mhattn.MultiHeadAttention)
    shadow.__dict__.update(layer.__dict__)
    for name in layer.weights():
        setattr(shadow, name, ours[name])
    ours_t = dict(shadow.state_dict(), x=ours["x"])
    theirs["x"] = xt.grad[0].numpy()
    tol = 1e-3 if dtype == np.float32 else 1e-9
    for name, want in theirs.items():
        err = np.abs(ours_t[name] - want).max() / max(np.abs(want).max(), 1e-30)
        assert err < tol, f"T={T}: gradient of {name} differs from torch by {err:.2e}"
