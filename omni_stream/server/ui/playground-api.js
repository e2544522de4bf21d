// The server's API as the playground uses it: fetch with the API key (when the server has
// one), the error text exactly as the server words it, and the speech WebSocket.
//
// The key lives in sessionStorage (this tab, until it closes), never in a URL. A browser
// cannot set Authorization on a WebSocket, so the socket carries it as the subprotocol
// "omni-stream.bearer.<key>" beside "omni-stream".

const KEY_ITEM = "omni-stream.api-key";

export class ApiError extends Error {
  constructor(message, status) {
    super(message);
    this.status = status;
  }
}

export function apiKey() {
  return sessionStorage.getItem(KEY_ITEM);
}

export function setApiKey(key) {
  if (key) sessionStorage.setItem(KEY_ITEM, key); else sessionStorage.removeItem(KEY_ITEM);
}

/** The server's own words for a failed response: error.message of its JSON body. */
export async function errorMessage(r) {
  const text = await r.text();
  try {
    const body = JSON.parse(text);
    if (body && body.error && body.error.message) return body.error.message;
  } catch (e) { /* not JSON: use the text */ }
  return text.trim() || `HTTP ${r.status} ${r.statusText}`;
}

/** fetch() with the key; a non-2xx answer throws ApiError(the server's message, status). */
export async function api(path, opts = {}, key = apiKey()) {
  const headers = new Headers(opts.headers || {});
  if (key) headers.set("Authorization", `Bearer ${key}`);
  const r = await fetch(path, {...opts, headers});
  if (!r.ok) throw new ApiError(await errorMessage(r), r.status);
  return r;
}

/** The speech WebSocket: JSON events to `onEvent`, binary PCM to `onAudio`. */
export class Session {
  constructor({onEvent, onAudio, onClose}) {
    this.ws = null;
    this.opened = null;
    this.onEvent = onEvent;
    this.onAudio = onAudio;
    this.onClose = onClose;
  }

  get open() {
    return this.ws !== null && this.ws.readyState === WebSocket.OPEN;
  }

  /** Connect (once; again after a close); resolves with the session.created event. */
  connect() {
    if (this.opened) return this.opened;
    const url = new URL("/v1/audio/speech/stream", location.href);
    url.protocol = url.protocol === "https:" ? "wss:" : "ws:";
    const key = apiKey();
    const protocols = ["omni-stream", ...(key ? [`omni-stream.bearer.${key}`] : [])];
    this.opened = new Promise((resolve, reject) => {
      let ws;
      try {
        ws = new WebSocket(url, protocols);
      } catch (e) { // a key with characters a subprotocol cannot carry
        this.opened = null;
        reject(new ApiError(`cannot open the WebSocket: ${e.message}`, 0));
        return;
      }
      ws.binaryType = "arraybuffer";
      let created = false;
      ws.onmessage = (e) => {
        if (typeof e.data !== "string") { this.onAudio(e.data); return; }
        const msg = JSON.parse(e.data);
        if (!created && msg.type === "session.created") { created = true; resolve(msg); }
        this.onEvent(msg);
      };
      ws.onclose = (e) => {
        this.ws = null;
        this.opened = null;
        if (!created) reject(new ApiError("the WebSocket closed before the session started " +
                                          `(code ${e.code})`, 0));
        this.onClose(e);
      };
      this.ws = ws;
    });
    return this.opened;
  }

  send(msg) {
    this.ws.send(JSON.stringify(msg));
  }

  close() {
    if (this.ws) this.ws.close(1000);
  }
}
