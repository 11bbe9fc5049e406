"""The HTML report's style sheet and script, inline in every page (nothing is fetched).

The script only adds to a page that is complete without it: pressing a column header of a sortable table
(pointer, or Enter on the focused header) sorts it (a column of numbers sorts by value, placeholders such
as "n/a", "–" or "no τ" last (a column is numbers when most cells are, or when its other cells are at most
three distinct words); first press: largest first, smallest first for a header marked
`data-order="asc"`, such as p-values and sign errors; rows in `<tfoot>`, the reference rows, stay
below), tables with `data-filters` get a row of filters (one select per row attribute, plus a measure-name
search), and figures with hover data show the nearest point's run (id, swept hyperparameters, the value)
under the pointer. Printing opens every collapsed section (`beforeprint`, and the print style sheet's
`::details-content` rule where the browser has it), and never splits a figure or a table row.
"""

CSS = """
body{font-family:system-ui,-apple-system,"Segoe UI",Roboto,Helvetica,Arial,sans-serif;max-width:1360px;
margin:1.5em auto;padding:0 1em;color:#111;line-height:1.45}
h1{font-size:1.5em;margin-bottom:.3em}h2{font-size:1.25em;border-bottom:1px solid #ccc;padding-bottom:.2em;
margin-top:1.8em}h3{font-size:1.05em;margin-top:1.4em}
table{border-collapse:collapse;font-size:.84em;margin:.6em 0}
table.compact{font-size:.78em}
th,td{border:1px solid #bbb;padding:.2em .45em;text-align:left;vertical-align:top}
th{background:#eee}td.num{text-align:right;font-variant-numeric:tabular-nums;white-space:nowrap}td.nowrap{white-space:nowrap}
tbody tr:nth-child(even){background:#f7f7f7}tfoot td{background:#eef3f8;font-style:italic}
table.sortable th{cursor:pointer}table.sortable th[aria-sort=ascending]::after{content:" \\25B2";font-size:.7em}
table.sortable th[aria-sort=descending]::after{content:" \\25BC";font-size:.7em}
code{font-family:ui-monospace,Menlo,Consolas,monospace;font-size:.92em}
td code,th code{overflow-wrap:normal;word-break:normal}
pre{background:#f5f5f5;border:1px solid #ddd;padding:.7em;overflow-x:auto;font-size:.82em;white-space:pre-wrap}
figure{margin:1em 0}img{max-width:100%;height:auto;border:1px solid #eee}
figcaption{font-size:.85em;color:#444}.tablewrap{max-width:100%;overflow-x:auto}
nav.toc{font-size:.88em;margin-bottom:.6em}
p.design{font-size:1.02em;margin:.3em 0}p.headline{margin:.3em 0}
details{margin:.5em 0}summary{cursor:pointer;color:#124;font-weight:600;font-size:.92em}
.filters{font-size:.85em;margin:.4em 0;display:flex;flex-wrap:wrap;gap:.4em 1em;align-items:center}
.hoverbox{position:relative;display:inline-block;max-width:100%}
@media screen{figure.facet-hidden{display:none}#verdict td:nth-child(2){min-width:15em}}
#fb-tip{position:fixed;z-index:10;pointer-events:none;background:#fff;border:1px solid #333;padding:.3em .5em;
font-size:.78em;line-height:1.3;box-shadow:0 1px 4px rgba(0,0,0,.3);max-width:28em;display:none}
#fb-tip b{display:block;font-family:ui-monospace,Menlo,Consolas,monospace}
@media print{@page{size:A4 portrait;margin:8mm 7mm}
body{max-width:none;margin:0;padding:0;font-size:8pt;line-height:1.22}
a{color:inherit;text-decoration:none}.filters,nav.toc,#fb-tip{display:none}
h1{font-size:13pt}h2{font-size:11pt;margin-top:.8em}h3{font-size:9.5pt;margin-top:.6em}
h1,h2,h3,h4,summary{break-after:avoid;page-break-after:avoid}
figure,img,tr,thead,pre,.keep{break-inside:avoid;page-break-inside:avoid}
table,table.compact{font-size:6.2pt;line-height:1.1}th,td{padding:.02em .25em}
.tablewrap{overflow:visible}figcaption{font-size:7pt}
figure{display:inline-table;width:1px;margin:.15em .25em .15em 0;vertical-align:top}
figcaption{display:table-caption;caption-side:bottom}
img{max-height:80mm;width:auto;max-width:194mm;object-fit:contain}figure.full img{max-height:270mm}
details>summary{list-style:none}details::details-content{content-visibility:visible;display:contents}
pre{font-size:6.2pt;padding:.3em;line-height:1.12;column-count:2;column-gap:1.2em;white-space:pre}p,li{margin:.2em 0}}
"""

