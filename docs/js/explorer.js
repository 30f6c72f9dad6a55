// The layout explorer (docs/explorer.md). It looks figures up in window.REFMP_EXPLORER, the
// table docs/_hooks/explorer.py computed with refmp's cost model while the site was built (a
// model's layouts in explorer/<model>.js, loaded when the model is chosen), and draws them; it
// computes no figure of its own (only units for people, and bar widths).
(function () {
  "use strict";
  const T = window.REFMP_EXPLORER;
  const root = document.getElementById("refmp-explorer");
  if (!T || !root) {
    return;
  }
  const FIELDS = Object.keys(T.choices);
  const LABELS = {
    model: "model", machine: "machine", tp: "tensor parallel, tp", pp: "pipeline stages, pp",
    cp: "context parallel, cp", ep: "expert parallel, ep", microbatches: "micro-batches, M",
    sequence_parallel: "sequence parallel", zero: "ZeRO stage", recompute: "recomputation",
    mixed_precision: "precision", schedule: "schedule",
    cp_ulysses: "hierarchical cp: Ulysses group, U", dp_shard: "HSDP: shard group, dp ranks (0: all)",
    etp: "MoE folding: expert tensor parallel, etp",
    fp8: "FP8 linears (scaling)", weight_gather: "ZeRO-3 weight gathers",
  };
  const NAMES = {  // what a choice is called on the page, where not its value
    mixed_precision: {none: "fp32"},
    etp: {0: "off (experts copied over tp)"},
    fp8: {none: "off", tensor: "current (per tensor)", delayed: "delayed (amax history)", mxfp8: "MXFP8"},
    weight_gather: {none: "the compute dtype", fp8: "FP8 (MXFP8)"},
  };
  const state = {model: "gpt2", machine: Object.keys(T.machines)[0]};
  FIELDS.forEach((f) => { state[f] = 0; });  // the index of each field's choice
  state.microbatches = T.choices.microbatches.indexOf(8);

  function load(model) {  // a model's layouts, by a script tag (it works from disk too)
    if (T.layouts[model] || document.getElementById(`explorer-data-${model}`)) {
      return;
    }
    const here = document.currentScript || document.querySelector("script[src$='explorer.js']");
    const s = el("script", {id: `explorer-data-${model}`,
                            src: new URL(`../explorer/${model}.js`, here.src).href});
    s.addEventListener("load", render);
    document.head.append(s);
  }

  function el(tag, attrs, ...children) {
    const e = document.createElement(tag);
    Object.entries(attrs || {}).forEach(([k, v]) => e.setAttribute(k, v));
    children.forEach((c) => e.append(c));
    return e;
  }

  function named(columns, row) {  // a row of the table as an object, by its column names
    return Object.fromEntries(columns.map((c, i) => [c, row[i]]));
  }

  function size(n) {  // bytes for people, as refmp.cost.memory.size prints them
    const units = ["B", "kB", "MB", "GB", "TB"];
    let i = 0;
    while (Math.abs(n) >= 1000 && i < units.length - 1) {
      n /= 1000;
      i += 1;
    }
    return `${Number(n.toPrecision(3))} ${units[i]}`;
  }

  function shown(field, value) {
    if (NAMES[field] && NAMES[field][value] !== undefined) {
      return NAMES[field][value];
    }
    if (typeof value === "boolean") {
      return value ? "on" : "off";
    }
    return value === "interleaved" ? "interleaved (v = 2)" : String(value);
  }

  function select(name, options, current) {
    const s = el("select", {name: name, id: `explorer-${name}`});
    options.forEach(([value, text]) => s.append(el("option", {value: value}, text)));
    s.value = current;
    s.addEventListener("change", () => {
      state[name] = name === "model" || name === "machine" ? s.value : Number(s.value);
      if (name === "model") {
        const moe = T.models[s.value].n_expert > 0;
        const ep = document.getElementById("explorer-ep");
        ep.disabled = !moe;  // ep > 1 only with experts
        if (!moe) {
          ep.value = 0;
          state.ep = 0;
        }
      }
      render();
    });
    return el("label", {}, el("span", {}, LABELS[name]), s);
  }

  function formula(title) {  // a link that opens the formula's box below the explorer
    const a = el("a", {href: "#the-formulas-behind-each-figure", class: "explorer-formula"}, "formula");
    a.addEventListener("click", () => {
      const box = [...document.querySelectorAll("details")].find(
        (d) => d.querySelector("summary").textContent.trim().startsWith(title));
      if (box) {
        box.open = true;
        box.scrollIntoView();
      }
    });
    return a;
  }

  const controls = el("div", {class: "explorer-controls"});
  controls.append(select("model", Object.keys(T.models).map((m) => [m, m]), state.model));
  controls.append(select("machine", Object.keys(T.machines).map((m) => [m, m]), state.machine));
  FIELDS.forEach((f) => controls.append(
    select(f, T.choices[f].map((v, i) => [i, shown(f, v)]), state[f])));
  const out = el("div", {class: "explorer-out", id: "explorer-out"});
  root.replaceChildren(controls, out);

  function memoryPanel(data, row, time, machine) {
    const mem = named(T.memory_columns, row.memory);
    Object.assign(mem, named(T.state_columns, data.states[mem.state]));
    const panel = el("section", {id: "explorer-memory"},
      el("h3", {}, "Memory per rank ", formula("Memory per rank")));
    const kinds = ["params", "grads", "optimizer", "activations", "workspace"];
    const cap = machine.gpu_memory_gb * 1e9;
    const bar = el("div", {class: "explorer-bar"});
    const table = el("table", {});
    kinds.forEach((k, i) => {
      const cell = el("td", {"data-bytes": mem[k], id: `explorer-mem-${k}`}, size(mem[k]));
      table.append(el("tr", {}, el("td", {}, el("span", {class: `explorer-key k${i}`}), k), cell));
      bar.append(el("span", {class: `k${i}`, style: `width:${Math.min(100, 100 * mem[k] / cap)}%`,
                             title: `${k}: ${size(mem[k])}`}));
    });
    table.append(el("tr", {}, el("td", {}, "needs (with the workspace)"),
      el("td", {"data-bytes": row.need, id: "explorer-need"}, size(row.need))));
    panel.append(table, bar, el("p", {id: "explorer-fits"},
      `${time.fits ? "Fits" : "Does not fit"} in the ${machine.gpu_memory_gb} GB of a GPU; ` +
      `pipeline stage ${mem.stage} needs the most. dp = ${row.dp}, b = ${row.b} ` +
      `row${row.b > 1 ? "s" : ""} a micro-batch.`));
    return panel;
  }

  function bytesPanel(moved) {
    const panel = el("section", {id: "explorer-bytes"},
      el("h3", {}, "Bytes per step, by axis ", formula("Bytes per step")));
    const table = el("table", {}, el("tr", {}, el("th", {}, "axis"), el("th", {}, "operation"),
      el("th", {}, "bytes a rank of stage 0 moves")));
    Object.entries(moved).forEach(([axis, ops]) => Object.entries(ops).forEach(([op, b]) =>
      table.append(el("tr", {}, el("td", {}, axis === "dp" ? "dp (dp x cp)" : axis),
        el("td", {}, op), el("td", {"data-bytes": b, "data-axis": axis, "data-op": op}, size(b))))));
    if (!Object.keys(moved).length) {
      table.append(el("tr", {}, el("td", {colspan: 3}, "nothing: one rank holds the whole model")));
    }
    panel.append(table);
    return panel;
  }

  function timePanel(time) {
    const panel = el("section", {id: "explorer-time"},
      el("h3", {}, "Step time ", formula("Step time")),
      el("p", {id: "explorer-step", "data-ms": time.ms},
        `${time.ms} ms per step, ${Math.round(time.tokens_per_s).toLocaleString("en")} tokens/s, ` +
        `MFU ${(100 * time.mfu).toPrecision(3)}%`));
    const table = el("table", {});
    T.time_columns.slice(4).forEach((k) => {
      table.append(el("tr", {}, el("td", {}, k), el("td", {}, `${time[k]} ms`),
        el("td", {}, el("span", {class: "explorer-term", style: `width:${200 * time[k] / time.ms}px`}))));
    });
    panel.append(table);
    return panel;
  }

  function timelinePanel() {
    const pp = T.choices.pp[state.pp];
    const schedule = T.choices.schedule[state.schedule];
    const M = T.choices.microbatches[state.microbatches];
    const tl = T.timelines[`${pp}/${schedule}/${M}`];
    const panel = el("section", {id: "explorer-timeline"},
      el("h3", {}, "The pipeline's timeline ", formula("The pipeline")));
    if (!tl) {
      panel.append(el("p", {}, `No pipeline (pp = 1): the ${M} micro-batches run one after ` +
                               "another (gradient accumulation), no bubble."));
      return panel;
    }
    const ns = "http://www.w3.org/2000/svg";
    const w = 640 / tl.makespan;
    const svg = document.createElementNS(ns, "svg");
    svg.setAttribute("viewBox", `0 0 700 ${24 * pp + 8}`);
    svg.setAttribute("class", "explorer-timeline");
    tl.events.forEach(([rank, kind, mb, chunk, start, end]) => {
      const r = document.createElementNS(ns, "rect");
      Object.entries({x: 56 + w * start, y: 4 + 24 * rank, width: w * (end - start) - 1, height: 20,
                      class: `ev-${kind}`}).forEach(([k, v]) => r.setAttribute(k, v));
      svg.append(r);
      const t = document.createElementNS(ns, "text");
      Object.entries({x: 56 + w * (start + end) / 2, y: 18 + 24 * rank, "text-anchor": "middle",
                      "font-size": 9}).forEach(([k, v]) => t.setAttribute(k, v));
      t.textContent = `${mb}${tl.v > 1 ? "ab"[Math.floor(chunk / pp)] : ""}`;
      svg.append(t);
    });
    for (let r = 0; r < pp; r += 1) {
      const t = document.createElementNS(ns, "text");
      Object.entries({x: 0, y: 18 + 24 * r, "font-size": 10}).forEach(([k, v]) => t.setAttribute(k, v));
      t.textContent = `rank ${r}`;
      svg.append(t);
    }
    panel.append(svg, el("p", {id: "explorer-bubble", "data-bubble": tl.bubble},
      `${schedule}, pp ${pp}, ${M} micro-batches: bubble ${tl.bubble.toFixed(3)} ` +
      "(forward blue, backward orange; each one step of simulated time)"));
    return panel;
  }

  function render() {
    const data = T.layouts[state.model];
    out.replaceChildren();
    if (!data) {
      out.append(el("p", {id: "explorer-loading"}, `Loading ${state.model}'s table...`));
      load(state.model);
      return;
    }
    const key = FIELDS.map((f) => state[f]).join("");
    const entry = data.layouts[key];
    if (entry === undefined) {
      out.append(el("p", {class: "explorer-refused", id: "explorer-refused"},
        "Not in the table (see what is offered below the explorer): ZeRO 2 and 3 only without " +
        "a pipeline, sequence parallelism with tp > 1, a schedule with a pipeline, tp pp cp " +
        `at most ${T.gpus}, a micro-batch count other than 8 only with a pipeline and cp = 1, ` +
        `${T.bench.join(" and ")} in fp32; FP8 with GPT-2's shape, pp = cp = ep = 1, no SP, no ` +
        "recomputation, no HSDP, over bf16; FP8 weight gathers with ZeRO-3; MoE folding (etp) " +
        "with experts over ep > 1, one stage, no cp, no recomputation, no HSDP."));
      return;
    }
    if (typeof entry === "number") {
      out.append(el("p", {class: "explorer-refused", id: "explorer-refused"},
        `refmp refuses this layout: ${data.reasons[entry]}`));
      return;
    }
    const row = named(T.columns, entry);
    const index = Object.keys(T.machines).indexOf(state.machine);
    const time = named(T.time_columns, row.time[index]);
    const machine = T.machines[state.machine];
    out.append(memoryPanel(data, row, time, machine), bytesPanel(data.bytes[row.bytes]),
               timePanel(time), timelinePanel());
  }

  document.getElementById("explorer-ep").disabled = !(T.models[state.model].n_expert > 0);
  render();
})();
