"""A voice agent's TTS through Pipecat: the OpenAI service per sentence vs OmniStreamTTSService.

A simulated LLM writes three-sentence replies at R tokens/s (a token ~ a word piece, as in
continuous_bench.py) into a real Pipecat pipeline (``[feeder] -> TTS -> recorder``, headless,
one pipeline per service for all its replies, like an agent's session). Two TTS services, on
the same server, with the replies interleaved (the order alternates per reply):

  openai      Pipecat's ``OpenAITTSService`` unmodified (base_url -> omni-stream): sentence
              aggregation, one HTTP request per sentence, pcm
  omnistream  ``omni_stream.integrations.pipecat.OmniStreamTTSService``: every token into one
              continuous WebSocket utterance per reply

Per reply: time from the first LLM token entering the pipeline to the first audio frame out
of the TTS; the silence a real-time player that starts at the first audio hears between then
and the end of the reply (the gaps between sentences: ``clients.playback``); audio seconds.
Interruption runs (``--interrupts``): the reply is written whole, the pipeline gets an
``InterruptionFrame`` 0.3 s after the first audio, and we time (a) the last audio frame of
the reply leaving the TTS after it (0 if none) and (b) the server freeing the stream (its
/metrics ``active_streams`` back to 0, polled every 5 ms).

    python benchmarks/tts/agent_bench.py --model CHECKPOINT --rates 15,30 --replies 20

Prints a table and writes ``results/agent_bench_<label>.json`` and ``.md``. A random checkpoint speaks
noise, and its utterance lengths follow the server's default frame cap (which follows the
text); both services get the same caps.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import json
import re
import shlex
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT))

import aiohttp  # noqa: E402
from pipecat.frames.frames import (EndFrame, Frame, InterruptionFrame,  # noqa: E402
                                   LLMFullResponseEndFrame, LLMFullResponseStartFrame,
                                   LLMTextFrame, TTSAudioRawFrame, TTSStoppedFrame)
from pipecat.pipeline.pipeline import Pipeline  # noqa: E402
from pipecat.pipeline.worker import PipelineParams, PipelineWorker  # noqa: E402
from pipecat.processors.frame_processor import FrameDirection, FrameProcessor  # noqa: E402
from pipecat.services.openai.tts import OpenAITTSService  # noqa: E402
from pipecat.workers.runner import WorkerRunner  # noqa: E402

from benchmarks.tts.continuous_bench import llm_pieces  # noqa: E402
from benchmarks.tts.machine import machine_info, print_machine  # noqa: E402
from benchmarks.tts.harness import pct, server  # noqa: E402
from clients.playback import simulate_playback  # noqa: E402
from omni_stream.integrations.pipecat import OmniStreamTTSService  # noqa: E402

SERVICES = ("openai", "omnistream")
REPLIES = [
    "Sure, I can help with that. The meeting moved to Thursday at ten. Please bring the "
    "updated budget numbers.",
    "The weather today is mostly sunny. Temperatures reach about twenty degrees in the "
    "afternoon. A light jacket should be enough.",
    "To reset your password, open the settings page. Then choose security and follow the "
    "link. It stays valid for one hour.",
    "Your order shipped this morning. It should arrive on Friday before noon. You will get a "
    "text message when it is close.",
    "That restaurant opens at six. It is about ten minutes from your hotel on foot. I can "
    "book a table for two if you like.",
]


class Out(FrameProcessor):
    """The pipeline's end: notes when each audio frame and each turn's end come out."""

    def __init__(self) -> None:
        super().__init__()
        self.audio: list[tuple[float, TTSAudioRawFrame]] = []
        self.stops: asyncio.Queue[float] = asyncio.Queue()
        self.first_audio = asyncio.Event()

    async def process_frame(self, frame: Frame, direction: FrameDirection) -> None:
        await super().process_frame(frame, direction)
        if isinstance(frame, TTSAudioRawFrame):
            self.audio.append((time.monotonic(), frame))
            self.first_audio.set()
        elif isinstance(frame, TTSStoppedFrame):
            self.stops.put_nowait(time.monotonic())
        await self.push_frame(frame, direction)

    def reset(self) -> None:
        self.audio.clear()
        self.first_audio.clear()
        while not self.stops.empty():
            self.stops.get_nowait()


class Agent:
    """One running pipeline [TTS -> Out] that replies are fed into."""

    def __init__(self, tts: FrameProcessor) -> None:
        self.out = Out()
        self.worker = PipelineWorker(Pipeline([tts, self.out]), cancel_on_idle_timeout=False,
                                     params=PipelineParams())
        self.runner = WorkerRunner(handle_sigint=False)
        self.started = asyncio.Event()
        self.worker.event_handler("on_pipeline_started")(self._started)

    async def _started(self, worker, frame) -> None:
        self.started.set()

    async def __aenter__(self) -> "Agent":
        await self.runner.add_workers(self.worker)
        self.task = asyncio.create_task(self.runner.run())
        await asyncio.wait_for(self.started.wait(), 30)
        return self

    async def __aexit__(self, *exc) -> None:
        await self.worker.queue_frame(EndFrame())
        try:
            await asyncio.wait_for(self.task, 60)
        except asyncio.TimeoutError:
            await self.worker.cancel()

    async def reply(self, text: str, rate: float, interrupt_after: float | None = None,
                    url: str | None = None) -> dict:
        """Write ``text`` at ``rate`` tokens/s; wait until its audio is out (or interrupt)."""
        self.out.reset()
        q = self.worker.queue_frame
        await q(LLMFullResponseStartFrame())
        pieces = llm_pieces(text)
        t0 = time.monotonic()
        for i, p in enumerate(pieces):  # a fixed schedule: a late send does not shift the rest
            await asyncio.sleep(max(0.0, t0 + i / rate - time.monotonic()))
            await q(LLMTextFrame(p))
        t_written = time.monotonic()
        await q(LLMFullResponseEndFrame())
        row: dict = dict(rate_tps=rate, pieces=len(pieces), write_s=t_written - t0)
        if interrupt_after is None:
            stops = 0
            sentences = 1  # the omnistream turn ends once; openai's context too (one turn)
            while stops < sentences:
                await asyncio.wait_for(self.out.stops.get(), 300)
                stops += 1
            await asyncio.sleep(0.05)  # stragglers of the turn, if any
        else:
            await asyncio.wait_for(self.out.first_audio.wait(), 300)
            await asyncio.sleep(interrupt_after)
            t_int = time.monotonic()
            await self.worker.queue_frame(InterruptionFrame())
            free_at = await _slot_free_at(url)
            await asyncio.sleep(0.3)
            after = [t for t, _ in self.out.audio if t > t_int]
            row.update(audio_after_interrupt_ms=(max(after) - t_int) * 1e3 if after else 0.0,
                       frames_after_interrupt=len(after),
                       server_free_ms=(free_at - t_int) * 1e3)
            self.out.reset()
            return row
        arrivals = [t for t, _ in self.out.audio]
        durations = [len(f.audio) / 2 / f.sample_rate for _, f in self.out.audio]
        if not arrivals:
            raise RuntimeError(f"no audio for reply {text[:40]!r}")
        pb = simulate_playback(arrivals, durations)
        row.update(first_audio_ms=(arrivals[0] - t0) * 1e3, audio_s=sum(durations),
                   silence_s=pb.underrun_s, gaps=pb.underruns,
                   sample_rates=sorted({f.sample_rate for _, f in self.out.audio}))
        return row


async def _active_streams(session: aiohttp.ClientSession, url: str) -> float:
    async with session.get(url + "/metrics") as r:
        text = await r.text()
    return sum(float(m.group(1)) for m in
               re.finditer(r"^omni_stream_backend_active_streams(?:\{[^}]*\})? (\S+)$", text,
                           re.M))


async def _slot_free_at(url: str, timeout: float = 30.0) -> float:
    """When the server's active streams reach 0 (polled every 5 ms)."""
    deadline = time.monotonic() + timeout
    async with aiohttp.ClientSession() as s:
        while time.monotonic() < deadline:
            if await _active_streams(s, url) == 0:
                return time.monotonic()
            await asyncio.sleep(0.005)
    raise RuntimeError("the server never freed the interrupted stream")


