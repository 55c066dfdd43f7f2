// ShardMQ management UI: plain JS, no build step. It only calls the public HTTP API (/api/...),
// with the Basic credentials entered at login (kept in sessionStorage for this tab).
"use strict";

const state = { auth: sessionStorage.getItem("shardmq-auth"), timer: null, samples: [] };

function esc(s) {
  return String(s === undefined || s === null ? "" : s).replace(/[&<>"']/g,
    (c) => ({ "&": "&amp;", "<": "&lt;", ">": "&gt;", '"': "&quot;", "'": "&#39;" }[c]));
}
const enc = encodeURIComponent;
const $ = (id) => document.getElementById(id);

async function api(method, path, body) {
  const opts = { method, headers: { Authorization: "Basic " + state.auth } };
  if (body !== undefined) {
    opts.headers["Content-Type"] = "application/json";
    opts.body = JSON.stringify(body);
  }
  const resp = await fetch(path, opts);
  if (resp.status === 401 && path !== "/api/whoami") { logout(); throw new Error("not authorised"); }
  const text = await resp.text();
  const data = text ? JSON.parse(text) : null;
  if (!resp.ok) throw new Error((data && data.reason) || resp.statusText);
  return data;
}

function flash(el, text, ok) { el.textContent = text; el.className = ok ? "ok" : "error"; }

// ------------------------------------------------------------------- login
$("login-form").addEventListener("submit", async (ev) => {
  ev.preventDefault();
  state.auth = btoa($("login-user").value + ":" + $("login-pass").value);
  try {
    const me = await api("GET", "/api/whoami");
    sessionStorage.setItem("shardmq-auth", state.auth);
    $("whoami").textContent = me.name;
    show(true);
  } catch (e) {
    state.auth = null;
    flash($("login-error"), "Login failed: " + e.message, false);
  }
});
$("logout").addEventListener("click", logout);

function logout() {
  sessionStorage.removeItem("shardmq-auth");
  state.auth = null;
  show(false);
}

function show(loggedIn) {
  $("login").classList.toggle("hidden", loggedIn);
  $("app").classList.toggle("hidden", !loggedIn);
  if (loggedIn) route();
}

// ------------------------------------------------------------------- routing
window.addEventListener("hashchange", route);

function route() {
  if (!state.auth) return;
  clearInterval(state.timer);
  const parts = (location.hash || "#/overview").slice(2).split("/").map(decodeURIComponent);
  const page = parts[0] || "overview";
  document.querySelectorAll("header nav a").forEach((a) => a.classList.toggle("active", a.id === "nav-" + page));
  const pages = { overview, connections, channels, exchanges, queues, queue, exchange, admin };
  const fn = pages[page] || overview;
  const run = () => fn(...parts.slice(1)).catch((e) => { $("main").innerHTML = `<p class="error">${esc(e.message)}</p>`; });
  run();
  if (["overview", "queues", "connections", "channels", "queue"].includes(page)) state.timer = setInterval(run, 5000);
  refreshAlarms();
}

async function refreshAlarms() {
  try {
    const ov = await api("GET", "/api/overview");
    const el = $("alarms");
    el.classList.toggle("hidden", !ov.alarms.length);
    el.textContent = ov.alarms.length ? "Resource alarm in effect: " + ov.alarms.join(", ") + " — publishers are blocked" : "";
  } catch (e) { /* shown by the page */ }
}

function table(id, columns, rows, opts = {}) {
  const head = columns.map((c) => `<th data-sort="${esc(c.sort || "")}" class="${c.num ? "num" : ""}">${esc(c.title)}</th>`).join("");
  const body = rows.map((r) => "<tr>" + columns.map((c) =>
    `<td class="${c.num ? "num" : ""}">${c.html ? c.html(r) : esc(c.value(r))}</td>`).join("") + "</tr>").join("");
  return `<table id="${id}"><thead><tr>${head}</tr></thead><tbody>${body || `<tr><td colspan="${columns.length}">${esc(opts.empty || "none")}</td></tr>`}</tbody></table>`;
}

// ------------------------------------------------------------------ overview
async function overview() {
  const ov = await api("GET", "/api/overview");
  const t = ov.object_totals, q = ov.queue_totals;
  const rate = (k) => ((ov.message_stats || {})[k + "_details"] || { rate: 0 }).rate;
  state.samples.push({ t: Date.now(), ready: q.messages_ready, unacked: q.messages_unacknowledged,
    publish: rate("publish"), deliver: rate("deliver_get"), ack: rate("ack") });
  state.samples = state.samples.slice(-60);
  const totals = [["Connections", t.connections], ["Channels", t.channels], ["Exchanges", t.exchanges],
    ["Queues", t.queues], ["Consumers", t.consumers], ["Ready", q.messages_ready],
    ["Unacked", q.messages_unacknowledged], ["Total messages", q.messages]];
  $("main").innerHTML = `<h2>Overview</h2>
    <p>${esc(ov.product_name)} ${esc(ov.product_version)} on node <b>${esc(ov.node)}</b></p>
    <div class="totals" id="totals">${totals.map(([k, v]) =>
      `<div class="total" id="total-${esc(k.toLowerCase().replace(/ /g, "-"))}"><b>${esc(v)}</b>${esc(k)}</div>`).join("")}</div>
    <h3>Queued messages (sampled every 5 s)</h3><canvas id="chart" width="720" height="140"></canvas>
    <h3>Message rates (per second)</h3><canvas id="rates" width="720" height="140"></canvas>
    <h3>Listeners</h3>${table("listeners", [{ title: "Protocol", value: (l) => l.protocol },
      { title: "Address", value: (l) => l.ip_address }, { title: "Port", value: (l) => l.port, num: true }], ov.listeners)}`;
  drawChart($("chart"), state.samples, [["ready", "#2d7be5"], ["unacked", "#e5892d"]]);
  drawChart($("rates"), state.samples, [["publish", "#2d7be5"], ["deliver", "#1b7f3b"], ["ack", "#e5892d"]]);
}

function drawChart(canvas, samples, series) {
  const ctx = canvas.getContext("2d");
  const w = canvas.width, h = canvas.height, pad = 24;
  ctx.clearRect(0, 0, w, h);
  const max = Math.max(1, ...samples.flatMap((s) => series.map(([k]) => s[k] || 0)));
  ctx.fillStyle = "#666"; ctx.font = "11px sans-serif"; ctx.fillText(String(max), 2, 12); ctx.fillText("0", 2, h - 4);
  for (const [key, color] of series) {
    ctx.strokeStyle = color; ctx.lineWidth = 2; ctx.beginPath();
    samples.forEach((s, i) => {
      const x = pad + (i * (w - pad - 4)) / Math.max(1, samples.length - 1);
      const y = h - pad / 2 - ((s[key] / max) * (h - pad));
      if (i) ctx.lineTo(x, y); else ctx.moveTo(x, y);
    });
    ctx.stroke();
  }
  series.forEach(([key, color], i) => { ctx.fillStyle = color; ctx.fillText(key, w - 60 * (series.length - i), 12); });
}

// --------------------------------------------------------------- connections
async function connections() {
  const rows = await api("GET", "/api/connections");
  $("main").innerHTML = `<h2>Connections</h2>${table("connections-table", [
    { title: "Name", value: (c) => c.name }, { title: "User", value: (c) => c.user }, { title: "Vhost", value: (c) => c.vhost },
    { title: "Client", value: (c) => (c.client_properties.product || "") + " " + (c.client_properties.connection_name || "") },
    { title: "Channels", value: (c) => c.channels, num: true }, { title: "State", value: (c) => c.state },
    { title: "", html: (c) => `<button class="close-conn" data-name="${esc(c.name)}">Close</button>` }], rows)}`;
  document.querySelectorAll(".close-conn").forEach((b) => b.addEventListener("click", async () => {
    if (!confirm("Close connection " + b.dataset.name + "?")) return;
    await api("DELETE", "/api/connections/" + enc(b.dataset.name));
    connections();
  }));
}

async function channels() {
  const rows = await api("GET", "/api/channels");
  $("main").innerHTML = `<h2>Channels</h2>${table("channels-table", [
    { title: "Channel", value: (c) => c.name }, { title: "User", value: (c) => c.user },
    { title: "Prefetch", value: (c) => c.prefetch_count, num: true }, { title: "Consumers", value: (c) => c.consumer_count, num: true },
    { title: "Unacked", value: (c) => c.messages_unacknowledged, num: true },
    { title: "Unconfirmed", value: (c) => c.messages_unconfirmed, num: true }], rows)}`;
}

// ----------------------------------------------------------------- exchanges
async function exchanges() {
  const rows = await api("GET", "/api/exchanges");
  $("main").innerHTML = `<h2>Exchanges</h2>${table("exchanges-table", [
    { title: "Vhost", value: (x) => x.vhost },
    { title: "Name", html: (x) => `<a href="#/exchange/${enc(x.vhost)}/${enc(x.name || "amq.default")}">${esc(x.name || "(AMQP default)")}</a>` },
    { title: "Type", value: (x) => x.type }, { title: "Durable", value: (x) => x.durable }], rows)}
    <fieldset><legend>Add an exchange</legend><form class="inline" id="add-exchange">
      <input name="vhost" value="/" size="8"> <input name="name" placeholder="name" required>
      <select name="type"><option>direct</option><option>fanout</option><option>topic</option><option>headers</option></select>
      <label><input type="checkbox" name="durable" checked> durable</label><button>Add</button><span id="add-exchange-msg"></span></form></fieldset>`;
  $("add-exchange").addEventListener("submit", async (ev) => {
    ev.preventDefault();
    const f = ev.target;
    try {
      await api("PUT", `/api/exchanges/${enc(f.vhost.value)}/${enc(f.name.value)}`, { type: f.type.value, durable: f.durable.checked });
      exchanges();
    } catch (e) { flash($("add-exchange-msg"), e.message, false); }
  });
}

async function exchange(vhost, name) {
  const x = await api("GET", `/api/exchanges/${enc(vhost)}/${enc(name)}`);
  const src = name === "amq.default" ? [] : await api("GET", `/api/exchanges/${enc(vhost)}/${enc(name)}/bindings/source`);
  $("main").innerHTML = `<h2>Exchange ${esc(x.name || "(AMQP default)")} <small>in ${esc(vhost)}</small></h2>
    <p>type ${esc(x.type)}, durable ${esc(x.durable)}, arguments ${esc(JSON.stringify(x.arguments))}</p>
    <h3>Bindings from this exchange</h3>${table("exchange-bindings", [{ title: "To", value: (b) => b.destination },
      { title: "Kind", value: (b) => b.destination_type }, { title: "Routing key", value: (b) => b.routing_key }], src)}
    ${publishForm(vhost, name, "")}
    ${x.name && !x.name.startsWith("amq.") ? `<button id="delete-exchange">Delete this exchange</button>` : ""}`;
  wirePublish(vhost, name);
  const del = $("delete-exchange");
  if (del) del.addEventListener("click", async () => {
    if (!confirm("Delete exchange " + name + "?")) return;
    await api("DELETE", `/api/exchanges/${enc(vhost)}/${enc(name)}`);
    location.hash = "#/exchanges";
  });
}

function publishForm(vhost, exchangeName, routingKey) {
  return `<fieldset><legend>Publish message</legend><form id="publish-form">
    <div class="bar"><label>Routing key <input name="routing_key" id="publish-key" value="${esc(routingKey)}"></label>
    <label><input type="checkbox" name="persistent"> persistent</label></div>
    <textarea name="payload" id="publish-payload" placeholder="payload"></textarea>
    <div class="bar"><button id="publish-button">Publish message</button><span id="publish-msg"></span></div></form></fieldset>`;
}

function wirePublish(vhost, exchangeName) {
  $("publish-form").addEventListener("submit", async (ev) => {
    ev.preventDefault();
    const f = ev.target;
    try {
      const r = await api("POST", `/api/exchanges/${enc(vhost)}/${enc(exchangeName)}/publish`, {
        routing_key: f.routing_key.value, payload: f.payload.value, payload_encoding: "string",
        properties: f.persistent.checked ? { delivery_mode: 2 } : {} });
      flash($("publish-msg"), r.routed ? "Message published." : "Message published, but not routed.", r.routed);
    } catch (e) { flash($("publish-msg"), e.message, false); }
  });
}

// -------------------------------------------------------------------- queues
const qstate = { page: 1, sort: "name", reverse: false, filter: "" };

async function queues() {
  const params = new URLSearchParams({ page: qstate.page, page_size: 50, sort: qstate.sort, sort_reverse: qstate.reverse });
  if (qstate.filter) params.set("name", qstate.filter);
  let data;
  try {
    data = await api("GET", "/api/queues?" + params);
  } catch (e) {
    if (qstate.page > 1) { qstate.page = 1; return queues(); }
    throw e;
  }
  $("main").innerHTML = `<h2>Queues <small>(${data.filtered_count} of ${data.total_count})</small></h2>
    <div class="bar"><input id="queue-filter" placeholder="filter by name" value="${esc(qstate.filter)}">
      <button id="prev-page" ${data.page <= 1 ? "disabled" : ""}>&lt;</button>
      <span id="page-info">page ${data.page} of ${data.page_count}</span>
      <button id="next-page" ${data.page >= data.page_count ? "disabled" : ""}>&gt;</button></div>
    ${table("queues-table", [
      { title: "Vhost", value: (q) => q.vhost, sort: "vhost" },
      { title: "Name", html: (q) => `<a class="queue-link" href="#/queue/${enc(q.vhost)}/${enc(q.name)}">${esc(q.name)}</a>`, sort: "name" },
      { title: "Type", value: (q) => q.type },
      { title: "Ready", value: (q) => q.messages_ready, num: true, sort: "messages_ready" },
      { title: "Unacked", value: (q) => q.messages_unacknowledged, num: true, sort: "messages_unacknowledged" },
      { title: "Total", value: (q) => q.messages, num: true, sort: "messages" },
      { title: "Consumers", value: (q) => q.consumers, num: true, sort: "consumers" }], data.items)}
    <fieldset><legend>Add a queue</legend><form class="inline" id="add-queue">
      <input name="vhost" value="/" size="8"> <input name="name" placeholder="name" required>
      <label><input type="checkbox" name="durable" checked> durable</label><button>Add queue</button><span id="add-queue-msg"></span></form></fieldset>`;
  $("queue-filter").addEventListener("change", (ev) => { qstate.filter = ev.target.value; qstate.page = 1; queues(); });
  $("prev-page").addEventListener("click", () => { qstate.page -= 1; queues(); });
  $("next-page").addEventListener("click", () => { qstate.page += 1; queues(); });
  document.querySelectorAll("#queues-table th").forEach((th) => th.addEventListener("click", () => {
    if (!th.dataset.sort) return;
    qstate.reverse = qstate.sort === th.dataset.sort ? !qstate.reverse : false;
    qstate.sort = th.dataset.sort;
    queues();
  }));
  $("add-queue").addEventListener("submit", async (ev) => {
    ev.preventDefault();
    const f = ev.target;
    try {
      await api("PUT", `/api/queues/${enc(f.vhost.value)}/${enc(f.name.value)}`, { durable: f.durable.checked });
      queues();
    } catch (e) { flash($("add-queue-msg"), e.message, false); }
  });
}

async function queue(vhost, name) {
  if ($("queue-page") && $("queue-page").dataset.key === vhost + "/" + name && document.activeElement &&
      document.activeElement.tagName !== "BODY" && document.activeElement.id !== "refresh") {
    return; // the user is typing in a form: do not redraw under them
  }
  const [q, bindings, consumers] = await Promise.all([
    api("GET", `/api/queues/${enc(vhost)}/${enc(name)}`),
    api("GET", `/api/queues/${enc(vhost)}/${enc(name)}/bindings`),
    api("GET", `/api/consumers/${enc(vhost)}`)]);
  const mine = consumers.filter((c) => c.queue.name === name);
  $("main").innerHTML = `<div id="queue-page" data-key="${esc(vhost + "/" + name)}">
    <h2>Queue <span id="queue-name">${esc(q.name)}</span> <small>in ${esc(vhost)}</small></h2>
    <div class="totals"><div class="total"><b id="queue-ready">${q.messages_ready}</b>Ready</div>
      <div class="total"><b id="queue-unacked">${q.messages_unacknowledged}</b>Unacked</div>
      <div class="total"><b id="queue-total">${q.messages}</b>Total</div>
      <div class="total"><b id="queue-consumers">${q.consumers}</b>Consumers</div></div>
    <p>type ${esc(q.type)}, durable ${esc(q.durable)}, auto-delete ${esc(q.auto_delete)}, exclusive ${esc(q.exclusive)},
      arguments ${esc(JSON.stringify(q.arguments))}, policy ${esc(q.policy || "none")}</p>
    <h3>Consumers</h3>${table("queue-consumers-table", [{ title: "Tag", value: (c) => c.consumer_tag },
      { title: "Channel", value: (c) => c.channel_details.name }, { title: "Ack required", value: (c) => c.ack_required },
      { title: "Prefetch", value: (c) => c.prefetch_count, num: true }], mine)}
    <h3>Bindings</h3>${table("queue-bindings", [{ title: "From", value: (b) => b.source || "(AMQP default)" },
      { title: "Routing key", value: (b) => b.routing_key }], bindings)}
    <form class="inline" id="bind-form"><input name="source" placeholder="exchange" required>
      <input name="routing_key" placeholder="routing key"><button>Bind</button><span id="bind-msg"></span></form>
    ${publishForm(vhost, "", name)}
    <fieldset><legend>Get messages</legend><form class="inline" id="get-form">
      <select name="ackmode" id="get-ackmode"><option value="ack_requeue_true">Nack message requeue true</option>
        <option value="ack_requeue_false">Ack message requeue false</option></select>
      <label>Messages <input name="count" value="1" size="3"></label><button id="get-button">Get message(s)</button></form>
      <div id="got"></div></fieldset>
    <div class="bar"><button id="purge-button">Purge messages</button><button id="delete-button">Delete queue</button>
      <span id="queue-msg"></span></div></div>`;
  wirePublish(vhost, "amq.default");
  $("bind-form").addEventListener("submit", async (ev) => {
    ev.preventDefault();
    const f = ev.target;
    try {
      await api("POST", `/api/bindings/${enc(vhost)}/e/${enc(f.source.value)}/q/${enc(name)}`, { routing_key: f.routing_key.value });
      queue(vhost, name);
    } catch (e) { flash($("bind-msg"), e.message, false); }
  });
  $("get-form").addEventListener("submit", async (ev) => {
    ev.preventDefault();
    const f = ev.target;
    const msgs = await api("POST", `/api/queues/${enc(vhost)}/${enc(name)}/get`, {
      count: parseInt(f.count.value, 10) || 1, ackmode: f.ackmode.value, encoding: "auto", truncate: 50000 });
    $("got").innerHTML = msgs.length ? msgs.map((m, i) => `<h4>Message ${i + 1}</h4>
      <p>exchange ${esc(m.exchange || "(AMQP default)")}, routing key ${esc(m.routing_key)}, redelivered ${esc(m.redelivered)},
      properties ${esc(JSON.stringify(m.properties))}, ${m.message_count} remaining</p>
      <pre class="msg got-payload">${esc(m.payload)}</pre>`).join("") : `<p id="queue-empty">Queue is empty</p>`;
  });
  $("purge-button").addEventListener("click", async () => {
    if (!confirm("Purge all ready messages of " + name + "?")) return;
    await api("DELETE", `/api/queues/${enc(vhost)}/${enc(name)}/contents`);
    flash($("queue-msg"), "Queue purged.", true);
  });
  $("delete-button").addEventListener("click", async () => {
    if (!confirm("Delete queue " + name + "?")) return;
    await api("DELETE", `/api/queues/${enc(vhost)}/${enc(name)}`);
    location.hash = "#/queues";
  });
}

// --------------------------------------------------------------------- admin
async function admin() {
  const [vhosts, users, perms, policies] = await Promise.all([api("GET", "/api/vhosts"), api("GET", "/api/users"),
    api("GET", "/api/permissions"), api("GET", "/api/policies")]);
  $("main").innerHTML = `<h2>Admin</h2>
    <h3>Virtual hosts</h3>${table("vhosts-table", [{ title: "Name", value: (v) => v.name },
      { title: "Description", value: (v) => v.description }, { title: "Messages", value: (v) => v.messages, num: true },
      { title: "", html: (v) => `<button class="del-vhost" data-name="${esc(v.name)}">Delete</button>` }], vhosts)}
    <form class="inline" id="add-vhost"><input name="name" placeholder="vhost" required><input name="description" placeholder="description">
      <button>Add vhost</button></form>
    <h3>Users</h3>${table("users-table", [{ title: "Name", value: (u) => u.name }, { title: "Tags", value: (u) => u.tags.join(", ") },
      { title: "", html: (u) => `<button class="del-user" data-name="${esc(u.name)}">Delete</button>` }], users)}
    <form class="inline" id="add-user"><input name="name" placeholder="user" required><input name="password" type="password" placeholder="password">
      <input name="tags" placeholder="tags (comma separated)"><button>Add user</button></form>
    <h3>Permissions</h3>${table("permissions-table", [{ title: "User", value: (p) => p.user }, { title: "Vhost", value: (p) => p.vhost },
      { title: "Configure", value: (p) => p.configure }, { title: "Write", value: (p) => p.write }, { title: "Read", value: (p) => p.read }], perms)}
    <form class="inline" id="set-perm"><input name="user" placeholder="user" required><input name="vhost" value="/" size="8">
      <input name="configure" value=".*" size="6"><input name="write" value=".*" size="6"><input name="read" value=".*" size="6">
      <button>Set permission</button></form>
    <h3>Policies</h3>${table("policies-table", [{ title: "Vhost", value: (p) => p.vhost }, { title: "Name", value: (p) => p.name },
      { title: "Pattern", value: (p) => p.pattern }, { title: "Apply to", value: (p) => p["apply-to"] },
      { title: "Definition", value: (p) => JSON.stringify(p.definition) }, { title: "Priority", value: (p) => p.priority, num: true },
      { title: "", html: (p) => `<button class="del-policy" data-vhost="${esc(p.vhost)}" data-name="${esc(p.name)}">Delete</button>` }], policies)}
    <form class="inline" id="set-policy"><input name="vhost" value="/" size="8"><input name="name" placeholder="name" required>
      <input name="pattern" placeholder="pattern" required><input name="definition" placeholder='{"max-length": 1000}' required>
      <select name="apply"><option>all</option><option>queues</option><option>exchanges</option></select>
      <input name="priority" value="0" size="3"><button>Set policy</button></form>
    <h3>Definitions</h3>
    <div class="bar"><button id="export-defs">Download definitions</button></div>
    <textarea id="import-defs" placeholder="paste a definitions JSON here"></textarea>
    <div class="bar"><button id="import-button">Upload definitions</button></div>
    <p id="admin-msg"></p>`;
  const msg = (e, ok) => flash($("admin-msg"), e, ok);
  const submit = (id, fn) => $(id).addEventListener("submit", async (ev) => {
    ev.preventDefault();
    try { await fn(ev.target); admin(); } catch (e) { msg(e.message, false); }
  });
  submit("add-vhost", (f) => api("PUT", "/api/vhosts/" + enc(f.name.value), { description: f.description.value }));
  submit("add-user", (f) => api("PUT", "/api/users/" + enc(f.name.value), { password: f.password.value, tags: f.tags.value }));
  submit("set-perm", (f) => api("PUT", `/api/permissions/${enc(f.vhost.value)}/${enc(f.user.value)}`,
    { configure: f.configure.value, write: f.write.value, read: f.read.value }));
  submit("set-policy", (f) => api("PUT", `/api/policies/${enc(f.vhost.value)}/${enc(f.name.value)}`,
    { pattern: f.pattern.value, definition: JSON.parse(f.definition.value), "apply-to": f.apply.value, priority: parseInt(f.priority.value, 10) || 0 }));
  const clicks = (cls, fn) => document.querySelectorAll(cls).forEach((b) => b.addEventListener("click", async () => {
    if (!confirm("Delete " + b.dataset.name + "?")) return;
    try { await fn(b.dataset); admin(); } catch (e) { msg(e.message, false); }
  }));
  clicks(".del-vhost", (d) => api("DELETE", "/api/vhosts/" + enc(d.name)));
  clicks(".del-user", (d) => api("DELETE", "/api/users/" + enc(d.name)));
  clicks(".del-policy", (d) => api("DELETE", `/api/policies/${enc(d.vhost)}/${enc(d.name)}`));
  $("export-defs").addEventListener("click", async () => {
    const defs = await api("GET", "/api/definitions");
    const a = document.createElement("a");
    a.href = URL.createObjectURL(new Blob([JSON.stringify(defs, null, 2)], { type: "application/json" }));
    a.download = "shardmq-definitions.json";
    a.click();
  });
  $("import-button").addEventListener("click", async () => {
    try {
      await api("POST", "/api/definitions", JSON.parse($("import-defs").value));
      msg("Definitions imported.", true);
    } catch (e) { msg(e.message, false); }
  });
}

// -------------------------------------------------------------------- start
(async () => {
  if (state.auth) {
    try {
      const me = await api("GET", "/api/whoami");
      $("whoami").textContent = me.name;
      show(true);
      return;
    } catch (e) { state.auth = null; }
  }
  show(false);
})();
