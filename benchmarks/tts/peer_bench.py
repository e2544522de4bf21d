"""omni-stream beside the other CPU implementations of Qwen3-TTS, on the same random checkpoint.

Peers (pinned, each in its own virtualenv under ~/.cache/omni-stream/peers/, benchmarks/tts/peers/):
  vox       vox-tts 0.19.5 (C++ engine), its own converter: python -m vox build --dtype --quant
  qwentts   realtimetts-qwen-native-cpu 0.4.2 (qwentts.cpp on GGML), GGUF files written by
            peers/gguf_convert.py (upstream convert.py's names and keys; Q8_0 / Q4_K_M / BF16 / F32)
omni-stream: cpu_engine_bench's worker (talker step + code predictor's 15 sub-steps per frame,
batch 1) and weight_path_bench's streaming Code2Wav timing (4-frame chunks).

Precisions matched: 8-bit (omni native-int8, vox q8, Q8_0), 4-bit (native-int4, vox q4full,
Q4_K_M), bf16 (torch bf16, vox bf16, BF16), fp32 (native-f32, vox f32, F32). Each measurement is a
fresh process; rounds are interleaved (every implementation and precision once per round, the
order rotated), and the table gives medians with n. Per frame: talker and code predictor as each
implementation's own counters report them (omni-stream: timed around its step functions; vox:
Engine.stats(); qwentts.cpp: its [Perf] log), and the codec per frame (omni-stream: streaming,
4-frame chunks; vox: streaming, 4-frame chunks; qwentts.cpp: one pass over the utterance).

Fidelity: greedy decoding of the same prompt against omni-stream's exact fp32 torch path over the
first --fidelity-frames frames. qwentts.cpp dumps its codes: the fraction of the 16 x F codes
equal to the reference's, and the frames before the first difference. vox gives no codes, only
audio: it runs the text-streaming prompt (one text token per step), so its audio is compared
with the reference's text-streaming audio through the same exact codec, frame by frame; a frame
counts as matching at >= 40 dB (equal codes give ~115 dB, any changed code ~0 dB).

    python benchmarks/tts/peer_bench.py --model CK          # CK: omni-stream make-checkpoint --preset 0.6b
    python benchmarks/tts/peer_bench.py --model CK --isa avx2 --precisions 8-bit,4-bit \
        --out benchmarks/tts/results/peer_bench_avx2.json   # this machine as an AVX2-only x86-64

``--isa LEVEL`` runs the whole benchmark with harness.ISA_ENV[LEVEL] set (omni-stream's kernels
capped at that level, torch / oneDNN / MKL alike; the peers' wheels are AVX2 builds either way)
and names the level beside the machine in the report.

Writes benchmarks/tts/results/peer_bench.{json,md}. The machine's read bandwidth is measured at
the start (machine.py) and printed beside the table: on a shared 2-core machine the figures are
noisy; read the medians and n, not single runs.
"""

from __future__ import annotations

import argparse
import hashlib
import json
import logging
import os
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[2]
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))

from benchmarks.tts.machine import machine_info, print_machine
from benchmarks.tts.peers.report import (MATCH_DB, PRECISIONS, TEXT, aggregate,
                                        bits_per_weight, fmt_ms, markdown, print_table)
from benchmarks.tts.peers.setup import PEERS, ensure_venv, peer_root

log = logging.getLogger("peer_bench")
RESULTS = ROOT / "benchmarks" / "tts" / "results"
OMNI_PATHS = {"8-bit": "native-int8", "4-bit": "native-int4", "bf16": "torch-bf16", "fp32": "native-f32"}
QWENTTS_QUANTS = {"8-bit": "Q8_0", "4-bit": "Q4_K_M", "bf16": "BF16", "fp32": "F32"}


# --------------------------------------------------------------------------- preparation
def checkpoint_key(ck: Path) -> str:
    """Folder name + a hash of its configs and weight files' sizes and mtimes: conversions of
    an unchanged checkpoint are reused from the cache."""
    h = hashlib.sha256()
    for p in sorted([*ck.glob("*.json"), *ck.glob("**/*.safetensors"), *ck.glob("speech_tokenizer/*.json")]):
        st = p.stat()
        h.update(f"{p.relative_to(ck)}:{st.st_size}:{int(st.st_mtime)}\n".encode())
    return f"{ck.name}-{h.hexdigest()[:10]}"


def convert_vox(py: Path, ck: Path, out_dir: Path, precision: str) -> Path:
    from benchmarks.tts.peers.vox_build import vox_build_command

    out = out_dir / f"vox-{precision}.tmod"
    if not out.exists():
        tmp = out.with_suffix(".partial")
        r = subprocess.run(vox_build_command(py, ck, tmp, precision), capture_output=True, text=True)
        if r.returncode:
            raise RuntimeError(f"vox build failed: {r.stderr.strip()[-600:]}")
        tmp.rename(out)
    return out


