// The playground at /: type, pick a voice, hear it stream. One WebSocket session per page
// (playground-api.js), one jitter-buffered player (playground-player.js, player-worklet.js),
// voice cloning where the model can (playground-clone.js).
//
// Each request is one label (context_id) on the session: "Speak" sends the text and
// input.done; "Speak as you type" opens a continuous utterance and sends each keystroke's new
// text; both end at context.done. "Stop" sends input.cancel and flushes the player at once;
// audio still in flight until audio.cancelled is dropped.
//
// ?rate=N runs the AudioContext at N Hz (the worklet resamples). For tests,
// window.omniPlayground exposes the events, the stats and (with ?tap, or
// setTap(true)) the PCM the worklet received, as Int16Array chunks in `received`, and when
// each binary frame arrived (`arrivals`).

import {api, ApiError, apiKey, setApiKey, Session} from "./playground-api.js";
import {Player, drawWaveform} from "./playground-player.js";
import {wireClone} from "./playground-clone.js";
import {wavBlob} from "./playground-wav.js";

const $ = (id) => document.getElementById(id);

const pg = {
  events: [], // every JSON event from the server, with `at` (performance.now())
  received: [], // with the tap on: the PCM the worklet received (Int16Array chunks)
  arrivals: [], // [performance.now(), samples] per binary frame played
  stats: {},
  get request() { return req; }, // the running or last request (its `pcm`: the bytes received)
  get contextRate() { return player.sampleRate; },
  setTap(on) { player.setTap(on); },
  clearReceived() { this.received = []; this.arrivals = []; },
};
window.omniPlayground = pg;

const params = new URLSearchParams(location.search);
const player = new Player({onStats, onTap: (pcm) => pg.received.push(pcm),
                          contextRate: Number(params.get("rate")) || null});
player.tap = params.has("tap");
const session = new Session({onEvent, onAudio, onClose});
const kickWaveform = drawWaveform($("wave"), player, () => player.stats.state !== "idle");

let serverRate = 24000; // session.created says; Qwen3-TTS-12Hz speaks at 24 kHz
let req = null; // the running (or last) request
let labels = 0;
let dropping = false; // between input.cancel and audio.cancelled
let configured = null; // {resolve, reject} while a session.config awaits its answer
const typing = {open: false, sent: "", chain: Promise.resolve()};

// ------------------------------------------------------------------------------ status
function say(text) { $("status").textContent = text; }
function showError(text) { $("error").textContent = text; }

function fmtMs(ms) { return ms == null ? "–" : `${Math.round(ms)} ms`; }

function render() {
  const s = player.stats;
  $("ttfa").textContent = fmtMs(req && req.firstAudio != null ? req.firstAudio - req.t0 : null);
  $("rtf").textContent = req && req.rtf != null ? req.rtf.toFixed(2) : "–";
  $("underruns").textContent = String(s.underruns || 0);
  $("buffered").textContent = `${(s.buffered_s || 0).toFixed(2)} s`;
  const busy = req !== null && !req.done;
  $("stop").disabled = !busy && s.state === "idle";
  pg.stats = {...s, ttfa_ms: req && req.firstAudio != null ? req.firstAudio - req.t0 : null,
              rtf: req ? req.rtf : null, busy};
}

function onStats(s) {
  if (s.state === "playing") kickWaveform();
  render();
}

// ------------------------------------------------------------------------------ the API key
function askKey(message) {
  $("key-panel").hidden = false;
  $("key-message").textContent = message;
  $("key").focus();
}

async function useKey(e) {
  e.preventDefault();
  const key = $("key").value.trim();
  try {
    const r = await api("/v1/audio/voices", {}, key); // checked by fetch: a failed WS hides why
    setApiKey(key);
    $("key-panel").hidden = true;
    $("key").value = "";
    session.close();
    showVoices(await r.json());
    say("API key accepted (kept for this tab only)");
    $("text").focus();
  } catch (err) {
    $("key-message").textContent = err.message;
  }
}

/** Run an API call; a 401 asks for the key, other errors are shown in the server's words. */
async function guarded(fn, where = showError) {
  try {
    return await fn();
  } catch (err) {
    if (err instanceof ApiError && err.status === 401) askKey(err.message);
    else where(err.message);
    return undefined;
  }
}

