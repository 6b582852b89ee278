// The viewer: ask about a video (streamed answer), then play it with its homunculus drawn over it
// from the stored token maps (/v1/homunculus/<id>), a timeline of scene changes and answer windows,
// and a live view following streams' answers (/v1/streams). Plain JS, no build step.
"use strict";

const $ = (id) => document.getElementById(id);
const KEY_STORAGE = "arrcoc.apikey";
const state = { model: null, homunculus: null, lastDrawn: null, objectUrl: null };

// ---- HTTP -------------------------------------------------------------------------------------
function authHeaders(extra = {}) {
  const key = $("apikey").value.trim();
  return key ? { ...extra, Authorization: `Bearer ${key}` } : extra;
}

async function api(path, options = {}) {
  const response = await fetch(path, { ...options, headers: authHeaders(options.headers || {}) });
  if (!response.ok) {
    let message = response.statusText;
    try { message = (await response.json()).error.message; } catch (_) { /* not JSON */ }
    throw new Error(`${response.status}: ${message}`);
  }
  return response;
}

// Server-sent events over fetch: EventSource cannot send the API key header.
async function* sseEvents(response) {
  const reader = response.body.getReader();
  const decoder = new TextDecoder();
  let buffer = "";
  for (;;) {
    const { value, done } = await reader.read();
    if (done) return;
    buffer += decoder.decode(value, { stream: true });
    let end;
    while ((end = buffer.indexOf("\n\n")) >= 0) {
      const block = buffer.slice(0, end);
      buffer = buffer.slice(end + 2);
      const event = { event: "message", data: "", id: null };
      for (const line of block.split("\n")) {
        if (line.startsWith("data:")) event.data += line.slice(5).trimStart();
        else if (line.startsWith("event:")) event.event = line.slice(6).trim();
        else if (line.startsWith("id:")) event.id = line.slice(3).trim();
      }
      if (event.data) yield event;
    }
  }
}

function setStatus(id, text, error = false) {
  $(id).textContent = text;
  $(id).classList.toggle("error", error);
}

// ---- server info ------------------------------------------------------------------------------
async function loadServer() {
  try {
    const models = await (await api("/v1/models")).json();
    state.model = models.data[0].id;
    $("model").textContent = `model: ${state.model}`;
    const videos = (await (await api("/v1/videos")).json()).data;
    const select = $("server-videos");
    select.replaceChildren(new Option("(none)", ""));
    const sources = $("live-sources");
    sources.replaceChildren();
    for (const v of videos) {
      select.add(new Option(v.name, v.url));
      sources.append(new Option(v.name, v.url));
    }
    setStatus("status", "");
    await loadStreams();
  } catch (e) {
    $("model").textContent = "model: ?";
    setStatus("status", e.message.startsWith("401") ? "this server needs an API key (top right)" : e.message, true);
  }
}

// ---- asking about a video ---------------------------------------------------------------------
function showVideo(url) {
  if (state.objectUrl) URL.revokeObjectURL(state.objectUrl);
  state.objectUrl = url;
  $("video").src = url;
}

function resetAnswer() {
  state.homunculus = null;
  state.lastDrawn = null;
  $("answer").textContent = "";
  $("answers").replaceChildren();
  $("usage").textContent = "";
  $("cuts").replaceChildren();
  $("windows").replaceChildren();
  $("frame-info").textContent = "no homunculus yet";
  document.body.dataset.state = "asking";
}