def make_tts(service: str, url: str, voice: str, served: str) -> FrameProcessor:
    if service == "openai":
        return OpenAITTSService(api_key="not-needed", base_url=url + "/v1",
                                settings=OpenAITTSService.Settings(model=served, voice="alloy"))
    return OmniStreamTTSService(base_url=url, voice=voice, language="english")


async def served_model(url: str) -> tuple[str, str]:
    """(served model name, the speaker the OpenAI name "alloy" maps to: its first voice)."""
    async with aiohttp.ClientSession() as s:
        async with s.get(url + "/v1/models") as r:
            name = (await r.json())["data"][0]["id"]
        async with s.get(url + "/v1/audio/voices") as r:
            voices = [v["name"] if isinstance(v, dict) else v
                      for v in (await r.json()).get("voices", [])]
    return name, voices[0]


async def run_all(url: str, args) -> dict[str, list]:
    served, voice = await served_model(url)
    rates = [float(x) for x in args.rates.split(",")]
    rows: dict[str, list] = {}
    async with Agent(make_tts("openai", url, voice, served)) as a_openai, \
            Agent(make_tts("omnistream", url, voice, served)) as a_omni:
        agents = {"openai": a_openai, "omnistream": a_omni}
        for name, agent in agents.items():  # unmeasured: first-request costs on both sides
            await agent.reply(REPLIES[0], max(rates))
        for rate in rates:
            for i in range(args.replies):
                order = SERVICES if i % 2 == 0 else SERVICES[::-1]
                for name in order:
                    r = await agents[name].reply(REPLIES[i % len(REPLIES)], rate)
                    rows.setdefault(f"{rate:g}/{name}", []).append(r)
                    print(f"  {rate:g} tok/s {name:>10} #{i}: first audio "
                          f"{r['first_audio_ms']:6.0f} ms, silence {r['silence_s']:5.2f} s "
                          f"({r['gaps']} gaps), audio {r['audio_s']:5.2f} s", file=sys.stderr)
        for i in range(args.interrupts):
            order = SERVICES if i % 2 == 0 else SERVICES[::-1]
            for name in order:
                r = await agents[name].reply(REPLIES[i % len(REPLIES)], max(rates),
                                             interrupt_after=0.3, url=url)
                rows.setdefault(f"interrupt/{name}", []).append(r)
                print(f"  interrupt {name:>10} #{i}: audio after {r['audio_after_interrupt_ms']:6.1f}"
                      f" ms, server free after {r['server_free_ms']:6.1f} ms", file=sys.stderr)
                await asyncio.sleep(0.2)
    return rows


