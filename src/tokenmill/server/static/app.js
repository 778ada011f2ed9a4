// tokenmill request explorer: follows one request through the engine while it runs.
// Talks only to this server: /v1/chat/completions or /v1/completions (streaming, with token ids and logprobs),
// /tokenize (the prompt's tokens), /explorer/info (the cache's geometry, the engine now) and /explorer/events
// (engine steps). When the server has an API key, every one of them needs it: the page asks for it once and keeps
// it for the tab. Each run is named by the page (an X-Request-Id header), so its steps are followed from the start:
// its time in the queue, each prefill chunk and decode step as it runs (the engine announces a step when its
// forward pass starts, "running", and reports it when done, "step"). Chips are drawn by chips.js.
"use strict";

const $ = (id) => document.getElementById(id);
const state = { info: null, run: null, engine: { history: [], tokenTimes: [] } };
const KEY_ITEM = "tokenmill-api-key";
const TPS_WINDOW_MS = 2000;  // the engine's tokens/s counts the steps of the last 2 s

// fetch with the API key (if one was given); a 401 asks for the key and tries again
async function api(url, options = {}) {
  for (;;) {
    const key = sessionStorage.getItem(KEY_ITEM);
    const headers = { ...(options.headers || {}), ...(key ? { Authorization: `Bearer ${key}` } : {}) };
    const r = await fetch(url, { ...options, headers });
    if (r.status !== 401) return r;
    sessionStorage.setItem(KEY_ITEM, await askForKey(key ? "that key was refused; try again" : ""));
  }
}

function askForKey(message) {
  const form = $("key-form");
  $("key-message").textContent = message;
  form.hidden = false;
  $("api-key").focus();
  return new Promise((resolve) => {
    form.onsubmit = (event) => {
      event.preventDefault();
      form.hidden = true;
      resolve($("api-key").value.trim());
    };
  });
}

function fmtMs(ms) { return ms == null || isNaN(ms) ? "–" : ms < 1000 ? `${ms.toFixed(0)} ms` : `${(ms / 1000).toFixed(2)} s`; }
function fmtBytes(b) {
  if (b == null) return "–";
  const units = ["B", "KiB", "MiB", "GiB"]; let i = 0;
  while (b >= 1024 && i < units.length - 1) { b /= 1024; i++; }
  return `${b.toFixed(i ? 1 : 0)} ${units[i]}`;
}
// a new id for this tab's next run: short, printable, and random enough never to meet another tab's
function newRunId() {
  const bytes = crypto.getRandomValues(new Uint8Array(6));  // (crypto.randomUUID needs https off localhost)
  return "tab-" + [...bytes].map((b) => b.toString(16).padStart(2, "0")).join("");
}

async function postJSON(url, body) {
  const r = await api(url, { method: "POST", headers: { "Content-Type": "application/json" }, body: JSON.stringify(body) });
  const data = await r.json();
  if (!r.ok) throw new Error(data.error ? data.error.message : `HTTP ${r.status}`);
  return data;
}

// a server of several models: the page shows the one its URL names (?model=NAME), else the one the server used last,
// and names it in every request; a one-model server's info lists no models (its requests name none, as before)
const pageModel = new URLSearchParams(location.search).get("model");
const modelQuery = () => {
  const name = state.info && state.info.models ? state.info.model : pageModel;
  return name ? `?model=${encodeURIComponent(name)}` : "";
};
const withModel = (body) => (state.info && state.info.models ? { model: state.info.model, ...body } : body);