// ------------------------------------------------------------------------------ voices
function showVoices(v, select) {
  const sel = $("voice");
  const keep = select || sel.value;
  sel.replaceChildren();
  const groups = [["Built-in", "builtin"], ["Uploaded", "uploaded"]];
  for (const [title, kind] of groups) {
    const items = v.data.filter((d) => d.kind === kind);
    if (items.length === 0) continue;
    const g = document.createElement("optgroup");
    g.label = title;
    for (const d of items) g.append(new Option(d.id, d.id));
    sel.append(g);
  }
  if (keep && [...sel.options].some((o) => o.value === keep)) sel.value = keep;
  const lang = $("language");
  const keepLang = lang.value;
  lang.replaceChildren(...v.languages.map((l) => new Option(l, l)));
  if (v.languages.includes(keepLang)) lang.value = keepLang;
  $("clone").hidden = !v.voice_clone;
}

async function loadVoices(select) {
  await guarded(async () => showVoices(await (await api("/v1/audio/voices")).json(), select));
}

// ------------------------------------------------------------------------------ the session
function options() {
  const int = (id) => {
    const raw = $(id).value.trim();
    return raw === "" ? null : Number(raw);
  };
  return {voice: $("voice").value || null, language: $("language").value || null,
          seed: int("seed"), max_new_tokens: int("max-frames")};
}

/** Audio running, the session open and configured; false (error shown) when it cannot be. */
async function prepare(textMode) {
  try {
    const opts = options();
    for (const k of ["seed", "max_new_tokens"]) {
      if (opts[k] !== null && !Number.isSafeInteger(opts[k])) {
        throw new Error(`${k === "seed" ? "Seed" : "Max frames"} must be a whole number`);
      }
    }
    if (!session.open) {
      try {
        await session.connect();
      } catch (err) { // the handshake's status is hidden from the page: ask over HTTP
        await api("/v1/audio/voices");
        throw err;
      }
    }
    await player.ensure(serverRate); // after session.created, which says the rate
    const answer = new Promise((resolve, reject) => { configured = {resolve, reject}; });
    session.send({type: "session.config", ...opts, text_mode: textMode});
    await answer;
    return true;
  } catch (err) {
    if (err instanceof ApiError && err.status === 401) askKey(err.message);
    else showError(err.message);
    return false;
  }
}

function newRequest() {
  const r = {id: `pg-${++labels}`, t0: performance.now(), firstAudio: null, samples: 0,
             rate: serverRate, waitedMs: 0, rtf: null, pcm: [], done: false};
  req = r;
  render();
  return r;
}

function onEvent(msg) {
  pg.events.push({...msg, at: performance.now()});
  switch (msg.type) {
    case "session.created":
      serverRate = msg.session.sample_rate || serverRate;
      break;
    case "session.updated":
      if (configured) { configured.resolve(msg); configured = null; }
      break;
    case "audio.start":
      if (dropping || req === null) break;
      req.rate = msg.sample_rate;
      player.start(msg.sample_rate);
      say("speaking…");
      break;
    case "text.waiting":
      player.waiting(true);
      say("speech caught up with the text: waiting for more (text.waiting)");
      break;
    case "text.resumed":
      player.waiting(false);
      say("speaking…");
      break;
    case "audio.done":
      if (dropping || req === null) break;
      player.end();
      req.waitedMs += msg.text_waited_ms || 0;
      if (req.samples > 0) {
        req.rtf = (performance.now() - req.t0 - req.waitedMs) / 1000 / (req.samples / req.rate);
      }
      break;
    case "context.done":
      if (req !== null && msg.context_id === req.id) {
        req.done = true;
        say(`done: ${(req.samples / req.rate).toFixed(2)} s of audio`);
      }
      break;
    case "audio.cancelled":
      dropping = false;
      break;
    case "error":
      if (configured && msg.context_id == null) { configured.reject(new Error(msg.error.message)); configured = null; }
      else showError(msg.error.message);
      break;
  }
  render();
}

function onAudio(bytes) {
  if (dropping || req === null || req.done) return;
  if (req.firstAudio === null) req.firstAudio = performance.now();
  req.samples += bytes.byteLength / 2;
  pg.arrivals.push([performance.now(), bytes.byteLength / 2]);
  req.pcm.push(bytes.slice(0)); // kept for the WAV download; `bytes` moves to the worklet
  player.push(bytes);
  render();
}

