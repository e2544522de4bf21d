// The playground's player: an AudioWorkletProcessor holding a jitter buffer of float samples.
//
// The page posts the server's PCM (s16le as an Int16Array, at the stream's sample rate) as it
// arrives; the processor converts it, resamples it to the AudioContext's rate when the two
// differ (linear, its state carried across chunks), and appends it to ONE contiguous ring
// buffer, so chunk joins are sample-continuous (no clicks). Playback starts with the first
// chunk. When the buffer runs dry while the stream is still open, that is an underrun: the
// output is silence, the counter goes up once, and playback resumes when a little audio is
// buffered again. The end of a stream (after "end"), and a pause while the server waits for
// the writer's text ("waiting"), are not underruns.
//
// Messages in:  {type: "start", rate} | {type: "pcm", data: Int16Array} | {type: "end"}
//               | {type: "flush"} | {type: "waiting", on} | {type: "tap", on}
// Messages out: {type: "stats", ...} (every ~50 ms while busy, and on each change of state),
//               {type: "tap", data: Int16Array} (with tap on: each "pcm" input, as received)

const REBUFFER_S = 0.08; // after an underrun, resume once this much is buffered (one frame)
const FADE_S = 0.004; // a flush fades the next 4 ms out instead of cutting mid-wave
const STATS_EVERY = 16; // render quanta (128 frames each) between stats messages

class OmniPlayer extends AudioWorkletProcessor {
  constructor() {
    super();
    this.ring = new Float32Array(Math.ceil(sampleRate * 10));
    this.head = 0; // read position in the ring
    this.size = 0; // samples buffered
    this.state = "idle"; // idle | playing | starved
    this.ended = true;
    this.waiting = false;
    this.underruns = 0;
    this.played = 0; // samples output from the buffer since the last start
    this.tap = false;
    this.quanta = 0;
    this.setRate(sampleRate);
    this.port.onmessage = (e) => this.onMessage(e.data);
  }

  setRate(rate) {
    this.step = rate / sampleRate; // input samples per output sample
    this.prev = 0; // last input sample of the previous chunk (resampler state)
    this.pos = 1; // position of the next output sample, in input samples from `prev`
  }

  onMessage(m) {
    switch (m.type) {
      case "start":
        this.ended = false;
        this.waiting = false;
        this.played = 0;
        this.setRate(m.rate);
        break;
      case "pcm":
        this.push(m.data);
        if (this.tap) this.port.postMessage({type: "tap", data: m.data}, [m.data.buffer]);
        break;
      case "end":
        this.ended = true;
        if (this.state === "starved") this.setState(this.size > 0 ? "playing" : "idle");
        break;
      case "flush":
        this.flush();
        break;
      case "waiting":
        this.waiting = m.on;
        break;
      case "tap":
        this.tap = m.on;
        break;
    }
    this.postStats();
  }

  push(pcm) {
    const n = pcm.length;
    if (n === 0) return;
    let out;
    if (this.step === 1) {
      out = new Float32Array(n);
      for (let i = 0; i < n; i++) out[i] = pcm[i] / 32768;
    } else {
      // linear interpolation between prev, pcm[0], ..., pcm[n - 1]; `pos` counts from prev
      const count = Math.max(0, Math.ceil((n - this.pos) / this.step));
      out = new Float32Array(count);
      let p = this.pos;
      for (let k = 0; k < count; k++, p += this.step) {
        const i = Math.floor(p);
        const f = p - i;
        const a = i === 0 ? this.prev : pcm[i - 1] / 32768;
        const b = pcm[i] / 32768;
        out[k] = a + (b - a) * f;
      }
      this.pos = p - n;
      this.prev = pcm[n - 1] / 32768;
    }
    this.write(out);
    if (this.state === "idle" || (this.state === "starved" && this.size >= REBUFFER_S * sampleRate)) {
      this.setState("playing");
    }
  }

  write(x) {
    const need = this.size + x.length;
    if (need > this.ring.length) { // grow, keeping the buffered samples in order
      const bigger = new Float32Array(Math.max(need, this.ring.length * 2));
      for (let i = 0; i < this.size; i++) bigger[i] = this.ring[(this.head + i) % this.ring.length];
      this.ring = bigger;
      this.head = 0;
    }
    const cap = this.ring.length;
    let w = (this.head + this.size) % cap;
    const first = Math.min(x.length, cap - w);
    this.ring.set(x.subarray(0, first), w);
    this.ring.set(x.subarray(first), 0);
    this.size += x.length;
  }

  flush() {
    const fade = this.state === "playing" ? Math.min(this.size, Math.round(FADE_S * sampleRate)) : 0;
    for (let i = 0; i < fade; i++) {
      this.ring[(this.head + i) % this.ring.length] *= 1 - (i + 1) / fade;
    }
    this.size = fade;
    this.ended = true;
    this.waiting = false;
    if (fade === 0) this.setState("idle");
  }

  setState(s) {
    if (s === this.state) return;
    this.state = s;
    this.postStats();
  }

  postStats() {
    this.port.postMessage({type: "stats", state: this.state, underruns: this.underruns,
                           buffered_s: this.size / sampleRate, played_s: this.played / sampleRate,
                           waiting: this.waiting});
  }

  process(_inputs, outputs) {
    const out = outputs[0][0];
    let i = 0;
    if (this.state === "playing") {
      const cap = this.ring.length;
      const n = Math.min(out.length, this.size);
      for (; i < n; i++) out[i] = this.ring[(this.head + i) % cap];
      this.head = (this.head + n) % cap;
      this.size -= n;
      this.played += n;
      if (this.size === 0 && this.ended) {
        this.setState("idle");
      } else if (n < out.length) { // the output needed more than the stream has delivered
        if (!this.waiting) this.underruns++;
        this.setState("starved");
      }
    }
    out.fill(0, i);
    if (this.state !== "idle" && ++this.quanta % STATS_EVERY === 0) this.postStats();
    return true;
  }
}

registerProcessor("omni-player", OmniPlayer);