def summarize(key: str, rows: list[dict]) -> dict:
    if key.startswith("interrupt/"):
        a = [r["audio_after_interrupt_ms"] for r in rows]
        f = [r["server_free_ms"] for r in rows]
        return dict(case=key, n=len(rows), audio_after_interrupt_ms_p50=pct(a, 0.5),
                    audio_after_interrupt_ms_p95=pct(a, 0.95), server_free_ms_p50=pct(f, 0.5),
                    server_free_ms_p95=pct(f, 0.95))
    fa = [r["first_audio_ms"] for r in rows]
    sil = [r["silence_s"] * 1e3 for r in rows]
    return dict(case=key, n=len(rows), first_audio_ms_p50=pct(fa, 0.5),
                first_audio_ms_p95=pct(fa, 0.95), silence_ms_p50=pct(sil, 0.5),
                silence_ms_p95=pct(sil, 0.95),
                replies_with_gaps=sum(1 for r in rows if r["gaps"]),
                audio_s_mean=sum(r["audio_s"] for r in rows) / len(rows))


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    src = ap.add_mutually_exclusive_group()
    src.add_argument("--url")
    src.add_argument("--model", help="start `omni-stream serve` on this checkpoint")
    ap.add_argument("--server-args", default="", help="extra args for omni-stream serve")
    ap.add_argument("--rates", default="15,30", help="LLM tokens per second, comma-separated")
    ap.add_argument("--replies", type=int, default=20, help="per rate and service")
    ap.add_argument("--interrupts", type=int, default=20, help="interrupted replies per service")
    ap.add_argument("--label", default="tiny_cpu")
    ap.add_argument("--out", default=None)
    ap.add_argument("--render", default=None, metavar="JSON",
                    help="only (re)write the Markdown table of an earlier run's JSON")
    args = ap.parse_args(argv)
    if args.render:
        doc = json.loads(Path(args.render).read_text())
        Path(args.render).with_suffix(".md").write_text(render(doc))
        print(render(doc))
        return 0
    if not (args.url or args.model):
        ap.error("give --url or --model")
    if args.replies < 1 or args.interrupts < 0:
        ap.error("--replies must be >= 1 and --interrupts >= 0")
    out = Path(args.out or ROOT / f"benchmarks/tts/results/agent_bench_{args.label}.json")
    out.parent.mkdir(parents=True, exist_ok=True)
    machine = machine_info()
    ctx = (server(args.model, args.server_args.split(), out.with_suffix(".server.log"))
           if args.model else contextlib.nullcontext(args.url))
    t_start = time.monotonic()
    with ctx as url:
        rows = asyncio.run(run_all(url, args))
    summaries = [summarize(k, v) for k, v in rows.items()]
    doc = dict(label=args.label, model=args.model or args.url, server_args=args.server_args,
               rates=args.rates, replies=args.replies, interrupts=args.interrupts,
               texts=REPLIES, machine=machine, wall_s=round(time.monotonic() - t_start, 1),
               summaries=summaries, rows=rows,
               command="python benchmarks/tts/agent_bench.py " + shlex.join(
                   argv if argv is not None else sys.argv[1:]))
    out.write_text(json.dumps(doc, indent=1))
    table = render(doc)
    out.with_suffix(".md").write_text(table)
    print_machine(machine)
    print(table)
    print(f"wrote {out} and its .md ({doc['wall_s']} s)")
    return 0