async function loadInfo() {
  for (;;) {
    try {
      const r = await api("/explorer/info" + modelQuery());
      if (r.ok) { state.info = await r.json(); break; }
    } catch (e) { /* server still starting */ }
    $("model-info").textContent = "waiting for the model to load…";
    await new Promise((res) => setTimeout(res, 1000));
  }
  const i = state.info;
  const ranks = i.tensor_parallel_size > 1 ? ` · tensor parallel over ${i.tensor_parallel_size} ranks` : "";
  const others = i.models && i.models.length > 1 ? ` · one of ${i.models.length} models (?model=NAME): ${i.models.join(", ")}` : "";
  $("model-info").textContent = `${i.model} · ${i.quantization} · ${i.device}${ranks} · ${i.kv_blocks_total} KV blocks of ${i.block_size} tokens${others}`;
  $("kv-formula").textContent = `one block = 2 (K and V) × ${i.num_layers} layers × ${i.block_size} tokens × ` +
    `${i.num_kv_heads} KV heads × ` + (i.kv_scale_bytes
      ? `(${i.head_dim} dims × ${i.kv_element_bytes} byte + a ${i.kv_scale_bytes}-byte scale) (${i.kv_dtype}) = `
      : `${i.head_dim} dims × ${i.kv_element_bytes} bytes (${i.kv_dtype}) = `) +
    `${i.kv_bytes_per_block.toLocaleString()} bytes`;
  if (i.chat_template === false || i.base_model_note) document.querySelector('input[value="raw"]').checked = true;
  if (i.base_model_note) { $("model-note").textContent = i.base_model_note; $("model-note").hidden = false; }
  showDefaults(i.sampling_defaults, i.sampling_defaults_source);
  showEngine(i.engine, i.engine.last_step);  // the engine as it is now, before any step event comes
}

// empty sampling fields are left out of the request, so the server gives them the model's recommended settings,
// as it does for any client: the placeholders and the note say which
function showDefaults(defaults, source) {
  const d = defaults || {};
  $("temperature").placeholder = `${d.temperature != null ? d.temperature : 1}`;
  $("top-p").placeholder = `${d.top_p != null ? d.top_p : 1}`;
  const named = Object.entries(d).map(([k, v]) => `${k.replace(/_/g, " ")} ${v}`).join(", ");
  $("defaults-note").textContent = `Fields left empty take the model's recommended settings, as any client's ` +
    `request does: ${named || "none"} (from ${source}). Temperature 0 is greedy.`;
}

// ---- engine events -------------------------------------------------------------------------------------------

// the JSON of each "data: " event of a server-sent event stream read through fetch (EventSource cannot send the
// API key), until the stream ends or says [DONE]
async function* sseData(response) {
  const reader = response.body.getReader(), decoder = new TextDecoder();
  let buffer = "";
  for (;;) {
    const { value, done } = await reader.read();
    if (done) return;
    buffer += decoder.decode(value, { stream: true });
    let cut;
    while ((cut = buffer.indexOf("\n\n")) >= 0) {
      const line = buffer.slice(0, cut).trim(); buffer = buffer.slice(cut + 2);
      if (line.startsWith("data: ") && line !== "data: [DONE]") yield JSON.parse(line.slice(6));
    }
  }
}

// the engine's step events; reconnects when the stream ends
async function listenToEngine() {
  for (;;) {
    try {
      const r = await api("/explorer/events" + modelQuery());
      for await (const ev of sseData(r)) onEngineEvent(ev);
    } catch (e) { /* the server went away: try again */ }
    await new Promise((res) => setTimeout(res, 1000));
  }
}

function onEngineEvent(ev) {
  const now = performance.now();
  const eng = state.engine;
  if (ev.type === "running") {  // a step's forward pass starts, with the counts as it scheduled them
    showCounts(ev);  // (a long prefill's own request is running now, not once its step is done)
    if (state.run) onStepStartForRun(ev, now);
    return;
  }
  if (ev.type === "step") {
    eng.history.push(ev.batch.length);
    if (eng.history.length > 120) eng.history.shift();
    eng.tokenTimes.push([now, ev.num_tokens]);
    drawBars($("batch-chart"), eng.history, "#2563eb");
    showBatch(ev.batch);
    if (state.run) onStepForRun(ev, now);
  }
  showEngine(ev, ev.type === "step" ? ev : ev.last_step);
}

// the engine panel: its stats (running, waiting, blocks, steps) and its last step's size and time
function showEngine(stats, lastStep) {
  const now = performance.now(), times = state.engine.tokenTimes;
  while (times.length && now - times[0][0] > TPS_WINDOW_MS) times.shift();
  showCounts(stats);
  $("eng-steps").textContent = stats.num_steps;
  $("eng-tps").textContent = (times.reduce((a, [, n]) => a + n, 0) * 1000 / TPS_WINDOW_MS).toFixed(0);
  if (!lastStep) {
    for (const id of ["eng-batch", "eng-step", "eng-collective"]) $(id).textContent = "none yet";
    return;
  }
  $("eng-batch").textContent = lastStep.batch_size;
  $("eng-step").textContent = `${lastStep.duration_ms.toFixed(1)} ms`;
  $("eng-collective").textContent = lastStep.ranks > 1 ? `${lastStep.collective_ms.toFixed(2)} ms` : "– (one rank)";
}

