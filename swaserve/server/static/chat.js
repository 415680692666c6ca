// The chat: the conversation list, the messages (Markdown, collapsible reasoning, tool
// calls, copy buttons) and one streamed answer at a time, which Stop aborts.
"use strict";

(() => {
  const $ = (id) => document.getElementById(id);
  const els = {
    messages: $("messages"), prompt: $("prompt"), send: $("send"), stop: $("stop"),
    error: $("error"), convs: $("conversations"), key: $("api-key"),
    system: $("system-prompt"), temperature: $("temperature"), topP: $("top-p"),
    maxTokens: $("max-tokens"), tools: $("tools"), model: $("model-name"),
  };
  let model = null;
  let controller = null;  // the answer in flight's AbortController

  function showError(message) {
    els.error.textContent = message || "";
    els.error.hidden = !message;
  }

  // -- settings ------------------------------------------------------------------------
  function loadSettings() {
    const s = Store.settings();
    els.key.value = Api.getKey();
    els.system.value = s.system;
    els.temperature.value = s.temperature;
    els.topP.value = s.top_p;
    els.maxTokens.value = s.max_tokens;
    els.tools.value = s.tools;
  }

  function saveSettings() {
    Api.setKey(els.key.value.trim());
    Store.saveSettings({ system: els.system.value, temperature: els.temperature.value,
      top_p: els.topP.value, max_tokens: els.maxTokens.value, tools: els.tools.value });
  }

  function sampling() {
    const body = {};
    const num = (el, name, parse) => {
      const v = parse(el.value);
      if (el.value !== "" && !Number.isNaN(v)) body[name] = v;
    };
    num(els.temperature, "temperature", parseFloat);
    num(els.topP, "top_p", parseFloat);
    num(els.maxTokens, "max_tokens", (v) => parseInt(v, 10));
    const tools = els.tools.value.trim();
    if (tools) body.tools = JSON.parse(tools);  // a syntax error is shown to the user
    return body;
  }

  // -- rendering -----------------------------------------------------------------------
  function renderConversations() {
    const cur = Store.current();
    els.convs.replaceChildren(...Store.conversations().map((c) => {
      const li = document.createElement("li");
      li.className = c.id === cur.id ? "active" : "";
      li.dataset.id = c.id;
      const title = document.createElement("span");
      title.textContent = c.title;
      const del = document.createElement("button");
      del.type = "button";
      del.className = "delete";
      del.title = "Delete this chat";
      del.textContent = "×";
      li.append(title, del);
      return li;
    }));
  }

  function toolCallsHTML(calls) {
    return calls.map((c) => {
      const fn = c.function || {};
      let args = fn.arguments || "";
      try { args = JSON.stringify(JSON.parse(args), null, 2); } catch (_) { /* partial */ }
      return `<details class="tool-call" open><summary>Tool call <code>` +
        `${Markdown.escape(fn.name || "?")}</code></summary><pre><code>` +
        `${Markdown.escape(args)}</code></pre></details>`;
    }).join("");
  }

  function messageHTML(m) {
    if (m.role === "user") return `<div class="body">${Markdown.escape(m.content)}</div>`;
    let html = "";
    if (m.reasoning) {
      html += `<details class="reasoning"${m.content ? "" : " open"}><summary>Reasoning` +
        `</summary><div class="body">${Markdown.render(m.reasoning)}</div></details>`;
    }
    html += `<div class="body markdown">${Markdown.render(m.content || "")}</div>`;
    if (m.tool_calls && m.tool_calls.length) html += toolCallsHTML(m.tool_calls);
    const meta = [];
    if (m.usage) meta.push(`${m.usage.completion_tokens} tokens`);
    if (m.seconds && m.usage) {
      meta.push(`${(m.usage.completion_tokens / m.seconds).toFixed(1)} tokens/s`);
    }
    if (m.finish) meta.push(m.finish);
    html += `<div class="meta">${Markdown.escape(meta.join(" · "))}` +
      '<button type="button" class="copy" data-copy="msg">Copy</button></div>';
    return html;
  }

  function messageEl(m, i) {
    const div = document.createElement("div");
    div.className = `msg ${m.role} done`;  // the answer in flight takes "done" off
    div.dataset.index = i;
    div.innerHTML = messageHTML(m);
    return div;
  }

  function renderMessages() {
    const conv = Store.current();
    els.messages.replaceChildren(...conv.messages.map(messageEl));
    if (!conv.messages.length) {
      const hint = document.createElement("div");
      hint.className = "empty muted";
      hint.textContent = model ? `Chat with ${model}.` : "Chat with the served model.";
      els.messages.append(hint);
    }
    els.messages.scrollTop = els.messages.scrollHeight;
  }

  // -- sending -------------------------------------------------------------------------
  function history(conv) {
    const out = [];
    if (els.system.value.trim()) out.push({ role: "system", content: els.system.value });
    for (const m of conv.messages) {
      if (m.role === "user" || m.content) out.push({ role: m.role, content: m.content || "" });
    }
    return out;
  }

  function setBusy(busy) {
    els.send.disabled = busy;
    els.stop.hidden = !busy;
    document.body.classList.toggle("busy", busy);
  }

  function applyDelta(m, delta) {
    if (delta.reasoning_content) m.reasoning = (m.reasoning || "") + delta.reasoning_content;
    if (delta.content) m.content += delta.content;
    for (const tc of delta.tool_calls || []) {
      m.tool_calls = m.tool_calls || [];
      const call = m.tool_calls[tc.index] ||= { id: tc.id, type: "function",
        function: { name: "", arguments: "" } };
      if (tc.function && tc.function.name) call.function.name += tc.function.name;
      if (tc.function && tc.function.arguments) {
        call.function.arguments += tc.function.arguments;
      }
    }
  }

  async function send(text) {
    const conv = Store.current();
    let body;
    try {
      body = { ...sampling(), messages: null };
    } catch (e) {
      showError(`Tools: ${e.message}`);
      return;
    }
    showError("");
    conv.messages.push({ role: "user", content: text });
    if (conv.title === "New chat") conv.title = text.slice(0, 40);
    body.messages = history(conv);
    if (model) body.model = model;
    const m = { role: "assistant", content: "" };
    conv.messages.push(m);
    Store.save();
    renderConversations();
    renderMessages();
    const el = els.messages.lastElementChild;
    el.classList.remove("done");
    let pending = false;
    const paint = () => {  // at most once a frame, however fast the tokens come
      if (pending) return;
      pending = true;
      requestAnimationFrame(() => {
        pending = false;
        el.innerHTML = messageHTML(m);
        els.messages.scrollTop = els.messages.scrollHeight;
      });
    };
    controller = new AbortController();
    setBusy(true);
    const t0 = performance.now();
    try {
      await Api.streamChat(body, {
        signal: controller.signal,
        onDelta(delta, chunk) {
          applyDelta(m, delta);
          const finish = chunk.choices[0].finish_reason;
          if (finish) m.finish = finish;
          paint();
        },
        onUsage(usage) { m.usage = usage; },
      });
    } catch (e) {
      if (e.name === "AbortError") m.finish = "stopped";
      else showError(e.message);
    } finally {
      m.seconds = (performance.now() - t0) / 1000;
      controller = null;
      setBusy(false);
      Store.save();
      el.innerHTML = messageHTML(m);
      el.classList.add("done");
    }
  }

  // -- copying -------------------------------------------------------------------------
  async function copy(text, button) {
    try {
      await navigator.clipboard.writeText(text);
    } catch (_) {  // no clipboard API outside a secure context: the old way
      const ta = document.createElement("textarea");
      ta.value = text;
      document.body.append(ta);
      ta.select();
      document.execCommand("copy");
      ta.remove();
    }
    button.textContent = "Copied";
    setTimeout(() => { button.textContent = "Copy"; }, 1200);
  }

  function onMessagesClick(ev) {
    const button = ev.target.closest("button.copy");
    if (!button) return;
    if (button.dataset.copy === "code") {
      copy(button.parentElement.querySelector("pre").textContent, button);
    } else {
      const i = +button.closest(".msg").dataset.index;
      copy(Store.current().messages[i].content || "", button);
    }
  }

  // -- wiring --------------------------------------------------------------------------
  function wire() {
    document.getElementById("composer").addEventListener("submit", (ev) => {
      ev.preventDefault();
      const text = els.prompt.value.trim();
      if (!text || controller) return;
      els.prompt.value = "";
      send(text);
    });
    els.prompt.addEventListener("keydown", (ev) => {
      if (ev.key === "Enter" && !ev.shiftKey && !ev.isComposing) {
        ev.preventDefault();
        document.getElementById("composer").requestSubmit();
      }
    });
    els.stop.addEventListener("click", () => controller && controller.abort());
    $("new-chat").addEventListener("click", () => {
      Store.newConversation();
      renderConversations();
      renderMessages();
      els.prompt.focus();
    });
    els.convs.addEventListener("click", (ev) => {
      const li = ev.target.closest("li");
      if (!li || controller) return;
      if (ev.target.classList.contains("delete")) Store.remove(li.dataset.id);
      else Store.select(li.dataset.id);
      renderConversations();
      renderMessages();
    });
    els.messages.addEventListener("click", onMessagesClick);
    for (const el of [els.key, els.system, els.temperature, els.topP, els.maxTokens, els.tools]) {
      el.addEventListener("change", () => {
        saveSettings();
        if (el === els.key) loadModel();
      });
    }
  }

  async function loadModel() {
    try {
      const models = await Api.getJSON("/v1/models");
      model = models.data.length ? models.data[0].id : null;
      els.model.textContent = model || "";
      showError("");
    } catch (e) {
      showError(`Models: ${e.message}${e.message.startsWith("401") ? " (set the API key)" : ""}`);
    }
  }

  loadSettings();
  wire();
  renderConversations();
  renderMessages();
  loadModel().then(() => {
    if (!Store.current().messages.length) renderMessages();  // the hint names the model
  });
})();
