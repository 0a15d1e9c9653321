// Tine's chat page: conversations kept in this browser (localStorage), replies streamed from
// the server's /v1/chat/completions, rendered as Markdown (marked, then DOMPurify), with the
// tokens that came from accepted speculative drafts marked.
"use strict";

const STORE = "tine.conversations";
const SETTINGS = "tine.settings";
const KEY = "tine.apiKey"; // sessionStorage: gone when the tab closes
// Markers around accepted-draft text in the Markdown source (Unicode private use), turned into
// <span class="draft"> after rendering.
const DRAFT_ON = "\uE000";
const DRAFT_OFF = "\uE001";

const $ = (id) => document.getElementById(id);
let conversations = load(STORE, []);
let current = conversations.length ? conversations[0].id : null;
let running = null; // {controller, conv, msg} while a reply streams

function load(key, fallback) {
  try {
    const v = JSON.parse(localStorage.getItem(key));
    return v ?? fallback;
  } catch {
    return fallback;
  }
}

function save() {
  try {
    localStorage.setItem(STORE, JSON.stringify(conversations));
  } catch (e) {
    showBanner(`Could not keep the conversation in this browser's storage: ${e.message}`);
  }
}

function settings() {
  return {
    temperature: parseFloat($("temperature").value),
    maxTokens: parseInt($("max-tokens").value, 10),
    speculation: $("speculation").value,
    nMax: $("n-max").value === "" ? null : parseInt($("n-max").value, 10),
    markDrafts: $("mark-drafts").checked,
  };
}

function restoreSettings() {
  const s = load(SETTINGS, {});
  if (Number.isFinite(s.temperature)) $("temperature").value = s.temperature;
  if (Number.isFinite(s.maxTokens)) $("max-tokens").value = s.maxTokens;
  if (s.speculation) $("speculation").value = s.speculation;
  if (Number.isFinite(s.nMax)) $("n-max").value = s.nMax;
  if (typeof s.markDrafts === "boolean") $("mark-drafts").checked = s.markDrafts;
  applyDraftMarks();
}

function applyDraftMarks() {
  $("messages").classList.toggle("hide-drafts", !$("mark-drafts").checked);
}

function conv() {
  return conversations.find((c) => c.id === current) || null;
}

function newConversation() {
  const c = { id: `c${Date.now()}${Math.floor(Math.random() * 1e6)}`, title: "New chat", messages: [] };
  conversations.unshift(c);
  current = c.id;
  save();
  return c;
}

// ---- rendering -------------------------------------------------------------------------------

function renderList() {
  const ul = $("conversations");
  ul.replaceChildren();
  for (const c of conversations) {
    const li = document.createElement("li");
    if (c.id === current) li.className = "current";
    const open = document.createElement("button");
    open.className = "open";
    open.type = "button";
    open.textContent = c.title;
    open.title = c.title;
    open.onclick = () => {
      current = c.id;
      renderAll();
    };
    const del = document.createElement("button");
    del.className = "delete";
    del.type = "button";
    del.textContent = "✕";
    del.title = "Delete this conversation";
    del.setAttribute("aria-label", `Delete ${c.title}`);
    del.onclick = () => {
      if (running && running.conv === c) running.controller.abort();
      conversations = conversations.filter((x) => x !== c);
      if (current === c.id) current = conversations.length ? conversations[0].id : null;
      save();
      renderAll();
    };
    li.append(open, del);
    ul.append(li);
  }
}

