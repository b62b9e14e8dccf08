// Submit page: show the fields of the chosen kind, and preview the planned layout and predicted
// step time (the server runs the planner on exactly what the form would submit).
"use strict";
(function () {
  window.addEventListener("DOMContentLoaded", () => {
    const form = document.getElementById("submit-form");
    const kind = form.elements.kind;
    const panel = document.getElementById("preview");
    const summary = document.getElementById("preview-summary");
    const problems = document.getElementById("preview-errors");

    // A job's name starts as "<kind>-demo"; it follows the kind until the user types their own.
    const defaultName = (value) => `${value || "sft"}-demo`;
    let shownKind = kind.value;

    function showKind() {
      for (const set of form.querySelectorAll("fieldset[data-kind]")) {
        set.hidden = !set.dataset.kind.split(" ").includes(kind.value || "sft");
      }
      const name = form.elements.name;
      if (name && name.value === defaultName(shownKind)) name.value = defaultName(kind.value);
      shownKind = kind.value;
    }
    kind.addEventListener("change", showKind);
    showKind();

    function clearErrors() {
      for (const el of form.querySelectorAll(".preview-error")) el.remove();
      problems.textContent = "";
    }

    function fieldError(name, text) {
      const input = form.elements[name];
      const p = document.createElement("span");
      p.className = "errorlist preview-error";
      p.textContent = text;
      if (input && input.closest) input.closest("label").appendChild(p);
      else problems.textContent += text + " ";
    }

    async function preview() {
      clearErrors();
      panel.hidden = false;
      summary.textContent = "planning…";
      let reply;
      try {
        const response = await fetch(form.dataset.previewUrl, {
          method: "POST", body: new FormData(form), credentials: "same-origin",
          headers: { "X-Requested-With": "fetch" },
        });
        reply = await response.json();
      } catch (err) {
        summary.textContent = "";
        problems.textContent = "preview failed: " + err;
        return;
      }
      if (!reply.ok) {
        summary.textContent = "Fix the fields marked below to see the plan.";
        for (const [name, list] of Object.entries(reply.errors)) {
          for (const e of list) fieldError(name === "__all__" ? "" : name, e.message);
        }
        NereusPlanMap.render(document.getElementById("preview-map"), null);
        document.getElementById("preview-stages").replaceChildren();
        return;
      }
      const p = reply.preview;
      document.getElementById("preview-label").textContent = p.simulated ? "(simulated)" : "(real CPU slots)";
      summary.textContent = p.predicted_step_s == null
        ? `${p.plan.num_slots} slots; ${p.note}.`
        : `Predicted step time ${p.predicted_step_s.toFixed(2)} s on ${p.plan.num_slots} slots ` +
          `at generated length ${p.gen_len}; ${p.note}.`;
      const table = document.getElementById("preview-stages");
      table.replaceChildren();
      const head = table.insertRow();
      for (const t of ["model-stage", "(dp, tp, pp)", "predicted s"]) {
        const th = document.createElement("th"); th.textContent = t; head.appendChild(th);
      }
      for (const ms of p.plan.model_stages) {
        const row = table.insertRow();
        const l = ms.layout;
        for (const t of [ms.name, `(${l.dp}, ${l.tp}, ${l.pp})`,
          ms.predicted_s == null ? "—" : ms.predicted_s.toFixed(3)]) row.insertCell().textContent = t;
      }
      NereusPlanMap.render(document.getElementById("preview-map"), p.plan);
    }
    document.getElementById("preview-button").addEventListener("click", preview);
  });
})();
