// The live dashboard: /metrics polled and parsed here. Gauges as read; tokens/s from counter deltas between two
// polls; TTFT/TPOT/ITL percentiles over a sliding window from histogram bucket deltas; on a router, each
// replica's health, load and routed share and the autoscaler's decisions. Every number sits in an element with a
// stable id and its raw value in data-value, so a test can hold it against /metrics.
"use strict";

const Dashboard = (() => {
  const HISTORY = 300; // chart points kept
  const HISTOGRAMS = [
    ["ttft", "TTFT", "time_to_first_token_seconds"],
    ["tpot", "TPOT", "time_per_output_token_seconds"],
    ["itl", "ITL", "inter_token_latency_seconds"],
    ["e2e", "E2E", "e2e_request_latency_seconds"],
    ["queue", "queue", "request_queue_time_seconds"],
  ];
  let snapshots = []; // [{t, samples}] for the percentile window
  let history = { t: [], inRate: [], outRate: [], running: [], waiting: [], kv: [] };
  let timer = null;
  let polls = 0;
  let busy = false;

  // fulcrum's names, else vLLM's (fulcrum serve --metrics-compat vllm shows both)
  const name = (samples, suffix) =>
    samples.has("fulcrum:" + suffix) || samples.has(`fulcrum:${suffix}_bucket`) ? "fulcrum:" + suffix : "vllm:" + suffix;
  const metric = (samples, suffix) => Prom.sum(samples, name(samples, suffix));

  function show(id, value, text) {
    const e = $(id);
    e.dataset.value = Number.isFinite(value) ? String(value) : "";
    e.textContent = text;
  }

  const pct = (v) => (Number.isFinite(v) ? (100 * v).toFixed(1) + " %" : "–");
  const ms = (s) => (Number.isFinite(s) ? (s * 1000 >= 100 ? (s * 1000).toFixed(0) : (s * 1000).toPrecision(3)) + " ms" : "–");

  function engineView(now, prev) {
    const s = now.samples;
    const running = metric(s, "num_requests_running");
    const waiting = metric(s, "num_requests_waiting");
    const kv = metric(s, "kv_cache_usage_perc");
    const capacity = metric(s, "kv_cache_capacity_tokens");
    const hits = metric(s, "prefix_cache_hits_total");
    const queries = metric(s, "prefix_cache_queries_total");
    const inTotal = metric(s, "prompt_tokens_total");
    const outTotal = metric(s, "generation_tokens_total");
    show("m-running", running, String(running));
    show("m-waiting", waiting, String(waiting));
    show("m-kv-usage", kv, pct(kv));
    show("m-kv-capacity", capacity, `of ${Charts.fmt(capacity)} tokens`);
    const hitRate = queries > 0 ? hits / queries : NaN;
    show("m-prefix-hit", hitRate, pct(hitRate));
    show("m-prefix-tokens", hits, `${Charts.fmt(hits)} of ${Charts.fmt(queries)} prompt tokens`);
    show("m-in-total", inTotal, `${Charts.fmt(inTotal)} in all`);
    show("m-out-total", outTotal, `${Charts.fmt(outTotal)} in all`);
    show("m-preemptions", metric(s, "num_preemptions_total"), String(metric(s, "num_preemptions_total")));
    let inRate = NaN, outRate = NaN;
    if (prev) {
      const dt = now.t - prev.t;
      const rate = (suffix, total) => Math.max(0, total - metric(prev.samples, suffix)) / dt;
      inRate = rate("prompt_tokens_total", inTotal);
      outRate = rate("generation_tokens_total", outTotal);
    }
    show("m-in-rate", inRate, Number.isFinite(inRate) ? inRate.toFixed(1) : "–");
    show("m-out-rate", outRate, Number.isFinite(outRate) ? outRate.toFixed(1) : "–");

    const drafts = name(s, "spec_decode_num_draft_tokens_total");
    $("spec-card").hidden = !s.has(drafts);
    if (s.has(drafts)) {
      const proposed = Prom.sum(s, drafts);
      const accepted = metric(s, "spec_decode_num_accepted_tokens_total");
      const rate = proposed > 0 ? accepted / proposed : NaN;
      show("m-spec-accept", rate, pct(rate));
      const length = metric(s, "spec_decode_mean_accepted_length");
      show("m-spec-length", length, `${length.toFixed(2)} tokens per step`);
    }

    latencyTable(now);
    tierTable(s);
    const h = history;
    h.t.push(now.t); h.inRate.push(inRate); h.outRate.push(outRate);
    h.running.push(running); h.waiting.push(waiting); h.kv.push(100 * kv);
    for (const k in h) if (h[k].length > HISTORY) h[k].shift();
  }

  // the newest snapshot at least `window` seconds old (else the first): percentiles cover at least the window
  function baseline(now) {
    const windowS = Number($("window").value);
    let base = snapshots[0];
    for (const snap of snapshots) if (snap.t <= now.t - windowS) base = snap;
    snapshots = snapshots.filter((snap) => snap.t >= base.t);
    return base;
  }

  function latencyTable(now) {
    const base = baseline(now);
    const body = $("latency-table").tBodies[0];
    body.replaceChildren();
    for (const [key, label, suffix] of HISTOGRAMS) {
      const full = name(now.samples, suffix);
      if (!now.samples.has(full + "_bucket")) continue;
      const delta = Prom.minus(Prom.buckets(now.samples, full), Prom.buckets(base.samples, full));
      const count = delta.length ? delta[delta.length - 1][1] : 0;
      const row = document.createElement("tr");
      const cell = (id, value, text) => {
        const td = document.createElement("td");
        td.id = id;
        td.dataset.value = Number.isFinite(value) ? String(value) : "";
        td.textContent = text;
        row.append(td);
      };
      const th = document.createElement("th");
      th.textContent = label;
      row.append(th);
      cell(`l-${key}-count`, count, String(count));
      for (const q of [0.5, 0.9, 0.99]) {
        const v = Prom.quantile(q, delta);
        cell(`l-${key}-p${Math.round(q * 100)}`, v, ms(v));
      }
      body.append(row);
    }
  }

  function tierTable(s) {
    const tiers = Prom.by(s, "fulcrum:kv_offload_hit_tokens_total", "tier");
    const names = Object.keys(tiers);
    $("tiers").hidden = !names.length;
    const body = $("tier-table").tBodies[0];
    body.replaceChildren();
    for (const tier of names) {
      const row = document.createElement("tr");
      const get = (m) => Prom.sum(s, m, { tier });
      const used = get("fulcrum:kv_offload_used_bytes");
      const cap = get("fulcrum:kv_offload_capacity_bytes");
      for (const [id, text] of [
        ["", tier],
        [`t-${tier}-hit-tokens`, Charts.fmt(get("fulcrum:kv_offload_hit_tokens_total"))],
        [`t-${tier}-hit-blocks`, Charts.fmt(get("fulcrum:kv_offload_hit_blocks_total"))],
        [`t-${tier}-stored-blocks`, Charts.fmt(get("fulcrum:kv_offload_stored_blocks_total"))],
        ["", `${(used / 2 ** 20).toFixed(1)} of ${(cap / 2 ** 20).toFixed(0)} MiB`],
      ]) {
        const td = document.createElement("td");
        if (id) td.id = id;
        td.textContent = text;
        row.append(td);
      }
      body.append(row);
    }
  }

  function routerView(now) {
    const s = now.samples;
    const healthy = Prom.by(s, "fulcrum_router:replica_healthy", "replica");
    const load = Prom.by(s, "fulcrum_router:replica_load", "replica");
    const inFlight = Prom.by(s, "fulcrum_router:replica_in_flight", "replica");
    const routed = Prom.by(s, "fulcrum_router:requests_total", "replica");
    const total = Object.values(routed).reduce((a, b) => a + b, 0);
    show("r-replicas", Prom.sum(s, "fulcrum_router:replicas"), String(Prom.sum(s, "fulcrum_router:replicas")));
    const hit = Prom.sum(s, "fulcrum_router:prefix_hit_rate");
    show("r-hit-rate", hit, pct(hit));
    show("r-requests", total, String(total));
    const failed = Prom.sum(s, "fulcrum_router:failed_total");
    show("r-failed", failed, String(failed));
    const body = $("replica-table").tBodies[0];
    body.replaceChildren();
    const urls = [...new Set([...Object.keys(healthy), ...Object.keys(routed)])].sort();
    urls.forEach((url, i) => {
      const row = document.createElement("tr");
      row.dataset.replica = url;
      const share = total > 0 ? (routed[url] || 0) / total : NaN;
      const l = load[url];
      for (const text of [url, healthy[url] ? "healthy" : "out", l === -1 ? "saturated" : Charts.fmt(l ?? NaN),
        String(inFlight[url] ?? 0), String(routed[url] || 0), pct(share)]) {
        const td = document.createElement("td");
        td.textContent = text;
        row.append(td);
      }
      row.firstChild.style.borderLeft = `6px solid ${Charts.COLOURS[i % Charts.COLOURS.length]}`;
      body.append(row);
    });
    if (urls.length) Charts.bars($("c-share"), ["routed share %"], urls.map((u) => ({ name: u.replace(/^https?:\/\//, ""),
      values: [total > 0 ? (100 * (routed[u] || 0)) / total : 0] })));
    const decisions = Prom.by(s, "fulcrum_router:decisions_total", "reason");
    const dbody = $("decision-table").tBodies[0];
    dbody.replaceChildren();
    for (const [reason, n] of Object.entries(decisions)) {
      const row = document.createElement("tr");
      for (const text of [reason, String(n)]) row.append(Object.assign(document.createElement("td"), { textContent: text }));
      dbody.append(row);
    }
  }

  async function scalerDecisions() {
    const r = await Api.call("/autoscaler/decisions");
    if (!r.ok) return;
    const answer = await r.json();
    $("scaler").hidden = !answer.autoscaler;
    const body = $("scaler-table").tBodies[0];
    body.replaceChildren();
    for (const d of answer.decisions.slice().reverse()) {
      const row = document.createElement("tr");
      for (const text of [new Date(d.time * 1000).toLocaleTimeString(), `${d.from} → ${d.to}`, d.reason]) {
        row.append(Object.assign(document.createElement("td"), { textContent: text }));
      }
      body.append(row);
    }
  }

  function redraw() {
    if ($("tab-dashboard").hidden) return;
    const h = history;
    const t0 = h.t.length ? h.t[h.t.length - 1] : 0;
    const pts = (ys) => ys.map((y, i) => [h.t[i] - t0, y]);
    const xfmt = (x) => `${Math.round(x)} s`;
    if (!$("engine-view").hidden) {
      Charts.lines($("c-tokens"), [{ name: "prompt", points: pts(h.inRate) }, { name: "output", points: pts(h.outRate) }], { xfmt });
      Charts.lines($("c-requests"), [{ name: "running", points: pts(h.running) }, { name: "waiting", points: pts(h.waiting) }], { xfmt });
      Charts.lines($("c-kv"), [{ name: "KV used %", points: pts(h.kv) }], { xfmt, ymax: 100 });
    }
  }

  async function poll() {
    if (busy) return;
    busy = true;
    try {
      const r = await Api.call("/metrics");
      if (!r.ok) throw new Error(`/metrics: HTTP ${r.status}`);
      const now = { t: performance.now() / 1000, samples: Prom.parse(await r.text()) };
      const prev = snapshots[snapshots.length - 1];
      snapshots.push(now);
      const router = now.samples.has("fulcrum_router:replicas");
      $("router-view").hidden = !router;
      $("engine-view").hidden = router;
      if (router) {
        routerView(now);
        await scalerDecisions();
      } else {
        engineView(now, prev);
      }
      polls += 1;
      const state = $("poll-state");
      state.dataset.polls = polls;
      state.textContent = `updated ${new Date().toLocaleTimeString()}`;
      state.className = "";
      redraw();
    } catch (e) {
      $("poll-state").textContent = e.message;
      $("poll-state").className = "error";
    } finally {
      busy = false;
    }
  }

  function schedule() {
    clearInterval(timer);
    timer = setInterval(poll, Number($("poll-interval").value));
  }

  function start() {
    $("poll-interval").addEventListener("change", schedule);
    $("window").addEventListener("change", () => snapshots.length && latencyTable(snapshots[snapshots.length - 1]));
    poll();
    schedule();
  }

  return { start, redraw };
})();
