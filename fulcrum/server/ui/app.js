// The page: tabs, the API key (asked for when the server answers 401, kept in this tab's sessionStorage only and
// sent as a Bearer token), and the start of each part. Offline (fulcrum bench view) only the bench viewer runs.
"use strict";

const Api = (() => {
  const KEY = "fulcrum.apiKey";
  let onUnauthorized = () => {};

  function headers(extra) {
    const h = { ...(extra || {}) };
    const key = sessionStorage.getItem(KEY);
    if (key) h.Authorization = "Bearer " + key;
    return h;
  }

  async function call(path, opts = {}) {
    const r = await fetch(path, { ...opts, headers: headers(opts.headers) });
    if (r.status === 401) onUnauthorized();
    return r;
  }

  return {
    call,
    setKey: (k) => (k ? sessionStorage.setItem(KEY, k) : sessionStorage.removeItem(KEY)),
    hasKey: () => !!sessionStorage.getItem(KEY),
    onUnauthorized: (f) => (onUnauthorized = f),
  };
})();

function $(id) {
  return document.getElementById(id);
}

function setStatus(text, kind) {
  const s = $("status");
  s.textContent = text;
  s.className = kind || "";
}

function showTab(name) {
  for (const b of document.querySelectorAll("#tabs button")) b.classList.toggle("active", b.dataset.tab === name);
  for (const t of document.querySelectorAll(".tab")) t.hidden = t.id !== "tab-" + name;
  if (name === "bench") Bench.redraw();
  if (name === "dashboard") Dashboard.redraw();
  if (location.protocol !== "file:") history.replaceState(null, "", "#" + name);
}

async function loadModels() {
  const r = await Api.call("/v1/models");
  if (!r.ok) return false;
  const body = await r.json();
  const select = $("model");
  select.replaceChildren();
  for (const m of body.data || []) {
    const o = document.createElement("option");
    o.value = o.textContent = m.id;
    select.append(o);
  }
  const first = (body.data || [])[0];
  $("server-info").textContent = first ? `${first.id}${first.max_model_len ? " · " + first.max_model_len + " tokens" : ""}` : "";
  return true;
}

function start() {
  for (const b of document.querySelectorAll("#tabs button")) b.addEventListener("click", () => showTab(b.dataset.tab));
  const offline = document.getElementById("bench-data");
  if (offline) {
    // a file from `fulcrum bench view`: no server behind it
    for (const b of document.querySelectorAll("#tabs button")) b.hidden = b.dataset.tab !== "bench";
    Bench.start(JSON.parse(offline.textContent));
    showTab("bench");
    return;
  }
  Api.onUnauthorized(() => {
    $("key-form").hidden = false;
    setStatus(Api.hasKey() ? "the API key was refused" : "this server needs an API key", "error");
  });
  $("key-form").addEventListener("submit", async (e) => {
    e.preventDefault();
    Api.setKey($("api-key").value.trim());
    $("api-key").value = "";
    if (await loadModels()) {
      $("key-form").hidden = true;
      setStatus("");
    }
  });
  Chat.start();
  Dashboard.start();
  Bench.start(null);
  loadModels().catch((e) => setStatus("cannot reach the server: " + e.message, "error"));
  const tab = location.hash.slice(1);
  showTab(["chat", "dashboard", "bench"].includes(tab) ? tab : "chat");
}

start();
