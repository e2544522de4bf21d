// The page side of the player: one AudioContext, the jitter-buffer worklet (player-worklet.js)
// and an AnalyserNode behind it for the waveform. The context is made at the stream's sample
// rate where the browser allows it (no resampling then); otherwise the worklet resamples.

export class Player {
  /** `contextRate`: run the AudioContext at this rate instead of the stream's (to try the
   * worklet's resampling: the page's ?rate=48000). */
  constructor({onStats, onTap, contextRate = null}) {
    this.contextRate = contextRate;
    this.ctx = null;
    this.node = null;
    this.analyser = null;
    this.tap = false;
    this.stats = {state: "idle", underruns: 0, buffered_s: 0, played_s: 0, waiting: false};
    this.onStats = onStats;
    this.onTap = onTap;
  }

  /** Make (once) and resume the audio graph; call from a user gesture (click, key). */
  async ensure(rate) {
    if (this.ctx === null) {
      let ctx;
      try {
        ctx = new AudioContext({sampleRate: this.contextRate || rate, latencyHint: "interactive"});
      } catch (e) { // a rate this browser cannot run: the worklet resamples
        ctx = new AudioContext({latencyHint: "interactive"});
      }
      await ctx.audioWorklet.addModule("/ui/player-worklet.js");
      const node = new AudioWorkletNode(ctx, "omni-player",
        {numberOfInputs: 0, numberOfOutputs: 1, outputChannelCount: [1]});
      node.port.onmessage = (e) => this.onMessage(e.data);
      const analyser = new AnalyserNode(ctx, {fftSize: 2048});
      node.connect(analyser).connect(ctx.destination);
      this.ctx = ctx;
      this.node = node;
      this.analyser = analyser;
      this.send({type: "tap", on: this.tap});
    }
    if (this.ctx.state !== "running") await this.ctx.resume();
  }

  get sampleRate() {
    return this.ctx ? this.ctx.sampleRate : null;
  }

  setTap(on) {
    this.tap = on;
    this.send({type: "tap", on});
  }

  send(msg, transfer) {
    if (this.node) this.node.port.postMessage(msg, transfer || []);
  }

  start(rate) { this.send({type: "start", rate}); }
  /** s16le bytes (an ArrayBuffer from the WebSocket) into the buffer; the buffer is moved. */
  push(bytes) {
    const pcm = new Int16Array(bytes);
    this.send({type: "pcm", data: pcm}, [pcm.buffer]);
  }
  end() { this.send({type: "end"}); }
  flush() { this.send({type: "flush"}); }
  waiting(on) { this.send({type: "waiting", on}); }

  onMessage(m) {
    if (m.type === "stats") {
      this.stats = m;
      this.onStats(m);
    } else if (m.type === "tap") {
      this.onTap(m.data);
    }
  }
}

/** Draw what is playing (the analyser's last 2048 samples, as a min/max envelope per pixel
 * column) on `canvas`, at most `fps` times a second, while `busy()`. */
export function drawWaveform(canvas, player, busy, fps = 20) {
  const g = canvas.getContext("2d");
  const buf = new Float32Array(2048);
  const style = getComputedStyle(canvas);
  const line = style.getPropertyValue("--wave").trim() || "#2563eb";
  const flat = style.getPropertyValue("--wave-idle").trim() || "#94a3b8";
  let running = false;
  let last = -Infinity;

  function draw(live) {
    const {width: w, height: h} = canvas;
    g.clearRect(0, 0, w, h);
    if (live) player.analyser.getFloatTimeDomainData(buf);
    g.fillStyle = live ? line : flat;
    const per = buf.length / w;
    for (let x = 0; x < w; x++) {
      let lo = 0, hi = 0;
      if (live) {
        lo = hi = buf[Math.floor(x * per)];
        for (let i = Math.floor(x * per) + 1; i < Math.floor((x + 1) * per); i++) {
          lo = Math.min(lo, buf[i]);
          hi = Math.max(hi, buf[i]);
        }
      }
      const top = Math.round(h / 2 - hi * (h / 2) * 0.95);
      const bottom = Math.round(h / 2 - lo * (h / 2) * 0.95);
      g.fillRect(x, top, 1, Math.max(1, bottom - top));
    }
  }

  function frame(now) {
    const live = player.analyser !== null && busy();
    if (!live || now - last >= 1000 / fps) {
      draw(live);
      last = now;
    }
    running = live;
    if (live) requestAnimationFrame(frame);
  }

  draw(false);
  return () => { if (!running) { running = true; requestAnimationFrame(frame); } };
}
