"""Code2Wav on a tiny config: streamed == one-pass at any chunking, per-slot state, weights.

The tiny config keeps the released upsampling (1920 samples per frame) and the 72-frame attention
window; sequences are longer than 150 frames so the window slides. Layer scales and ConvNeXt gains
are raised from their init values so every streamed path (attention window, ConvNeXt tails)
visibly shapes the output: a wrong tail would show up far above the 1e-5 tolerance.
"""

from __future__ import annotations

import json
import os
import random
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from omni_stream.config import Code2WavConfig
from omni_stream.models.code2wav import Code2Wav, Code2WavStream, random_code2wav_state_dict

TINY = Code2WavConfig(hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                      num_attention_heads=4, num_key_value_heads=4, head_dim=8, latent_dim=32,
                      codebook_dim=16, codebook_size=64, decoder_dim=64, sliding_window=72)
SPF = 1920
FRAMES = 160
TOL = 1e-5


def _codes(seed: int, batch: int = 1, frames: int = FRAMES) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    return torch.randint(0, TINY.codebook_size, (batch, TINY.num_quantizers, frames), generator=g)


def _build(gemm_min_channels: int = 768) -> Code2Wav:
    m = Code2Wav(TINY, gemm_min_channels=gemm_min_channels).eval()
    m.load_state_dict(random_code2wav_state_dict(TINY, seed=0, layer_scale=0.3, convnext_gamma=0.3),
                      strict=True)
    return m


@pytest.fixture(scope="module", autouse=True)
def _one_thread():
    n = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(n)


@pytest.fixture(scope="module")
def model() -> Code2Wav:
    return _build()


@pytest.fixture(scope="module")
def codes() -> torch.Tensor:
    return _codes(1, batch=2)  # two different streams


@pytest.fixture(scope="module")
def ref(model: Code2Wav, codes: torch.Tensor) -> torch.Tensor:
    with torch.no_grad():
        return model(codes)  # [2, FRAMES * SPF]


def _splits(chunking: str) -> list[int]:
    if chunking == "random":
        rng = random.Random(7)
        out: list[int] = []
        while sum(out) < FRAMES:
            out.append(rng.choice([1, 1, 2, 3, 5, 8, 13, 40, 75]))
        out[-1] -= sum(out) - FRAMES
        return out
    n = int(chunking)
    return [min(n, FRAMES - a) for a in range(0, FRAMES, n)]


def _stream(model: Code2Wav, codes: torch.Tensor, splits: list[int], slots=(2, 0),
            max_slots: int = 3) -> torch.Tensor:
    s = Code2WavStream(model, max_slots)
    outs, a = [], 0
    for n in splits:
        y = s.decode(list(slots), codes[:, :, a:a + n])
        assert y.shape == (codes.shape[0], n * SPF)
        outs.append(y)
        a += n
    return torch.cat(outs, dim=-1)


def test_config_keeps_released_upsampling(model: Code2Wav, ref: torch.Tensor) -> None:
    assert model.samples_per_frame == SPF
    assert ref.shape == (2, FRAMES * SPF)
    assert ref.abs().max() <= 1.0


@pytest.mark.parametrize("chunking", ["1", "2", "3", "25", "random"])
def test_streamed_equals_one_pass(model, codes, ref, chunking) -> None:
    out = _stream(model, codes, _splits(chunking))
    assert (out - ref).abs().max().item() <= TOL


@pytest.mark.parametrize("chunking", ["1", "random"])
def test_streamed_equals_one_pass_all_gemm_kernels(codes, ref, chunking) -> None:
    """The GEMM streaming kernels (used for the wide layers at real dims) on every layer."""
    out = _stream(_build(gemm_min_channels=0), codes, _splits(chunking))
    assert (out - ref).abs().max().item() <= TOL


