// Prometheus text format: parsed into samples, summed over labels, histograms as cumulative buckets, and
// quantiles over bucket deltas by Prometheus' own histogram_quantile (linear inside the bucket).
"use strict";

const Prom = (() => {
  const LINE = /^([a-zA-Z_:][a-zA-Z0-9_:]*)(?:\{(.*)\})?\s+(\S+)/;
  const LABEL = /([a-zA-Z_][a-zA-Z0-9_]*)="((?:[^"\\]|\\.)*)"/g;

  function parseValue(text) {
    if (text === "+Inf") return Infinity;
    if (text === "-Inf") return -Infinity;
    return Number(text);
  }

  // text -> Map(name -> [{labels, value}])
  function parse(text) {
    const samples = new Map();
    for (const line of text.split("\n")) {
      if (!line || line[0] === "#") continue;
      const m = LINE.exec(line);
      if (!m) continue;
      const labels = {};
      if (m[2]) for (const l of m[2].matchAll(LABEL)) labels[l[1]] = l[2].replace(/\\(.)/g, (_, c) => (c === "n" ? "\n" : c));
      if (!samples.has(m[1])) samples.set(m[1], []);
      samples.get(m[1]).push({ labels, value: parseValue(m[3]) });
    }
    return samples;
  }

  const matches = (labels, where) => Object.entries(where || {}).every(([k, v]) => labels[k] === v);

  // the sum over every series of a name (0 when absent: a counter not yet shown counts nothing)
  function sum(samples, name, where) {
    let total = 0;
    for (const s of samples.get(name) || []) if (matches(s.labels, where)) total += s.value;
    return total;
  }

  const has = (samples, name) => samples.has(name);

  // {label value -> summed value}, grouped by one label
  function by(samples, name, label) {
    const out = {};
    for (const s of samples.get(name) || []) {
      const k = s.labels[label];
      if (k !== undefined) out[k] = (out[k] || 0) + s.value;
    }
    return out;
  }

  // cumulative buckets of a histogram, summed over its series: [[le, count], ...] sorted by le
  function buckets(samples, name) {
    const acc = new Map();
    for (const s of samples.get(name + "_bucket") || []) {
      const le = parseValue(s.labels.le);
      acc.set(le, (acc.get(le) || 0) + s.value);
    }
    return [...acc.entries()].sort((a, b) => a[0] - b[0]);
  }

  // b - a bucket by bucket (a counter reset, b below a, counts b whole)
  function minus(b, a) {
    const old = new Map(a || []);
    const reset = b.some(([le, c]) => c < (old.get(le) || 0));
    return b.map(([le, c]) => [le, reset ? c : c - (old.get(le) || 0)]);
  }

  // Prometheus' histogram_quantile: linear within the bucket, the highest finite bound if it lands in +Inf
  function quantile(q, cumulative) {
    if (!cumulative.length) return NaN;
    const total = cumulative[cumulative.length - 1][1];
    if (!(total > 0)) return NaN;
    const rank = q * total;
    let prevLe = 0;
    let prevCount = 0;
    for (let i = 0; i < cumulative.length; i++) {
      const [le, count] = cumulative[i];
      if (count >= rank) {
        if (le === Infinity) return i > 0 ? cumulative[i - 1][0] : NaN;
        if (i === 0 && le <= 0) return le;
        return prevLe + (le - prevLe) * ((rank - prevCount) / (count - prevCount));
      }
      prevLe = le;
      prevCount = count;
    }
    return cumulative[cumulative.length - 1][0];
  }

  return { parse, sum, has, by, buckets, minus, quantile };
})();
