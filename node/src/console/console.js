// Lineage Cluster operator console. Agent data is only ever placed in the page as text
// (textContent, never innerHTML), and the page runs under a CSP without inline script.
"use strict";

const TOKEN_KEY = "lineage-admin-token";
const LOG_PAGE = 50;
let selectedAgent = null;
let logAfter = -1;

function $(id) { return document.getElementById(id); }

function el(tag, text, className) {
  const node = document.createElement(tag);
  if (text !== undefined && text !== null) node.textContent = String(text);
  if (className) node.className = className;
  return node;
}

function token() { return sessionStorage.getItem(TOKEN_KEY) || ""; }

async function api(method, path, body) {
  const headers = { "Authorization": "Bearer " + token() };
  const init = { method, headers };
  if (body !== undefined) {
    headers["Content-Type"] = "application/json";
    headers["Idempotency-Key"] = crypto.randomUUID();
    init.body = JSON.stringify(body);
  }
  const reply = await fetch(path, init);
  const data = await reply.json().catch(() => ({}));
  if (!reply.ok) {
    const error = new Error((data && data.error) || ("HTTP " + reply.status));
    error.status = reply.status;
    throw error;
  }
  return data;
}

function showError(error) {
  $("error").textContent = error ? String(error.message || error) : "";
}

async function signIn(event) {
  event.preventDefault();
  sessionStorage.setItem(TOKEN_KEY, $("token").value.trim());
  $("token").value = "";
  try {
    await api("GET", "/v1/agents");
    $("signin-error").textContent = "";
    enter();
  } catch (error) {
    sessionStorage.removeItem(TOKEN_KEY);
    $("signin-error").textContent = error.status === 401 ? "That token was not accepted." : String(error.message);
  }
}

function signOut() {
  sessionStorage.removeItem(TOKEN_KEY);
  location.reload();
}

function enter() {
  $("signin-view").hidden = true;
  $("main-view").hidden = false;
  $("signout").hidden = false;
  $("whoami").textContent = "operator";
  refresh();
}

async function refresh() {
  showError(null);
  try {
    await Promise.all([loadCluster(), loadAgents()]);
    if (selectedAgent) await loadAgent(selectedAgent);
  } catch (error) {
    showError(error);
  }
}

async function loadCluster() {
  const cluster = await api("GET", "/v1/cluster");
  const body = $("cluster-table").tBodies[0];
  body.replaceChildren();
  for (const node of cluster.nodes) {
    const row = el("tr");
    row.append(el("td", node.id), el("td", node.addr), el("td", node.role),
      el("td", node.matched_index ?? "–"), el("td", node.lag ?? "–"));
    body.append(row);
  }
  $("cluster-summary").textContent =
    "leader " + (cluster.leader ?? "none") + ", term " + cluster.term +
    ", applied " + (cluster.applied_index ?? 0);
}

async function loadAgents() {
  const { agents } = await api("GET", "/v1/agents");
  const body = $("agents-table").tBodies[0];
  body.replaceChildren();
  for (const entry of agents) {
    const row = el("tr", null, "clickable");
    row.dataset.agent = entry.agent_id;
    const status = entry.status;
    let state = entry.state;
    if (status && !status.alive) state = "terminated";
    row.append(el("td", entry.agent_id), el("td", state, "state-" + state));
    if (status) {
      row.append(el("td", status.spent + " / " + status.budget),
        el("td", status.scar_score + " / " + status.scar_limit),
        el("td", status.actions_pending));
    } else {
      row.append(el("td", entry.error || ""), el("td"), el("td"));
    }
    row.addEventListener("click", () => selectAgent(entry.agent_id));
    body.append(row);
  }
}

async function selectAgent(agentId) {
  selectedAgent = agentId;
  logAfter = -1;
  $("verify-result").textContent = "";
  await loadAgent(agentId).catch(showError);
}

function agentPath(agentId, rest) {
  return "/v1/agents/" + encodeURIComponent(agentId) + (rest || "");
}

async function loadAgent(agentId) {
  const status = await api("GET", agentPath(agentId));
  $("agent").hidden = false;
  $("agent-title").textContent = "Agent " + agentId;
  $("agent-status").textContent =
    (status.alive ? "active" : "terminated: " + status.termination_reason) +
    " · spent " + status.spent + " of " + status.budget +
    " · scars " + status.scar_score + " / " + status.scar_limit +
    " · head " + status.head.seq;
  $("terminate").disabled = !status.alive;
  await Promise.all([loadPending(agentId), loadLog(agentId)]);
}

