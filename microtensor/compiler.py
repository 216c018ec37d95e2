"""torch.compiler's questions, for code that runs both eagerly and under mt.compile."""
from microtensor.capture.recorder import is_compiling

__all__ = ["is_compiling"]
