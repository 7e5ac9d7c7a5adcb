// deltaq's console: polls /console/api/overview, draws /console/api/history with uPlot, and
// acts through the API's own admin endpoints (after a confirmation).
"use strict";

const REFRESH_MS = 1500;
const state = { token: sessionStorage.getItem("deltaq-token") || "", selected: null, chart: null };

function headers() {
  return state.token ? { Authorization: `Bearer ${state.token}` } : {};
}

async function api(method, path) {
  const response = await fetch(path, { method, headers: headers() });
  if (response.status === 401) {
    document.getElementById("token-form").hidden = false;
    throw new Error("a token is needed (E_AUTH_FAILED)");
  }
  const text = await response.text();
  if (!response.ok) {
    let code = text;
    try { code = JSON.parse(text).message; } catch (e) { /* not JSON */ }
    throw new Error(`${method} ${path}: ${response.status} ${code}`);
  }
  return text ? JSON.parse(text) : null;
}

function setStatus(text, error) {
  const status = document.getElementById("status");
  status.textContent = text;
  status.className = error ? "status error" : "status";
}

function fmt(value, digits) {
  if (value === null || value === undefined) return "–";
  return digits ? value.toFixed(digits) : String(value);
}

function cell(row, text, className) {
  const td = row.insertCell();
  td.textContent = text;
  if (className) td.className = className;
  return td;
}

function button(td, label, action) {
  const b = document.createElement("button");
  b.textContent = label;
  b.dataset.action = label;
  b.addEventListener("click", action);
  td.appendChild(b);
}

async function act(what, path, query) {
  if (!confirm(`${what}?`)) return;
  try {
    await api("POST", `${path}?${new URLSearchParams(query)}`);
    setStatus(`${what}: done`);
    await refresh();
  } catch (e) {
    setStatus(e.message, true);
  }
}

function actions(td, kind, query, paused) {
  const label = kind === "topic" ? `topic ${query.topic}` : `channel ${query.topic}/${query.channel}`;
  const base = `/${kind}`;
  if (paused) button(td, "unpause", () => act(`Unpause ${label}`, `${base}/unpause`, query));
  else button(td, "pause", () => act(`Pause ${label}`, `${base}/pause`, query));
  button(td, "empty", () => act(`Empty ${label}`, `${base}/empty`, query));
  button(td, "delete", () => act(`Delete ${label} and its tables`, `${base}/delete`, query));
}

function select(topic, channel) {
  state.selected = { topic, channel };
  document.getElementById("detail").hidden = false;
  document.getElementById("channel-tools").hidden = !channel;
  document.getElementById("detail-title").textContent = channel ? `${topic} / ${channel}` : topic;
  document.getElementById("lookup").textContent = "";
  document.querySelector("#peek tbody").textContent = "";
  if (state.chart) { state.chart.destroy(); state.chart = null; }
  drawChart();
  if (channel) peek();
}

function render(overview) {
  const body = document.querySelector("#topics tbody");
  body.textContent = "";
  for (const t of overview.topics) {
    const row = body.insertRow();
    row.className = "topic" + (t.paused ? " paused" : "");
    row.dataset.topic = t.name;
    const name = cell(row, "");
    const link = document.createElement("a");
    link.className = "select";
    link.textContent = t.name;
    link.addEventListener("click", () => select(t.name, null));
    name.appendChild(link);
    if (t.refused) {
      // The table uses a Delta feature deltaq cannot keep working with: say which.
      const why = document.createElement("div");
      why.className = "refused";
      why.textContent = `refused: ${t.refused}`;
      name.appendChild(why);
    }
    cell(row, fmt(t.depth), "depth");
    cell(row, ""); cell(row, ""); cell(row, ""); cell(row, ""); cell(row, ""); cell(row, "");
    cell(row, fmt(t.publish_rate, 1), "publish-rate");
    cell(row, "");
    cell(row, `topic v${t.version}`);
    cell(row, fmt(t.commit_rate, 1));
    actions(cell(row, "", "actions"), "topic", { topic: t.name }, t.paused);
    for (const c of t.channels) {
      const crow = body.insertRow();
      crow.className = "channel" + (c.paused ? " paused" : "");
      crow.dataset.topic = t.name;
      crow.dataset.channel = c.name;
      const cname = cell(crow, "");
      const clink = document.createElement("a");
      clink.className = "select";
      clink.textContent = c.name;
      clink.addEventListener("click", () => select(t.name, c.name));
      cname.appendChild(clink);
      if (c.filter) {
        // A filtered channel: its filter and how many messages it kept out.
        const filtered = document.createElement("div");
        filtered.className = "filter";
        filtered.textContent = `filter: ${c.filter} (${fmt(c.filtered)} kept out)`;
        cname.appendChild(filtered);
      }
      cell(crow, fmt(c.depth), "depth");
      cell(crow, fmt(c.in_flight), "in-flight");
      cell(crow, fmt(c.deferred));
      cell(crow, fmt(c.dead), "dead");
      cell(crow, fmt(c.requeued));
      cell(crow, fmt(c.timed_out));
      cell(crow, fmt(c.clients));
      cell(crow, "");
      cell(crow, fmt(c.fin_rate, 1), "fin-rate");
      const delta = cell(crow, c.elsewhere
        ? `served by ${c.elsewhere}`
        : c.fanout_behind
          ? `fanout behind: topic v${c.topic_data_version}, here through v${c.fanned_topic_version}`
          : "fanout caught up", "delta");
      // The tables' versions, for whoever looks for them (none before the first row).
      if (!c.elsewhere && c.table_version >= 0) {
        delta.title = `table v${c.table_version}, ledger v${c.ledger_version}`;
      }
      cell(crow, fmt(c.ledger_commit_rate, 1));
      actions(cell(crow, "", "actions"), "channel", { topic: t.name, channel: c.name }, c.paused);
    }
  }
}

