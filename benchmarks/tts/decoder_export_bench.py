"""Client-side Code2Wav: per-frame decode time of the exported programs vs eager, and wire bytes.

Side by side on the same checkpoint (default: the 0.6B-shaped random one), one CPU thread:
  eager   ``Code2WavStream`` (what ``--decoder-backend torch`` and the server's codec stage run);
  pt2     the ExportedProgram of the streaming step (``torch.export.load(...).module()``);
  aoti    the same program compiled by AOTInductor for this CPU;
  pte     the ExecuTorch program with the XNNPACK delegate (``--decoder-backend executorch``).
Each decodes one stream from a fresh state in chunks of ``--chunks`` frames (1 = the first
chunk of the ramp, 4/8 = steady); the figure is the median wall time per call / frames per call,
after ``--warmup`` calls. Exports are cached under ``--work`` (reused when the manifest matches
the checkpoint's codec hash).

Wire bytes per second of audio: codec frames (int64 [n, 16] binary message + the JSON
``codec.frames`` header per chunk, as ``omni_stream/server/ws.py`` sends them) vs s16le PCM.

Run:  PYTHONPATH=. python benchmarks/tts/decoder_export_bench.py --model /tmp/ck-06b
Writes results/decoder_export_bench.json and .md. Cold: the exports take ~10-20 minutes on a
2-core machine (XNNPACK lowering and AOTInductor compile); warm: a couple of minutes.
"""

from __future__ import annotations

import argparse
import json
import logging
import os
import platform
import statistics
import sys
import time
from pathlib import Path

import torch

from omni_stream.evaluation.metrics import snr_db  # noqa: E402
from omni_stream.export.torch_program import export_program
from omni_stream.export.manifest import Manifest, ManifestError, codec_identity
from omni_stream.export.runtime_torch import load_program
from omni_stream.checkpoints.io import load_codec
from omni_stream.models.code2wav import Code2WavStream

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))  # for benchmarks.tts.machine
from benchmarks.tts.machine import machine_info, print_machine  # noqa: E402

log = logging.getLogger("decoder_export_bench")
FRAME_S = 0.08
RESULTS = Path(__file__).resolve().parent / "results"


def exported(model: Path, fmt: str, work: Path, max_chunk: int, sha: str) -> Manifest:
    """The cached export for this codec, or a fresh one."""
    out = work / fmt
    try:
        m = Manifest.read(out)
        m.check_files()
        if m.codec.codec_sha256 == sha and m.max_chunk_frames >= max_chunk:
            log.info("reusing %s", m.path)
            return m
    except ManifestError:
        pass
    t0 = time.perf_counter()
    m = export_program(model, fmt, out, max_chunk=max_chunk, overwrite=True)
    log.info("exported %s in %.0f s", fmt, time.perf_counter() - t0)
    return m


def time_calls(run, codes: torch.Tensor, chunk: int, warmup: int, calls: int) -> list[float]:
    """Seconds per call, decoding ``codes [1, 16, T]`` chunk by chunk from a fresh state."""
    ts, at = [], 0
    for i in range(warmup + calls):
        if at + chunk > codes.shape[2]:
            at = 0  # wrap: the state keeps going, positions keep growing (as in a long stream)
        x = codes[:, :, at:at + chunk].contiguous()
        t0 = time.perf_counter()
        run(x)
        if i >= warmup:
            ts.append(time.perf_counter() - t0)
        at += chunk
    return ts