def test_slots_with_different_histories_share_one_batch(model, ref, codes) -> None:
    s = Code2WavStream(model, max_slots=3)
    a = s.decode([0], codes[0:1, :, :100])
    b = s.decode([1], codes[1:2, :, :37])
    # one call: slot 1 (frame 37..) and slot 0 (frame 100..), rows in that order
    both = s.decode([1, 0], torch.stack([codes[1, :, 37:50], codes[0, :, 100:113]]))
    assert (a - ref[0:1, :100 * SPF]).abs().max() <= TOL
    assert (b - ref[1:2, :37 * SPF]).abs().max() <= TOL
    assert (both[0] - ref[1, 37 * SPF:50 * SPF]).abs().max() <= TOL
    assert (both[1] - ref[0, 100 * SPF:113 * SPF]).abs().max() <= TOL
    assert s.state.pos.tolist() == [113, 50, 0]
    assert all(t[2].abs().max() == 0 for t in (*s.state.tails, *s.state.keys, *s.state.values))


def test_reset_gives_a_fresh_stream(model, ref, codes) -> None:
    s = Code2WavStream(model, max_slots=2)
    s.decode([0, 1], codes[:, :, :90])
    s.reset(0)
    fresh = torch.cat([s.decode([0], codes[1:2, :, a:a + 30]) for a in range(0, FRAMES, 30)], -1)
    assert (fresh - ref[1:2]).abs().max() <= TOL
    rest = s.decode([1], codes[1:2, :, 90:FRAMES])  # slot 1 was not disturbed by the reset
    assert (rest - ref[1:2, 90 * SPF:]).abs().max() <= TOL


def test_attention_window_is_72_frames_including_self(model) -> None:
    """HF sliding window: query i sees keys j with i - 72 < j <= i; 2 layers reach back 142."""
    tr = model.pre_transformer
    x = torch.randn(1, 150, TINY.latent_dim, generator=torch.Generator().manual_seed(3))
    x2 = x.clone()
    x2[:, 0] += 1.0
    with torch.no_grad():
        d = (tr(x2) - tr(x)).abs().amax(dim=-1)[0]  # [150]
    assert (d[:143] > 0).all()
    assert (d[143:] == 0).all()


def test_state_layout(model) -> None:
    st = model.new_state(5)
    w = TINY.sliding_window
    assert st.pos.shape == (5,) and st.pos.dtype == torch.long
    assert len(st.keys) == len(st.values) == TINY.num_hidden_layers
    assert st.keys[0].shape == (5, TINY.num_key_value_heads, w - 1, TINY.head_dim)
    # pre_conv (2) + 2 ConvNeXt (6) + decoder.0 (6) + 4 blocks x (prev column + 3 dilated) + out (6)
    lengths = sorted(t.shape[-1] for t in st.tails)
    assert lengths == sorted([2, 6, 6, 6, 6] + [1, 6, 18, 54] * 4)


def test_random_state_dict_is_audible_and_loads_strictly() -> None:
    sd = random_code2wav_state_dict(TINY, seed=5)
    m = Code2Wav(TINY).eval()
    assert set(sd) == set(m.state_dict())
    assert not any(k.startswith("decoder.decoder.") or k.startswith("decoder.quantizer") for k in sd)
    m.load_state_dict(sd, strict=True)
    with torch.no_grad():
        wav = m(_codes(2, frames=40))
    rms = wav.pow(2).mean().sqrt().item()
    assert 0.05 < rms < 0.6, rms
    assert (wav.abs() >= 1).float().mean() < 0.01  # rarely clipped
    again = random_code2wav_state_dict(TINY, seed=5)
    other = random_code2wav_state_dict(TINY, seed=6)
    k = "quantizer.rvq_first.vq.layers.0._codebook.embedding_sum"
    assert torch.equal(sd[k], again[k]) and not torch.equal(sd[k], other[k])


