// Live job page: stream events over the websocket, resume from the last id after a reconnect.
"use strict";
(function () {
  const root = document.getElementById("job");
  const jobId = root.dataset.jobId;
  const rows = document.getElementById("events");
  const stateBadge = document.getElementById("job-state");
  const status = document.getElementById("live-status");
  const dark = window.matchMedia("(prefers-color-scheme: dark)").matches;
  const layout = (ytitle) => ({
    margin: { t: 10, r: 10, b: 70, l: 50 }, xaxis: { title: { text: "step" } },
    yaxis: { title: { text: ytitle } }, paper_bgcolor: "rgba(0,0,0,0)", plot_bgcolor: "rgba(0,0,0,0)",
    font: { color: dark ? "#e6edf3" : "#1b1f24" }, legend: { orientation: "h", y: -0.35 },
  });
  const MAX_ROWS = 300;
  let lastId = 0;
  let charts = false;
  let retryMs = 500;

  function initCharts() {
    if (charts || !window.Plotly) return charts;
    Plotly.newPlot("chart-loss", [{ x: [], y: [], mode: "lines+markers", name: "loss" }], layout("loss"),
      { displaylogo: false, responsive: true });
    Plotly.newPlot("chart-time", [
      { x: [], y: [], name: "compute", type: "scatter", mode: "lines" },
      { x: [], y: [], name: "all-reduce", type: "scatter", mode: "lines" },
      { x: [], y: [], name: "step", type: "scatter", mode: "lines" },
    ], layout("seconds"), { displaylogo: false, responsive: true });
    charts = true;
    return charts;
  }

  function addRow(event) {
    const tr = document.createElement("tr");
    for (const text of [event.id, event.at.slice(11, 23), event.kind, JSON.stringify(event.data)]) {
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
    addRow(event);
    const d = event.data;
    if (event.kind === "job.state") {
      stateBadge.textContent = d.state;
      stateBadge.className = "state state-" + d.state;
    } else if (event.kind === "slots.ready") {
      document.getElementById("backend").textContent = d.backend;
    } else if (event.kind === "step.finished" && initCharts()) {
      Plotly.extendTraces("chart-loss", { x: [[d.step]], y: [[d.loss]] }, [0]);
      Plotly.extendTraces("chart-time", { x: [[d.step], [d.step], [d.step]],
        y: [[d.compute_s], [d.comm_s], [d.step_s]] }, [0, 1, 2]);
    }
  }

  function connect() {
    const scheme = location.protocol === "https:" ? "wss" : "ws";
    const ws = new WebSocket(`${scheme}://${location.host}/ws/jobs/${jobId}/?after=${lastId}`);
    ws.onopen = () => { status.textContent = "live"; retryMs = 500; };
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
  window.addEventListener("DOMContentLoaded", () => { initCharts(); connect(); });
})();
