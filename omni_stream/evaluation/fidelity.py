"""How close a fast path (quantized weights, another dtype) stays to a reference model.

Free-running greedy decodes of two models part ways at the first flipped argmax and never meet
again, which says little about how good each step is. So the comparison is teacher-forced: both
models see the reference's history every frame, and each frame we compare
- codebook 0: the talker's argmax and its logits (SNR in dB),
- codebooks 1..15: the code predictor's greedy codes given the same codebook-0 id, and its 15
  logits rows given the reference's inputs for every sub-step (talker hidden state, codebook 0
  and codes 1..14: ``FrameEngine.cp_logits_teacher_forced``), as SNR and top-1 agreement per
  codebook: a residual draw that follows a flipped one would compare nothing,
and the audio: the test's own per-frame codes (its codebook-0 argmax and its residual codes,
each given the reference history) and the reference codes through the same Code2Wav, as the SNR
of the two waveforms. On random-weight checkpoints logits have small margins, so these figures
are pessimistic next to a trained model's.

``load_path`` builds a synthesizer for a weight path the way the server does; ``omni-stream
fidelity`` runs the comparison for each path over ``requests_for``'s fixed prompts.
"""

from __future__ import annotations

import json
import math
from dataclasses import dataclass, field
from pathlib import Path
from typing import Sequence

import numpy as np
import torch

from omni_stream.checkpoints.io import OUTLIERS_FILE
from omni_stream.config import WEIGHT_PATHS, SamplingParams
from omni_stream.models.prompt import PromptRequest
from omni_stream.engine.synthesis import Synthesizer
from omni_stream.evaluation.metrics import snr_db

TEXTS = ("Hello world, this is a teacher-forced check of one weight path against the reference.",
         "Numbers, names and questions: does the code predictor keep up with 1,234 Fridays?")


@dataclass
class Fidelity:
    frames: int
    code0_agreement: float  # teacher-forced top-1 agreement of the talker
    code0_top5_overlap: float  # mean |top5(ref) & top5(test)| / 5
    logits_snr_db: float  # talker logits, all frames together
    residual_agreement: float  # codebooks 1..15, given the same codebook 0
    audio_snr_db: float | None  # waveform of the test's codes vs the reference's codes
    # code predictor given the reference's inputs for every sub-step: logits of all 15
    # codebooks over all frames, then per codebook, and top-1 agreement per codebook
    cp_logits_snr_db: float = float("nan")
    cp_logits_snr_db_per_codebook: list[float] = field(default_factory=list)
    cp_agreement_per_codebook: list[float] = field(default_factory=list)

    @property
    def cp_agreement(self) -> float:
        """Mean teacher-forced top-1 agreement over the code predictor's codebooks."""
        a = self.cp_agreement_per_codebook
        return float(np.mean(a)) if a else math.nan

    def as_dict(self) -> dict:
        def clean(v):
            if isinstance(v, list):
                return [clean(x) for x in v]
            return None if isinstance(v, float) and math.isinf(v) else v

        return {k: clean(v) for k, v in self.__dict__.items()}