async function loadPending(agentId) {
  const { pending } = await api("GET", agentPath(agentId, "/actions/pending"));
  const list = $("pending");
  // Rows are kept by agent and action id and the list is changed only where the queue
  // changed, so a refresh never wipes (or takes the focus from) a note being typed.
  const wanted = new Set(pending.map(item => item.action.action_id));
  for (const li of Array.from(list.children)) {
    const stale = li.dataset.agent !== agentId || !wanted.has(li.dataset.action);
    if (stale) li.remove();
  }
  const shown = new Set(Array.from(list.children).map(li => li.dataset.action));
  for (const item of pending) {
    if (!shown.has(item.action.action_id)) list.append(pendingRow(agentId, item));
  }
  if (list.children.length === 0) list.append(el("li", "Nothing is waiting."));
}

function pendingRow(agentId, item) {
  const action = item.action;
  const li = el("li");
  li.dataset.agent = agentId;
  li.dataset.action = action.action_id;
  li.append(el("strong", action.action_id + " · " + action.tool + " · cost " + action.cost),
    el("div", "requested " + item.requested_at));
  // The exact input the approval binds to, as text.
  li.append(el("pre", JSON.stringify(action.input, null, 2), "pending-input"));
  const note = el("input"); note.placeholder = "note (optional)"; note.className = "note";
  const reason = el("input"); reason.placeholder = "reason to reject"; reason.className = "reason";
  const scar = el("select"); scar.className = "scar";
  for (const s of ["", "minor", "moderate", "severe", "fatal"]) {
    const option = el("option", s || "no scar"); option.value = s; scar.append(option);
  }
  const approve = el("button", "Approve", "approve");
  approve.addEventListener("click", () => decide(agentId, action.action_id, "approve",
    { approver: "console", note: note.value || null }));
  const reject = el("button", "Reject", "reject danger");
  reject.addEventListener("click", () => decide(agentId, action.action_id, "reject",
    { approver: "console", reason: reason.value || "rejected in the console", scar: scar.value || null }));
  const controls = el("div", null, "controls");
  controls.append(note, approve, reason, scar, reject);
  li.append(controls);
  return li;
}

async function decide(agentId, actionId, verb, body) {
  try {
    const decision = await api("POST", agentPath(agentId, "/actions/" + encodeURIComponent(actionId) + "/" + verb), body);
    showError(null);
    $("verify-result").textContent = actionId + ": " + decision.decision;
    await refresh();
  } catch (error) {
    showError(error);
  }
}

async function loadLog(agentId) {
  const after = logAfter >= 0 ? "&after=" + logAfter : "";
  const page = await api("GET", agentPath(agentId, "/log?limit=" + LOG_PAGE + after));
  const body = $("log-table").tBodies[0];
  body.replaceChildren();
  for (const record of page.records) {
    const row = el("tr");
    const payload = el("td"); payload.append(el("pre", JSON.stringify(record.payload)));
    row.append(el("td", record.seq), el("td", record.timestamp), el("td", record.kind), payload);
    body.append(row);
  }
  const first = page.records.length ? page.records[0].seq : "–";
  const last = page.records.length ? page.records[page.records.length - 1].seq : "–";
  $("log-range").textContent = "records " + first + "–" + last + " of " + (page.head.seq + 1);
}

async function pageLog(direction) {
  if (!selectedAgent) return;
  logAfter = Math.max(-1, logAfter + direction * LOG_PAGE);
  await loadLog(selectedAgent).catch(showError);
}

async function verify() {
  if (!selectedAgent) return;
  try {
    const result = await api("GET", agentPath(selectedAgent, "/verify"));
    $("verify-result").textContent = result.ok
      ? "verified: " + result.records + " records, head " + result.head.seq + ":" + result.head.hash.slice(0, 16) + "…"
      : "FAILED: " + (result.failure.line ? "line " + result.failure.line + ": " : "") + result.failure.reason;
  } catch (error) {
    showError(error);
  }
}

async function terminate() {
  if (!selectedAgent) return;
  const reason = prompt("Terminate " + selectedAgent + " permanently? This cannot be undone.\nReason:");
  if (!reason) return;
  try {
    await api("POST", agentPath(selectedAgent, "/terminate"), { reason, by: "console" });
    await refresh();
  } catch (error) {
    showError(error);
  }
}

document.addEventListener("DOMContentLoaded", () => {
  $("signin-form").addEventListener("submit", signIn);
  $("signout").addEventListener("click", signOut);
  $("verify").addEventListener("click", verify);
  $("terminate").addEventListener("click", terminate);
  $("log-prev").addEventListener("click", () => pageLog(-1));
  $("log-next").addEventListener("click", () => pageLog(1));
  if (token()) enter();
  setInterval(() => { if (token()) refresh(); }, 5000);
});
