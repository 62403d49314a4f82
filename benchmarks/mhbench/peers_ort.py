"""ONNX Runtime as a peer: the layer as three ONNX graphs, weights as
initializers (graph constants, as an exported model has them), one
session per graph and case.

The graphs, on x (B, T, d) float32, all ending in MatMul(., W^O):

- ``mha``:    MatMul(x, W_q), MatMul(x, W_k), MatMul(x, W_v) ->
              com.microsoft.MultiHeadAttention(num_heads, unidirectional);
- ``attn``:   com.microsoft.Attention(x, [W_q | W_k | W_v] (d, 3d), zero bias
              (3d,), num_heads, unidirectional), the fused-QKV contrib op;
- ``attn23``: the three MatMuls -> the opset-23 ``Attention`` (ai.onnx) on 3-D
              Q, K, V with q_num_heads = kv_num_heads = h and is_causal.

Sessions run at ORT_ENABLE_ALL with intra_op_num_threads = the benchmark's
thread count, inter_op_num_threads = 1 and sequential execution, on the CPU
execution provider.  float64 rows say "skipped": the com.microsoft ops'
schemas refuse tensor(double), and the opset-23 Attention, which accepts
it, agreed with mhattn only to ~2e-8 at a tiny size in onnxruntime 1.32
(softmax_precision=DOUBLE alike), so it is not a float64 computation.  ``import onnxruntime`` happens in
``available()``, never at import of this module.
"""
from __future__ import annotations

import math
from typing import List, Optional, Tuple

import numpy as np

from .configs import Case
from .variants import Data, Unsupported, Variant

GRAPHS = ("mha", "attn", "attn23")
LABELS = {"mha": "MatMul + com.microsoft.MultiHeadAttention + MatMul",
          "attn": "com.microsoft.Attention (fused QKV) + MatMul",
          "attn23": "MatMul + opset-23 Attention + MatMul"}
KEYS = {g: f"ort_{g}" for g in GRAPHS}                     # result keys
# Initializers beyond this make a model that protobuf cannot serialise
# (2 GiB per message); the GPT-3-width row would need external data files.
MAX_INIT_BYTES = 1 << 30


def available() -> Optional[str]:
    """onnxruntime's version when it and onnx import, else None."""
    try:
        import onnx  # noqa: F401
        import onnxruntime
    except ImportError:
        return None
    return onnxruntime.__version__