def convert_qwentts(py: Path, ck: Path, out_dir: Path, precision: str) -> tuple[Path, Path]:
    from benchmarks.tts.peers.gguf_convert import (
        GgmlQuantizer,
        write_codec_gguf,
        write_talker_gguf,
    )

    q = QWENTTS_QUANTS[precision]
    talker, codec = out_dir / f"qwentts-talker-{q}.gguf", out_dir / f"qwentts-codec-{q}.gguf"
    lib = next(py.parent.parent.glob("lib/python*/site-packages/qwentts_cpp_cpu/lib/libggml-base.so*"), None)
    quantizer = GgmlQuantizer(lib) if lib is not None else None
    for path, write in ((talker, write_talker_gguf), (codec, write_codec_gguf)):
        if not path.exists():
            tmp = path.with_suffix(".partial")
            write(ck, tmp, q, quantizer)
            tmp.rename(path)
    return talker, codec


# --------------------------------------------------------------------------- one run
def run_omni(ck: Path, precision: str, threads: int, frames: int, timeout: int) -> dict:
    cmd = [sys.executable, str(ROOT / "benchmarks" / "tts" / "cpu_engine_bench.py"), "--worker",
           "--model", str(ck), "--path", OMNI_PATHS[precision], "--threads-one", str(threads),
           "--frames", str(frames), "--batches", "1", "--codec-chunk", "4"]
    r = subprocess.run(cmd, capture_output=True, text=True, timeout=timeout)
    if r.returncode:
        raise RuntimeError(f"exit {r.returncode}: {failure_reason(r.stderr)}")
    row = json.loads(r.stdout.strip().splitlines()[-1])
    return dict(talker_ms=row["talker_ms_b1"], cp_ms=row["cp_frame_ms_b1"],
                codec_ms=row.get("codec_ms_per_frame"), weight_bytes_per_frame=row["weight_bytes_per_frame"],
                codec_mode=f"streaming, 4-frame chunks, {row.get('codec_dtype')}")


def native_kernels() -> str | None:
    """What omni-stream's native runtime runs here (its library's own report), in a child so
    this process loads no kernel."""
    code = ("from omni_stream.engine.cpu.abi import library; "
            "from omni_stream.engine.cpu.build import kernels; print(kernels(library()))")
    r = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, cwd=ROOT)
    return r.stdout.strip() or None if r.returncode == 0 else None


def failure_reason(stderr: str) -> str:
    """The lines of a failed run that say why (an assertion, the exception), not a backtrace."""
    lines = [ln.strip() for ln in stderr.splitlines() if ln.strip()]
    for key in ("GGML_ASSERT", "FATAL", "Error:", "Error ", "error:"):
        hit = [ln for ln in lines if key in ln]
        if hit:
            return hit[-1][-600:]
    return "\n".join(lines[-3:])[-600:] or "no output"


def run_peer(name: str, py: Path, model: Any, precision: str, threads: int, frames: int,
             out: Path, timeout: int) -> dict:
    cmd = [str(py), str(ROOT / "benchmarks" / "tts" / "peers" / "worker.py"), "--peer", name,
           "--threads", str(threads), "--frames", str(frames), "--text", TEXT, "--out", str(out)]
    cmd += (["--model", str(model[0]), "--codec", str(model[1])] if name == "qwentts"
            else ["--model", str(model)])
    env = dict(os.environ, GGML_NO_BACKTRACE="1")  # an abort says why, without a gdb dump
    r = subprocess.run(cmd, capture_output=True, text=True, timeout=timeout, env=env)
    if r.returncode:
        raise RuntimeError(f"exit {r.returncode}: {failure_reason(r.stderr or r.stdout)}")
    return json.loads(r.stdout.strip().splitlines()[-1])


