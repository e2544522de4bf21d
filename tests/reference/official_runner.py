"""Run the official ``qwen-tts`` package as a reference. Executed BY THE REFERENCE PYTHON.

This script is run with the interpreter that ``tests/reference/refenv.py`` builds (it imports
``qwen_tts`` and ``transformers==4.57.3``); it never imports omni_stream. It only calls the
official package's public classes and the wrapper's own prompt helpers, so what it records is
what the official code computes.

Subcommands (all on CPU, float32):

  generate    --model DIR --requests REQ.json --out OUT.npz [--decode] [--attn eager]
              Greedy codes (and prompt token ids, prefill embeddings, per-frame time) per request.
  decode      --model DIR --codes CODES.npy|.npz --out WAV.npy|.npz
              The official speech tokenizer's decode of [frames, 16] codes.
  save-random --variant custom_voice --out DIR [--seed 0]
              Tiny random checkpoint built from config by the official classes and written with
              their save_pretrained (released layout).
  keys        --model DIR [--summary]
              JSON: state_dict key -> shape of the official model and speech tokenizer built
              from DIR's configs, compared with the tensors stored in DIR.
  tokenize    --model DIR --text T [--text T2] | --texts TEXTS.json
              JSON: token ids as the official wrapper produces them (raw, assistant turn,
              instruct turn) and the pre-tokenizer it ends up using.
  voice-prompt --model BASE_DIR --requests REQ.json --out OUT.npz [--threads N]
              create_voice_clone_prompt per request {"id", "ref_audio": wav path, "ref_text",
              "x_vector_only"}: OUT keys {id}.x_vector float32 [C], {id}.ref_codes int64
              [frames, 16] (ICL mode). Fails unless the loaded encoder / speaker encoder hold
              exactly the file's tensors.
  clone       --model BASE_DIR --requests REQ.json --out OUT.npz [--threads N] [--attn eager]
              Greedy voice-clone generation (requests add "text", "language",
              "non_streaming_mode", "max_new_tokens"): {id}.codes int64 [frames, 16] (generated
              codes only, without the reference codes), {id}.x_vector, {id}.ref_codes,
              {id}.input_ids, {id}.ref_ids.

A request (REQ.json is a list of them):
  {"id": "a", "text": "Hello.", "speaker": "ryan" | null, "language": "english" | "auto" | null,
   "instruct": "..." | null, "variant": "custom_voice" | "voice_design",
   "max_new_tokens": 20, "greedy": true, "non_streaming_mode": true,
   "attn_implementation": "eager" (optional), "repetition_penalty": 1.05 (optional)}

OUT.npz keys per request id X: codes_X int64 [frames, 16], input_ids_X int64 [n] (assistant
text), instruct_ids_X (if an instruction was used), ms_per_frame_X, generate_s_X, hidden_X
(talker final hidden state per frame), prefill_embeds_X [L, hidden], trailing_text_X,
wav_X (with --decode); plus ``meta`` (a JSON string: versions, attention implementations per
module, generation kwargs, tokenizer pre-tokenizer, instruct drops).
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time
import warnings
from pathlib import Path

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TRANSFORMERS_OFFLINE", "1")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
warnings.filterwarnings("ignore")

import contextlib  # noqa: E402

import numpy as np  # noqa: E402
import torch  # noqa: E402

# qwen_tts prints a flash-attn banner on import: keep stdout clean for JSON output
with contextlib.redirect_stdout(sys.stderr):
    import qwen_tts  # noqa: E402,F401
import transformers  # noqa: E402

if not os.environ.get("OMNI_STREAM_REFENV_VERBOSE"):
    # e.g. the (tolerated) list of random-initialised speech-tokenizer encoder weights
    transformers.utils.logging.set_verbosity_error()

SPECIAL_TEXT_TOKENS = {
    151643: "<|endoftext|>", 151644: "<|im_start|>", 151645: "<|im_end|>",
    151646: "<|object_ref_start|>", 151647: "<|object_ref_end|>", 151648: "<|box_start|>",
    151649: "<|box_end|>", 151650: "<|quad_start|>", 151651: "<|quad_end|>",
    151652: "<|vision_start|>", 151653: "<|vision_end|>", 151654: "<|vision_pad|>",
    151655: "<|image_pad|>", 151656: "<|video_pad|>", 151657: "<tool_call>",
    151658: "</tool_call>", 151659: "<|fim_prefix|>", 151660: "<|fim_middle|>",
    151661: "<|fim_suffix|>", 151662: "<|fim_pad|>", 151663: "<|repo_name|>",
    151664: "<|file_sep|>", 151665: "<tool_response>", 151666: "</tool_response>",
    151667: "<think>", 151668: "</think>", 151669: "<|audio_start|>", 151670: "<|audio_end|>",
    151671: "<tts_pad>", 151672: "<tts_text_bos>", 151673: "<tts_text_eod>",
    151674: "<tts_text_bos_single>", 151675: "<|audio_pad|>",
}
BASE_TEXT_VOCAB = 151643
LANGUAGES = {
    "chinese": 2055, "english": 2050, "german": 2053, "spanish": 2054, "japanese": 2058,
    "french": 2061, "korean": 2064, "russian": 2069, "italian": 2070, "portuguese": 2071,
    "sichuan_dialect": 2062, "beijing_dialect": 2074,
}
SPEAKERS = {
    "vivian": 3065, "serena": 3066, "uncle_fu": 3010, "ryan": 3061, "aiden": 2861,
    "ono_anna": 2873, "sohee": 2864, "eric": 2875, "dylan": 2878,
}
SPEAKER_DIALECT = {name: False for name in SPEAKERS}
SPEAKER_DIALECT.update({"eric": "sichuan_dialect", "dylan": "beijing_dialect"})
CODEC_IDS = dict(codec_pad_id=2148, codec_bos_id=2149, codec_eos_token_id=2150,
                 codec_think_id=2154, codec_nothink_id=2155, codec_think_bos_id=2156,
                 codec_think_eos_id=2157)
GENERATION_DEFAULTS = dict(
    do_sample=True, repetition_penalty=1.05, temperature=0.9, top_p=1.0, top_k=50,
    subtalker_dosample=True, subtalker_temperature=0.9, subtalker_top_p=1.0, subtalker_top_k=50,
    max_new_tokens=8192,
)
# speech_tokenizer/preprocessor_config.json as released (AutoFeatureExtractor needs it).
SPEECH_PREPROCESSOR = {
    "chunk_length_s": None, "feature_extractor_type": "EncodecFeatureExtractor",
    "feature_size": 1, "overlap": None, "padding_side": "right", "padding_value": 0.0,
    "return_attention_mask": True, "sampling_rate": 24000,
}


def log(msg: str) -> None:
    print(f"[official_runner] {msg}", file=sys.stderr, flush=True)


# --------------------------------------------------------------------------------------------
# loading


def _speech_dir(path: Path) -> Path:
    return path / "speech_tokenizer" if (path / "speech_tokenizer" / "config.json").is_file() else path


def load_wrapper(model_dir: str, attn: str | None, dtype: str = "float32"):
    from qwen_tts import Qwen3TTSModel

    kwargs = dict(dtype=getattr(torch, dtype))
    if attn:
        kwargs["attn_implementation"] = attn
    t0 = time.perf_counter()
    w = Qwen3TTSModel.from_pretrained(model_dir, **kwargs)
    w.model.eval()
    log(f"loaded {model_dir} (attn={attn or 'default'}) in {time.perf_counter() - t0:.1f} s")
    return w


def attn_report(w) -> dict:
    m = w.model
    out = {
        "talker": m.talker.model.config._attn_implementation,
        "code_predictor": m.talker.code_predictor.model.config._attn_implementation,
    }
    st = getattr(m, "speech_tokenizer", None)
    if st is not None:
        out["speech_tokenizer_decoder"] = (
            st.model.decoder.pre_transformer.config._attn_implementation)
    return out


def pretokenizer_report(w) -> str:
    tok = w.processor.tokenizer
    backend = getattr(tok, "backend_tokenizer", None)
    if backend is None:
        return type(tok).__name__
    return json.dumps(json.loads(backend.to_str()).get("pre_tokenizer"))


# --------------------------------------------------------------------------------------------
# generate


def _ids(t) -> np.ndarray:
    return t.detach().cpu().reshape(-1).numpy().astype(np.int64)


def _warmup(w, req: dict) -> None:
    """One short untimed greedy run, so the first request's ms/frame is not a cold start."""
    m = w.model
    call = dict(input_ids=w._tokenize_texts([w._build_assistant_text(req["text"])]),
                languages=[req.get("language") or "Auto"], non_streaming_mode=True,
                **w._merge_generate_kwargs(do_sample=False, subtalker_dosample=False,
                                           max_new_tokens=4))
    if m.tts_model_type == "custom_voice":
        call["speakers"] = [req.get("speaker")]
    t0 = time.perf_counter()
    with torch.no_grad():
        m.generate(**call)
    log(f"warm-up in {time.perf_counter() - t0:.2f} s")


