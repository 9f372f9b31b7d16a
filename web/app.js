// The Nexus console: stream one completion at a time over one of three transports
// and show its events as they arrive. Plain browser JavaScript, no build step.
//
//   sse     POST /v1/chat/completions {"background": true} -> 202 {id, url, read_token},
//           then EventSource(url + &stream_format=nexus): the url carries the stream's
//           read token (?token=), as EventSource cannot send the key. EventSource
//           reconnects by itself and sends Last-Event-ID; the server resumes after
//           that event.
//   ndjson  POST /v1/chat/completions?stream_format=ndjson (X-Nexus-Resumable: true, so
//           that the server keeps the stream through a drop) read with fetch. If the
//           connection drops before {"type":"done"}, resume with
//           GET /v1/streams/<id>?stream_format=ndjson&last_event_id=<n>, n being the
//           number of complete non-heartbeat lines read so far (with the key, as the POST).
//   ws      GET /v1/realtime: {"type":"start","request":{...}} out, event objects in,
//           {"type":"abort"} to stop. An unexpected close reconnects the socket; the
//           turn in flight is not resumed (it is marked interrupted).
//
// The status line's data-state is one of: idle, connecting, streaming,
// reconnecting, aborting, done, aborted, error, interrupted.
"use strict";

(() => {
  const $ = (id) => document.getElementById(id);
  const els = {
    form: $("form"),
    model: $("model"),
    transport: $("transport"),
    prompt: $("prompt"),
    extra: $("extra"),
    extraBox: $("extra-box"),
    send: $("send"),
    abort: $("abort"),
    clear: $("clear"),
    status: $("status"),
    ttft: $("ttft"),
    tps: $("tps"),
    tokens: $("tokens"),
    reconnects: $("reconnects"),
    usage: $("usage"),
    socket: $("socket"),
    streamId: $("stream-id"),
    reasoning: $("reasoning"),
    output: $("output"),
    tools: $("tools"),
    error: $("error"),
    log: $("log"),
  };

  const LOG_LIMIT = 500;
  const NDJSON_MAX_RETRIES = 8;
  const WS_ABORT_GRACE_MS = 3000;
  const backoff = (attempt) => Math.min(250 * 2 ** (attempt - 1), 4000);

  const SSE_EVENTS = ["delta", "reasoning", "tool_call", "usage", "audio", "image", "citation", "done"];

  /** @type {Run | null} the turn shown on the page (finished or not) */
  let run = null;

  class Run {
    constructor(transport) {
      this.transport = transport;
      this.sentAt = performance.now();
      this.firstAt = null;
      this.lastAt = null;
      this.tokens = 0;
      this.received = 0; // non-heartbeat events, for the NDJSON resume
      this.reconnects = 0;
      this.streamId = null;
      this.finishReason = null;
      this.finished = false;
      this.controller = new AbortController();
      this.es = null;
      this.ws = null;
      this.toolCalls = [];
    }
  }

  // --- view -----------------------------------------------------------------

  const plural = (n, word) => `${n} ${word}${n === 1 ? "" : "s"}`;

  function setStatus(state, text) {
    delete els.status.dataset.models; // set again by loadModels when its failure is the status
    els.status.dataset.state = state;
    els.status.textContent = text;
  }

  function setBusy(busy) {
    els.send.disabled = busy;
    els.abort.disabled = !busy;
    els.output.setAttribute("aria-busy", String(busy));
  }

  function resetView() {
    for (const el of [els.output, els.reasoning, els.tools, els.error, els.log]) el.replaceChildren();
    els.reasoning.hidden = true;
    els.tools.hidden = true;
    els.error.hidden = true;
    els.ttft.textContent = "–";
    els.tps.textContent = "–";
    els.tokens.textContent = "0";
    els.reconnects.textContent = "0";
    els.usage.textContent = "–";
    els.streamId.textContent = "–";
  }

  function showError(message) {
    els.error.textContent = message;
    els.error.hidden = false;
  }

  function log(kind, text, r = run) {
    const item = document.createElement("li");
    item.className = `ev ev-${kind}`;
    const time = document.createElement("span");
    time.className = "time";
    time.textContent = r ? `+${Math.round(performance.now() - r.sentAt)} ms` : "";
    const body = document.createElement("code");
    body.textContent = text;
    item.append(time, " ", body);
    const atBottom = els.log.scrollHeight - els.log.scrollTop - els.log.clientHeight < 8;
    els.log.append(item);
    while (els.log.childElementCount > LOG_LIMIT) els.log.firstElementChild.remove();
    if (atBottom) els.log.scrollTop = els.log.scrollHeight;
  }

  function note(text, r = run) {
    log("note", text, r);
  }

  function showStreamId(r, id) {
    r.streamId = id || null;
    if (run === r) els.streamId.textContent = id || "–";
  }

  function countReconnect(r) {
    r.reconnects += 1;
    if (run === r) els.reconnects.textContent = String(r.reconnects);
  }

  function updateMetrics(r) {
    els.tokens.textContent = String(r.tokens);
    if (r.firstAt !== null) els.ttft.textContent = `${Math.round(r.firstAt - r.sentAt)} ms`;
    if (r.tokens > 1 && r.lastAt > r.firstAt) {
      els.tps.textContent = ((r.tokens - 1) / ((r.lastAt - r.firstAt) / 1000)).toFixed(1);
    }
  }

  function renderTools(r) {
    els.tools.textContent = r.toolCalls
      .filter(Boolean)
      .map((call) => `${call.name || "?"}(${call.arguments})`)
      .join("\n");
    els.tools.hidden = false;
  }

  // --- events -----------------------------------------------------------------

  /** Show one event object of the stream (the NDJSON / native SSE form). */
  function handleEvent(r, event) {
    if (r !== run || r.finished || event === null || typeof event !== "object") return;
    if (event.type === "heartbeat") return;
    log(event.type || "unknown", JSON.stringify(event), r);
    const delta = event.delta || {};
    switch (event.type) {
      case "delta":
        if (typeof delta.content === "string" && delta.content !== "") {
          const now = performance.now();
          if (r.firstAt === null) {
            r.firstAt = now;
            if (els.status.dataset.state !== "reconnecting") setStatus("streaming", "streaming");
          }
          r.lastAt = now;
          r.tokens += 1;
          els.output.append(delta.content);
          updateMetrics(r);
        }
        if (typeof delta.refusal === "string" && delta.refusal !== "") {
          const span = document.createElement("span");
          span.className = "refusal";
          span.textContent = delta.refusal;
          els.output.append(span);
        }
        if (Array.isArray(delta.tool_calls)) addToolCalls(r, delta.tool_calls);
        if (event.finish_reason) r.finishReason = event.finish_reason;
        break;
      case "reasoning":
        if (typeof delta.reasoning === "string") {
          els.reasoning.append(delta.reasoning);
          els.reasoning.hidden = false;
        }
        break;
      case "tool_call":
        if (Array.isArray(delta.tool_calls)) addToolCalls(r, delta.tool_calls);
        break;
      case "usage": {
        const u = event.usage || {};
        els.usage.textContent = `${u.prompt_tokens} in · ${u.completion_tokens} out · ${u.total_tokens} total`;
        break;
      }
      case "error": {
        const e = event.error || {};
        const text = `${e.code || e.type || "error"}: ${e.message || "the stream failed"}`;
        showError(e.retryable ? `${text} (retryable)` : text);
        finish(r, "error", `error: ${e.code || e.type || "stream failed"}`);
        break;
      }
      case "done":
        if (event.aborted) finish(r, "aborted", "aborted");
        else finish(r, "done", r.finishReason ? `done (${r.finishReason})` : "done");
        break;
      default:
        break; // audio, image, citation: shown in the event log only
    }
  }

  function addToolCalls(r, fragments) {
    for (const fragment of fragments) {
      const index = Number.isInteger(fragment.index) ? fragment.index : r.toolCalls.length;
      const call = (r.toolCalls[index] ||= { name: "", arguments: "" });
      const fn = fragment.function || {};
      if (fn.name) call.name = fn.name;
      if (typeof fn.arguments === "string") call.arguments += fn.arguments;
    }
    renderTools(r);
  }

  /** End the turn: release its connections, set the final status. Idempotent. */
  function finish(r, state, text) {
    if (r.finished) return;
    r.finished = true;
    if (r.es) r.es.close();
    r.controller.abort();
    if (run !== r) return;
    updateMetrics(r);
    setStatus(state, text);
    setBusy(false);
    note(`${state}: ${text}`, r);
  }

  // --- transports ---------------------------------------------------------------

  // The API key (kept in this browser only): a Bearer header on fetch, a subprotocol on
  // the WebSocket. EventSource cannot send headers: it reads a background stream with the
  // read token of the 202 (in its url), good for that one stream, for reading only.
  const keyInput = document.getElementById("api-key");
  keyInput.value = localStorage.getItem("nexus.key") || "";
  keyInput.addEventListener("change", () => {
    localStorage.setItem("nexus.key", keyInput.value.trim());
    loadModels();
    // The socket was opened with the old key: its turns would still be that key's.
    closeSocket("the API key changed");
    socket.refused = 0;
    if (els.transport.value === "ws") openSocket();
  });
  function authHeaders(extra) {
    const key = keyInput.value.trim();
    return key ? { ...extra, Authorization: `Bearer ${key}` } : { ...extra };
  }

  async function postJSON(url, body, r, extra = {}) {
    return fetch(url, {
      method: "POST",
      headers: authHeaders({ "Content-Type": "application/json", ...extra }),
      body: JSON.stringify(body),
      signal: r.controller.signal,
    });
  }

  async function httpErrorMessage(resp) {
    let detail = resp.statusText;
    try {
      const body = await resp.json();
      const e = body.error || {};
      detail = `${e.code || e.type || ""}: ${e.message || JSON.stringify(body)}`;
    } catch {
      // not JSON: keep the status text
    }
    return `HTTP ${resp.status} ${detail}`;
  }

  function streamUrl(path, params) {
    const url = new URL(path, location.href);
    for (const [key, value] of Object.entries(params)) url.searchParams.set(key, value);
    return url;
  }

  async function startSSE(r, body) {
    setStatus("connecting", "starting a background stream…");
    // No abort signal: a stream created while Abort was pressed is cancelled below, by id.
    const resp = await fetch("/v1/chat/completions", {
      method: "POST",
      headers: authHeaders({ "Content-Type": "application/json" }),
      body: JSON.stringify({ ...body, stream: true, background: true }),
    });
    if (r.finished) {
      if (resp.status === 202) cancelOnServer(r, (await resp.json()).id);
      return;
    }
    if (resp.status !== 202) throw new Error(await httpErrorMessage(resp));
    const info = await resp.json();
    showStreamId(r, info.id);
    // info.url is /v1/streams/<id>?token=<read token>: the token stays out of the log.
    const url = streamUrl(info.url || `/v1/streams/${encodeURIComponent(info.id)}`, {
      stream_format: "nexus",
    });
    note(`background stream ${info.id}; EventSource ${url.pathname} (with its read token)`, r);
    const es = new EventSource(url);
    r.es = es;
    es.addEventListener("open", () => {
      if (r.finished || run !== r) return;
      if (!r.reconnects) {
        setStatus("streaming", "streaming");
        return;
      }
      note(`reconnected after ${plural(r.reconnects, "drop")}`, r);
      setStatus("streaming", `streaming (resumed after ${plural(r.reconnects, "drop")})`);
    });
    const onFrame = (e) => {
      let event;
      try {
        event = JSON.parse(e.data);
      } catch {
        note(`unparsable ${e.type} frame: ${e.data}`, r);
        return;
      }
      handleEvent(r, event);
    };
    for (const name of SSE_EVENTS) es.addEventListener(name, onFrame);
    es.addEventListener("message", onFrame);
    // "error" is both the server's named error event (a MessageEvent with data) and
    // EventSource's own network error, after which it reconnects by itself.
    es.addEventListener("error", (e) => {
      if (typeof e.data === "string") {
        onFrame(e);
        return;
      }
      if (r.finished) return;
      if (es.readyState === EventSource.CLOSED) {
        finish(r, "error", "the event stream was refused; EventSource gave up");
        return;
      }
      countReconnect(r);
      note("connection lost; EventSource is reconnecting with Last-Event-ID", r);
      setStatus("reconnecting", "connection lost; reconnecting…");
    });
  }

  function cancelOnServer(r, id = r.streamId) {
    if (!id) return; // not known yet (startSSE cancels it when its POST is answered)
    fetch(`/v1/streams/${encodeURIComponent(id)}`, { method: "DELETE", headers: authHeaders({}) })
      .catch(() => {});
  }

  async function startNDJSON(r, body) {
    setStatus("connecting", "connecting…");
    // Resumable: the server keeps the stream going through a drop, for the resume below.
    let resp = await postJSON("/v1/chat/completions?stream_format=ndjson", { ...body, stream: true }, r, {
      "X-Nexus-Resumable": "true",
    });
    if (!resp.ok) throw new Error(await httpErrorMessage(resp));
    showStreamId(r, resp.headers.get("X-Nexus-Stream-Id"));
    let failures = 0;
    for (;;) {
      const before = r.received;
      let reason;
      try {
        await readNDJSON(r, resp);
        if (r.finished) return;
        reason = "the response ended before its done line";
      } catch (err) {
        if (r.finished || err.name === "AbortError") return;
        reason = err.message || String(err);
      }
      if (r.received > before) failures = 0;
      // Resume after the last complete line.
      for (;;) {
        failures += 1;
        if (!r.streamId || failures > NDJSON_MAX_RETRIES) {
          finish(r, "error", `connection lost (${reason}); gave up`);
          return;
        }
        countReconnect(r);
        note(`connection lost (${reason}); resuming after event ${r.received}`, r);
        setStatus("reconnecting", "connection lost; reconnecting…");
        await sleep(backoff(failures), r.controller.signal);
        if (r.finished) return;
        const url = streamUrl(`/v1/streams/${encodeURIComponent(r.streamId)}`, {
          stream_format: "ndjson",
          last_event_id: String(r.received),
        });
        try {
          resp = await fetch(url, { headers: authHeaders({}), signal: r.controller.signal });
        } catch (err) {
          if (r.finished || err.name === "AbortError") return;
          reason = err.message || String(err);
          continue;
        }
        if (resp.status === 204) {
          finish(r, "done", "done (the server says the stream is over)");
          return;
        }
        if (!resp.ok) {
          if (resp.status >= 500 || resp.status === 429) {
            reason = `HTTP ${resp.status}`;
            continue;
          }
          finish(r, "error", `resume refused: ${await httpErrorMessage(resp)}`);
          return;
        }
        note(`resumed after event ${r.received}`, r);
        setStatus("streaming", `streaming (resumed after ${plural(r.reconnects, "drop")})`);
        break;
      }
    }
  }

  /** Read NDJSON lines until the body ends or the turn is finished. A partial last line is dropped. */
  async function readNDJSON(r, resp) {
    const reader = resp.body.getReader();
    const decoder = new TextDecoder();
    let buffer = "";
    try {
      for (;;) {
        const { value, done } = await reader.read();
        if (done) return;
        buffer += decoder.decode(value, { stream: true });
        let newline;
        while ((newline = buffer.indexOf("\n")) !== -1) {
          const line = buffer.slice(0, newline).trim();
          buffer = buffer.slice(newline + 1);
          if (!line) continue;
          let event;
          try {
            event = JSON.parse(line);
          } catch {
            r.received += 1;
            note(`unparsable line: ${line}`, r);
            continue;
          }
          if (event && event.type === "heartbeat") continue;
          r.received += 1;
          handleEvent(r, event);
          if (r.finished) return;
        }
      }
    } finally {
      reader.cancel().catch(() => {});
    }
  }

  function sleep(ms, signal) {
    return new Promise((resolve) => {
      const timer = setTimeout(resolve, ms);
      signal.addEventListener("abort", () => {
        clearTimeout(timer);
        resolve();
      }, { once: true });
    });
  }

  // The WebSocket lives across turns; it reconnects on an unexpected close while
  // the WebSocket transport is selected.
  const socket = { ws: null, opened: null, attempts: 0, timer: null, refused: 0 };
  // A handshake refused for its key is not tried again until the key (or the transport)
  // changes: socket.refused is set to this.
  const MAX_REFUSED = 1;
  // A subprotocol is an HTTP token: a key with other characters cannot ride in one.
  const TOKEN = /^[!#$%&'*+\-.^_`|~0-9A-Za-z]+$/;

  function closeSocket(reason) {
    const ws = socket.ws;
    clearTimeout(socket.timer);
    socket.timer = null;
    if (!ws) return;
    socket.ws = null;
    const r = run;
    if (r && r.ws === ws && !r.finished) finish(r, "interrupted", `interrupted: ${reason}`);
    ws.close(1000, reason);
  }

  function setSocketState(text) {
    els.socket.textContent = text;
  }

  function openSocket() {
    if (socket.ws && socket.ws.readyState <= WebSocket.OPEN) return socket.opened;
    clearTimeout(socket.timer);
    socket.timer = null;
    const url = new URL("/v1/realtime", location.href);
    url.protocol = url.protocol === "https:" ? "wss:" : "ws:";
    const key = keyInput.value.trim();
    if (key && !TOKEN.test(key)) {
      // (The key itself is never shown.)
      const why = "this API key has characters a WebSocket subprotocol cannot carry: use SSE or NDJSON";
      setSocketState(why);
      socket.opened = Promise.reject(new Error(why));
      socket.opened.catch(() => {});
      return socket.opened;
    }
    const ws = key ? new WebSocket(url, ["nexus.v1", `nexus-key.${key}`]) : new WebSocket(url);
    socket.ws = ws;
    setSocketState("connecting");
    let opened = false;
    socket.opened = new Promise((resolve, reject) => {
      ws.addEventListener("open", () => {
        opened = true;
        socket.attempts = 0;
        socket.refused = 0;
        setSocketState("open");
        resolve(ws);
      }, { once: true });
      ws.addEventListener("close", () => reject(new Error("the WebSocket could not connect")), { once: true });
    });
    socket.opened.catch(() => {}); // handled by the caller that awaits it, if any
    ws.addEventListener("message", (e) => {
      let event;
      try {
        event = JSON.parse(e.data);
      } catch {
        note(`unparsable frame: ${e.data}`);
        return;
      }
      // An error that refused some other frame (refused: its type) leaves the turn running.
      const aside = event.type === "error" && event.refused && event.refused !== "start";
      if (run && run.ws === ws && !run.finished && !aside) handleEvent(run, event);
      else if (event.type === "error") note(`socket: ${JSON.stringify(event)}`);
    });
    ws.addEventListener("close", (e) => {
      if (socket.ws !== ws) return;
      socket.ws = null;
      setSocketState(`closed (${e.code})`);
      const r = run;
      if (r && r.ws === ws && !r.finished) {
        finish(r, "interrupted", `interrupted: the WebSocket closed (code ${e.code}); a WebSocket turn is not resumed, send again`);
      }
      if (els.transport.value !== "ws") return;
      if (!opened) {
        // A browser's WebSocket cannot read why a handshake failed: a plain request with
        // the same key tells a refused key (no more tries) from a gateway that is down.
        const key = keyInput.value.trim();
        refusedKey().then((refused) => {
          // Answered for a key since changed (its own socket opened meanwhile): moot.
          if (keyInput.value.trim() !== key || socket.ws || els.transport.value !== "ws") return;
          if (refused) {
            socket.refused = MAX_REFUSED;
            setSocketState(`the gateway refused the WebSocket (${refused}): change the key to try again`);
          } else {
            retrySocket(e.code, r);
          }
        });
        return;
      }
      retrySocket(e.code, r);
    });
    return socket.opened;
  }

  // The code of a refusal that waiting does not cure (a key refused: 401; a page or a
  // host name the gateway does not serve: 403), else "" (down, or busy: try again later).
  async function refusedKey() {
    try {
      const resp = await fetch("/v1/models", { headers: authHeaders({}) });
      if (resp.status !== 401 && resp.status !== 403) return "";
      const body = await resp.json().catch(() => ({}));
      return (body.error && body.error.code) || `HTTP ${resp.status}`;
    } catch {
      return ""; // the gateway is not reachable: try again later
    }
  }

  function retrySocket(code, r) {
    if (socket.refused >= MAX_REFUSED || els.transport.value !== "ws" || socket.ws) return;
    socket.attempts += 1;
    const delay = backoff(socket.attempts);
    setSocketState(`closed (${code}); reconnecting in ${delay} ms`);
    if (r && r.transport === "ws") countReconnect(r);
    socket.timer = setTimeout(() => {
      socket.timer = null;
      if (els.transport.value === "ws") openSocket();
    }, delay);
  }

  async function startWS(r, body) {
    setStatus("connecting", "connecting the WebSocket…");
    const ws = await openSocket();
    if (r.finished) return;
    r.ws = ws;
    const request = { ...body };
    delete request.stream; // the realtime surface always streams
    ws.send(JSON.stringify({ type: "start", request }));
    setStatus("streaming", "waiting for the first token…");
  }

  const transports = { sse: startSSE, ndjson: startNDJSON, ws: startWS };

  // --- controls -----------------------------------------------------------------

  function buildBody() {
    const body = {
      model: els.model.value,
      messages: [{ role: "user", content: els.prompt.value }],
    };
    const extra = els.extra.value.trim();
    if (!extra) return body;
    let fields;
    try {
      fields = JSON.parse(extra);
    } catch (err) {
      throw new Error(`extra request fields: not JSON (${err.message})`);
    }
    if (fields === null || typeof fields !== "object" || Array.isArray(fields)) {
      throw new Error("extra request fields: must be a JSON object");
    }
    return { ...body, ...fields };
  }

  async function send(e) {
    e.preventDefault();
    if (run && !run.finished) return;
    if (!els.model.value && !(await loadModels())) return; // its status says why
    let body;
    try {
      body = buildBody();
    } catch (err) {
      els.extraBox.open = true;
      setStatus("error", err.message);
      return;
    }
    resetView();
    const r = new Run(els.transport.value);
    run = r;
    setBusy(true);
    note(`send via ${r.transport}: ${body.model}`, r);
    try {
      await transports[r.transport](r, body);
    } catch (err) {
      if (r.finished) return;
      if (err.name === "AbortError") finish(r, "aborted", "aborted");
      else {
        showError(err.message || String(err));
        finish(r, "error", "failed");
      }
    }
  }

  function abort() {
    const r = run;
    if (!r || r.finished) return;
    els.abort.disabled = true;
    if (r.transport === "ws" && r.ws && r.ws.readyState === WebSocket.OPEN) {
      // The server answers {"type":"done","aborted":true}; finish() runs on it.
      r.ws.send(JSON.stringify({ type: "abort" }));
      setStatus("aborting", "aborting…");
      note("abort sent", r);
      setTimeout(() => finish(r, "aborted", "aborted (the server did not confirm)"), WS_ABORT_GRACE_MS);
      return;
    }
    // The stream outlives its connection on the server (to be resumable): cancel it there.
    if (r.transport !== "ws") cancelOnServer(r);
    finish(r, "aborted", "aborted");
  }

  // The model list. A failed load (no key yet, a wrong one, the key's rate) leaves the
  // select empty and says why; a refusal with Retry-After is tried again once it has passed,
  // and Send with no model loaded tries the load again first.
  let modelsRetry = null;
  async function loadModels() {
    clearTimeout(modelsRetry);
    try {
      const resp = await fetch("/v1/models", { headers: authHeaders({}) });
      if (!resp.ok) {
        const message = await httpErrorMessage(resp);
        const wait = Number(resp.headers.get("Retry-After"));
        if (resp.status === 429 && wait > 0) {
          const seconds = Math.min(Math.ceil(wait), 60);
          modelsRetry = setTimeout(loadModels, seconds * 1000);
          throw new Error(`${message}; trying again in ${plural(seconds, "second")}`);
        }
        throw new Error(message);
      }
      const ids = (await resp.json()).data.map((m) => m.id);
      if (!ids.length) throw new Error("the gateway lists no models");
      els.model.replaceChildren(
        ...ids.map((id) => {
          const option = document.createElement("option");
          option.value = option.textContent = id;
          return option;
        }),
      );
      els.model.dataset.loaded = "true";
      if (els.status.dataset.models === "error") setStatus("idle", "idle");
      return true;
    } catch (err) {
      const option = document.createElement("option");
      option.value = "";
      option.textContent = "no models";
      els.model.replaceChildren(option);
      delete els.model.dataset.loaded;
      setStatus("error", `could not load models: ${err.message}`);
      els.status.dataset.models = "error";
      return false;
    }
  }

  els.form.addEventListener("submit", send);
  els.abort.addEventListener("click", abort);
  els.clear.addEventListener("click", () => {
    if (run && !run.finished) return;
    run = null;
    resetView();
    setStatus("idle", "idle");
  });
  els.prompt.addEventListener("keydown", (e) => {
    if (e.key === "Enter" && (e.ctrlKey || e.metaKey)) {
      e.preventDefault();
      els.form.requestSubmit();
    }
  });
  document.addEventListener("keydown", (e) => {
    if (e.key === "Escape" && run && !run.finished) abort();
  });
  els.transport.addEventListener("change", () => {
    socket.refused = 0;
    if (els.transport.value === "ws") openSocket();
  });

  if (els.transport.value === "ws") openSocket();
  loadModels();
})();
