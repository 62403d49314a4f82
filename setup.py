"""Build of mhattn: the pure-Python package under python/ and the C core.

Project metadata lives in pyproject.toml; this file only describes the
extension. Flags are portable on purpose: no fast-math flags of any kind
(masked softmax relies on infinities, and fast-math links code that flushes
subnormals for the whole process) and no tuning for the build machine's CPU
(wheels must run anywhere; ISA-specific code is chosen at run time). Set MHATTN_SANITIZE=1 to build with AddressSanitizer and
UndefinedBehaviorSanitizer.
"""
import glob
import os

import numpy
from setuptools import Extension, setup

compile_args = ["-std=c11", "-O3", "-Wall", "-Wextra", "-fvisibility=hidden", "-pthread"]
link_args = ["-pthread"]
if os.environ.get("MHATTN_SANITIZE") == "1":
    # -fno-wrapv undoes the -fwrapv in Python's own CFLAGS, so that UBSan
    # reports signed overflow in the core instead of letting it wrap.
    sanitize = ["-fsanitize=address,undefined", "-fno-omit-frame-pointer",
                "-fno-wrapv", "-O1", "-g"]
    compile_args += sanitize  # the later -O1 overrides -O3
    link_args += sanitize

ext = Extension(
    "mhattn._C",
    # csrc/mhattn_module.c (the glue), csrc/core/ (drivers, GEMM, threads,
    # dispatch) and csrc/kernels/ (one compile unit per ISA); see csrc/README.md.
    sources=sorted(glob.glob(os.path.join("csrc", "*.c"))
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
    ],
    extra_compile_args=compile_args,
    extra_link_args=link_args,
)

setup(
    package_dir={"": "python"},
    packages=["mhattn"],
    package_data={"mhattn": ["*.pyi", "py.typed"]},
    ext_modules=[ext],
)
