// WAV files made in the page: the download of what was played, a recorded voice clip.

/** A mono 16-bit PCM WAV file of `pcm` (an Int16Array), at `rate` Hz. */
export function wavBlob(pcm, rate) {
  const head = new DataView(new ArrayBuffer(44));
  const text = (at, s) => { for (let i = 0; i < s.length; i++) head.setUint8(at + i, s.charCodeAt(i)); };
  text(0, "RIFF");
  head.setUint32(4, 36 + pcm.byteLength, true);
  text(8, "WAVE");
  text(12, "fmt ");
  head.setUint32(16, 16, true);
  head.setUint16(20, 1, true); // PCM
  head.setUint16(22, 1, true); // mono
  head.setUint32(24, rate, true);
  head.setUint32(28, rate * 2, true);
  head.setUint16(32, 2, true);
  head.setUint16(34, 16, true);
  text(36, "data");
  head.setUint32(40, pcm.byteLength, true);
  return new Blob([head.buffer, pcm], {type: "audio/wav"}); // little-endian platforms
}

/** Float samples in [-1, 1] as 16-bit PCM. */
export function toInt16(samples) {
  return Int16Array.from(samples, (v) => Math.round(Math.max(-1, Math.min(1, v)) * 32767));
}
