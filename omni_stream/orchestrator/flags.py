"""``omni-stream serve``'s flags -> the pipeline's settings: the effective deployment profile
(flags over the machine's probe and measured costs over the class defaults) and the
``PipelineSettings`` it gives. Used by the CLI and by each replica of a cluster deployment
(``omni_stream.cluster``), which builds its pipeline from the same flags on its own node."""

from __future__ import annotations

import argparse
import logging
import os

from omni_stream.config import LOW_BIT_WEIGHT_PATHS

log = logging.getLogger("omni_stream.cli")

DTYPES = {"fp32": "float32", "float32": "float32", "bf16": "bfloat16", "bfloat16": "bfloat16"}


def _prod(shape) -> int:
    n = 1
    for d in shape:
        n *= int(d)
    return n


# serve flag (argparse dest) -> DeployProfile field; a flag left unset is filled by the profile
SERVE_PROFILE_FLAGS = {
    "dtype": "dtype", "codec_dtype": "codec_dtype", "device": "device", "max_streams": "max_streams",
    "max_seq_len": "max_seq_len", "first_chunk": "first_chunk", "steady_chunk": "steady_chunk",
    "talker_threads": "talker_threads", "codec_threads": "codec_threads",
    "cp_threads": "cp_threads", "placement": "placement", "queue_timeout": "queue_timeout_s",
    "kv_budget_mb": "kv_budget_mb", "weight_path": "weight_path", "compile": "compile",
    "fidelity_first": "fidelity_first", "engine": "engine", "lend_cores": "lend_cores",
}


def _model_bytes(path) -> int:
    """Parameters of the main checkpoint x 2 (bf16 bytes, what build_profile expects)."""
    from safetensors import safe_open

    from omni_stream.checkpoints.io import _weight_files

    n = 0
    for f in _weight_files(path):
        with safe_open(str(f), framework="pt") as h:
            for k in h.keys():
                n += _prod(h.get_slice(k).get_shape())
    return 2 * n


def effective_profile(a: argparse.Namespace, path, hw=None, calibration=None,
                      native_unavailable: str | None = None):
    """The deployment profile for ``serve``: ``--profile auto`` layers model defaults, the
    hardware-class file, values derived from the probe, the chunk calibration and the flags
    given (which win); ``--profile none`` is the fixed defaults, the chunk calibration and the
    flags. ``calibration``: this deployment's cached ChunkPolicy or None;
    ``native_unavailable``: why the native runtime cannot run here (the torch engine is
    derived). Returns (profile, sources)."""
    from omni_stream.edge.adapt import FIELDS, DeployProfile, build_profile, calibration_values
    from omni_stream.edge.probe import load_profile
    from omni_stream.checkpoints.io import read_config
    from omni_stream.scheduling import kv_bytes_per_token

    user = {}
    for dest, fld in SERVE_PROFILE_FLAGS.items():
        v = getattr(a, dest, None)
        if v is not None:
            if dest in ("dtype", "codec_dtype"):
                if v not in DTYPES:
                    raise ValueError(f"unknown {dest.replace('_', '-')} '{v}': use fp32 or bf16")
                v = DTYPES[v]
            user[fld] = v
    if user.get("dtype") == "float32":
        user.setdefault("weight_path", "fp32")
    if a.profile == "none":
        if user.get("weight_path") in LOW_BIT_WEIGHT_PATHS:  # torch's low-bit kernels: bf16
            user.setdefault("dtype", "bfloat16")
        if user.get("dtype") == "bfloat16":
            user.setdefault("weight_path", "bf16")
        calib = calibration_values(calibration)
        prof = DeployProfile(**{**calib, **user})
        return prof, {k: "user" if k in user else "calibration" if k in calib else "default"
                      for k in FIELDS}
    cfg = read_config(path)
    hw = hw or load_profile()
    bandwidth, frame_bytes = _weight_path_pricing(hw, cfg)
    return build_profile(hw, model_bytes=_model_bytes(path),
                         kv_bytes_per_token=kv_bytes_per_token(cfg, 2).flat_per_token,
                         calibration=calibration, user=user, bandwidth_gbs=bandwidth,
                         frame_bytes=frame_bytes, native_unavailable=native_unavailable)


def native_runtime() -> tuple[str | None, str | None]:
    """(the kernels this process's native runtime runs, e.g. 'avx2+fma+f16c', or None; why it
    cannot run here, naming the fix, or None): builds the library if it is not built yet."""
    from omni_stream.engine.cpu.build import BuildError, ensure_library, kernels

    try:
        return kernels(ensure_library()), None
    except BuildError as e:
        return None, str(e)


