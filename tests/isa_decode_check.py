"""Run as a script (``python tests/isa_decode_check.py``) under an ``ONEDNN_MAX_CPU_ISA`` cap:
pins oneDNN as the codec stage does, builds the codec stage's bf16 decoder at the released
widths and prints one JSON line: the level oneDNN runs at, whether the code claims the same
bits at any chunk plan there (``onednn.decode_invariant``), whether the weights were packed,
and, where it claims it, whether three chunk plans (one with another stream sharing every
call) gave the bits of a reference plan. ``tests/test_code2wav.py`` runs it per level."""

from __future__ import annotations

import json

from omni_stream.models.onednn import decode_invariant, pin_decode_isa

level = pin_decode_isa()  # first: before any oneDNN call in this process

import torch  # noqa: E402

from omni_stream.checkpoints.presets import _CODEC_RELEASED  # noqa: E402
from omni_stream.models.code2wav import (Code2Wav, Code2WavConfig, Code2WavStream,  # noqa: E402
                                         random_code2wav_state_dict)
from omni_stream.stages.codec_kernels import same_bits, stage_kernels  # noqa: E402


def main() -> None:
    torch.set_num_threads(1)
    claim = decode_invariant(level)
    cfg = Code2WavConfig(**{k: v for k, v in _CODEC_RELEASED.items()
                            if k in Code2WavConfig.__dataclass_fields__})
    m = Code2Wav(cfg).eval()
    m.load_state_dict(random_code2wav_state_dict(cfg, seed=1), strict=True)
    m = stage_kernels(m.bfloat16())
    out = dict(level=level, claim=claim, packed=m.packed, plans={})
    if claim:
        g = torch.Generator().manual_seed(5)
        codes = torch.randint(0, cfg.codebook_size, (2, cfg.num_quantizers, 18), generator=g)

        def stream(plan, with_other: bool) -> torch.Tensor:
            s, pcm, a = Code2WavStream(m, 3), [], 0
            if with_other:  # another stream, 3 frames ahead, shares every call
                s.decode([2], codes[1:, :, :3])
            for n in plan:
                if with_other and a + n + 3 <= codes.shape[2]:
                    y = s.decode([0, 2], torch.cat([codes[:1, :, a:a + n],
                                                    codes[1:, :, a + 3:a + 3 + n]]))
                else:
                    y = s.decode([0], codes[:1, :, a:a + n])
                pcm.append(y[0])
                a += n
            return torch.cat(pcm)

        with torch.inference_mode():
            ref = stream([4] * 4 + [2], False)
            for plan, other in (([1, 2, 3, 5, 7], False), ([18], False), ([3, 5, 2, 6, 2], True)):
                out["plans"][f"{plan}{' shared' if other else ''}"] = same_bits(stream(plan, other), ref)
    print(json.dumps(out))


if __name__ == "__main__":
    main()