def wire_bytes(chunk: int) -> dict:
    """Bytes on the WebSocket per second of audio at a steady chunk size."""
    header = json.dumps({"type": "codec.frames", "request_id": "ws-0123456789abcdef01234567",
                         "offset": 1234, "frames": chunk, "shape": [chunk, 16],
                         "dtype": "int64"}, separators=(",", ":"))
    codes = (chunk * 16 * 8 + len(header)) / (chunk * FRAME_S)
    pcm = 1920 * 2 / FRAME_S
    return dict(chunk=chunk, codes_bytes_per_s=round(codes), pcm_bytes_per_s=round(pcm),
                ratio=round(pcm / codes, 1))


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", default="/tmp/ck-06b")
    ap.add_argument("--formats", default="eager,pt2,aoti,pte")
    ap.add_argument("--chunks", default="1,4,8")
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--warmup", type=int, default=2)
    ap.add_argument("--calls", type=int, default=10)
    ap.add_argument("--max-chunk", type=int, default=32)
    ap.add_argument("--work", default="/tmp/decoder-export-bench")
    ap.add_argument("--out", default=str(RESULTS / "decoder_export_bench.json"))
    a = ap.parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(message)s")
    machine = machine_info()
    torch.set_num_threads(a.threads)
    model_dir, work = Path(a.model), Path(a.work)
    chunks = [int(c) for c in a.chunks.split(",")]
    formats = a.formats.split(",")
    ident = codec_identity(model_dir)
    model = load_codec(model_dir, dtype=torch.float32).eval()
    g = torch.Generator().manual_seed(0)
    codes = torch.randint(0, ident.codebook_size, (1, ident.num_codebooks, 64), generator=g)
    with torch.no_grad():
        ref = model(codes[:, :, :16])[0]

    rows, exports = [], {}
    for fmt in formats:
        if fmt == "eager":
            def make():
                with torch.inference_mode():
                    s = Code2WavStream(model, 1)

                def run(x):
                    with torch.inference_mode():
                        return s.decode([0], x)[0]
                return run
        else:
            m = exported(model_dir, fmt, work, a.max_chunk, ident.codec_sha256)
            fn = load_program(fmt, m.check_files(), threads=a.threads)
            exports[fmt] = dict(file=str(m.program_path), bytes=m.files[0].bytes,
                                verified_snr_db=m.verified.get("snr_db"))

            def make(fn=fn, m=m):
                state = [torch.zeros(s.shape, dtype=getattr(torch, s.dtype)) for s in m.state]

                def run(x):
                    nonlocal state
                    wav, state = fn(x, state)
                    return wav[0]
                return run
        # fidelity on this machine: 16 frames in ramp chunks vs the eager one-pass decode
        run = make()
        got = torch.cat([run(codes[:, :, a0:a0 + n].contiguous())
                         for a0, n in ((0, 1), (1, 2), (3, 4), (7, 8), (15, 1))])
        snr = snr_db(ref, got)
        for chunk in chunks:
            ts = time_calls(make(), codes, chunk, a.warmup, a.calls)
            med = statistics.median(ts)
            rows.append(dict(backend=fmt, chunk=chunk, ms_per_call=round(med * 1e3, 2),
                             ms_per_frame=round(med * 1e3 / chunk, 2),
                             rtf=round(med / (chunk * FRAME_S), 3),
                             snr_db_vs_one_pass=round(snr, 1)))
            log.info("%-5s chunk %d: %.1f ms/frame", fmt, chunk, med * 1e3 / chunk)

    wire = [wire_bytes(c) for c in (1, 4, 8)]
    from omni_stream.scheduling.fingerprint import fingerprint_info

    out = dict(benchmark="decoder_export_bench", command=" ".join([Path(sys.argv[0]).name, *(argv or sys.argv[1:])]),
               model=str(model_dir), model_size=ident.model_size, codec_sha256=ident.codec_sha256,
               threads=a.threads, dtype="float32", torch=torch.__version__,
               executorch=_version("executorch"), cpu=fingerprint_info(),
               arch=platform.machine(), machine=machine, load_avg_end=list(os.getloadavg()),
               exports=exports, rows=rows, wire=wire)
    Path(a.out).parent.mkdir(parents=True, exist_ok=True)
    Path(a.out).write_text(json.dumps(out, indent=2) + "\n")
    md = _markdown(out)
    Path(a.out).with_suffix(".md").write_text(md)
    print_machine(machine)
    print(md)
    return 0


def _version(name: str) -> str | None:
    from importlib.metadata import PackageNotFoundError, version

    try:
        return version(name)
    except PackageNotFoundError:
        return None


def _markdown(r: dict) -> str:
    lines = [f"# Client-side Code2Wav decode ({r['model_size']} codec, fp32, {r['threads']} thread)",
             "", f"`{r['command']}` (torch {r['torch']}, executorch {r['executorch']}, load at end "
             f"{', '.join(f'{x:.1f}' for x in r['load_avg_end'])})", "",
             f"Machine: {r['machine']['label']}", "",
             "| backend | chunk (frames) | ms / call | ms / frame | RTF | SNR vs one-pass (dB) |",
             "|---|---|---|---|---|---|"]
    for x in r["rows"]:
        lines.append(f"| {x['backend']} | {x['chunk']} | {x['ms_per_call']} | {x['ms_per_frame']} "
                     f"| {x['rtf']} | {x['snr_db_vs_one_pass']} |")
    lines += ["", "| chunk (frames) | codes B/s | PCM s16le B/s | PCM / codes |", "|---|---|---|---|"]
    for w in r["wire"]:
        lines.append(f"| {w['chunk']} | {w['codes_bytes_per_s']} | {w['pcm_bytes_per_s']} "
                     f"| {w['ratio']}x |")
    lines += ["", "Program files: " + ", ".join(f"{k} {v['bytes'] / 1e6:.0f} MB"
                                               for k, v in r["exports"].items()), ""]
    return "\n".join(lines)


if __name__ == "__main__":
    sys.exit(main())
