"""``omni-stream`` command line: make-checkpoint, synthesize (and serve, profile, stats...)."""

from __future__ import annotations

import argparse
import logging
import sys
import time

from omni_stream.checkpoints.default import add_model_argument
from omni_stream.config import ENGINES, LOW_BIT_WEIGHT_PATHS, WEIGHT_PATHS
from omni_stream.orchestrator.flags import (BANDWIDTH_ENV, DTYPES, SERVE_PROFILE_FLAGS,  # noqa: F401
                                            _model_bytes, _prod, _weight_path_pricing,
                                            _with_calibration, effective_profile,
                                            format_native_kernels, native_kernels_report,
                                            pipeline_settings)

log = logging.getLogger("omni_stream")



def _dtype(name: str):
    import torch

    if name not in DTYPES:
        raise SystemExit(f"unknown dtype '{name}': use fp32 or bf16")
    return getattr(torch, DTYPES[name])


def cmd_make_checkpoint(a: argparse.Namespace) -> int:
    from omni_stream.checkpoints.io import OUTLIERS_FILE, STUDENT_T_DF, write_random_checkpoint

    t0 = time.perf_counter()
    out = write_random_checkpoint(a.out, a.preset, a.variant, seed=a.seed, dtype=_dtype(a.dtype),
                                  talker_layers=a.talker_layers, cp_layers=a.cp_layers,
                                  outliers=a.outliers)
    print(f"wrote {a.preset} {a.variant} checkpoint (seed {a.seed}) to {out} "
          f"in {time.perf_counter() - t0:.1f} s")
    if a.outliers:
        print(f"with outliers: Student-t(df={STUDENT_T_DF}) decoder weights and massive-activation "
              f"channels, listed in {out / OUTLIERS_FILE}")
    return 0


def _clone_from_args(a: argparse.Namespace, variant: str):
    """The VoiceClone of ``--ref-audio`` (None without it); SystemExit naming the fix."""
    if a.ref_audio is None:
        if a.ref_text or a.x_vector_only:
            raise SystemExit("omni-stream synthesize: --ref-text / --x-vector-only go with "
                             "--ref-audio FILE")
        return None
    if variant != "base":
        raise SystemExit(f"omni-stream synthesize: a {variant} checkpoint cannot clone voices: "
                         "use a Base checkpoint")
    if not a.x_vector_only and not (a.ref_text or "").strip():
        raise SystemExit("omni-stream synthesize: --ref-audio needs --ref-text (its transcript) "
                         "for ICL cloning, or --x-vector-only")
    from pathlib import Path

    from omni_stream.checkpoints.default import resolve_model_path
    from omni_stream.errors import RequestError
    from omni_stream.voices.audio import decode_audio
    from omni_stream.voices.encode import VoiceEncoder

    try:
        wav, sr = decode_audio(Path(a.ref_audio).read_bytes(), param="--ref-audio")
    except (OSError, RequestError) as e:
        raise SystemExit(f"omni-stream synthesize: --ref-audio {a.ref_audio}: {e}") from None
    return VoiceEncoder(resolve_model_path(a.model)).encode(
        wav, sr, ref_text=None if a.x_vector_only else a.ref_text, x_vector_only=a.x_vector_only)


def cmd_synthesize(a: argparse.Namespace) -> int:
    import numpy as np
    import soundfile as sf
    import torch

    from omni_stream.models.prompt import PromptRequest
    from omni_stream.engine.sampling import SamplingParams
    from omni_stream.engine.synthesis import Synthesizer

    torch.set_num_threads(a.threads) if a.threads else None
    dtype = torch.bfloat16 if a.weight_path in LOW_BIT_WEIGHT_PATHS else _dtype(a.dtype)
    synth = Synthesizer.from_path(a.model, dtype=dtype, weight_path=a.weight_path, engine=a.engine)
    if a.compile:
        from omni_stream.engine.compiled import compile_engine, compile_stats, warm_up

        compile_engine(synth.engine)
        took = warm_up(synth.engine)
        print(f"compiled decoder steps in {took:.1f} s: {compile_stats()}")
    clone = _clone_from_args(a, synth.model.config.variant)
    req = PromptRequest(text=a.text, language=a.language, speaker=a.voice,
                        instructions=a.instructions, clone=clone,
                        # the official clone path streams the text
                        stream_text=a.stream_text or clone is not None)
    params = SamplingParams.greedy() if a.greedy else SamplingParams()
    t0 = time.perf_counter()
    res = synth.synthesize(req, params, seed=a.seed, max_frames=a.max_frames)
    dt = time.perf_counter() - t0
    sr = synth.model.config.code2wav.sample_rate
    if a.out:
        sf.write(a.out, res.audio, sr, subtype="PCM_16")
    if a.codes_out:
        np.save(a.codes_out, res.codes)
    secs = len(res.audio) / sr
    print(f"{len(res.codes)} frames, {secs:.2f} s of audio in {dt:.2f} s (RTF {dt / max(secs, 1e-9):.2f})"
          f"{', stopped on eos' if res.stopped_on_eos else ', hit max frames'}"
          + (f" -> {a.out}" if a.out else ""))
    return 0


