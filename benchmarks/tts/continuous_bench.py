"""Speech of text while an LLM writes it: continuous mode vs sentence mode, side by side.

A simulated LLM writes each paragraph at R tokens/s (a token ~ a word piece: each word with its
leading space, words past 5 characters cut in two, as a BPE tokenizer does). The same pieces,
at the same times, go over the WebSocket ``/v1/audio/speech/stream`` two ways, interleaved per
request (the order alternates):

  continuous  ``text_mode: "continuous"``: one utterance fed piece by piece, spoken as written
  sentences   ``text_mode: "sentences"``: the server cuts each complete sentence off the text
              and speaks it as its own utterance (speech starts once a sentence is complete)

Per request: time from the first text piece sent to the first audio, the underruns of a
real-time player that starts at the first audio (``--prebuffer``, default 0), the time the
speech waited for text (continuous), and RTF = (first text -> last audio) / audio seconds.
Prints a table and writes ``results/continuous_text_<label>.json``.

    python benchmarks/tts/continuous_bench.py --model CHECKPOINT --rates 15,30 --requests 8

A random checkpoint never ends an utterance by itself: ``--frames-per-sentence N`` caps each
sentence-mode utterance at N frames and a continuous utterance at N x its sentences, so both
modes speak the same amount of audio (``--max-new-tokens`` caps every utterance alike instead).
Exit 1 when the server is unreachable or a request fails: no numbers from broken runs.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import json
import shlex
import statistics
import sys
import time
from pathlib import Path
from typing import AsyncIterator

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT))

from benchmarks.tts.machine import machine_info, print_machine  # noqa: E402
from benchmarks.tts.harness import first_voice, pct, server  # noqa: E402
from clients.continuous import ContinuousResult, speak_continuous  # noqa: E402
from clients.result import ClientError  # noqa: E402
from omni_stream.server.ws import split_sentences  # noqa: E402

# assistant-like answers of 20-40 words, two or three sentences each
PARAGRAPHS = [
    "Sure, here is a quick summary. The meeting moved to Thursday at ten, and the budget "
    "review comes first. Please bring the updated numbers.",
    "The weather today is mostly sunny with a light breeze from the west. Temperatures reach "
    "about twenty degrees in the afternoon, so a light jacket should be enough.",
    "To reset your password, open the settings page and choose security. Then follow the link "
    "we send to your email address; it stays valid for one hour.",
    "Photosynthesis turns light, water and carbon dioxide into sugar and oxygen. It happens in "
    "the chloroplasts of plant cells, and it feeds almost every living thing on the planet.",
]
MODES = ("continuous", "sentences")


def llm_pieces(text: str) -> list[str]:
    """The text as an LLM streams it: words with their leading space, long ones in two."""
    out: list[str] = []
    for i, word in enumerate(text.split(" ")):
        w = word if i == 0 else " " + word
        if len(w) > 5:
            cut = max(4, (len(w) + 1) // 2)
            out += [w[:cut], w[cut:]]
        else:
            out.append(w)
    assert "".join(out) == text
    return out


async def paced(pieces: list[str], rate: float) -> AsyncIterator[str]:
    """Yield piece i at i / rate seconds after the first (on a fixed schedule: a late send
    does not push the later ones back)."""
    t0 = time.monotonic()
    for i, p in enumerate(pieces):
        await asyncio.sleep(max(0.0, t0 + i / rate - time.monotonic()))
        yield p


async def one(url: str, mode: str, text: str, rate: float, seed: int, voice: str | None,
              args) -> dict:
    pieces = llm_pieces(text)
    frames = args.max_new_tokens
    if args.frames_per_sentence:  # the same audio budget in both modes
        sentences = len(split_sentences(text + " ", 1 << 20)[0]) or 1
        frames = args.frames_per_sentence * (sentences if mode == "continuous" else 1)
    res: ContinuousResult = await speak_continuous(
        url, paced(pieces, rate), voice=voice, language=args.language, model=args.served_model,
        seed=seed, greedy=args.greedy, max_new_tokens=frames, timeout=args.timeout,
        extra={"text_mode": mode})
    pb = res.playback(args.prebuffer)
    t0 = res.first_text_at
    return dict(mode=mode, rate_tps=rate, seed=seed, text_words=len(text.split()),
                pieces=len(pieces), first_audio_ms=res.first_audio_after_text_s * 1e3,
                write_s=res.last_text_at - t0, audio_s=res.audio_s, rtf=res.rtf,
                underruns=pb.underruns, underrun_s=pb.underrun_s, max_gap_ms=pb.max_gap_s * 1e3,
                text_waited_ms=res.text_waited_ms,
                text_waits=sum(1 for w in res.waits if w["type"] == "text.waiting"),
                utterances=len(res.utterances),
                finish_reasons=[u.get("finish_reason") for u in res.utterances],
                arrivals_s=[round(a - t0, 4) for a in res.arrivals],
                durations_s=[round(d, 4) for d in res.durations])


def summarize(rate: float, mode: str, rows: list[dict]) -> dict:
    fa = [r["first_audio_ms"] for r in rows]
    waited = [r["text_waited_ms"] for r in rows]
    return dict(rate_tps=rate, mode=mode, n=len(rows), first_audio_ms_p50=pct(fa, 0.5),
                first_audio_ms_p95=pct(fa, 0.95), underruns=sum(r["underruns"] for r in rows),
                underrun_s=sum(r["underrun_s"] for r in rows),
                streams_with_underruns=sum(1 for r in rows if r["underruns"]),
                text_waited_ms_p50=pct(waited, 0.5), text_waited_ms_mean=statistics.fmean(waited),
                rtf_mean=statistics.fmean(r["rtf"] for r in rows),
                audio_s_mean=statistics.fmean(r["audio_s"] for r in rows),
                write_s_mean=statistics.fmean(r["write_s"] for r in rows),
                utterances_mean=statistics.fmean(r["utterances"] for r in rows))


async def run_all(url: str, rates: list[float], voice: str | None, args) -> dict[str, list]:
    # one unmeasured request first: the server's first stream pays one-off costs
    await one(url, "continuous", PARAGRAPHS[0], max(rates), 0, voice, args)
    rows: dict[str, list] = {}
    for rate in rates:
        for i in range(args.requests):
            text = PARAGRAPHS[i % len(PARAGRAPHS)]
            order = MODES if i % 2 == 0 else MODES[::-1]
            for mode in order:  # interleaved: both modes see the same machine state
                r = await one(url, mode, text, rate, args.seed + i, voice, args)
                rows.setdefault(f"{rate:g}/{mode}", []).append(r)
                print(f"  {rate:g} tok/s {mode:>10} #{i}: first audio {r['first_audio_ms']:6.0f} ms"
                      f", underruns {r['underruns']}, waited {r['text_waited_ms']} ms, "
                      f"RTF {r['rtf']:.2f}", file=sys.stderr)
    return rows


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    src = ap.add_mutually_exclusive_group(required=True)
    src.add_argument("--url")
    src.add_argument("--model", help="start `omni-stream serve` on this checkpoint")
    ap.add_argument("--server-args", default="", help="extra args for omni-stream serve")
    ap.add_argument("--rates", default="15,30", help="LLM tokens per second, comma-separated")
    ap.add_argument("--requests", type=int, default=8, help="per rate and mode")
    ap.add_argument("--voice", default=None)
    ap.add_argument("--language", default="english")
    ap.add_argument("--served-model", default=None)
    ap.add_argument("--max-new-tokens", type=int, default=None,
                    help="frames per utterance, either mode (a random checkpoint needs a cap)")
    ap.add_argument("--frames-per-sentence", type=int, default=None,
                    help="frames per sentence: sentence mode N per utterance, continuous N x "
                         "the paragraph's sentences (same audio in both modes)")
    ap.add_argument("--greedy", action="store_true")
    ap.add_argument("--seed", type=int, default=1)
    ap.add_argument("--prebuffer", type=float, default=0.0, help="player start-up buffer (s)")
    ap.add_argument("--timeout", type=float, default=600.0, help="per request (s)")
    ap.add_argument("--label", default="0.6b_cpu")
    ap.add_argument("--out", default=None,
                    help="default: benchmarks/tts/results/continuous_text_<label>.json")
    args = ap.parse_args(argv)
    rates = [float(x) for x in args.rates.split(",")]
    if args.requests < 1 or any(r <= 0 for r in rates):
        ap.error("--requests and every rate must be > 0")
    out = Path(args.out or ROOT / f"benchmarks/tts/results/continuous_text_{args.label}.json")
    out.parent.mkdir(parents=True, exist_ok=True)
    machine = machine_info()
    ctx = (server(args.model, args.server_args.split(), out.with_suffix(".server.log"))
           if args.model else contextlib.nullcontext(args.url))
    t_start = time.monotonic()
    try:
        with ctx as url:
            voice = args.voice or first_voice(url)
            rows = asyncio.run(run_all(url, rates, voice, args))
    except ClientError as e:
        print(f"benchmark failed: {e}", file=sys.stderr)
        return 1
    except OSError as e:
        print(f"benchmark failed: server unreachable: {e}", file=sys.stderr)
        return 1
    summaries = [summarize(rate, mode, rows[f"{rate:g}/{mode}"]) for rate in rates
                 for mode in MODES]
    print_machine(machine)
    print(f"{'tok/s':>5} {'mode':>10} {'n':>3} | {'1st audio p50':>13} {'p95':>6} ms | "
          f"{'underruns':>9} {'streams':>7} {'(s)':>6} | {'waited p50':>10} ms | "
          f"{'RTF':>5} | {'audio s':>7} | utts")
    for s in summaries:
        print(f"{s['rate_tps']:>5g} {s['mode']:>10} {s['n']:>3} | {s['first_audio_ms_p50']:13.0f} "
              f"{s['first_audio_ms_p95']:6.0f}    | {s['underruns']:>9} "
              f"{s['streams_with_underruns']:>4}/{s['n']:<2} {s['underrun_s']:6.2f} | "
              f"{s['text_waited_ms_p50']:10.0f}    | {s['rtf_mean']:5.2f} | "
              f"{s['audio_s_mean']:7.2f} | {s['utterances_mean']:.1f}")
    doc = dict(label=args.label, model=args.model or args.url, server_args=args.server_args,
               voice=voice, rates_tps=rates, requests=args.requests,
               max_new_tokens=args.max_new_tokens,
               frames_per_sentence=args.frames_per_sentence, greedy=args.greedy,
               prebuffer_s=args.prebuffer, paragraphs=PARAGRAPHS, machine=machine,
               wall_s=round(time.monotonic() - t_start, 1), summaries=summaries, requests_rows=rows,
               command="python benchmarks/tts/continuous_bench.py " + shlex.join(
                   argv if argv is not None else sys.argv[1:]))
    out.write_text(json.dumps(doc, indent=1))
    print(f"wrote {out} ({doc['wall_s']} s)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
