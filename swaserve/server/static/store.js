// What the page keeps in the browser's localStorage: the conversations (each its messages),
// which one is open, and the settings. Nothing of it reaches the server but the requests.
"use strict";

const Store = (() => {
  const CONVS = "swaserve.conversations";
  const CURRENT = "swaserve.current";
  const SETTINGS = "swaserve.settings";
  const DEFAULTS = { system: "", temperature: 0.7, top_p: 1, max_tokens: 512, tools: "" };

  function read(key, fallback) {
    try {
      const v = JSON.parse(localStorage.getItem(key));
      return v === null ? fallback : v;
    } catch (_) {
      return fallback;  // unreadable: start over rather than break the page
    }
  }

  function write(key, value) {
    try {
      localStorage.setItem(key, JSON.stringify(value));
    } catch (e) {
      console.warn("localStorage is full or off:", e);
    }
  }

  let convs = read(CONVS, []);
  let current = read(CURRENT, null);

  function save() {
    write(CONVS, convs);
    write(CURRENT, current);
  }

  function newConversation() {
    const conv = { id: `c${Date.now().toString(36)}${Math.random().toString(36).slice(2, 6)}`,
      title: "New chat", messages: [], created: Date.now() };
    convs.unshift(conv);
    current = conv.id;
    save();
    return conv;
  }

  return {
    conversations: () => convs,
    current() {
      return convs.find((c) => c.id === current) || newConversation();
    },
    select(id) {
      current = id;
      save();
    },
    remove(id) {
      convs = convs.filter((c) => c.id !== id);
      if (current === id) current = convs.length ? convs[0].id : null;
      save();
    },
    newConversation,
    save,
    settings: () => ({ ...DEFAULTS, ...read(SETTINGS, {}) }),
    saveSettings(s) { write(SETTINGS, s); },
  };
})();