def cmd_fidelity(a: argparse.Namespace) -> int:
    """Teacher-forced fidelity of each weight path against the fp32 torch reference: one table
    row per path (evaluation.fidelity), optionally as JSON."""
    import json

    import torch

    from omni_stream.checkpoints.default import resolve_model_path
    from omni_stream.evaluation.fidelity import (engine_paths, load_path, outliers_note, reference,
                                                 report_row, teacher_forced)

    if a.frames < 1:
        raise SystemExit("omni-stream fidelity: --frames must be at least 1")
    if a.threads:
        torch.set_num_threads(a.threads)
    runs = engine_paths(a.engine)
    paths = list(dict.fromkeys(a.weight_path or runs))
    for p in paths:
        if p not in runs:
            print(f"omni-stream fidelity: error: weight path {p} does not run on the {a.engine} "
                  f"engine: use one of {', '.join(runs)}", file=sys.stderr)
            return 2
    path = resolve_model_path(a.model)
    note = outliers_note(path)
    if note:
        print(note)
    ref, reqs, seq = reference(path, a.frames)
    rows = []
    for p in paths:
        t0 = time.perf_counter()
        test = load_path(path, p, a.engine, a.threads or None, max_seq_len=seq)
        rows.append(dict(report_row(p, a.engine, teacher_forced(ref, test, reqs, a.frames)),
                         seconds=round(time.perf_counter() - t0, 2)))
        del test
    _fidelity_table(rows, f"{a.engine} engine vs fp32 torch, teacher-forced, {len(reqs)} "
                          f"prompts x {a.frames} frames (SNR in dB)")
    if a.json:
        with open(a.json, "w") as fh:
            json.dump(dict(model=str(path), engine=a.engine, frames=a.frames,
                           outliers=note is not None, rows=rows), fh, indent=1)
        print(f"wrote {a.json}")
    return 0


def _fidelity_table(rows: list[dict], title: str) -> None:
    def db(v):
        return "inf" if v is None else f"{v:.1f}"  # as_dict writes an infinite SNR as None

    # SNRs in dB; code-0 / top-5 / CP: agreement; CP worst: the least agreeing codebook
    head = ["path", "talker SNR", "code-0", "top-5", "CP SNR", "CP", "CP worst", "audio SNR"]
    body = [[r["weight_path"], db(r["logits_snr_db"]), f"{r['code0_agreement']:.3f}",
             f"{r['code0_top5_overlap']:.3f}", db(r["cp_logits_snr_db"]), f"{r['cp_agreement']:.3f}",
             "-" if r["cp_worst_codebook"] is None
             else f"{r['cp_worst_agreement']:.3f} cb{r['cp_worst_codebook']}",
             "-" if r["frames"] == 0 else db(r["audio_snr_db"])] for r in rows]
    try:
        from rich.console import Console
        from rich.table import Table
    except ImportError:
        print(title)
        w = [max(len(x[i]) for x in [head] + body) for i in range(len(head))]
        for line in [head] + body:
            print("  ".join(c.rjust(n) for c, n in zip(line, w)))
        return
    t = Table(title=title)
    for i, h in enumerate(head):
        t.add_column(h, justify="left" if i == 0 else "right")
    for line in body:
        t.add_row(*line)
    Console().print(t)


def cmd_serve(a: argparse.Namespace) -> int:
    from omni_stream.orchestrator import PipelineBackend
    from omni_stream.server.app import run_server
    from omni_stream.server.settings import from_args

    if a.ray is not None:
        return _serve_cluster(a)
    from omni_stream.cluster.launch import cluster_flags_valid  # the cluster code's own checks

    cluster_flags_valid(a)
    settings, _, _ = pipeline_settings(a, build_native=True)
    run_server(PipelineBackend(settings), a.host, a.port, from_args(a))
    return 0


