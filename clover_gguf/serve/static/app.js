// clover-gguf's chat page: talks to this server's OpenAI API (/v1/models, /v1/chat/completions streamed, with
// clover_blocks for the block view). Conversations and settings are kept in localStorage, the API key (when the
// server has one) in sessionStorage, for this tab. Everything the model or the user wrote goes into the DOM as text:
// CloverMarkdown builds nodes, and no string here is ever parsed as HTML.
"use strict";

(function () {
  const STORE = "clover-gguf.chats";
  const CURRENT = "clover-gguf.current";
  const SETTINGS = "clover-gguf.settings";
  const KEY = "clover-gguf.api-key";
  const MODES = ["auto", "ar", "draft-self", "diffusion"];
  const DEFAULTS = { mode: null, temperature: 0, top_p: 1, top_k: 0, max_tokens: null, threshold: null,
                     block_size: null, think: true, blocks: true, system: "" };
  const REPLAY_MS = 420;  // a block pass on screen during a replay

  const $ = (id) => document.getElementById(id);
  const ui = {
    app: $("app"), sidebar: $("sidebar"), scrim: $("scrim"), chats: $("chats"), newChat: $("new-chat"),
    menu: $("menu"), model: $("model-name"), dot: $("status-dot"), mode: $("mode"),
    settingsBtn: $("settings-btn"), settings: $("settings"), scroll: $("scroll"), messages: $("messages"),
    empty: $("empty"), emptyTitle: $("empty-title"), notice: $("notice"), composer: $("composer"),
    prompt: $("prompt"), send: $("send"), stop: $("stop"), keyDialog: $("key-dialog"), keyForm: $("key-form"),
    keyInput: $("api-key"), keyError: $("key-error"),
  };

  function el(tag, cls, text) {
    const n = document.createElement(tag);
    if (cls) n.className = cls;
    if (text !== undefined && text !== null) n.textContent = text;
    return n;
  }

  // ---- storage -------------------------------------------------------------------------------------------------
  function load(key, fallback) {
    try {
      const v = JSON.parse(localStorage.getItem(key));
      return v === null || v === undefined ? fallback : v;
    } catch (e) {
      return fallback;
    }
  }

  function save(key, value) {
    try {
      localStorage.setItem(key, JSON.stringify(value));
      return true;
    } catch (e) {  // full: drop the block views of the oldest conversations, then try once more
      if (key !== STORE) return false;
      for (const chat of [...value].sort((a, b) => a.updated - b.updated)) {
        for (const m of chat.messages) delete m.blocks;
        try {
          localStorage.setItem(key, JSON.stringify(value));
          return true;
        } catch (e2) { /* keep dropping */ }
      }
      return false;
    }
  }

  const settings = Object.assign({}, DEFAULTS, load(SETTINGS, {}));
  let chats = load(STORE, []).filter((c) => c && Array.isArray(c.messages));
  let current = null;  // the open conversation
  let apiKey = sessionStorage.getItem(KEY) || "";
  let server = { name: "clover-gguf", defaultMode: "auto", blockMode: true };
  let streaming = null;  // {controller, message, view}

  const newId = () => Date.now().toString(36) + Math.random().toString(36).slice(2, 8);
  const saveChats = () => save(STORE, chats);

  // ---- API -----------------------------------------------------------------------------------------------------
  let keyWaiters = null;

  function askKey(error) {
    if (!keyWaiters) {
      keyWaiters = [];
      ui.keyError.hidden = !error;
      ui.keyError.textContent = error || "";
      ui.keyInput.value = "";
      if (!ui.keyDialog.open) ui.keyDialog.showModal();
      ui.keyInput.focus();
    }
    return new Promise((resolve) => keyWaiters.push(resolve));
  }

  ui.keyForm.addEventListener("submit", (e) => {
    e.preventDefault();
    const key = ui.keyInput.value.trim();
    if (!key) return;
    apiKey = key;
    sessionStorage.setItem(KEY, key);
    ui.keyDialog.close();
    const waiters = keyWaiters || [];
    keyWaiters = null;
    waiters.forEach((w) => w(key));
  });
  ui.keyDialog.addEventListener("cancel", (e) => e.preventDefault());  // the API cannot be used without it

  // fetch with the key; a 401 asks for the key (again) and retries
  async function api(path, init) {
    for (let refused = false; ; refused = true) {
      const headers = new Headers((init && init.headers) || {});
      if (apiKey) headers.set("Authorization", "Bearer " + apiKey);
      const res = await fetch(path, Object.assign({}, init, { headers }));
      if (res.status !== 401) return res;
      sessionStorage.removeItem(KEY);
      await askKey(apiKey || refused ? "The server did not accept that key." : null);
    }
  }

  async function errorText(res) {
    try {
      const body = await res.json();
      if (body && body.error && body.error.message) return body.error.message;
    } catch (e) { /* not JSON */ }
    return "HTTP " + res.status;
  }

  async function* events(res) {
    const reader = res.body.getReader();
    const decoder = new TextDecoder();
    let buf = "";
    for (;;) {
      const { value, done } = await reader.read();
      if (done) return;
      buf += decoder.decode(value, { stream: true });
      let cut;
      while ((cut = buf.indexOf("\n\n")) >= 0) {
        const raw = buf.slice(0, cut);
        buf = buf.slice(cut + 2);
        const data = raw.split("\n").filter((l) => l.startsWith("data:")).map((l) => l.slice(5).trim()).join("\n");
        if (!data) continue;
        if (data === "[DONE]") return;
        yield JSON.parse(data);
      }
    }
  }

  async function connect() {
    try {
      const res = await api("/v1/models");
      if (!res.ok) throw new Error(await errorText(res));
      const model = (await res.json()).data[0];
      const meta = model.meta || {};
      server = { name: model.id, defaultMode: meta.default_mode || "auto", blockMode: meta.block_mode !== false };
      ui.model.textContent = model.id;
      ui.dot.className = "dot ok";
      document.title = model.id + " · clover-gguf";
      for (const opt of ui.mode.options) opt.disabled = !server.blockMode && !["ar", "auto"].includes(opt.value);
      if (!settings.mode || !MODES.includes(settings.mode)) ui.mode.value = server.defaultMode;
      hideNotice();
    } catch (e) {
      ui.dot.className = "dot bad";
      showNotice("The server is not answering (" + e.message + "). ", "Retry", connect);
    }
  }

  function showNotice(text, action, onAction) {
    ui.notice.replaceChildren(document.createTextNode(text));
    if (action) {
      const b = el("button", "text-btn", action);
      b.type = "button";
      b.addEventListener("click", onAction);
      ui.notice.appendChild(b);
    }
    ui.notice.hidden = false;
  }

  function hideNotice() {
    ui.notice.hidden = true;
  }

  // ---- conversations -------------------------------------------------------------------------------------------
  function openChat(chat) {
    if (streaming) stop();
    current = chat;
    localStorage.setItem(CURRENT, chat ? chat.id : "");
    renderMessages();
    renderChats();
    closeSidebar();
  }

  function newChat() {
    openChat(null);
    ui.prompt.focus();
  }

  function deleteChat(chat) {
    chats = chats.filter((c) => c !== chat);
    saveChats();
    if (current === chat) openChat(null);
    else renderChats();
  }

  function renderChats() {
    const items = [...chats].sort((a, b) => b.updated - a.updated).map((chat) => {
      const row = el("div", "chat-row" + (chat === current ? " active" : ""));
      const open = el("button", "chat-open", chat.title || "New chat");
      open.type = "button";
      open.title = chat.title || "";
      open.addEventListener("click", () => openChat(chat));
      const del = el("button", "chat-del");
      del.type = "button";
      del.setAttribute("aria-label", "Delete conversation");
      del.textContent = "×";
      del.addEventListener("click", () => deleteChat(chat));
      row.append(open, del);
      return row;
    });
    ui.chats.replaceChildren(...items);
    if (!items.length) ui.chats.appendChild(el("p", "chats-none", "No conversations yet."));
  }

  function toggleSidebar(open) {
    ui.app.classList.toggle("side-open", open);
    ui.scrim.hidden = !open;
  }
  const closeSidebar = () => toggleSidebar(false);

  // ---- messages ------------------------------------------------------------------------------------------------
  function renderMessages() {
    ui.messages.replaceChildren();
    const msgs = current ? current.messages : [];
    msgs.forEach((m) => ui.messages.appendChild(m.role === "user" ? userNode(m) : assistantNode(m).node));
    ui.empty.hidden = msgs.length > 0;
    markLatest();
    ui.scroll.scrollTop = ui.scroll.scrollHeight;
  }

  function userNode(m) {
    const wrap = el("div", "msg user");
    const bubble = el("div", "bubble");
    bubble.setAttribute("data-role", "user");
    bubble.textContent = m.content;
    wrap.appendChild(bubble);
    return wrap;
  }

  // the stable test hooks live on the latest assistant message only
  function markLatest() {
    const hooks = ["answer", "thinking", "stats", "block-view"];
    ui.messages.querySelectorAll("[data-testid]").forEach((n) => {
      if (hooks.includes(n.getAttribute("data-testid"))) n.removeAttribute("data-testid");
    });
    const all = ui.messages.querySelectorAll(".msg.assistant");
    const last = all[all.length - 1];
    if (!last) return;
    for (const hook of hooks) {
      const n = last.querySelector("[data-hook=" + hook + "]");
      if (n) n.setAttribute("data-testid", hook);
    }
  }

  // an assistant message's nodes, and an update() that redraws them from the message
  function assistantNode(m) {
    const node = el("div", "msg assistant");
    const thinking = el("details", "thinking");
    thinking.setAttribute("data-hook", "thinking");
    const summary = el("summary");
    const label = el("span", "thinking-label");
    const preview = el("span", "thinking-preview");
    summary.append(label, preview);
    const thinkingText = el("div", "thinking-text");
    thinking.append(summary, thinkingText);
    const answer = el("div", "answer md");
    answer.setAttribute("data-hook", "answer");
    const view = new BlockView(m);
    const stats = el("div", "stats");
    stats.setAttribute("data-hook", "stats");
    node.append(thinking, answer, view.node, stats);

    let shownThinking = null;
    let shownContent = null;
    function update() {
      const live = streaming && streaming.message === m;
      thinking.hidden = !m.thinking;
      if (m.thinking !== shownThinking) {
        thinkingText.textContent = m.thinking || "";
        shownThinking = m.thinking;
      }
      const thinkingNow = live && m.thinking && !m.content;
      node.classList.toggle("is-thinking", !!thinkingNow);
      label.textContent = thinkingNow ? "Thinking" : m.thinkSeconds >= 0.95 ? "Thought for " + seconds(m.thinkSeconds)
        : "Thoughts · " + words(m.thinking) + (words(m.thinking) === 1 ? " word" : " words");
      preview.textContent = thinkingNow ? lastLine(m.thinking) : "";
      if (m.content !== shownContent) {
        CloverMarkdown.render(m.content || "", answer);
        shownContent = m.content;
      }
      node.classList.toggle("is-waiting", !!(live && !m.content && !m.thinking));
      stats.replaceChildren();
      if (m.error) {
        stats.className = "stats error";
        stats.textContent = m.error;
      } else if (!live && (m.stats || m.stopped)) {
        stats.className = "stats";
        statsLine(m, stats);
      } else {
        stats.className = "stats pending";
      }
      // the stats hook exists once the answer is over
      stats.setAttribute("data-hook", live ? "stats-pending" : "stats");
      view.update(live);
    }
    update();
    return { node, update, view };
  }

  function words(text) {
    return (text || "").split(/\s+/).filter(Boolean).length;
  }

  function lastLine(text) {
    const lines = (text || "").trim().split("\n");
    return lines[lines.length - 1].slice(-120);
  }

  function seconds(s) {
    return s < 10 ? s.toFixed(1) + " s" : Math.round(s) + " s";
  }

  function fmt(x, digits) {
    return x === null || x === undefined ? "?" : Number(x).toFixed(digits);
  }

  function statsLine(m, out) {
    const st = m.stats;
    const parts = [];
    let why = null;  // auto's reason for writing no block, on a line of its own
    const add = (text, title, cls) => {
      const s = el("span", cls || null, text);
      if (title) s.title = title;
      parts.push(s);
    };
    if (!st) {
      add("stopped", "the answer was stopped before the server sent its stats", "stopped");
    } else {
      add(st.mode, "decoding mode", "mode");
      if (m.stopped) add("stopped", null, "stopped");
      add(st.generated_tokens + " tokens");
      const rate = st.decode_tokens_per_s || st.tokens_per_s;
      add(fmt(rate, 1) + " tok/s", "generated tokens per second after the prompt (" + fmt(st.tokens_per_s, 1)
          + " with the prompt's pass)");
      add(fmt(st.tokens_per_pass, 2) + " tokens/pass", st.forward_passes + " forward passes, the prompt's included");
      if (st.mode === "auto") {
        let chose = st.ar_steps + " AR steps, " + st.drafts + (st.drafts === 1 ? " draft" : " drafts");
        if (st.accepted_per_draft !== null && st.accepted_per_draft !== undefined) {
          chose += " (" + fmt(st.accepted_per_draft, 1) + " accepted each)";
        }
        add(chose, "what auto chose, block by block");
        if (!st.drafts) why = autoWhy(st);
      } else if (st.acceptance_rate !== null && st.acceptance_rate !== undefined) {
        add(Math.round(st.acceptance_rate * 100) + "% accepted",
            st.accepted_tokens + " of " + st.drafted_tokens + " block tokens agreed with the causal pass");
      }
      if (st.finish_reason === "length") add("cut at the token limit");
      add(seconds(st.seconds || 0), "time to first token " + fmt(st.time_to_first_token_s, 2) + " s");
    }
    parts.forEach((p) => out.appendChild(p));
    if (m.content) {
      const copy = el("button", "text-btn copy-answer", "Copy");
      copy.type = "button";
      copy.title = "Copy the answer (Markdown)";
      copy.addEventListener("click", () => CloverMarkdown.copy(m.content, copy));
      out.appendChild(copy);
    }
    if (why) out.appendChild(why);
  }

  // Why auto wrote no block (a CPU: a block pass costs more than the tokens its drafts would yield) and how to see
  // blocks anyway: one line under the stats, from the pass costs the server measured (clover_stats)
  function autoWhy(st) {
    const line = el("div", "auto-why");
    const cost = st.block_pass_ar_steps;
    line.textContent = "auto decoded AR" + (cost === null || cost === undefined ? ""
      : ": a block pass costs " + fmt(cost, 1) + " AR steps on this machine (measured), more than its drafts "
        + "would save") + ". Pick draft-self or diffusion in the mode menu to see the blocks.";
    return line;
  }

  // ---- the block view ------------------------------------------------------------------------------------------
  // m.blocks: one record per block or AR run, built from the stream's clover_blocks events:
  //   {k: "diffusion"|"draft", n: size, s: answer tokens before it, p: [the pass that filled each position; 0 known
  //    before any pass; -1 masked], t: [its text], e: [end-token positions], r: passes, a/d/c/x: accepted, drafted,
  //    cut, ended (drafts), nx: the causal token at the cut, g: agreed (diffusion's commit)}  or  {k: "ar", steps}
  class BlockView {
    constructor(m) {
      this.m = m;
      this.sel = null;  // the record shown (null: the latest block)
      this.at = null;  // the pass shown of it (null: its last)
      this.drawn = 0;  // block passes drawn for this answer
      this.timer = null;
      this.node = el("div", "blockview");
      this.node.setAttribute("data-hook", "block-view");
      this.head = el("div", "bv-head");
      this.title = el("span", "bv-title");
      this.detail = el("span", "bv-detail");
      this.replayBtn = el("button", "text-btn bv-replay", "Replay");
      this.replayBtn.type = "button";
      this.replayBtn.addEventListener("click", () => this.replay());
      const legend = el("span", "bv-legend");
      for (const [cls, name] of [["new", "this pass"], ["filled", "earlier"], ["masked", "masked"]]) {
        const key = el("span", "bv-key");
        key.append(el("i", "slot " + cls), document.createTextNode(name));
        legend.appendChild(key);
      }
      this.head.append(this.title, this.detail, legend);
      this.grid = el("div", "bv-grid");
      this.strip = el("div", "bv-strip");
      this.foot = el("div", "bv-foot");
      this.summary = el("span", "bv-summary");
      this.foot.append(this.strip, this.summary, this.replayBtn);
      this.node.append(this.head, this.grid, this.foot);
    }

    static apply(m, ev) {
      const bl = m.blocks || (m.blocks = []);
      const cur = bl[bl.length - 1];
      if (ev.type === "block") {
        const n = ev.size;
        const rec = { k: ev.kind, n, s: ev.start, p: new Array(n).fill(-1), t: new Array(n).fill(""), e: [], r: 0 };
        (ev.known || []).forEach((i, j) => { rec.p[i] = 0; rec.t[i] = (ev.texts || [])[j] || ""; });
        rec.e = (ev.ends || []).slice();
        bl.push(rec);
      } else if (ev.type === "pass" && cur && cur.k !== "ar") {
        cur.r += 1;
        ev.filled.forEach((i, j) => { cur.p[i] = cur.r; cur.t[i] = (ev.texts || [])[j] || ""; });
        for (const i of ev.ends || []) if (!cur.e.includes(i)) cur.e.push(i);
        return 1;
      } else if (ev.type === "forced" && cur && cur.k !== "ar") {  // placed by the grammar, no pass of their own
        ev.filled.forEach((i, j) => { cur.p[i] = cur.r; cur.t[i] = (ev.texts || [])[j] || ""; });
      } else if (ev.type === "verify" && cur) {
        Object.assign(cur, { a: ev.accepted, d: ev.drafted, c: ev.cut, x: ev.ended, nx: ev.next_text });
      } else if (ev.type === "commit" && cur) {
        cur.g = ev.agreed;
      } else if (ev.type === "ar") {
        bl.push({ k: "ar", steps: ev.steps });
      }
      return 0;
    }

    passes() {
      return (this.m.blocks || []).reduce((n, b) => n + (b.r || 0), 0);
    }

    update(live) {
      const blocks = this.m.blocks || [];
      this.live = live;
      this.node.hidden = !blocks.length;
      const picked = !live && this.sel !== null;
      this.node.classList.toggle("live", !!live);
      this.node.classList.toggle("done", !live && !picked);
      this.replayBtn.hidden = !!live || !blocks.some((b) => b.k !== "ar");
      this.drawStrip(blocks);
      if (!live && this.sel === null) {
        this.drawSummary(blocks);
      } else {
        const idx = this.sel !== null ? this.sel : lastBlock(blocks);
        this.drawBlock(blocks, idx, this.sel !== null ? this.at : null);
      }
      this.drawn = this.passes();
      this.node.setAttribute("data-passes", String(this.drawn));
    }

    drawStrip(blocks) {
      const chips = this.strip.children;
      blocks.forEach((b, k) => {
        let chip = chips[k];
        if (!chip) {
          chip = el("button", "chip");
          chip.type = "button";
          chip.addEventListener("click", () => this.select(k));
          this.strip.appendChild(chip);
        }
        chip.className = "chip " + (b.k === "ar" ? "ar" : b.k) + (k === this.sel ? " sel" : "");
        chip.disabled = b.k === "ar";
        if (b.k === "ar") {
          chip.textContent = "AR " + b.steps;
          chip.title = b.steps + " AR steps: one token per pass";
        } else {
          chip.textContent = String(b.r);
          const used = usedOf(b);
          let title = "block " + (k + 1) + ": " + b.k + ", " + b.r + (b.r === 1 ? " pass" : " passes");
          if (b.k === "draft" && b.d !== undefined) {
            title += ", " + b.a + " of " + b.d + " drafted tokens accepted";
            chip.style.setProperty("--ok", String(b.d ? b.a / b.d : 1));
          } else {
            title += ", " + used + " tokens";
            chip.style.setProperty("--ok", "1");
          }
          chip.title = title;
        }
      });
      while (chips.length > blocks.length) chips[chips.length - 1].remove();
    }

    // after the answer: what the blocks did, in one line, above their strip
    drawSummary(blocks) {
      const bl = blocks.filter((b) => b.k !== "ar");
      const passes = bl.reduce((n, b) => n + b.r, 0);
      const ar = blocks.reduce((n, b) => n + (b.steps || 0), 0);
      const drafts = bl.filter((b) => b.d !== undefined);
      const parts = [];
      if (bl.length) {
        parts.push(bl.length + (bl.length === 1 ? " block" : " blocks") + " in " + passes
                   + (passes === 1 ? " pass" : " passes"));
      }
      if (drafts.length) {
        const a = drafts.reduce((n, b) => n + b.a, 0);
        const d = drafts.reduce((n, b) => n + b.d, 0);
        parts.push(a + " of " + d + " drafted tokens accepted");
      }
      if (ar) parts.push(ar + " AR " + (ar === 1 ? "step" : "steps"));
      this.summary.textContent = parts.join(" · ");
      this.grid.hidden = true;
    }

    drawBlock(blocks, idx, at) {
      const b = idx === null ? null : blocks[idx];
      if (!b) {
        const ar = blocks.length ? blocks.reduce((n, r) => n + (r.steps || 0), 0) : 0;
        this.title.textContent = "AR";
        this.detail.textContent = ar + " steps, one token per pass: no block to fill";
        this.grid.hidden = true;
        return;
      }
      this.grid.hidden = false;
      const k = at === null ? b.r : at;  // the pass shown
      const final = k === b.r && (b.c !== undefined || b.g !== undefined || !this.live);
      const end = b.e.length ? Math.min(...b.e) : null;
      const number = blocks.slice(0, idx + 1).filter((r) => r.k !== "ar").length;
      this.title.textContent = "Block " + number + " · " + b.k;
      let detail = k === 0 ? "before its first pass" : "pass " + k + (!this.live && b.r > 1 ? " of " + b.r : "");
      if (final && b.c !== undefined) {
        detail += " · " + b.a + " of " + b.d + " accepted";
        if (!b.x && b.nx !== undefined && b.nx !== null) {
          detail += ", then “" + shown(b.nx) + "” from the causal pass";
        }
      } else if (final && b.g !== undefined) {
        detail += " · the causal pass agreed on " + b.g + " of " + (b.n - 1);
      }
      this.detail.textContent = detail;
      const slots = this.grid.children;
      for (let i = 0; i < b.n; i++) {
        let s = slots[i];
        if (!s) {
          s = el("span", "slot");
          this.grid.appendChild(s);
        }
        const p = b.p[i];
        let cls = "slot";
        let text = "";
        if (p < 0 || p > k) {
          cls += " masked";
        } else {
          text = shown(b.t[i]);
          cls += p === 0 ? " known" : p === k && !final ? " new" : " filled";
          if (b.e.includes(i)) cls += " end";
          if ((end !== null && i > end) || (final && b.d !== undefined && i > b.d)) cls += " unused";
          else if (final && b.c !== undefined && i > 0) cls += i < b.c ? " accepted" : " rejected";
        }
        if (s.className !== cls) s.className = cls;
        if (s.textContent !== text) s.textContent = text;
        s.title = p < 0 || p > k ? "position " + i + ": masked" : "position " + i + ": " + JSON.stringify(b.t[i])
          + (p ? ", pass " + p : ", known before the passes");
        s.setAttribute("data-pass", p > 1 && p <= k ? String(p) : "");  // the first pass's, the bulk, unlabelled
      }
      while (slots.length > b.n) slots[slots.length - 1].remove();
    }

    select(k) {
      this.stopReplay();
      this.sel = this.sel === k ? null : k;
      this.at = null;
      this.update(this.live);
    }

    replay() {
      if (this.timer) {
        this.stopReplay();
        this.update(this.live);
        return;
      }
      const blocks = this.m.blocks || [];
      const frames = [];
      blocks.forEach((b, k) => {
        if (b.k === "ar") return;
        for (let p = b.p.includes(0) ? 0 : 1; p <= b.r; p++) frames.push([k, p]);
      });
      let f = 0;
      this.replayBtn.textContent = "Stop replay";
      const step = () => {
        if (f >= frames.length) {
          this.stopReplay();
          this.update(this.live);
          return;
        }
        [this.sel, this.at] = frames[f++];
        this.update(this.live);
        this.timer = setTimeout(step, REPLAY_MS);
      };
      step();
    }

    stopReplay() {
      clearTimeout(this.timer);
      this.timer = null;
      this.sel = null;
      this.at = null;
      this.replayBtn.textContent = "Replay";
    }
  }

  function lastBlock(blocks) {
    for (let k = blocks.length - 1; k >= 0; k--) if (blocks[k].k !== "ar") return k;
    return null;
  }

  function usedOf(b) {
    const end = b.e.length ? Math.min(...b.e) : null;
    if (b.c !== undefined) return b.x ? b.c - 1 : b.c;
    return end !== null ? end : b.n;
  }

  // a token as a slot shows it: line breaks and tabs visible, special tokens short
  function shown(text) {
    if (text === "<|im_end|>" || text === "<|endoftext|>") return "end";
    text = String(text);
    if (/^ +$/.test(text)) return "␣".repeat(text.length);
    return text.replace(/\n/g, "↵").replace(/\t/g, "⇥");
  }

  // ---- sending -------------------------------------------------------------------------------------------------
  function requestBody(history) {
    const body = { model: server.name, stream: true, mode: ui.mode.value };
    const messages = [];
    if (settings.system && settings.system.trim()) messages.push({ role: "system", content: settings.system });
    for (const m of history) {
      if (m.role === "user") messages.push({ role: "user", content: m.content });
      else if (m.content && !m.error) messages.push({ role: "assistant", content: m.content });
    }
    body.messages = messages;
    if (settings.temperature > 0) body.temperature = settings.temperature;
    if (settings.top_p > 0 && settings.top_p < 1) body.top_p = settings.top_p;
    if (settings.top_k > 0) body.top_k = settings.top_k;
    if (settings.max_tokens) body.max_tokens = settings.max_tokens;
    if (settings.threshold !== null && settings.threshold !== "") body.threshold = settings.threshold;
    if (settings.block_size) body.block_size = settings.block_size;
    if (!settings.think) body.think = false;
    if (settings.blocks) body.clover_blocks = true;
    return body;
  }

  async function send() {
    const text = ui.prompt.value;
    if (!text.trim() || streaming) return;
    if (!current) {
      current = { id: newId(), title: text.trim().replace(/\s+/g, " ").slice(0, 60), created: Date.now(),
                  updated: Date.now(), messages: [] };
      chats.push(current);
      localStorage.setItem(CURRENT, current.id);
    }
    const chat = current;
    chat.messages.push({ role: "user", content: text });
    const m = { role: "assistant", content: "", thinking: "", mode: ui.mode.value };
    chat.messages.push(m);
    chat.updated = Date.now();
    ui.prompt.value = "";
    autosize();
    saveChats();
    renderChats();
    ui.empty.hidden = true;
    ui.messages.appendChild(userNode(chat.messages[chat.messages.length - 2]));
    const view = assistantNode(m);
    ui.messages.appendChild(view.node);
    const controller = new AbortController();
    streaming = { controller, message: m, view, chat };
    view.update();
    markLatest();
    setBusy(true);
    stickToBottom(true);
    const body = requestBody(chat.messages.slice(0, -1));
    const started = performance.now();
    let thinkStart = null;
    let frame = 0;
    const redraw = () => {
      if (frame) return;
      frame = requestAnimationFrame(() => {
        frame = 0;
        const follow = nearBottom();
        view.update();
        if (follow) stickToBottom();
      });
    };
    try {
      const res = await api("/v1/chat/completions", {
        method: "POST", headers: { "Content-Type": "application/json" }, body: JSON.stringify(body),
        signal: controller.signal,
      });
      if (!res.ok) throw new Error(await errorText(res));
      for await (const chunk of events(res)) {
        if (chunk.error) throw new Error(chunk.error.message || "the server failed");
        for (const ev of chunk.clover_blocks || []) BlockView.apply(m, ev);
        const choice = chunk.choices && chunk.choices[0];
        const delta = (choice && choice.delta) || {};
        if (delta.reasoning_content) {
          if (thinkStart === null) thinkStart = performance.now();
          m.thinking += delta.reasoning_content;
        }
        if (delta.content) {
          if (thinkStart !== null && !m.thinkSeconds) m.thinkSeconds = (performance.now() - thinkStart) / 1000;
          m.content += delta.content;
        }
        if (chunk.clover_stats) m.stats = chunk.clover_stats;
        redraw();
      }
    } catch (e) {
      if (e.name === "AbortError") m.stopped = true;
      else m.error = e.message || String(e);
    } finally {
      if (frame) cancelAnimationFrame(frame);
      if (thinkStart !== null && !m.thinkSeconds) m.thinkSeconds = (performance.now() - thinkStart) / 1000;
      m.seconds = (performance.now() - started) / 1000;
      m.thinking = (m.thinking || "").trim();
      m.content = (m.content || "").trim();
      streaming = null;
      chat.updated = Date.now();
      saveChats();
      view.update(false);
      markLatest();
      setBusy(false);
      if (nearBottom(240)) stickToBottom();
    }
  }

  function stop() {
    if (streaming) streaming.controller.abort();
  }

  function setBusy(busy) {
    ui.send.hidden = busy;
    ui.stop.hidden = !busy;
    ui.app.classList.toggle("busy", busy);
  }

  function nearBottom(px) {
    const s = ui.scroll;
    return s.scrollHeight - s.scrollTop - s.clientHeight < (px || 80);
  }

  function stickToBottom() {
    ui.scroll.scrollTop = ui.scroll.scrollHeight;
  }

  function autosize() {
    ui.prompt.style.height = "auto";
    ui.prompt.style.height = Math.min(ui.prompt.scrollHeight, Math.round(window.innerHeight * 0.4)) + "px";
  }

  // ---- settings ------------------------------------------------------------------------------------------------
  const NUMERIC = ["temperature", "top_p", "top_k", "max_tokens", "threshold", "block_size"];

  function showSettings() {
    for (const k of NUMERIC) $("set-" + k).value = settings[k] === null ? "" : settings[k];
    $("set-think").checked = !!settings.think;
    $("set-blocks").checked = !!settings.blocks;
    $("set-system").value = settings.system || "";
  }

  function readSettings() {
    for (const k of NUMERIC) {
      const input = $("set-" + k);
      const v = input.value.trim() === "" ? null : Number(input.value);
      const ok = v === null || (Number.isFinite(v) && input.checkValidity());
      input.classList.toggle("bad", !ok);
      if (!ok) continue;
      settings[k] = v === null && ["temperature", "top_p", "top_k"].includes(k) ? DEFAULTS[k] : v;
    }
    settings.think = $("set-think").checked;
    settings.blocks = $("set-blocks").checked;
    settings.system = $("set-system").value;
    save(SETTINGS, settings);
  }

  function toggleSettings(open) {
    ui.settings.hidden = !open;
    ui.settingsBtn.setAttribute("aria-expanded", String(open));
    if (open) showSettings();
  }

  // ---- wiring --------------------------------------------------------------------------------------------------
  ui.composer.addEventListener("submit", (e) => {
    e.preventDefault();
    send();
  });
  ui.prompt.addEventListener("keydown", (e) => {
    if (e.key === "Enter" && !e.shiftKey && !e.isComposing && e.keyCode !== 229) {
      e.preventDefault();
      send();
    }
  });
  ui.prompt.addEventListener("input", autosize);
  ui.stop.addEventListener("click", stop);
  document.addEventListener("keydown", (e) => {
    if (e.key === "Escape" && streaming) stop();
  });
  ui.newChat.addEventListener("click", newChat);
  ui.menu.addEventListener("click", () => toggleSidebar(!ui.app.classList.contains("side-open")));
  ui.scrim.addEventListener("click", closeSidebar);
  ui.mode.addEventListener("change", () => {
    settings.mode = ui.mode.value;
    save(SETTINGS, settings);
  });
  ui.settingsBtn.addEventListener("click", () => toggleSettings(ui.settings.hidden));
  $("settings-close").addEventListener("click", () => toggleSettings(false));
  $("settings-reset").addEventListener("click", () => {
    Object.assign(settings, DEFAULTS, { mode: settings.mode });
    save(SETTINGS, settings);
    showSettings();
  });
  ui.settings.addEventListener("input", readSettings);
  ui.settings.addEventListener("change", readSettings);
  window.addEventListener("storage", (e) => {  // another tab changed the conversations
    if (e.key !== STORE || streaming) return;
    chats = load(STORE, []);
    const id = current && current.id;
    current = chats.find((c) => c.id === id) || null;
    renderChats();
    renderMessages();
  });

  if (settings.mode && MODES.includes(settings.mode)) ui.mode.value = settings.mode;
  const open = localStorage.getItem(CURRENT);
  current = chats.find((c) => c.id === open) || null;
  renderChats();
  renderMessages();
  connect();
  ui.prompt.focus();
})();
