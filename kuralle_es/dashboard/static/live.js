// kuralle_es dashboard: pages that change in place as their runs do.
//
// The page names its event stream (<body data-live-events="/events?run=...">): the
// run events, as server-sent events. On an event (a few at once count as one) the
// page fetches itself again and swaps each of its parts marked data-live for the new
// one, so nothing reloads: a part with a form being filled in (a field with focus,
// or text typed into it) is left as it is.
(function () {
  "use strict";
  var body = document.body;
  var stream = body.getAttribute("data-live-events");
  if (!stream || !window.EventSource || !window.fetch || !window.DOMParser) {
    return;
  }
  var pending = null;
  var updates = 0;

  function busy(part) {
    if (part.contains(document.activeElement) && document.activeElement !== body) {
      return true;
    }
    var fields = part.querySelectorAll("input, textarea, select");
    for (var i = 0; i < fields.length; i++) {
      var field = fields[i];
      if (field.type === "hidden") { continue; }
      if (field.tagName === "SELECT") {
        for (var j = 0; j < field.options.length; j++) {
          if (field.options[j].selected !== field.options[j].defaultSelected) { return true; }
        }
      } else if (field.type === "checkbox" || field.type === "radio") {
        if (field.checked !== field.defaultChecked) { return true; }
      } else if (field.value !== field.defaultValue) {
        return true;
      }
    }
    return false;
  }

  function swap(html) {
    var fresh = new DOMParser().parseFromString(html, "text/html");
    var parts = document.querySelectorAll("[data-live]");
    for (var i = 0; i < parts.length; i++) {
      var part = parts[i];
      var next = part.id ? fresh.getElementById(part.id) : null;
      if (next && !busy(part)) {
        part.replaceWith(document.importNode(next, true));
      }
    }
    updates += 1;
    body.setAttribute("data-live-updates", String(updates));
  }

  function refresh() {
    pending = null;
    fetch(window.location.href, { credentials: "same-origin", headers: { "Accept": "text/html" } })
      .then(function (answer) { return answer.ok ? answer.text() : null; })
      .then(function (html) { if (html) { swap(html); } })
      .catch(function () { /* the next event tries again */ });
  }

  function soon() {
    if (pending === null) {
      pending = window.setTimeout(refresh, 250);
    }
  }

  // The stream starts after the events the page was rendered from, and a stream
  // that ends is reopened after its last event (Last-Event-ID): none is missed.
  var source = new EventSource(stream);
  source.addEventListener("run", soon);
  source.addEventListener("open", function () {
    body.setAttribute("data-live-connected", "yes");
  });
})();
