// The plan map: one row per model-stage, one column per slot. A cell's hue is its data-parallel
// replica, its shade its pipeline stage, and its label its (replica, tensor rank, pipeline stage),
// in the order of the row's (dp, tp, pp) layout
// (a unit's slots are listed pipeline-stage-major: slots [p*tp, (p+1)*tp) form stage p).
"use strict";
window.NereusPlanMap = (function () {
  function positions(plan) {
    // {modelStage: {slot: {d, p, t, layout}}}
    const out = {};
    for (const ms of plan.model_stages) {
      const tp = ms.layout.tp;
      const cells = (out[ms.name] = {});
      ms.units.forEach((unit, d) => unit.forEach((slot, i) => {
        cells[slot] = { d, p: Math.floor(i / tp), t: i % tp, layout: ms.layout };
      }));
    }
    return out;
  }

  function colour(pos) {
    const hue = (pos.d * 137.5) % 360;
    const shade = 42 + 16 * (pos.p % 3);
    return `hsl(${hue.toFixed(0)} 55% ${shade}%)`;
  }

  // render(container, plan, {compareTo}): compareTo marks the cells that differ from another plan.
  function render(container, plan, opts) {
    container.replaceChildren();
    if (!plan) return;
    const other = opts && opts.compareTo ? positions(opts.compareTo) : null;
    const pos = positions(plan);
    const slots = plan.num_slots;
    const grid = document.createElement("div");
    grid.className = "grid";
    grid.style.gridTemplateColumns = `minmax(9rem, max-content) repeat(${slots}, minmax(1.6rem, 1fr))`;
    grid.appendChild(cell("th", "model-stage \\ slot"));
    for (let s = 0; s < slots; s++) grid.appendChild(cell("th", String(s)));
    for (const ms of plan.model_stages) {
      const l = ms.layout;
      // Training and inference run in the plan's micro-batches (sequences each): shown as "mb";
      // generation that decodes in waves shows how many sequences a unit decodes at once.
      const wave = ms.name.endsWith("@generation") ? "at once" : "mb";
      const mb = ms.micro_batch ? ` ${wave} ${ms.micro_batch}` : "";
      grid.appendChild(cell("th", `${ms.name} (${l.dp},${l.tp},${l.pp})${mb}`));
      for (let s = 0; s < slots; s++) {
        const p = pos[ms.name][s];
        const c = cell("td", p ? `${p.d}·${p.t}·${p.p}` : "");
        c.dataset.slot = s;
        if (p) {
          c.style.background = colour(p);
          c.title = `${ms.name} slot ${s}: replica ${p.d} of ${l.dp}, pipeline stage ${p.p} of ${l.pp}, ` +
            `tensor rank ${p.t} of ${l.tp}`;
          const q = other && other[ms.name] ? other[ms.name][s] : undefined;
          if (other && (!q || q.d !== p.d || q.p !== p.p || q.t !== p.t ||
              q.layout.tp !== l.tp || q.layout.pp !== l.pp)) c.classList.add("changed");
        } else {
          c.classList.add("idle");
        }
        grid.appendChild(c);
      }
    }
    container.appendChild(grid);
    const legend = document.createElement("p");
    legend.className = "muted small";
    legend.textContent = "cell: replica·tensor rank·pipeline stage, in the order of a row's (dp,tp,pp); " +
      "hue = data-parallel replica, " +
      "shade = pipeline stage" + (other ? "; outlined = differs from the current plan" : "");
    container.appendChild(legend);
  }

  function cell(kind, text) {
    const el = document.createElement("div");
    el.className = "cell " + kind;
    el.textContent = text;
    return el;
  }

  return { render, positions };
})();
