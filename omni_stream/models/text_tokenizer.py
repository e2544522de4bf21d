"""The Qwen2 byte-level BPE text tokenizer: load the released files, or build a random one.

A released checkpoint ships ``vocab.json``, ``merges.txt`` and ``tokenizer_config.json`` (whose
``added_tokens_decoder`` places the special tokens at fixed ids). We assemble the same pipeline
with the ``tokenizers`` library (NFC, Qwen2 split regex, byte-level) so no ``transformers``
import is needed at serving time.
"""

from __future__ import annotations

import json
import logging
from pathlib import Path

from tokenizers import AddedToken, Regex, Tokenizer, decoders, models, normalizers, pre_tokenizers

log = logging.getLogger(__name__)

# The split pattern Qwen2 tokenizers use before byte-level BPE.
QWEN2_SPLIT = (
    r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}| ?[^\s\p{L}\p{N}]+[\r\n]*"
    r"|\s*[\r\n]+|\s+(?!\S)|\s+"
)
# The pattern transformers 4.57.3 substitutes when the official package loads its processor with
# ``fix_mistral_regex=True`` and the checkpoint's config.json says transformers_version
# 4.57.3 .. <5.0 (or says nothing): released Qwen3-TTS checkpoints are tokenized with THIS one by
# the official code. It splits CamelCase words and drops the contraction rule.
PATCHED_SPLIT = (
    r"[^\r\n\p{L}\p{N}]?[\p{Lu}\p{Lt}\p{Lm}\p{Lo}\p{M}]*[\p{Ll}\p{Lm}\p{Lo}\p{M}]+"
    r"|[^\r\n\p{L}\p{N}]?[\p{Lu}\p{Lt}\p{Lm}\p{Lo}\p{M}]+[\p{Ll}\p{Lm}\p{Lo}\p{M}]*"
    r"|\p{N}| ?[^\s\p{L}\p{N}]+[\r\n/]*|\s*[\r\n]+|\s+(?!\S)|\s+"
)
BASE_VOCAB_SIZE = 151643  # ids below this are BPE tokens; special tokens start here

SPECIAL_TOKENS: dict[int, str] = {
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

# Text the random tokenizer's merges are learned from: enough to give common words their own
# tokens, so token counts of English prompts resemble a real tokenizer's.
_CORPUS = """
The quick brown fox jumps over the lazy dog. Hello world, this is a streaming text to speech
server. It speaks as soon as the first words arrive and keeps speaking without gaps. Please read
this sentence aloud for the listener; the weather today is sunny with a light breeze. Numbers
like 1, 2, 3, 42 and 2026 are spoken digit by digit. Good morning! How are you? I am fine, thank
you very much. Welcome to omni-stream, the fastest way to turn text into speech.
CamelCase words like HelloWorld, OpenAI, iPhone and JavaScript; don't, can't, we'll, it's;
accents and combining marks: café, naïve, résumé, cafe\u0301, Ångström, São Paulo, Zürich.
"""


class TextTokenizer:
    """Thin wrapper: ``encode(text) -> list[int]`` with special tokens recognised in text."""

    def __init__(self, tok: Tokenizer) -> None:
        self._tok = tok

    def encode(self, text: str) -> list[int]:
        return self._tok.encode(text, add_special_tokens=False).ids

    def decode(self, ids: list[int]) -> str:
        return self._tok.decode(ids, skip_special_tokens=False)

    def token_to_id(self, token: str) -> int | None:
        return self._tok.token_to_id(token)

    @classmethod
    def from_dir(cls, path: str | Path, split_pattern: str | None = None) -> "TextTokenizer":
        """Load ``tokenizer.json`` if present, else assemble from vocab/merges/config.

        ``split_pattern`` defaults to what the official loader would use for this folder
        (see ``official_split_pattern``)."""
        path = Path(path)
        pattern = split_pattern or official_split_pattern(path)
        if (path / "tokenizer.json").is_file():
            tok = Tokenizer.from_file(str(path / "tokenizer.json"))
            pre = tok.pre_tokenizer
            if pre is not None and hasattr(pre, "__getitem__"):
                pre[0] = pre_tokenizers.Split(Regex(pattern), behavior="isolated", invert=False)
            return cls(tok)
        for name in ("vocab.json", "merges.txt", "tokenizer_config.json"):
            if not (path / name).is_file():
                raise FileNotFoundError(
                    f"tokenizer file '{name}' missing in {path}: a checkpoint needs vocab.json, "
                    "merges.txt and tokenizer_config.json (or tokenizer.json)")
        vocab = json.loads((path / "vocab.json").read_text(encoding="utf-8"))
        merges = []
        for line in (path / "merges.txt").read_text(encoding="utf-8").splitlines():
            if not line or line.startswith("#version"):
                continue
            a, b = line.split(" ")
            merges.append((a, b))
        tcfg = json.loads((path / "tokenizer_config.json").read_text(encoding="utf-8"))
        added = tcfg.get("added_tokens_decoder", {})
        for sid, entry in added.items():
            vocab.setdefault(entry["content"], int(sid))
        return cls(_assemble(vocab, merges, added, pattern))


def official_split_pattern(path: Path) -> str:
    """The split regex the official qwen-tts loader ends up with for this checkpoint folder.

    It loads the processor with ``fix_mistral_regex=True``; transformers 4.57.3 then swaps in
    ``PATCHED_SPLIT`` unless config.json's ``transformers_version`` is <= 4.57.2 or >= 5.0."""
    cfg_path = path / "config.json"
    version = None
    if cfg_path.is_file():
        try:
            version = json.loads(cfg_path.read_text(encoding="utf-8")).get("transformers_version")
        except (json.JSONDecodeError, AttributeError):
            version = None
    if version:
        try:
            parts = tuple(int(x) for x in str(version).split(".")[:3] if x.isdigit())
        except ValueError:
            parts = ()
        if parts and (parts <= (4, 57, 2) or parts >= (5, 0, 0)):
            return QWEN2_SPLIT
    return PATCHED_SPLIT


def _assemble(vocab: dict[str, int], merges: list[tuple[str, str]],
              added: dict[str, dict], pattern: str = QWEN2_SPLIT) -> Tokenizer:
    tok = Tokenizer(models.BPE(vocab=vocab, merges=merges, byte_fallback=False,
                               fuse_unk=False, unk_token=None))
    tok.normalizer = normalizers.NFC()
    tok.pre_tokenizer = pre_tokenizers.Sequence([
        pre_tokenizers.Split(Regex(pattern), behavior="isolated", invert=False),
        pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False),
    ])
    tok.decoder = decoders.ByteLevel()
    specials = [AddedToken(e["content"], special=bool(e.get("special", True)), normalized=False)
                for _, e in sorted(added.items(), key=lambda kv: int(kv[0]))]
    tok.add_special_tokens(specials)
    for sid, e in added.items():
        got = tok.token_to_id(e["content"])
        if got != int(sid):
            raise ValueError(f"special token {e['content']!r} landed on id {got}, config says {sid}")
    return tok


