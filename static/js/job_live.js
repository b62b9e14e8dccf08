// Live job page: stream events over the websocket, resume from the last id after a reconnect, and
// hand every event to the page's panels (job_sft.js or job_ppo.js register with NereusLive.on).
"use strict";
window.NereusLive = (function () {
  const handlers = [];
  const MAX_ROWS = 300;
  let lastId = 0;
  const TERMINAL = ["succeeded", "failed", "cancelled"];
  const themeHandlers = [];
  let retryMs = 500;
  let ended = false;  // the job reached a final state: nothing more will come

  function theme() {
    const dark = window.matchMedia("(prefers-color-scheme: dark)").matches;
    return { font: { color: dark ? "#e6edf3" : "#1b1f24" }, grid: dark ? "#30363d" : "#d8dde3" };
  }

  function layout(ytitle, extra) {
    const t = theme();
    return Object.assign({
      margin: { t: 10, r: 10, b: 70, l: 55 },
      xaxis: { title: { text: "step" }, gridcolor: t.grid },
      yaxis: { title: { text: ytitle }, gridcolor: t.grid },
      paper_bgcolor: "rgba(0,0,0,0)", plot_bgcolor: "rgba(0,0,0,0)",
      font: t.font, legend: { orientation: "h", y: -0.3 },
    }, extra || {});
  }

  function addRow(rows, event) {
    const tr = document.createElement("tr");
    const data = JSON.stringify(event.data);
    for (const text of [event.id, event.at.slice(11, 23), event.kind,
      data.length > 400 ? data.slice(0, 400) + "…" : data]) {
      const td = document.createElement("td");
      td.textContent = text;
      tr.appendChild(td);
    }
    rows.prepend(tr);
    while (rows.childElementCount > MAX_ROWS) rows.lastElementChild.remove();  // the log keeps all
  }

  function handle(event) {
    if (event.id <= lastId) return;
    lastId = event.id;
    document.body.dataset.lastEvent = String(lastId);
    addRow(document.getElementById("events"), event);
    if (event.kind === "job.state") {
      const badge = document.getElementById("job-state");
      badge.textContent = event.data.state;
      badge.className = "state state-" + event.data.state;
      const cancel = document.getElementById("cancel-form");
      if (cancel && TERMINAL.includes(event.data.state)) cancel.hidden = true;
      const pool = document.getElementById("pool-form");
      if (pool && TERMINAL.includes(event.data.state)) pool.hidden = true;
      ended = TERMINAL.includes(event.data.state);
      if (ended) document.getElementById("live-status").textContent = "ended";
    }
    for (const h of handlers) {
      try { h(event); } catch (err) { console.error("panel failed on event", event.id, err); }
    }
  }

  function connect() {
    const status = document.getElementById("live-status");
    const jobId = document.getElementById("job").dataset.jobId;
    const scheme = location.protocol === "https:" ? "wss" : "ws";
    const ws = new WebSocket(`${scheme}://${location.host}/ws/jobs/${jobId}/?after=${lastId}`);
    ws.onopen = () => { status.textContent = ended ? "ended" : "live"; retryMs = 500; };
    ws.onmessage = (msg) => {
      const frame = JSON.parse(msg.data);
      if (frame.type === "event") handle(frame.event);
      else if (frame.type === "error") console.warn("server:", frame.code, frame.message);
    };
    ws.onclose = (e) => {
      if (e.code === 4401 || e.code === 4404) { status.textContent = "not allowed"; return; }
      status.textContent = "reconnecting…";
      setTimeout(connect, retryMs);
      retryMs = Math.min(retryMs * 2, 10000);
    };
  }

  window.addEventListener("DOMContentLoaded", connect);
  // Cancelling cannot be undone (the job stops at its next step): ask first.
  window.addEventListener("DOMContentLoaded", () => {
    const cancel = document.getElementById("cancel-form");
    if (cancel) cancel.addEventListener("submit", (e) => {
      if (!window.confirm("Cancel this job? It stops at its next step; this cannot be undone.")) e.preventDefault();
    });
  });
  // Dark mode follows the system setting, live: charts are redrawn with the new colours.
  window.matchMedia("(prefers-color-scheme: dark)").addEventListener("change", () => {
    for (const h of themeHandlers) h();
  });
  return { on: (h) => handlers.push(h), onTheme: (h) => themeHandlers.push(h), layout, theme, TERMINAL };
})();
