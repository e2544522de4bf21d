"""``omni-stream profile``: the effective profile with sources, on this machine and emulated."""

from __future__ import annotations

import json

import pytest

from omni_stream.cli import main


def test_profile_here_and_emulated(tiny_ckpt, capsys, monkeypatch):
    assert main(["profile", "--model", str(tiny_ckpt), "--json", "--no-measure"]) == 0
    here = json.loads(capsys.readouterr().out)
    assert here["hardware"]["hardware_class"] in ("x86_cpu", "arm64_cpu")
    assert set(here["sources"]) == set(here["profile"])
    monkeypatch.setenv("OMNI_STREAM_HW_PROFILE", json.dumps(
        {"hardware_class": "cuda_discrete", "cuda": {"name": "H100", "total_memory_gb": 80.0,
                                                      "unified_memory": False,
                                                      "compute_capability": [9, 0]}}))
    assert main(["profile", "--model", str(tiny_ckpt), "--json", "--set", '{"max_seq_len": 1024}']) == 0
    gpu = json.loads(capsys.readouterr().out)
    assert gpu["profile"]["device"] == "cuda" and gpu["profile"]["cuda_graphs"] is True
    assert gpu["profile"]["max_seq_len"] == 1024 and gpu["sources"]["max_seq_len"] == "user"
    monkeypatch.setenv("OMNI_STREAM_HW_PROFILE", '{"hardware_class": "quantum"}')
    assert main(["profile", "--model", str(tiny_ckpt)]) == 2
    assert "quantum" in capsys.readouterr().err


def _serve_args(*argv):
    from omni_stream.cli import build_parser

    return build_parser().parse_args(["serve", *argv])


def test_serve_settings_follow_the_profile_and_flags(tiny_ckpt, monkeypatch, tmp_path):
    from omni_stream.cli import pipeline_settings
    from omni_stream.edge.probe import load_profile

    monkeypatch.setenv("OMNI_STREAM_CACHE_DIR", str(tmp_path))  # no chunk calibration here

    # an emulated 8-core big.LITTLE ARM board: split placement, 2 threads per stage, from the profile
    hw = load_profile(env={"OMNI_STREAM_HW_PROFILE": json.dumps(
        {"hardware_class": "arm64_cpu", "arch": "aarch64", "physical_cores": 8, "ram_gb": 8})},
        use_torch=False)
    s, prof, src = pipeline_settings(_serve_args("--model", str(tiny_ckpt)), hw)
    assert s.placement == prof.placement == "split" and src["placement"] == "derived"
    assert s.talker_threads == prof.talker_threads and s.max_streams == prof.max_streams
    assert s.max_seq_len == prof.max_seq_len == 1024 and src["max_seq_len"] == "class:arm64_cpu"
    # explicit flags win over the profile
    s2, _, src2 = pipeline_settings(_serve_args("--model", str(tiny_ckpt), "--placement", "together",
                                                "--max-streams", "3", "--dtype", "fp32"), hw)
    assert (s2.placement, s2.max_streams, s2.dtype) == ("together", 3, "float32")
    assert src2["placement"] == src2["max_streams"] == src2["dtype"] == "user"
    # --profile none: the fixed defaults
    s3, _, src3 = pipeline_settings(_serve_args("--model", str(tiny_ckpt), "--profile", "none"), hw)
    assert (s3.placement, s3.max_streams, s3.dtype, s3.max_seq_len) == ("together", 4, "float32", 2048)
    assert set(src3.values()) == {"default"}
    with pytest.raises(ValueError, match="unknown dtype 'fp8'"):
        pipeline_settings(_serve_args("--model", str(tiny_ckpt), "--dtype", "fp8"), hw)


def _hw(override: dict):
    from omni_stream.edge.probe import load_profile

    return load_profile(env={"OMNI_STREAM_HW_PROFILE": json.dumps(override)}, use_torch=False)