def write_random_tokenizer(out: Path, n_merges: int = 400) -> None:
    """Write a Qwen2-layout tokenizer whose special tokens sit at the released ids.

    The BPE part is learned from a small embedded corpus, then padded with unreachable filler
    entries up to id 151642 so that the special tokens that follow land on their released ids
    under every loader (including ones that assign added-token ids sequentially).
    """
    from tokenizers import trainers

    byte_level = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)
    alphabet = pre_tokenizers.ByteLevel.alphabet()
    tok = Tokenizer(models.BPE())
    tok.normalizer = normalizers.NFC()
    tok.pre_tokenizer = pre_tokenizers.Sequence([
        pre_tokenizers.Split(Regex(QWEN2_SPLIT), behavior="isolated", invert=False), byte_level])
    trainer = trainers.BpeTrainer(vocab_size=len(alphabet) + n_merges, initial_alphabet=alphabet,
                                  show_progress=False, special_tokens=[])
    # role words must be single tokens: prompt building slices the chat template by position
    roles = "\n".join(["<|im_start|>assistant\n", "<|im_start|>user\n", "<|im_start|>system\n"] * 50)
    tok.train_from_iterator([_CORPUS] * 4 + [roles.replace("<|im_start|>", "")], trainer=trainer)
    state = json.loads(tok.to_str())
    vocab: dict[str, int] = state["model"]["vocab"]
    merges = [m if isinstance(m, str) else " ".join(m) for m in state["model"]["merges"]]
    i = 0
    while len(vocab) < BASE_VOCAB_SIZE:
        vocab[f"\u0100fill{i}"] = len(vocab)
        i += 1
    out.mkdir(parents=True, exist_ok=True)
    (out / "vocab.json").write_text(json.dumps(vocab, ensure_ascii=False), encoding="utf-8")
    (out / "merges.txt").write_text("#version: 0.2\n" + "\n".join(merges) + "\n", encoding="utf-8")
    added = {str(i): {"content": c, "lstrip": False, "normalized": False, "rstrip": False,
                      "single_word": False, "special": True} for i, c in SPECIAL_TOKENS.items()}
    tcfg = {
        "add_bos_token": False, "add_prefix_space": False, "added_tokens_decoder": added,
        "additional_special_tokens": ["<|im_start|>", "<|im_end|>"],
        "bos_token": None, "clean_up_tokenization_spaces": False, "eos_token": "<|im_end|>",
        "errors": "replace", "model_max_length": 131072, "pad_token": "<|endoftext|>",
        "split_special_tokens": False, "tokenizer_class": "Qwen2Tokenizer", "unk_token": None,
    }
    (out / "tokenizer_config.json").write_text(json.dumps(tcfg, indent=2), encoding="utf-8")
