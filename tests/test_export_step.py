"""Phone NPU path: exported decode steps (talker, code predictor, Code2Wav) against the eager model.

One tiny checkpoint, exported once per module through the CLI; every comparison is against the
eager frame engine or Code2WavStream on the same inputs (teacher-forced histories), and the ONNX
Runtime loop must reproduce the eager greedy codes frame for frame.
"""

from __future__ import annotations

import copy
import numpy as np
import onnx
import pytest
import torch

from omni_stream.cli import main as cli_main
from omni_stream.export.manifest import Manifest, ManifestError
from omni_stream.export.onnx_export import describe, load_decoder
from omni_stream.export.onnx_ops import NPU_OPS, OpCheckError, check_ops, lint, sanitize
from omni_stream.export.onnx_parity import compare_logits, record_eager, replay_code_predictor, replay_talker
from omni_stream.export.runtime_onnx import OrtRunner, StepCache, TorchRunner
from omni_stream.export.onnx_step import DecoderStep, StepError, code_predictor_step, talker_step
from omni_stream.checkpoints.io import load_model
from omni_stream.models.prompt import PromptRequest

FRAMES = 56
TALKER_CONTEXT = 96
REQ = PromptRequest(text="Hello world, this is a test.", language="english", speaker="ryan")


@pytest.fixture(scope="module", autouse=True)
def one_thread():
    """Tiny models on a shared 2-core box: two torch threads only add barrier stalls."""
    n = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(n)


@pytest.fixture(scope="module")
def model(tiny_ckpt):
    return load_model(tiny_ckpt, dtype=torch.float32)  # own instance: hooks never touch others'


@pytest.fixture(scope="module")
def history(model):
    return record_eager(model, REQ, FRAMES)


@pytest.fixture(scope="module")
def export_dir(tiny_ckpt, tmp_path_factory):
    out = tmp_path_factory.mktemp("npu-export")
    for part, ctx in (("talker", TALKER_CONTEXT), ("code_predictor", 16), ("code2wav", 72)):
        assert cli_main(["export-step", "--model", str(tiny_ckpt), "--part", part,
                         "--context", str(ctx), "--out", str(out)]) == 0
    return out


def _runner(export_dir, part, layout, suffix=""):
    m = Manifest.read(export_dir / f"{part}-{layout}{suffix}.json")
    return OrtRunner(m.check_files()), m


# ------------------------------------------------------------------------------ parity
@pytest.mark.parametrize("layout", ["roll", "ring"])
def test_exported_steps_match_eager_logits(export_dir, history, layout):
    """fp32 graphs vs the eager engine over a real greedy history: >= 100 dB, same top-1/top-5."""
    talker = compare_logits(history.talker_logits, replay_talker(*_runner(export_dir, "talker", layout), history))
    cp = compare_logits(history.cp_logits, replay_code_predictor(*_runner(export_dir, "code_predictor", layout), history))
    print(f"\n{layout}: talker {talker}\n{layout}: code predictor {cp}")
    for r in (talker, cp):
        assert r["rows"] >= 50
        assert r["snr_db"] >= 100.0
        assert r["top1"] == 1.0 and r["top5"] == 1.0


@pytest.mark.parametrize("layout", ["roll", "ring"])
def test_ort_loop_reproduces_eager_greedy_codes(export_dir, history, model, layout):
    dec = load_decoder(export_dir, layout)
    codes = dec.generate(history.prompt, history.trailing, FRAMES, stop_on_eos=False)
    assert codes.shape == (FRAMES, 16)
    np.testing.assert_array_equal(codes, history.codes)
    # and the stopping rule of the synthesizer (eos ends the stream) on the same prompt
    from omni_stream.engine.sampling import SamplingParams
    from omni_stream.engine.synthesis import Synthesizer

    eager, _, _ = Synthesizer(model, max_seq_len=256).generate_codes(REQ, SamplingParams.greedy(), 0, FRAMES)
    np.testing.assert_array_equal(dec.generate(history.prompt, history.trailing, FRAMES), eager)