def native_kernels_report(hw, build: bool = True) -> dict:
    """What the native runtime runs for ``hw``, for ``omni-stream profile``: ``kernels`` (e.g.
    'avx2+fma+f16c'), ``source`` ('library': this machine's built library's ``oc_isa()``;
    'predicted': ``edge.derive.native_kernels`` of hardware that is not this machine, or of a
    library not built yet), ``note`` and ``unavailable`` (why the library cannot be built here,
    naming the fix, else None). ``build``: build the library if it is not (else only a cached
    one is read)."""
    from omni_stream.edge import derive
    from omni_stream.edge.probe import ENV_VAR
    from omni_stream.engine.cpu import isa as cpu_isa
    from omni_stream.engine.cpu.build import BuildError, kernels, library_path, load

    cap = cpu_isa.parse_cap(os.environ.get(cpu_isa.CAP_ENV))
    predicted = derive.native_kernels(hw, cap)
    out = dict(kernels=predicted, level=derive.native_kernel_level(hw, cap), source="predicted",
               note="", unavailable=None)
    if hw.source == "override":  # a full description of another machine: nothing here to ask
        out["note"] = f"predicted for the machine {ENV_VAR} describes"
        return out
    target = cpu_isa.this_target()
    if build:
        got, why = native_runtime()
    else:  # a library built before, if any; nothing is compiled
        got = why = None
        try:
            path = library_path()
            if path.is_file():
                got = kernels(load(path))
        except BuildError as e:  # no compiler, a library that does not load
            why = str(e)
    if why is not None:
        out.update(kernels=None, unavailable=why,
                   note=f"the library cannot be built here, the torch engine is used: {why}")
    elif got is None:
        out["note"] = "predicted: the library is not built yet (--no-measure)"
    else:
        out.update(kernels=got, source="library", note="" if target.why == "this CPU" else target.why)
        if got != predicted:
            out["note"] += ("; " if out["note"] else "") + f"the described machine would run {predicted}"
    return out


def format_native_kernels(report: dict) -> str:
    """``native kernels: avx2+fma+f16c`` with its note, if any (``native_kernels_report``)."""
    k = report["kernels"] or "none"
    return f"native kernels: {k}" + (f" ({report['note']})" if report["note"] else "")


def fall_back_to_torch(sources, why: str, rebuild):
    """A profile with the native engine where the native runtime cannot run (``why``, which
    names the fix): the derived engine falls back to torch, logged with the reason, through
    ``rebuild(why)`` (whose result is returned); an engine the user asked for, or a weight path
    only the native runtime has, is an error naming the reason."""
    if sources.get("engine") == "user":
        raise ValueError(f"--engine native: the CPU runtime cannot run here: {why}")
    log.warning("the native CPU runtime cannot run here, so the torch engine runs the decode "
                "step: %s", why)
    try:
        return rebuild(why)
    except ValueError as e:
        raise ValueError(f"{e} (the native CPU runtime cannot run here: {why})") from None


BANDWIDTH_ENV = "OMNI_STREAM_BANDWIDTH_GBS"


