// A PPO job's panels (real on CPU slots, or on the simulated cluster), all drawn from the job's
// events: drift charts (sequence length, peak memory, slot pool, with threshold bands and trigger
// points), step latency by stage (predicted by the plan in force vs measured), PPO's own charts
// (reward, KL, response length, clip fraction and entropy; real jobs), the plan map (current and
// proposed), the transition DAG (live, node by node, when the engine reports nodes), calibration
// and the decisions log. The "simulated" labels follow the events' own `simulated` flag.
"use strict";
(function () {
  const cfg = JSON.parse(document.getElementById("job-config").textContent);
  const STAGES = ["generation", "inference", "training"];
  // On a phone the mode bar would sit over the top of every chart (touch shows it always).
  const plotConfig = { displaylogo: false, responsive: true,
    displayModeBar: window.matchMedia("(max-width: 600px)").matches ? false : "hover" };
  const S = {
    steps: [], genLen: [], memory: [], pool: [], stage: { generation: [], inference: [], training: [] },
    predicted: { generation: [], inference: [], training: [] }, band: { gen_len: [], peak_memory: [] },
    ref: {}, latest: {}, triggers: [], current: null, candidate: null, proposals: {}, waiting: null,
    target: null, transitions: [], shown: null, live: null, calibration: null, lastStep: null,
    ppo: { steps: [], reward: [], kl: [], klCoef: [], length: [], clip: [], entropy: [] },
    simulated: null,
  };
  let dirty = false;

  // --- helpers ------------------------------------------------------------------------------
  const $ = (id) => document.getElementById(id);
  const num = (v, digits = 3) => (v == null || !isFinite(v) ? "–" : Number(v).toPrecision(digits));
  function row(table, cells, cls) {
    const tr = document.createElement("tr");
    if (cls) tr.className = cls;
    for (const c of cells) { const td = document.createElement("td"); td.textContent = c; tr.appendChild(td); }
    return tr;
  }
  function redrawSoon() {
    if (dirty) return;
    dirty = true;
    setTimeout(() => { dirty = false; drawCharts(); }, 150);
  }

  // --- drift and latency --------------------------------------------------------------------
  function label(simulated) {
    if (simulated == null || simulated === S.simulated) return;
    S.simulated = Boolean(simulated);
    for (const el of document.querySelectorAll(".sim")) el.hidden = !S.simulated;
    for (const el of document.querySelectorAll(".real")) el.hidden = S.simulated;
  }

  // A new driver (after a lost worker) resumes from a checkpoint and runs some steps again: the
  // re-run replaces what the lost driver had reported from that step on.
  function truncateFrom(step) {
    const keep = S.steps.findIndex((s) => s >= step);
    if (keep >= 0) {
      for (const arr of [S.steps, S.genLen, S.memory, S.pool, ...Object.values(S.stage),
        ...Object.values(S.predicted), ...Object.values(S.band)]) arr.splice(keep);
    }
    const k = S.ppo.steps.findIndex((s) => s >= step);
    if (k >= 0) for (const arr of Object.values(S.ppo)) arr.splice(k);
  }

  function onStep(d) {
    $("step-now").textContent = d.step + 1;
    label(d.simulated);
    if (S.steps.length && d.step <= S.steps[S.steps.length - 1]) truncateFrom(d.step);
    S.lastStep = d;
    onPpo(d);
    if (!d.ok) { S.triggers.push({ kind: "failed step", step: d.step, detail: d.failure }); return; }
    for (const [signal, value] of [["gen_len", d.gen_len], ["peak_memory", d.peak_memory], ["step_time", d.step_s]]) {
      if (S.ref[signal] === undefined) S.ref[signal] = value;  // the monitor's first reference
      S.latest[signal] = value;
    }
    S.steps.push(d.step);
    S.genLen.push(d.gen_len);
    S.memory.push(d.peak_memory);
    S.pool.push(d.num_slots);
    if ($("pool-now") && d.num_slots != null) $("pool-now").textContent = d.num_slots;  // after resizes
    for (const [signal, band] of Object.entries(S.band)) {
      band.push([S.ref[signal] * (1 - cfg.thresholds[signal]), S.ref[signal] * (1 + cfg.thresholds[signal])]);
    }
    const stages = S.current ? Object.fromEntries(S.current.stages.map((s) => [s.stage, s.predicted_s])) : {};
    for (const st of STAGES) {
      S.stage[st].push(d.stage_s[st]);
      S.predicted[st].push(stages[st] ?? null);
    }
    drawCalibration();
    redrawSoon();
  }

  function onPpo(d) {
    const p = d.ppo;
    if (!p || p.mean_reward == null || !$("chart-reward")) return;
    const step = d.ppo_step ?? d.step;
    if (S.ppo.steps.length && step <= S.ppo.steps[S.ppo.steps.length - 1]) {
      const k = S.ppo.steps.findIndex((s) => s >= step);
      for (const arr of Object.values(S.ppo)) arr.splice(k);
    }
    S.ppo.steps.push(step);
    S.ppo.reward.push(p.mean_reward);
    S.ppo.kl.push(p.kl);
    S.ppo.klCoef.push(p.kl_coef);
    S.ppo.length.push(p.mean_response_length);
    S.ppo.clip.push(p.clip_fraction);
    S.ppo.entropy.push(p.entropy);
  }

  function drawPpo() {
    if (!$("chart-reward")) return;
    const x = S.ppo.steps;
    const line = (y, name, extra) => ({ x, y, name, mode: "lines+markers", type: "scatter", ...extra });
    // The series grow in place: datarevision makes Plotly.react recompute every axis's range
    // (the right-hand axes otherwise kept the empty chart's).
    const layout = (title, extra) => NereusLive.layout(title, {
      xaxis: { title: { text: "PPO step" }, autorange: true }, datarevision: x.length, ...extra });
    const right = (text) => ({
      yaxis2: { overlaying: "y", side: "right", title: { text, standoff: 8 }, showgrid: false, autorange: true,
        rangemode: "tozero", zeroline: false },  // a constant coefficient is not drawn about 0 ± 1
      margin: { t: 10, r: 70, b: 70, l: 55 } });
    Plotly.react("chart-reward", [line(S.ppo.reward, "mean reward")], layout("reward"), plotConfig);
    Plotly.react("chart-kl", [line(S.ppo.kl, "KL(actor ‖ reference)"),
      line(S.ppo.klCoef, "KL coefficient", { yaxis: "y2", line: { dash: "dot" } })],
    layout("KL", right("coefficient")), plotConfig);
    Plotly.react("chart-length", [line(S.ppo.length, "mean response length")], layout("tokens"), plotConfig);
    Plotly.react("chart-clip", [line(S.ppo.clip, "clip fraction"),
      line(S.ppo.entropy, "entropy", { yaxis: "y2", line: { dash: "dot" } })],
    layout("clip fraction", right("entropy (nats)")), plotConfig);
  }

  function onTrigger(d) {
    S.triggers.push(d);
    // Every trigger replans, and a replan resets every signal's reference to its latest value.
    Object.assign(S.ref, S.latest);
    redrawSoon();
  }

  function markers(filter, yOf, name, symbol) {
    const hits = S.triggers.filter(filter);
    return { x: hits.map((t) => t.step), y: hits.map(yOf), text: hits.map((t) => t.detail || t.kind),
      name, mode: "markers", type: "scatter", marker: { symbol, size: 10 }, hovertemplate: "%{text}<extra></extra>" };
  }
  function band(signal, i) {
    return { x: S.steps, y: S.band[signal].map((b) => b[i]), mode: "lines", line: { dash: "dot", width: 1, shape: "hv" },
      name: i ? `+${cfg.thresholds[signal] * 100}% of reference` : `−${cfg.thresholds[signal] * 100}% of reference`,
      type: "scatter" };
  }
  const valueAt = (series) => (t) => { const i = S.steps.lastIndexOf(t.step); return i >= 0 ? series[i] : null; };

  function drawCharts() {
    if (!window.Plotly) return;
    const line = (y, name) => ({ x: S.steps, y, name, mode: "lines", type: "scatter" });
    Plotly.react("chart-genlen", [line(S.genLen, "generated length"), band("gen_len", 1), band("gen_len", 0),
      markers((t) => t.signal === "gen_len" && t.kind === "drift", (t) => t.value, "drift trigger", "diamond"),
      markers((t) => t.kind === "memory", (t) => t.value, "memory forecast trigger", "x")],
    NereusLive.layout("tokens"), plotConfig);
    Plotly.react("chart-memory", [line(S.memory, "peak memory"), band("peak_memory", 1), band("peak_memory", 0),
      markers((t) => t.signal === "peak_memory", (t) => t.value, "drift trigger", "diamond"),
      markers((t) => t.kind === "failed step", valueAt(S.memory), "failed step", "x")],
    NereusLive.layout("fraction of device memory", { shapes: [
      { type: "line", xref: "paper", x0: 0, x1: 1, y0: cfg.memory_budget, y1: cfg.memory_budget, line: { dash: "dash", color: "#cf222e" } },
    ], annotations: [{ xref: "paper", x: 0, y: cfg.memory_budget, text: "planning budget", showarrow: false, yanchor: "bottom", xanchor: "left" }] }),
    plotConfig);
    Plotly.react("chart-pool", [{ ...line(S.pool, "slots"), line: { shape: "hv" } },
      markers((t) => t.kind === "pool", (t) => t.value, "pool trigger", "diamond"),
      markers((t) => t.kind === "failure", valueAt(S.pool), "slot failure", "x"),
      markers((t) => t.kind === "revoked", valueAt(S.pool), "slot revoked", "triangle-down"),
      markers((t) => t.kind === "granted", valueAt(S.pool), "slot granted", "triangle-up")],
    NereusLive.layout("slots"), plotConfig);
    const traces = [];
    STAGES.forEach((st, i) => {
      const colour = ["#0b6bcb", "#1a7f37", "#9a6700"][i];
      traces.push({ ...line(S.stage[st], `${st} measured`), line: { color: colour } });
      traces.push({ ...line(S.predicted[st], `${st} predicted`), line: { color: colour, dash: "dash", shape: "hv" } });
    });
    traces.push(markers((t) => t.signal === "step_time", valueAt(S.stage.generation), "step-time trigger", "diamond"));
    // Where the prices moved rather than the world: achieved efficiency, or a calibrated class
    // (its hover names the class and how far it moved).
    traces.push(markers((t) => t.signal === "efficiency" || t.signal === "calibration", valueAt(S.stage.generation),
      "calibration trigger", "star"));
    Plotly.react("chart-latency", traces, NereusLive.layout("seconds"), plotConfig);
    drawPpo();
  }

  // --- plans and proposals ------------------------------------------------------------------
  // The proposal's number as the inbox, the API and nereus approve give it (its row), not the
  // controller's own count.
  const plural = (n, word) => `${n} ${word}${n === 1 ? "" : "s"}`;
  const pid = (id) => (S.proposals[id] && S.proposals[id].row) || id;

  function drawMaps() {
    if (S.current) {
      NereusPlanMap.render($("map-current"), S.current);
      $("map-current-label").textContent = `predicted ${num(S.current.predicted_step_s)} s/step on ${S.current.num_slots} slots`;
    }
    const waiting = S.waiting && S.proposals[S.waiting];
    const proposed = waiting ? waiting.plan : S.candidate && S.candidate.plan;
    if (proposed) {
      NereusPlanMap.render($("map-proposed"), proposed, { compareTo: S.current });
      $("map-proposed-label").textContent = waiting
        ? `proposal ${pid(S.waiting)}, waiting: predicted ${num(proposed.predicted_step_s)} s/step`
        : `last candidate (${S.candidate.reason}): predicted ${num(proposed.predicted_step_s)} s/step`;
    }
  }

  function drawProposal() {
    const box = $("proposal");
    const p = S.waiting && S.proposals[S.waiting];
    box.hidden = !p;
    if (!p) return;
    const v = p.verdict || {};
    $("proposal-body").replaceChildren();
    const text = document.createElement("p");
    // Both sides as admission priced them, with what the job had measured by then (the running
    // plan's own prediction dates from when it was chosen, a deferred candidate's from when it
    // was planned).
    const before = v.current_s ?? (v.saving_s != null ? p.plan.predicted_step_s + v.saving_s : null);
    const after = v.candidate_s ?? p.plan.predicted_step_s;
    text.textContent = `Proposal ${pid(S.waiting)}: ${v.reason || "plan change"} — predicted ` +
      `${num(before)} → ${num(after)} s/step; ` +
      `transition cost ${num(v.cost_s)} s, saving ${num(v.saving_s)} s/step, payback ` +
      `${num(v.payback_steps)} steps against a horizon of ${num(v.horizon_steps)} steps (gamma ${v.gamma}).` +
      (p.route === "restart"
        ? " Approving restarts the job: its state is saved and loaded onto this plan (a checkpoint/restart, not a live transition; the cost above is the restart's)."
        : "") +
      (p.decidedBy ? ` ${p.decision} by ${p.decidedBy}: waiting for the controller.` : "");
    $("proposal-body").appendChild(text);
    const form = $("decide-form");
    if (form) {
      form.hidden = Boolean(p.decidedBy) || !p.row;
      if (p.row) form.action = cfg.decide_url.replace("{id}", p.row);
      form.dataset.proposal = p.row || "";
    }
  }

  // --- transitions --------------------------------------------------------------------------
  function nodeStates(t) {
    // Per-node reports (transition.node events) win; the simulated engine reports the transition
    // as a whole, so its nodes take the transition's outcome.
    const states = {};
    for (const n of t.dag.nodes) {
      const reported = t.reported[n.id];
      states[n.id] = (reported && reported.state) ||
        (n.state !== "pending" ? n.state : t.ok ? "done" : "failed");
    }
    return states;
  }

  // A transition executing now: the compiled DAG (control.transition_started) with its nodes'
  // states as the engine reports them; control.transition brings the measured times when done.
  function liveNode(d) {
    if (!S.live) S.live = { nodes: {}, step: S.lastStep ? S.lastStep.step : null };
    S.live.nodes[d.node] = { ...(S.live.nodes[d.node] || {}), ...d };
    drawLive();
  }

  function drawLive() {
    const live = S.live;
    if (!live) return;
    const reported = Object.values(live.nodes).map((n) => ({ id: n.node, kind: n.kind || "node",
      model_stage: n.model_stage || "", slots: [], predicted_s: n.predicted_s, actual_s: n.actual_s,
      state: n.state, error: n.error }));
    // With the compiled DAG, its nodes and edges; a node the engine reported takes its state.
    const dag = live.dag || { nodes: reported, edges: [], critical_path: [] };
    const states = Object.fromEntries(dag.nodes.map((n) => [n.id, "pending"]));
    for (const n of reported) states[n.id] = n.state;
    const values = Object.values(states);
    const done = values.filter((s) => s === "done").length;
    const running = values.filter((s) => s === "running").length;
    $("dag-summary").textContent = `Transition ${S.transitions.length + 1} executing after step ` +
      `${live.step ?? "–"}: ${done} of ${dag.nodes.length} nodes done, ${running} running (live` +
      (live.dag ? `; predicted ${num(live.predicted_s)} s, critical path (thick) ` +
        `${num(live.dag.critical_path_s)} s).` : "; edges appear when it completes).");
    $("dag").dataset.state = "running";
    $("dag").dataset.transition = S.transitions.length + 1;
    NereusDag.render($("dag"), dag, states);
  }

  function drawTransitions() {
    const body = $("transitions").tBodies[0];
    body.replaceChildren();
    S.transitions.slice().reverse().forEach((t) => {
      const tr = row(body, [t.index, t.step ?? "–", t.nodes, num(t.dag.critical_path_s), num(t.predicted_s),
        num(t.actual_s), t.ok ? "done" : `failed: ${t.failure}`], t === S.shown ? "selected" : "");
      tr.addEventListener("click", () => { S.shown = t; drawTransitions(); });
      body.appendChild(tr);
    });
    const t = S.shown;
    if (S.live) { drawLive(); return; }
    if (!t) return;
    const states = nodeStates(t);
    const perNode = t.dag.nodes.some((n) => t.reported[n.id] || n.state !== "pending");
    $("dag-summary").textContent = `Transition ${t.index} (${t.simulated ? "simulated" : "real"}): ` +
      `${t.ok ? "complete" : "failed"} — ${plural(t.nodes, "node")}, predicted ${num(t.predicted_s)} s, actual ` +
      `${num(t.actual_s)} s; critical path (thick) ${num(t.dag.critical_path_s)} s of moving state` +
      (t.rebuild_s && t.nodes ? `, then ${num(t.rebuild_s)} s rebuilding engines in their new layouts.` : ".") +
      (t.nodes === 0
        ? ` No state moved: only units rebuilt every step anyway (inference, generation) took ` +
          `their new layouts, in ${num(t.rebuild_s)} s.`
        : "") +
      ((t.dag.joining || []).length
        ? ` ${t.dag.joining.length} new units were built while the first step generated on the ` +
          `built ones (predicted to cost that step ${num(t.dag.joining_s)} s).`
        : "") +
      (perNode ? "" : " The simulated engine reports the transition as a whole, so node states " +
        "follow its outcome and per-node actual times are not reported.");
    $("dag").dataset.state = t.ok ? "done" : "failed";
    $("dag").dataset.transition = t.index;
    NereusDag.render($("dag"), t.dag, states);
  }

  // --- calibration --------------------------------------------------------------------------
  function drawCalibration() {
    const d = S.lastStep;
    const stages = $("calibration-stages");
    stages.replaceChildren(row(stages, ["stage", "predicted s", "measured s", "predicted ÷ measured"]));
    if (d && d.ok && S.current) {
      for (const s of S.current.stages) {
        const measured = d.stage_s[s.stage];
        stages.appendChild(row(stages, [s.stage, num(s.predicted_s), num(measured), num(s.predicted_s / measured)]));
      }
    }
    const ops = $("calibration-ops");
    ops.replaceChildren(row(ops, ["operation class", "seconds per step (all model-stages)"]));
    if (S.current) {
      const total = {};
      for (const ms of S.current.model_stages) {
        for (const [op, s] of Object.entries(ms.breakdown || {})) total[op] = (total[op] || 0) + s;
      }
      for (const [op, s] of Object.entries(total).sort((a, b) => b[1] - a[1])) ops.appendChild(row(ops, [op, num(s)]));
    }
    if (S.calibration && window.Plotly) {  // control.calibration: the runtime's learned efficiencies
      $("calibration-none").hidden = true;
      $("chart-calibration").hidden = false;
      const eff = S.calibration.efficiency || {};
      const traces = [{ type: "bar", x: Object.keys(eff), y: Object.values(eff), name: "calibrated" }];
      const probed = (S.probes && S.probes.efficiency) || {};
      if (Object.keys(probed).length) {  // control.probes: each class timed alone at the start
        traces.push({ type: "bar", x: Object.keys(probed), y: Object.values(probed), name: "probed alone" });
      }
      Plotly.react("chart-calibration", traces,
        NereusLive.layout("efficiency (achieved ÷ peak)", { xaxis: { title: { text: "operation class" }, tickangle: -35, automargin: true } }), plotConfig);
    }
  }

  // --- decisions log ------------------------------------------------------------------------
  function log(event, trigger, outcome, reason, economics) {
    const body = $("decisions").tBodies[0];
    const step = S.lastStep ? S.lastStep.step : "–";
    body.prepend(row(body, [step, event, trigger, outcome, reason, economics]));
  }
  const triggerText = (t) => (t ? `${t.kind}${t.signal ? " " + t.signal : ""}: ` +
    `${String(t.detail || "").replaceAll(" -> ", " → ")}` : "");  // "->" broke across lines
  // H's source: the trigger's signal, and the pool's too when the saving holds at every recent
  // length (the controller's outlook).
  const economics = (v, outlook) => {
    if (!v) return "";
    const signals = ((outlook && outlook.signals) || []).filter(Boolean);  // none for a failed step
    return `${num(v.cost_s)} s / ${num(v.saving_s)} s per step / ${num(v.payback_steps)} steps ` +
      `(H ${num(v.horizon_steps)}${signals.length ? ` from ${signals.join(", ")}` : ""})`;
  };

  // The links' load (control.links, and the gauges of a control.probes round): a round that
  // measured nothing leaves the load calibration still uses on show, and says so.
  function showLinkLoad(d) {
    const loads = Object.entries(d.load || {}).map(([link, v]) => `${link} ×${num(v)}`);
    const el = $("link-load");
    if (!loads.length) {
      if (d.failure && !el.hidden) el.textContent += ` (not measured after step ${d.step}: ${d.failure})`;
      return;
    }
    el.hidden = false;
    el.textContent = `Link load after step ${d.step} (a collective's time alone against its ` +
      `first, as calibration prices the links): ${loads.join(", ")}` +
      (d.simulated ? " (simulated)" : "");
  }

  // --- dispatch -----------------------------------------------------------------------------
  NereusLive.on((event) => {
    const d = event.data;
    const record = d.record || {};
    switch (event.kind) {
      case "step.finished": onStep(d); break;
      case "job.started": label(d.simulated); break;
      case "job.driver_lost":
        log("driver lost", "", "a new driver takes over", `epoch ${d.epoch} silent for ${num(d.silent_s)} s`, "");
        break;
      case "engine.revoked": case "engine.granted": {
        const kind = event.kind.replace("engine.", "");
        S.triggers.push({ kind, step: S.lastStep ? S.lastStep.step : 0, detail: `slot ${d.slot} ${kind}` });
        log(kind, `slot ${d.slot}`, "", "the cluster's move", "");
        redrawSoon();
        break;
      }
      case "engine.reclaim_announced":
        S.triggers.push({ kind: "revoked", step: S.lastStep ? S.lastStep.step : 0,
          detail: `slots ${(d.slots || []).join(", ")} to go in ${num(d.notice_s)} s` });
        log("reclaim announced", `slots ${(d.slots || []).join(", ")}`, `within ${num(d.notice_s)} s`,
          "the job moves off them while they hold their state", "");
        redrawSoon();
        break;
      case "engine.released": case "engine.reclaimed": case "engine.reclaim_withdrawn": {
        const what = { "engine.released": ["released", "the job was off it"],
          "engine.reclaimed": ["reclaimed", "its deadline passed, state and all"],
          "engine.reclaim_withdrawn": ["kept", "a resize gave it back before it went"] }[event.kind];
        log(what[0], `slot ${d.slot}`, "", what[1], "");
        break;
      }
      case "scenario.skipped":
        log("scenario", "", `${d.move} skipped`, d.reason || "", "");
        break;
      case "command.resize":
        log("resize", "", `by ${d.by}`, `pool of ${d.slots} slots` +
          (d.notice_s ? `, ${num(d.notice_s)} s notice` : ", at once"), "");
        break;
      case "engine.slots_lost":
        log("slots lost", `slots ${(d.slots || []).join(", ")}`, `group re-formed in ${num(d.reform_s)} s`, "", "");
        break;
      case "engine.resumed":
        log("resumed", "", `from the checkpoint of step ${d.step}`, "a new driver took over", "");
        break;
      case "engine.step_failed":
        log("step failed", `step ${d.step}`, "", d.error || "", "");
        break;
      case "engine.checkpoint_unusable":
        log("checkpoint unusable", `step ${d.step}`, "the one before it is used", d.error || "", "");
        break;
      case "engine.restart_retried":
        log("restart retried", "", "a slot died while loading: loaded again", d.error || "", "");
        break;
      case "control.trigger": onTrigger(d); break;
      case "control.plan":
        S.current = d.plan; drawMaps(); drawCalibration();
        log("plan", "", "running", d.reason || "", `predicted ${num(d.plan.predicted_step_s)} s/step`);
        break;
      case "control.decision":
        if (d.candidate) S.candidate = { plan: d.candidate, reason: d.reason };
        S.target = d.candidate || null;  // what a following transition moves to (as the server does)
        log("decision", triggerText(d.trigger), d.admit ? "admitted" : "kept the plan", d.reason,
          economics(d.verdict, d.outlook));
        drawMaps();
        break;
      case "control.proposal":
        S.proposals[d.proposal] = { plan: d.plan, verdict: d.verdict, row: record.proposal, route: d.route };
        S.waiting = d.proposal;
        log("proposal", "", `proposal ${pid(d.proposal)}: waiting for approval`, (d.verdict || {}).reason || "",
          economics(d.verdict, d.outlook));
        drawProposal(); drawMaps();
        break;
      case "command.approve": case "command.reject": {
        const p = S.proposals[d.proposal];
        if (p) { p.decidedBy = d.by; p.decision = event.kind === "command.approve" ? "approved" : "rejected"; }
        // An override (a person's plan) has no controller id: its row is the number people use.
        log(event.kind.replace("command.", ""), "", `proposal ${d.proposal_row ?? pid(d.proposal)} by ${d.by}`,
          d.comment || "", "");
        drawProposal();
        break;
      }
      case "control.approved": case "control.rejected": case "control.expired": case "control.stale": {
        const outcome = event.kind.replace("control.", "");
        if (outcome === "approved" && S.proposals[d.proposal]) S.target = S.proposals[d.proposal].plan;
        if (S.waiting === d.proposal) S.waiting = null;
        log(outcome, "", `proposal ${pid(d.proposal)}`, d.reason || "", "");
        drawProposal(); drawMaps();
        break;
      }
      case "proposals.stale": case "proposals.expired":  // by the service: the job ended, a
        // new driver took it over, or the deadline passed
        for (const [id, p] of Object.entries(S.proposals)) {
          if ((d.proposals || []).includes(p.row) && String(S.waiting) === id) S.waiting = null;
        }
        log(event.kind.replace("proposals.", ""), "", `proposals ${(d.proposals || []).join(", ")}`, d.reason || "", "");
        drawProposal(); drawMaps();
        break;
      case "job.state":
        if (NereusLive.TERMINAL.includes(d.state)) { S.waiting = null; drawProposal(); }
        break;
      case "command.applied":
        log("command", "", d.command === "resize" ? `resize: ${d.outcome}`
          : `${d.command} ${d.command === "override" ? d.proposal : pid(d.proposal)}: ${d.outcome}`, "", "");
        break;
      case "control.override_refused":
        log("override refused", d.step != null ? `at step ${d.step}` : "", "kept the running plan",
          d.reason || "", "");
        break;
      case "control.transition": {
        const reported = S.live ? S.live.nodes : {};
        const t = { ...d, index: S.transitions.length + 1, reported,
          step: S.live && S.live.step != null ? S.live.step : S.lastStep ? S.lastStep.step : null };
        S.live = null;
        label(d.simulated);
        S.transitions.push(t);
        S.shown = t;
        if (d.ok && S.target) { S.current = S.target; S.target = null; }
        log("transition", "", d.ok ? "done" : "failed", d.failure || "",
          `predicted ${num(d.predicted_s)} s, actual ${num(d.actual_s)} s`);
        drawTransitions(); drawMaps(); drawCalibration();
        break;
      }
      case "control.building_ahead":
        label(d.simulated);
        log("building ahead", `after step ${d.step}`, `${d.units} new units on idle slots`,
          d.proposal
            ? `built while proposal #${d.proposal} waits; approved, its transition waits only for what is left`
            : "built while the next step runs on the current plan; the transition follows that step",
          `predicted ${num(d.predicted_s)} s`);
        break;
      case "control.transition_started":
        S.live = { nodes: {}, step: S.lastStep ? S.lastStep.step : null, dag: d.dag,
          predicted_s: d.predicted_s };
        label(d.simulated);
        drawLive();
        break;
      case "transition.groups":
        if (!S.live) S.live = { nodes: {}, step: S.lastStep ? S.lastStep.step : null };
        drawLive();
        break;
      case "transition.node": liveNode(d); break;
      case "control.restart":
        if (S.target) { S.current = S.target; S.target = null; }
        log("restart", "", `from checkpoint in ${num(d.seconds)} s`, d.reason || "", "");
        drawMaps();
        break;
      case "control.relaxed":
        log("relaxed", "", "", d.reason || "", "");
        break;
      case "control.calibration":
        S.calibration = d; drawCalibration();
        break;
      case "control.links":  // the links timed again: their load against the first probing
        showLinkLoad(d);
        break;
      case "control.probes": {
        showLinkLoad(d);
        // a later round (a new node's links) adds to the earlier ones
        S.probes = { ...d, efficiency: { ...((S.probes && S.probes.efficiency) || {}), ...(d.efficiency || {}) } };
        const timed = Object.keys(d.efficiency || {}).length;
        const gauged = Object.keys(d.load || {}).length;
        const what = timed ? `${timed} operation class${timed === 1 ? "" : "es"}` :
          `the links' gauge${gauged === 1 ? "" : "s"} (their load only)`;
        log("probes", "", `${what} timed alone in ${num(d.seconds)} s`,
          d.failure || "calibration starts from what they measured", "");
        label(d.simulated);
        drawCalibration();
        break;
      }
      case "job.exported":
        if ($("artifacts") && $("artifacts").hidden) {
          $("artifacts").hidden = false;
          $("artifacts-note").textContent = `The trained ${d.artifact} was exported ` +
            `(${d.architecture}, ${num(d.bytes / 1e6)} MB, weights after step ${d.step}): ` +
            "reload the page for its files, or run nereus download.";
        }
        break;
      case "job.export_failed":
        log("export failed", "", "", d.reason || "", "");
        break;
      case "job.finished":
        $("job-summary").textContent = d.simulated
          ? `Finished (${d.status}): ${d.steps} steps in ${num(d.simulated_s, 4)} simulated seconds, ` +
            `${plural(d.transitions, "transition")}, ${plural(d.restarts, "restart")}.` + hindsight(d.hindsight)
          : `Finished (${d.status}): ${d.steps} steps in ${num(d.wall_s, 4)} s, ` +
            `${plural(d.transitions, "transition")} (${num(d.transition_s)} s), ${plural(d.restarts, "restart")}, final mean reward ` +
            `${num(d.mean_reward)}.`;
        break;
      default:
    }
  });
  // A simulated job's last word: why its transitions were made, and whether the moves made for
  // their saving truly repaid on the hidden true model (runtime/engine/hindsight.py).
  function hindsight(h) {
    if (!h || !h.transitions) return "";
    const why = Object.entries(h.transitions).filter(([, n]) => n > 0)
      .map(([reason, n]) => `${reason} ${n}`).join(", ");
    let text = why ? ` Transitions made for: ${why}.` : "";
    if (h.moves_for_saving > 0) {
      text += ` In hindsight (the simulated true model), ${h.repaid} of ` +
        `${plural(h.moves_for_saving, "move")} made for their saving repaid their cost; ` +
        `their true saving less their cost: ${h.net_s >= 0 ? "+" : ""}${Number(h.net_s).toFixed(1)} s.`;
    }
    return text;
  }

  NereusLive.onTheme(() => { drawCharts(); drawCalibration(); });
  window.addEventListener("DOMContentLoaded", () => { drawCharts(); drawCalibration(); });
})();