SCRIPT = r"""
(function () {
  "use strict";
  function num(text) {
    var m = String(text).replace(/\u2212/g, "-").match(/^\s*[<>~]?\s*([+-]?(?:\d+\.?\d*|\.\d+)(?:e[+-]?\d+)?)/i);
    return m ? parseFloat(m[1]) : NaN;
  }
  function text(cell) { return cell ? cell.textContent.trim() : ""; }
  function sortBy(table, col, th) {
    var body = table.tBodies[0];
    var rows = Array.prototype.slice.call(body.rows);
    var values = rows.map(function (r) { return text(r.cells[col]); });
    var counted = values.filter(function (v) { return v !== "" && v !== "-"; });
    var numbers = counted.filter(function (v) { return !isNaN(num(v)); }).length;
    var words = {};
    counted.forEach(function (v) { if (isNaN(num(v))) { words[v] = 1; } });
    var numeric = numbers > 0 && (numbers * 2 >= counted.length || Object.keys(words).length <= 3);
    var state = th.getAttribute("aria-sort");
    var descending = state ? state === "ascending" : numeric && th.getAttribute("data-order") !== "asc";
    rows.sort(function (a, b) {
      var x = text(a.cells[col]), y = text(b.cells[col]);
      if (numeric) {
        var u = num(x), v = num(y);
        if (isNaN(u) || isNaN(v)) { return isNaN(u) === isNaN(v) ? 0 : (isNaN(u) ? 1 : -1); }
        return descending ? v - u : u - v;
      }
      return descending ? y.localeCompare(x) : x.localeCompare(y);
    });
    rows.forEach(function (r) { body.appendChild(r); });
    Array.prototype.forEach.call(table.tHead.rows[0].cells, function (c) { c.removeAttribute("aria-sort"); });
    th.setAttribute("aria-sort", descending ? "descending" : "ascending");
  }
  function makeSortable(table) {
    Array.prototype.forEach.call(table.tHead.rows[0].cells, function (th, col) {
      th.title = "sort by this column";
      th.tabIndex = 0;
      th.addEventListener("pointerup", function () { sortBy(table, col, th); });
      th.addEventListener("keydown", function (e) { if (e.key === "Enter") { sortBy(table, col, th); } });
    });
  }
  function makeFilters(table) {
    var names = (table.getAttribute("data-filters") || "").split(" ").filter(Boolean);
    var rows = Array.prototype.slice.call(table.tBodies[0].rows);
    var box = document.createElement("div");
    box.className = "filters";
    var selects = {};
    var search = document.createElement("input");
    search.type = "search";
    search.placeholder = "measure contains";
    var count = document.createElement("span");
    function apply() {
      var shown = 0;
      rows.forEach(function (r) {
        var ok = text(r.cells[0]).indexOf(search.value.trim()) >= 0 || text(r.cells[1]).indexOf(search.value.trim()) >= 0;
        names.forEach(function (n) {
          var want = selects[n].value;
          if (want && (" " + (r.getAttribute("data-" + n) || "") + " ").indexOf(" " + want + " ") < 0) { ok = false; }
        });
        r.hidden = !ok;
        if (ok) { shown += 1; }
      });
      count.textContent = shown + " of " + rows.length + " measures";
    }
    names.forEach(function (n) {
      var values = {};
      rows.forEach(function (r) {
        (r.getAttribute("data-" + n) || "").split(" ").filter(Boolean).forEach(function (v) { values[v] = 1; });
      });
      var label = document.createElement("label");
      label.textContent = n + " ";
      var select = document.createElement("select");
      select.name = n;
      select.appendChild(new Option("all", ""));
      Object.keys(values).sort().forEach(function (v) { select.appendChild(new Option(v.replace(/_/g, " "), v)); });
      select.addEventListener("change", apply);
      label.appendChild(select);
      box.appendChild(label);
      selects[n] = select;
    });
    search.addEventListener("input", apply);
    box.appendChild(search);
    box.appendChild(count);
    var wrap = table.parentNode;
    wrap.parentNode.insertBefore(box, wrap);
    apply();
  }
  function fmt(v) {
    if (typeof v !== "number" || !isFinite(v)) { return "n/a"; }
    return Math.abs(v) >= 1e4 || (Math.abs(v) < 1e-3 && v !== 0) ? v.toExponential(3) : String(+v.toPrecision(4));
  }
  function setupHover(data) {
    var tip = document.createElement("div");
    tip.id = "fb-tip";
    document.body.appendChild(tip);
    Array.prototype.forEach.call(document.querySelectorAll("figure.hover"), function (fig) {
      var holder = document.getElementById(fig.id + "-points");
      var img = fig.querySelector("img");
      if (!holder || !img) { return; }
      var spec = JSON.parse(holder.textContent);
      img.addEventListener("mousemove", function (e) {
        var rect = img.getBoundingClientRect();
        var sx = img.naturalWidth / rect.width, sy = img.naturalHeight / rect.height;
        var x = (e.clientX - rect.left) * sx, y = (e.clientY - rect.top) * sy;
        var best = null, bestD = 64 * sx * sx;
        spec.points.forEach(function (p) {
          var d = (p[0] - x) * (p[0] - x) + (p[1] - y) * (p[1] - y);
          if (d < bestD) { bestD = d; best = p; }
        });
        if (!best) { tip.style.display = "none"; tip.removeAttribute("data-run"); return; }
        var run = data.runs[best[2]];
        var lines = [run.id, spec.panels[best[3]] + " = " + fmt(best[4]), "gap = " + fmt(run.gap)];
        run.fields.forEach(function (f) { lines.push(f[0] + " = " + f[1]); });
        tip.textContent = "";
        lines.forEach(function (l, i) {
          var line = document.createElement(i === 0 ? "b" : "div");
          line.textContent = l;
          tip.appendChild(line);
        });
        tip.setAttribute("data-run", run.id);
        tip.style.left = Math.min(e.clientX + 14, window.innerWidth - 320) + "px";
        tip.style.top = (e.clientY + 14) + "px";
        tip.style.display = "block";
      });
      img.addEventListener("mouseleave", function () { tip.style.display = "none"; });
    });
  }
  function openForPrint() {
    Array.prototype.forEach.call(document.querySelectorAll("details:not([open])"), function (d) {
      d.setAttribute("open", "");
      d.setAttribute("data-print-opened", "");
    });
  }
  function closeAfterPrint() {
    Array.prototype.forEach.call(document.querySelectorAll("details[data-print-opened]"), function (d) {
      d.removeAttribute("open");
      d.removeAttribute("data-print-opened");
    });
  }
  function setupFacets() {
    var figures = Array.prototype.slice.call(document.querySelectorAll("figure.facet"));
    if (figures.length < 2) { return; }
    var box = document.createElement("div");
    box.className = "filters facets";
    var label = document.createElement("label");
    label.textContent = "show the design along ";
    var select = document.createElement("select");
    select.name = "facet";
    figures.forEach(function (f) { select.appendChild(new Option(f.getAttribute("data-facet"), f.getAttribute("data-facet"))); });
    function show() {
      figures.forEach(function (f) { f.classList.toggle("facet-hidden", f.getAttribute("data-facet") !== select.value); });
    }
    select.addEventListener("change", show);
    label.appendChild(select);
    box.appendChild(label);
    figures[0].parentNode.insertBefore(box, figures[0]);
    show();
  }
  setupFacets();
  window.addEventListener("beforeprint", openForPrint);
  window.addEventListener("afterprint", closeAfterPrint);
  if (window.matchMedia) {
    var printing = window.matchMedia("print");
    if (printing.addEventListener) {
      printing.addEventListener("change", function (e) { if (e.matches) { openForPrint(); } });
    }
  }
  Array.prototype.forEach.call(document.querySelectorAll("table.sortable"), makeSortable);
  Array.prototype.forEach.call(document.querySelectorAll("table[data-filters]"), makeFilters);
  var holder = document.getElementById("fb-data");
  if (holder) { setupHover(JSON.parse(holder.textContent)); }
})();
"""
