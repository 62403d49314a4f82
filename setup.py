"""Build of mhattn: the pure-Python package under python/ and the C core.

Project metadata lives in pyproject.toml; this file only describes the
extension and its flags, chosen per compiler (build_ext_flags below): gcc
and clang take GNU-style flags, MSVC its own. The ISA kernels need no flag
of their own: each ISA's file marks its functions for its target
(csrc/kernels/isa_target.h). Flags are portable on purpose: no fast-math
flags of any kind (masked softmax relies on infinities, and fast-math links
code that flushes subnormals for the whole process), no contraction of
a * b + c into a fused multiply-add (clang's default: the same source must
give the same bits from every compiler), and no tuning for the build
machine's CPU (wheels must run anywhere; ISA-specific code is chosen at run
time).

Release builds carry no debug information and no static symbol table
(gcc 12 on x86-64: 0.5 MB instead of 3.3 MB). Environment:
  MHATTN_DEBUG=1     keep debug information (-g; /Zi and /DEBUG on MSVC)
  MHATTN_SANITIZE=1  build with AddressSanitizer and UndefinedBehaviorSanitizer
                     (gcc or clang; implies MHATTN_DEBUG=1)
  MHATTN_EMULATE_AVX512=1
                     a test build, never a release: the 'avx512' kernels run
                     on plain-C lanes (csrc/kernels/simd_emu512.h) on any
                     x86 CPU with AVX2 (~3x slower than the AVX2 kernels on
                     Zen 3) and give AVX-512's bits, so that a machine
                     without AVX-512 can run (and record)
                     tests/golden/avx512.npz; mhattn._C.EMULATED_AVX512 is 1
"""
import glob
import os
import sys

import numpy
from setuptools import Extension, find_packages, setup
from setuptools.command.build_ext import build_ext

SANITIZE = os.environ.get("MHATTN_SANITIZE") == "1"
DEBUG = SANITIZE or os.environ.get("MHATTN_DEBUG") == "1"
EMULATE_AVX512 = os.environ.get("MHATTN_EMULATE_AVX512") == "1"


def unix_flags():
    """(compile, link) flags for gcc and clang."""
    compile_args = ["-std=c11", "-O3", "-Wall", "-Wextra", "-fvisibility=hidden",
                    "-ffp-contract=off", "-pthread"]
    link_args = ["-pthread"]
    if DEBUG:
        compile_args += ["-g"]
    else:
        # -g0 undoes the -g in Python's own CFLAGS; the link strips symbols.
        compile_args += ["-g0"]
        link_args += ["-Wl,-S", "-Wl,-x"] if sys.platform == "darwin" else ["-s"]
    if SANITIZE:
        # -fno-wrapv undoes the -fwrapv in Python's own CFLAGS, so that UBSan
        # reports signed overflow in the core instead of letting it wrap.
        sanitize = ["-fsanitize=address,undefined", "-fno-omit-frame-pointer",
                    "-fno-wrapv", "-O1"]
        compile_args += sanitize  # the later -O1 overrides -O3
        link_args += sanitize
    return compile_args, link_args


def msvc_flags():
    """(compile, link) flags for MSVC: <stdatomic.h> needs Visual Studio
    2022 17.5 or later and /experimental:c11atomics."""
    if SANITIZE:
        sys.exit("MHATTN_SANITIZE=1 needs gcc or clang")
    compile_args = ["/std:c11", "/experimental:c11atomics", "/O2", "/W3"]
    return (compile_args + ["/Zi"], ["/DEBUG"]) if DEBUG else (compile_args, [])


class build_ext_flags(build_ext):
    """build_ext with the flags of the compiler it found."""

    def build_extensions(self):
        msvc = self.compiler.compiler_type == "msvc"
        compile_args, link_args = msvc_flags() if msvc else unix_flags()
        for ext in self.extensions:
            ext.extra_compile_args = compile_args
            ext.extra_link_args = link_args
        super().build_extensions()


ext = Extension(
    "mhattn._C",
    # csrc/python/ (the glue), csrc/core/ (drivers, GEMM, threads,
    # dispatch) and csrc/kernels/ (one compile unit per ISA); see csrc/README.md.
    sources=sorted(glob.glob(os.path.join("csrc", "python", "*.c"))
                   + glob.glob(os.path.join("csrc", "core", "*.c"))
                   + glob.glob(os.path.join("csrc", "kernels", "*.c"))),
    depends=sorted(glob.glob(os.path.join("csrc", "**", "*.h"), recursive=True)
                   + glob.glob(os.path.join("csrc", "kernels", "*.inc"))),
    include_dirs=[numpy.get_include(), "csrc", os.path.join("csrc", "core"),
                  os.path.join("csrc", "kernels")],
    define_macros=[
        ("NPY_NO_DEPRECATED_API", "NPY_1_23_API_VERSION"),
        # Built against NumPy 2, run against NumPy >= 1.23.5.
        ("NPY_TARGET_VERSION", "NPY_1_23_API_VERSION"),
    ] + ([("MHA_EMULATE_AVX512", "1")] if EMULATE_AVX512 else []),
)

setup(
    package_dir={"": "python"},
    # mhattn and its subpackages (compute, learn, nn, reference, _internal).
    packages=find_packages("python"),
    # The walkthrough notebook ships with the package: `python -m mhattn
    # --notebook` writes it out (importlib.resources finds it). At the top:
    # a folder without __init__.py would be an undeclared namespace package.
    package_data={"mhattn": ["*.pyi", "py.typed"], "mhattn.learn": ["walkthrough.ipynb"]},
    ext_modules=[ext],
    cmdclass={"build_ext": build_ext_flags},
)