async function ask(event) {
  event.preventDefault();
  const file = $("file").files[0];
  const chosen = $("server-videos").value;
  const question = $("question").value.trim();
  if (!file && !chosen) return setStatus("status", "choose a video file, or one from the server", true);
  if (!question) return setStatus("status", "ask a question", true);
  resetAnswer();
  $("ask").disabled = true;
  try {
    let url;
    if (file) {
      setStatus("status", `uploading ${file.name}…`);
      const form = new FormData();
      form.append("file", file);
      form.append("purpose", "user_data");
      url = (await (await api("/v1/files", { method: "POST", body: form })).json()).id;
      showVideo(URL.createObjectURL(file));
    } else {
      url = chosen;
      const blob = await (await api(`/v1/videos/content?url=${encodeURIComponent(chosen)}`)).blob();
      showVideo(URL.createObjectURL(blob));
    }
    setStatus("status", "watching and answering…");
    const body = {
      model: state.model, stream: true, stream_options: { include_usage: true },
      messages: [{ role: "user", content: [{ type: "video_url", video_url: { url } }, { type: "text", text: question }] }],
    };
    const every = parseFloat($("every").value);
    if (every > 0) body.every = every;
    const response = await api("/v1/chat/completions", {
      method: "POST", headers: { "Content-Type": "application/json" }, body: JSON.stringify(body),
    });
    let text = "", extension = null, usage = null;
    for await (const event of sseEvents(response)) {
      if (event.data === "[DONE]") break;
      const message = JSON.parse(event.data);
      if (message.error) throw new Error(message.error.message);
      const choice = message.choices[0];
      if (choice && choice.delta.content) {
        text += choice.delta.content;
        $("answer").textContent = text;
      }
      if (message.arrcoc) extension = message.arrcoc;
      if (message.usage) usage = message.usage;
    }
    if (!extension) throw new Error("the answer stream ended early");
    showAnswers(extension.answers, usage, extension.notes);
    setStatus("status", "loading the homunculus…");
    setHomunculus(await (await api(extension.homunculus)).json());
    setStatus("status", `answered · ${extension.frames} frames · homunculus ${extension.stream_id}`);
    document.body.dataset.state = "answered";
  } catch (e) {
    setStatus("status", e.message, true);
    document.body.dataset.state = "failed";
  } finally {
    $("ask").disabled = false;
  }
}

// an answer as a person reads it: its text, or "no answer (why)" (pipeline/runtime/answer_words.py)
const answerText = (a) => (a.no_answer ? `no answer (${a.no_answer})` : a.text);

function showAnswers(answers, usage, notes) {
  const list = $("answers");
  list.replaceChildren();
  for (const a of answers) {
    const li = document.createElement("li");
    li.innerHTML = `<span class="when"></span><span class="text"></span><span class="tok"></span>`;
    li.querySelector(".when").textContent = `${a.t_start.toFixed(1)}–${a.t_end.toFixed(1)} s`;
    li.querySelector(".text").textContent = answerText(a);
    li.querySelector(".tok").textContent = `${a.tokens_kept} / ${a.tokens_full} tokens`;
    li.addEventListener("click", () => seek(a.t_start));
    list.append(li);
  }
  if (usage) {
    const share = usage.tokens_full ? (100 * usage.tokens_kept / usage.tokens_full).toFixed(0) : "–";
    $("usage").textContent = `visual tokens ${usage.tokens_kept} of ${usage.tokens_full} (${share}%) · ` +
      `prompt ${usage.prompt_tokens} · completion ${usage.completion_tokens}` +
      (notes && notes.length ? ` · ${notes.join("; ")}` : "");
  }
}

// ---- the homunculus over the video ------------------------------------------------------------
function setHomunculus(h) {
  state.homunculus = h;
  state.lastDrawn = null;
  $("stage").style.aspectRatio = `${h.width} / ${h.height}`;
  drawTimeline();
  draw();
}

function duration() {
  const h = state.homunculus;
  const video = $("video");
  const last = h && h.pts.length ? h.pts[h.pts.length - 1] + 1 / h.fps : 0;
  return Number.isFinite(video.duration) && video.duration > 0 ? Math.max(video.duration, last) : last;
}

function frameAt(t) {             // the last frame shown at or before t (binary search over pts)
  const pts = state.homunculus.pts;
  let lo = 0, hi = pts.length - 1;
  while (lo < hi) {
    const mid = (lo + hi + 1) >> 1;
    if (pts[mid] <= t + 1e-3) lo = mid; else hi = mid - 1;
  }
  return lo;
}