// how many sequences run and wait, and the KV blocks they hold
function showCounts(stats) {
  $("eng-running").textContent = stats.num_running;
  $("eng-waiting").textContent = stats.num_waiting;
  $("kv-total").textContent = `${stats.kv_blocks_in_use} / ${stats.kv_blocks_total}`;
  $("kv-bar").style.width = `${(100 * stats.kv_blocks_in_use / stats.kv_blocks_total).toFixed(1)}%`;
}

// the sequences of the last step, this tab's own highlighted (.mine)
function showBatch(batch) {
  const list = $("eng-requests");
  list.replaceChildren(document.createTextNode(batch.length ? "in this step: " : ""));
  for (const b of batch) {
    const el = document.createElement("span");
    const base = b.request_id.replace(/-\d+$/, "");  // "<call id>-<prompt index>": the call
    const mine = isMine(b);
    el.className = "seq" + (mine ? " mine" : "");
    el.dataset.requestId = b.request_id;
    el.title = `${b.request_id}, sample ${b.sample}: ${b.kind} of ${b.tokens} tokens${mine ? " (this tab's)" : ""}`;
    const name = base.length > 26 ? base.slice(0, 24) + "…" : base;
    el.textContent = `${name}${b.sample ? ` #${b.sample}` : ""} · ${b.kind} ${b.tokens}${mine ? " · this tab" : ""}`;
    list.append(el);
  }
}

function isMine(b) { return state.run != null && b.request_id.startsWith(state.run.callId + "-"); }

// this run's entry in a step's batch (its first sample's: the samples share one prefill), or undefined
function myEntry(ev) { return ev.batch.find((b) => isMine(b) && b.sample === 0); }

// its first step: the time in the queue ends here
function noteScheduled(run, b, ev, at) {
  if (run.firstScheduled != null) return;
  run.firstScheduled = at;
  segment("queued", run.t0, at, "queued");
  $("fig-queue").textContent = fmtMs(at - run.t0);
  $("fig-ranks").textContent = ev.ranks;
  markCached(b.cached_tokens);
}

// a step of this run has started its forward pass: shown (open, growing) until the step is done
function onStepStartForRun(ev, now) {
  const run = state.run, b = myEntry(ev);
  if (!b) return;
  noteScheduled(run, b, ev, now);
  run.running = { step: ev.step, kind: b.kind, start: now, label: b.kind === "prefill" ? chunkLabel(b) : "" };
  if (b.kind === "prefill") showPrefilling(b);
  drawTimeline();
}

function chunkLabel(b) { return `chunk ${b.prefill_chunk}: ${b.start + 1}–${b.start + b.tokens}`; }

function onStepForRun(ev, now) {
  const run = state.run, b = myEntry(ev);
  if (!b) return;
  // its start as announced, else (its start event was lost) as the step's own duration tells
  const open = run.running && run.running.step === ev.step ? run.running : null;
  const stepStart = open ? open.start : now - ev.duration_ms;
  run.running = null;
  noteScheduled(run, b, ev, stepStart);
  if (b.kind === "prefill") {
    run.chunks += 1;
    segment("prefill", stepStart, now, chunkLabel(b));
    $("fig-chunks").textContent = run.chunks;
  } else {
    const spec = b.proposed ? `${b.accepted} of ${b.proposed} proposed tokens accepted` : "";
    segment("decode", stepStart, now, spec, { proposed: b.proposed || 0, accepted: b.accepted || 0 });
    // accepted proposals follow the step's first token: output indices from (start - prompt) + 1
    for (let k = 1; k <= (b.accepted || 0); k++) markAccepted(b.start - b.prompt_tokens + k);
  }
  if (b.allowed_tokens != null) {  // a constrained request: how many tokens its schema allowed at this step
    run.allowed = (run.allowed || []).concat([b.allowed_tokens]);
    $("fig-allowed").textContent = `${b.allowed_tokens} / ${Math.min(...run.allowed)} / ${Math.max(...run.allowed)}`;
  }
  run.lastEvent = now;
  run.blocks = b.blocks;
  run.cachedTokens = b.cached_tokens;
  showKv(b.blocks, b.cached_tokens);
}