def test_ring_and_roll_agree_past_the_window(model, history):
    """A window shorter than the history: the ring wraps (slots reused, never reordered) and
    must give the roll layout's outputs; before the wrap both equal full attention, after it
    both differ from it (the window really dropped history)."""
    talker = model.weights.talker
    rows = history.talker_x[:40]

    def run(layout: str, ctx: int) -> np.ndarray:
        step = talker_step(talker, layout, ctx)
        cache = StepCache(describe(step, "talker"), rope_len=len(rows))
        runner = TorchRunner(step)
        return np.stack([cache.step(runner, x)["logits"][0] for x in rows])

    ctx = 12
    roll, ring, full = run("roll", ctx), run("ring", ctx), run("ring", 64)
    r = compare_logits(roll, ring)
    assert r["snr_db"] >= 100.0 and r["top1"] == 1.0
    np.testing.assert_allclose(ring[:ctx], full[:ctx], rtol=0, atol=1e-5)
    assert compare_logits(full[ctx:], ring[ctx:])["snr_db"] < 60.0
    # full attention over the whole history is the eager model
    t = history.prompt_len
    assert compare_logits(history.talker_logits[: len(rows) - t + 1], full[t - 1:])["snr_db"] >= 100.0


@pytest.mark.parametrize("layout", ["roll", "ring"])
def test_code2wav_step_matches_streamed_and_one_pass_decode(export_dir, model, layout):
    """90 frames through the one-frame graph (past the 72-frame window, so the ring wraps). The
    graph is Code2Wav's own modules (Code2WavOnnxStep), so it stays within float rounding of
    the one-pass decode (measured ~4e-6)."""
    codes = torch.randint(0, 2048, (1, 16, 90), generator=torch.Generator().manual_seed(1))
    with torch.inference_mode():
        ref = model.code2wav(codes)[0].numpy()
    run, spec = _runner(export_dir, "code2wav", layout)
    cache = StepCache(spec)
    out = np.concatenate([cache.step(run, codes[0, :, i].numpy())["audio"][0] for i in range(90)])
    assert out.shape == ref.shape
    np.testing.assert_allclose(out, ref, rtol=0, atol=2e-5)
    assert np.abs(ref).max() > 0.05  # not silence


# ------------------------------------------------------------------------------ graph hygiene
def test_graphs_are_npu_clean(export_dir, model):
    cfg = model.config.talker
    for path in sorted(export_dir.glob("*.onnx")):
        m = onnx.load(str(path))
        onnx.checker.check_model(m)
        assert lint(m) == [], path.name
        ops = [n.op_type for n in m.graph.node]
        spec = Manifest.read(path.with_suffix(".json")).step
        assert ops.count("Softmax") == spec.n_layers, "one fused softmax per layer"
        assert not {"Expand", "Where", "IsNaN", "ScatterND", "Shape", "Range"} & set(ops)
        inputs = {i.name: [d.dim_value for d in i.type.tensor_type.shape.dim] for i in m.graph.input}
        assert all(all(d > 0 for d in s) for s in inputs.values()), "static shapes"
        keys = [n for n in inputs if n.startswith("past_key_")]
        assert len(keys) == spec.n_layers == len([n for n in inputs if n.startswith("past_value_")])
        n = spec.context - 1
        assert inputs["past_key_0"] == [1, spec.n_kv, spec.head_dim, n]
        outputs = {o.name: [d.dim_value for d in o.type.tensor_type.shape.dim] for o in m.graph.output}
        if spec.layout == "ring":
            assert outputs["new_key_0"] == [1, spec.n_kv, spec.head_dim, 1]
            assert outputs["new_value_0"] == [1, spec.n_kv, 1, spec.head_dim]
        else:
            assert outputs["present_key_0"] == inputs["past_key_0"]
    ring = Manifest.read(export_dir / "talker-ring.json")
    assert ring.step.n_layers == cfg.lm.num_hidden_layers
    b_ring = ring.boundary_bytes()["total"]
    b_roll = Manifest.read(export_dir / "talker-roll.json").boundary_bytes()["total"]
    assert b_ring < b_roll


def test_step_manifests_describe_the_graphs(export_dir, tiny_ckpt, tmp_path):
    """Each graph's manifest (the format every export target writes) lists the graph's inputs,
    state and outputs as ONNX Runtime sees them, its file hash, the self-check against the torch
    step, the source and versions, and for Code2Wav the codec identity a client checks."""
    import json
    import shutil

    from omni_stream.export.manifest import codec_identity

    for path in sorted(p for p in export_dir.glob("*.onnx") if "." not in p.stem):  # fp32 graphs
        m = Manifest.read(path.with_suffix(".json"))
        sess = OrtRunner(path).session
        graph_in = [(i.name, tuple(i.shape)) for i in sess.get_inputs()]
        assert graph_in == [(t.name, t.shape) for t in m.inputs + m.state], path.name
        assert [(o.name, tuple(o.shape)) for o in sess.get_outputs()] == [(t.name, t.shape) for t in m.outputs]
        assert (m.format, m.part, m.step.layout) == ("onnx", path.stem.split("-")[0], path.stem.split("-")[1])
        assert m.check_files() == path and m.files[0].bytes == path.stat().st_size
        assert m.verified["steps"] == 8 and m.verified["snr_db"] >= 100.0
        assert m.source_checkpoint == str(tiny_ckpt.resolve()) and m.exporter["onnxruntime"]
        if m.part == "code2wav":
            assert m.codec == codec_identity(tiny_ckpt) and m.chunk_frames == (1, 1)
            assert [t.name for t in m.state][-1].startswith("tail_")
        else:
            assert m.codec is None and m.chunk_frames is None
    # a graph that changed after its export is refused before any runtime loads it
    bad = tmp_path / "bad"
    shutil.copytree(export_dir, bad, ignore=shutil.ignore_patterns("*.w*a16*"))
    (bad / "code_predictor-ring.onnx").write_bytes(b"\0" * 64)
    with pytest.raises(ManifestError, match="is corrupt or was replaced"):
        load_decoder(bad, "ring")
    raw = json.loads((bad / "talker-ring.json").read_text())
    del raw["step"]
    (bad / "talker-ring.json").write_text(json.dumps(raw))
    with pytest.raises(ManifestError, match="needs its 'step' section"):
        Manifest.read(bad / "talker-ring.json")


