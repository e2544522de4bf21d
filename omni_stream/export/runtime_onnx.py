"""Runtime loop over exported decode steps: caches, ring slots, masks, greedy codes.

This is what a phone runtime does around the NPU graphs, in plain numpy: it owns one key and one
value array per layer, builds the mask and rotary inputs of each step, writes the step's new
entry into its ring slot (ring layout) or takes the shifted window back (roll layout), and runs
talker + code predictor per frame. The step itself is a ``StepRunner``: an ONNX Runtime session
(``OrtRunner``) or the torch step module it was exported from (``TorchRunner``), so the same loop
drives the exported graphs, the eager reference, the exporter's self-check and the calibration
recording. What it needs to know about a step (cache shapes, layout, context, rotary theta) it
reads from the step's manifest (``manifest.py``: ``state`` and the ``step`` section).

Cache bookkeeping (N = context, n = N - 1 cached entries):
  roll: slot j holds position ``pos - n + j`` (oldest first); valid iff that is >= 0.
  ring: position q lives in slot ``q % n``; at position ``pos`` slot s is valid iff s < pos.
The last key column is always the token itself. Masked keys get ``MASK_VALUE`` added: finite
(no NaN guards needed in the graph) and small enough that 16-bit activation quantization keeps
a fine step on the scores (-1e9 would leave a quantization step of ~15000).
"""

from __future__ import annotations

import logging
from dataclasses import dataclass
from pathlib import Path
from typing import Callable, Protocol

import numpy as np

from omni_stream.export.manifest import Manifest

log = logging.getLogger(__name__)

MASK_VALUE = -100.0  # e^-100 ~ 4e-44: masked keys add nothing in fp32


class StepRunner(Protocol):
    def run(self, feeds: dict[str, np.ndarray]) -> dict[str, np.ndarray]: ...


def rope_rows(head_dim: int, theta: float, length: int) -> tuple[np.ndarray, np.ndarray]:
    """cos and sign-folded sin ``[-sin, sin]`` tables [length, D] in fp32: the eager model's
    own tables (``rope_tables`` folds the sign already)."""
    from omni_stream.models.layers import rope_tables

    cos, sin = rope_tables(head_dim, theta, length)
    return cos.numpy(), sin.numpy()


class StepCache:
    """One stream's cache state for one step graph, laid out as its manifest says."""

    def __init__(self, manifest: Manifest, rope_len: int | None = None) -> None:
        if manifest.step is None:
            raise ValueError(f"{manifest.path or manifest.part}: not a decode step's manifest "
                             "(no 'step' section): export it with `omni-stream export-step`")
        self.manifest = manifest
        self.spec = spec = manifest.step
        state = {t.name: t for t in manifest.state}
        self.inputs = {t.name: t for t in manifest.inputs}
        self.keys = [np.zeros(state[f"past_key_{i}"].shape, np.float32) for i in range(spec.n_layers)]
        self.values = [np.zeros(state[f"past_value_{i}"].shape, np.float32) for i in range(spec.n_layers)]
        # Code2Wav: each stateful conv's last inputs (zeros = the causal left padding)
        self.tail_names = [t.name for t in manifest.state if t.name.startswith("tail_")]
        self.tails = [np.zeros(state[k].shape, np.float32) for k in self.tail_names]
        self.cos, self.sin = rope_rows(spec.head_dim, spec.rope_theta, rope_len or spec.context)
        self.pos = 0

    def reset(self) -> None:
        self.pos = 0
        for a in (*self.keys, *self.values, *self.tails):
            a.fill(0.0)

    def mask(self) -> np.ndarray:
        n, p = self.spec.cache_len, self.pos
        m = np.zeros((1, 1, 1, n + 1), np.float32)
        slots = np.arange(n)
        invalid = slots < n - p if self.spec.layout == "roll" else slots >= p
        m[0, 0, 0, :n][invalid] = MASK_VALUE
        return m

    def feeds(self, x: np.ndarray, head: int | None = None) -> dict[str, np.ndarray]:
        d = self.spec.head_dim
        if self.pos >= len(self.cos):  # a stream longer than planned (Code2Wav): grow the table
            self.cos, self.sin = rope_rows(d, self.spec.rope_theta, 2 * self.pos + 1)
        if "codes" in self.inputs:
            f = {"codes": np.ascontiguousarray(x, np.int64).reshape(self.inputs["codes"].shape)}
        else:
            f = {"x": np.ascontiguousarray(x, np.float32).reshape(1, 1, -1)}
        f.update({
             "rope_cos": self.cos[self.pos].reshape(1, 1, 1, d),
             "rope_sin": self.sin[self.pos].reshape(1, 1, 1, d),
             "mask": self.mask()})
        if self.spec.multi_head:
            f["head"] = np.array([head or 0], np.int64)
        for i in range(self.spec.n_layers):
            f[f"past_key_{i}"] = self.keys[i]
            f[f"past_value_{i}"] = self.values[i]
        f.update(zip(self.tail_names, self.tails))
        return f

    def update(self, out: dict[str, np.ndarray]) -> None:
        if self.spec.layout == "roll":
            for i in range(self.spec.n_layers):
                self.keys[i] = out[f"present_key_{i}"]
                self.values[i] = out[f"present_value_{i}"]
        else:
            s = self.pos % self.spec.cache_len
            for i in range(self.spec.n_layers):
                self.keys[i][..., s] = out[f"new_key_{i}"][..., 0]
                self.values[i][:, :, s] = out[f"new_value_{i}"][:, :, 0]
        for j, name in enumerate(self.tail_names):
            self.tails[j] = out[f"tail_out_{name[5:]}"]
        self.pos += 1

    def step(self, runner: StepRunner, x: np.ndarray, head: int | None = None) -> dict[str, np.ndarray]:
        out = runner.run(self.feeds(x, head))
        self.update(out)
        return out