// an output token that was a proposal the model confirmed (speculative decoding): marked when its chip exists
function markAccepted(index) {
  state.run.accepted.add(index);
  const el = $("output-tokens").children[index];
  if (el) el.classList.add("spec");
}

// while chunk i runs: "prefilling chunk i/n" (n assumes the next chunks are as large as a step allows; other
// requests in the batch can make them smaller, and n grows)
function showPrefilling(b) {
  if (state.run.tokenTimes.length) return;
  const remaining = Math.max(0, b.prompt_tokens - b.start - b.tokens);
  const total = b.prefill_chunk + Math.ceil(remaining / state.info.max_num_batched_tokens);
  $("status").textContent = `prefilling chunk ${b.prefill_chunk}/${total}: prompt tokens ` +
    `${(b.start + 1).toLocaleString()}–${(b.start + b.tokens).toLocaleString()} of ${b.prompt_tokens.toLocaleString()}…`;
}

// ---- the request's own view ------------------------------------------------------------------------------------

function segment(kind, start, end, label, extra = {}) {
  const run = state.run;
  run.segments.push({ kind, start, end: Math.max(end, start + 1), label, ...extra });
  drawTimeline();
}

// the run's segments, with what is under way drawn up to now: the wait in the queue until its first step, or the
// step running now
function timelineSegments(run, now) {
  const segs = run.segments.slice();
  if (run.firstScheduled == null && !run.tEnd) {
    segs.push({ kind: "queued", start: run.t0, end: now, label: "queued", open: true });
  }
  if (run.running) segs.push({ ...run.running, end: now, open: true });
  return segs;
}

function drawTimeline() {
  const run = state.run, box = $("timeline");
  box.innerHTML = "";
  if (!run) return;
  const now = performance.now();
  const t1 = run.tEnd || now;
  const span = Math.max(t1 - run.t0, 1);
  const segs = timelineSegments(run, now);
  for (const s of segs) {
    const el = document.createElement("div");
    el.className = `seg ${s.kind}${s.open ? " running" : ""}`;
    const width = Math.max(0.4, 100 * (s.end - s.start) / span);
    el.style.left = `${(100 * (s.start - run.t0) / span).toFixed(2)}%`;
    el.style.width = `${width.toFixed(2)}%`;
    // a label only where it fits (a cut one reads as another word); the summary below names every phase
    if (box.clientWidth * width / 100 >= 7 * s.label.length + 8) el.textContent = s.label;
    el.title = `${s.kind}${s.label ? ` (${s.label})` : ""}: ${fmtMs(s.start - run.t0)} → ${fmtMs(s.end - run.t0)}`;
    box.append(el);
  }
  $("timeline-summary").textContent = timelineSummary(segs);
}

// "queued 12 ms · prefill 420 ms in 3 chunks · decode 1.20 s in 63 steps"
function timelineSummary(segs) {
  const parts = [];
  for (const [kind, unit] of [["queued", ""], ["prefill", "chunk"], ["decode", "step"]]) {
    const mine = segs.filter((s) => s.kind === kind);
    if (!mine.length) continue;
    const ms = mine.reduce((a, s) => a + s.end - s.start, 0);
    const count = unit ? ` in ${mine.length} ${unit}${mine.length === 1 ? "" : "s"}` : "";
    const now = mine.some((s) => s.open) ? " (now)" : "";
    parts.push(`${kind} ${fmtMs(ms)}${count}${now}`);
  }
  const proposed = segs.reduce((a, s) => a + (s.proposed || 0), 0);
  if (proposed) parts.push(`${segs.reduce((a, s) => a + (s.accepted || 0), 0)} of ${proposed} proposed tokens accepted`);
  return parts.join(" · ");
}

