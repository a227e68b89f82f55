// Small canvas charts: lines over x (time series, curves) and grouped bars. No library: axes, ticks, a legend.
"use strict";

const Charts = (() => {
  const COLOURS = ["#2f6fdf", "#e0742b", "#2a9d55", "#c23b5a", "#8a5cd1", "#9a7b12", "#1b9aaa", "#666"];
  const PAD = { left: 52, right: 12, top: 22, bottom: 28 };

  function setup(canvas) {
    const ratio = window.devicePixelRatio || 1;
    const w = canvas.clientWidth || canvas.width;
    const h = canvas.clientHeight || canvas.height;
    if (canvas.width !== Math.round(w * ratio)) canvas.width = Math.round(w * ratio);
    if (canvas.height !== Math.round(h * ratio)) canvas.height = Math.round(h * ratio);
    const ctx = canvas.getContext("2d");
    ctx.setTransform(ratio, 0, 0, ratio, 0, 0);
    ctx.clearRect(0, 0, w, h);
    ctx.font = "11px system-ui, sans-serif";
    return { ctx, w, h };
  }

  function niceMax(v) {
    if (!(v > 0) || !isFinite(v)) return 1;
    const p = Math.pow(10, Math.floor(Math.log10(v)));
    for (const m of [1, 2, 2.5, 5, 10]) if (m * p >= v) return m * p;
    return 10 * p;
  }

  function fmt(v) {
    if (v === 0) return "0";
    const a = Math.abs(v);
    if (a >= 1e6) return (v / 1e6).toFixed(1) + "M";
    if (a >= 1e3) return (v / 1e3).toFixed(a >= 1e4 ? 0 : 1) + "k";
    if (a >= 10) return v.toFixed(0);
    if (a >= 1) return v.toFixed(1);
    return v.toPrecision(2);
  }

  function axes(ctx, w, h, ymax, xlabels) {
    const x0 = PAD.left, y0 = h - PAD.bottom, x1 = w - PAD.right, y1 = PAD.top;
    ctx.strokeStyle = "#ddd";
    ctx.fillStyle = "#555";
    ctx.textAlign = "right";
    ctx.textBaseline = "middle";
    for (let i = 0; i <= 4; i++) {
      const y = y0 - ((y0 - y1) * i) / 4;
      ctx.beginPath();
      ctx.moveTo(x0, y);
      ctx.lineTo(x1, y);
      ctx.stroke();
      ctx.fillText(fmt((ymax * i) / 4), x0 - 4, y);
    }
    ctx.textAlign = "center";
    ctx.textBaseline = "top";
    for (const [x, text] of xlabels) ctx.fillText(text, x, y0 + 6);
    return { x0, y0, x1, y1 };
  }

  function legend(ctx, names, x, y) {
    ctx.textAlign = "left";
    ctx.textBaseline = "middle";
    for (let i = 0; i < names.length; i++) {
      ctx.fillStyle = COLOURS[i % COLOURS.length];
      ctx.fillRect(x, y - 4, 10, 8);
      ctx.fillStyle = "#333";
      ctx.fillText(names[i], x + 14, y);
      x += 24 + ctx.measureText(names[i]).width;
    }
  }

  // series: [{name, points: [[x, y], ...]}]; xfmt formats the x ticks
  function lines(canvas, series, opts = {}) {
    const { ctx, w, h } = setup(canvas);
    const all = series.flatMap((s) => s.points).filter((p) => isFinite(p[0]) && isFinite(p[1]));
    const xs = all.map((p) => p[0]);
    let xmin = opts.xmin ?? Math.min(...xs);
    let xmax = opts.xmax ?? Math.max(...xs);
    if (!all.length) { xmin = 0; xmax = 1; }
    if (xmax === xmin) xmax = xmin + 1;
    const ymax = opts.ymax ?? niceMax(Math.max(0, ...all.map((p) => p[1])) * 1.05);
    const xfmt = opts.xfmt || fmt;
    const sx = (x) => PAD.left + ((x - xmin) / (xmax - xmin)) * (w - PAD.left - PAD.right);
    const ticks = [0, 0.25, 0.5, 0.75, 1].map((f) => xmin + f * (xmax - xmin)).map((x) => [sx(x), xfmt(x)]);
    const box = axes(ctx, w, h, ymax, ticks);
    const sy = (y) => box.y0 - (Math.min(y, ymax) / ymax) * (box.y0 - box.y1);
    series.forEach((s, i) => {
      ctx.strokeStyle = ctx.fillStyle = COLOURS[i % COLOURS.length];
      ctx.lineWidth = 1.8;
      ctx.beginPath();
      let started = false;
      for (const [x, y] of s.points) {
        if (!isFinite(x) || !isFinite(y)) continue;
        if (started) ctx.lineTo(sx(x), sy(y));
        else { ctx.moveTo(sx(x), sy(y)); started = true; }
      }
      ctx.stroke();
      if (opts.dots) for (const [x, y] of s.points) if (isFinite(x) && isFinite(y)) ctx.fillRect(sx(x) - 2.5, sy(y) - 2.5, 5, 5);
    });
    ctx.lineWidth = 1;
    legend(ctx, series.map((s) => s.name), PAD.left, 10);
    if (opts.xtitle) {
      ctx.fillStyle = "#777";
      ctx.textAlign = "right";
      ctx.fillText(opts.xtitle, w - PAD.right, 10);
    }
  }

  // groups: category labels; series: [{name, values: [one per group]}]
  function bars(canvas, groups, series) {
    const { ctx, w, h } = setup(canvas);
    const vals = series.flatMap((s) => s.values).filter((v) => isFinite(v));
    const ymax = niceMax(Math.max(0, ...vals) * 1.05);
    const gw = (w - PAD.left - PAD.right) / Math.max(groups.length, 1);
    const box = axes(ctx, w, h, ymax, groups.map((g, i) => [PAD.left + gw * (i + 0.5), g]));
    const bw = (gw * 0.8) / Math.max(series.length, 1);
    series.forEach((s, j) => {
      ctx.fillStyle = COLOURS[j % COLOURS.length];
      s.values.forEach((v, i) => {
        if (!isFinite(v)) return;
        const hgt = (Math.min(v, ymax) / ymax) * (box.y0 - box.y1);
        ctx.fillRect(PAD.left + gw * i + gw * 0.1 + bw * j, box.y0 - hgt, bw - 2, hgt);
      });
    });
    legend(ctx, series.map((s) => s.name), PAD.left, 10);
  }

  function empty(canvas, text) {
    const { ctx, w, h } = setup(canvas);
    ctx.fillStyle = "#888";
    ctx.textAlign = "center";
    ctx.textBaseline = "middle";
    ctx.fillText(text, w / 2, h / 2);
  }

  return { lines, bars, empty, fmt, COLOURS };
})();