def test_parameter_names_follow_the_official_checkpoint() -> None:
    with torch.device("meta"):
        names = set(Code2Wav(Code2WavConfig()).state_dict())
    expected = [
        "quantizer.rvq_first.vq.layers.0._codebook.embedding_sum",
        "quantizer.rvq_first.vq.layers.0._codebook.cluster_usage",
        "quantizer.rvq_first.output_proj.weight", "quantizer.rvq_first.input_proj.weight",
        "quantizer.rvq_rest.vq.layers.14._codebook.embedding_sum",
        "pre_conv.conv.weight", "pre_transformer.input_proj.weight",
        "pre_transformer.layers.0.self_attn.q_proj.weight",
        "pre_transformer.layers.7.self_attn_layer_scale.scale", "pre_transformer.norm.weight",
        "upsample.0.0.conv.weight", "upsample.0.1.dwconv.conv.weight", "upsample.0.1.gamma",
        "decoder.0.conv.weight", "decoder.1.block.0.alpha", "decoder.1.block.1.conv.weight",
        "decoder.1.block.2.conv1.conv.weight", "decoder.4.block.4.conv2.conv.bias",
        "decoder.5.alpha", "decoder.6.conv.weight",
    ]
    assert not [k for k in expected if k not in names]
    assert len(names) == 271  # the released decoder's state_dict size


def test_codebook_embedding_is_sum_over_usage(model, ref, codes) -> None:
    sd = {k: v.clone() for k, v in model.state_dict().items()}
    for k in ("quantizer.rvq_first.vq.layers.0._codebook", "quantizer.rvq_rest.vq.layers.3._codebook"):
        sd[f"{k}.embedding_sum"] *= 4.0
        sd[f"{k}.cluster_usage"] *= 4.0
    m = Code2Wav(TINY).eval()
    m.load_state_dict(sd)
    with torch.no_grad():
        out = m(codes[:, :, :20])
    assert (out - ref[:, :20 * SPF]).abs().max() <= TOL


@pytest.mark.parametrize("bad, match", [
    (torch.zeros(1, 15, 4, dtype=torch.long), "16 codebooks"),
    (torch.zeros(1, 16, dtype=torch.long), "16 codebooks"),
    (torch.full((1, 16, 4), 64), r"\[0, 64\).*codebook_size"),
    (torch.full((1, 16, 4), -1), r"\[0, 64\)"),
    (torch.zeros(1, 16, 4), "integer"),
    (torch.zeros(1, 16, 0, dtype=torch.long), "at least one"),
])
def test_bad_codes_raise_value_error(model, bad, match) -> None:
    with pytest.raises(ValueError, match=match):
        model(bad)
    with pytest.raises(ValueError, match=match):
        Code2WavStream(model, 1).decode([0], bad)


def test_bad_slots_raise_value_error(model) -> None:
    s = Code2WavStream(model, 2)
    ok = torch.zeros(2, 16, 1, dtype=torch.long)
    with pytest.raises(ValueError, match="2 slots for 1 rows"):
        s.decode([0, 1], ok[:1])
    with pytest.raises(ValueError, match="distinct"):
        s.decode([1, 1], ok)
    with pytest.raises(ValueError, match=r"\[0, 2\)"):
        s.decode([0, 2], ok)
    with pytest.raises(ValueError, match=r"\[0, 2\)"):
        s.reset(3)
    assert s.state.pos.tolist() == [0, 0]  # nothing was decoded


def test_bf16_under_inference_mode(model, ref, codes) -> None:
    mb = _build().to(torch.bfloat16)
    with torch.inference_mode():
        s = Code2WavStream(mb, 2)
        assert s.state.keys[0].dtype == torch.bfloat16
        out = torch.cat([s.decode([0, 1], codes[:, :, a:a + 16]) for a in range(0, 96, 16)], -1)
    want = ref[:, :96 * SPF]
    rel = ((out.float() - want).pow(2).mean() / want.pow(2).mean()).sqrt().item()
    assert out.dtype == torch.bfloat16 and rel < 0.15, rel


def test_state_made_outside_inference_mode_updates_inside(model, ref, codes) -> None:
    s = Code2WavStream(model, 2)
    with torch.inference_mode():
        a = s.decode([0, 1], codes[:, :, :10])
    b = s.decode([0, 1], codes[:, :, 10:20])
    assert (torch.cat([a, b], -1) - ref[:, :20 * SPF]).abs().max() <= TOL