def _save(path: str, out: dict[str, np.ndarray], meta: dict) -> int:
    """Write the arrays and the run's metadata (JSON under ``meta``) as one npz; exit code 0."""
    out["meta"] = np.array(json.dumps(meta, default=str))
    Path(path).parent.mkdir(parents=True, exist_ok=True)
    np.savez(path, **out)
    log(f"wrote {path}")
    return 0


def cmd_generate(args) -> int:
    requests = json.loads(Path(args.requests).read_text())
    if isinstance(requests, dict):
        requests = requests.get("requests", [requests])
    torch.set_num_threads(args.threads)
    wrappers: dict = {}
    out: dict[str, np.ndarray] = {}
    meta: dict = {
        "torch": torch.__version__, "threads": args.threads, "requests": {},
        "attn": {}, "pretokenizer": None,
    }
    meta["transformers"] = transformers.__version__
    keys = key_report(Path(args.model))
    for part in keys.values():
        part.pop("state_dict", None)
    meta["key_check"] = keys
    problems = key_problems(keys)
    for p in problems:
        log(f"key check: {p}")
    if problems and not args.allow_key_mismatch:
        raise SystemExit("the official loader would random-initialise or drop weights of this "
                         "checkpoint (see above); pass --allow-key-mismatch to run anyway")
    for req in requests:
        rid = str(req["id"])
        attn = req.get("attn_implementation", args.attn)
        if attn not in wrappers:
            wrappers[attn] = load_wrapper(args.model, attn, args.dtype)
            meta["attn"][str(attn)] = attn_report(wrappers[attn])
            if args.warmup:
                _warmup(wrappers[attn], req)
        w = wrappers[attn]
        meta["pretokenizer"] = pretokenizer_report(w)
        m = w.model
        variant = req.get("variant") or m.tts_model_type
        if variant != m.tts_model_type:
            raise SystemExit(f"request {rid}: variant {variant} but checkpoint is {m.tts_model_type}")
        text = req["text"]
        language = req.get("language") or "Auto"
        speaker = req.get("speaker")
        instruct = req.get("instruct")
        w._validate_languages([language])
        rmeta: dict = {"attn": attn, "language": language, "speaker": speaker}
        if variant == "custom_voice":
            w._validate_speakers([speaker])
            # the wrapper's rule (generate_custom_voice): a substring test on tts_model_size
            if m.tts_model_size in "0b6" and instruct:
                rmeta["instruct_dropped"] = True
                instruct = None
        elif variant != "voice_design":
            raise SystemExit(f"request {rid}: variant {variant} not supported by this runner")

        input_ids = w._tokenize_texts([w._build_assistant_text(text)])
        instruct_ids = [None]
        if instruct:
            instruct_ids = [w._tokenize_texts([w._build_instruct_text(instruct)])[0]]
        greedy = bool(req.get("greedy", True))
        user_kwargs = dict(max_new_tokens=int(req.get("max_new_tokens", 2048)))
        if greedy:
            user_kwargs.update(do_sample=False, subtalker_dosample=False)
        if req.get("repetition_penalty") is not None:
            user_kwargs["repetition_penalty"] = float(req["repetition_penalty"])
        gen_kwargs = w._merge_generate_kwargs(**user_kwargs)
        rmeta["gen_kwargs"] = gen_kwargs
        if not greedy:
            torch.manual_seed(int(req.get("seed", 0)))

        captured: dict = {}
        talker = m.talker
        orig_generate = talker.generate

        def capture(*a, **kw):
            captured["inputs_embeds"] = kw["inputs_embeds"].detach().clone()
            captured["trailing_text_hidden"] = kw["trailing_text_hidden"].detach().clone()
            return orig_generate(*a, **kw)

        talker.generate = capture
        try:
            call = dict(input_ids=input_ids, instruct_ids=instruct_ids, languages=[language],
                        non_streaming_mode=bool(req.get("non_streaming_mode", True)),
                        **gen_kwargs)
            if variant == "custom_voice":
                call["speakers"] = [speaker]
            t0 = time.perf_counter()
            with torch.no_grad():
                codes_list, hidden_list = m.generate(**call)
            dt = time.perf_counter() - t0
        finally:
            del talker.generate  # drop the instance attribute: the class method is back

        codes = codes_list[0].detach().cpu().numpy().astype(np.int64)
        frames = int(codes.shape[0])
        out[f"codes_{rid}"] = codes
        out[f"input_ids_{rid}"] = _ids(input_ids[0])
        if instruct_ids[0] is not None:
            out[f"instruct_ids_{rid}"] = _ids(instruct_ids[0])
        out[f"hidden_{rid}"] = hidden_list[0].detach().float().cpu().numpy()
        out[f"prefill_embeds_{rid}"] = captured["inputs_embeds"][0].float().cpu().numpy()
        out[f"trailing_text_{rid}"] = captured["trailing_text_hidden"][0].float().cpu().numpy()
        out[f"generate_s_{rid}"] = np.array(dt)
        out[f"ms_per_frame_{rid}"] = np.array(1000.0 * dt / max(frames, 1))
        rmeta.update(frames=frames, generate_s=dt)
        log(f"{rid}: {frames} frames in {dt:.2f} s ({1000 * dt / max(frames, 1):.1f} ms/frame)")
        if args.decode and frames > 0:
            t0 = time.perf_counter()
            wavs, sr = m.speech_tokenizer.decode([{"audio_codes": codes_list[0]}])
            out[f"decode_ms_per_frame_{rid}"] = np.array(1000.0 * (time.perf_counter() - t0) / frames)
            out[f"wav_{rid}"] = np.asarray(wavs[0], dtype=np.float32)
            rmeta["sample_rate"] = sr
        meta["requests"][rid] = rmeta
    return _save(args.out, out, meta)