@torch.inference_mode()
def teacher_forced(ref: Synthesizer, test: Synthesizer,
                   req: PromptRequest | Sequence[PromptRequest], frames: int,
                   codec: bool = True) -> Fidelity:
    """Compare ``test`` with ``ref`` over ``frames`` greedy frames of the reference's history
    (per request, when ``req`` is several: their frames are pooled)."""
    if ref.engine is test.engine:
        raise ValueError("teacher_forced needs two synthesizers (each steps its own engine); "
                         "load the reference twice to compare a path with itself")
    reqs = [req] if isinstance(req, PromptRequest) else list(req)
    acc: dict[str, list] = {k: [] for k in ("agree0", "top5", "lr", "lt", "res", "cr", "ct",
                                            "wr", "wt")}
    for r in reqs:
        _one(ref, test, r, frames, codec, acc)
    g1 = ref.model.config.talker.num_code_groups - 1
    n = len(acc["lr"])
    if n:
        cr, ct = torch.stack(acc["cr"]), torch.stack(acc["ct"])  # [F, G-1, codebook]
        cp_snr = snr_db(cr, ct)
        cp_per = [snr_db(cr[:, j], ct[:, j]) for j in range(g1)]
        cp_agree = (cr.argmax(-1) == ct.argmax(-1)).float().mean(0).tolist()
    else:
        cp_snr, cp_per, cp_agree = math.nan, [math.nan] * g1, [math.nan] * g1
    audio_snr = snr_db(torch.cat(acc["wr"], -1), torch.cat(acc["wt"], -1)) if acc["wr"] else None
    return Fidelity(
        frames=n, code0_agreement=float(np.mean(acc["agree0"])),
        code0_top5_overlap=float(np.mean(acc["top5"])) if n else math.nan,
        logits_snr_db=snr_db(torch.stack(acc["lr"]), torch.stack(acc["lt"])) if n else math.nan,
        residual_agreement=float(np.mean(acc["res"])) if n else math.nan,
        audio_snr_db=audio_snr, cp_logits_snr_db=cp_snr, cp_logits_snr_db_per_codebook=cp_per,
        cp_agreement_per_codebook=cp_agree)


def _one(ref: Synthesizer, test: Synthesizer, req: PromptRequest, frames: int, codec: bool,
         acc: dict[str, list]) -> None:
    """One request's frames, appended to ``acc``."""
    params = SamplingParams.greedy()
    er, et = ref.engine, test.engine
    pr, pt = ref.builder.build(req), test.builder.build(req)
    c_ref = er.prefill(0, pr.embeds, pr.trailing, params, 0)
    c_test = et.prefill(0, pt.embeds, pt.trailing, params, 0)
    acc["agree0"].append(c_ref == c_test)
    codes: list[torch.Tensor] = []
    test_codes: list[torch.Tensor] = []
    pred0 = c_test
    eos = ref.model.config.talker.special.codec_eos
    for _ in range(frames):
        if c_ref == eos:
            break
        et.follow_draws(er, 1)
        res_r = er.predict_residual(1)
        res_t = et.predict_residual(1)
        acc["res"].append(float((res_r == res_t).float().mean()))
        # both code predictors on the reference's inputs, sub-step by sub-step
        h, c0 = er.last_hidden[:1], int(er.last_code0[0])
        acc["cr"].append(er.cp_logits_teacher_forced(h, c0, res_r[0]))
        acc["ct"].append(et.cp_logits_teacher_forced(h, c0, res_r[0]))
        with er.residual_given(res_r), et.residual_given(res_r):
            frame, nxt_r = er.step(1)
            _, nxt_t = et.step(1)
        codes.append(frame[0].clone())
        test_codes.append(torch.cat((torch.tensor([pred0]), res_t[0].cpu())))
        pred0 = int(nxt_t[0])
        lg_r = er.talker_logits(er.last_hidden[:1])[0]
        lg_t = et.talker_logits(et.last_hidden[:1])[0]
        acc["lr"].append(lg_r)
        acc["lt"].append(lg_t)
        acc["top5"].append(len(set(lg_r.topk(5).indices.tolist())
                               & set(lg_t.topk(5).indices.tolist())) / 5)
        acc["agree0"].append(int(nxt_r[0]) == int(nxt_t[0]))
        c_ref = int(nxt_r[0])
    if codec and codes:
        dev = next(ref.model.code2wav.parameters()).device
        for key, c in (("wr", codes), ("wt", test_codes)):
            acc[key].append(ref.model.code2wav(torch.stack(c).T.unsqueeze(0).to(dev)).float().reshape(-1))