@pytest.mark.parametrize("gemm_min_channels", [768, 0])
def test_packed_bf16_weights_decode_as_the_unpacked(codes, ref, gemm_min_channels) -> None:
    """``pack()`` (bf16 on CPU: oneDNN's blocked weights, made once) streams the same audio as
    the unpacked bf16 model, within bf16 rounding, and is as close to the fp32 decode."""
    plain, packed = _build(gemm_min_channels).to(torch.bfloat16), _build(gemm_min_channels).to(torch.bfloat16)
    try:  # with the CPU runtime's one-pass Snake where it builds
        from omni_stream.engine.cpu.abi import snake_kernel
        snake = snake_kernel()
    except Exception:
        snake = None
    if not packed.pack(snake=snake):
        pytest.skip("this torch has no oneDNN bf16 packing")
    splits = _splits("random")[:12]
    n = sum(splits)
    with torch.inference_mode():
        a, b = (_stream(m, codes, splits).float() for m in (plain, packed))
    want = ref[:, :n * SPF]

    def snr(x, y):
        return 10 * torch.log10(y.pow(2).sum() / (x - y).pow(2).sum().clamp_min(1e-30)).item()

    assert snr(b, a) > 20, snr(b, a)
    assert snr(b, want) > snr(a, want) - 3, (snr(b, want), snr(a, want))


@pytest.mark.parametrize("gemm_min_channels", [768, 0])
def test_packed_fp32_streams_the_one_pass_and_the_same_bits_at_any_chunks_and_batch(
        codes, ref, gemm_min_channels) -> None:
    """``pack()`` in fp32 (every conv that is not depthwise as a packed GEMM, the quantizer's
    projection packed, a lone row computed as one of two, each query's keys contiguous) streams
    the one-pass decode within fp32 rounding, and one stream's audio is the same bits at any
    chunk plan, with or without another stream in its calls. Unpacked, fp32 rounds by the
    call's length (oneDNN's conv, MKL's GEMV for one row, matmul over a strided window), so
    a seeded request's samples moved by 1 LSB with the timing of its chunks."""
    m = _build(gemm_min_channels)
    if not m.pack():
        pytest.skip("this torch has no oneDNN packing")
    n = 24
    with torch.inference_mode():
        def one(splits: list[int], other: bool) -> torch.Tensor:
            s, outs, a = Code2WavStream(m, 3), [], 0
            if other:  # another stream, 3 frames ahead, shares every call
                s.decode([2], codes[1:, :, :3])
            for k in splits:
                if other and a + k + 3 <= n:
                    y = s.decode([0, 2], torch.cat([codes[:1, :, a:a + k], codes[1:, :, a + 3:a + 3 + k]]))
                else:
                    y = s.decode([0], codes[:1, :, a:a + k])
                outs.append(y[0])
                a += k
            return torch.cat(outs)

        want = one([4] * 6, False)
        assert (want - ref[0, :n * SPF]).abs().max() <= TOL
        for splits, other in (([1] * n, False), ([n], False), ([1, 2, 3, 5, 7, 6], False),
                              ([3, 5, 2, 6, 1, 7], True), ([1] * n, True)):
            got = one(splits, other)  # the same bits (torch.equal calls -0.0 and 0.0 equal)
            assert torch.equal(got.view(torch.int32), want.view(torch.int32)), (splits, other)


def _in_bf16(module: torch.nn.Module) -> None:
    """Run ``module`` in bf16 inside an fp32 model (a mixed-precision decode): its parameters
    cast, its input cast down and its output back up."""
    module.to(torch.bfloat16)
    inner = module.forward

    def forward(x, *args, **kw):
        return inner(x.bfloat16(), *args, **kw).float()

    module.forward = forward


@pytest.mark.parametrize("part", ["pre_transformer", "decoder.1", "upsample.0.0"])
def test_a_part_in_bf16_streams_beside_an_fp32_state(codes, part) -> None:
    """A mixed-precision decode (one part in bf16, the state and the rest fp32) streams: the
    part reads and writes its conv tails and attention cache in its own dtype, and the streamed
    audio is its one-pass decode's, within bf16 rounding."""
    m = _build()
    _in_bf16(m.get_submodule(part))
    with torch.no_grad():
        one_pass = m(codes)
        streamed = _stream(m, codes, _splits("random"))
        full = _build()(codes)
    assert streamed.dtype == torch.float32 and streamed.shape == one_pass.shape
    snr = lambda x, r: float(10 * torch.log10(r.pow(2).sum() / (x - r).pow(2).sum()))  # noqa: E731
    assert snr(streamed, one_pass) >= 30  # bf16 rounding differs by chunk (code2wav_precision)
    assert 20 <= snr(one_pass, full) < 100  # the part really ran in bf16


