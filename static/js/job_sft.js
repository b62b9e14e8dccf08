// The SFT job's panels: training loss and step time (compute vs all-reduce), real slots.
"use strict";
(function () {
  let charts = false;
  const config = { displaylogo: false, responsive: true };

  function initCharts() {
    if (charts || !window.Plotly) return charts;
    Plotly.newPlot("chart-loss", [{ x: [], y: [], mode: "lines+markers", name: "loss" }],
      NereusLive.layout("loss"), config);
    Plotly.newPlot("chart-time", [
      { x: [], y: [], name: "compute", type: "scatter", mode: "lines" },
      { x: [], y: [], name: "all-reduce", type: "scatter", mode: "lines" },
      { x: [], y: [], name: "step", type: "scatter", mode: "lines" },
    ], NereusLive.layout("seconds"), config);
    charts = true;
    return charts;
  }

  NereusLive.on((event) => {
    const d = event.data;
    if (event.kind === "slots.ready") {
      document.getElementById("backend").textContent = d.backend;
    } else if (event.kind === "step.finished" && initCharts()) {
      Plotly.extendTraces("chart-loss", { x: [[d.step]], y: [[d.loss]] }, [0]);
      Plotly.extendTraces("chart-time", { x: [[d.step], [d.step], [d.step]],
        y: [[d.compute_s], [d.comm_s], [d.step_s]] }, [0, 1, 2]);
    }
  });
  NereusLive.onTheme(() => {
    if (!charts) return;
    Plotly.relayout("chart-loss", NereusLive.layout("loss"));
    Plotly.relayout("chart-time", NereusLive.layout("seconds"));
  });
  window.addEventListener("DOMContentLoaded", initCharts);
})();