def _serve_cluster(a: argparse.Namespace) -> int:
    try:
        from omni_stream.cluster.launch import run
    except ImportError as e:
        raise ValueError(f"--ray needs Ray Serve ({e}): pip install 'omni-stream[cluster]'") \
            from None
    return run(a)


def cmd_profile(a: argparse.Namespace) -> int:
    """Print the probed hardware and the effective deployment profile with each value's source."""
    import json

    from omni_stream.edge.adapt import build_profile, format_profile, profile_to_dict
    from omni_stream.edge.probe import load_profile, profile_summary
    from omni_stream.checkpoints.io import read_config
    from omni_stream.checkpoints.default import resolve_model_path
    from omni_stream.scheduling import kv_bytes_per_token

    path = resolve_model_path(a.model)
    cfg = read_config(path)
    hw = load_profile()
    user = json.loads(a.set) if a.set else None

    model_bytes = _model_bytes(path)
    # the native runtime's kernels: this machine's library reports them (built here unless
    # --no-measure), another machine's are predicted from its ISA list
    kernels = native_kernels_report(hw, build=not a.no_measure)
    unavailable = kernels["unavailable"]
    bandwidth, frame_bytes = _weight_path_pricing(hw, cfg)

    def build(calibration, why=unavailable):
        return build_profile(hw, model_bytes=model_bytes,
                             kv_bytes_per_token=kv_bytes_per_token(cfg, 2).flat_per_token,
                             calibration=calibration, user=user, bandwidth_gbs=bandwidth,
                             frame_bytes=frame_bytes, native_unavailable=why)

    found: list = []
    prof, sources, settings, calib = _with_calibration(a, path, build, found)
    if not found and not a.no_measure and hw.source == "probe":  # not an emulated machine
        _measure_deployment(settings)  # seconds: starts the stages, times them, caches
        prof, sources, settings, calib = _with_calibration(a, path, build, found)
    costs = found[0] if found else None
    cap = None
    if costs is not None:
        from omni_stream.scheduling.capacity import capacity

        cap = capacity(costs, slots=settings.max_streams, steady=prof.steady_chunk)
    if a.json:
        extra = {}
        if costs is not None:
            extra = dict(costs=costs.to_dict(), capacity_streams=cap.streams,
                         rtf_estimate=cap.rtf, realtime=cap.realtime,
                         bandwidth_gbs=costs.bandwidth_gbs)
        print(json.dumps(dict(hardware=profile_summary(hw), profile=profile_to_dict(prof),
                              sources=sources, calibration=str(calib) if calib else None,
                              native_kernels=kernels, **extra), indent=2))
    else:
        from omni_stream.scheduling.capacity import format_costs

        print("hardware:", json.dumps(profile_summary(hw)))
        print(format_native_kernels(kernels))
        print("measured costs:", calib or "none for these settings (--no-measure)")
        if costs is not None:
            print(format_costs(costs, cap, steady=prof.steady_chunk))
        print(format_profile(prof, sources))
    return 0


