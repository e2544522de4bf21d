"""Client-side Code2Wav: each client decoder's audio against the server's, its per-frame decode
time, and wire bytes.

Side by side on the same checkpoint (default: the 0.6B-shaped random one), one CPU thread:
  eager       ``Code2WavStream`` fp32 (``--decoder-backend torch --decoder-dtype fp32``);
  torch-bf16  the codec stage's own bf16 decode (``codec_kernels.stage_kernels``: what
              ``--decoder-backend torch`` runs against a bf16 server, and what the server runs);
  pt2         the fp32 ExportedProgram of the streaming step (``torch.export.load(...).module()``);
  aoti        the same program compiled by AOTInductor for this CPU;
  pte         the ExecuTorch program with the XNNPACK delegate (``--decoder-backend executorch``).

Fidelity: every backend decodes the same 24 frames in ramp chunks; its samples are compared with
the two decodes a server sends for them: the default CPU server's (Code2Wav in bf16 with the
stage's kernels, oneDNN pinned as the stage pins it) and a ``--codec-dtype fp32`` server's (the
exact streamed decode). SNR in dB and the largest difference in s16 LSBs (the client's wav).

Speed: one stream from a fresh state in chunks of ``--chunks`` frames (1 = the first chunk of
the ramp, 4/8 = steady); the median wall time per call / frames per call, each backend in turn
for ``--rounds`` rounds (a fresh stream, ``--warmup`` calls, then ``--calls`` timed ones), so a
busy machine slows every backend alike; n = rounds x calls. Exports are cached under ``--work`` (reused when the manifest matches
the checkpoint's codec hash).

``--sensitivity`` measures why no fp32 program gets closer to the bf16 server than ~30 dB: the
server's own decode with one bf16 step added to one element of one state tensor mid-stream; the
server's decode with oneDNN capped at each lower ISA level this CPU has (a fresh process per
level: same rounding points, other accumulation orders); and an fp32 program that rounds to
bf16 exactly where the stage rounds (``bf16_emulation.py``).

Wire bytes per second of audio: codec frames (int64 [n, 16] binary message + the JSON
``codec.frames`` header per chunk, as ``omni_stream/server/ws.py`` sends them) vs s16le PCM.

Run:  PYTHONPATH=. python benchmarks/tts/decoder_export_bench.py --model /tmp/ck-06b --sensitivity
Writes results/decoder_export_bench.json and .md. Cold: the exports take ~10-20 minutes on a
2-core machine (XNNPACK lowering and AOTInductor compile); warm: a few minutes.
"""

from __future__ import annotations

import argparse
import json
import logging
import os
import platform
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from omni_stream.models.onednn import (DECODE_LEVEL, ENV, cpu_flags, pin_decode_isa,
                                           supported_levels)

ISA = pin_decode_isa()  # as the codec stage: before this process's first oneDNN call

import torch  # noqa: E402

from omni_stream.checkpoints.io import load_codec  # noqa: E402
from omni_stream.evaluation.metrics import snr_db  # noqa: E402
from omni_stream.export.manifest import Manifest, ManifestError, codec_identity  # noqa: E402
from omni_stream.export.runtime_torch import load_program  # noqa: E402
from omni_stream.export.torch_program import export_program  # noqa: E402
from omni_stream.models.code2wav import Code2WavStream  # noqa: E402
from omni_stream.stages.codec_kernels import stage_kernels  # noqa: E402

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))  # for benchmarks.tts.*
from benchmarks.tts.machine import machine_info, print_machine  # noqa: E402

log = logging.getLogger("decoder_export_bench")
FRAME_S = 0.08
RESULTS = Path(__file__).resolve().parent / "results"
PLAN = (1, 2, 4, 8, 3, 6)  # the fidelity decode's chunks: a ramp, then odd sizes (24 frames)
FORMATS = ("pt2", "aoti", "pte")


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


def stream_fn(model):
    """``make() -> run(codes [1, Q, n]) -> wav [n * spf]``: a fresh one-slot stream per make."""
    def make():
        with torch.inference_mode():
            s = Code2WavStream(model, 1)

        def run(x):
            with torch.inference_mode():
                return s.decode([0], x)[0].float()
        return run
    return make


def program_fn(fn, state0: list[torch.Tensor]):
    def make():
        state = [t.clone() for t in state0]

        def run(x):
            nonlocal state
            wav, state = fn(x, state)
            return wav[0].float()
        return run
    return make


def decode_plan(run, codes: torch.Tensor, plan=PLAN) -> torch.Tensor:
    out, at = [], 0
    for n in plan:
        out.append(run(codes[:, :, at:at + n].contiguous()))
        at += n
    return torch.cat(out)


