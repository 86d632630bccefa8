"""Build of churon's optional native CPU kernels, the extension module `churon._cpu`.

Project metadata lives in pyproject.toml; this file only adds the extension. The kernel source
(src/churon/kernels/cpu/kernels.cpp) is compiled once per ISA with that ISA's flags into its
own namespace, and the module picks one at import time from what the CPU supports.

The extension is optional: without a C++17 compiler (or pybind11) churon installs and runs on
its PyTorch code, with a warning here and `churon.kernels.reason` saying why at run time.
Set CHURON_REQUIRE_NATIVE=1 to make a failed build an error instead.
"""

from __future__ import annotations

import os
import platform

from setuptools import Extension, setup
from setuptools.command.build_ext import build_ext

CPU_DIR = os.path.join("src", "churon", "kernels", "cpu")
KERNEL_SOURCE = os.path.join(CPU_DIR, "kernels.cpp")
# what kernels.cpp includes: the SIMD mapping, and the loops written per ISA
KERNEL_HEADERS = [os.path.join(CPU_DIR, h) for h in ("common.h", "simd.h", "matmul_amx.inc", "matmul_amx_bf16.inc",
                                                    "matmul_avx512.inc", "matmul_avx2.inc", "matmul_scalar.inc",
                                                    "attention_avx512.inc", "attention_amx_bf16.inc", "lora.inc")]
# compiled once, with COMMON_FLAGS only
MODULE_SOURCES = [os.path.join(CPU_DIR, f) for f in ("module.cpp", "isa.cpp", "repack.cpp", "qmatrix.cpp", "moe.cpp",
                                                    "decoder.cpp", "ops.cpp", "lora.cpp", "threadpool.cpp",
                                                    "tile_matrix.cpp", "weight_memory.cpp")]
MODULE_HEADERS = [os.path.join(CPU_DIR, h) for h in ("common.h", "decoder.h", "driver.h", "isa.h", "ops.h",
                                                    "qmatrix.h", "repack.h", "threadpool.h", "tile_matrix.h",
                                                    "weight_memory.h")]

# -ffp-contract=off: a*b+c stays two roundings unless the code asks for an FMA, which keeps
# dequantization bitwise equal to ggml and each ISA's results reproducible.
COMMON_FLAGS = ["-std=c++17", "-O3", "-g0", "-ffp-contract=off", "-fno-math-errno", "-fvisibility=hidden"]

IS_X86 = platform.machine().lower() in ("x86_64", "amd64", "i686", "i386", "x86")
ISA_FLAGS = {"scalar": []}
# GCC 12 warns about its own intrinsics headers (_mm256_undefined_*): noise
QUIET = ["-Wno-uninitialized", "-Wno-maybe-uninitialized"]
if IS_X86:
    ISA_FLAGS["avx2"] = ["-mavx2", "-mfma", "-mf16c"] + QUIET
    ISA_FLAGS["avx512"] = ["-mavx512f", "-mavx512bw", "-mavx512vl", "-mavx512dq", "-mavx512vnni",
                           "-mavx2", "-mfma", "-mf16c"] + QUIET
    # AVX-512 plus the AMX-INT8 tiles (its quantized matmuls) and the AMX-BF16 ones (an encoder's bfloat16
    # matmuls); everything else is the avx512 copy's code
    ISA_FLAGS["amx"] = ISA_FLAGS["avx512"] + ["-mamx-tile", "-mamx-int8", "-mamx-bf16", "-mavx512bf16"]
# a compiler too old for these flags builds the others without them
OPTIONAL_ISAS = {"amx"}


class OptionalBuildExt(build_ext):
    """Compiles the per-ISA kernel objects, links them into churon._cpu; never fails the install."""

    def build_extension(self, ext: Extension) -> None:
        try:
            self._build(ext)
        except Exception as e:  # noqa: BLE001 - any compiler failure means "no native kernels"
            if os.environ.get("CHURON_REQUIRE_NATIVE") == "1":
                raise
            self.warn(
                f"churon: the native CPU kernels (churon._cpu) were not built ({type(e).__name__}: {e}); "
                "churon will run on its PyTorch code instead"
            )

    def _build(self, ext: Extension) -> None:
        try:
            import pybind11
        except ImportError as e:
            raise RuntimeError("pybind11 is not installed in the build environment") from e
        ext.include_dirs = [pybind11.get_include(), CPU_DIR]
        objects, built = [], []
        for isa, flags in ISA_FLAGS.items():
            try:
                objects += self.compiler.compile(
                    [KERNEL_SOURCE],
                    output_dir=os.path.join(self.build_temp, "isa_" + isa),
                    macros=[("CHURON_ISA", isa)],
                    include_dirs=[CPU_DIR],
                    extra_postargs=COMMON_FLAGS + flags,
                    depends=KERNEL_HEADERS,
                )
            except Exception as e:  # noqa: BLE001 - any compiler failure drops this ISA only
                if isa not in OPTIONAL_ISAS:
                    raise
                self.warn(f"churon: the {isa} kernels were not built ({type(e).__name__}: {e})")
                continue
            built.append(isa)
        ext.extra_objects = objects
        ext.define_macros = [("CHURON_HAVE_" + isa.upper(), "1") for isa in built if isa != "scalar"]
        # this link recompiles the module sources every time, like the ISA objects above
        self.force = True
        super().build_extension(ext)


setup(
    ext_modules=[
        Extension(
            "churon._cpu",
            sources=MODULE_SOURCES,
            depends=MODULE_HEADERS + KERNEL_HEADERS + [KERNEL_SOURCE],
            extra_compile_args=COMMON_FLAGS,
            extra_link_args=["-pthread"],
            language="c++",
            optional=True,
        )
    ],
    cmdclass={"build_ext": OptionalBuildExt},
)