def _measure_deployment(settings) -> None:
    """Start the pipeline of ``settings`` once (it measures and caches the costs), then stop."""
    import asyncio

    from omni_stream.orchestrator import PipelineBackend

    async def run():
        b = PipelineBackend(settings)
        try:
            await b.start()
        finally:
            await b.close()

    asyncio.run(run())


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="omni-stream", description=__doc__)
    p.add_argument("-v", "--verbose", action="store_true")
    sub = p.add_subparsers(dest="cmd", required=True)

    m = sub.add_parser("make-checkpoint", help="write a random checkpoint in the released layout")
    m.add_argument("--preset", choices=["tiny", "small", "0.6b", "1.7b"], required=True)
    m.add_argument("--variant", choices=["custom_voice", "voice_design", "base"], default="custom_voice")
    m.add_argument("--seed", type=int, default=0)
    m.add_argument("--dtype", default="bf16", help="stored dtype: bf16 (released) or fp32")
    m.add_argument("--talker-layers", type=int, default=None, help="override the talker depth")
    m.add_argument("--cp-layers", type=int, default=None, help="override the code predictor depth")
    m.add_argument("--outliers", action="store_true",
                   help="heavy-tailed decoder weights and massive-activation channels, as in "
                        "trained LLMs (same function; for testing quantizers)")
    m.add_argument("--out", required=True)
    m.set_defaults(func=cmd_make_checkpoint)

    s = sub.add_parser("synthesize", help="text -> wav offline (one request)")
    add_model_argument(s)
    s.add_argument("--text", required=True)
    s.add_argument("--voice", default=None, help="speaker name (CustomVoice)")
    s.add_argument("--language", default="auto")
    s.add_argument("--instructions", default=None)
    s.add_argument("--greedy", action="store_true", help="greedy decoding (no sampling)")
    s.add_argument("--seed", type=int, default=0)
    s.add_argument("--max-frames", type=int, default=2047)
    s.add_argument("--stream-text", action="store_true", help="feed text token by token")
    s.add_argument("--dtype", default="fp32")
    s.add_argument("--threads", type=int, default=0)
    s.add_argument("--weight-path", choices=WEIGHT_PATHS, default=None,
                   help="int8/int4: low-bit talker/code-predictor weights (compute in bf16)")
    s.add_argument("--compile", action="store_true",
                   help="torch.compile the decoder steps (cached across runs)")
    s.add_argument("--engine", choices=ENGINES, default="torch",
                   help="what runs the decode step: torch ops, or the native CPU runtime")
    s.add_argument("--ref-audio", default=None, metavar="FILE",
                   help="clone the voice of this clip (Base checkpoints; wav/flac/ogg/mp3)")
    s.add_argument("--ref-text", default=None, help="the clip's transcript (ICL cloning)")
    s.add_argument("--x-vector-only", action="store_true",
                   help="clone from the speaker embedding alone (no --ref-text)")
    s.add_argument("--out", default=None, help="output wav path")
    s.add_argument("--codes-out", default=None, help="output codes .npy (int64 [frames, 16])")
    s.set_defaults(func=cmd_synthesize)

    fd = sub.add_parser("fidelity", help="teacher-forced fidelity of weight paths against fp32")
    add_model_argument(fd)
    fd.add_argument("--weight-path", action="extend", nargs="+", choices=WEIGHT_PATHS, default=None,
                    help="paths to compare (repeatable; default: every path the engine runs)")
    fd.add_argument("--frames", type=int, default=32, help="teacher-forced frames per prompt")
    fd.add_argument("--threads", type=int, default=0)
    fd.add_argument("--engine", choices=ENGINES, default="torch",
                    help="what runs the tested paths (the reference is always fp32 torch)")
    fd.add_argument("--json", default=None, metavar="FILE", help="write the rows as JSON")
    fd.set_defaults(func=cmd_fidelity)
    v = sub.add_parser("serve", help="run the streaming HTTP/WebSocket server")
    add_model_argument(v)
    v.add_argument("--model-name", default=None, help="served model id (default: qwen3-tts)")
    v.add_argument("--profile", choices=["auto", "none"], default="auto",
                   help="auto: unset flags come from the hardware probe, class file and "
                        "chunk calibration (see `omni-stream profile`); none: fixed defaults "
                        "and the chunk calibration")
    v.add_argument("--dtype", default=None, help="fp32 or bf16 (default: from the profile)")
    v.add_argument("--codec-dtype", default=None,
                   help="Code2Wav's dtype, fp32 or bf16 (default: from the profile: fp32 on GPUs "
                        "and with --fidelity-first, else --dtype's). fp32 is the exact decode, "
                        "what exported client-side decoders match; bf16 is ~30 dB from it")
    v.add_argument("--device", default=None, help="cpu or cuda (default: from the profile)")
    v.add_argument("--max-streams", type=int, default=None, help="concurrent streams (talker slots)")
    v.add_argument("--max-queue", type=int, default=16, help="requests waiting for a slot")
    v.add_argument("--queue-timeout", type=float, default=None, help="seconds a request may wait")
    v.add_argument("--max-seq-len", type=int, default=None, help="talker positions per stream")
    v.add_argument("--first-chunk", type=int, default=None, help="frames in the first audio chunk")
    v.add_argument("--steady-chunk", type=int, default=None, help="frames per chunk once ramped up")
    v.add_argument("--talker-threads", type=int, default=None)
    v.add_argument("--codec-threads", type=int, default=None)
    v.add_argument("--placement", choices=["together", "split"], default=None,
                   help="talker and code predictor in one process, or in two")
    v.add_argument("--cp-threads", type=int, default=None, help="code-predictor threads (split)")
    v.add_argument("--kv-budget-mb", type=float, default=None,
                   help="talker KV admitted at once (default: the static cache, streams x seq len)")
    v.add_argument("--weight-path", choices=WEIGHT_PATHS, default=None,
                   help="talker/code-predictor weights (default: from the profile; int8/int4 "
                        "are CPU low-bit paths computing in bf16)")
    v.add_argument("--fidelity-first", action=argparse.BooleanOptionalAction, default=None,
                   help="keep exact bf16/fp32 weights even where int8 would be faster")
    v.add_argument("--compile", action=argparse.BooleanOptionalAction, default=None,
                   help="torch.compile the decoder steps, cached across restarts "
                        "(default: from the profile)")
    v.add_argument("--engine", choices=ENGINES, default=None,
                   help="what runs the decode step: 'native' (the CPU runtime, engine/cpu), "
                        "'torch' ops, or 'vllm' (the talker decoder and its KV cache on vLLM, "
                        "from the environment setup.sh builds: README 'vLLM engine') (default: "
                        "from the profile: native on x86-64 CPUs with AVX2 and on ARM64; "
                        "torch where the runtime cannot be built, with the reason logged)")
    v.add_argument("--lend-cores", action=argparse.BooleanOptionalAction, default=None,
                   help="let the talker's native runtime compute on the codec stage's cores "
                        "while Code2Wav is idle (default: from the profile: on with the native "
                        "engine and pinned stages)")
    v.add_argument("--speculative-cp", default=None, metavar="LAYERS[:LOOKAHEAD]",
                   help="speculative code prediction: a draft of the code "
                        "predictor's first LAYERS layers proposes LOOKAHEAD codes (default 4), "
                        "the full predictor verifies them in one pass; the codes are the plain "
                        "path's for every seed (benchmarks/tts/results/speculative_bench.md)")
    v.add_argument("--no-throttle", action="store_true",
                   help="run new prefills at once instead of within the running streams' slack")
    v.add_argument("--frame-cap", default=None, metavar="BASE+PER_TOKEN",
                   help="the frame cap of a request that gives no max_new_tokens: BASE frames "
                        "plus PER_TOKEN frames per text token (default 40+12: about three times "
                        "a slow reading; a random checkpoint, which never ends by itself, "
                        "speaks at a reading pace with e.g. 1+4)")
    from omni_stream.server.settings import add_arguments

    add_arguments(v)
    from omni_stream.cluster.launch import add_arguments as add_cluster_arguments

    add_cluster_arguments(v)
    v.set_defaults(func=cmd_serve)

    pr = sub.add_parser("profile", help="print the probed hardware and the effective profile")
    add_model_argument(pr)
    pr.add_argument("--set", default=None, help='user overrides as JSON, e.g. \'{"max_streams": 2}\'')
    pr.add_argument("--json", action="store_true")
    pr.add_argument("--no-measure", action="store_true",
                    help="do not measure the machine when no costs are cached for these "
                         "settings (nor build the native runtime: its kernels are then read "
                         "from a library built before, or predicted)")
    pr.set_defaults(func=cmd_profile)

    from omni_stream.observability.report import add_stats_parser

    add_stats_parser(sub)
    from omni_stream.export.cli import add_export_parsers

    add_export_parsers(sub)
    from omni_stream.voices.cli import add_voices_parser

    add_voices_parser(sub)
    return p


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    if getattr(args, "engine", None) == "vllm":
        from omni_stream.engine.vllm.env import reexec_with_vllm

        if getattr(args, "ray", None) is not None:
            print("omni-stream: error: --engine vllm serves on one machine (vLLM's environment "
                  "has no Ray): drop --ray, or use --engine torch / native on the cluster",
                  file=sys.stderr)
            return 2

        try:  # vLLM lives in an environment of its own (engine/vllm/env.py)
            reexec_with_vllm(sys.argv[1:] if argv is None else list(argv))
        except ValueError as e:
            print(f"omni-stream: error: {e}", file=sys.stderr)
            return 2
    logging.basicConfig(level=logging.DEBUG if args.verbose else logging.INFO,
                        format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    try:
        return args.func(args)
    except (ValueError, FileNotFoundError) as e:
        print(f"omni-stream: error: {e}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())