def test_sanitizer_removes_guards_allowzero_and_scalar_axes():
    from onnx import TensorProto, helper, numpy_helper
    import onnxruntime as ort

    x = helper.make_tensor_value_info("x", TensorProto.FLOAT, [2, 3])
    y = helper.make_tensor_value_info("y", TensorProto.FLOAT, [1, 6])
    nodes = [helper.make_node("IsNaN", ["x"], ["nan"]),
             helper.make_node("Where", ["nan", "zero", "x"], ["g"]),
             helper.make_node("Reshape", ["g", "shape"], ["r"], allowzero=1),
             helper.make_node("Unsqueeze", ["r", "ax"], ["u"]),
             helper.make_node("Squeeze", ["u", "ax"], ["s"]),
             helper.make_node("Pow", ["s", "two"], ["y"])]
    inits = [numpy_helper.from_array(np.array(0.0, np.float32), "zero"),
             numpy_helper.from_array(np.array([1, 6], np.int64), "shape"),
             numpy_helper.from_array(np.array(0, np.int64), "ax"),
             numpy_helper.from_array(np.array(2.0, np.float32), "two")]
    m = helper.make_model(helper.make_graph(nodes, "g", [x], [y], inits),
                          opset_imports=[helper.make_opsetid("", 20)])
    found = " | ".join(lint(m))  # (ORT itself rejects the rank-0 axes)
    for what in ("IsNaN", "Where", "allowzero=1", "Unsqueeze '' rank-0 axes", "Squeeze '' rank-0 axes",
                 "op Pow not in the allowlist"):
        assert what in found
    feed = {"x": np.arange(6, dtype=np.float32).reshape(2, 3) - 2.5}
    report = sanitize(m)
    assert report["guards_removed"] == 1 and report["reshape_allowzero_fixed"] == 1
    assert report["axes_made_1d"] == 1 and report["dead_nodes_removed"] == 1
    assert report["pow2_to_mul"] == 1  # Pow(x, 2) -> Mul(x, x)
    assert lint(m) == []
    np.testing.assert_array_equal(ort.InferenceSession(m.SerializeToString()).run(None, feed)[0],
                                  feed["x"].reshape(1, 6) ** 2)
    y23 = helper.make_tensor_value_info("y", TensorProto.FLOAT, [2, 3])
    cube = helper.make_model(helper.make_graph([helper.make_node("Pow", ["x", "three"], ["y"])], "c", [x], [y23],
                                               [numpy_helper.from_array(np.array(3.0, np.float32), "three")]),
                             opset_imports=[helper.make_opsetid("", 20)])
    with pytest.raises(OpCheckError, match="Pow x1"):  # only a square is rewritten
        sanitize(cube)
    bad = helper.make_model(helper.make_graph([helper.make_node("Expand", ["x", "shape"], ["y"])], "b", [x], [y],
                                              inits[1:2]), opset_imports=[helper.make_opsetid("", 20)])
    with pytest.raises(OpCheckError, match="Expand x1"):
        check_ops(bad, NPU_OPS)


