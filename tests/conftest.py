import numpy as np
import pytest

import microtensor as mt


@pytest.fixture(autouse=True)
def _seed():
    """Every test starts from the same random state."""
    mt.manual_seed(0)
    np.random.seed(0)
    yield
