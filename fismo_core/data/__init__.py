"""Package data of `fismo verify`: gradient streams recorded from the demo's real models.

``gradients.npz`` holds, for each stream, the parameter ``W_0`` at the start of
the recording and the ``G_t`` of consecutive training steps, in the float32
the models trained in (so the float64 reference sees them exactly), and a
JSON manifest describing how they were recorded. It was written by
``python -m fismo_core.data.record_gradients`` (needs the ``demo`` extra);
reading it needs only NumPy: see `fismo_core.verify.recorded_streams`.
"""

GRADIENTS_FILE = "gradients.npz"
"""The file name of the recorded streams, next to this module."""