# --------------------------------------------------------------------------------------------
# decode


def cmd_decode(args) -> int:
    from qwen_tts import Qwen3TTSTokenizer

    torch.set_num_threads(args.threads)
    kwargs = dict(dtype=torch.float32)
    if args.attn:
        kwargs["attn_implementation"] = args.attn
    tok = Qwen3TTSTokenizer.from_pretrained(str(_speech_dir(Path(args.model))), **kwargs)
    tok.model.eval()
    src = Path(args.codes)
    if src.suffix == ".npz":
        with np.load(src) as z:
            items = {k: z[k] for k in z.files if k.startswith("codes_")}
    else:
        items = {"": np.load(src)}
    res: dict[str, np.ndarray] = {}
    for key, codes in items.items():
        codes = np.asarray(codes, dtype=np.int64)
        if codes.ndim != 2 or codes.shape[1] != 16:
            raise SystemExit(f"codes {key or src.name}: expected [frames, 16], got {codes.shape}")
        t0 = time.perf_counter()
        wavs, sr = tok.decode([{"audio_codes": torch.from_numpy(codes)}])
        dt = time.perf_counter() - t0
        name = "wav" + key[len("codes"):] if key else "wav"
        res[name] = np.asarray(wavs[0], dtype=np.float32)
        log(f"{key or src.name}: {codes.shape[0]} frames -> {res[name].shape[0]} samples "
            f"@ {sr} Hz in {dt:.2f} s")
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    if args.out.endswith(".npz"):
        np.savez(args.out, **res)
    else:
        if len(res) != 1:
            raise SystemExit("several code arrays: write to a .npz")
        np.save(args.out, next(iter(res.values())))
    return 0