def compare(ref: torch.Tensor, got: torch.Tensor) -> dict:
    """SNR (dB) and the largest difference in s16 LSBs (the client's wav: x * 32767, rounded)."""
    lsb = (torch.round(ref.double() * 32767) - torch.round(got.double() * 32767)).abs().max()
    snr = snr_db(ref, got)
    return dict(snr_db=round(snr, 1) if snr != float("inf") else "inf", max_lsb=int(lsb))


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


# ---------------------------------------------------------------- why ~30 dB: the sensitivity


def nudged(model, codes: torch.Tensor, which: str, at_frame: int = 8) -> torch.Tensor:
    """The server's bf16 decode of ``codes`` in 8-frame chunks, with the newest element of the
    state tensor ``which`` (``tail<i>``: its last sample of its last channel; ``keys<i>``: the
    last frame's key, last head, last dim) moved by one bf16 step before frame ``at_frame``."""
    kind, i = which.rstrip("0123456789"), int(which[len(which.rstrip("0123456789")):])
    with torch.inference_mode():
        s, out = Code2WavStream(model, 1), []
        for a in range(0, codes.shape[2], 8):
            if a == at_frame:
                t = {"tail": s.state.tails, "keys": s.state.keys}[kind][i]
                t.view(-1)[-1:].view(torch.int16).add_(1)
            out.append(s.decode([0], codes[:, :, a:a + 8])[0].float())
    return torch.cat(out)


def isa_decodes(model_dir: Path, codes_path: Path) -> list[dict]:
    """The server's bf16 decode under each oneDNN ISA cap below the stage's level (a fresh
    process each: oneDNN reads the cap once), saved beside ``codes_path``."""
    out = []
    levels = supported_levels(cpu_flags())
    for level in levels[:levels.index(DECODE_LEVEL) if DECODE_LEVEL in levels else 0][::-1][:3]:
        dst = codes_path.with_name(f"isa-{level}.pt")
        env = {**os.environ, ENV: level, "PYTHONPATH": str(Path(__file__).resolve().parents[2])}
        r = subprocess.run([sys.executable, __file__, "--model", str(model_dir),
                            "--decode-server", str(codes_path), str(dst)], env=env,
                           capture_output=True, text=True, timeout=1800)
        if r.returncode != 0:
            out.append(dict(level=level, error=r.stderr.strip().splitlines()[-1:]))
            continue
        out.append(dict(level=level, **json.loads(r.stdout.strip().splitlines()[-1]), path=dst))
    return out


def decode_server_child(model_dir: str, codes_path: str, dst: str) -> None:
    """Child of ``isa_decodes``: the bf16 stage decode of the saved codes under this process's
    ISA cap; prints its level and whether the weights were packed."""
    torch.set_num_threads(1)
    model = stage_kernels(load_codec(model_dir, dtype=torch.bfloat16).eval())
    codes = torch.load(codes_path)
    torch.save(decode_plan(stream_fn(model)(), codes), dst)
    print(json.dumps(dict(packed=bool(getattr(model, "packed", False)), isa=ISA)))


def sensitivity(model_dir: Path, server_bf16, codes: torch.Tensor, ref: torch.Tensor,
                max_chunk: int) -> dict:
    from benchmarks.tts.bf16_emulation import emulated_step

    res: dict = {"nudge": [], "isa": [], "emulation": {}}
    base = nudged(server_bf16, codes, "tail0", at_frame=10 ** 9)  # no nudge: 8-frame chunks
    after = slice(8 * 1920, None)
    n_tails, n_layers = len(server_bf16._tail_shapes), server_bf16.cfg.num_hidden_layers
    st = server_bf16.new_state(1)
    for which in ("tail0", f"keys{n_layers // 2}", f"tail{n_tails // 2}", f"tail{n_tails - 1}"):
        kind, i = which.rstrip("0123456789"), int(which[len(which.rstrip("0123456789")):])
        shape = tuple({"tail": st.tails, "keys": st.keys}[kind][i].shape[1:])
        got = nudged(server_bf16, codes, which)
        res["nudge"].append(dict(state=which, shape=list(shape),
                                 **compare(base[after], got[after])))
        log.info("one bf16 step at %s: %s", which, res["nudge"][-1])
    with tempfile.TemporaryDirectory() as tmp:
        cp = Path(tmp) / "codes.pt"
        torch.save(codes, cp)
        for r in isa_decodes(model_dir, cp):
            path = r.pop("path", None)
            if path is not None:
                r.update(compare(ref, torch.load(path)))
            res["isa"].append(r)
            log.info("oneDNN at %s: %s", r["level"], r)
    t0 = time.perf_counter()
    emu = emulated_step(load_codec(model_dir, dtype=torch.bfloat16).eval(), max_chunk)
    state0 = [s.float() if s.dtype == torch.bfloat16 else s for s in _state0(server_bf16)]
    got = decode_plan(program_fn(emu, state0)(), codes)
    res["emulation"] = dict(**compare(ref, got), bf16_exact=bool(torch.equal(
        got, got.bfloat16().float())), built_s=round(time.perf_counter() - t0, 1))
    log.info("fp32 program rounding where the stage rounds: %s", res["emulation"])
    return res