// The Markdown source of an assistant reply, accepted-draft pieces between markers. A marker
// that would open a line moves past the line's Markdown syntax (a fence, a heading, a list
// bullet), so the structure still parses.
function markedSource(msg) {
  if (!msg.pieces) return msg.content || "";
  let out = "";
  for (const p of msg.pieces) {
    if (!p.draft) {
      out += p.text;
      continue;
    }
    const atLineStart = out === "" || out.endsWith("\n");
    const m = atLineStart ? /^[ \t]*(?:`{3,}|~{3,}|#{1,6} |[-*+] |\d+[.)] |> |\|)?/.exec(p.text) : null;
    const lead = m ? m[0] : "";
    const rest = p.text.slice(lead.length);
    // Markers go around the text of each line, never across a newline.
    out += lead + rest.split("\n").map((line) => (line ? DRAFT_ON + line + DRAFT_OFF : line)).join("\n");
  }
  return out;
}

function renderMarkdown(el, source) {
  const html = DOMPurify.sanitize(marked.parse(source, { gfm: true, breaks: false }));
  el.innerHTML = html;
  // Markers inside attributes (a link's target, a code block's language) are dropped.
  for (const node of el.querySelectorAll("*")) {
    for (const a of [...node.attributes]) {
      if (a.value.includes(DRAFT_ON) || a.value.includes(DRAFT_OFF)) node.setAttribute(a.name, a.value.replaceAll(DRAFT_ON, "").replaceAll(DRAFT_OFF, ""));
    }
  }
  // Text between markers, in document order, goes into <span class="draft">.
  const walker = document.createTreeWalker(el, NodeFilter.SHOW_TEXT);
  const texts = [];
  while (walker.nextNode()) texts.push(walker.currentNode);
  let inDraft = false;
  for (const t of texts) {
    const s = t.nodeValue;
    if (!inDraft && !s.includes(DRAFT_ON) && !s.includes(DRAFT_OFF)) continue;
    const frag = document.createDocumentFragment();
    let buf = "";
    const flush = () => {
      if (!buf) return;
      if (inDraft) {
        const span = document.createElement("span");
        span.className = "draft";
        span.textContent = buf;
        frag.append(span);
      } else {
        frag.append(document.createTextNode(buf));
      }
      buf = "";
    };
    for (const ch of s) {
      if (ch === DRAFT_ON || ch === DRAFT_OFF) {
        flush();
        inDraft = ch === DRAFT_ON;
      } else {
        buf += ch;
      }
    }
    flush();
    t.replaceWith(frag);
  }
}

function statsText(t) {
  if (!t) return "";
  const parts = [`${t.predicted_n} tokens`];
  if (t.predicted_per_second > 0) parts.push(`${t.predicted_per_second.toFixed(1)} tokens/s`);
  if (t.prompt_n > 0) parts.push(`prompt ${t.prompt_n} tokens at ${t.prompt_per_second.toFixed(0)}/s`);
  if (t.draft_n > 0) {
    const pct = ((100 * t.draft_n_accepted) / t.draft_n).toFixed(0);
    parts.push(`drafted ${t.draft_n}, accepted ${t.draft_n_accepted} (${pct}%)`);
  }
  return parts.join(" · ");
}

function renderMessage(msg) {
  const div = document.createElement("div");
  div.className = `msg ${msg.role}`;
  const who = document.createElement("div");
  who.className = "who";
  who.textContent = msg.role === "user" ? "You" : "Assistant";
  div.append(who);
  if (msg.reasoning) {
    const d = document.createElement("details");
    d.className = "reasoning";
    const s = document.createElement("summary");
    s.textContent = "Reasoning";
    const body = document.createElement("div");
    body.textContent = msg.reasoning;
    d.append(s, body);
    div.append(d);
  }
  const body = document.createElement("div");
  body.className = "body";
  if (msg.role === "user") body.textContent = msg.content;
  else renderMarkdown(body, markedSource(msg));
  div.append(body);
  for (const call of msg.tool_calls || []) {
    const box = document.createElement("div");
    box.className = "tool-call";
    const name = document.createElement("b");
    name.textContent = `Tool call: ${call.function?.name ?? "?"}`;
    const args = document.createElement("pre");
    args.textContent = call.function?.arguments ?? "";
    box.append(name, args);
    div.append(box);
  }
  if (msg.error) {
    const e = document.createElement("div");
    e.className = "error";
    e.textContent = msg.error;
    div.append(e);
  }
  if (msg.timings || msg.stopped) {
    const s = document.createElement("div");
    s.className = "stats";
    s.textContent = [statsText(msg.timings), msg.stopped ? "stopped" : ""].filter(Boolean).join(" · ");
    div.append(s);
  }
  return div;
}

function renderMessages() {
  const box = $("messages");
  const stick = box.scrollHeight - box.scrollTop - box.clientHeight < 40;
  box.replaceChildren();
  const c = conv();
  if (c) for (const m of c.messages) box.append(renderMessage(m));
  if (stick) box.scrollTop = box.scrollHeight;
}

function renderAll() {
  renderList();
  renderMessages();
  $("send").textContent = running ? "Stop" : "Send";
}

function showBanner(text) {
  $("model").textContent = text;
}

// ---- the server --------------------------------------------------------------------------------

function headers() {
  const h = { "Content-Type": "application/json" };
  const key = sessionStorage.getItem(KEY);
  if (key) h.Authorization = `Bearer ${key}`;
  return h;
}

// Asks for the key; resolves true when one was given.
function askKey(message) {
  return new Promise((resolve) => {
    const dlg = $("key-dialog");
    $("key-error").hidden = !message;
    $("key-error").textContent = message || "";
    $("key-input").value = "";
    dlg.onclose = () => {
      const key = $("key-input").value.trim();
      if (dlg.returnValue === "ok" && key) {
        sessionStorage.setItem(KEY, key);
        resolve(true);
      } else {
        resolve(false);
      }
    };
    dlg.showModal();
  });
}

// The error a non-2xx answer carries, in words.
async function errorText(res) {
  let text = "";
  try {
    text = await res.text();
    const v = JSON.parse(text);
    if (v?.error?.message) return `${v.error.message} (HTTP ${res.status})`;
  } catch {
    // not JSON: the text itself
  }
  return `${text.trim() || res.statusText || "error"} (HTTP ${res.status})`;
}

async function fetchWithKey(path, init) {
  for (;;) {
    const res = await fetch(path, { ...init, headers: headers() });
    if (res.status !== 401) return res;
    const why = await errorText(res);
    const had = sessionStorage.getItem(KEY);
    sessionStorage.removeItem(KEY);
    if (!(await askKey(had ? `The key was not accepted: ${why}` : null))) throw new Error(why);
  }
}

async function loadModel() {
  try {
    const res = await fetchWithKey("v1/models", { method: "GET" });
    if (!res.ok) throw new Error(await errorText(res));
    const v = await res.json();
    showBanner(`Model: ${v.data?.[0]?.id ?? "?"}`);
  } catch (e) {
    showBanner(`Server: ${e.message}`);
  }
}

// The drafters this server offers a request (`/props`' speculative.types), after "as the server
// runs" (its --spec-type, named); the choice kept in this browser is restored once they are known.
let draftersLoaded = false;
async function loadDrafters() {
  if (draftersLoaded) return;
  try {
    const res = await fetchWithKey("props", { method: "GET" });
    if (!res.ok) return;
    const spec = (await res.json()).speculative;
    if (!spec || !Array.isArray(spec.types)) return;
    const select = $("speculation");
    select.replaceChildren();
    const add = (value, text) => {
      const o = document.createElement("option");
      o.value = value;
      o.textContent = text;
      select.append(o);
    };
    add("server", `as the server runs (${spec.type === "none" ? "off" : spec.type})`);
    for (const t of spec.types) add(t, t === "none" ? "off" : t);
    const kept = load(SETTINGS, {}).speculation;
    if (kept && [...select.options].some((o) => o.value === kept)) select.value = kept;
    draftersLoaded = true;
  } catch (e) {
    // The page works without the list: the server's own drafter.
  }
}

// ---- a reply -------------------------------------------------------------------------------------

async function send(text) {
  let c = conv() || newConversation();
  if (c.messages.length === 0) c.title = text.slice(0, 60);
  c.messages.push({ role: "user", content: text });
  const msg = { role: "assistant", content: "", pieces: [], reasoning: "", tool_calls: [], timings: null };
  c.messages.push(msg);
  save();
  const s = settings();
  localStorage.setItem(SETTINGS, JSON.stringify(s));
  const body = {
    messages: c.messages.slice(0, -1).map((m) => ({ role: m.role, content: m.content || "" })),
    stream: true,
    timings_per_token: true,
    temperature: s.temperature,
    max_tokens: s.maxTokens,
  };
  // "off" is what a page kept from before the server named its drafters.
  if (s.speculation === "off" || s.speculation === "none") body["speculative.type"] = "none";
  else if (s.speculation && s.speculation !== "server") body["speculative.type"] = s.speculation;
  if (s.nMax && body["speculative.type"] !== "none") body["speculative.n_max"] = s.nMax;
  const controller = new AbortController();
  running = { controller, conv: c, msg };
  renderAll();
  let accepted = 0; // the server's count of accepted drafts so far
  let toMark = 0; // tokens still to come that were accepted drafts
  const onChunk = (v) => {
    if (v.error) {
      msg.error = `${v.error.message ?? "error"}${v.error.code ? ` (HTTP ${v.error.code})` : ""}`;
      return;
    }
    const t = v.timings;
    if (t) {
      // A verify round's accepted drafts come out first, one token per chunk: the count rises
      // by k on the first of them.
      if (t.draft_n_accepted > accepted) toMark += t.draft_n_accepted - accepted;
      accepted = t.draft_n_accepted;
      msg.timings = t;
    }
    const d = v.choices?.[0]?.delta;
    if (!d) return;
    if (d.reasoning_content) msg.reasoning += d.reasoning_content;
    if (typeof d.content === "string" && d.content) {
      const draft = toMark > 0;
      if (draft) toMark -= 1;
      msg.content += d.content;
      const last = msg.pieces[msg.pieces.length - 1];
      if (last && last.draft === draft) last.text += d.content;
      else msg.pieces.push({ text: d.content, draft });
    } else if (toMark > 0 && (d.reasoning_content || d.tool_calls)) {
      toMark -= 1;
    }
    for (const tc of d.tool_calls || []) {
      const i = tc.index ?? msg.tool_calls.length;
      msg.tool_calls[i] ??= { type: "function", function: { name: "", arguments: "" } };
      if (tc.id) msg.tool_calls[i].id = tc.id;
      if (tc.function?.name) msg.tool_calls[i].function.name += tc.function.name;
      if (tc.function?.arguments) msg.tool_calls[i].function.arguments += tc.function.arguments;
    }
  };
  try {
    const res = await fetchWithKey("v1/chat/completions", { method: "POST", body: JSON.stringify(body), signal: controller.signal });
    if (!res.ok) throw new Error(await errorText(res));
    loadDrafters();
    const reader = res.body.getReader();
    const dec = new TextDecoder();
    let buf = "";
    let shown = 0;
    for (;;) {
      const { done, value } = await reader.read();
      if (done) break;
      buf += dec.decode(value, { stream: true });
      let cut;
      while ((cut = buf.indexOf("\n\n")) >= 0) {
        const event = buf.slice(0, cut);
        buf = buf.slice(cut + 2);
        for (const line of event.split("\n")) {
          if (!line.startsWith("data:")) continue;
          const data = line.slice(5).trim();
          if (data === "[DONE]") continue;
          try {
            onChunk(JSON.parse(data));
          } catch (e) {
            msg.error = `A reply chunk could not be read: ${e.message}`;
          }
        }
      }
      // At most one render a frame.
      const now = performance.now();
      if (now - shown > 30) {
        shown = now;
        renderMessages();
      }
    }
  } catch (e) {
    if (e.name === "AbortError") msg.stopped = true;
    else msg.error = e instanceof TypeError ? `Could not reach the server: ${e.message}` : e.message;
  } finally {
    running = null;
    msg.tool_calls = msg.tool_calls.filter(Boolean);
    save();
    renderAll();
  }
}

// ---- wiring --------------------------------------------------------------------------------------

$("composer").addEventListener("submit", (ev) => {
  ev.preventDefault();
  if (running) {
    running.controller.abort();
    return;
  }
  const text = $("input").value.trim();
  if (!text) return;
  $("input").value = "";
  send(text);
});
$("input").addEventListener("keydown", (ev) => {
  if (ev.key === "Enter" && !ev.shiftKey && !ev.isComposing) {
    ev.preventDefault();
    $("composer").requestSubmit();
  }
});
$("new-chat").onclick = () => {
  if (running) running.controller.abort();
  newConversation();
  renderAll();
  $("input").focus();
};
$("forget-key").onclick = () => sessionStorage.removeItem(KEY);
$("mark-drafts").onchange = () => {
  applyDraftMarks();
  localStorage.setItem(SETTINGS, JSON.stringify(settings()));
};
for (const id of ["temperature", "max-tokens", "speculation", "n-max"]) $(id).onchange = () => localStorage.setItem(SETTINGS, JSON.stringify(settings()));

restoreSettings();
renderAll();
loadModel().then(loadDrafters);