# --------------------------------------------------------------------------------------------
# save-random

_CORPUS = """Once upon a time there was a small radio that could talk. Every morning it read
the news, the weather and a short poem to the family in the kitchen. "Good morning, everyone!"
it said. The children asked questions: what is the temperature, when does the train leave,
how far away is the moon? The radio answered quickly and clearly, one word after another,
never waiting for the whole story before it started speaking. 12 apples, 7 pears, 2026 stars.
"""
# Words whose Qwen2 pre-tokens the Mistral-style split regex (which transformers 4.57.3 swaps
# in when the official loader passes fix_mistral_regex=True) cuts differently: CamelCase and
# combining marks. Training on them gives merges across those cuts, so a tokenizer that uses
# the other regex produces different ids for them.
_SPLIT_PROBES = "HelloWorld OpenAI iPhone McDonald नमस्ते दुनिया ไทย café naïve " * 8


def write_text_tokenizer(out: Path, n_merges: int) -> None:
    """A random Qwen2-layout byte-level BPE tokenizer with the released special-token ids,
    written through the official processor's save_pretrained."""
    import tempfile

    from qwen_tts.core.models import Qwen3TTSProcessor
    from tokenizers import Regex, Tokenizer, models, normalizers, pre_tokenizers, trainers
    from transformers import Qwen2TokenizerFast

    split = (r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}|"
             r" ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+")
    alphabet = pre_tokenizers.ByteLevel.alphabet()
    tok = Tokenizer(models.BPE())
    tok.normalizer = normalizers.NFC()
    tok.pre_tokenizer = pre_tokenizers.Sequence([
        pre_tokenizers.Split(Regex(split), behavior="isolated"),
        pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)])
    trainer = trainers.BpeTrainer(vocab_size=len(alphabet) + n_merges, initial_alphabet=alphabet,
                                  show_progress=False, special_tokens=[])
    roles = "assistant\nuser\nsystem\n" * 64  # role words must be single tokens
    tok.train_from_iterator([_CORPUS] * 3 + [roles, _SPLIT_PROBES], trainer=trainer)
    state = json.loads(tok.to_str())
    vocab: dict[str, int] = state["model"]["vocab"]
    merges = [m if isinstance(m, str) else " ".join(m) for m in state["model"]["merges"]]
    i = 0
    while len(vocab) < BASE_TEXT_VOCAB:  # unreachable filler so special ids land as released
        vocab[f"\u0120zz{i}"] = len(vocab)
        i += 1
    added = {str(k): {"content": c, "lstrip": False, "normalized": False, "rstrip": False,
                      "single_word": False, "special": True}
             for k, c in SPECIAL_TEXT_TOKENS.items()}
    tcfg = {
        "add_bos_token": False, "add_prefix_space": False, "added_tokens_decoder": added,
        "additional_special_tokens": ["<|im_start|>", "<|im_end|>"], "bos_token": None,
        "clean_up_tokenization_spaces": False, "eos_token": "<|im_end|>", "errors": "replace",
        "model_max_length": 131072, "pad_token": "<|endoftext|>", "split_special_tokens": False,
        "tokenizer_class": "Qwen2Tokenizer", "unk_token": None,
    }
    with tempfile.TemporaryDirectory() as td:
        tdp = Path(td)
        (tdp / "vocab.json").write_text(json.dumps(vocab, ensure_ascii=False), encoding="utf-8")
        (tdp / "merges.txt").write_text("#version: 0.2\n" + "\n".join(merges) + "\n",
                                        encoding="utf-8")
        (tdp / "tokenizer_config.json").write_text(json.dumps(tcfg, indent=2), encoding="utf-8")
        fast = Qwen2TokenizerFast.from_pretrained(td)
        for k, c in SPECIAL_TEXT_TOKENS.items():
            if fast.convert_tokens_to_ids(c) != k:
                raise SystemExit(f"special token {c} landed on {fast.convert_tokens_to_ids(c)}")
        Qwen3TTSProcessor(tokenizer=fast).save_pretrained(str(out))


def _perturb(model: torch.nn.Module, gen: torch.Generator) -> None:
    """Give constant-initialised parameters random values so a wrong key map or a skipped
    norm/bias shows up in a parity test (HF init leaves norms at 1, biases at 0, codebooks
    at 0, which would make e.g. a silent codec or an ignored norm weight invisible)."""
    with torch.no_grad():
        for name, p in model.named_parameters():
            flat = p.detach().reshape(-1)
            if flat.numel() == 0 or bool((flat != flat[0]).any()):
                continue
            value = float(flat[0])
            if name.endswith("embedding_sum"):
                p.copy_(torch.randn(p.shape, generator=gen))
            elif name.endswith("cluster_usage"):
                p.copy_(torch.rand(p.shape, generator=gen) * 1.5 + 0.5)
            elif value == 1.0:
                p.copy_(1.0 + 0.1 * torch.randn(p.shape, generator=gen))
            elif value == 0.0:
                p.copy_(0.05 * torch.randn(p.shape, generator=gen))
            else:
                p.copy_(value * (1.0 + 0.1 * torch.randn(p.shape, generator=gen)))


