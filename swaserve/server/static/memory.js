// The live memory view: GET /v1/memory about once a second, drawn as the pools as a whole
// (the planner's budget, rows, full-pool pages, window pages, state slots) and one card
// per running request (its row, ring fill per sliding group, pages, state, prefix hit).
"use strict";

const MemoryView = (() => {
  const POLL_MS = 1000;
  const esc = (v) => Markdown.escape(String(v));
  const pct = (n, d) => (d > 0 ? Math.min(100, (100 * n) / d) : 0);

  function bytes(n) {
    const units = ["B", "KiB", "MiB", "GiB", "TiB"];
    let i = 0;
    while (n >= 1024 && i < units.length - 1) {
      n /= 1024;
      i++;
    }
    return `${n.toFixed(i ? 1 : 0)} ${units[i]}`;
  }

  // a bar of stacked segments [[count, class, title]] out of `total`
  function bar(total, segments) {
    const parts = segments.map(([n, cls, title]) =>
      `<span class="seg ${cls}" style="width:${pct(n, total)}%" title="${esc(title)}"></span>`);
    return `<div class="bar">${parts.join("")}</div>`;
  }

  function row(label, value, barHTML = "") {
    return `<div class="stat"><span class="label">${esc(label)}</span>` +
      `<span class="value">${value}</span></div>${barHTML}`;
  }

  function rowsGrid(used, total, mine) {
    const cells = [];
    for (let r = 0; r < Math.min(total, 512); r++) {
      cells.push(`<i class="${mine.has(r) ? "mine" : ""}" title="row ${r}"></i>`);
    }
    return `<div class="rows-grid" title="${used} of ${total} rows in use">${cells.join("")}</div>`;
  }

  function poolHTML(v) {
    const p = v.pool;
    const plan = v.plan;
    let h = row("Budget", `${bytes(plan.allocated_bytes)} allocated / ${bytes(plan.budget_bytes)}`,
      bar(plan.budget_bytes, [[plan.allocated_bytes, "alloc", "allocated by the cache"]]));
    const ring = plan.ring ? `ring ${plan.ring} slots, ` : "";
    h += row("Rows", `<b id="mem-rows-used">${p.rows.used}</b> / ${p.rows.total}` +
      ` <span class="muted">(${ring}${bytes(plan.fixed_bytes_per_row)} each)</span>`, rowsGrid(p.rows.used, p.rows.total, new Set(v.requests.map((r) => r.row))));
    const f = p.full_pages;
    if (f) {
      const cachedOnly = Math.max(0, f.used - f.requests);
      h += row("Full pages", `<b id="mem-pages-used">${f.used}</b> used / ${f.total} ` +
        `<span class="muted">(${f.requests} requests, ${f.cached} cached, ${f.free} free; ` +
        `${plan.page_size} tokens each)</span>`,
        bar(f.total, [[f.requests, "req", "held by requests"],
          [cachedOnly, "cached", "held by the prefix cache only"]]));
    }
    const w = p.window_pages;
    if (w) {
      h += row("Window pages", `${w.used} / ${w.total} <span class="muted">(prefix cache's ` +
        "sliding KV)</span>", bar(w.total, [[w.used, "cached", "used"]]));
    }
    const s = p.state_slots;
    if (s) {
      h += row("State slots", `${s.rows_used} / ${s.rows_total} rows, ` +
        `${s.checkpoints_used} / ${s.checkpoints_total} checkpoints`,
        bar(s.checkpoints_total, [[s.checkpoints_used, "cached", "checkpoints"]]));
    }
    const pc = v.prefix_cache;
    if (pc) {
      const rate = pc.query_tokens ? ` (${pct(pc.hit_tokens, pc.query_tokens).toFixed(0)}% hit)` : "";
      h += row("Prefix cache", `${pc.nodes} nodes, ${pc.hit_tokens} / ${pc.query_tokens} ` +
        `tokens hit${rate}`);
    }
    const parts = Object.entries(p.bytes).map(([k, b]) =>
      `<tr><td>${esc(k)}</td><td>${bytes(b.used)}</td><td>${bytes(b.free)}</td></tr>`);
    h += `<table class="bytes"><thead><tr><th>part</th><th>used</th><th>free</th></tr></thead>` +
      `<tbody>${parts.join("")}</tbody></table>`;
    h += `<div class="muted small">${v.num_waiting} waiting · ${esc(v.model)}</div>`;
    return h;
  }

  function ringHTML(r, groups) {
    if (!r.ring) return "";
    const live = groups.map((g, i) => `W ${g.window} × ${g.layers.length} layers: ` +
      `${r.ring.live[i]} live`).join("; ");
    return row("Ring", `<b class="ring-filled">${r.ring.filled}</b> / ${r.ring.slots} slots ` +
      `<span class="muted">${esc(live)}</span>`,
      bar(r.ring.slots, [[r.ring.filled, "ring", "slots holding a position"]]));
  }

  function requestHTML(r, v) {
    let h = `<div class="req-head"><code>${esc(r.id.slice(0, 22))}</code>` +
      `<span class="badge ${r.phase}">${r.phase}</span><span class="muted">row ${r.row}</span></div>`;
    h += row("Tokens", `<b class="computed">${r.computed_tokens}</b> / ${r.max_tokens} ` +
      `<span class="muted">(prompt ${r.prompt_tokens}, output ${r.output_tokens})</span>`,
      bar(r.max_tokens, [[r.cached_tokens, "cached", "from the prefix cache"],
        [r.computed_tokens - r.cached_tokens, "req", "computed"]]));
    if (v.pool.full_pages) {
      h += row("Full pages", `${r.full_pages} <span class="muted">(${r.full_pages * v.plan.page_size}` +
        " token slots)</span>");
    }
    h += ringHTML(r, v.layout.sliding);
    if (r.state) {
      const cks = r.state.checkpoints.length ? r.state.checkpoints.join(", ") : "none";
      h += row("State", `slot ${r.state.slot}, ${r.state.consumed} tokens in; checkpoints at ` +
        esc(cks));
    }
    for (const c of r.compress || []) {
      h += row(`Compress L${c.layer}`, `${c.filled} / ${c.span} raw (1 per ${c.rate})`);
    }
    if (r.cached_tokens || r.prefix_node_tokens || r.window_pages) {
      h += row("Prefix cache", `${r.cached_tokens} tokens hit; ${r.prefix_node_tokens} ` +
        `locked; ${r.window_pages} window pages`);
    }
    return `<div class="req" data-id="${esc(r.id)}">${h}</div>`;
  }

  let timer = null;
  const status = () => document.getElementById("mem-status");

  async function refresh() {
    try {
      const v = await Api.getJSON("/v1/memory");
      document.getElementById("mem-pool").innerHTML = poolHTML(v);
      document.getElementById("mem-requests").innerHTML = v.requests.length
        ? v.requests.map((r) => requestHTML(r, v)).join("")
        : '<div class="muted small">none running</div>';
      document.getElementById("mem-count").textContent = v.requests.length;
      status().textContent = new Date().toLocaleTimeString();
      status().classList.remove("error");
    } catch (e) {
      status().textContent = e.message;
      status().classList.add("error");
    }
  }

  function start() {
    if (timer) return;
    const tick = async () => {
      await refresh();
      timer = setTimeout(tick, POLL_MS);  // after the answer: polls never pile up
    };
    tick();
  }

  return { start, refresh };
})();

MemoryView.start();