# ---------------------------------------------------------------------------- runners
class OrtRunner:
    """An ONNX Runtime CPU session over one exported step."""

    def __init__(self, path: str | Path, threads: int = 1) -> None:
        import onnxruntime as ort

        so = ort.SessionOptions()
        so.intra_op_num_threads = threads
        so.inter_op_num_threads = 1
        so.log_severity_level = 3
        self.session = ort.InferenceSession(str(path), so, providers=["CPUExecutionProvider"])
        self.output_names = [o.name for o in self.session.get_outputs()]
        self.input_names = {i.name for i in self.session.get_inputs()}

    def run(self, feeds: dict[str, np.ndarray]) -> dict[str, np.ndarray]:
        res = self.session.run(self.output_names, {k: v for k, v in feeds.items() if k in self.input_names})
        return dict(zip(self.output_names, res))


class TorchRunner:
    """The torch step module the graph is exported from (the eager form of the same step)."""

    def __init__(self, module) -> None:
        self.module = module
        self.input_names = module.input_names()
        self.output_names = module.output_names()

    def run(self, feeds: dict[str, np.ndarray]) -> dict[str, np.ndarray]:
        import torch

        with torch.inference_mode():
            res = self.module(*(torch.from_numpy(np.ascontiguousarray(feeds[n])) for n in self.input_names))
        return {n: r.numpy() for n, r in zip(self.output_names, res)}


class RecordingRunner:
    """Wraps a runner and keeps a copy of every feed (calibration data from real decodes)."""

    def __init__(self, inner: StepRunner, sink: list[dict[str, np.ndarray]],
                 keep: Callable[[int], bool] = lambda i: True) -> None:
        self.inner, self.sink, self.keep, self.calls = inner, sink, keep, 0

    def run(self, feeds: dict[str, np.ndarray]) -> dict[str, np.ndarray]:
        if self.keep(self.calls):
            self.sink.append({k: v.copy() for k, v in feeds.items()})
        self.calls += 1
        return self.inner.run(feeds)


# ---------------------------------------------------------------------------- the decoder loop
@dataclass(frozen=True)
class LoopConfig:
    """Greedy decoding rules of the frame engine (SamplingParams.greedy())."""

    vocab: int
    groups: int
    eos: int
    suppressed: tuple[int, ...]
    repetition_penalty: float = 1.05
    min_new_tokens: int = 2


