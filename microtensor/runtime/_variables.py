"""The MICROTENSOR_* environment variables: every one microtensor reads, and a warning for
any other, so that a typo (a name one letter short) is not silently a default.

Each variable's values are read, and a value it does not know warned about, where it is
used (the module named below); this module knows the names, and the on/off spelling the
switches share."""
import difflib
import warnings

# name -> where it is read and what it does (setup.py's are read by the build only)
VARIABLES = {
    "MICROTENSOR_KERNELS": "kernels/_choice.py: auto, avx512, avx2 or baseline",
    "MICROTENSOR_BLAS": "runtime/_blas_choice.py: auto, openblas or mkl",
    "MICROTENSOR_MALLOC": "runtime/_malloc.py: auto or default",
    "MICROTENSOR_OMP_DEFAULTS": "runtime/_omp_env.py: on/off, OpenMP's waiting defaults",
    "MICROTENSOR_ADAPTIVE_THREADS": "kernels/_blas.pyx: on/off, the team follows the load",
    "MICROTENSOR_DIST_TIMEOUT": "distributed.py: seconds a collective may take",
    "MICROTENSOR_CHROMIUM": "tests/_browser.py: the browser the explorer's tests drive",
    "MICROTENSOR_DEBUG": "setup.py: build with bounds checks",
    "MICROTENSOR_NATIVE": "setup.py: build with -march=native",
    "MICROTENSOR_BUILD_ONLY": "setup.py: rebuild these extensions only",
    "MICROTENSOR_PARALLEL_MIN_SCALE": "setup.py: scale the kernels' parallel thresholds",
}

# the spellings of a switch (MICROTENSOR_OMP_DEFAULTS, MICROTENSOR_ADAPTIVE_THREADS)
SWITCH = {"1": True, "on": True, "true": True, "yes": True, "auto": True,
          "0": False, "off": False, "false": False, "no": False}


def switch(environ, name, default=True):
    """The on/off variable `name` read from `environ`: unset or empty is `default`; a value
    that is none of SWITCH's spellings warns and means `default`."""
    raw = environ.get(name, "")
    if raw.strip() == "":
        return default
    value = SWITCH.get(raw.strip().lower())
    if value is None:
        warnings.warn(f"{name}={raw!r} is not one of {', '.join(SWITCH)}; using "
                      f"{'on' if default else 'off'}", RuntimeWarning, stacklevel=3)
        return default
    return value


def check_names(environ):
    """Warn once for each MICROTENSOR_* variable set in `environ` that microtensor does not
    read, naming the nearest one it does."""
    unknown = sorted(k for k in environ if k.startswith("MICROTENSOR_") and k not in VARIABLES)
    for name in unknown:
        near = difflib.get_close_matches(name, VARIABLES, n=1)
        hint = f" (did you mean {near[0]}?)" if near else ""
        warnings.warn(f"{name} is set but microtensor reads no such variable{hint}; the ones "
                      f"it reads: {', '.join(VARIABLES)}", RuntimeWarning, stacklevel=3)
    return unknown