# ------------------------------------------------------------------------------ quantized
def test_quantized_variants_fidelity(export_dir, history, model):
    from omni_stream.export.onnx_quantize import calibration_feeds, quantize_step

    feeds = calibration_feeds(model, "ring", TALKER_CONTEXT, 16, frames=16)
    report = {}
    for part, replay in (("talker", replay_talker), ("code_predictor", replay_code_predictor)):
        run, spec = _runner(export_dir, part, "ring")
        ref = replay(run, spec, history)
        for scheme in ("w8a16", "w4a16"):
            q = quantize_step(export_dir / f"{part}-ring.onnx", export_dir / f"{part}-ring.{scheme}.onnx",
                              feeds[part], scheme)
            qm = onnx.load(str(q))
            assert lint(qm) == []
            wtypes = {t.data_type for t in qm.graph.initializer}
            assert (onnx.TensorProto.INT8 if scheme == "w8a16" else onnx.TensorProto.INT4) in wtypes
            assert "DequantizeLinear" in {n.op_type for n in qm.graph.node}
            qman = Manifest.read(q.with_suffix(".json"))  # the variant's own manifest
            assert qman.quantization == scheme and qman.check_files() == q and qman.step == spec.step
            report[(part, scheme)] = compare_logits(ref, replay(OrtRunner(q), qman, history))
    for k, r in report.items():
        print(f"\n{k[0]} {k[1]} vs fp32: top-1 {r['top1']:.3f}, top-5 {r['top5']:.3f}, SNR {r['snr_db']:.1f} dB")
    for part in ("talker", "code_predictor"):
        w8, w4 = report[(part, "w8a16")], report[(part, "w4a16")]
        assert w8["snr_db"] >= 25.0 and w8["top1"] >= 0.9
        assert w4["snr_db"] >= 10.0
        assert w8["snr_db"] > w4["snr_db"] + 6.0  # 4 more weight bits are visible
    # the runtime loop runs on the quantized graphs too
    codes = load_decoder(export_dir, "ring", suffix=".w8a16").generate(history.prompt, history.trailing, 8,
                                                                       stop_on_eos=False)
    assert codes.shape == (8, 16) and codes[:, 1:].max() < 2048


# ------------------------------------------------------------------------------ bad input
def test_unsupported_part_is_a_clear_error(tiny_ckpt, tmp_path):
    with pytest.raises(SystemExit, match="unsupported part 'vocoder'.*talker, code_predictor, code2wav"):
        cli_main(["export-step", "--model", str(tiny_ckpt), "--part", "vocoder", "--context", "16",
                  "--out", str(tmp_path)])


def test_context_smaller_than_the_prompt(export_dir, history):
    dec = load_decoder(export_dir, "ring")
    long_prompt = np.zeros((TALKER_CONTEXT + 4, history.prompt.shape[1]), np.float32)
    with pytest.raises(ValueError, match=f"context {TALKER_CONTEXT}; export with --context >= "):
        dec.generate(long_prompt, history.trailing, 10)
    with pytest.raises(ValueError, match="exceeds the talker context"):
        dec.generate(history.prompt, history.trailing, TALKER_CONTEXT)


def test_bad_contexts_and_layouts(model, tiny_ckpt, tmp_path, capsys):
    with pytest.raises(StepError, match="smaller than its per-frame sequence of 16 positions.*--context 16"):
        code_predictor_step(model.weights.talker, "ring", 8)
    rc = cli_main(["export-step", "--model", str(tiny_ckpt), "--part", "code2wav", "--context", "64",
                   "--out", str(tmp_path)])
    assert rc == 2
    assert "sliding window of 72 frames; use --context 72" in capsys.readouterr().err
    with pytest.raises(StepError, match="unknown cache layout 'spiral'"):
        talker_step(model.weights.talker, "spiral", 32)


def test_model_without_the_expected_layers(model, tiny_ckpt, tmp_path, capsys):
    # a module tree that lost a layer
    talker = copy.deepcopy(model.weights.talker)
    del talker.model.layers[1]
    with pytest.raises(StepError, match="1 decoder layers but the config declares 2"):
        talker_step(talker, "ring", 32)
    # not a decoder stack at all
    with pytest.raises(StepError, match="expected a decoder stack"):
        DecoderStep(torch.nn.Linear(4, 4), [torch.zeros(4, 4)], "ring", 8)
    # a checkpoint folder whose weights lack a layer: the strict loader names the tensor
    import shutil

    from safetensors.torch import load_file, save_file

    bad = tmp_path / "ck"
    shutil.copytree(tiny_ckpt, bad)
    sd = {k: v for k, v in load_file(str(bad / "model.safetensors")).items()
          if not k.startswith("talker.model.layers.1.")}
    save_file(sd, str(bad / "model.safetensors"))
    rc = cli_main(["export-step", "--model", str(bad), "--part", "talker", "--context", "32",
                   "--out", str(tmp_path / "out")])
    assert rc == 2
    assert "missing tensors: talker.model.layers.1." in capsys.readouterr().err
    assert not (tmp_path / "out" / "talker-ring.onnx").exists()
