// onceflow operator UI: live numbers. Every element marked data-live is refreshed from
// the same page every 5 seconds while the tab is visible; the pages work without it.
(function () {
  "use strict";
  var live = document.querySelectorAll("[data-live]");
  if (!live.length || !window.fetch || !window.DOMParser) { return; }
  function refresh() {
    if (document.hidden) { return; }
    fetch(window.location.href, { credentials: "same-origin", headers: { "Accept": "text/html" } })
      .then(function (r) { return r.ok ? r.text() : null; })
      .then(function (html) {
        if (!html) { return; }
        var doc = new DOMParser().parseFromString(html, "text/html");
        document.querySelectorAll("[data-live]").forEach(function (el) {
          var fresh = doc.querySelector('[data-live="' + el.getAttribute("data-live") + '"]');
          if (fresh) { el.innerHTML = fresh.innerHTML; }
        });
      })
      .catch(function () {});
  }
  window.setInterval(refresh, 5000);
})();
