"""mt.nn: modules, layers and the functional API."""
from microtensor.nn import functional