def _state0(model) -> list[torch.Tensor]:
    from omni_stream.export.code2wav_step import initial_state

    return initial_state(model)


# ---------------------------------------------------------------- main


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", default="/tmp/ck-06b")
    ap.add_argument("--formats", default="eager,torch-bf16,pt2,aoti,pte")
    ap.add_argument("--chunks", default="1,4,8")
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--warmup", type=int, default=2)
    ap.add_argument("--calls", type=int, default=2, help="timed calls per backend and round")
    ap.add_argument("--rounds", type=int, default=5,
                    help="rounds over all backends (a fresh stream each): n = rounds x calls")
    ap.add_argument("--max-chunk", type=int, default=32)
    ap.add_argument("--work", default="/tmp/decoder-export-bench")
    ap.add_argument("--sensitivity", action="store_true",
                    help="also measure how far any change of rounding moves the bf16 decode")
    ap.add_argument("--decode-server", nargs=2, metavar=("CODES", "OUT"), help=argparse.SUPPRESS)
    ap.add_argument("--out", default=str(RESULTS / "decoder_export_bench.json"))
    a = ap.parse_args(argv)
    if a.decode_server:
        decode_server_child(a.model, *a.decode_server)
        return 0
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(message)s")
    machine = machine_info()
    torch.set_num_threads(a.threads)
    model_dir, work = Path(a.model), Path(a.work)
    chunks = [int(c) for c in a.chunks.split(",")]
    formats = a.formats.split(",")
    ident = codec_identity(model_dir)
    model = load_codec(model_dir, dtype=torch.float32).eval()
    server_bf16 = stage_kernels(load_codec(model_dir, dtype=torch.bfloat16).eval())
    g = torch.Generator().manual_seed(0)
    codes = torch.randint(0, ident.codebook_size, (1, ident.num_codebooks, 64), generator=g)
    fid_codes = codes[:, :, :sum(PLAN)]
    refs = {"server_bf16": decode_plan(stream_fn(server_bf16)(), fid_codes),
            "server_fp32": decode_plan(stream_fn(model)(), fid_codes)}

    rows, fidelity, exports, makers = [], [], {}, {}
    for fmt in formats:
        if fmt == "eager":
            make = stream_fn(model)
        elif fmt == "torch-bf16":  # a model of its own, as a client's TorchDecoder builds it
            make = stream_fn(stage_kernels(load_codec(model_dir, dtype=torch.bfloat16).eval()))
        elif fmt in FORMATS:
            m = exported(model_dir, fmt, work, a.max_chunk, ident.codec_sha256)
            fn = load_program(fmt, m.check_files(), threads=a.threads)
            exports[fmt] = dict(file=str(m.program_path), bytes=m.files[0].bytes,
                                verified_snr_db=m.verified.get("snr_db"))
            make = program_fn(fn, [torch.zeros(s.shape, dtype=getattr(torch, s.dtype))
                                   for s in m.state])
        else:
            raise SystemExit(f"unknown backend {fmt!r}: eager, torch-bf16, {', '.join(FORMATS)}")
        got = decode_plan(make(), fid_codes)
        fidelity.append(dict(backend=fmt, **{f"vs_{k}": compare(r, got) for k, r in refs.items()}))
        log.info("%-10s vs server: %s", fmt, fidelity[-1])
        makers[fmt] = make
    # rounds over all backends, so that what else runs on the machine meets each alike
    times: dict[tuple[str, int], list[float]] = {(f, c): [] for f in makers for c in chunks}
    for _ in range(a.rounds):
        for fmt, make in makers.items():
            for chunk in chunks:
                times[fmt, chunk] += time_calls(make(), codes, chunk, a.warmup, a.calls)
    for (fmt, chunk), ts in times.items():
        med = statistics.median(ts)
        rows.append(dict(backend=fmt, chunk=chunk, n=len(ts), ms_per_call=round(med * 1e3, 2),
                         ms_per_frame=round(med * 1e3 / chunk, 2),
                         rtf=round(med / (chunk * FRAME_S), 3)))
        log.info("%-10s chunk %d: %.1f ms/frame", fmt, chunk, med * 1e3 / chunk)

    sens = (sensitivity(model_dir, server_bf16, fid_codes, refs["server_bf16"], a.max_chunk)
            if a.sensitivity else None)
    wire = [wire_bytes(c) for c in (1, 4, 8)]
    from omni_stream.scheduling.fingerprint import fingerprint_info

    out = dict(benchmark="decoder_export_bench",
               command=" ".join([Path(sys.argv[0]).name, *(argv or sys.argv[1:])]),
               model=str(model_dir), model_size=ident.model_size, codec_sha256=ident.codec_sha256,
               threads=a.threads, rounds=a.rounds, calls_per_round=a.calls, onednn_isa=ISA,
               torch=torch.__version__,
               executorch=_version("executorch"), cpu=fingerprint_info(),
               arch=platform.machine(), machine=machine, load_avg_end=list(os.getloadavg()),
               fidelity_plan=list(PLAN), exports=exports, fidelity=fidelity, rows=rows,
               sensitivity=sens, wire=wire)
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
    lines = [f"# Client-side Code2Wav decode ({r['model_size']} codec, {r['threads']} thread)",
             "", f"`{r['command']}` (torch {r['torch']}, executorch {r['executorch']}, oneDNN at "
             f"{r['onednn_isa']}, load at end {', '.join(f'{x:.1f}' for x in r['load_avg_end'])})",
             "", f"Machine: {r['machine']['label']}", "",
             f"## Against the server ({sum(r['fidelity_plan'])} frames in chunks "
             f"{r['fidelity_plan']})", "",
             "| client backend | vs default CPU server (bf16): SNR dB / max LSB "
             "| vs `--codec-dtype fp32` server: SNR dB / max LSB |", "|---|---|---|"]
    for f in r["fidelity"]:
        b, e = f["vs_server_bf16"], f["vs_server_fp32"]
        lines.append(f"| {f['backend']} | {b['snr_db']} / {b['max_lsb']} "
                     f"| {e['snr_db']} / {e['max_lsb']} |")
    lines += ["", "eager: `--decoder-backend torch --decoder-dtype fp32`; torch-bf16: "
              "`--decoder-backend torch` against a bf16 server (the codec stage's kernels); pt2, "
              "aoti, pte: the exported fp32 programs (aoti compiles the pt2 program)."]
    s = r.get("sensitivity")
    if s:
        lines += ["", "## Why no fp32 program gets closer to the bf16 server", "",
                  "| change to the server's own bf16 decode | SNR dB / max LSB vs unchanged |",
                  "|---|---|"]
        for x in s["nudge"]:
            lines.append(f"| one bf16 step at the newest element of `{x['state']}` "
                         f"{tuple(x['shape'])} before frame 8 (audio from there) "
                         f"| {x['snr_db']} / {x['max_lsb']} |")
        for x in s["isa"]:
            got = (f"{x['snr_db']} / {x['max_lsb']}" if "snr_db" in x else f"failed: {x['error']}")
            lines.append(f"| oneDNN capped at {x['level']} (packed: {x.get('packed')}) | {got} |")
        e = s["emulation"]
        lines.append(f"| fp32 program rounding to bf16 where the stage rounds | "
                     f"{e['snr_db']} / {e['max_lsb']} |")
        lines += ["", "A changed rounding that moves no later rounding vanishes (inf); one that "
                  "does spreads through every later bf16 rounding to about the distance of any "
                  "other bf16 decode (~30 dB), so only the stage's own kernels give its samples."]
    lines += ["", "## Decode time (one stream, fresh state)", "",
              "| backend | chunk (frames) | n | ms / call (median) | ms / frame | RTF |",
              "|---|---|---|---|---|---|"]
    for x in r["rows"]:
        lines.append(f"| {x['backend']} | {x['chunk']} | {x['n']} | {x['ms_per_call']} "
                     f"| {x['ms_per_frame']} | {x['rtf']} |")
    lines += ["", "| chunk (frames) | codes B/s | PCM s16le B/s | PCM / codes |", "|---|---|---|---|"]
    for w in r["wire"]:
        lines.append(f"| {w['chunk']} | {w['codes_bytes_per_s']} | {w['pcm_bytes_per_s']} "
                     f"| {w['ratio']}x |")
    lines += ["", "Program files: " + ", ".join(f"{k} {v['bytes'] / 1e6:.0f} MB"
                                               for k, v in r["exports"].items()), ""]
    return "\n".join(lines)


if __name__ == "__main__":
    sys.exit(main())
