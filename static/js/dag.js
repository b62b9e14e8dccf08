// The transition DAG as SVG: nodes in columns by depth (longest path from a source), edges left
// to right (resource edges dashed), the critical path drawn thick, node colour = state, and each
// node's predicted against actual seconds in its tooltip and label.
"use strict";
window.NereusDag = (function () {
  const NS = "http://www.w3.org/2000/svg";
  const W = 170, H = 38, GX = 40, GY = 10;

  function el(name, attrs, text) {
    const e = document.createElementNS(NS, name);
    for (const [k, v] of Object.entries(attrs)) e.setAttribute(k, v);
    if (text !== undefined) e.textContent = text;
    return e;
  }

  function fmt(s) { return s == null ? "–" : s < 1 ? (s * 1000).toFixed(0) + " ms" : s.toFixed(2) + " s"; }

  // states: {nodeId: state} chosen by the caller (per-node reports, or the transition's outcome).
  function render(container, dag, states) {
    container.replaceChildren();
    if (!dag) return;
    const preds = {};
    for (const n of dag.nodes) preds[n.id] = [];
    for (const e of dag.edges) if (preds[e.to]) preds[e.to].push(e.from);
    const depth = {};
    const depthOf = (id, seen) => {
      if (depth[id] !== undefined) return depth[id];
      if (seen.has(id)) return 0;  // never for a DAG; guards a malformed one
      seen.add(id);
      depth[id] = preds[id].length ? 1 + Math.max(...preds[id].map((p) => depthOf(p, seen))) : 0;
      return depth[id];
    };
    const columns = [];
    for (const n of dag.nodes) (columns[depthOf(n.id, new Set())] ||= []).push(n);
    const at = {};
    columns.forEach((col, x) => {
      col.sort((a, b) => a.model_stage.localeCompare(b.model_stage) || a.id.localeCompare(b.id));
      col.forEach((n, y) => { at[n.id] = { x: x * (W + GX), y: y * (H + GY) }; });
    });
    const rows = Math.max(1, ...columns.map((c) => c.length));
    const svg = el("svg", { width: columns.length * (W + GX), height: rows * (H + GY), role: "img",
      "aria-label": `transition DAG with ${dag.nodes.length} nodes` });
    const critical = new Set(dag.critical_path || []);
    const path = dag.critical_path || [];
    const criticalEdges = new Set(path.slice(1).map((id, i) => path[i] + ">" + id));
    for (const e of dag.edges) {
      const a = at[e.from], b = at[e.to];
      if (!a || !b) continue;
      const cls = ["edge", e.kind === "data" ? "data" : "resource"];
      if (criticalEdges.has(e.from + ">" + e.to)) cls.push("critical");
      svg.appendChild(el("path", { class: cls.join(" "),
        d: `M${a.x + W},${a.y + H / 2} C${a.x + W + GX / 2},${a.y + H / 2} ${b.x - GX / 2},${b.y + H / 2} ${b.x},${b.y + H / 2}` }));
    }
    for (const n of dag.nodes) {
      const p = at[n.id];
      const state = states[n.id] || n.state;
      const g = el("g", { class: `node state-${state}${critical.has(n.id) ? " critical" : ""}`,
        transform: `translate(${p.x},${p.y})`, "data-node": n.id, "data-state": state });
      g.appendChild(el("title", {}, `${n.id} (${n.kind}, ${n.model_stage}) — ${state}\n` +
        `slots ${n.slots.join(",")}\npredicted ${fmt(n.predicted_s)}, actual ${fmt(n.actual_s)}` +
        (n.error ? `\nerror: ${n.error}` : "")));
      g.appendChild(el("rect", { width: W, height: H, rx: 5 }));
      g.appendChild(el("text", { x: 6, y: 15 }, `${n.kind} ${n.model_stage}`.slice(0, 26)));
      g.appendChild(el("text", { x: 6, y: 31, class: "sub" },
        `${fmt(n.predicted_s)} pred · ${fmt(n.actual_s)} act`));
      svg.appendChild(g);
    }
    container.appendChild(svg);
  }

  return { render, fmt };
})();
