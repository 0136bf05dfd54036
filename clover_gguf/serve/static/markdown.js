// A small Markdown renderer for the chat page: text in, DOM nodes out. Everything the model or the user wrote becomes
// text nodes (document.createTextNode / textContent); no string is ever parsed as HTML, so `<img onerror=...>` in an
// answer is shown as those characters. Covers what chat answers use: paragraphs (a single newline is a line break),
// headings, fenced code (an unclosed fence while streaming is code to the end), inline code, bold, italic,
// strikethrough, links and bare URLs (http, https and mailto only), lists (nested by indentation), block quotes,
// tables and rules.
"use strict";

(function (global) {
  const LIST = /^( *)([-*+]|\d{1,9}[.)])( +|$)/;
  const FENCE = /^ {0,3}(`{3,}|~{3,})[ \t]*([^`\s]*)/;
  const HEADING = /^ {0,3}(#{1,6})(?:[ \t]+(.*?))?(?:[ \t]+#+)?[ \t]*$/;
  const RULE = /^ {0,3}([-*_])(?:[ \t]*\1){2,}[ \t]*$/;
  const QUOTE = /^ {0,3}> ?/;
  const TABLE_SEP = /^ *\|? *:?-+:? *(\| *:?-+:? *)*\|? *$/;
  const SAFE_URL = /^(https?:\/\/|mailto:)/i;

  function el(tag, cls, text) {
    const n = document.createElement(tag);
    if (cls) n.className = cls;
    if (text !== undefined) n.textContent = text;
    return n;
  }

  const blank = (line) => /^\s*$/.test(line);
  const indentOf = (line) => line.length - line.replace(/^ +/, "").length;

  function startsBlock(line) {
    return FENCE.test(line) || HEADING.test(line) || RULE.test(line) || QUOTE.test(line) || LIST.test(line);
  }

  // ---- blocks ---------------------------------------------------------------------------------------------------
  function blocks(lines, out) {
    let i = 0;
    while (i < lines.length) {
      const line = lines[i];
      let m;
      if (blank(line)) {
        i++;
      } else if ((m = FENCE.exec(line))) {
        const mark = m[1];
        const close = new RegExp("^ {0,3}" + (mark[0] === "`" ? "`" : "~") + "{" + mark.length + ",}[ \\t]*$");
        const body = [];
        for (i++; i < lines.length && !close.test(lines[i]); i++) body.push(lines[i]);
        i++;
        out.appendChild(codeBlock(body.join("\n"), m[2]));
      } else if (RULE.test(line)) {
        out.appendChild(el("hr"));
        i++;
      } else if ((m = HEADING.exec(line))) {
        const h = el("h" + m[1].length);
        inline(m[2] || "", h);
        out.appendChild(h);
        i++;
      } else if (QUOTE.test(line)) {
        const body = [];
        for (; i < lines.length && !blank(lines[i]); i++) body.push(lines[i].replace(QUOTE, ""));
        const q = el("blockquote");
        blocks(body, q);
        out.appendChild(q);
      } else if (LIST.test(line)) {
        i = list(lines, i, out);
      } else if (line.includes("|") && i + 1 < lines.length && TABLE_SEP.test(lines[i + 1])
                 && lines[i + 1].includes("-")) {
        i = table(lines, i, out);
      } else {
        const body = [line];
        for (i++; i < lines.length && !blank(lines[i]) && !startsBlock(lines[i]); i++) body.push(lines[i]);
        const p = el("p");
        inline(body.join("\n"), p);
        out.appendChild(p);
      }
    }
  }

  function codeBlock(text, lang) {
    const box = el("div", "code");
    const head = el("div", "code-head");
    head.appendChild(el("span", "code-lang", lang || "text"));
    const copy = el("button", "code-copy", "Copy");
    copy.type = "button";
    copy.addEventListener("click", () => copyText(text, copy));
    head.appendChild(copy);
    const pre = el("pre");
    pre.appendChild(el("code", null, text));
    box.append(head, pre);
    return box;
  }

  function copyText(text, button) {
    const done = () => {
      button.textContent = "Copied";
      setTimeout(() => { button.textContent = "Copy"; }, 1200);
    };
    if (navigator.clipboard && global.isSecureContext) {
      navigator.clipboard.writeText(text).then(done, () => {});
      return;
    }
    const area = el("textarea");  // plain http on another host: the older way
    area.value = text;
    area.setAttribute("readonly", "");
    area.style.position = "fixed";
    area.style.opacity = "0";
    document.body.appendChild(area);
    area.select();
    try { if (document.execCommand("copy")) done(); } catch (e) { /* nothing to do */ }
    area.remove();
  }

  function list(lines, i, out) {
    const first = LIST.exec(lines[i]);
    const base = first[1].length;
    const ordered = /\d/.test(first[2]);
    const node = el(ordered ? "ol" : "ul");
    if (ordered && parseInt(first[2], 10) !== 1) node.start = parseInt(first[2], 10);
    while (i < lines.length) {
      const m = LIST.exec(lines[i]);
      if (!m || m[1].length !== base || /\d/.test(m[2]) !== ordered) break;
      const inner = m[0].length;
      const item = [lines[i].slice(inner)];
      for (i++; i < lines.length; i++) {
        const line = lines[i];
        if (blank(line)) {
          let j = i + 1;
          while (j < lines.length && blank(lines[j])) j++;
          if (j < lines.length && indentOf(lines[j]) > base && !(LIST.test(lines[j]) && indentOf(lines[j]) === base)) {
            item.push("");
            continue;
          }
          break;
        }
        const lead = indentOf(line);
        if (lead > base) item.push(line.slice(Math.min(lead, inner)));
        else if (startsBlock(line)) break;
        else item.push(line.trim());  // a lazy continuation of the item's paragraph
      }
      const li = el("li");
      blocks(item, li);
      node.appendChild(li);
      let j = i;
      while (j < lines.length && blank(lines[j])) j++;
      const next = j < lines.length ? LIST.exec(lines[j]) : null;
      if (!next || next[1].length !== base || /\d/.test(next[2]) !== ordered) break;
      i = j;
    }
    out.appendChild(node);
    return i;
  }

  function cells(line) {
    let s = line.trim();
    if (s.startsWith("|")) s = s.slice(1);
    if (s.endsWith("|") && !s.endsWith("\\|")) s = s.slice(0, -1);
    return s.split(/(?<!\\)\|/).map((c) => c.trim().replace(/\\\|/g, "|"));
  }

  function table(lines, i, out) {
    const head = cells(lines[i]);
    const align = cells(lines[i + 1]).map((c) => (c.startsWith(":") && c.endsWith(":") ? "center"
      : c.endsWith(":") ? "right" : null));
    const wrap = el("div", "table");
    const t = el("table");
    const tr = el("tr");
    head.forEach((c, k) => {
      const th = el("th");
      if (align[k]) th.style.textAlign = align[k];
      inline(c, th);
      tr.appendChild(th);
    });
    t.appendChild(el("thead")).appendChild(tr);
    const body = el("tbody");
    for (i += 2; i < lines.length && !blank(lines[i]) && lines[i].includes("|"); i++) {
      const row = el("tr");
      const cs = cells(lines[i]);
      head.forEach((_, k) => {
        const td = el("td");
        if (align[k]) td.style.textAlign = align[k];
        inline(cs[k] || "", td);
        row.appendChild(td);
      });
      body.appendChild(row);
    }
    t.appendChild(body);
    wrap.appendChild(t);
    out.appendChild(wrap);
    return i;
  }

  // ---- inline ---------------------------------------------------------------------------------------------------
  const EMPHASIS = [["**", "strong"], ["__", "strong"], ["~~", "del"], ["*", "em"], ["_", "em"]];

  // Each search below runs at most once per position of `text`: the next "]" and newline are kept as i moves on, a
  // link is parsed once per closing "]", and an emphasis mark's closers are listed once (Closers). A search from
  // every opener to the text's end made "*a " x 16,000 take seconds, 4x more at twice the length.
  const LINK = /^\]\(([^)\s]+)\)/;

  function inline(text, out) {
    let buf = "";
    const closers = new Closers(text);
    let bracket = -2, newline = -2;  // the next "]" / "\n" at or after i (-1: none; -2: not looked up yet)
    const links = new Map();  // a "]" -> its link's [url, length past the "]"], or null
    const flush = () => {
      if (!buf) return;
      const parts = buf.split("\n");
      parts.forEach((part, k) => {
        if (k) out.appendChild(el("br"));
        if (part) out.appendChild(document.createTextNode(part));
      });
      buf = "";
    };
    let i = 0;
    while (i < text.length) {
      const c = text[i];
      if (c === "\\" && i + 1 < text.length && /[!-\/:-@[-`{-~]/.test(text[i + 1])) {
        buf += text[i + 1];
        i += 2;
        continue;
      }
      if (c === "`") {
        const run = /^`+/.exec(text.slice(i))[0];
        const end = text.indexOf(run, i + run.length);
        if (end > 0 && text[end + run.length] !== "`") {
          flush();
          let code = text.slice(i + run.length, end).replace(/\n/g, " ");
          if (/^ .*[^ ].* $/.test(code)) code = code.slice(1, -1);
          out.appendChild(el("code", null, code));
          i = end + run.length;
          continue;
        }
        buf += run;
        i += run.length;
        continue;
      }
      if (c === "[") {  // [label](url): the label runs to the next "]", on one line
        if (bracket !== -1 && bracket < i) bracket = text.indexOf("]", i);
        if (newline !== -1 && newline < i) newline = text.indexOf("\n", i);
        if (bracket > i + 1 && (newline < 0 || newline > bracket)) {
          if (!links.has(bracket)) {
            const m = LINK.exec(text.slice(bracket, bracket + 2 + 8192));
            links.set(bracket, m && SAFE_URL.test(m[1]) ? [m[1], m[0].length] : null);
          }
          const link = links.get(bracket);
          if (link) {
            flush();
            out.appendChild(anchor(link[0], text.slice(i + 1, bracket)));
            i = bracket + link[1];
            continue;
          }
        }
      }
      if ((c === "h" || c === "m") && !/\w/.test(text[i - 1] || "")) {
        const url = /^(https?:\/\/[^\s<>"]+|mailto:[^\s<>"]+)/.exec(text.slice(i));
        if (url) {
          const href = url[1].replace(/[.,;:!?)\]'"]+$/, "");
          flush();
          out.appendChild(anchor(href, null));
          i += href.length;
          continue;
        }
      }
      const em = emphasis(text, i, closers);
      if (em) {
        flush();
        const node = el(em.tag);
        inline(em.inner, node);
        out.appendChild(node);
        i = em.end;
        continue;
      }
      buf += c;
      i++;
    }
    flush();
  }

  function emphasis(text, i, closers) {
    for (const [mark, tag] of EMPHASIS) {
      if (!text.startsWith(mark, i)) continue;
      const after = text[i + mark.length];
      if (!after || /\s/.test(after) || text.startsWith(mark, i + mark.length)) continue;
      if (mark[0] === "_" && /\w/.test(text[i - 1] || "")) continue;  // snake_case stays as written
      const end = closers.first(mark, i + mark.length + 1);
      if (end >= 0) return { tag, inner: text.slice(i + mark.length, end), end: end + mark.length };
    }
    return null;
  }

  // Where each emphasis mark may close in one text (listed on first use, one pass per mark): after a character that
  // is no whitespace, not doubled for a single mark, "_" not inside a word.
  class Closers {
    constructor(text) {
      this.text = text;
      this.at = new Map();
    }

    first(mark, from) {  // -> the first closer of `mark` at or after `from`, -1 for none
      let list = this.at.get(mark);
      if (!list) {
        list = [];
        const text = this.text;
        for (let end = text.indexOf(mark, 1); end >= 0; end = text.indexOf(mark, end + 1)) {
          const before = text[end - 1];
          const next = text[end + mark.length];
          if (!/\s/.test(before) && !(mark.length === 1 && next === mark)
              && !(mark[0] === "_" && /\w/.test(next || ""))) list.push(end);
        }
        this.at.set(mark, list);
      }
      let lo = 0, hi = list.length;  // binary search: the first >= from
      while (lo < hi) {
        const mid = (lo + hi) >> 1;
        if (list[mid] < from) lo = mid + 1; else hi = mid;
      }
      return lo < list.length ? list[lo] : -1;
    }
  }

  function anchor(href, label) {
    const a = el("a");
    a.href = href;
    a.rel = "noopener noreferrer";
    a.target = "_blank";
    if (label === null) a.textContent = href;
    else inline(label, a);
    return a;
  }

  // -> nothing; `root` holds the rendered text
  function render(text, root) {
    const frag = document.createDocumentFragment();
    blocks(String(text).replace(/\r\n?/g, "\n").split("\n"), frag);
    root.replaceChildren(frag);
  }

  global.CloverMarkdown = { render, copy: copyText };
})(window);
