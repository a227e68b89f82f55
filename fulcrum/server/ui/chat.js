// The chat playground: a streamed /v1/chat/completions (or /v1/completions for a raw prompt), n answers side by
// side, each with its TTFT, TPOT, tokens and finish reason; logprob colours; Stop aborts the request (the server
// aborts a request whose client went away). The conversation lives in this page's memory only.
"use strict";

const Chat = (() => {
  let history = []; // [{role, content}] of the chat so far
  let controller = null;

  function el(tag, cls, text) {
    const e = document.createElement(tag);
    if (cls) e.className = cls;
    if (text !== undefined) e.textContent = text;
    return e;
  }

  function num(id, parse = Number) {
    const v = $(id).value.trim();
    return v === "" ? undefined : parse(v);
  }

  function jsonBox(id, what) {
    const text = $(id).value.trim();
    if (!text) return undefined;
    try {
      return JSON.parse(text);
    } catch (e) {
      throw new Error(`${what} is not valid JSON: ${e.message}`);
    }
  }

  function buildBody(mode, prompt) {
    const body = { model: $("model").value, stream: true, stream_options: { include_usage: true } };
    const fields = { temperature: num("temperature"), top_p: num("top_p"), max_tokens: num("max_tokens", parseInt),
      seed: num("seed", parseInt), n: num("n", parseInt) };
    for (const [k, v] of Object.entries(fields)) if (v !== undefined && !Number.isNaN(v)) body[k] = v;
    const stop = $("stop").value.split("\n").filter((s) => s.length);
    if (stop.length) body.stop = stop;
    const schema = jsonBox("schema", "the JSON schema");
    if (schema !== undefined) body.response_format = { type: "json_schema", json_schema: { name: "answer", schema } };
    if (mode === "chat") {
      const messages = [];
      const system = $("system").value.trim();
      if (system) messages.push({ role: "system", content: system });
      messages.push(...history, { role: "user", content: prompt });
      body.messages = messages;
      const tools = jsonBox("tools", "the tools box");
      if (tools !== undefined) body.tools = tools;
      if ($("logprobs").checked) Object.assign(body, { logprobs: true, top_logprobs: 5 });
    } else {
      body.prompt = prompt;
      if ($("logprobs").checked) body.logprobs = 5;
    }
    const extra = jsonBox("extra", "the extra fields");
    if (extra !== undefined) Object.assign(body, extra);
    return body;
  }

  // one answer box per choice index, made when its first chunk arrives
  function answerBox(turn, index, n) {
    let box = turn.querySelector(`.answer[data-index="${index}"]`);
    if (box) return box;
    box = el("div", "answer");
    box.dataset.index = index;
    if (n > 1) box.append(el("div", "label", `answer ${index + 1}`));
    box.append(el("div", "reasoning"), el("div", "text"), el("div", "tools"), el("div", "stats"));
    turn.querySelector(".answers").append(box);
    box.state = { first: null, last: null, chunks: 0, tokens: 0, text: "", finish: null, calls: [] };
    return box;
  }

  function colour(logprob) {
    const p = Math.exp(logprob);
    return `hsl(${Math.round(120 * p)}, 75%, ${Math.round(88 - 8 * p)}%)`;
  }

  // chat logprobs: {content: [{token, logprob, top_logprobs}]}; completions: {tokens, token_logprobs, top_logprobs}
  function logprobEntries(lp) {
    if (!lp) return [];
    if (Array.isArray(lp.content)) {
      return lp.content.map((t) => ({ token: t.token, logprob: t.logprob,
        top: (t.top_logprobs || []).map((x) => [x.token, x.logprob]) }));
    }
    if (Array.isArray(lp.tokens)) {
      return lp.tokens.map((token, i) => ({ token, logprob: lp.token_logprobs[i],
        top: Object.entries((lp.top_logprobs || [])[i] || {}) }));
    }
    return [];
  }

  function tokenSpan(text, logprob, tip) {
    const span = el("span", "tok", text);
    span.style.background = colour(logprob);
    span.title = tip;
    return span;
  }

  function addText(box, text, lp) {
    const target = box.querySelector(".text");
    const fresh = logprobEntries(lp);
    box.state.tokens += fresh.length;
    // a token whose text the server holds back (a character not yet whole, a possible stop string) comes with
    // its logprob and no text; its text follows in a later chunk: kept until then
    const entries = (box.state.heldEntries || []).concat(fresh);
    if (!text) {
      box.state.heldEntries = entries;
      return;
    }
    box.state.heldEntries = [];
    const tip = (e) => `${JSON.stringify(e.token)} p=${Math.exp(e.logprob).toFixed(3)}\n` +
      e.top.map(([t, l]) => `  ${JSON.stringify(t)} ${Math.exp(l).toFixed(3)}`).join("\n");
    if (entries.length && entries.map((e) => e.token).join("") === text) {
      for (const e of entries) target.append(tokenSpan(e.token, e.logprob, tip(e)));
    } else if (entries.length) {
      // the text of this chunk is not its tokens' strings laid end to end (a character split across tokens):
      // one span, coloured by its least likely token
      const worst = entries.reduce((a, b) => (b.logprob < a.logprob ? b : a));
      target.append(tokenSpan(text, worst.logprob, entries.map(tip).join("\n")));
    } else {
      target.append(document.createTextNode(text));
    }
  }

  function addToolCalls(box, deltas) {
    for (const d of deltas) {
      const i = d.index ?? 0;
      const call = (box.state.calls[i] ||= { name: "", arguments: "" });
      if (d.function?.name) call.name += d.function.name;
      if (d.function?.arguments) call.arguments += d.function.arguments;
    }
    box.querySelector(".tools").textContent = box.state.calls.map((c) => `→ ${c.name}(${c.arguments})`).join("\n");
  }

  function showStats(box, t0, usageTokens) {
    const s = box.state;
    const tokens = usageTokens ?? (s.tokens || s.chunks);
    const ttft = s.first === null ? null : s.first - t0;
    const tpot = tokens > 1 && s.last !== null ? (s.last - s.first) / (tokens - 1) : null;
    box.dataset.ttftMs = ttft === null ? "" : ttft.toFixed(1);
    box.dataset.tokens = tokens;
    box.dataset.finish = s.finish || "";
    const parts = [
      `TTFT ${ttft === null ? "–" : ttft.toFixed(0) + " ms"}`,
      `TPOT ${tpot === null ? "–" : tpot.toFixed(1) + " ms"}`,
      `${tokens} tokens`,
      `finish: ${s.finish || "…"}`,
    ];
    box.querySelector(".stats").textContent = parts.join(" · ");
  }

  async function* events(response, signal) {
    const reader = response.body.getReader();
    const decoder = new TextDecoder();
    let buf = "";
    while (true) {
      const { value, done } = await reader.read();
      if (done) break;
      buf += decoder.decode(value, { stream: true });
      let cut;
      while ((cut = buf.indexOf("\n\n")) >= 0) {
        const event = buf.slice(0, cut);
        buf = buf.slice(cut + 2);
        const data = event.split("\n").filter((l) => l.startsWith("data:")).map((l) => l.slice(5).trim()).join("\n");
        if (data === "[DONE]") return;
        if (data) yield JSON.parse(data);
      }
      if (signal.aborted) return;
    }
  }

  async function send(mode, prompt, body) {
    setStatus("");
    const messages = $("messages");
    const turn = el("div", "turn");
    turn.append(el("div", "user", prompt), el("div", "answers"));
    messages.append(turn);
    messages.scrollTop = messages.scrollHeight;
    controller = new AbortController();
    $("send").disabled = true;
    $("stop-btn").disabled = false;
    const n = body.n || 1;
    const t0 = performance.now();
    let usage = null;
    try {
      const path = mode === "chat" ? "/v1/chat/completions" : "/v1/completions";
      const r = await Api.call(path, { method: "POST", headers: { "Content-Type": "application/json" },
        body: JSON.stringify(body), signal: controller.signal });
      if (!r.ok) {
        const err = await r.json().catch(() => ({}));
        throw new Error(`HTTP ${r.status}: ${err.error?.message || err.message || r.statusText}`);
      }
      for await (const chunk of events(r, controller.signal)) {
        if (chunk.error) throw new Error(chunk.error.message || JSON.stringify(chunk.error));
        if (chunk.usage) usage = chunk.usage;
        const now = performance.now();
        for (const c of chunk.choices || []) {
          const box = answerBox(turn, c.index, n);
          const text = mode === "chat" ? c.delta?.content || "" : c.text || "";
          const calls = mode === "chat" ? c.delta?.tool_calls : null;
          const thought = mode === "chat" ? c.delta?.reasoning_content || "" : ""; // --reasoning-parser
          if (thought) box.querySelector(".reasoning").append(document.createTextNode(thought));
          if (text || calls?.length || thought) {
            if (box.state.first === null) box.state.first = now;
            box.state.last = now;
            box.state.chunks += 1;
            box.state.text += text;
            addText(box, text, c.logprobs);
            if (calls?.length) addToolCalls(box, calls);
          }
          if (c.finish_reason) box.state.finish = c.finish_reason;
          showStats(box, t0);
        }
        messages.scrollTop = messages.scrollHeight;
      }
    } catch (e) {
      if (e.name === "AbortError") {
        for (const box of turn.querySelectorAll(".answer")) box.state.finish ||= "stopped";
        setStatus("stopped");
      } else {
        turn.append(el("div", "error", e.message));
        setStatus(e.message, "error");
      }
    } finally {
      controller = null;
      $("send").disabled = false;
      $("stop-btn").disabled = true;
    }
    const boxes = [...turn.querySelectorAll(".answer")];
    for (const box of boxes) showStats(box, t0, n === 1 && usage ? usage.completion_tokens : undefined);
    if (mode === "chat" && boxes.length) {
      history.push({ role: "user", content: prompt }, { role: "assistant", content: boxes[0].state.text });
    }
    turn.classList.add("done");
  }

  function start() {
    $("chat-form").addEventListener("submit", (e) => {
      e.preventDefault();
      const prompt = $("prompt").value;
      if (!prompt.trim() || controller) return;
      const mode = $("mode").value;
      let body;
      try {
        body = buildBody(mode, prompt);
      } catch (e) {
        setStatus(e.message, "error"); // the message stays in the box, to send again once the field is fixed
        return;
      }
      $("prompt").value = "";
      send(mode, prompt, body);
    });
    $("prompt").addEventListener("keydown", (e) => {
      if (e.key === "Enter" && !e.shiftKey) {
        e.preventDefault();
        $("chat-form").requestSubmit();
      }
    });
    $("stop-btn").addEventListener("click", () => controller && controller.abort());
    $("clear").addEventListener("click", () => {
      history = [];
      $("messages").replaceChildren();
    });
    $("mode").addEventListener("change", () => {
      for (const e of document.querySelectorAll(".chat-only")) e.hidden = $("mode").value !== "chat";
    });
  }

  return { start };
})();
