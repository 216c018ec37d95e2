"""mt.Generator: a random number generator object, as torch.Generator.

    g = mt.Generator().manual_seed(42)
    x = mt.randn(3, generator=g)          # draws from g, not from the default generator
    state = g.get_state()                 # a uint8 tensor
    g.set_state(state)                    # the same draws again

Every random function that takes `generator=` in torch takes it here (randn, rand,
randint, randperm, multinomial, normal, bernoulli, poisson, the in-place normal_,
uniform_, bernoulli_, exponential_, random_ and nn.init's fills); without it they draw
from `mt.default_generator`, which `mt.manual_seed` reseeds. Each Generator owns a numpy
PCG64 stream, so two generators are independent and one seed gives one sequence of draws
(numpy's PCG64 stream, not torch's Mersenne Twister: the same seed gives other numbers
than torch, and the same numbers as microtensor).

The default generator is a view of the core's stream (the one `mt.get_rng_state` saves):
seeding or restoring either is seeding or restoring both. It is seeded once, when
microtensor is imported, from the operating system's entropy; `mt.initial_seed()` says
with what and changes nothing (`mt.manual_seed(mt.initial_seed())` restarts the stream).

A state is accepted in every form microtensor hands one out: the uint8 tensor of
`get_state()` (any generator's, the default one's included), the JSON string of
`mt.get_rng_state()`, its bytes, or the dict it decodes to. `mt.set_rng_state` and every
`Generator.set_state` take each of them.
"""
import json
import random as _py_random

import numpy as np

from microtensor.core import _core
from microtensor.core.dtypes import device as _device
from microtensor.core._core import check_device as _check_device

__all__ = ["Generator", "default_generator", "manual_seed", "seed", "initial_seed",
           "set_rng_state"]

_MAX_SEED = 2 ** 64


def _check_seed(seed):
    if isinstance(seed, (bool, np.bool_)) or not isinstance(seed, (int, np.integer)):
        try:
            seed = int(seed)
        except (TypeError, ValueError):
            raise TypeError(f"manual_seed expected an int, got {type(seed).__name__}") from None
    seed = int(seed)
    if not -2 ** 63 <= seed < _MAX_SEED:
        raise RuntimeError(f"Overflow when unpacking long: seed {seed} is outside "
                           f"[-2**63, 2**64)")
    return seed % _MAX_SEED                   # as torch: a negative seed wraps around


def _fresh_seed():
    return _py_random.SystemRandom().randrange(2 ** 63)


def _state_tensor(bit_generator):
    raw = json.dumps(bit_generator.state).encode()
    return _core.wrap(np.frombuffer(raw, dtype=np.uint8).copy())


def _state_from(state):
    """A numpy bit generator in `state`, given in any form a get_state hands out."""
    if isinstance(state, _core.Tensor):
        if state.dtype != np.uint8 or state.ndim != 1:
            raise TypeError(f"set_state expects a 1-D uint8 tensor (what get_state returns), "
                            f"got a {state.dtype} tensor of shape {tuple(state.shape)}")
        state = bytes(np.ascontiguousarray(state.numpy()))
    elif not isinstance(state, (str, bytes, bytearray, dict)):
        raise TypeError(f"set_state expects a generator state (the uint8 tensor of get_state, "
                        f"or the string of mt.get_rng_state), got {type(state).__name__}")
    try:
        st = state if isinstance(state, dict) else json.loads(
            state if isinstance(state, str) else bytes(state).decode())
        bg = getattr(np.random, st["bit_generator"])()
        bg.state = st
    except Exception as e:                    # noqa: BLE001 - any garbage is one error
        raise RuntimeError(f"set_state: not a generator state ({type(e).__name__}: {e})") from None
    return bg


class Generator:
    """A stream of random numbers of its own (see the module docstring)."""

    def __init__(self, device="cpu"):
        _check_device(device)
        self.device = _device("cpu")
        self._initial = _fresh_seed()
        self._rng = np.random.Generator(np.random.PCG64(self._initial))

    def _numpy_generator(self):
        """The numpy Generator the random functions draw from."""
        return self._rng

    def manual_seed(self, seed):
        """Reseed; returns self, so `g = mt.Generator().manual_seed(0)` works."""
        self._initial = _check_seed(seed)
        self._rng = np.random.Generator(np.random.PCG64(self._initial))
        return self

    def seed(self):
        """Reseed from the operating system's entropy; returns the seed."""
        self.manual_seed(_fresh_seed())
        return self._initial

    def initial_seed(self):
        """The seed of the last manual_seed / seed (or the one drawn at creation)."""
        return self._initial

    def get_state(self):
        return _state_tensor(self._numpy_generator().bit_generator)

    def set_state(self, new_state):
        self._rng = np.random.Generator(_state_from(new_state))
        return self

    def __repr__(self):
        return f"<mt.Generator object (initial seed {self._initial})>"


class _DefaultGenerator(Generator):
    """mt.default_generator: the core's stream, which every draw without generator= uses."""

    def __init__(self):
        self.device = _device("cpu")
        self.manual_seed(_fresh_seed())       # once, at import: the seed is then known

    def _numpy_generator(self):
        return _core.default_generator()

    def manual_seed(self, seed):
        self._initial = _check_seed(seed)
        _core.manual_seed(self._initial)
        return self

    def set_state(self, new_state):
        _core.set_rng_state(_state_from(new_state).state)
        return self


default_generator = _DefaultGenerator()


def manual_seed(seed):
    """Seed the default generator (randn, dropout, nn.init, ... without generator=)."""
    return default_generator.manual_seed(seed)


def seed():
    """Seed the default generator from the operating system's entropy; returns the seed."""
    return default_generator.seed()


def initial_seed():
    return default_generator.initial_seed()


def set_rng_state(new_state):
    """Restore the default generator's state (any form a get_state hands out)."""
    default_generator.set_state(new_state)