function draw() {
  const h = state.homunculus;
  const canvas = $("overlay");
  const video = $("video");
  const rect = canvas.getBoundingClientRect();
  const ratio = window.devicePixelRatio || 1;
  const width = Math.round(rect.width * ratio), height = Math.round(rect.height * ratio);
  const index = h && h.frames ? frameAt(video.currentTime || 0) : -1;
  const key = `${index}:${width}x${height}`;
  if (key === state.lastDrawn) return;
  state.lastDrawn = key;
  canvas.width = width;
  canvas.height = height;
  const ctx = canvas.getContext("2d");
  ctx.clearRect(0, 0, width, height);
  if (index < 0) return;
  const [gh, gw] = h.grid;
  const row = h.tokens[index];
  const cw = width / gw, ch = height / gh;
  ctx.lineWidth = Math.max(1, ratio);
  for (let r = 0; r < gh; r++) {
    for (let c = 0; c < gw; c++) {
      const tokens = row[r * gw + c];
      const x = c * cw, y = r * ch;
      if (tokens === 0) {
        ctx.fillStyle = "rgba(0, 0, 0, 0.5)";
        ctx.fillRect(x, y, cw, ch);
      } else {
        ctx.fillStyle = tokens > 1 ? "rgba(255, 90, 54, 0.35)" : "rgba(255, 176, 32, 0.22)";
        ctx.fillRect(x, y, cw, ch);
        ctx.strokeStyle = tokens > 1 ? "#ff5a36" : "#ffb020";
        ctx.strokeRect(x + ratio, y + ratio, cw - 2 * ratio, ch - 2 * ratio);
      }
    }
  }
  const kept = h.tokens_kept[index];
  const cut = h.scene_changes.some((t) => Math.abs(t - h.pts[index]) < 1e-3);
  $("frame-info").textContent = `frame ${h.frame_index[index]} · ${h.pts[index].toFixed(2)} s · tokens kept ` +
    `${kept} / ${h.tokens_full} (${(100 * kept / h.tokens_full).toFixed(0)}%)` + (cut ? " · scene change" : "");
  const total = duration();
  $("playhead").style.left = total ? `${(100 * (video.currentTime || 0) / total).toFixed(3)}%` : "0";
}

function drawTimeline() {
  const h = state.homunculus;
  const total = duration();
  const cuts = $("cuts"), windows = $("windows");
  cuts.replaceChildren();
  windows.replaceChildren();
  if (!total) return;
  const first = h.pts.length ? h.pts[0] : 0;
  for (const t of h.scene_changes) {
    if (t <= first + 1e-6) continue;      // the opening frame starts the first fixation: no cut
    const mark = document.createElement("div");
    mark.className = "cut";
    mark.dataset.t = t;
    mark.dataset.label = `${t.toFixed(1)} s`;
    mark.title = `scene change at ${t.toFixed(2)} s`;
    mark.style.left = `${(100 * t / total).toFixed(3)}%`;
    cuts.append(mark);
  }
  for (const a of h.answers) {
    const span = document.createElement("div");
    span.className = "window";
    span.title = `${a.t_start.toFixed(1)}–${a.t_end.toFixed(1)} s: ${answerText(a)}`;
    span.style.left = `${(100 * a.t_start / total).toFixed(3)}%`;
    span.style.width = `${(100 * Math.max(0, a.t_end - a.t_start) / total).toFixed(3)}%`;
    windows.append(span);
  }
}

function seek(t) {
  const video = $("video");
  if (video.readyState > 0) video.currentTime = t;
}

function loop() {
  if (state.homunculus) draw();
  requestAnimationFrame(loop);
}

// ---- live streams -----------------------------------------------------------------------------
async function startLive(event) {
  event.preventDefault();
  const body = {
    source: $("live-source").value.trim(), question: $("live-question").value.trim(),
    every: parseFloat($("live-every").value) || 2, on_scene_change: $("live-scene").checked,
  };
  $("live-start").disabled = true;
  setStatus("live-status", "opening the source…");
  try {
    const stream = await (await api("/v1/streams", {
      method: "POST", headers: { "Content-Type": "application/json" }, body: JSON.stringify(body),
    })).json();
    setStatus("live-status", "");
    follow(stream);
  } catch (e) {
    setStatus("live-status", e.message, true);
  } finally {
    $("live-start").disabled = false;
  }
}

