"""Build microtensor's Cython extensions.

Compiler directives are set once here, for every .pyx file:
language level 3, bounds checks and negative-index wraparound off, C division.
Set MICROTENSOR_DEBUG=1 to turn bounds checks back on (slower, for debugging a kernel).
Set MICROTENSOR_NATIVE=1 to compile with -march=native (faster, not portable).
OpenMP is used when the compiler accepts it; otherwise the build is serial and says so.
Set MICROTENSOR_BUILD_ONLY=microtensor.core._core (comma-separated) to rebuild some extensions only.
Set MICROTENSOR_PARALLEL_MIN_SCALE=0 to build with the kernels' parallel thresholds off
(benchmarks/bench_thresholds.py measures below them that way; any other number scales them).

The build is quick by default: the extensions compile in parallel (one job per CPU, also
under `pip install .`, through the build_ext below) and without debug information (-g0:
the line tables of the generated C are most of the compile time and of the .so size, and
only a debugger reads them; MICROTENSOR_DEBUG=1 keeps them). The flags used are recorded
in microtensor/runtime/_build_config.py, which `mt.show_config()` prints.

A second build reuses the first's work: pip builds this folder in place (build/ stays),
and a .pyx whose generated .c is newer than the .pyx and every project file it includes
or cimports is not run through Cython again, nor compiled again when its module in build/
is newer still, as long as build/microtensor-build.json records the same settings
(compiler flags, Cython, numpy and scipy versions). Cython's own check would redo every
module in a fresh pip build environment, whose numpy and scipy .pxd files are always new.
"""
import json
import os
import re
import shutil
import subprocess
import sys
import sysconfig
import tempfile
import threading
import time
from glob import glob

import numpy as np
from Cython.Build import cythonize
from setuptools import Extension, setup
from setuptools.command.build_ext import build_ext


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

compile_args = (["-O3"] + (["-fopenmp"] if openmp else []) + (["-march=native"] if native else [])
                # NOTE: after Python's own CFLAGS (which hold -g), so that it wins
                + ([] if debug else ["-g0"]))
link_args = ["-fopenmp"] if openmp else []
parallel_min_scale = os.environ.get("MICROTENSOR_PARALLEL_MIN_SCALE", "1")
float(parallel_min_scale)    # a number, or the build stops here
macros = [("NPY_NO_DEPRECATED_API", "NPY_1_7_API_VERSION")]
if parallel_min_scale != "1":
    macros.append(("MT_PARALLEL_MIN_SCALE", parallel_min_scale))


def jobs():
    """Compile jobs: one per CPU this process may use."""
    try:
        return max(1, len(os.sched_getaffinity(0)))
    except (AttributeError, OSError):
        return os.cpu_count() or 1


# The per-CPU builds of the fused kernels and the gcc target of each. Only the kernels'
# own functions are compiled for the target: Cython's generated C holds them in its
# "module_code" section after Cython's memoryview helpers, and target_kernels_only puts a
# `#pragma GCC target` around exactly them. The module's import code, Cython's helpers and
# the memoryview machinery stay plain x86-64, so importing any build is safe on every
# x86-64 CPU (a whole-file pragma made gcc use AVX instructions at import: a CPU without
# them died there). What each build checks at import is in its .pyx.
AVX512 = "avx512f,avx512bw,avx512vl,avx512dq,avx2,fma,prefer-vector-width=256"
KERNEL_TARGETS = {
    "microtensor.kernels._fused_avx2": "avx2,fma",
    "microtensor.kernels._fused_attention_avx2": "avx2,fma",
    "microtensor.kernels._fused_avx512": AVX512,
    "microtensor.kernels._fused_attention_avx512": AVX512,
}
PRAGMA_MARK = "/* microtensor: kernel functions compiled for "

# Kernels of a per-CPU build that get 512-bit vectors where the rest of the build prefers
# 256: the flat elementwise ones, whose every element is a polynomial and a division
# (no running sums). On a 2-core Intel Xeon (Sapphire Rapids class), one thread, float32,
# 393,216 elements: GELU forward 288 -> 220 us, backward 304 -> 225, the tanh GELU 364 ->
# 279 and 561 -> 397, SiLU 260 -> 231 and 480 -> 354; the row kernels (layer_norm,
# cross-entropy) were up to 2.2x slower at 512 bits, so they keep 256 (docs/BENCHMARKS.md).
WIDE_VECTOR_KERNELS = {
    "microtensor.kernels._fused_avx512": ("gelu_forward", "gelu_backward", "gelu_tanh_forward",
                                          "gelu_tanh_backward", "silu_forward", "silu_backward"),
}
WIDE_MARK = '__attribute__((target("prefer-vector-width=512"))) '