function onClose(e) {
  dropping = false;
  typing.open = false;
  if (configured) { configured.reject(new Error(`the session closed (code ${e.code})`)); configured = null; }
  if (req !== null && !req.done) {
    req.done = true;
    player.end();
    showError(`the session closed (code ${e.code}${e.reason ? `: ${e.reason}` : ""})`);
  }
  render();
}

// ------------------------------------------------------------------------------ actions
async function speak() {
  showError("");
  if ($("typing").checked) { finishTyping(); return; }
  const text = $("text").value;
  if (!text.trim()) { showError("Type some text to speak first."); return; }
  if ((req !== null && !req.done) || player.stats.state !== "idle") stop();
  if (!(await prepare("sentences"))) return;
  const r = newRequest();
  session.send({type: "input.text", text, context_id: r.id});
  session.send({type: "input.done", context_id: r.id});
  say("sent…");
}

function stop() {
  if (session.open && ((req !== null && !req.done) || typing.open)) {
    session.send({type: "input.cancel"});
    dropping = true;
  }
  player.flush();
  if (req !== null && !req.done) { req.done = true; say("stopped"); }
  typing.open = false;
  typing.sent = $("text").value; // typing on speaks only what comes after this
  render();
}

/** Speak as you type: send what was added since the last keystroke. */
async function sendTyped() {
  const text = $("text").value;
  if (!text.startsWith(typing.sent)) { // an edit inside text already spoken: go on from here
    typing.sent = text;
    say("edits to text already sent are not spoken again");
    return;
  }
  const piece = text.slice(typing.sent.length);
  if (piece === "") return;
  if (!typing.open) {
    if (!piece.trim()) return;
    if (!(await prepare("continuous"))) return;
    typing.open = true;
    newRequest();
    say("speaking as you type…");
  }
  typing.sent = text;
  session.send({type: "input.text", text: piece, context_id: req.id});
}

function finishTyping() {
  typing.chain = typing.chain.then(() => {
    if (typing.open) {
      session.send({type: "input.done", context_id: req.id});
      typing.open = false;
    } else {
      say("type to speak: each keystroke is sent as you type");
    }
  });
}

async function download() {
  showError("");
  const fmt = $("format").value;
  let blob;
  if (fmt === "wav" && req !== null && req.samples > 0) { // what was heard, as heard
    const pcm = new Int16Array(req.samples);
    let at = 0;
    for (const b of req.pcm) { const x = new Int16Array(b); pcm.set(x, at); at += x.length; }
    blob = wavBlob(pcm, req.rate);
  } else { // the same request, encoded by the server
    const text = $("text").value;
    if (!text.trim()) { showError("Type some text to speak first."); return; }
    say(`synthesizing ${fmt} for download…`);
    blob = await guarded(async () => {
      const r = await api("/v1/audio/speech", {
        method: "POST", headers: {"Content-Type": "application/json"},
        body: JSON.stringify({input: text, ...options(), response_format: fmt, stream: false})});
      return r.blob();
    });
    if (!blob) return;
  }
  const a = document.createElement("a");
  a.href = URL.createObjectURL(blob);
  a.download = `omni-stream.${fmt}`;
  a.click();
  setTimeout(() => URL.revokeObjectURL(a.href), 10000);
  say(`downloaded omni-stream.${fmt}`);
}

// ------------------------------------------------------------------------------ wiring
function wire() {
  $("speak-form").addEventListener("submit", (e) => { e.preventDefault(); speak(); });
  $("stop").addEventListener("click", stop);
  $("download").addEventListener("click", download);
  $("key-form").addEventListener("submit", useKey);
  $("text").addEventListener("input", () => {
    if (!$("typing").checked) return;
    typing.chain = typing.chain.then(sendTyped).catch((err) => showError(err.message));
  });
  $("typing").addEventListener("change", () => {
    if ($("typing").checked) typing.sent = "";
    else finishTyping();
  });
  wireClone({guarded, loadVoices});
  document.addEventListener("keydown", (e) => {
    if (e.key === "Enter" && (e.ctrlKey || e.metaKey)) {
      e.preventDefault();
      speak();
    } else if (e.key === "Escape") {
      e.preventDefault();
      stop();
    }
  });
}

wire();
render();
if (apiKey() !== null) say("using the API key kept for this tab");
loadVoices();
