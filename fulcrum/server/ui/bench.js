// The benchmark viewer: `fulcrum bench serve --out` results (one, or several compared) as a table and charts:
// latency percentiles, throughput against latency, goodput and cost per 1M output tokens. Files are read in the
// browser (nothing is uploaded); `fulcrum bench view` embeds them in an offline copy of this page.
"use strict";

const Bench = (() => {
  let loaded = []; // [{name, doc}]

  // per request and per token latencies differ by 10-100x: one chart each, so neither is flattened
  const LATENCY = { "b-latency": [["ttft_ms", "TTFT"], ["e2e_ms", "E2E"]], "b-latency-token": [["tpot_ms", "TPOT"], ["itl_ms", "ITL"]] };
  const get = (summary, key, stat) => {
    const v = summary?.[key];
    const x = stat ? v?.[stat] : v;
    return typeof x === "number" ? x : NaN;
  };
  const runName = (file, run) => (loaded.length > 1 ? `${file.name}: ${run.label}` : run.label);

  function check(name, doc) {
    if (!doc || typeof doc !== "object" || !Array.isArray(doc.runs)) {
      throw new Error(`${name}: not a \`fulcrum bench serve --out\` result (no runs)`);
    }
    return { name, doc };
  }

  function table() {
    const cols = [
      ["run", null], ["completed", (s) => s.completed], ["failed", (s) => s.failed],
      ["req/s", (s) => get(s, "request_throughput")], ["output tok/s", (s) => get(s, "output_throughput")],
      ["TTFT p50 ms", (s) => get(s, "ttft_ms", "p50")], ["TTFT p99 ms", (s) => get(s, "ttft_ms", "p99")],
      ["TPOT p50 ms", (s) => get(s, "tpot_ms", "p50")], ["TPOT p99 ms", (s) => get(s, "tpot_ms", "p99")],
      ["ITL p99 ms", (s) => get(s, "itl_ms", "p99")], ["E2E p50 ms", (s) => get(s, "e2e_ms", "p50")],
      ["goodput req/s", (s) => get(s, "goodput")], ["$ / 1M out", (s) => get(s, "cost_per_1m_output_tokens")],
    ];
    const t = $("bench-table");
    const head = document.createElement("tr");
    for (const [title] of cols) head.append(Object.assign(document.createElement("th"), { textContent: title }));
    t.tHead.replaceChildren(head);
    t.tBodies[0].replaceChildren();
    for (const file of loaded) {
      for (const run of file.doc.runs) {
        const row = document.createElement("tr");
        for (const [, f] of cols) {
          const v = f ? f(run.summary || {}) : runName(file, run);
          const text = typeof v === "number" ? (Number.isFinite(v) ? (Number.isInteger(v) ? String(v) : v.toFixed(2)) : "–") : v;
          row.append(Object.assign(document.createElement("td"), { textContent: text }));
        }
        t.tBodies[0].append(row);
      }
    }
  }

  function charts() {
    const runs = loaded.flatMap((file) => file.doc.runs.map((run) => ({ file, run })));
    for (const [canvas, metrics] of Object.entries(LATENCY)) {
      const groups = [];
      for (const [key, label] of metrics) for (const p of ["p50", "p90", "p99"]) groups.push([key, p, `${label} ${p}`]);
      Charts.bars($(canvas), groups.map((g) => g[2]), runs.slice(0, 8).map(({ file, run }) =>
        ({ name: runName(file, run), values: groups.map(([k, p]) => get(run.summary, k, p)) })));
    }

    Charts.lines($("b-curve"), loaded.map((file) => ({
      name: file.name,
      points: file.doc.runs.map((r) => [get(r.summary, "output_throughput"), get(r.summary, "ttft_ms", "p50")])
        .sort((a, b) => a[0] - b[0]),
    })), { dots: true, xtitle: "output tok/s" });

    // runs matched across files by their load label, as `fulcrum bench compare` matches them
    const labels = [...new Set(runs.map(({ run }) => run.label))];
    const perFile = (key) => loaded.map((file) => ({
      name: file.name,
      values: labels.map((l) => get(file.doc.runs.find((r) => r.label === l)?.summary, key)),
    }));
    const any = (key) => runs.some(({ run }) => Number.isFinite(get(run.summary, key)));
    if (any("goodput")) Charts.bars($("b-goodput"), labels, perFile("goodput"));
    else Charts.empty($("b-goodput"), "no goodput: the run had no --slo");
    if (any("cost_per_1m_output_tokens")) Charts.bars($("b-cost"), labels, perFile("cost_per_1m_output_tokens"));
    else Charts.empty($("b-cost"), "no cost: the run had no --price-per-hour");
  }

  function redraw() {
    if (!loaded.length || $("tab-bench").hidden) return;
    charts();
  }

  function show(files) {
    loaded = files;
    const date = files.map((f) => f.doc.date).filter(Boolean)[0];
    $("bench-message").textContent = `${files.map((f) => f.name).join(", ")}: ` +
      `${files.reduce((n, f) => n + f.doc.runs.length, 0)} runs` +
      (files[0].doc.model ? ` of ${files[0].doc.model}` : "") + (date ? `, ${date}` : "");
    $("bench-message").className = "";
    table();
    redraw();
  }

  async function open(fileList) {
    try {
      const files = [];
      for (const f of fileList) {
        let doc;
        try {
          doc = JSON.parse(await f.text());
        } catch (e) {
          throw new Error(`${f.name}: not JSON (${e.message})`);
        }
        files.push(check(f.name.replace(/\.json$/, ""), doc));
      }
      if (files.length) show(files);
    } catch (e) {
      $("bench-message").textContent = e.message;
      $("bench-message").className = "error";
    }
  }

  function start(embedded) {
    $("bench-files").addEventListener("change", (e) => open(e.target.files));
    if (embedded) show(embedded.map((x) => check(x.name, x.doc)));
  }

  return { start, redraw };
})();