def build_model(graph: str, w_q: np.ndarray, w_k: np.ndarray, w_v: np.ndarray,
                w_o: np.ndarray, h: int, B: int, T: int, causal: bool):
    """The onnx ModelProto of one graph: input "x" (B, T, d), output "y"
    (B, T, d), float32; every weight an initializer."""
    from onnx import TensorProto, helper, numpy_helper

    d = w_q.shape[0]
    f32 = np.float32
    inits = [numpy_helper.from_array(np.asarray(w_o, f32), "W_o")]
    nodes = []
    if graph == "attn":
        w_qkv = np.concatenate([w_q, w_k, w_v], axis=1).astype(f32)   # (d, 3d)
        inits += [numpy_helper.from_array(w_qkv, "W_qkv"),
                  numpy_helper.from_array(np.zeros(3 * d, f32), "b_qkv")]
        nodes.append(helper.make_node("Attention", ["x", "W_qkv", "b_qkv"], ["ctx"],
                                      domain="com.microsoft", num_heads=h,
                                      unidirectional=int(causal)))
    else:
        for name, w in (("q", w_q), ("k", w_k), ("v", w_v)):
            inits.append(numpy_helper.from_array(np.asarray(w, f32), f"W_{name}"))
            nodes.append(helper.make_node("MatMul", ["x", f"W_{name}"], [name]))
        if graph == "mha":
            nodes.append(helper.make_node("MultiHeadAttention", ["q", "k", "v"], ["ctx"],
                                          domain="com.microsoft", num_heads=h,
                                          unidirectional=int(causal)))
        elif graph == "attn23":
            nodes.append(helper.make_node("Attention", ["q", "k", "v"], ["ctx"],
                                          q_num_heads=h, kv_num_heads=h,
                                          is_causal=int(causal),
                                          scale=1.0 / math.sqrt(d // h)))
        else:
            raise ValueError(f"unknown graph {graph!r}; expected one of {GRAPHS}")
    nodes.append(helper.make_node("MatMul", ["ctx", "W_o"], ["y"]))
    x = helper.make_tensor_value_info("x", TensorProto.FLOAT, [B, T, d])
    y = helper.make_tensor_value_info("y", TensorProto.FLOAT, [B, T, d])
    g = helper.make_graph(nodes, f"mha_{graph}", [x], [y], initializer=inits)
    opsets = [helper.make_opsetid("", 23 if graph == "attn23" else 17)]
    if graph != "attn23":
        opsets.append(helper.make_opsetid("com.microsoft", 1))
    model = helper.make_model(g, opset_imports=opsets)
    model.ir_version = 10      # what onnxruntime 1.2x-1.3x reads
    return model


def make_session(model, threads: int):
    """An InferenceSession on the CPU EP: ORT_ENABLE_ALL, intra_op threads,
    inter_op 1, sequential."""
    import onnxruntime as ort

    so = ort.SessionOptions()
    so.graph_optimization_level = ort.GraphOptimizationLevel.ORT_ENABLE_ALL
    so.intra_op_num_threads = threads
    so.inter_op_num_threads = 1
    so.execution_mode = ort.ExecutionMode.ORT_SEQUENTIAL
    so.log_severity_level = 3          # errors only
    return ort.InferenceSession(model.SerializeToString(), so,
                                providers=["CPUExecutionProvider"])


def layer(graph: str, data: Data, causal: bool, threads: int):
    """The timed call of one graph on data: x (T, d) or (B, T, d) in, the
    same shape out (ORT's (B, T, d) output reshaped, a view)."""
    x = data.x
    B, T, d = (1,) + x.shape if x.ndim == 2 else x.shape
    model = build_model(graph, data.w_q, data.w_k, data.w_v, data.w_o, data.h, B, T, causal)
    sess = make_session(model, threads)
    del model
    x3 = np.ascontiguousarray(x.reshape(B, T, d))
    feeds, shape = {"x": x3}, x.shape
    return lambda: sess.run(None, feeds)[0].reshape(shape)


def supported_graphs(threads: int) -> Tuple[List[str], List[str]]:
    """(graphs this onnxruntime runs, notes on those it does not): each
    graph is built and run once at a tiny size, causal and not."""
    rng = np.random.default_rng(0)
    ws = [rng.standard_normal((8, 8)).astype(np.float32) for _ in range(4)]
    ok, notes = [], []
    for g in GRAPHS:
        try:
            for causal in (False, True):
                sess = make_session(build_model(g, *ws, 2, 1, 3, causal), threads)
                sess.run(None, {"x": np.ones((1, 3, 8), np.float32)})
        except Exception as exc:   # onnxruntime's errors share no base class
            notes.append(f"ONNX Runtime graph {LABELS[g]} skipped: this onnxruntime "
                         f"does not run it ({type(exc).__name__}: {str(exc)[:200]})")
        else:
            ok.append(g)
    return ok, notes


def make_variant(graph: str, threads: int) -> Variant:
    def prepare(data: Data, case: Case):
        if case.dtype != "float32":
            raise Unsupported("float32 only (see peers_ort.py)")
        if 4 * 4 * case.d * case.d > MAX_INIT_BYTES:
            raise Unsupported(f"initializers > {MAX_INIT_BYTES >> 30} GiB "
                              "(protobuf's 2 GiB limit; no external data here)")
        return layer(graph, data, case.causal, threads)
    return Variant(KEYS[graph], f"ONNX Runtime {LABELS[graph]}", prepare)


def ort_variants(threads: int) -> Tuple[List[Variant], List[str]]:
    """The ORT variants this installation runs (none when onnxruntime or
    onnx is missing), and notes on any graph it cannot run."""
    if available() is None:
        return [], ["ONNX Runtime (onnxruntime + onnx) is not installed: its column is skipped"]
    graphs, notes = supported_graphs(threads)
    return [make_variant(g, threads) for g in graphs], notes

