"""The configurations (T, d_model, h), how the command line names them,
the cases they expand to, and each case's FLOP count."""
from __future__ import annotations

import argparse
from dataclasses import dataclass
from typing import List, Tuple

# (T, d_model, h).  B = 8 is added for the short ones (T <= SHORT_T).
CONFIGS = [(3, 4, 2), (128, 512, 8), (1024, 512, 8), (4096, 512, 8),
           (2048, 1024, 16), (2048, 12288, 96)]
GPT3 = (2048, 12288, 96)
SHORT_T = 128
SHORT_BATCH = 8
DTYPES = {"f32": "float32", "f64": "float64"}
# --causal: the causal flags each choice runs.
CAUSALS = {"both": [False, True], "no": [False], "yes": [True]}


def parse_config(text: str) -> Tuple[int, int, int]:
    """'1024x512x8' -> (1024, 512, 8)."""
    try:
        T, d, h = (int(p) for p in text.lower().split("x"))
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected TxDxH such as 1024x512x8, got {text!r}")
    if min(T, d, h) < 1 or d % h:
        raise argparse.ArgumentTypeError(f"{text}: need T, d, h >= 1 and h dividing d")
    return (T, d, h)


def config_name(config: Tuple[int, int, int]) -> str:
    """(1024, 512, 8) -> '1024x512x8'."""
    return "x".join(map(str, config))


def build_cases(configs: List[Tuple[int, int, int]]) -> List[tuple]:
    """(T, d, h, B) in run order: B = 1 for all, B = 8 too for the short ones."""
    out = []
    for T, d, h in configs:
        out.append((T, d, h, 1))
        if T <= SHORT_T:
            out.append((T, d, h, SHORT_BATCH))
    return out


@dataclass(frozen=True)
class Case:
    T: int
    d: int
    h: int
    B: int
    dtype: str      # "float32" | "float64"
    causal: bool

    @property
    def name(self) -> str:
        return f"{self.T}x{self.d}x{self.h}"

    @property
    def label(self) -> str:
        """How progress lines and notes name the case."""
        return f"{self.name} B={self.B} {self.dtype} causal={self.causal}"

    def flops(self) -> float:
        """8 T d^2 (four projections) + 4 T^2 d (Q K^T and weights V) per
        sequence; causal attention does half of the second term."""
        attn = 4.0 * self.T * self.T * self.d * (0.5 if self.causal else 1.0)
        return self.B * (8.0 * self.T * self.d * self.d + attn)
