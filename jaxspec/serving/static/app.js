// The playground page: sends the form to POST /playground/generate and renders its NDJSON stream as it
// arrives (the stream's format is described in jaxspec/serving/playground.py). A server started with an API
// key wants it on every request (`Authorization: Bearer`): the page sends what the key field holds.
"use strict";

const $ = (id) => document.getElementById(id);
let controller = null; // aborts the request in flight (the Stop button)

function headers(extra = {}) {
  const key = $("api-key").value.trim();
  return key ? { ...extra, Authorization: `Bearer ${key}` } : extra;
}

async function loadConfig() {
  const response = await fetch("/playground/config", { headers: headers() });
  if (response.status === 401) {
    setState("error", "this server wants its API key: enter it above");
    return;
  }
  if (!response.ok) throw new Error(`HTTP ${response.status}`);
  const config = await response.json();
  setState("idle", "");
  $("model").textContent = config.model;
  $("method").replaceChildren();
  for (const method of config.methods) {
    $("method").add(new Option(method, method, false, method === config.default_method));
  }
  $("k").max = config.num_speculative_tokens;
  $("k").placeholder = `server's (${config.num_speculative_tokens})`;
  $("max_tokens").max = config.max_context - 1;
}

const chatMode = () => document.querySelector("input[name=mode]:checked").value === "chat";

function showMode() {
  $("system-field").hidden = !chatMode();
  $("prompt-label").textContent = chatMode() ? "Message" : "Prompt";
}

function requestBody() {
  // An empty field is left out, so the server's default applies.
  const number = (id) => ($(id).value === "" ? undefined : Number($(id).value));
  const body = {
    max_tokens: number("max_tokens"), temperature: number("temperature"), top_p: number("top_p"),
    top_k: number("top_k"), seed: number("seed"),
    speculative: { method: $("method").value, num_speculative_tokens: number("k") },
  };
  if (chatMode()) {
    body.messages = $("system").value ? [{ role: "system", content: $("system").value }] : [];
    body.messages.push({ role: "user", content: $("prompt").value });
  } else {
    body.prompt = $("prompt").value;
  }
  return body;
}

// One JSON object per line; a line split across network chunks waits for its end.
async function* ndjson(response) {
  const reader = response.body.pipeThrough(new TextDecoderStream()).getReader();
  let buffer = "";
  for (;;) {
    const { value, done } = await reader.read();
    if (done) return;
    buffer += value;
    const lines = buffer.split("\n");
    buffer = lines.pop();
    for (const line of lines) if (line) yield JSON.parse(line);
  }
}

// The counts behind the stats panel. Each verification step commits a run of accepted drafts and then one
// target token, so the flags alone give the accepted drafts of every step.
function newRun() {
  return { start: performance.now(), first: null, tokens: 0, steps: 0, pending: 0, acceptedAt: [] };
}

function closeStep(run) {
  for (let j = 0; j < run.pending; j++) run.acceptedAt[j] = (run.acceptedAt[j] || 0) + 1;
  run.steps += 1;
  run.pending = 0;
}

function count(run, draft) {
  run.tokens += 1;
  // The first token comes from the prefill, not from a verification step; null: the engine did not say.
  if (run.tokens === 1 || draft === null) return;
  if (draft) run.pending += 1;
  else closeStep(run);
}

function render(event, run) {
  run.first ??= performance.now();
  event.ids.forEach((id, i) => {
    const draft = event.draft ? event.draft[i] : null;
    count(run, draft);
    if (!event.pieces[i]) return; // part of a character (its text comes with a later token), or EOS
    const span = document.createElement("span");
    span.className = `tok ${draft === null ? "unmarked" : draft ? "draft" : "target"}`;
    span.title = `token ${id}${draft ? " (accepted draft)" : ""}`;
    span.textContent = event.pieces[i];
    $("output").append(span);
  });
}

function showStats(run) {
  $("tokens").textContent = run.tokens;
  if (run.first !== null) {
    $("ttft").textContent = `${((run.first - run.start) / 1000).toFixed(2)} s`;
    // The first token arrives with the prefill: the rate is that of the tokens decoded after it.
    const seconds = (performance.now() - run.first) / 1000;
    if (run.tokens > 1 && seconds > 0) $("tps").textContent = ((run.tokens - 1) / seconds).toFixed(1);
  }
  const accepted = run.acceptedAt.reduce((a, b) => a + b, 0);
  $("steps").textContent = run.steps;
  $("accepted").textContent = accepted;
  if (run.steps) $("per-step").textContent = ((accepted + run.steps) / run.steps).toFixed(2);
  const bars = run.acceptedAt.map((n, j) => {
    const share = (100 * n) / run.steps;
    const bar = document.createElement("div");
    bar.className = "bar";
    bar.title = `${n} of ${run.steps} steps`;
    bar.innerHTML = `<span class="pos">${j + 1}</span><span class="track"><span class="fill"></span></span>` +
      `<span class="pct">${share.toFixed(0)}%</span>`;
    bar.querySelector(".fill").style.width = `${share}%`;
    return bar;
  });
  $("acceptance").replaceChildren(...bars);
}

// Only the engine knows how many drafts it scored: the final stats add that count and the acceptance rate.
function finish(event, run) {
  if (event.tail) $("output").append(event.tail);
  if (run.pending) closeStep(run); // the last step, cut short by a stop token or the token budget
  showStats(run);
  const stats = event.stats;
  if (stats && stats.drafted) {
    const rate = ((100 * stats.accepted) / stats.drafted).toFixed(0);
    $("accepted").textContent = `${stats.accepted} of ${stats.drafted} drafted (${rate}%)`;
  }
  if (event.finish_reason === "error") setState("error", `error: ${event.error}`);
  else setState("done", `done (${event.finish_reason})`);
}

function setState(state, text) {
  $("status").dataset.state = state;
  $("status").textContent = text;
  const running = state === "running";
  $("run").disabled = running;
  $("stop").disabled = !running;
}

async function run(submit) {
  submit.preventDefault();
  controller = new AbortController();
  const current = newRun();
  $("output").replaceChildren();
  for (const id of ["tokens", "tps", "ttft", "steps", "per-step", "accepted"]) $(id).textContent = "–";
  $("acceptance").replaceChildren();
  setState("running", "generating…");
  try {
    const response = await fetch("/playground/generate", {
      method: "POST", headers: headers({ "Content-Type": "application/json" }),
      body: JSON.stringify(requestBody()), signal: controller.signal,
    });
    if (!response.ok) {
      const error = await response.json().catch(() => null);
      throw new Error(error?.error?.message ?? `HTTP ${response.status}`);
    }
    for await (const event of ndjson(response)) {
      if (event.done) {
        finish(event, current);
        return;
      }
      render(event, current);
      showStats(current);
    }
    throw new Error("the stream ended early");
  } catch (e) {
    if (e.name === "AbortError") setState("stopped", "stopped");
    else setState("error", e.message);
  }
}

document.addEventListener("DOMContentLoaded", () => {
  $("form").addEventListener("submit", run);
  $("stop").addEventListener("click", () => controller.abort());
  for (const radio of document.querySelectorAll("input[name=mode]")) radio.addEventListener("change", showMode);
  const load = () => loadConfig().catch((e) => setState("error", `could not load the server's settings: ${e.message}`));
  $("api-key").addEventListener("change", load);
  load();
});