async function drawChart() {
  const selected = state.selected;
  if (!selected) return;
  const query = new URLSearchParams({ topic: selected.topic });
  if (selected.channel) query.set("channel", selected.channel);
  let series;
  try {
    series = await api("GET", `/console/api/history?${query}`);
  } catch (e) {
    setStatus(e.message, true);
    return;
  }
  const names = selected.channel
    ? ["depth", "in_flight", "fin_rate", "requeue_rate", "timeout_rate"]
    : ["depth", "publish_rate", "commit_rate"];
  const colors = ["#1d4ed8", "#b45309", "#047857", "#9333ea", "#dc2626"];
  const data = [series.t, ...names.map((n) => series[n])];
  if (state.chart) {
    state.chart.setData(data);
    return;
  }
  const chart = document.getElementById("chart");
  chart.textContent = "";
  state.chart = new uPlot(
    {
      width: Math.max(400, chart.clientWidth || 900),
      height: 260,
      series: [{}, ...names.map((n, i) => ({ label: n.replace("_", " "), stroke: colors[i], spanGaps: true }))],
      axes: [{}, { size: 60 }],
    },
    data,
    chart,
  );
}

async function peek() {
  const selected = state.selected;
  if (!selected || !selected.channel) return;
  const query = new URLSearchParams({ topic: selected.topic, channel: selected.channel, n: "10" });
  const body = document.querySelector("#peek tbody");
  try {
    const answer = await api("GET", `/console/api/peek?${query}`);
    body.textContent = "";
    for (const m of answer.messages) {
      const row = body.insertRow();
      cell(row, m.id); cell(row, String(m.attempts)); cell(row, m.body);
    }
  } catch (e) {
    setStatus(e.message, true);
  }
}

function time(us) {
  return us === null || us === undefined ? "" : new Date(us / 1000).toISOString();
}

async function lookup(event) {
  event.preventDefault();
  const selected = state.selected;
  const id = document.getElementById("lookup-id").value.trim();
  const out = document.getElementById("lookup");
  out.textContent = "";
  const query = new URLSearchParams({ topic: selected.topic, channel: selected.channel, id });
  try {
    const found = await api("GET", `/console/api/message?${query}`);
    const info = document.createElement("p");
    info.textContent = found.message
      ? `published ${time(found.message.published_at_us)}, topic version ${found.message.topic_version}: ${found.message.body}`
      : "row no longer in the channel's table";
    out.appendChild(info);
    const table = document.createElement("table");
    table.id = "history";
    const head = table.createTHead().insertRow();
    for (const h of ["event", "attempt", "at", "consumer", "lease until", "deliver at"]) cell(head, h);
    const rows = table.createTBody();
    for (const e of found.events) {
      const row = rows.insertRow();
      cell(row, e.event, "event"); cell(row, String(e.attempt)); cell(row, time(e.at_us));
      cell(row, e.consumer || ""); cell(row, time(e.lease_expires_at_us)); cell(row, time(e.deliver_at_us));
    }
    out.appendChild(table);
  } catch (e) {
    out.textContent = e.message;
  }
}

async function create(event) {
  event.preventDefault();
  const topic = document.getElementById("create-topic").value.trim();
  const channel = document.getElementById("create-channel").value.trim();
  if (!confirm(channel ? `Create channel ${topic}/${channel}?` : `Create topic ${topic}?`)) return;
  try {
    await api("POST", `/topic/create?${new URLSearchParams({ topic })}`);
    if (channel) await api("POST", `/channel/create?${new URLSearchParams({ topic, channel })}`);
    setStatus("created");
    await refresh();
  } catch (e) {
    setStatus(e.message, true);
  }
}

async function refresh() {
  try {
    const overview = await api("GET", "/console/api/overview");
    render(overview);
    const problem = overview.storage && overview.storage.problem;
    const jobsError = overview.jobs && overview.jobs.error;
    if (problem) {
      setStatus(`writes fail: ${problem} (${overview.storage.refused} refused)`, true);
    } else if (jobsError) {
      setStatus(`no fanout or sweep: ${jobsError}`, true);
    } else {
      setStatus(`updated ${new Date().toLocaleTimeString()}`);
    }
    document.body.dataset.refreshed = String(Date.now());
    if (state.selected) await drawChart();
  } catch (e) {
    setStatus(e.message, true);
  }
}

document.getElementById("token-form").addEventListener("submit", (event) => {
  event.preventDefault();
  state.token = document.getElementById("token").value.trim();
  sessionStorage.setItem("deltaq-token", state.token);
  document.getElementById("token-form").hidden = true;
  refresh();
});
document.getElementById("create-form").addEventListener("submit", create);
document.getElementById("lookup-form").addEventListener("submit", lookup);
document.getElementById("peek-refresh").addEventListener("click", peek);
refresh();
setInterval(refresh, REFRESH_MS);