def _weight_path_pricing(hw, cfg) -> tuple[float | None, dict[str, int]]:
    """(read bandwidth, what a frame of each native weight path costs, in bytes read at that
    bandwidth) for the profile to price weight paths with (``edge.derive.priced_weight_path``).
    The bandwidth is ``OMNI_STREAM_BANDWIDTH_GBS`` if set (then a frame costs its weight bytes:
    nothing else is known of that machine), else measured on every core the talker may use,
    once per process (the profile is built twice at start-up). A measured machine also gets
    each weight kind's cache-resident kernel rate and, per path, the read bandwidth over a
    buffer the size of the code predictor's weights, which it reads 15 times a frame: where a
    large cache keeps them between sub-steps (an AMX Xeon's 300 MB L3) the re-reads are bound
    by the kernels, not by memory (``edge.derive.priced_frame_s``). Each path's priced frame is
    logged; None where the hardware is an override describing another machine."""
    from omni_stream.edge import derive
    from omni_stream.edge.measure import memory_bandwidth_gbs
    from omni_stream.engine.cpu import isa as cpu_isa
    from omni_stream.engine.cpu.plans import frame_reads, kernel_read_gbs
    from omni_stream.engine.loading import NATIVE_PLANS

    reads = {wp: frame_reads(cfg.talker, plan) for wp, plan in NATIVE_PLANS.items()
             if wp in LOW_BIT_WEIGHT_PATHS}
    frame_bytes = {wp: r.total for wp, r in reads.items()}
    env = os.environ.get(BANDWIDTH_ENV, "").strip()
    if env:
        try:
            bw = float(env)
        except ValueError:
            raise SystemExit(f"{BANDWIDTH_ENV}={env!r}: give the read bandwidth in GB/s, e.g. 17.5")
        if not bw > 0 or bw == float("inf"):
            raise SystemExit(f"{BANDWIDTH_ENV}={env!r}: the bandwidth must be a finite number > 0")
        key, how = env, BANDWIDTH_ENV
    elif hw.source != "probe":
        return None, frame_bytes
    else:
        threads = min(hw.physical_cores, derive.MAX_STAGE_THREADS)
        key, how = threads, f"measured on {threads} threads"
    if key not in _BANDWIDTH:
        gbs = bw if env else memory_bandwidth_gbs(key)
        priced, detail = dict(frame_bytes), ""
        if not env and derive.native_engine_runs(hw, cpu_isa.parse_cap(os.environ.get(cpu_isa.CAP_ENV))):
            try:
                kinds = sorted({k for r in reads.values() for k in (*r.talker, *r.cp)})
                # one thread's rate times the threads: the products split their rows across
                # the pool's threads, and a pool timed on a busy machine measures its spinning
                rates = {k: kernel_read_gbs(k, 1) * key for k in kinds}
                reread = {wp: memory_bandwidth_gbs(key, mib=max(1, r.cp_bytes >> 20))
                          for wp, r in reads.items()}
            except Exception as e:  # no compiler here: the native paths are not served anyway
                log.warning("weight paths priced by bytes alone: the kernels' rates could not "
                            "be measured (%s)", e)
            else:
                mem = gbs * 1e9 * derive.NATIVE_READ_EFFICIENCY
                priced = {wp: round(derive.priced_frame_s(r, gbs, rates, reread[wp]) * mem)
                          for wp, r in reads.items()}
                detail = ("; kernels from cache " + ", ".join(f"{k} {v:.0f}" for k, v in rates.items())
                          + " GB/s; code predictor re-read at " + ", ".join(
                              f"{wp} {reread[wp]:.0f}" for wp in reads) + " GB/s")
        _BANDWIDTH[key] = (gbs, priced)
        log.info("weight paths priced at %.1f GB/s (%s)%s: %s per frame (real time: <= %.0f ms)",
                 gbs, how, detail,
                 ", ".join(f"{wp} {b / (gbs * 1e9 * derive.NATIVE_READ_EFFICIENCY) * 1e3:.0f} ms"
                           for wp, b in priced.items()),
                 derive.REALTIME_MODEL_SHARE * derive.FRAME_S * 1e3)
    return _BANDWIDTH[key]


_BANDWIDTH: dict = {}  # per process: env value or thread count -> (GB/s, priced frame bytes per path)


def _settings(a: argparse.Namespace, path, prof, sources):
    """PipelineSettings from an effective profile (and the serve-only flags, if any)."""
    from omni_stream.orchestrator.settings import PipelineSettings
    from omni_stream.scheduling.chunking import ChunkPolicy

    model_name = getattr(a, "model_name", None)
    return PipelineSettings(
        model_path=str(path),
        model_name=model_name or ("qwen3-tts" if a.model == "default" else path.name),
        dtype=prof.dtype, codec_dtype=prof.codec_dtype, device=prof.device,
        max_streams=prof.max_streams,
        max_queue=getattr(a, "max_queue", 16), queue_timeout_s=prof.queue_timeout_s,
        max_seq_len=prof.max_seq_len,
        schedule=ChunkPolicy(first=prof.first_chunk, steady=prof.steady_chunk),
        schedule_calibrated="calibration" in (sources["first_chunk"], sources["steady_chunk"]),
        schedule_fixed="user" in (sources["first_chunk"], sources["steady_chunk"]),
        talker_threads=prof.talker_threads, codec_threads=prof.codec_threads,
        cp_threads=prof.cp_threads, placement=prof.placement, cuda_graphs=prof.cuda_graphs,
        weight_path=prof.weight_path if prof.weight_path in LOW_BIT_WEIGHT_PATHS else None,
        compile=prof.compile, engine=prof.engine, lend_cores=prof.lend_cores,
        start_timeout_s=1800.0 if prof.compile else 300.0,  # a cold compile takes minutes
        kv_budget_bytes=int(prof.kv_budget_mb * 2**20) if prof.kv_budget_mb else None,
        throttle=not getattr(a, "no_throttle", False), cpu_sets=dict(prof.cpu_sets),
        speculative_cp=_speculative_cp(getattr(a, "speculative_cp", None), path),
        frame_cap=_frame_cap(getattr(a, "frame_cap", None)))


