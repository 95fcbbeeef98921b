// kuralle_es dashboard: a run's stream, live (docs/streaming.md).
//
// Reads the run's stored stream with a plain EventSource from offset 0, so a
// reload shows everything again from the store, once: each model step's text
// is its attempts' deltas, an attempt's text is dropped when a `retract`
// names it, and a step's `text` part (its journaled whole) replaces its
// deltas. The browser's own reconnection sends Last-Event-ID, so a dropped
// connection resumes without repeating a part. On a page kept live by
// live.js (the run events) the rest of the page changes in place; without it,
// the page reloads itself when a turn ends live (to show the journal it
// wrote), and every data-refresh seconds while the run is at rest. A part of
// an erased data subject comes without its payload (docs/privacy.md) and
// shows as "(erased)".
(function () {
  var ERASED = "(erased)";
  "use strict";
  var box = document.getElementById("stream");
  if (!box || !window.EventSource) return;
  var seen = Number(box.dataset.seen || "0");
  var refresh = Number(box.dataset.refresh || "0");
  var steps = new Map();
  // live.js swaps the page's parts as the run changes: no reload is needed.
  var kept = Boolean(document.body && document.body.dataset.liveEvents);

  function line(kind, text) {
    var p = document.createElement("p");
    p.className = "part " + kind;
    p.textContent = text;
    box.appendChild(p);
    return p;
  }

  function step(index) {
    var view = steps.get(index);
    if (!view) {
      view = { el: line("answer", ""), attempts: new Map(), whole: null };
      view.el.dataset.step = String(index);
      steps.set(index, view);
    }
    return view;
  }

  function render(view) {
    if (view.whole !== null) {
      view.el.textContent = view.whole;
      return;
    }
    var text = "";
    view.attempts.forEach(function (pieces) { text += pieces.join(""); });
    view.el.textContent = text;
  }

  function show(part) {
    var view;
    switch (part.type) {
      case "text-delta":
        view = step(part.step);
        if (!view.attempts.has(part.attempt)) view.attempts.set(part.attempt, []);
        view.attempts.get(part.attempt).push(part.delta === undefined ? ERASED : part.delta);
        render(view);
        break;
      case "retract":
        view = step(part.step);
        view.attempts.delete(part.attempt);
        render(view);
        break;
      case "text":
        if (part.step === undefined) { line("said", part.text === undefined ? ERASED : part.text); break; }
        view = step(part.step);
        view.whole = part.text === undefined ? ERASED : part.text;
        render(view);
        break;
      case "tool-call":
        line("tool", "→ " + part.tool_name + " " + JSON.stringify(part.args));
        break;
      case "tool-result":
        line("tool", "← " + part.tool_name + " " + JSON.stringify(part.result));
        break;
      case "custom":
        line("custom", JSON.stringify(part.data));
        break;
      default:
        line("end " + part.type, part.type);
    }
  }

  var source = new EventSource(box.dataset.src);
  box.dataset.state = "open";
  source.onmessage = function (event) {
    var part = JSON.parse(event.data);
    show(part);
    box.dataset.last = String(part.offset);
    var ends = part.type === "finished" || part.type === "paused" || part.type === "error";
    if (ends && part.offset > seen) {
      source.close();
      box.dataset.state = "ended";
      if (!kept) window.setTimeout(function () { window.location.reload(); }, 1000);
    }
  };
  source.addEventListener("end", function () {
    source.close();
    box.dataset.state = "at-rest";
    if (refresh > 0 && !kept) {
      window.setTimeout(function () { window.location.reload(); }, refresh * 1000);
    }
  });
})();