GPU = {"hardware_class": "cuda_discrete", "cuda": {"name": "H100", "total_memory_gb": 80.0,
                                                   "unified_memory": False,
                                                   "compute_capability": [9, 0]}}


def test_cuda_graphs_from_the_profile_reach_the_talker_stage_spec(tiny_ckpt, monkeypatch, tmp_path):
    """The profile's cuda_graphs (derived on for CUDA classes) is what the talker stage gets;
    nothing turns graphs on behind the profile's back, and they are refused where they cannot
    run (a CPU device, the split placement)."""
    from omni_stream.cli import pipeline_settings
    from omni_stream.orchestrator import PipelineSettings
    from omni_stream.orchestrator.pipeline import stage_specs
    from omni_stream.stages.proc import StageSpec

    monkeypatch.setenv("OMNI_STREAM_CACHE_DIR", str(tmp_path))
    s, prof, src = pipeline_settings(_serve_args("--model", str(tiny_ckpt)), _hw(GPU))
    assert prof.cuda_graphs and src["cuda_graphs"] == "derived"
    assert (s.device, s.cuda_graphs) == ("cuda", True)
    specs = stage_specs(s)
    assert specs["talker"].cuda_graphs and not specs["codec"].cuda_graphs
    # split placement on the GPU: the code predictor is outside the graph, so graphs are off
    s2, prof2, _ = pipeline_settings(_serve_args("--model", str(tiny_ckpt), "--placement",
                                                 "split"), _hw(GPU))
    assert not prof2.cuda_graphs and not s2.cuda_graphs
    assert not any(sp.cuda_graphs for sp in stage_specs(s2).values())
    # a CPU box: off, and the talker does not turn them on by itself
    s3, _, _ = pipeline_settings(_serve_args("--model", str(tiny_ckpt)),
                                 _hw({"hardware_class": "x86_cpu"}))
    assert not s3.cuda_graphs and not stage_specs(s3)["talker"].cuda_graphs
    with pytest.raises(ValueError, match="cuda_graphs needs a CUDA device"):
        PipelineSettings(model_path="m", device="cpu", cuda_graphs=True)
    with pytest.raises(ValueError, match="cuda_graphs needs a CUDA device"):
        StageSpec(model_path="m", device="cpu", cuda_graphs=True)
    with pytest.raises(ValueError, match="placement 'together'"):
        PipelineSettings(model_path="m", device="cuda", cuda_graphs=True, placement="split")