function markCached(cachedTokens) {
  markCachedChips($("prompt-tokens"), cachedTokens);
  const bs = state.info ? state.info.block_size : 16;
  const blocks = cachedTokens / bs;
  $("kv-reused").textContent = `${blocks} block${blocks === 1 ? "" : "s"} (${cachedTokens} tokens)`;
}

function showKv(blocks, cachedTokens) {
  const info = state.info;
  $("kv-blocks").textContent = blocks;
  $("kv-bytes").textContent = fmtBytes(blocks * info.kv_bytes_per_block);
  const reused = Math.floor(cachedTokens / info.block_size);
  const grid = $("kv-grid");
  while (grid.children.length < blocks) {
    const b = document.createElement("span");
    b.className = "kv-block" + (grid.children.length < reused ? " reused" : "");
    b.title = grid.children.length < reused ? "reused from the prefix cache" : "computed by this request";
    grid.append(b);
  }
}

function drawBars(canvas, values, color) {
  const ctx = canvas.getContext("2d");
  const w = (canvas.width = canvas.clientWidth * devicePixelRatio);
  const h = (canvas.height = canvas.clientHeight * devicePixelRatio);
  ctx.clearRect(0, 0, w, h);
  if (!values.length) return;
  const max = Math.max(...values, 1);
  const bw = w / Math.max(values.length, 30);
  ctx.fillStyle = color;
  values.forEach((v, i) => {
    const bh = (h - 14 * devicePixelRatio) * v / max;
    ctx.fillRect(i * bw, h - bh, Math.max(bw - 1, 1), bh);
  });
  ctx.fillStyle = "#6b7280";
  ctx.font = `${11 * devicePixelRatio}px system-ui`;
  ctx.fillText(`max ${max.toFixed(max < 10 ? 1 : 0)}`, 4, 12 * devicePixelRatio);
}

function updateFigures() {
  const run = state.run;
  const n = run.tokenTimes.length;
  if (!n) return;
  const ttft = run.tokenTimes[0] - run.t0;
  $("fig-ttft").textContent = fmtMs(ttft);
  if (n > 1) {
    const tpot = (run.tokenTimes[n - 1] - run.tokenTimes[0]) / (n - 1);
    $("fig-tpot").textContent = `${tpot.toFixed(1)} ms`;
    $("fig-tps").textContent = (1000 / tpot).toFixed(1);
  }
  const itl = run.tokenTimes.slice(1).map((t, i) => t - run.tokenTimes[i]);
  drawBars($("itl-chart"), itl, "#10b981");
}

async function submit(event) {
  event.preventDefault();
  const mode = document.querySelector('input[name="mode"]:checked').value;
  const text = $("prompt").value;
  const params = { max_tokens: Number($("max-tokens").value) || 64 };
  // empty: not sent, so the server's defaults (the model's recommended settings) apply
  if ($("temperature").value !== "") params.temperature = Number($("temperature").value);
  if ($("top-p").value !== "") params.top_p = Number($("top-p").value);
  if ($("seed").value !== "") params.seed = Number($("seed").value);
  const schema = $("json-schema").value.trim();
  if (schema) {
    try {
      params.response_format = { type: "json_schema", json_schema: { name: "explorer", schema: JSON.parse(schema) } };
    } catch (e) {
      $("status").textContent = `the JSON schema does not parse: ${e.message}`;
      return;
    }
  }
  $("submit").disabled = true;
  $("status").textContent = "tokenizing…";
  for (const id of ["prompt-tokens", "output-tokens", "answer", "thinking", "kv-grid", "timeline", "timeline-summary"]) $(id).innerHTML = "";
  $("thinking-box").hidden = true;
  for (const id of ["fig-request", "fig-prompt", "fig-queue", "fig-ttft", "fig-tpot", "fig-tps", "fig-chunks", "fig-ranks", "fig-e2e", "fig-allowed", "kv-blocks", "kv-bytes", "kv-reused"]) $(id).textContent = "–";
  try {
    const messages = [{ role: "user", content: text }];
    const tok = await postJSON("/tokenize", withModel(mode === "chat"
      ? { messages, return_token_texts: true }
      : { prompt: text, add_special_tokens: true, return_token_texts: true }));
    showPrompt($("prompt-tokens"), tok.tokens, tok.token_texts);
    $("fig-prompt").textContent = tok.count.toLocaleString();
    const id = newRunId();
    // the engine names the call "<chatcmpl|cmpl>-<id>" from the moment it arrives: its steps are this tab's
    state.run = { id, callId: `${mode === "chat" ? "chatcmpl" : "cmpl"}-${id}`, t0: performance.now(), segments: [],
                  chunks: 0, tokenTimes: [], blocks: 0, accepted: new Set() };
    $("fig-request").textContent = id;
    $("status").textContent = `${tok.count.toLocaleString()} prompt tokens; waiting in the queue…`;
    const ticking = setInterval(drawTimeline, 200);  // the phase under way grows while no event comes
    try {
      await stream(mode, mode === "chat" ? { messages, ...params } : { prompt: tok.tokens, ...params });
    } finally {
      clearInterval(ticking);
    }
  } catch (e) {
    $("status").textContent = `error: ${e.message}`;
  } finally {
    $("submit").disabled = false;
  }
}

