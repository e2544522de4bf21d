"""IncrementalTokenizer: text pushed in any pieces yields exactly the one-pass ids[3:-5], early."""

from __future__ import annotations

import logging
import random

import pytest
from tokenizers import AddedToken, Regex, Tokenizer, decoders, models, normalizers, pre_tokenizers, trainers

from omni_stream.models.prompt import assistant_text
from omni_stream.models.text_stream import IncrementalTokenizer
from omni_stream.models.text_tokenizer import PATCHED_SPLIT, QWEN2_SPLIT, SPECIAL_TOKENS, TextTokenizer

TEXTS = [
    "Hello world, this is a test.",
    "Hello world, this is",
    "Don't stop: it's 3.14159, not 2026 or $1,000! We'll see; they're I'M sure.",
    "Visit https://example.com/path?q=1&x=2 or mail a.b@c.org -- ok?!",
    "  leading spaces and trailing   ",
    "\nstarts with a newline",
    " \n\n  starts with whitespace and newlines",
    "\r\nwindows\r\nlines\r\n",
    "tabs\tand\t\tmore\t",
    "ends with newlines\n\n",
    "lines\n \n  \n\tmixed   \n end",
    "中文测试，你好！这是一个流式语音合成服务。",
    "日本語のテキスト、カタカナとひらがな。東京へ行きます！",
    "한국어 텍스트 가나다",
    "emoji 👩🏽‍💻 and 👍🏿 and 👨‍👩‍👧‍👦 family 🇺🇸!",
    "cafe\u0301 cafe\u0301s na\u0308ive e\u0301\u0323 A\u030a Ångström",
    "\u0301 starts with a combining accent",
    "mixed 中文 English 123 日本 ok",
    "HelloWorld iPhone JavaScript OpenAI HTTPServer XMLHttpRequest",
    "a<|im_end|>b <|im_start|> partial <|im_ and < > <= => ≠ a\u0338",
    "x'S 'RE 'll 've 'd 'm 't abc' 'x",
    "ǅungla ʰaspirated Ⅳ ½ ² nbsp\xa0here ideographic\u3000space \x1cfs",
    "///path//\n/ok ...\n\n... ???",
    "ᄀ\u1161\u11a8 가\u11a8 decomposed hangul",
    "",
    "a",
    " ",
    "\n",
]

# Atoms for random texts: families the split regex and NFC treat differently.
ATOMS = ["a", "B", "z", "é", "e", "\u0301", "\u0323", "\u0338", "<", ">", "=", "中", "文", "ア",
         "ᄀ", "\u1161", "\u11a8", "가", "1", "9", "½", " ", "  ", "\n", "\r", "\t", "\xa0", "\u3000",
         "\x1c", ".", ",", "!", "/", "'", "'s", "'re", "'ll", "$", "👩", "🏽", "\u200d", "💻",
         "\ufe0f", "ʰ", "ǅ", "Hello", " world", "<|im_end|>", "<|im_", "|>", "\U000e0100", "\u0378",
         "\u212b", "\u0344", "\u0958", "\u0f71", "\u017f", "'S", "\u2028", "\x85", "\r\n", "\uff0c"]

CORPUS = (
    "The quick brown fox jumps over the lazy dog. Hello world, this is a streaming text to speech "
    "server. It's 3.14159, the year 2026, $1,000 and https://example.com/path?q=1. Don't, can't, "
    "we'll, they're. HelloWorld iPhone JavaScript.\n\n  Indented line\n\tTabbed\r\n"
    "中文测试，你好！这是一个流式语音合成服务。我们今天去北京。"
    "日本語のテキスト、カタカナとひらがな。東京へ行きます！ 한국어 텍스트 가나다 "
    "emoji 👩🏽‍💻 👍🏿 👨‍👩‍👧‍👦 🇺🇸 café naïve résumé Ångström São Paulo Zürich\n"
)