@dataclass
class Tables:
    """Embedding tables the runtime sums on the host (gathers, not worth an NPU call)."""

    codec: np.ndarray  # [V, C] talker codebook-0 table
    residual: np.ndarray  # [G-1, Vcp, C] code predictor tables, in the talker's width
    pad_row: np.ndarray  # [C] text-track tts_pad row

    def save(self, path: Path) -> None:
        np.savez(path, codec=self.codec, residual=self.residual, pad_row=self.pad_row)

    @classmethod
    def load(cls, path: Path) -> "Tables":
        z = np.load(path)
        return cls(z["codec"], z["residual"], z["pad_row"])


class StepDecoder:
    """Greedy talker + code predictor loop over two step runners (one stream)."""

    def __init__(self, talker: StepRunner, talker_manifest: Manifest, cp: StepRunner,
                 cp_manifest: Manifest, tables: Tables, loop: LoopConfig) -> None:
        self.talker, self.cp, self.tables, self.loop = talker, cp, tables, loop
        self.tcache = StepCache(talker_manifest)
        self.ccache = StepCache(cp_manifest)
        if self.ccache.spec.context < loop.groups:
            raise ValueError(f"code predictor context {self.ccache.spec.context} < {loop.groups} "
                             "positions per frame")
        self._suppress = np.zeros(loop.vocab, bool)
        self._suppress[list(loop.suppressed)] = True

    def _draw(self, logits: np.ndarray, seen: np.ndarray, n_gen: int) -> int:
        s = logits.astype(np.float32).reshape(-1)
        p = np.float32(self.loop.repetition_penalty)
        s = np.where(seen, np.where(s < 0, s * p, s / p), s)
        banned = self._suppress.copy()
        if n_gen < self.loop.min_new_tokens:
            banned[self.loop.eos] = True
        s[banned] = -np.inf
        return int(np.argmax(s))

    def residual(self, hidden: np.ndarray, code0: int) -> list[int]:
        """Codes 1..G-1 of a frame: 2 prefill positions then G-2 single steps, fresh cache."""
        c = self.ccache
        c.reset()
        c.step(self.cp, hidden)
        out = c.step(self.cp, self.tables.codec[code0], head=0)
        codes = [int(np.argmax(out["logits"]))]
        for j in range(1, self.loop.groups - 1):
            out = c.step(self.cp, self.tables.residual[j - 1, codes[-1]], head=j)
            codes.append(int(np.argmax(out["logits"])))
        return codes

    def generate(self, prompt: np.ndarray, trailing: np.ndarray, max_frames: int,
                 stop_on_eos: bool = True) -> np.ndarray:
        """prompt [T, C], trailing [N, C] (text-track rows of the first decode steps) ->
        greedy codes int64 [frames, G]."""
        t = prompt.shape[0]
        ctx = self.tcache.spec.context
        if t >= ctx:
            raise ValueError(f"the prompt has {t} positions but the talker step was exported with "
                             f"context {ctx}; export with --context >= {t + max_frames}")
        if t + max_frames > ctx:
            raise ValueError(f"prompt ({t}) + max_frames ({max_frames}) exceeds the talker context "
                             f"{ctx}; export with --context >= {t + max_frames} or ask for fewer frames")
        self.tcache.reset()
        out = None
        for row in prompt:
            out = self.tcache.step(self.talker, row)
        seen = np.zeros(self.loop.vocab, bool)
        code0 = self._draw(out["logits"], seen, 0)
        seen[code0] = True
        hidden = out["hidden"]
        frames: list[list[int]] = []
        stopped = stop_on_eos and code0 == self.loop.eos
        n_tr = trailing.shape[0]
        while not stopped and len(frames) < max_frames:
            res = self.residual(hidden, code0)
            codes = [code0] + res
            frames.append(codes)
            x = self.tables.codec[code0].copy()
            for j, cj in enumerate(res):
                x = x + self.tables.residual[j, cj]
            step_i = len(frames) - 1
            x = x + (trailing[step_i] if step_i < n_tr else self.tables.pad_row)
            out = self.tcache.step(self.talker, x)
            hidden = out["hidden"]
            code0 = self._draw(out["logits"], seen, len(frames))
            seen[code0] = True
            stopped = stop_on_eos and code0 == self.loop.eos
        return np.array(frames, dtype=np.int64).reshape(-1, self.loop.groups)