# ---------------------------------------------------------------------------- the report
def engine_paths(engine: str, device: str = "cpu") -> list[str]:
    """The weight paths ``engine`` runs on ``device`` (WEIGHT_PATHS order)."""
    from omni_stream.engine import quant

    out = []
    for wp in WEIGHT_PATHS:  # the native runtime has a plan for every one (NATIVE_PLANS)
        try:
            quant.check_supported(wp, device, engine)
        except ValueError:
            continue
        out.append(wp)
    return out


def load_path(model_path: str | Path, weight_path: str | None, engine: str = "torch",
              threads: int | None = None, max_seq_len: int = 512) -> Synthesizer:
    """A synthesizer on ``weight_path`` (None: the fp32 reference) built as the server builds
    it: ``load_for_engine`` then ``attach_engine``, in fp32 for fp32 and bf16 otherwise (the
    low-bit paths compute in bf16). No pack cache: packing every path here would evict the
    server's packed weights from the cache folder (it keeps the 4 most recent)."""
    from omni_stream.engine.loading import attach_engine, load_for_engine

    dtype = torch.float32 if weight_path in (None, "fp32") else torch.bfloat16
    s = Synthesizer(load_for_engine(model_path, dtype, "cpu", weight_path, engine),
                    max_seq_len=max_seq_len)
    attach_engine(s.engine, engine, weight_path, threads or torch.get_num_threads(),
                  model_path=model_path if engine == "vllm" else None)
    return s


def requests_for(config) -> list[PromptRequest]:
    """The fixed prompts of the report, one per text, in the variant's voice: a named speaker
    (CustomVoice), a description (VoiceDesign), or none (Base); the second streams its text
    (the other prompt layout)."""
    speakers = sorted(config.talker.speakers)
    voice = (dict(speaker=speakers[0]) if speakers else
             dict(instructions="A calm, clear voice.") if config.variant == "voice_design" else {})
    return [PromptRequest(text=TEXTS[0], language="english", **voice),
            PromptRequest(text=TEXTS[1], language="auto", stream_text=True, **voice)]


def outliers_note(model_path: str | Path) -> str | None:
    """A line saying the checkpoint has planted outlier channels (``make-checkpoint
    --outliers``), which low-bit paths quantize worst; None without the side file."""
    f = Path(model_path) / OUTLIERS_FILE
    if not f.is_file():
        return None
    try:
        chans = json.loads(f.read_text()).get("channels") or {}
        count = (f": {sum(len(v) for v in chans.values())} channels in {len(chans)} layers"
                 if chans else "")
    except (OSError, ValueError, AttributeError, TypeError):
        count = ""
    return f"the checkpoint has outlier channels ({OUTLIERS_FILE}{count})"


def report_row(path: str, engine: str, f: Fidelity) -> dict:
    """One row of ``omni-stream fidelity``: the headline figures, then every field."""
    agree = f.cp_agreement_per_codebook
    worst = int(np.argmin(agree)) if agree and not any(math.isnan(a) for a in agree) else None
    return {"weight_path": path, "engine": engine, **f.as_dict(), "cp_agreement": f.cp_agreement,
            "cp_worst_codebook": None if worst is None else worst + 1,
            "cp_worst_agreement": None if worst is None else agree[worst]}


def reference(model_path: str | Path, frames: int) -> tuple[Synthesizer, list[PromptRequest], int]:
    """The fp32 torch reference with its engine sized to the report's prompts plus ``frames``
    (a 4096-position cache of a 0.6B model is ~1 GB per synthesizer), those prompts, and the
    size for the test synthesizers."""
    from omni_stream.engine.frame import EngineShape, FrameEngine

    ref = load_path(model_path, None, max_seq_len=2)
    reqs = requests_for(ref.model.config)
    seq = max(ref.builder.build(r).length for r in reqs) + frames + 1
    ref.engine = FrameEngine(ref.model.weights.talker, EngineShape(max_slots=1, max_seq_len=seq))
    return ref, reqs, seq