def target_kernels_only(c_file, target):
    """Wrap the kernels' functions in `c_file` (Cython's output) in a `#pragma GCC target`
    (gcc on x86-64 only; elsewhere the build is a plain copy). Done once per generated
    file; the build stops if the file's layout is not the one expected."""
    with open(c_file) as f:
        text = f.read()
    if PRAGMA_MARK in text:
        return
    start = text.index("/* #### Code section: module_code ### */")
    end = text.index("/* #### Code section: module_exttypes ### */")
    first = text.find('\n/* "microtensor/', start, end)
    later_helpers = [text.find(m, first, end) for m in ('\n/* "View.MemoryView"', '\n/* "(tree')]
    if first < 0 or any(i >= 0 for i in later_helpers):
        raise RuntimeError(f"{c_file}: Cython's module code is not laid out as setup.py "
                           "expects (the kernels after Cython's helpers); see KERNEL_TARGETS")
    guard = "#if defined(__x86_64__) && defined(__GNUC__) && !defined(__clang__)\n"
    push = (f"\n{PRAGMA_MARK}{target} */\n{guard}#pragma GCC push_options\n"
            f'#pragma GCC target ("{target}")\n#endif\n')
    pop = f"{guard}#pragma GCC pop_options\n#endif\n"
    text = text[:first] + push + text[first:end] + pop + text[end:]
    with open(c_file, "w") as f:
        f.write(text)


def widen_kernels(c_file, names):
    """Give the definitions of the def functions `names` (each fused type's body: Cython's
    `__pyx_pf_<module>_<n><name>(...) {`) the attribute WIDE_MARK, inside the build's
    `#pragma GCC target`, which the attribute adds to (gcc on x86-64 only). The build
    stops if a name is not found."""
    with open(c_file) as f:
        text = f.read()
    if WIDE_MARK in text or not re.search(r"^#pragma GCC target", text, re.M):
        return
    for name in names:
        pattern = re.compile(r"^(static PyObject \*__pyx_pf_\w+?_\d+" + name + r"\(.*\) \{)$", re.M)
        text, n = pattern.subn("#if defined(__x86_64__) && defined(__GNUC__) && !defined(__clang__)\n"
                               + WIDE_MARK + "\n#endif\n" + r"\1", text)
        if n == 0:
            raise RuntimeError(f"{c_file}: no definition of the kernel {name} to widen "
                               "(see WIDE_VECTOR_KERNELS)")
    with open(c_file, "w") as f:
        f.write(text)


_progress = {"lock": threading.Lock(), "done": 0}


def say(line):
    """A progress line on stderr, at once."""
    print(f"microtensor build: {line}", file=sys.stderr, flush=True)


class ParallelBuildExt(build_ext):
    """build_ext with one compile job per CPU unless -j/--parallel says otherwise (pip
    runs build_ext without options, so the default is what makes `pip install .` quick);
    the per-CPU builds get their target around their kernels only (KERNEL_TARGETS)."""

    def finalize_options(self):
        super().finalize_options()
        if not self.parallel:
            self.parallel = jobs()

    def build_extension(self, ext):
        if ext.name in KERNEL_TARGETS:
            for source in ext.sources:
                if source.endswith(".c"):
                    target_kernels_only(source, KERNEL_TARGETS[ext.name])
                    widen_kernels(source, WIDE_VECTOR_KERNELS.get(ext.name, ()))
        start = time.monotonic()
        super().build_extension(ext)
        # signs of life (pip shows them with -v): the extensions compile in parallel
        with _progress["lock"]:
            _progress["done"] += 1
            say(f"[{_progress['done']}/{len(self.extensions)}] {ext.name} "
                f"({time.monotonic() - start:.0f} s)")


def record_build_config():
    """microtensor/runtime/_build_config.py: the flags of this build, for mt.show_config()."""
    cc = os.environ.get("CC") or sysconfig.get_config_var("CC") or "cc"
    try:
        version = subprocess.run(cc.split() + ["--version"], capture_output=True,
                                 text=True).stdout.splitlines()[0]
    except (OSError, IndexError):
        version = cc
    with open(os.path.join("microtensor", "runtime", "_build_config.py"), "w") as f:
        f.write('"""Written by setup.py at build time: how the extensions were compiled."""\n'
                f"COMPILE_ARGS = {compile_args!r}\nOPENMP = {openmp!r}\nNATIVE = {native!r}\n"
                f"DEBUG = {debug!r}\nPARALLEL_MIN_SCALE = {float(parallel_min_scale)!r}\n"
                f"COMPILER = {version!r}\n")


record_build_config()

