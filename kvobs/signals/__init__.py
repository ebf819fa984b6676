"""Early layer0 signals: buffered until their transfer task registers, recovered exactly once, bounded.

`EarlySignalBuffer` decides at each call (one engine process, any number of threads);
`StepAlignedSignalBuffer` decides once per model-runner step in a canonical order, so tensor-parallel ranks
release identical batches. Each decision is written once, in `kvobs.signals._core`: the early buffer's
`register()` and `finish()` are those decisions, its `signal()` and `signal_batch()` make the core's one signal
decision (`_signal_locked`), and the step-aligned buffer applies the calls it recorded through the same ones.
"""

from kvobs.errors import SignalBufferFull
from kvobs.signals._immediate import EarlySignalBuffer
from kvobs.signals._records import Progress, ReadySignal
from kvobs.signals._step_aligned import StepAlignedSignalBuffer

__all__ = ["EarlySignalBuffer", "Progress", "ReadySignal", "SignalBufferFull", "StepAlignedSignalBuffer"]