def _isa_levels() -> list[str]:
    """No cap (what a server runs) and every oneDNN level from AVX2 up that this CPU runs."""
    from omni_stream.models.onednn import LEVELS, cpu_flags, supported_levels

    have = supported_levels(cpu_flags())
    return ["DEFAULT"] + [lv for lv in have if LEVELS.index(lv) >= LEVELS.index("AVX2")]


@pytest.mark.parametrize("level", _isa_levels())
def test_codec_stage_kernels_give_one_stream_the_same_bits_for_any_chunks_and_batch(level) -> None:
    """At the released widths, the codec stage's bf16 decode (packed weights, the runtime's
    Snake) of one stream is bit-identical whatever chunks its frames come in and whichever
    streams share its calls: every product's rows, the attention per query and the Snake per
    value are computed alike at any chunk length (``windowed_attend``, the quantizer's per-row
    projection, the kernel's masked tail), with oneDNN pinned at ``AVX512_CORE_BF16`` (its AMX
    kernels and its emulated bf16 below that round by row count). Plain bf16 torch kernels
    differ by chunk (~30 dB). Run under each ``ONEDNN_MAX_CPU_ISA`` level this CPU has, in a
    fresh process each (oneDNN reads the cap once): no cap must give the guarantee wherever the
    CPU has AVX512-BF16; every level builds the decoder without error (AVX2 has no packed bf16
    linear); a level where the code claims the guarantee must keep it, and one where it does
    not is skipped with that reason."""
    pytest.importorskip("omni_stream.engine.cpu.native")
    from omni_stream.models.onednn import DECODE_LEVEL, ENV, cpu_flags, supported_levels

    env = {k: v for k, v in os.environ.items() if k != ENV}
    if level != "DEFAULT":
        env[ENV] = level
    run = subprocess.run([sys.executable, str(Path(__file__).with_name("isa_decode_check.py"))],
                         env=env, capture_output=True, text=True, timeout=600)
    assert run.returncode == 0, run.stderr[-3000:]
    got = json.loads(run.stdout.strip().splitlines()[-1])
    if level == "DEFAULT" and DECODE_LEVEL in supported_levels(cpu_flags()):
        assert got["level"] == DECODE_LEVEL and got["claim"], got
    if not got["claim"]:
        pytest.skip(f"oneDNN at {got['level']}: the bf16 decode is not chunk-plan invariant "
                    f"there (packed weights: {got['packed']}; models/onednn.py)")
    assert got["packed"], got
    assert got["plans"] and all(got["plans"].values()), got


def test_codec_stage_start_up_check_sees_whether_chunking_changes_the_bits() -> None:
    """``CodecStage.check_invariance`` (run at start-up where the weights are packed) decodes
    random frames one by one and as one chunk: the packed bf16 decoder passes, a decoder whose
    rounding follows the call's length fails, and slot 0 is fresh afterwards either way."""
    from omni_stream.engine.cpu.abi import snake_kernel
    from omni_stream.stages.codec_stage import CodecStage

    class Out:
        def put(self, *a, **kw) -> bool:
            return True

    m = _build().bfloat16()
    if not m.pack(snake=snake_kernel()):
        pytest.skip("oneDNN's packed bf16 kernels are not available here")
    stage = CodecStage(m, max_slots=2, out=Out())
    assert stage.check_invariance(frames=3)
    real = stage.dec.decode

    def by_length(slots, codes):  # a kernel whose rounding depends on the row count
        y = real(slots, codes)
        return y + codes.shape[2] * 2.0 ** -12 if codes.shape[2] > 1 else y

    stage.dec.decode = by_length
    assert not stage.check_invariance(frames=3)
    st = stage.dec.state
    assert int(st.pos[0]) == 0 and all(float(t[0].abs().sum()) == 0 for t in st.tails)
