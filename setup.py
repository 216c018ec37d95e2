"""Build microtensor's Cython extensions.

Compiler directives are set once here, for every .pyx file:
language level 3, bounds checks and negative-index wraparound off, C division.
Set MICROTENSOR_DEBUG=1 to turn bounds checks back on (slower, for debugging a kernel).
Set MICROTENSOR_NATIVE=1 to compile with -march=native (faster, not portable).
OpenMP is used when the compiler accepts it; otherwise the build is serial and says so.
Set MICROTENSOR_BUILD_ONLY=microtensor._core (comma-separated) to rebuild some extensions only.
"""
import os
import shutil
import subprocess
import sys
import sysconfig
import tempfile
from glob import glob

import numpy as np
from Cython.Build import cythonize
from setuptools import Extension, setup


def compiler_accepts_openmp():
    """Compile and link a tiny OpenMP program; True when that works."""
    cc = os.environ.get("CC") or sysconfig.get_config_var("CC") or "cc"
    cc = cc.split()
    tmp = tempfile.mkdtemp()
    try:
        src = os.path.join(tmp, "omp_test.c")
        with open(src, "w") as f:
            f.write("#include <omp.h>\nint main(void){int n=0;\n#pragma omp parallel reduction(+:n)\nn+=1;\nreturn n>0?0:1;}\n")
        cmd = cc + ["-fopenmp", src, "-o", os.path.join(tmp, "omp_test")]
        return subprocess.run(cmd, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL).returncode == 0
    except OSError:
        return False
    finally:
        shutil.rmtree(tmp, ignore_errors=True)


debug = os.environ.get("MICROTENSOR_DEBUG", "0") not in ("", "0")
native = os.environ.get("MICROTENSOR_NATIVE", "0") not in ("", "0")
openmp = compiler_accepts_openmp()
if not openmp:
    print("\n" + "!" * 78 + "\n"
          "WARNING: the C compiler does not accept -fopenmp; microtensor's kernels\n"
          "will be built serial (correct, but using one core).\n" + "!" * 78 + "\n",
          file=sys.stderr)

compile_args = ["-O3"] + (["-fopenmp"] if openmp else []) + (["-march=native"] if native else [])
link_args = ["-fopenmp"] if openmp else []

directives = {
    "language_level": 3,
    "boundscheck": debug,
    "wraparound": debug,
    "cdivision": True,
    "initializedcheck": debug,
    "nonecheck": False,
}

only = [n for n in os.environ.get("MICROTENSOR_BUILD_ONLY", "").split(",") if n]
extensions = []
for pyx in sorted(glob("microtensor/**/*.pyx", recursive=True)):
    name = pyx[:-4].replace(os.sep, ".").replace("/", ".")
    if only and name not in only:
        continue
    extensions.append(Extension(
        name, [pyx],
        include_dirs=[np.get_include()],
        define_macros=[("NPY_NO_DEPRECATED_API", "NPY_1_7_API_VERSION")],
        extra_compile_args=compile_args,
        extra_link_args=link_args,
    ))

setup(
    ext_modules=cythonize(extensions, compiler_directives=directives,
                          compile_time_env={"MT_OPENMP": openmp}),
)
