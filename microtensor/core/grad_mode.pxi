# Grad mode and anomaly mode are per thread, as in PyTorch: `no_grad` in an evaluation
# thread must not switch gradients off in a training thread. They live in C thread-local
# storage, so the check every op makes (`_grad_on()`) stays one load. A new thread starts
# with gradients on (the stored flag is "disabled", and thread-locals start at zero).
cdef extern from *:
    """
    #if defined(_MSC_VER)
    #define MT_THREAD_LOCAL __declspec(thread)
    #else
    #define MT_THREAD_LOCAL __thread
    #endif
    static MT_THREAD_LOCAL int mt_grad_disabled = 0;
    static MT_THREAD_LOCAL int mt_anomaly_on = 0;
    static inline int mt_grad_on(void) { return !mt_grad_disabled; }
    static inline void mt_set_grad_on(int on) { mt_grad_disabled = !on; }
    static inline int mt_anomaly(void) { return mt_anomaly_on; }
    static inline void mt_set_anomaly(int on) { mt_anomaly_on = on; }
    """
    bint mt_grad_on() nogil
    void mt_set_grad_on(bint on) nogil
    bint mt_anomaly() nogil
    void mt_set_anomaly(bint on) nogil


cdef inline bint _grad_on():
    return mt_grad_on()


def set_grad_enabled_(bint mode):
    """Set this thread's grad mode; returns the previous one."""
    prev = mt_grad_on()
    mt_set_grad_on(mode)
    return prev


def is_grad_enabled():
    """True when operations in this thread record a graph for backward."""
    return mt_grad_on()


def set_anomaly_enabled_(bint mode):
    prev = mt_anomaly()
    mt_set_anomaly(mode)
    return prev


def is_anomaly_enabled():
    return mt_anomaly()


class _GradMode:
    """Base of no_grad / enable_grad: a context manager that also decorates functions."""
    mode = True

    def __enter__(self):
        self._prev = set_grad_enabled_(self.mode)
        return self

    def __exit__(self, *exc):
        set_grad_enabled_(self._prev)
        return False

    def __call__(self, fn):
        import functools
        mode = self.mode

        @functools.wraps(fn)
        def wrapper(*args, **kwargs):
            prev = set_grad_enabled_(mode)
            try:
                return fn(*args, **kwargs)
            finally:
                set_grad_enabled_(prev)
        return wrapper


class no_grad(_GradMode):
    """`with mt.no_grad():` runs operations without recording a graph."""
    mode = False


class enable_grad(_GradMode):
    """`with mt.enable_grad():` turns graph recording back on inside no_grad."""
    mode = True


class set_grad_enabled(_GradMode):
    def __init__(self, mode):
        self.mode = bool(mode)
        self._prev = set_grad_enabled_(self.mode)

    def __enter__(self):
        return self


class AnomalyError(RuntimeError):
    """A NaN or Inf appeared in backward (raised under detect_anomaly)."""


class detect_anomaly:
    """Within this context the first NaN or Inf produced in backward raises an error
    naming the op that produced it and where that op was created in forward."""

    def __init__(self, check_nan=True):
        self.check_nan = check_nan

    def __enter__(self):
        self._prev = set_anomaly_enabled_(self.check_nan)
        return self

    def __exit__(self, *exc):
        set_anomaly_enabled_(self._prev)
        return False