def render(doc: dict) -> str:
    """The results as Markdown: the machine, then one table per kind of case."""
    from benchmarks.tts.machine import machine_label

    lines = [f"# agent_bench: {doc['label']}", "",
             f"Machine: {machine_label(doc['machine'])}, "
             f"{doc['machine'].get('bandwidth_gbs_1_thread')} GB/s on 1 thread. Model: `{doc['model']}` "
             f"(`omni-stream serve {doc['server_args']}`). Command: `{doc['command']}`.", "",
             "| LLM tok/s | TTS | n | first token -> first audio p50 / p95 (ms) | "
             "silence after first audio p50 / p95 (ms) | replies with gaps | audio s (mean) |",
             "|---|---|---|---|---|---|---|"]
    for s in doc["summaries"]:
        if "first_audio_ms_p50" in s:
            rate, service = s["case"].split("/")
            lines.append(f"| {rate} | {service} | {s['n']} | {s['first_audio_ms_p50']:.0f} / "
                         f"{s['first_audio_ms_p95']:.0f} | {s['silence_ms_p50']:.0f} / "
                         f"{s['silence_ms_p95']:.0f} | {s['replies_with_gaps']}/{s['n']} | "
                         f"{s['audio_s_mean']:.1f} |")
    lines += ["", "| interrupted | n | audio out of the TTS after the interruption p50 / p95 "
              "(ms) | server stream freed after p50 / p95 (ms) |", "|---|---|---|---|"]
    for s in doc["summaries"]:
        if "server_free_ms_p50" in s:
            lines.append(f"| {s['case'].split('/')[1]} | {s['n']} | "
                         f"{s['audio_after_interrupt_ms_p50']:.1f} / "
                         f"{s['audio_after_interrupt_ms_p95']:.1f} | "
                         f"{s['server_free_ms_p50']:.1f} / {s['server_free_ms_p95']:.1f} |")
    return "\n".join(lines) + "\n"


if __name__ == "__main__":
    sys.exit(main())
