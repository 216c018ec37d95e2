# ---- the capture hook: the one door mt.compile watches ------------------------------------
# A compiled function is recorded as the ops it calls. Reading a tensor's values in
# Python (t.item(), bool(t), t.numpy(), repr(t)) can steer the Python code between ops,
# and changing a tensor outside an op (t.grad = None, t.data = ...) is a change no op
# records: both call the hook, as does every tensor the core makes (one made outside
# every recorded op came from a call the recording could not see) and a read of t.grad
# or t.data (recorded, read again at replay). mt.compile decides (microtensor/capture/).

cdef object _capture_hook = None


def set_capture_hook(hook):
    """hook(tensor, what) runs where Python reads a tensor's values or changes it outside
    an op, and where a tensor is made ("a new tensor"; None: no hook). For "t.data" it
    may return the tensor the read gives. Returns the previous hook."""
    global _capture_hook
    if hook is not None and not callable(hook):
        raise TypeError(f"set_capture_hook: the hook must be callable or None, got {type(hook).__name__}")
    previous = _capture_hook
    _capture_hook = hook
    return previous


cdef inline int _seen(Tensor t, str what) except -1:
    if _capture_hook is not None:
        _capture_hook(t, what)
    return 0


def capture_read(t, what):
    """The door for code outside the core: an op whose result is a Python value read
    from a tensor (mt.equal, mt.allclose) or whose output shape depends on its values
    (nonzero, unique, masked_select) calls this first, so mt.compile can see it."""
    if _capture_hook is not None and isinstance(t, Tensor):
        _capture_hook(t, what)
