// Lineage Cluster operator console. Agent data is only ever placed in the page as text
// (textContent, never innerHTML), and the page runs under a CSP without inline script.
"use strict";

const TOKEN_KEY = "lineage-admin-token";
const LOG_PAGE = 50;
const QUEUE_PAGE = 1000;
let selectedAgent = null;
// The log page shows the records just below this seq; null: the newest.
let logBefore = null;

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
    error.code = data && data.code;
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
    const who = await api("GET", "/v1/whoami");
    if (who.kind === "agent") throw new Error("That is an agent's token; sign in with an operator's.");
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

// Who is signed in (GET /v1/whoami): a named operator is recorded by name; the shared
// admin token names whoever the request body names ("console").
let me = null;

async function enter() {
  $("signin-view").hidden = true;
  $("main-view").hidden = false;
  $("signout").hidden = false;
  try {
    me = await api("GET", "/v1/whoami");
    $("whoami").textContent = me.kind === "operator"
      ? "signed in as " + me.name + " (" + me.role + ")"
      : "signed in with the shared admin token (unattributed)";
  } catch (error) {
    showError(error);
  }
  refresh();
}

// The name sent with an approval or rejection: none for a named operator (the cluster
// records its own name), "console" for the shared admin token.
function approverName() {
  return me && me.kind === "operator" ? undefined : "console";
}

async function refresh() {
  showError(null);
  try {
    await Promise.all([loadCluster(), loadAgents(), loadQueue()]);
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
    let contact = "this node";
    if (node.reachable === true) contact = node.last_contact_ms + " ms ago";
    else if (node.reachable === false) contact = node.last_contact_ms == null
      ? "UNREACHABLE" : "UNREACHABLE (" + (node.last_contact_ms / 1000).toFixed(1) + " s)";
    row.append(el("td", node.id), el("td", node.addr), el("td", node.role),
      el("td", node.matched_index ?? "–"), el("td", node.lag ?? "–"),
      el("td", contact, node.reachable === false ? "state-quarantined" : ""));
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
    const status = entry.status;
    const waiting = status && status.actions_pending > 0;
    const row = el("tr", null, "clickable" + (waiting ? " has-pending" : ""));
    row.dataset.agent = entry.agent_id;
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
  logBefore = null;
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
  await loadLog(agentId);
}

// Every agent's actions waiting for approval. Rows are kept by agent and action id and
// the list is changed only where the queue changed, so a refresh never wipes (or takes
// the focus from) a note being typed.
async function loadQueue() {
  const page = await api("GET", "/v1/actions/pending?limit=" + QUEUE_PAGE);
  const count = $("queue-count");
  count.textContent = String(page.total);
  count.className = "count" + (page.total > 0 ? " waiting" : "");
  // Entries whose request does not read back intact on this node are named, never shown.
  const unreadable = page.unreadable || [];
  $("queue-more").textContent = (page.next
    ? (page.total - page.pending.length - unreadable.length) + " more are waiting beyond the first " + QUEUE_PAGE + "."
    : "") + (unreadable.length
    ? " " + unreadable.length + " cannot be shown: the request does not read back intact on this node (" +
      unreadable.map(u => u.agent_id + " " + u.action_id).join(", ") + ")."
    : "");
  const key = (agent, action) => agent + "\u0000" + action;
  const list = $("pending");
  const wanted = new Set(page.pending.map(item => key(item.agent_id, item.action.action_id)));
  for (const li of Array.from(list.children)) {
    if (!wanted.has(key(li.dataset.agent, li.dataset.action))) li.remove();
  }
  const shown = new Set(Array.from(list.children).map(li => key(li.dataset.agent, li.dataset.action)));
  for (const item of page.pending) {
    if (!shown.has(key(item.agent_id, item.action.action_id))) list.append(pendingRow(item.agent_id, item));
  }
  if (list.children.length === 0) list.append(el("li", "Nothing is waiting."));
}

function pendingRow(agentId, item) {
  const action = item.action;
  const li = el("li", null, "pending-row");
  li.dataset.agent = agentId;
  li.dataset.action = action.action_id;
  li.append(el("strong", agentId + " · " + action.action_id + " · " + action.tool + " · cost " + action.cost),
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
    { approver: approverName(), note: note.value || null }));
  const reject = el("button", "Reject", "reject danger");
  reject.addEventListener("click", () => decide(agentId, action.action_id, "reject",
    { approver: approverName(), reason: reason.value || "rejected in the console", scar: scar.value || null }));
  const controls = el("div", null, "controls");
  controls.append(note, approve, reason, scar, reject);
  li.append(controls);
  return li;
}

async function decide(agentId, actionId, verb, body) {
  try {
    const decision = await api("POST", agentPath(agentId, "/actions/" + encodeURIComponent(actionId) + "/" + verb), body);
    showError(null);
    $("verify-result").textContent = agentId + " " + actionId + ": " + decision.decision;
  } catch (error) {
    // Someone else decided it first (another operator, another console): say so.
    if (error.status === 409) {
      showError(agentId + " " + actionId + " was already decided by someone else (409: " + error.message + ")");
    } else {
      showError(error);
    }
  }
  const shown = $("error").textContent;
  await refresh();
  if (shown) $("error").textContent = shown;
}

async function loadLog(agentId) {
  const before = logBefore === null ? "" : "&before=" + logBefore;
  const page = await api("GET", agentPath(agentId, "/log?limit=" + LOG_PAGE + before));
  const body = $("log-table").tBodies[0];
  body.replaceChildren();
  for (const record of page.records.slice().reverse()) {
    const row = el("tr");
    const payload = el("td"); payload.append(el("pre", JSON.stringify(record.payload)));
    row.append(el("td", record.seq), el("td", record.timestamp), el("td", record.kind), payload);
    body.append(row);
  }
  const total = page.head ? page.head.seq + 1 : 0;
  const oldest = page.records.length ? page.records[0].seq : null;
  const newest = page.records.length ? page.records[page.records.length - 1].seq : null;
  $("log-range").textContent = oldest === null
    ? "no records"
    : "records " + newest + "–" + oldest + " of " + total;
  $("log-older").disabled = oldest === null || oldest === 0;
  $("log-newer").disabled = logBefore === null;
  $("log-newest").disabled = logBefore === null;
  $("log-older").dataset.before = oldest === null ? "" : String(oldest);
  $("log-newer").dataset.before = newest === null ? "" : String(newest + 1 + LOG_PAGE);
  $("log-newer").dataset.total = String(total);
}

async function pageLog(which) {
  if (!selectedAgent) return;
  if (which === "newest") {
    logBefore = null;
  } else {
    const before = Number($("log-" + which).dataset.before);
    const total = Number($("log-newer").dataset.total);
    logBefore = which === "newer" && before >= total ? null : before;
  }
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
  $("log-newest").addEventListener("click", () => pageLog("newest"));
  $("log-newer").addEventListener("click", () => pageLog("newer"));
  $("log-older").addEventListener("click", () => pageLog("older"));
  if (token()) enter();
  setInterval(() => { if (token()) refresh(); }, 5000);
});
