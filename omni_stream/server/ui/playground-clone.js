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