async function stream(mode, body) {
  const url = mode === "chat" ? "/v1/chat/completions" : "/v1/completions";
  const request = { ...withModel(body), stream: true, stream_options: { include_usage: true }, return_token_ids: true,
                    logprobs: mode === "chat" ? true : 0 };
  const headers = { "Content-Type": "application/json", "X-Request-Id": state.run.id };
  const r = await api(url, { method: "POST", headers, body: JSON.stringify(request) });
  if (!r.ok) { const data = await r.json(); throw new Error(data.error ? data.error.message : `HTTP ${r.status}`); }
  const run = state.run;
  let answer = "";
  // a reasoning model's thinking, apart from the answer: its text, tokens and time (first to last thinking chunk)
  const thought = { text: "", tokens: 0, start: null, end: null };
  for await (const chunk of sseData(r)) {
    if (chunk.error) throw new Error(chunk.error.message);
    if (chunk.usage) {
      onUsage(chunk.usage);
      const details = chunk.usage.completion_tokens_details;
      if (thought.text && details && details.reasoning_tokens != null) { thought.tokens = details.reasoning_tokens; showThinking(thought); }
      continue;
    }
    const c = chunk.choices[0];
    if (!c) continue;
    const ids = c.token_ids || [];
    const texts = mode === "chat"
      ? ((c.logprobs && c.logprobs.content) || []).map((x) => x.token)
      : ((c.logprobs && c.logprobs.tokens) || []);
    const now = performance.now();
    ids.forEach((id, i) => {
      const spec = run.accepted.has(run.tokenTimes.length) ? " spec" : "";
      run.tokenTimes.push(now);
      $("output-tokens").append(chip(texts[i] != null ? texts[i] : "", id, "out new" + spec));
    });
    const thinking = mode === "chat" && c.delta ? c.delta.reasoning_content || "" : "";
    if (thinking) {
      if (thought.start === null) thought.start = now;
      thought.end = now;
      thought.text += thinking;
      thought.tokens += ids.length;
      showThinking(thought);
    }
    answer += mode === "chat" ? (c.delta && c.delta.content) || "" : c.text || "";
    $("answer").textContent = answer;
    if (ids.length) { $("status").textContent = `generating… ${run.tokenTimes.length} tokens`; updateFigures(); drawTimeline(); }
    if (c.finish_reason) $("status").textContent = `done: ${run.tokenTimes.length} tokens, finish reason "${c.finish_reason}"`;
  }
  run.tEnd = performance.now();
  $("fig-e2e").textContent = fmtMs(run.tEnd - run.t0);
  drawTimeline();
}

function showThinking(thought) {
  $("thinking-box").hidden = false;
  $("thinking").textContent = thought.text;
  const seconds = ((thought.end - thought.start) / 1000).toFixed(1);
  $("thinking-summary").textContent = `thinking: ${thought.tokens} tokens, ${seconds} s`;
}

function onUsage(usage) {
  const cached = (usage.prompt_tokens_details && usage.prompt_tokens_details.cached_tokens) || 0;
  markCached(cached);
}

window.addEventListener("DOMContentLoaded", async () => {
  $("prompt-form").addEventListener("submit", submit);
  await loadInfo();
  listenToEngine();
});