def random_configs(args) -> tuple[dict, dict]:
    h, hd = args.hidden, args.head_dim
    half = hd // 2
    cp = dict(vocab_size=2048, hidden_size=args.cp_hidden, intermediate_size=2 * args.cp_hidden,
              num_hidden_layers=args.cp_layers, num_attention_heads=4, num_key_value_heads=2,
              head_dim=hd, hidden_act="silu", max_position_embeddings=65536, rms_norm_eps=1e-6,
              rope_theta=1000000, rope_scaling=None, attention_bias=False,
              use_sliding_window=False, sliding_window=None,
              layer_types=["full_attention"] * args.cp_layers, max_window_layers=args.cp_layers,
              attention_dropout=0.0, num_code_groups=16, initializer_range=0.02,
              tie_word_embeddings=False)
    talker = dict(
        code_predictor_config=cp, vocab_size=3072, hidden_size=h, intermediate_size=2 * h,
        num_hidden_layers=args.layers, num_attention_heads=4, num_key_value_heads=2, head_dim=hd,
        hidden_act="silu", max_position_embeddings=32768, rms_norm_eps=1e-6, rope_theta=1000000,
        rope_scaling={"interleaved": True, "mrope_section": [half - 2 * (half // 3), half // 3,
                                                             half // 3],
                      "rope_type": "default", "type": "default"},
        attention_bias=False, use_sliding_window=False, sliding_window=None,
        attention_dropout=0.0, num_code_groups=16, text_vocab_size=151936,
        text_hidden_size=args.text_hidden, position_id_per_seconds=13,
        codec_language_id=dict(LANGUAGES),
        spk_id=dict(SPEAKERS) if args.variant == "custom_voice" else {},
        spk_is_dialect=dict(SPEAKER_DIALECT) if args.variant == "custom_voice" else {},
        initializer_range=0.02, tie_word_embeddings=False, **CODEC_IDS)
    main = dict(talker_config=talker, tokenizer_type="qwen3_tts_tokenizer_12hz",
                tts_model_size=args.size_tag, tts_model_type=args.variant,
                im_start_token_id=151644, im_end_token_id=151645, tts_pad_token_id=151671,
                tts_bos_token_id=151672, tts_eos_token_id=151673, assistant_token_id=77091)
    if args.variant == "base":
        main["speaker_encoder_config"] = dict(
            mel_dim=128, enc_dim=h, enc_channels=[32, 32, 32, 32, 96],
            enc_kernel_sizes=[5, 3, 3, 3, 1], enc_dilations=[1, 2, 3, 4, 1],
            enc_attention_channels=16, enc_res2net_scale=4, enc_se_channels=16,
            sample_rate=24000)
    decoder = dict(
        codebook_size=2048, codebook_dim=16, hidden_size=32, latent_dim=32,
        max_position_embeddings=8000, rope_theta=10000, num_attention_heads=4,
        num_key_value_heads=4, head_dim=8, attention_bias=False, sliding_window=72,
        intermediate_size=64, hidden_act="silu", layer_scale_initial_scale=0.01,
        rms_norm_eps=1e-5, num_hidden_layers=2, num_quantizers=16, num_semantic_quantizers=1,
        semantic_codebook_size=4096, vector_quantization_hidden_dimension=16,
        upsample_rates=[8, 5, 4, 3], upsampling_ratios=[2, 2], decoder_dim=64,
        attention_dropout=0.0)
    encoder = dict(
        audio_channels=1, codebook_dim=16, codebook_size=2048, compress=2, dilation_growth_rate=2,
        frame_rate=12.5, head_dim=16, hidden_act="gelu", hidden_size=32, intermediate_size=64,
        kernel_size=7, last_kernel_size=7, layer_scale_initial_scale=0.01,
        max_position_embeddings=8000, norm_eps=1e-5, num_attention_heads=2, num_filters=4,
        num_hidden_layers=1, num_key_value_heads=2, num_quantizers=32, num_residual_layers=1,
        num_semantic_quantizers=1, residual_kernel_size=3, rope_theta=10000.0,
        sampling_rate=24000, sliding_window=250, trim_right_ratio=1.0, upsample_groups=32,
        upsampling_ratios=[8, 6, 5, 4], use_causal_conv=True, use_conv_shortcut=False,
        vector_quantization_hidden_dimension=16)
    codec = dict(encoder_config=encoder, decoder_config=decoder, encoder_valid_num_quantizers=16,
                 input_sample_rate=24000, output_sample_rate=24000, decode_upsample_rate=1920,
                 encode_downsample_rate=1920)
    return main, codec


def cmd_save_random(args) -> int:
    from qwen_tts.core import Qwen3TTSTokenizerV2Config, Qwen3TTSTokenizerV2Model
    from qwen_tts.core.models import Qwen3TTSConfig, Qwen3TTSForConditionalGeneration

    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    main_cfg, codec_cfg = random_configs(args)
    torch.manual_seed(args.seed)
    gen = torch.Generator().manual_seed(args.seed + 1)
    model = Qwen3TTSForConditionalGeneration(Qwen3TTSConfig(**main_cfg)).eval()
    if not args.no_perturb:
        _perturb(model, gen)
    model.save_pretrained(str(out))
    written = sorted(p.name for p in out.iterdir())
    # Qwen3TTSSpeakerEncoderConfig skips PretrainedConfig.__init__, so save_pretrained writes
    # "model_type": "" into it, which its own __init__ (no **kwargs) then rejects on load: the
    # official package cannot read back its own config.json without this fix-up.
    cfg_path = out / "config.json"
    cfg_json = json.loads(cfg_path.read_text())
    spk_cfg = cfg_json.get("speaker_encoder_config")
    fixups = []
    if isinstance(spk_cfg, dict) and "model_type" in spk_cfg:
        spk_cfg.pop("model_type")
        fixups.append("speaker_encoder_config.model_type removed")
    cfg_path.write_text(json.dumps(cfg_json, indent=2, sort_keys=True) + "\n")
    # the loader reads generation_config.json as the wrapper's sampling defaults
    gc_path = out / "generation_config.json"
    hf_gc = json.loads(gc_path.read_text()) if gc_path.is_file() else None
    gc_path.write_text(json.dumps(GENERATION_DEFAULTS, indent=2) + "\n")

    codec = Qwen3TTSTokenizerV2Model(Qwen3TTSTokenizerV2Config(**codec_cfg)).eval()
    if not args.no_perturb:
        _perturb(codec, gen)
    st = out / "speech_tokenizer"
    codec.save_pretrained(str(st))
    (st / "preprocessor_config.json").write_text(json.dumps(SPEECH_PREPROCESSOR, indent=2) + "\n")

    write_text_tokenizer(out, args.merges)
    removed = []
    if not args.keep_tokenizer_json:
        for extra in ("tokenizer.json",):
            if (out / extra).exists():
                (out / extra).unlink()
                removed.append(extra)
    report = {
        "out": str(out), "model_save_pretrained_wrote": written,
        "hf_generation_config": hf_gc, "removed": removed, "config_fixups": fixups,
        "files": sorted(str(p.relative_to(out)) for p in out.rglob("*") if p.is_file()),
        "params_main": sum(p.numel() for p in model.parameters()),
        "params_codec": sum(p.numel() for p in codec.parameters()),
    }
    print(json.dumps(report, indent=1))
    return 0


# --------------------------------------------------------------------------------------------
# keys


def _stored_shapes(path: Path) -> dict[str, list[int]] | None:
    f = path / "model.safetensors"
    if not f.is_file():
        return None
    from safetensors import safe_open

    with safe_open(str(f), framework="pt") as sf:
        return {k: list(sf.get_slice(k).get_shape()) for k in sf.keys()}


def _compare(expected: dict[str, list[int]], stored: dict[str, list[int]] | None) -> dict:
    if stored is None:
        return {"stored": None}
    return {
        "missing_in_checkpoint": sorted(set(expected) - set(stored)),
        "unexpected_in_checkpoint": sorted(set(stored) - set(expected)),
        "shape_mismatch": {k: {"official": expected[k], "stored": stored[k]}
                           for k in sorted(set(expected) & set(stored))
                           if expected[k] != stored[k]},
    }


def key_report(root: Path) -> dict:
    """The official modules' state_dict shapes (built on the meta device from DIR's configs)
    compared with the tensors stored in DIR and DIR/speech_tokenizer."""
    from qwen_tts.core import Qwen3TTSTokenizerV2Config, Qwen3TTSTokenizerV2Model
    from qwen_tts.core.models import Qwen3TTSConfig, Qwen3TTSForConditionalGeneration

    res: dict = {}
    with torch.device("meta"):
        main = Qwen3TTSForConditionalGeneration(Qwen3TTSConfig.from_pretrained(str(root)))
    shapes = {k: list(v.shape) for k, v in main.state_dict().items()}
    res["main"] = {"state_dict": shapes, **_compare(shapes, _stored_shapes(root))}
    sd = _speech_dir(root)
    if (sd / "config.json").is_file():
        with torch.device("meta"):
            codec = Qwen3TTSTokenizerV2Model(Qwen3TTSTokenizerV2Config.from_pretrained(str(sd)))
        cshapes = {k: list(v.shape) for k, v in codec.state_dict().items()}
        res["speech_tokenizer"] = {"state_dict": cshapes, **_compare(cshapes, _stored_shapes(sd))}
    return res


def key_problems(res: dict) -> list[str]:
    """What would make the official loader silently random-initialise or drop weights.
    Missing speech-tokenizer *encoder* weights are tolerated (decode never runs the encoder)."""
    problems = []
    for part, r in res.items():
        if r.get("stored", True) is None:
            problems.append(f"{part}: no model.safetensors")
            continue
        missing = r["missing_in_checkpoint"]
        if part == "speech_tokenizer":
            missing = [k for k in missing if not k.startswith("encoder.")]
        for label, keys in (("missing", missing), ("unexpected", r["unexpected_in_checkpoint"]),
                            ("shape mismatch", list(r["shape_mismatch"]))):
            if keys:
                problems.append(f"{part}: {len(keys)} {label}: {', '.join(keys[:8])}"
                                + (" ..." if len(keys) > 8 else ""))
    return problems


def cmd_keys(args) -> int:
    res = key_report(Path(args.model))
    if args.summary:
        for part in res.values():
            part.pop("state_dict")
            enc = [k for k in part.get("missing_in_checkpoint", []) if k.startswith("encoder.")]
            if enc:
                part["missing_in_checkpoint"] = [
                    k for k in part["missing_in_checkpoint"] if not k.startswith("encoder.")]
                part["missing_encoder_keys (tolerated: decode never runs the encoder)"] = len(enc)
        res["problems"] = key_problems(key_report(Path(args.model)))
    print(json.dumps(res, indent=1))
    return 0


# --------------------------------------------------------------------------------------------
# tokenize


def cmd_tokenize(args) -> int:
    """Token ids of texts exactly as the official wrapper tokenizes them (its processor, loaded
    the way Qwen3TTSModel.from_pretrained loads it), as JSON on stdout."""
    from qwen_tts import Qwen3TTSModel
    from qwen_tts.core.models import Qwen3TTSConfig, Qwen3TTSProcessor
    from transformers import AutoConfig, AutoProcessor

    AutoConfig.register("qwen3_tts", Qwen3TTSConfig)
    AutoProcessor.register(Qwen3TTSConfig, Qwen3TTSProcessor)
    proc = AutoProcessor.from_pretrained(args.model, fix_mistral_regex=True)
    texts = json.loads(Path(args.texts).read_text()) if args.texts else args.text
    helper = Qwen3TTSModel(model=torch.nn.Module(), processor=proc)  # only for its text helpers
    helper.device = torch.device("cpu")
    res = []
    for t in texts:
        entry = {"text": t, "raw": proc(text=t)["input_ids"][0]}
        entry["assistant"] = _ids(helper._tokenize_texts([helper._build_assistant_text(t)])[0]
                                  ).tolist()
        entry["instruct"] = _ids(helper._tokenize_texts([helper._build_instruct_text(t)])[0]
                                 ).tolist()
        res.append(entry)
    pre = json.loads(proc.tokenizer.backend_tokenizer.to_str()).get("pre_tokenizer")
    print(json.dumps({"pretokenizer": pre, "tokens": res}, ensure_ascii=False))
    return 0


# --------------------------------------------------------------------------------------------
# voice cloning (Base): voice-prompt, clone


def _stored_tensors(path: Path, prefix: str) -> dict:
    from safetensors import safe_open

    out = {}
    with safe_open(str(path / "model.safetensors"), framework="pt") as sf:
        for k in sf.keys():
            if k.startswith(prefix):
                out[k] = sf.get_tensor(k)
    return out


def check_clone_weights(w, root: Path) -> dict:
    """The loaded official speech-tokenizer encoder and speaker encoder must hold exactly the
    file's tensors (not HF's init: its all-zero codebooks would make every code 0)."""
    report = {}
    parts = (("speech_tokenizer encoder", w.model.speech_tokenizer.model, _speech_dir(root), "encoder."),
             ("speaker_encoder", w.model, root, "speaker_encoder."))
    for label, module, folder, prefix in parts:
        stored = _stored_tensors(folder, prefix)
        state = {k: v for k, v in module.state_dict().items() if k.startswith(prefix)}
        if not stored or set(stored) != set(state):
            raise SystemExit(f"{label}: stored keys differ from the official module's "
                             f"(missing {sorted(set(state) - set(stored))[:4]}, "
                             f"unexpected {sorted(set(stored) - set(state))[:4]})")
        diff = max(float((state[k].float() - stored[k].float()).abs().max()) for k in stored)
        if diff != 0.0:
            raise SystemExit(f"{label}: the official loader did not keep the file's weights "
                             f"(max abs diff {diff})")
        report[label] = {"tensors": len(stored), "max_abs_diff_vs_file": diff}
    log(f"clone weights check: {report}")
    return report


def _prompt_item(w, req: dict):
    items = w.create_voice_clone_prompt(ref_audio=str(req["ref_audio"]),
                                        ref_text=req.get("ref_text"),
                                        x_vector_only_mode=bool(req.get("x_vector_only", False)))
    return items[0]


def _store_prompt(out: dict, rid: str, item) -> None:
    out[f"{rid}.x_vector"] = item.ref_spk_embedding.detach().float().cpu().numpy().reshape(-1)
    if item.ref_code is not None:
        out[f"{rid}.ref_codes"] = item.ref_code.detach().cpu().numpy().astype(np.int64)


def _load_requests(path: str) -> list:
    requests = json.loads(Path(path).read_text())
    if isinstance(requests, dict):
        requests = requests.get("requests", [requests])
    return requests


def cmd_voice_prompt(args) -> int:
    """x-vector (and ICL ref codes) per request via the official create_voice_clone_prompt,
    one clip per call (as a single-request server would)."""
    torch.set_num_threads(args.threads)
    w = load_wrapper(args.model, None, "float32")
    if w.model.tts_model_type != "base":
        raise SystemExit(f"{args.model} is a {w.model.tts_model_type} checkpoint, not base")
    meta = {"weights": check_clone_weights(w, Path(args.model)), "requests": {}}
    out: dict[str, np.ndarray] = {}
    for req in _load_requests(args.requests):
        rid = str(req["id"])
        t0 = time.perf_counter()
        item = _prompt_item(w, req)
        dt = time.perf_counter() - t0
        _store_prompt(out, rid, item)
        meta["requests"][rid] = {"seconds": dt, "icl": bool(item.icl_mode)}
        log(f"{rid}: prompt in {dt:.2f} s"
            + (f", {item.ref_code.shape[0]} ref frames" if item.ref_code is not None else ""))
    return _save(args.out, out, meta)


def cmd_clone(args) -> int:
    """Greedy voice-clone generation as ``generate_voice_clone`` runs it (prompt items ->
    ``model.generate`` with ref_ids and the voice_clone_prompt dict); the generated talker codes
    are stored WITHOUT the reference codes the wrapper prepends for decoding."""
    torch.set_num_threads(args.threads)
    w = load_wrapper(args.model, args.attn, "float32")
    m = w.model
    if m.tts_model_type != "base":
        raise SystemExit(f"{args.model} is a {m.tts_model_type} checkpoint, not base")
    meta = {"weights": check_clone_weights(w, Path(args.model)), "requests": {},
            "torch": torch.__version__, "transformers": transformers.__version__}
    out: dict[str, np.ndarray] = {}
    for req in _load_requests(args.requests):
        rid = str(req["id"])
        item = _prompt_item(w, req)
        _store_prompt(out, rid, item)
        language = req.get("language") or "Auto"
        w._validate_languages([language])
        input_ids = w._tokenize_texts([w._build_assistant_text(req["text"])])
        rt = item.ref_text
        ref_ids = [None if rt is None or rt == "" else
                   w._tokenize_texts([w._build_ref_text(rt)])[0]]
        gen_kwargs = w._merge_generate_kwargs(
            do_sample=False, subtalker_dosample=False,
            max_new_tokens=int(req.get("max_new_tokens", 2048)))
        t0 = time.perf_counter()
        with torch.no_grad():
            codes_list, _ = m.generate(
                input_ids=input_ids, ref_ids=ref_ids,
                voice_clone_prompt=w._prompt_items_to_voice_clone_prompt([item]),
                languages=[language], non_streaming_mode=bool(req.get("non_streaming_mode", False)),
                **gen_kwargs)
        dt = time.perf_counter() - t0
        codes = codes_list[0].detach().cpu().numpy().astype(np.int64)
        out[f"{rid}.codes"] = codes
        out[f"{rid}.input_ids"] = _ids(input_ids[0])
        if ref_ids[0] is not None:
            out[f"{rid}.ref_ids"] = _ids(ref_ids[0])
        meta["requests"][rid] = {"frames": int(codes.shape[0]), "generate_s": dt,
                                 "gen_kwargs": gen_kwargs, "icl": bool(item.icl_mode)}
        log(f"{rid}: {codes.shape[0]} frames in {dt:.2f} s")
    return _save(args.out, out, meta)


# --------------------------------------------------------------------------------------------


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    sub = ap.add_subparsers(dest="cmd", required=True)

    g = sub.add_parser("generate")
    g.add_argument("--model", required=True)
    g.add_argument("--requests", required=True)
    g.add_argument("--out", required=True)
    g.add_argument("--attn", default="eager",
                   help="attn_implementation passed to from_pretrained (default eager)")
    g.add_argument("--decode", action="store_true", help="also decode each request's codes")
    g.add_argument("--dtype", default="float32", choices=["float32", "bfloat16"],
                   help="dtype the official model is loaded in (parity: float32)")
    g.add_argument("--threads", type=int, default=1)
    g.add_argument("--allow-key-mismatch", action="store_true",
                   help="run even if stored tensors do not match the official modules")
    g.add_argument("--no-warmup", dest="warmup", action="store_false",
                   help="skip the short untimed run after each model load")
    g.set_defaults(fn=cmd_generate)

    d = sub.add_parser("decode")
    d.add_argument("--model", required=True, help="checkpoint dir or its speech_tokenizer dir")
    d.add_argument("--codes", required=True, help=".npy [frames,16] or .npz with codes_* keys")
    d.add_argument("--out", required=True, help=".npy (one array) or .npz (wav_* keys)")
    d.add_argument("--attn", default=None, help="default: what the official loader picks")
    d.add_argument("--threads", type=int, default=1)
    d.set_defaults(fn=cmd_decode)

    s = sub.add_parser("save-random")
    s.add_argument("--variant", default="custom_voice",
                   choices=["custom_voice", "voice_design", "base"])
    s.add_argument("--out", required=True)
    s.add_argument("--seed", type=int, default=0)
    s.add_argument("--hidden", type=int, default=64)
    s.add_argument("--head-dim", type=int, default=16)
    s.add_argument("--layers", type=int, default=2)
    s.add_argument("--text-hidden", type=int, default=32)
    s.add_argument("--cp-hidden", type=int, default=64)
    s.add_argument("--cp-layers", type=int, default=2)
    s.add_argument("--size-tag", default="0b6",
                   help="tts_model_size; '0b6' makes the wrapper drop CustomVoice instructions")
    s.add_argument("--merges", type=int, default=300)
    s.add_argument("--no-perturb", action="store_true",
                   help="keep HF's init (norms 1, biases 0, codebooks 0 = silent codec)")
    s.add_argument("--keep-tokenizer-json", action="store_true",
                   help="keep the tokenizer.json that save_pretrained writes (not released)")
    s.set_defaults(fn=cmd_save_random)

    k = sub.add_parser("keys")
    k.add_argument("--model", required=True)
    k.add_argument("--summary", action="store_true", help="only the differences")
    k.set_defaults(fn=cmd_keys)

    t = sub.add_parser("tokenize")
    t.add_argument("--model", required=True)
    t.add_argument("--texts", default=None, help="JSON list of strings")
    t.add_argument("--text", action="append", default=[], help="a text (repeatable)")
    t.set_defaults(fn=cmd_tokenize)

    v = sub.add_parser("voice-prompt")
    v.add_argument("--model", required=True, help="a Base checkpoint")
    v.add_argument("--requests", required=True,
                   help='JSON list of {"id", "ref_audio": WAV path, "ref_text", "x_vector_only"}')
    v.add_argument("--out", required=True)
    v.add_argument("--threads", type=int, default=1)
    v.set_defaults(fn=cmd_voice_prompt)

    c = sub.add_parser("clone")
    c.add_argument("--model", required=True, help="a Base checkpoint")
    c.add_argument("--requests", required=True,
                   help="voice-prompt requests plus text, language, non_streaming_mode, "
                        "max_new_tokens")
    c.add_argument("--out", required=True)
    c.add_argument("--attn", default="eager")
    c.add_argument("--threads", type=int, default=1)
    c.set_defaults(fn=cmd_clone)

    args = ap.parse_args(argv)
    return args.fn(args)


if __name__ == "__main__":
    sys.exit(main())