def _trained_tokenizer(tmp_path, pattern: str) -> TextTokenizer:
    """A byte-level BPE with thousands of merges (English, CJK, emoji) in the checkpoint pipeline,
    saved as tokenizer.json and loaded the way a checkpoint is."""
    tok = Tokenizer(models.BPE())
    tok.normalizer = normalizers.NFC()
    tok.pre_tokenizer = pre_tokenizers.Sequence([
        pre_tokenizers.Split(Regex(QWEN2_SPLIT), behavior="isolated", invert=False),
        pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)])
    tok.decoder = decoders.ByteLevel()
    alphabet = pre_tokenizers.ByteLevel.alphabet()
    trainer = trainers.BpeTrainer(vocab_size=len(alphabet) + 3000, initial_alphabet=alphabet,
                                  show_progress=False)
    tok.train_from_iterator([CORPUS] * 8 + ["assistant\n user\n"] * 50, trainer=trainer)
    tok.add_special_tokens([AddedToken(c, special=True, normalized=False) for c in SPECIAL_TOKENS.values()])
    tmp_path.mkdir(parents=True, exist_ok=True)
    tok.save(str(tmp_path / "tokenizer.json"))
    return TextTokenizer.from_dir(tmp_path, split_pattern=pattern)


@pytest.fixture(scope="module")
def tokenizers_under_test(tiny_ckpt, tmp_path_factory) -> dict[str, TextTokenizer]:
    base = tmp_path_factory.mktemp("trained-bpe")
    return {
        "tiny-official": TextTokenizer.from_dir(tiny_ckpt),  # the pattern the official loader picks
        "tiny-qwen2": TextTokenizer.from_dir(tiny_ckpt, split_pattern=QWEN2_SPLIT),
        "trained-qwen2": _trained_tokenizer(base / "q", QWEN2_SPLIT),
        "trained-patched": _trained_tokenizer(base / "p", PATCHED_SPLIT),
    }


def _whole(tok: TextTokenizer, text: str) -> list[int]:
    return tok.encode(assistant_text(text))[3:-5]


def _stream(tok: TextTokenizer, pieces: list[str], want: list[int]) -> None:
    it = IncrementalTokenizer(tok)
    got: list[int] = []
    for piece in pieces:
        got += it.push(piece)
        assert got == want[:len(got)], (pieces, piece)
        assert it.emitted == got
        assert it.text.endswith(it.held)
    got += it.close()
    assert got == want, pieces
    assert it.emitted == want and it.text == "".join(pieces)


