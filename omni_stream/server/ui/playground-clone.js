// Clone a voice: a clip recorded from the microphone or picked from a file, uploaded through
// POST /v1/audio/voices (multipart: audio, name, ref_text or x_vector_only). A recording is
// decoded by the browser and sent as a 16-bit WAV, which the server reads whatever it
// was recorded in.

import {api} from "./playground-api.js";
import {toInt16, wavBlob} from "./playground-wav.js";

const CLIP_RATE = 24000;

/** Records the microphone until stop(), which resolves with a WAV Blob (mono, 24 kHz). */
export class Recorder {
  async start() {
    this.stream = await navigator.mediaDevices.getUserMedia({audio: true});
    this.chunks = [];
    this.rec = new MediaRecorder(this.stream);
    this.rec.ondataavailable = (e) => { if (e.data.size > 0) this.chunks.push(e.data); };
    this.done = new Promise((resolve) => { this.rec.onstop = resolve; });
    this.rec.start();
    this.t0 = performance.now();
  }

  async stop() {
    this.rec.stop();
    await this.done;
    for (const t of this.stream.getTracks()) t.stop();
    const encoded = await new Blob(this.chunks, {type: this.rec.mimeType}).arrayBuffer();
    const ctx = new OfflineAudioContext(1, 1, CLIP_RATE); // decodes and resamples to its rate
    const audio = await ctx.decodeAudioData(encoded);
    return wavBlob(toInt16(audio.getChannelData(0)), CLIP_RATE);
  }
}

/** Upload a clip as voice `name`; resolves with the server's record, throws ApiError. */
export async function uploadVoice({clip, filename, name, refText}) {
  const form = new FormData();
  form.append("audio", clip, filename);
  form.append("name", name);
  if (refText) form.append("ref_text", refText);
  else form.append("x_vector_only", "true"); // no transcript: the speaker embedding alone
  const r = await api("/v1/audio/voices", {method: "POST", body: form});
  return r.json();
}

// ------------------------------------------------------------------------------ the panel
const $ = (id) => document.getElementById(id);
const clone = {clip: null, filename: null, recorder: null};
let app = null; // the page's {guarded, loadVoices}

function cloneSay(text) { $("clone-status").textContent = text; }

function pickFile() {
  const f = $("clone-file").files[0];
  if (!f) return;
  clone.clip = f;
  clone.filename = f.name;
  $("clip-info").textContent = `file: ${f.name} (${Math.ceil(f.size / 1024)} KiB)`;
}

async function record() {
  const btn = $("record");
  try {
    if (clone.recorder === null) {
      clone.recorder = new Recorder();
      await clone.recorder.start();
      btn.textContent = "Stop recording";
      btn.setAttribute("aria-pressed", "true");
      cloneSay("recording… speak for 5-15 s");
    } else {
      const rec = clone.recorder;
      clone.recorder = null;
      btn.textContent = "Record";
      btn.setAttribute("aria-pressed", "false");
      clone.clip = await rec.stop();
      clone.filename = "recording.wav";
      const seconds = (clone.clip.size - 44) / 2 / CLIP_RATE;
      $("clip-info").textContent = `recording: ${seconds.toFixed(1)} s`;
      cloneSay("");
    }
  } catch (err) {
    clone.recorder = null;
    btn.textContent = "Record";
    btn.setAttribute("aria-pressed", "false");
    cloneSay(`cannot record: ${err.message}`);
  }
}

async function upload() {
  if (clone.clip === null) { cloneSay("Pick an audio file or record a clip first."); return; }
  const name = $("clone-name").value.trim();
  cloneSay("computing the voice…");
  const refText = $("clone-text").value.trim();
  const rec = await app.guarded(
    () => uploadVoice({clip: clone.clip, filename: clone.filename, name, refText}), cloneSay);
  if (!rec) return;
  cloneSay(`voice '${rec.name}' added: it is selected above`);
  await app.loadVoices(rec.name);
}

/** Wire the "Clone a voice" panel; `guarded(fn, say)` runs an API call (a 401 asks for the
 * key), `loadVoices(select)` refreshes the voice picker. */
export function wireClone(helpers) {
  app = helpers;
  $("clone-file").addEventListener("change", pickFile);
  $("record").addEventListener("click", record);
  $("upload").addEventListener("click", upload);
}
