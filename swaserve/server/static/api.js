// The server's API as the page uses it: the key from localStorage as a bearer token,
// JSON reads, and a chat completion streamed as server-sent events.
"use strict";

const Api = (() => {
  const KEY = "swaserve.apiKey";

  function headers() {
    const h = { "Content-Type": "application/json" };
    const key = localStorage.getItem(KEY);
    if (key) h.Authorization = `Bearer ${key}`;
    return h;
  }

  async function failure(resp) {
    let message = `${resp.status} ${resp.statusText}`;
    try {
      const body = await resp.json();
      if (body.error && body.error.message) message = `${resp.status}: ${body.error.message}`;
    } catch (_) { /* not JSON: the status says it */ }
    return new Error(message);
  }

  async function getJSON(path) {
    const resp = await fetch(path, { headers: headers() });
    if (!resp.ok) throw await failure(resp);
    return resp.json();
  }

  // each `data:` event's JSON to `onChunk` until [DONE]; an `error` event raises
  async function readEvents(resp, onChunk) {
    const reader = resp.body.getReader();
    const decoder = new TextDecoder();
    let buf = "";
    for (;;) {
      const { value, done } = await reader.read();
      if (done) break;
      buf += decoder.decode(value, { stream: true });
      let end;
      while ((end = buf.indexOf("\n\n")) >= 0) {
        const event = buf.slice(0, end);
        buf = buf.slice(end + 2);
        for (const line of event.split("\n")) {
          if (!line.startsWith("data:")) continue;
          const data = line.slice(5).trim();
          if (data === "[DONE]") return;
          const obj = JSON.parse(data);
          if (obj.error) throw new Error(obj.error.message || "the server failed");
          onChunk(obj);
        }
      }
    }
  }

  // stream one chat completion; `onDelta(delta, chunk)` for each choice-0 delta, and
  // `onUsage(usage)` at the end; `signal` aborts it
  async function streamChat(body, { onDelta, onUsage, signal }) {
    const resp = await fetch("/v1/chat/completions", {
      method: "POST", headers: headers(), signal,
      body: JSON.stringify({ ...body, stream: true, stream_options: { include_usage: true } }),
    });
    if (!resp.ok) throw await failure(resp);
    await readEvents(resp, (chunk) => {
      if (chunk.usage && onUsage) onUsage(chunk.usage);
      const choice = (chunk.choices || [])[0];
      if (choice && choice.delta) onDelta(choice.delta, chunk);
    });
  }

  return {
    KEY, getJSON, streamChat,
    setKey(key) {
      if (key) localStorage.setItem(KEY, key);
      else localStorage.removeItem(KEY);
    },
    getKey() { return localStorage.getItem(KEY) || ""; },
  };
})();