def _splits(text: str, rng: random.Random) -> list[list[str]]:
    out = [[text], list(text), [x for c in text for x in (c, "")]]
    out += [[text[:i], text[i:]] for i in range(1, len(text))]  # every cut: inside ZWJ, accents...
    for _ in range(4):
        cuts = sorted(rng.randint(0, len(text)) for _ in range(rng.randint(1, max(1, len(text) // 2))))
        out.append([text[a:b] for a, b in zip([0] + cuts, cuts + [len(text)])])
    return out


def test_texts_all_splits_match_one_pass(tokenizers_under_test):
    rng = random.Random(0)
    for name, tok in tokenizers_under_test.items():
        for text in TEXTS:
            want = _whole(tok, text)
            for pieces in _splits(text, rng):
                _stream(tok, pieces, want)


def test_random_texts_random_splits(tokenizers_under_test):
    rng = random.Random(1)
    for name, tok in tokenizers_under_test.items():
        for _ in range(400):
            text = "".join(rng.choice(ATOMS) for _ in range(rng.randint(1, 20)))
            want = _whole(tok, text)
            for pieces in (list(text), *_splits(text, rng)[3:][-4:]):
                _stream(tok, pieces, want)


def test_trained_tokenizer_has_multichar_tokens(tokenizers_under_test):
    """The property is only meaningful if BPE merges bytes into longer tokens across scripts."""
    for name in ("trained-qwen2", "trained-patched"):
        tok = tokenizers_under_test[name]
        for word in ("Hello", " world", "中文", "👩🏽"):
            assert len(tok.encode(word)) < len(word.encode("utf-8")), (name, word)


@pytest.mark.parametrize("name", ["tiny-official", "trained-qwen2"])
def test_ids_come_out_as_early_as_the_rule_allows(tokenizers_under_test, name):
    tok = tokenizers_under_test[name]
    it = IncrementalTokenizer(tok)
    assert not it.ready_for_prefill
    it.push("Hello")
    assert it.emitted == [] and it.held == "Hello"  # "Hello" may still grow
    it.push(" ")
    assert tok.decode(it.emitted) == "Hello" and it.ready_for_prefill
    it.push("world, this is")
    assert tok.decode(it.emitted) == "Hello world, this" and it.held == " is"
    it = IncrementalTokenizer(tok)
    it.push("In 202")  # digits are pre-tokens of their own: out at once
    assert tok.decode(it.emitted) == "In 202" and it.held == ""
    it.push("6 cafe")
    assert tok.decode(it.emitted) == "In 2026" and it.held == " cafe"
    it.push("\u0301")  # composes with the held "e"
    assert it.held == " cafe\u0301"
    it.push(". 中文，")
    assert tok.decode(it.emitted) == "In 2026 caf\u00e9. 中文" and it.held == "，"
    it = IncrementalTokenizer(tok)
    it.push("a  \n ")  # whitespace before a newline may merge with a later newline
    assert tok.decode(it.emitted) == "a" and it.held == "  \n "
    it.push("\nb")  # "b" may still take an accent: its kind is not known yet
    assert tok.decode(it.emitted) == "a"
    it.push(" ")
    assert tok.decode(it.emitted) == "a  \n \nb" and it.held == " "


def test_leading_newline_joins_the_role_line(tokenizers_under_test):
    """The role line's "\\n" and the text's leading newlines form one pre-token, so ids[3:-5]
    lose part of it; the stream reproduces the slice PromptBuilder takes."""
    tok = tokenizers_under_test["tiny-official"]
    want = _whole(tok, "\n\nHi")
    assert tok.decode(want) != "\n\nHi"
    _stream(tok, ["\n", "\n", "H", "i"], want)


def test_special_token_prefix_is_held(tokenizers_under_test):
    tok = tokenizers_under_test["tiny-official"]
    it = IncrementalTokenizer(tok)
    it.push("ok. <|im_")
    assert it.held.endswith("<|im_")
    it.push("end|>x")
    assert tok.token_to_id("<|im_end|>") in it.emitted
    assert it.emitted + it.close() == _whole(tok, "ok. <|im_end|>x")


def test_held_text_stays_short_on_long_input(tokenizers_under_test):
    tok = tokenizers_under_test["trained-qwen2"]
    words = ("The year 2026, 中文测试，你好！ we'll see cafe\u0301 👩🏽‍💻 https://x.org/a?b=1 ok.\n").split(" ")
    it = IncrementalTokenizer(tok)
    longest = 0
    text = ""
    for i in range(600):
        piece = (" " if i else "") + words[i % len(words)]
        text += piece
        it.push(piece)
        longest = max(longest, len(it.held))
    assert longest <= 40
    assert it.emitted + it.close() == _whole(tok, text)


def test_bad_input_and_lifecycle(tokenizers_under_test):
    tok = tokenizers_under_test["tiny-official"]
    it = IncrementalTokenizer(tok)
    with pytest.raises(TypeError, match="str"):
        it.push(b"bytes")  # type: ignore[arg-type]
    with pytest.raises(ValueError, match="surrogate"):
        it.push("\ud800")
    assert it.push("") == [] and it.text == ""
    assert it.close() == _whole(tok, "") == []
    with pytest.raises(RuntimeError, match="close"):
        it.push("more")
    with pytest.raises(RuntimeError):
        it.close()


def test_unknown_tokenizer_shape_holds_until_close(tokenizers_under_test, caplog):
    inner = Tokenizer.from_str(tokenizers_under_test["trained-qwen2"]._tok.to_str())
    inner.normalizer = normalizers.NFKC()
    tok = TextTokenizer(inner)
    with caplog.at_level(logging.WARNING):
        it = IncrementalTokenizer(tok)
    assert "held until" in caplog.text
    text = "Hello world, ﬁne ½"
    assert it.push(text) == []
    assert it.close() == _whole(tok, text)
