// The live dashboard: polls GET /v1/stats once a second and draws the time per frame step,
// part by part, against the 80 ms frame on a canvas. No build step, no library.
// When the server has an API key, the first 401 shows a key prompt; the key is kept in
// sessionStorage ("omni-stream-api-key", shared with the playground), never in a URL.
"use strict";

(() => {
  const KEY_NAME = "omni-stream-api-key";
  const STATS_URL = "/v1/stats";
  const PERIOD_MS = 1000;
  const POINTS = 60; // one a second: the last minute
  const SERIES = [ // [key in step_ms, label, colour]
    ["talker_lm", "talker (LM)", "#2563eb"],
    ["code_predictor", "code predictor", "#16a34a"],
    ["codec", "codec", "#d97706"],
    ["transport", "transport", "#9333ea"],
  ];
  const FRAME_COLOUR = "#b42318";

  // what the page has seen and drawn (read by the browser tests)
  const state = window.omniDashboard = { points: [], polls: 0, draws: 0, frameMs: 80, last: null };
  const $ = (id) => document.getElementById(id);
  let timer = null;
  let keptKey = null; // where sessionStorage is off: this page's life only

  function apiKey() {
    try { return sessionStorage.getItem(KEY_NAME) || keptKey; } catch (_) { return keptKey; }
  }

  async function errorMessage(r) {
    try {
      const body = await r.json();
      if (body && body.error && body.error.message) return body.error.message;
    } catch (_) { /* not JSON */ }
    return `${r.status} ${r.statusText}`;
  }

  function setStatus(text, bad) {
    const s = $("status");
    s.textContent = text;
    s.classList.toggle("bad", Boolean(bad));
  }

  function askKey(message) {
    const form = $("key-form");
    $("key-error").textContent = message;
    if (form.hidden) {
      form.hidden = false;
      $("key-input").focus();
    }
    setStatus("waiting for the API key", true);
  }

  function schedule() {
    clearTimeout(timer);
    timer = setTimeout(poll, PERIOD_MS);
  }

  async function poll() {
    const headers = {};
    const key = apiKey();
    if (key) headers.Authorization = `Bearer ${key}`;
    let r;
    try {
      r = await fetch(STATS_URL, { headers, cache: "no-store" });
    } catch (e) {
      setStatus(`server unreachable (${e.message}); retrying`, true);
      schedule();
      return;
    }
    if (r.status === 401) { // stop polling until a key is given
      askKey(await errorMessage(r));
      return;
    }
    if (!r.ok) {
      setStatus(await errorMessage(r), true);
      schedule();
      return;
    }
    show(await r.json());
    schedule();
  }

  const fmt = (v, digits) => (v === null || v === undefined ? "–" : Number(v).toFixed(digits));

  function show(body) {
    state.polls += 1;
    state.last = body;
    state.frameMs = body.frame_ms || 80;
    $("model").textContent = body.model + (body.ready ? "" : " (starting)");
    const cap = body.capacity;
    $("capacity").textContent = cap ? String(cap.capacity_streams) : "–";
    $("slots").textContent = cap && cap.slots !== undefined ? String(cap.slots) : "–";
    $("rtf").textContent = cap ? fmt(cap.rtf_estimate, 2) : "–";
    $("realtime").textContent = !cap ? "not measured yet"
      : cap.realtime ? "one stream; real time" : "one stream; NOT real time: first audio held back";
    $("bandwidth").textContent = body.bandwidth_gbs === null ? "unknown"
      : `${fmt(body.bandwidth_gbs, 1)} GB/s`;
    for (const k of ["running", "queued", "refused"]) $(k).textContent = String(body.streams[k]);
    const point = { t: Date.now() };
    for (const [k] of SERIES) point[k] = body.step_ms ? (body.step_ms[k] ?? null) : null;
    state.points.push(point);
    if (state.points.length > POINTS) state.points.shift();
    setStatus(body.step_ms
      ? `last ${fmt(body.window_s, 1)} s: ${body.steps} frame steps`
      : "idle: no frame steps in the last few seconds (send a request to see the parts)");
    table(body);
    draw();
  }

  function table(body) {
    const rows = [...SERIES];
    if (body.step_ms && body.step_ms.wall !== undefined) rows.push(["wall", "wall time per step", null]);
    const tbody = $("parts").tBodies[0];
    tbody.replaceChildren(...rows.map(([k, label, colour]) => {
      const tr = document.createElement("tr");
      const name = document.createElement("td");
      if (colour) {
        const sw = document.createElement("span");
        sw.className = "swatch";
        sw.style.background = colour;
        name.append(sw);
      }
      name.append(label);
      const v = document.createElement("td");
      v.textContent = body.step_ms ? fmt(body.step_ms[k], 1) : "–";
      v.dataset.part = k;
      tr.append(name, v);
      return tr;
    }));
  }

  function draw() {
    const canvas = $("chart");
    const dpr = window.devicePixelRatio || 1;
    const w = canvas.clientWidth, h = canvas.clientHeight;
    if (canvas.width !== Math.round(w * dpr) || canvas.height !== Math.round(h * dpr)) {
      canvas.width = Math.round(w * dpr);
      canvas.height = Math.round(h * dpr);
    }
    const ctx = canvas.getContext("2d");
    ctx.setTransform(dpr, 0, 0, dpr, 0, 0);
    ctx.clearRect(0, 0, w, h);
    const pad = { l: 44, r: 12, t: 26, b: 24 };
    const pw = w - pad.l - pad.r, ph = h - pad.t - pad.b;
    let top = state.frameMs * 1.25;
    for (const p of state.points) for (const [k] of SERIES) if (p[k] !== null) top = Math.max(top, p[k] * 1.1);
    top = Math.ceil(top / 20) * 20;
    const y = (ms) => pad.t + ph - (ms / top) * ph;
    const x = (i) => pad.l + (pw * i) / (POINTS - 1);
    const offset = POINTS - state.points.length; // newest point at the right edge

    ctx.font = "11px system-ui, sans-serif";
    ctx.fillStyle = "#5b6470";
    ctx.strokeStyle = "#e5e8ec";
    ctx.lineWidth = 1;
    ctx.textAlign = "right";
    ctx.textBaseline = "middle";
    const stepMs = top > 200 ? 50 : 20;
    for (let ms = 0; ms <= top; ms += stepMs) {
      ctx.beginPath(); ctx.moveTo(pad.l, y(ms)); ctx.lineTo(pad.l + pw, y(ms)); ctx.stroke();
      ctx.fillText(`${ms}`, pad.l - 6, y(ms));
    }
    ctx.textAlign = "left";
    ctx.fillText("ms", 4, pad.t - 12);
    ctx.textBaseline = "top";
    ctx.fillText("60 s ago", pad.l, pad.t + ph + 6);
    ctx.textAlign = "right";
    ctx.fillText("now", pad.l + pw, pad.t + ph + 6);

    ctx.save(); // the frame budget
    ctx.strokeStyle = FRAME_COLOUR;
    ctx.setLineDash([6, 4]);
    ctx.lineWidth = 1.5;
    ctx.beginPath(); ctx.moveTo(pad.l, y(state.frameMs)); ctx.lineTo(pad.l + pw, y(state.frameMs)); ctx.stroke();
    ctx.restore();
    ctx.fillStyle = FRAME_COLOUR;
    ctx.textAlign = "right";
    ctx.textBaseline = "bottom";
    ctx.fillText(`${state.frameMs} ms frame`, pad.l + pw, y(state.frameMs) - 3);

    ctx.lineWidth = 2;
    ctx.lineJoin = "round";
    for (const [k, , colour] of SERIES) {
      ctx.strokeStyle = colour;
      ctx.fillStyle = colour;
      ctx.beginPath();
      let pen = false;
      state.points.forEach((p, i) => {
        if (p[k] === null) { pen = false; return; }
        const px = x(i + offset), py = y(p[k]);
        if (pen) ctx.lineTo(px, py); else ctx.moveTo(px, py);
        pen = true;
      });
      ctx.stroke();
      const lastP = state.points[state.points.length - 1];
      if (lastP && lastP[k] !== null) {
        ctx.beginPath(); ctx.arc(x(POINTS - 1), y(lastP[k]), 3, 0, 2 * Math.PI); ctx.fill();
      }
    }
    // legend, top left
    ctx.textAlign = "left";
    ctx.textBaseline = "middle";
    let lx = pad.l + 4;
    for (const [, label, colour] of SERIES) {
      ctx.fillStyle = colour;
      ctx.fillRect(lx, 6, 10, 10);
      ctx.fillStyle = "#1b1f24";
      ctx.fillText(label, lx + 14, 11);
      lx += 24 + ctx.measureText(label).width;
    }
    state.draws += 1;
  }

  function init() {
    $("key-form").addEventListener("submit", (ev) => {
      ev.preventDefault();
      const key = $("key-input").value.trim();
      if (!key) return;
      keptKey = key;
      try { sessionStorage.setItem(KEY_NAME, key); } catch (_) { /* storage off: kept above */ }
      $("key-form").hidden = true;
      $("key-error").textContent = "";
      setStatus("checking the key…");
      poll();
    });
    window.addEventListener("resize", draw);
    draw();
    poll();
  }

  if (document.readyState === "loading") document.addEventListener("DOMContentLoaded", init);
  else init();
})();