directives = {
    "language_level": 3,
    "boundscheck": debug,
    "wraparound": debug,
    "cdivision": True,
    "initializedcheck": debug,
    "nonecheck": False,
}

# ---- reuse of an earlier build (see the top) ------------------------------------------

STAMP = os.path.join("build", "microtensor-build.json")


def build_settings():
    """What the generated C and the compiled modules depend on besides the sources."""
    import Cython
    import scipy
    return json.loads(json.dumps({
        "python": sys.version, "cython": Cython.__version__, "numpy": np.__version__,
        "scipy": scipy.__version__, "compile_args": compile_args, "link_args": link_args,
        "macros": macros, "directives": directives, "openmp": openmp,
        "kernel_targets": KERNEL_TARGETS, "wide_vector_kernels": WIDE_VECTOR_KERNELS}))


def previous_settings():
    try:
        with open(STAMP) as f:
            return json.load(f)
    except (OSError, ValueError):
        return None


_DEPENDENCY = re.compile(r'^\s*(?:include\s+"([^"]+)"|from\s+(microtensor[\w.]*)\s+cimport'
                         r'|cimport\s+(microtensor[\w.]*))', re.M)


def project_dependencies(path, seen=None):
    """path and every project file it includes or cimports, recursively."""
    seen = set() if seen is None else seen
    if path in seen or not os.path.exists(path):
        return seen
    seen.add(path)
    with open(path) as f:
        text = f.read()
    for include, frm, imp in _DEPENDENCY.findall(text):
        if include:
            project_dependencies(os.path.join(os.path.dirname(path), include), seen)
        else:
            project_dependencies((frm or imp).replace(".", "/") + ".pxd", seen)
    return seen


def c_is_current(pyx):
    """Is pyx's generated .c newer than pyx, what it includes or cimports, and setup.py?"""
    c_file = pyx[:-4] + ".c"
    if not os.path.exists(c_file):
        return False
    newest = max(os.path.getmtime(p) for p in project_dependencies(pyx) | {"setup.py"})
    return os.path.getmtime(c_file) >= newest


settings = build_settings()
same_settings = previous_settings() == settings


def own_compile_args(pyx):
    """The flags a .pyx asks for in its first lines (`# distutils: extra_compile_args =
    -fno-math-errno`: the optimizer's sqrt without errno bookkeeping, so that its update
    loop vectorises). The Extensions below are made here, not by cythonize, so the
    comment is read here."""
    with open(pyx) as f:
        for line in f.readlines()[:5]:
            m = re.match(r"#\s*distutils:\s*extra_compile_args\s*=\s*(.+)", line)
            if m:
                return m.group(1).split()
    return []


only = [n for n in os.environ.get("MICROTENSOR_BUILD_ONLY", "").split(",") if n]
extensions = []
for pyx in sorted(glob("microtensor/**/*.pyx", recursive=True)):
    name = pyx[:-4].replace(os.sep, ".").replace("/", ".")
    if only and name not in only:
        continue
    extensions.append(Extension(
        name, [pyx[:-4] + ".c"],       # the C that Cython makes of `pyx` in build_ext.run
        include_dirs=[np.get_include()],
        define_macros=macros,
        extra_compile_args=compile_args + own_compile_args(pyx),
        extra_link_args=link_args,
    ))


class IncrementalBuildExt(ParallelBuildExt):
    """Runs Cython only here, when something is built (pip also runs this file to ask for
    the build requirements and the metadata): for the .pyx whose .c is missing or older
    than what it depends on, or for all when the settings changed since the last build,
    which then compiles every module again too. Records the settings once this build
    succeeded."""

    def finalize_options(self):
        super().finalize_options()
        if not same_settings:
            self.force = True

    def run(self):
        stale = [ext for ext in self.extensions
                 if not (same_settings and c_is_current(ext.sources[0][:-2] + ".pyx"))]
        started = time.monotonic()
        say(f"{len(self.extensions)} C extensions ({len(stale)} to translate with Cython "
            f"first), {self.parallel or 1} compile jobs: a full build takes a few minutes")
        if stale:
            cythonize([Extension(ext.name, [ext.sources[0][:-2] + ".pyx"]) for ext in stale],
                      compiler_directives=directives, nthreads=jobs(),
                      compile_time_env={"MT_OPENMP": openmp}, force=True)
        super().run()
        say(f"done in {time.monotonic() - started:.0f} s")
        os.makedirs(os.path.dirname(STAMP), exist_ok=True)
        with open(STAMP, "w") as f:
            json.dump(settings, f, indent=1)


setup(
    ext_modules=extensions,
    cmdclass={"build_ext": IncrementalBuildExt},
)
