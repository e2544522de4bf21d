"""One timed run of a peer, inside the peer's own virtualenv (imports only numpy and the peer).

    <peer venv>/bin/python worker.py --peer vox --model M.tmod --threads 1 --frames 24 --out DIR
    <peer venv>/bin/python worker.py --peer qwentts --model talker.gguf --codec codec.gguf ...

Loads the model, runs a short warm-up utterance, then one greedy utterance of ``--frames``
frames, and prints one JSON line: talker, code-predictor and codec ms per frame as the peer's
own counters report them (vox: ``Engine.stats()`` differences over the measured run; qwentts.cpp:
its ``[Perf]`` log lines), the frames made, and where the fidelity material went: vox's audio
(``DIR/audio.npy``; its API gives no codes) or qwentts.cpp's codes (``DIR/codes.npy`` [F, 16],
from its ``dump_dir``).
"""

from __future__ import annotations

import argparse
import json
import re
import sys
import time
from pathlib import Path

import numpy as np


def run_vox(a: argparse.Namespace) -> dict:
    import vox

    e = vox.Engine(a.model, device="cpu", threads=a.threads)
    voice = e.speaker_voice(a.speaker)
    greedy = dict(temperature=0, top_k=1, sub_temperature=0, sub_top_k=1, repetition_penalty=1.0,
                  language=a.language, seed=0)
    e.synthesize(a.text, voice, max_frames=4, **greedy)  # warm-up
    before = e.stats()["backend"]
    t0 = time.perf_counter()
    audio = e.synthesize(a.text, voice, max_frames=a.frames, **greedy)
    wall = time.perf_counter() - t0
    after = e.stats()["backend"]
    frames = after["frames"] - before["frames"]
    sec = {k: after["seconds"][k] - before["seconds"].get(k, 0.0) for k in after["seconds"]}
    np.save(Path(a.out) / "audio.npy", audio.astype(np.float32))
    return dict(frames=frames, talker_ms=1e3 * sec["talker"] / frames,
                cp_ms=1e3 * sec["predictor"] / frames, codec_ms=1e3 * sec["codec"] / frames,
                prefill_ms=1e3 * sec.get("prefill", 0.0), wall_s=wall, audio="audio.npy",
                codec_mode="streaming, chunk_frames 4 (vox default)", version=vox.__version__)


_PERF = {
    "talker_ms": re.compile(r"\[Perf\] TalkerDecode [\d.]+ ms \((\d+) frames, ([\d.]+) ms/frame\)"),
    "cp_ms": re.compile(r"\[Perf\] CodePredictor [\d.]+ ms \(([\d.]+) ms/frame\)"),
    "codec_total_ms": re.compile(r"\[Perf\] CodecDecode ([\d.]+) ms"),
    "prefill_ms": re.compile(r"\[Perf\] Prefill ([\d.]+) ms"),
}


def _dump(path: Path) -> np.ndarray:
    """A qwentts.cpp debug dump: int32 ndim, int32 dims (outermost first), float32 data."""
    raw = np.fromfile(path, dtype=np.int32)
    nd = int(raw[0])
    return raw[1 + nd:].view(np.float32).reshape([int(x) for x in raw[1:1 + nd]])


def run_qwentts(a: argparse.Namespace) -> dict:
    import qwentts_cpp_cpu as q

    logs: list[str] = []
    t = q.QwenTTS(a.model, a.codec, cpu_threads=a.threads)
    t.library.set_log_callback(lambda _lvl, msg: logs.append(str(msg)))
    greedy = dict(lang=a.language, speaker=a.speaker, do_sample=False, repetition_penalty=1.0)
    t.synthesize(text=a.text, max_new_tokens=4, **greedy)  # warm-up
    logs.clear()
    dump = Path(a.out) / "dump"
    dump.mkdir(parents=True, exist_ok=True)
    t0 = time.perf_counter()
    t.synthesize(text=a.text, max_new_tokens=a.frames, dump_dir=str(dump), **greedy)
    wall = time.perf_counter() - t0
    text = "\n".join(logs)
    got: dict = {}
    for key, pat in _PERF.items():
        m = pat.search(text)
        if m is None:
            raise RuntimeError(f"no '{pat.pattern}' in qwentts.cpp's log:\n{text[-2000:]}")
        got[key] = m.groups()
    frames = int(got["talker_ms"][0])
    codes = _dump(dump / "codes-full.bin").astype(np.int64)  # [F, 16]
    np.save(Path(a.out) / "codes.npy", codes)
    return dict(frames=frames, talker_ms=float(got["talker_ms"][1]), cp_ms=float(got["cp_ms"][0]),
                codec_ms=float(got["codec_total_ms"][0]) / frames, prefill_ms=float(got["prefill_ms"][0]),
                wall_s=wall, codes="codes.npy", codec_mode="one pass over the utterance (codec_chunk_sec 24)",
                version=q.__version__)


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--peer", choices=["vox", "qwentts"], required=True)
    ap.add_argument("--model", required=True, help="vox: .tmod; qwentts: talker .gguf")
    ap.add_argument("--codec", help="qwentts: codec .gguf")
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--frames", type=int, default=24)
    ap.add_argument("--text", required=True)
    ap.add_argument("--speaker", default="ryan")
    ap.add_argument("--language", default="english")
    ap.add_argument("--out", required=True, help="a folder for audio / codes")
    a = ap.parse_args()
    Path(a.out).mkdir(parents=True, exist_ok=True)
    row = run_vox(a) if a.peer == "vox" else run_qwentts(a)
    print(json.dumps(row))
    return 0


if __name__ == "__main__":
    sys.exit(main())