async function loadStreams() {
  const streams = (await (await api("/v1/streams")).json()).data;
  for (const stream of streams) {       // the streams running now (ended ones stay in GET /v1/streams)
    const running = stream.status === "starting" || stream.status === "running";
    if (running && !document.getElementById(`card-${stream.id}`)) follow(stream);
  }
}

function streamCard(stream) {
  const card = document.createElement("div");
  card.className = "stream";
  card.id = `card-${stream.id}`;
  card.innerHTML = `<header><strong class="source"></strong><span class="question"></span>
    <span class="state"></span><button class="stop">Stop</button></header><ol class="events"></ol>`;
  card.querySelector(".source").textContent = stream.source;
  card.querySelector(".question").textContent = `“${stream.question}”`;
  card.querySelector(".stop").addEventListener("click", async () => {
    try { await api(`/v1/streams/${stream.id}`, { method: "DELETE" }); } catch (e) { setStatus("live-status", e.message, true); }
  });
  $("live-streams").prepend(card);
  return card;
}

async function follow(stream) {
  const card = streamCard(stream);
  const list = card.querySelector(".events");
  const setState = (text) => { card.querySelector(".state").textContent = text; };
  const add = (cls, when, text) => {
    const li = document.createElement("li");
    li.className = cls;
    li.innerHTML = `<span class="when"></span><span class="text"></span>`;
    li.querySelector(".when").textContent = when;
    li.querySelector(".text").textContent = text;
    list.prepend(li);
  };
  setState(stream.status);
  try {
    const response = await api(`/v1/streams/${stream.id}/events`);
    for await (const event of sseEvents(response)) {
      const data = JSON.parse(event.data);
      if (event.event === "answer") {
        add("answer", `${data.t_start.toFixed(1)}–${data.t_end.toFixed(1)} s`,
            `${answerText(data)}  (${data.tokens_kept} / ${data.tokens_full} tokens, ${data.latency_s.toFixed(2)} s)`);
        setState("running");
      } else if (event.event === "gap") {
        add("gap", `${data.start_pts.toFixed(1)}–${data.end_pts.toFixed(1)} s`,
            `drop-out of ${data.seconds.toFixed(1)} s (${data.reason})`);
      } else if (event.event === "end") {
        add("end", "end", data.error ? `${data.reason}: ${data.error}` : data.reason);
        setState(data.reason);
        card.querySelector(".stop").disabled = true;
      }
    }
  } catch (e) {
    setState(e.message);
  }
}

// ---- wiring -----------------------------------------------------------------------------------
function showPanel(button) {
  for (const tab of document.querySelectorAll(".tab")) tab.classList.toggle("active", tab === button);
  for (const panel of document.querySelectorAll(".panel")) panel.classList.toggle("active", panel.id === button.dataset.panel);
}

window.addEventListener("DOMContentLoaded", () => {
  $("apikey").value = localStorage.getItem(KEY_STORAGE) || "";
  $("apikey").addEventListener("change", () => { localStorage.setItem(KEY_STORAGE, $("apikey").value.trim()); loadServer(); });
  for (const tab of document.querySelectorAll(".tab")) tab.addEventListener("click", () => showPanel(tab));
  $("ask-form").addEventListener("submit", ask);
  $("live-form").addEventListener("submit", startLive);
  $("file").addEventListener("change", () => { if ($("file").files[0]) $("server-videos").value = ""; });
  $("timeline").addEventListener("click", (e) => {
    const rect = $("timeline").getBoundingClientRect();
    seek(duration() * (e.clientX - rect.left) / rect.width);
  });
  $("video").addEventListener("loadedmetadata", () => { if (state.homunculus) drawTimeline(); });
  loadServer();
  requestAnimationFrame(loop);
});