def _frame_cap(text: str | None):
    """``--frame-cap BASE+PER_TOKEN`` -> FrameCap (None: the default)."""
    from omni_stream.scheduling.limits import FrameCap

    if text is None:
        return FrameCap()
    base, sep, per = text.partition("+")
    try:
        if not sep:
            raise ValueError("no '+'")
        return FrameCap(base_frames=int(base), frames_per_token=float(per))
    except ValueError as e:
        raise SystemExit(f"--frame-cap {text!r}: expected BASE+PER_TOKEN (an integer >= 1 plus a "
                         f"number > 0, e.g. 40+12): {e}") from None


def _speculative_cp(text: str | None, path) -> tuple[int, int] | None:
    """``--speculative-cp LAYERS[:LOOKAHEAD]`` -> (draft layers, lookahead), checked against the
    checkpoint's code predictor (1 .. its layers - 1; lookahead >= 1, default 4)."""
    if text is None:
        return None
    from omni_stream.checkpoints.io import read_config

    n = read_config(path).talker.code_predictor.num_hidden_layers
    layers, _, look = text.partition(":")
    try:
        d, k = int(layers), int(look) if look else 4
    except ValueError:
        d = k = 0
    if not (1 <= d < n and k >= 1):
        raise ValueError(f"--speculative-cp {text!r}: give LAYERS[:LOOKAHEAD], draft layers 1 to "
                         f"{n - 1} (this code predictor has {n}) and a lookahead >= 1, e.g. 2:4")
    return d, k


def _with_calibration(a: argparse.Namespace, path, build, costs_out: list | None = None):
    """(profile, sources, settings, cost file or None): ``build(calibration)`` gives the
    profile, with the chunk policy of this deployment's cached costs
    (``scheduling.capacity.chunk_policy``) as its calibration layer when they exist. The cache
    is keyed by the settings' fingerprint, which the chunk sizes do not enter, so the profile
    is first built without it to find the key. ``costs_out`` gets the cached costs, if any."""
    from omni_stream.scheduling.capacity import chunk_policy
    from omni_stream.scheduling.chunking import ChunkPolicy

    prof, sources = build(None)
    settings = _settings(a, path, prof, sources)
    cache = settings.cost_cache()
    costs = cache.load()
    if costs is None:
        return prof, sources, settings, None
    if costs_out is not None:
        costs_out.append(costs)
    policy = chunk_policy(costs, ChunkPolicy(first=prof.first_chunk, steady=prof.steady_chunk))
    try:
        cprof, csources = build(policy)
    except ValueError as e:
        log.warning("the chunk policy of the measured costs %s (first %d, steady %d) does not "
                    "fit the other settings and is not used: %s", cache.path, policy.first,
                    policy.steady, e)
        return prof, sources, settings, None
    return cprof, csources, _settings(a, path, cprof, csources), cache.path


def pipeline_settings(a: argparse.Namespace, hw=None, *, build_native: bool = False):
    """PipelineSettings for ``serve`` from the flags and the effective profile (whose
    calibration layer is the cached chunk calibration of these settings, if any).
    ``build_native`` (serve, a cluster replica): a profile with the native engine builds its
    library here, before any stage starts; where that fails the derived engine falls back to
    torch with a logged reason (``native_fallback``)."""
    from omni_stream.edge.adapt import format_profile
    from omni_stream.edge.probe import load_profile
    from omni_stream.checkpoints.default import resolve_model_path

    path = resolve_model_path(a.model)
    if hw is None and a.profile != "none":
        hw = load_profile()

    def with_calibration(why=None):
        return _with_calibration(
            a, path, lambda c: effective_profile(a, path, hw, calibration=c, native_unavailable=why))

    prof, sources, settings, calib = with_calibration()
    kernels = None
    if build_native and prof.engine == "native":
        kernels, why = native_runtime()
        if why is not None:
            prof, sources, settings, calib = fall_back_to_torch(sources, why, with_calibration)
    log.info("effective profile (--profile %s%s):\n%s%s", a.profile,
             f", measured costs {calib}" if calib else "", format_profile(prof, sources),
             f"\nnative kernels: {kernels}" if kernels and prof.engine == "native" else "")
    return settings, prof, sources