# --------------------------------------------------------------------------- fidelity
def fidelity(ck: Path, frames: int, runs_dir: Path, impls: list[str], threads: int) -> list[dict]:
    """Greedy codes / audio of every implementation and precision against torch fp32."""
    import numpy as np
    import torch

    from omni_stream.engine.sampling import SamplingParams
    from omni_stream.engine.synthesis import Synthesizer
    from omni_stream.evaluation.fidelity import load_path
    from omni_stream.models.prompt import PromptRequest

    torch.set_num_threads(threads)
    req = PromptRequest(text=TEXT, language="english", speaker="ryan")
    req_st = PromptRequest(text=TEXT, language="english", speaker="ryan", stream_text=True)
    ref = Synthesizer.from_path(str(ck), torch.float32)
    ref_codes, _, _ = ref.generate_codes(req, SamplingParams.greedy(), 0, frames)
    ref_audio_st = ref.synthesize(req_st, SamplingParams.greedy(), 0, frames).audio
    spf = ref.model.code2wav.samples_per_frame
    rows = []

    def codes_row(impl: str, prec: str, codes: np.ndarray) -> dict:
        n = min(len(codes), len(ref_codes))
        eq = codes[:n] == ref_codes[:n]
        diff = np.flatnonzero(~eq.all(axis=1))
        return dict(impl=impl, precision=prec, compared="codes", frames=n,
                    code_match=float(eq.mean()) if n else None,
                    code0_match=float(eq[:, 0].mean()) if n else None,
                    frames_before_first_difference=int(diff[0]) if len(diff) else n)

    for prec in PRECISIONS:
        if "omni-stream" in impls:
            engine, wp = OMNI_PATHS[prec].split("-")
            wp = {"f32": "fp32"}.get(wp, wp)
            try:  # as the server builds the path: fp32 weights compute in fp32, the others in bf16
                s = load_path(str(ck), wp, engine, threads, max_seq_len=512)
                c, _, _ = s.generate_codes(req, SamplingParams.greedy(), 0, frames)
                rows.append(codes_row("omni-stream", prec, c))
                del s
            except Exception as e:  # a failed path is a row that says why
                rows.append(dict(impl="omni-stream", precision=prec, error=f"{type(e).__name__}: {e}"))
        qdir = runs_dir / f"qwentts-{prec}-t1-r0"
        if "qwentts" in impls:
            if (qdir / "codes.npy").exists():
                rows.append(codes_row("qwentts", prec, np.load(qdir / "codes.npy")))
            else:
                rows.append(dict(impl="qwentts", precision=prec, error="no codes: its timed run failed"))
        vdir = runs_dir / f"vox-{prec}-t1-r0"
        if "vox" in impls:
            if (vdir / "audio.npy").exists():
                a = np.load(vdir / "audio.npy")
                n = min(len(a), len(ref_audio_st)) // spf
                snr = []
                for f in range(n):
                    x, y = ref_audio_st[f * spf:(f + 1) * spf], a[f * spf:(f + 1) * spf]
                    snr.append(float(10 * np.log10((x ** 2).sum() / max(((x - y) ** 2).sum(), 1e-30))))
                ok = [s >= MATCH_DB for s in snr]
                rows.append(dict(impl="vox", precision=prec, compared="audio, text-streaming prompt",
                                 frames=n, frame_match=float(np.mean(ok)) if n else None,
                                 frames_before_first_difference=ok.index(False) if False in ok else n,
                                 frame_snr_db=[round(s, 1) for s in snr]))
            else:
                rows.append(dict(impl="vox", precision=prec, error="no audio: its timed run failed"))
    return rows


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", help="a released-layout checkpoint folder (make-checkpoint --preset 0.6b)")
    ap.add_argument("--peers", default="vox,qwentts")
    ap.add_argument("--precisions", default=",".join(PRECISIONS))
    ap.add_argument("--threads", default="1,2")
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--frames", type=int, default=24)
    ap.add_argument("--fidelity-frames", type=int, default=16)
    ap.add_argument("--timeout", type=int, default=600, help="seconds per run")
    ap.add_argument("--no-omni", action="store_true", help="peers only")
    ap.add_argument("--isa", default=None, help="run as a machine of this native kernel level "
                    "(harness.ISA_ENV: avx2, avx512, scalar)")
    ap.add_argument("--out", default=str(RESULTS / "peer_bench.json"))
    ap.add_argument("--report", action="store_true", help="re-render --out's .md and table from its JSON")
    ap.add_argument("--fidelity-only", action="store_true",
                    help="recompute --out's fidelity rows from its runs' folder (--runs-dir), keep its timings")
    ap.add_argument("--runs-dir", default=None, help="with --fidelity-only: the timed runs' folder")
    a = ap.parse_args()
    if a.report or a.fidelity_only:
        doc = json.loads(Path(a.out).read_text())
        if a.fidelity_only:  # the timed runs' codes and audio are still in their folder
            runs_dir = Path(a.runs_dir or doc["runs_dir"])
            impls = list(dict.fromkeys(r["impl"] for r in doc["rows"]))
            doc["fidelity"] = fidelity(Path(doc["model"]), doc["fidelity_frames"], runs_dir, impls,
                                       max(int(t) for t in doc["bandwidth_gbs_by_threads"]))
            doc["runs_dir"] = str(runs_dir)
            doc["fidelity_command"] = "python benchmarks/tts/peer_bench.py " + " ".join(sys.argv[1:])
            Path(a.out).write_text(json.dumps(doc, indent=1))
        Path(a.out).with_suffix(".md").write_text(markdown(doc))
        print_table(doc)
        return 0
    if a.isa:
        from benchmarks.tts.harness import ISA_ENV

        if a.isa not in ISA_ENV:
            ap.error(f"--isa: {a.isa!r} is not one of {', '.join(ISA_ENV)}")
        os.environ.update(ISA_ENV[a.isa])  # before this process or a child loads a kernel
    logging.basicConfig(level=logging.INFO, format="%(message)s")
    logging.getLogger("gguf").setLevel(logging.WARNING)  # its writer logs every file it opens
    if not a.model:
        ap.error("--model is required (a checkpoint folder), except with --report / --fidelity-only")
    ck = Path(a.model).resolve()
    precs = [p for p in a.precisions.split(",") if p]
    for p in precs:
        if p not in PRECISIONS:
            ap.error(f"--precisions: {p!r} is not one of {', '.join(PRECISIONS)}")
    threads = [int(t) for t in a.threads.split(",")]
    machine = machine_info()
    print_machine(machine)
    work = peer_root() / "models" / checkpoint_key(ck)
    work.mkdir(parents=True, exist_ok=True)
    runs_dir = peer_root() / "runs" / time.strftime("%Y%m%d-%H%M%S")

    impls = ([] if a.no_omni else ["omni-stream"]) + [p for p in a.peers.split(",") if p]
    pythons: dict[str, Path] = {}
    models: dict[tuple[str, str], Any] = {}
    setup_errors: dict[tuple[str, str], str] = {}
    for name in impls[1 if not a.no_omni else 0:]:
        try:
            pythons[name] = ensure_venv(PEERS[name])
        except Exception as e:
            for p in precs:
                setup_errors[(name, p)] = f"install: {type(e).__name__}: {e}"
            continue
        for p in precs:
            t0 = time.perf_counter()
            try:
                models[(name, p)] = (convert_vox if name == "vox" else convert_qwentts)(pythons[name], ck, work, p)
                log.info("%s %s: converted (%.0f s)", name, p, time.perf_counter() - t0)
            except Exception as e:
                setup_errors[(name, p)] = f"convert: {type(e).__name__}: {e}"
                log.info("%s %s: conversion failed: %s", name, p, e)

    runs: list[dict] = []
    for rnd in range(a.rounds):
        for th in threads:
            for p in precs:
                k = rnd % len(impls)
                for impl in impls[k:] + impls[:k]:  # the order rotates each round
                    row: dict[str, Any] = dict(impl=impl, precision=p, threads=th, round=rnd)
                    try:
                        if (impl, p) in setup_errors:
                            raise RuntimeError(setup_errors[(impl, p)])
                        if impl == "omni-stream":
                            row.update(run_omni(ck, p, th, a.frames, a.timeout))
                        else:
                            out = runs_dir / f"{impl}-{p}-t{th}-r{rnd}"
                            row.update(run_peer(impl, pythons[impl], models[(impl, p)], p, th, a.frames,
                                                out, a.timeout))
                        log.info("round %d %-11s %-5s %d thr: talker %.1f + cp %.1f ms/frame, codec %s",
                                 rnd, impl, p, th, row["talker_ms"], row["cp_ms"], fmt_ms(row.get("codec_ms")))
                    except Exception as e:
                        row["error"] = f"{type(e).__name__}: {e}"
                        log.info("round %d %-11s %-5s %d thr: FAILED %s", rnd, impl, p, th, row["error"][:300])
                    runs.append(row)
    machine_end = machine_info()  # the bandwidth after the runs: a shared machine moves
    rows = aggregate(runs)
    bits_per_weight(rows)
    fid = fidelity(ck, a.fidelity_frames, runs_dir, impls, max(threads))
    bw = {str(t): machine.get("bandwidth_gbs_1_thread") if t == 1 else machine.get("bandwidth_gbs") for t in threads}
    doc = dict(model=str(ck), text=TEXT, isa=a.isa, native_kernels=native_kernels(), rounds=a.rounds, frames=a.frames,
               fidelity_frames=a.fidelity_frames, machine=machine, machine_end=machine_end,
               bandwidth_gbs_by_threads=bw,
               peers={k: dict(package=v.package, version=v.version) for k, v in PEERS.items() if k in impls},
               omni_paths=OMNI_PATHS, qwentts_quants=QWENTTS_QUANTS,
               command="python benchmarks/tts/peer_bench.py " + " ".join(sys.argv[1:]),
               runs_dir=str(runs_dir), rows=rows, fidelity=fid, runs=runs)
    out = Path(a.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(doc, indent=1))
    out.with_suffix(".md").write_text(markdown(doc))
    print_table(doc)
    print(f"wrote {out} and {out.with_suffix('.md').name}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