def test_cached_costs_are_the_profiles_calibration_layer(tiny_ckpt, monkeypatch, tmp_path,
                                                       capsys):
    """Costs cached for these settings give the chunk policy in ``omni-stream profile`` (source
    "calibration"), the capacity, RTF estimate and bandwidth it prints, and the schedule
    ``serve`` runs with; flags still win."""
    from omni_stream.cli import pipeline_settings
    from omni_stream.scheduling.capacity import MachineCosts, chunk_policy

    monkeypatch.setenv("OMNI_STREAM_CACHE_DIR", str(tmp_path))
    args = _serve_args("--model", str(tiny_ckpt))
    s0, _, src0 = pipeline_settings(args)
    assert src0["first_chunk"] != "calibration" and not s0.schedule_calibrated
    # a slow machine: 70 ms frames and a costly codec call: not real time
    costs = MachineCosts(frame_s=(0.070, 0.085, 0.100, 0.115), codec_call_s=0.030,
                         codec_frame_s=0.002, bandwidth_gbs=17.0, bandwidth_1t_gbs=9.5)
    path = s0.cost_cache().store(costs)
    assert path.parent == tmp_path / "calibration"
    want = chunk_policy(costs, s0.schedule)

    s, prof, src = pipeline_settings(args)
    assert (prof.first_chunk, prof.steady_chunk) == (want.first, want.steady)
    assert src["first_chunk"] == src["steady_chunk"] == "calibration"
    assert (s.schedule.first, s.schedule.steady) == (want.first, want.steady)
    assert s.schedule_calibrated and not s.schedule_fixed
    assert s.calibration_fingerprint() == s0.calibration_fingerprint()

    assert main(["profile", "--model", str(tiny_ckpt), "--json"]) == 0
    shown = json.loads(capsys.readouterr().out)
    assert (shown["profile"]["first_chunk"], shown["profile"]["steady_chunk"]) == (want.first,
                                                                                   want.steady)
    assert shown["sources"]["first_chunk"] == "calibration"
    assert shown["calibration"] == str(path)
    assert shown["bandwidth_gbs"] == 17.0 and shown["capacity_streams"] == 1
    assert shown["realtime"] is False and shown["rtf_estimate"] > 0.85
    assert main(["profile", "--model", str(tiny_ckpt)]) == 0
    text = capsys.readouterr().out
    assert "memory read bandwidth: 17.0 GB/s" in text and "NOT real time" in text
    assert "1 stream 70.0" in text

    # a flag wins over the calibration for its field only, and fixes the schedule
    s, _, src = pipeline_settings(_serve_args("--model", str(tiny_ckpt), "--steady-chunk", "40"))
    assert (s.schedule.first, s.schedule.steady) == (want.first, 40)
    assert src["steady_chunk"] == "user" and s.schedule_fixed
    # --profile none: the defaults, the calibration (same deployment), the flags
    none = _serve_args("--model", str(tiny_ckpt), "--profile", "none")
    s, _, _ = pipeline_settings(none)
    s.cost_cache().store(costs)
    s, _, src = pipeline_settings(none)
    assert s.schedule_calibrated and src["steady_chunk"] == "calibration"
    assert src["dtype"] == "default"


def test_codec_dtype_reaches_the_codec_stage_and_the_announced_decode_dtype(tiny_ckpt, monkeypatch,
                                                                            tmp_path):
    """Code2Wav's dtype is its own: derived fp32 on a GPU beside bf16 language models, the
    models' dtype on a bf16 CPU, ``--codec-dtype`` wins; the codec stage loads it, the talker
    keeps ``dtype``, and a bad value is refused by name."""
    from omni_stream.cli import pipeline_settings
    from omni_stream.orchestrator import PipelineSettings
    from omni_stream.orchestrator.pipeline import stage_specs

    monkeypatch.setenv("OMNI_STREAM_CACHE_DIR", str(tmp_path))
    s, prof, src = pipeline_settings(_serve_args("--model", str(tiny_ckpt)), _hw(GPU))
    assert (s.dtype, s.decode_dtype, src["codec_dtype"]) == ("bfloat16", "float32", "derived")
    specs = stage_specs(s)
    assert (specs["talker"].dtype, specs["codec"].dtype) == ("bfloat16", "float32")
    s2, _, src2 = pipeline_settings(_serve_args("--model", str(tiny_ckpt), "--dtype", "bf16",
                                                "--codec-dtype", "fp32"),
                                    _hw({"hardware_class": "x86_cpu"}))
    assert (s2.dtype, s2.decode_dtype, src2["codec_dtype"]) == ("bfloat16", "float32", "user")
    assert stage_specs(s2)["codec"].dtype == "float32"
    # the measured costs belong to the codec's dtype too
    s3 = PipelineSettings(model_path=str(tiny_ckpt), dtype="bfloat16")
    assert s3.decode_dtype == "bfloat16"
    assert s3.calibration_fingerprint() != PipelineSettings(
        model_path=str(tiny_ckpt), dtype="bfloat16", codec_dtype="float32").calibration_fingerprint()
    with pytest.raises(ValueError, match="unknown codec-dtype 'fp16'"):
        pipeline_settings(_serve_args("--model", str(tiny_ckpt), "--codec-dtype", "fp16"), _hw(GPU))
