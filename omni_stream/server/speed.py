"""OpenAI ``speed``: a pitch-preserving time-stretch of one stream's audio, chunk by chunk.

The model speaks at its own pace; ``speed`` (0.25-4.0) is applied to the PCM the server decodes,
after the backend, by Rubber Band's real-time stretcher (R3 "finer" engine, short window) through
``pylibrb``, whose wheel bundles the library (no system package). One :class:`Stretcher` per
stream, never per chunk: the stretcher carries its phase state across chunks, so joins are
continuous. speed 1.0 (or omitted) never reaches here: the stream is passed through untouched.

Why this library and these options (``benchmarks/tts/speed_bench.py`` measures them): R3 keeps
a 220 Hz and a 1 kHz tone's pitch exact (R2 moved 220 Hz by 1.6 %), its joins jump no more than
the tone itself, and with the short window it returns audio from the first 80 ms frame at
speeds up to 2.0 (the default window needs 110-130 ms of input at 1.5-2.0). Signalsmith Stretch
(python-stretch) jumped 18-35x the signal's own step at chunk joins when fed chunk by chunk;
bungee-python crashed the interpreter on construction.

Exact length: the stretcher is primed with its preferred start pad of silence and its start delay
is dropped from the front, so output starts aligned with the input; at the end of the stream it
is flushed (``final``) and the output is cut or padded to ``round(samples_in / speed)``. The
stream never gets ahead of that target, so nothing has to be taken back.
"""

from __future__ import annotations

import importlib.util
import math
from typing import Any

import numpy as np

from omni_stream.errors import RequestError

SPEED_MIN, SPEED_MAX = 0.25, 4.0
_BLOCK = 4096  # samples per process() call: the stretcher's buffers are sized for this once


def check_speed(value: Any, param: str = "speed") -> float:
    """``value`` as a speed in [0.25, 4.0] (None: 1.0); 400 naming the range otherwise (NaN and
    infinities included)."""
    if value is None:
        return 1.0
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        raise RequestError(400, "invalid_type",
                           f"'{param}' must be a number between {SPEED_MIN} and {SPEED_MAX}, "
                           f"got {value!r}", param=param)
    if not (math.isfinite(value) and SPEED_MIN <= value <= SPEED_MAX):
        raise RequestError(400, "invalid_value",
                           f"'{param}' must be between {SPEED_MIN} and {SPEED_MAX}, got {value}",
                           param=param)
    return float(value)


def speed_available() -> bool:
    """Whether this process can stretch (``pylibrb`` installed); looked up, not imported."""
    return importlib.util.find_spec("pylibrb") is not None


def require_speed(speed: float, param: str = "speed") -> None:
    """400 ``unsupported_speed`` where ``speed`` != 1.0 and the stretcher is not installed."""
    if speed != 1.0 and not speed_available():
        raise RequestError(400, "unsupported_speed",
                           f"'{param}' {speed} needs the pylibrb package, which this server "
                           "lacks: pip install 'omni-stream[speed]' (Linux x86-64; scripts/setup.sh "
                           "installs it), or omit speed", param=param)


class StretchError(RuntimeError):
    """The stretcher failed: the stream it belongs to fails, nothing else."""


class Stretcher:
    """One stream's time-stretch: :meth:`push` each chunk's samples, :meth:`finish` once at the
    end. Both return the samples ready now (float32 mono); the output is ``round(n / speed)``
    samples in total for ``n`` pushed. Not thread-safe: one call at a time (the server awaits
    each)."""

    def __init__(self, speed: float, sample_rate: int) -> None:
        assert SPEED_MIN <= speed <= SPEED_MAX and speed != 1.0, speed
        import pylibrb  # lazily: only a stream with speed != 1.0 loads it

        opt = pylibrb.Option
        self.speed = speed
        try:
            self._rb = pylibrb.RubberBandStretcher(
                sample_rate, 1, opt.PROCESS_REALTIME | opt.ENGINE_FINER | opt.WINDOW_SHORT,
                1.0 / speed, 1.0)
            self._rb.set_max_process_size(_BLOCK)
            self._drop = self._rb.get_start_delay()  # output samples before the input's first
            pad = self._rb.get_preferred_start_pad()
            if pad:
                self._rb.process(np.zeros((1, pad), np.float32))
        except Exception as e:  # noqa: BLE001 - whatever the binding raises fails this stream
            raise StretchError(f"time-stretch setup failed: {e}") from e
        self.samples_in = 0
        self.samples_out = 0
        self._held = np.zeros(0, np.float32)  # ready, but past round(samples_in / speed)
        self._done = False

    def push(self, pcm: np.ndarray) -> np.ndarray:
        """Stretch ``pcm`` ([samples] float32); returns what is ready (maybe nothing)."""
        assert not self._done, "push after finish"
        x = np.ascontiguousarray(pcm, np.float32).reshape(-1)
        self.samples_in += len(x)
        try:
            for i in range(0, len(x), _BLOCK):
                self._rb.process(x[None, i:i + _BLOCK])
                self._retrieve()
        except Exception as e:  # noqa: BLE001
            raise StretchError(f"time-stretch failed: {e}") from e
        return self._emit(self._target())

    def finish(self) -> np.ndarray:
        """Flush the stretcher's tail; returns the rest, cut or padded to the exact length."""
        assert not self._done, "finish twice"
        self._done = True
        try:
            self._rb.process(np.zeros((1, 0), np.float32), final=True)
            while not self._rb.is_done() or self._rb.available() > 0:
                if self._retrieve() == 0 and self._rb.available() <= 0:
                    break
        except Exception as e:  # noqa: BLE001
            raise StretchError(f"time-stretch flush failed: {e}") from e
        target = self._target()
        short = target - self.samples_out - len(self._held)
        if short > 0:  # the flushed tail fell short of the exact length: silence
            self._held = np.concatenate([self._held, np.zeros(short, np.float32)])
        return self._emit(target)

    def _target(self) -> int:
        return round(self.samples_in / self.speed)

    def _retrieve(self) -> int:
        n = self._rb.available()
        if n <= 0:
            return 0
        y = self._rb.retrieve(n)[0]  # [n]
        if self._drop:
            k = min(self._drop, len(y))
            y, self._drop = y[k:], self._drop - k
        if len(y):
            self._held = np.concatenate([self._held, y.astype(np.float32, copy=False)])
        return n

    def _emit(self, target: int) -> np.ndarray:
        k = max(0, min(len(self._held), target - self.samples_out))
        out, self._held = self._held[:k], self._held[k:]
        self.samples_out += k
        return out
