// A small Markdown renderer: fenced code, headings, lists, quotes, rules, tables and
// paragraphs; inline code, bold, italic, strikethrough and http(s) links. Text is escaped
// before any tag is made, so a model's output can never inject HTML.
"use strict";

const Markdown = (() => {
  function escape(s) {
    return s.replace(/&/g, "&amp;").replace(/</g, "&lt;").replace(/>/g, "&gt;")
      .replace(/"/g, "&quot;");
  }

  // inline spans of one escaped line; code spans are set aside first so that their
  // content is not formatted
  function inline(text) {
    const codes = [];
    let s = escape(text).replace(/`([^`]+)`/g, (_, c) => {
      codes.push(c);
      return `\u0000${codes.length - 1}\u0000`;
    });
    s = s.replace(/\[([^\]]+)\]\((https?:\/\/[^\s)]+)\)/g,
      '<a href="$2" target="_blank" rel="noopener noreferrer">$1</a>');
    s = s.replace(/\*\*([^*]+)\*\*/g, "<strong>$1</strong>")
      .replace(/__([^_]+)__/g, "<strong>$1</strong>")
      .replace(/(^|[^*])\*([^*\s][^*]*)\*/g, "$1<em>$2</em>")
      .replace(/(^|\W)_([^_\s][^_]*)_(?=\W|$)/g, "$1<em>$2</em>")
      .replace(/~~([^~]+)~~/g, "<del>$1</del>");
    return s.replace(/\u0000(\d+)\u0000/g, (_, i) => `<code>${codes[+i]}</code>`);
  }

  function codeBlock(lang, lines) {
    const cls = lang ? ` class="lang-${escape(lang)}"` : "";
    const label = lang ? `<span class="lang">${escape(lang)}</span>` : "";
    return `<div class="code">${label}<button type="button" class="copy" ` +
      `data-copy="code">Copy</button><pre><code${cls}>${escape(lines.join("\n"))}` +
      "</code></pre></div>";
  }

  function list(lines, i, ordered) {
    const re = ordered ? /^\s*\d+[.)]\s+(.*)$/ : /^\s*[-*+]\s+(.*)$/;
    const items = [];
    while (i < lines.length) {
      const m = lines[i].match(re);
      if (m) {
        items.push(m[1]);
      } else if (/^\s{2,}\S/.test(lines[i]) && items.length) {
        items[items.length - 1] += " " + lines[i].trim();  // a wrapped item
      } else {
        break;
      }
      i++;
    }
    const tag = ordered ? "ol" : "ul";
    return [`<${tag}>${items.map((t) => `<li>${inline(t)}</li>`).join("")}</${tag}>`, i];
  }

  function cells(line) {
    return line.trim().replace(/^\||\|$/g, "").split("|").map((c) => c.trim());
  }

  function table(lines, i) {
    const head = cells(lines[i]);
    const rows = [];
    i += 2;  // the header and its --- row
    while (i < lines.length && lines[i].includes("|") && lines[i].trim()) {
      rows.push(cells(lines[i++]));
    }
    const th = head.map((c) => `<th>${inline(c)}</th>`).join("");
    const tb = rows.map((r) => `<tr>${r.map((c) => `<td>${inline(c)}</td>`).join("")}</tr>`);
    return [`<table><thead><tr>${th}</tr></thead><tbody>${tb.join("")}</tbody></table>`, i];
  }

  function isBlockStart(line, next) {
    return /^(```|~~~|#{1,6}\s|>|\s*[-*+]\s|\s*\d+[.)]\s|(\*\s*){3,}$|(-\s*){3,}$)/.test(line)
      || (line.includes("|") && next !== undefined && /^\s*\|?\s*:?-{3,}/.test(next));
  }

  // one block starting at lines[i]: [html, next index]
  function block(lines, i) {
    const line = lines[i];
    const fence = line.match(/^(```|~~~)\s*([\w+#.-]*)/);
    if (fence) {
      const body = [];
      i++;
      while (i < lines.length && !lines[i].startsWith(fence[1])) body.push(lines[i++]);
      return [codeBlock(fence[2], body), i + 1];  // an open fence runs to the end
    }
    const h = line.match(/^(#{1,6})\s+(.*)$/);
    if (h) return [`<h${h[1].length}>${inline(h[2])}</h${h[1].length}>`, i + 1];
    if (/^((\*\s*){3,}|(-\s*){3,}|(_\s*){3,})$/.test(line.trim())) return ["<hr>", i + 1];
    if (/^\s*[-*+]\s+/.test(line)) return list(lines, i, false);
    if (/^\s*\d+[.)]\s+/.test(line)) return list(lines, i, true);
    if (line.includes("|") && /^\s*\|?\s*:?-{3,}/.test(lines[i + 1] || "")) {
      return table(lines, i);
    }
    if (line.startsWith(">")) {
      const quoted = [];
      while (i < lines.length && lines[i].startsWith(">")) {
        quoted.push(lines[i++].replace(/^>\s?/, ""));
      }
      return [`<blockquote>${render(quoted.join("\n"))}</blockquote>`, i];
    }
    const para = [];
    while (i < lines.length && lines[i].trim() && (!para.length
      || !isBlockStart(lines[i], lines[i + 1]))) {
      para.push(lines[i++]);
    }
    return [`<p>${para.map(inline).join("<br>")}</p>`, i];
  }

  function render(text) {
    const lines = text.replace(/\r\n?/g, "\n").split("\n");
    const out = [];
    let i = 0;
    while (i < lines.length) {
      if (!lines[i].trim()) {
        i++;
        continue;
      }
      const [html, next] = block(lines, i);
      out.push(html);
      i = next;
    }
    return out.join("\n");
  }

  return { render, escape };
})();
