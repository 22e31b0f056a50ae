"""lineage_guard: the Python client for Lineage Cluster, in one file, standard library only.

It speaks the guard's HTTP API, so it works against a Lineage Cluster and against the
single-node reference guard server alike. Give it one node's URL or several: every call
goes to the node that answered last, and moves on to the next node when one is down or
has no leader (HTTP 503), until ``retry_for`` seconds have passed. Each write carries an
``Idempotency-Key`` chosen once per call and sent again on every retry, so a call that
is retried on another node after a leader failure is decided and charged once.

    from lineage_guard import ActionDenied, AgentClient, connect_admin

    admin = connect_admin()                 # GUARD_URL(S), GUARD_ADMIN_TOKEN, or guard-data/
    created = admin.create_agent("bot", {"budget": 10, "scar_limit": 10,
                                         "tools": {"search": {"cost": 1}}})
    agent = AgentClient(admin.urls, "bot", created["token"])

    @agent.tool("search")
    def search(q):
        return ["..."]

Python 3.8 or newer.
"""

import functools
import json
import os
import secrets
import socket
import ssl
import time
import urllib.error
import urllib.parse
import urllib.request
import warnings
from http.client import HTTPException

__all__ = [
    "ActionDenied",
    "AdminClient",
    "AgentClient",
    "GuardError",
    "LineageWarning",
    "SetupError",
    "connect_admin",
    "find_admin_token",
    "load_dotenv",
]

DEFAULT_URL = "http://127.0.0.1:9200"


class GuardError(Exception):
    """The guard answered with an error, or no node answered in time.

    ``status`` is the HTTP status (None when no node answered), ``code`` the API's error
    code (``not_found``, ``unauthorized``, ...; ``unavailable`` when no node answered) and
    ``message`` its text.
    """

    def __init__(self, status, code, message):
        super().__init__(f"{status or 'no answer'} {code}: {message}")
        self.status = status
        self.code = code
        self.message = message


class ActionDenied(GuardError):
    """The guard refused an action. ``reason`` is the deny reason object, e.g.
    ``{"code": "tool_not_allowed", "tool": "rm"}``; ``action_id`` names the request."""

    def __init__(self, reason, action_id=None):
        super().__init__(200, "denied", json.dumps(reason, sort_keys=True))
        self.reason = reason
        self.action_id = action_id


class LineageWarning(UserWarning):
    """Something the node answered that a caller should know of, though the call worked:
    a waiting action it could not show (its request does not read back intact there)."""


class SetupError(Exception):
    """Something needed to talk to the guard is missing; the message says how to fix it."""


# ---------------------------------------------------------------- environment


def _dotenv_pairs(path):
    """The ``KEY=value`` pairs of a .env file in order (``export`` prefixes, comments and
    matching quotes handled); none when it cannot be read."""
    try:
        with open(path, encoding="utf-8") as f:
            lines = f.read().splitlines()
    except OSError:
        return []
    pairs = []
    for line in lines:
        line = line.strip()
        if not line or line.startswith("#") or "=" not in line:
            continue
        if line.startswith("export "):
            line = line[len("export "):]
        key, _, value = line.partition("=")
        key, value = key.strip(), value.strip()
        if len(value) >= 2 and value[0] == value[-1] and value[0] in "'\"":
            value = value[1:-1]
        if key:
            pairs.append((key, value))
    return pairs


def load_dotenv(path=None):
    """Loads ``KEY=value`` lines from ``path`` (default ``./.env``) into ``os.environ``,
    without overriding variables that are already set. Returns the names it set."""
    loaded = []
    for key, value in _dotenv_pairs(path or os.path.join(os.getcwd(), ".env")):
        if key not in os.environ:
            os.environ[key] = value
            loaded.append(key)
    return loaded


def find_admin_token():
    """The admin token, from the first of: ``GUARD_ADMIN_TOKEN`` in the environment;
    ``GUARD_ADMIN_TOKEN`` in ``./.env``; ``keys/admin.token`` under ``$GUARD_DATA_DIR``,
    ``./guard-data`` or ``./lineage-data`` (where ``lineage-node dev`` keeps it).
    Raises SetupError when none has it."""
    token = os.environ.get("GUARD_ADMIN_TOKEN", "").strip()
    if token:
        return token
    dotenv = _dotenv_pairs(os.path.join(os.getcwd(), ".env"))
    token = next((v for k, v in dotenv if k == "GUARD_ADMIN_TOKEN"), "").strip()
    if token:
        return token
    looked = []
    data_dirs = [os.environ.get("GUARD_DATA_DIR"), "guard-data", "lineage-data"]
    for data_dir in filter(None, data_dirs):
        path = os.path.join(data_dir, "keys", "admin.token")
        looked.append(path)
        try:
            with open(path, encoding="utf-8") as f:
                token = f.read().strip()
        except OSError:
            continue
        if token:
            return token
    raise SetupError(
        "no admin token found: set GUARD_ADMIN_TOKEN (in the environment or ./.env), "
        "or GUARD_DATA_DIR to the node's data dir; looked in " + ", ".join(looked)
    )


def _env_urls():
    urls = os.environ.get("GUARD_URLS") or os.environ.get("GUARD_URL") or DEFAULT_URL
    return urls


def connect_admin(url=None, token=None, timeout=10, retry_for=15, ca_file=None):
    """An AdminClient for ``url`` (one URL, a list, or comma-separated URLs; default
    ``$GUARD_URLS``, ``$GUARD_URL`` or http://127.0.0.1:9200), after checking that a
    node answers and accepts the token. ``ca_file`` (default ``$LINEAGE_CA``) is the CA
    bundle an https:// node's certificate must chain to. Raises SetupError saying what
    to fix."""
    token = token or find_admin_token()
    admin = AdminClient(
        url or _env_urls(), token, timeout=timeout, retry_for=retry_for, ca_file=ca_file
    )
    try:
        admin.agents()
    except GuardError as e:
        if e.status == 401:
            raise SetupError(
                f"the guard at {', '.join(admin.urls)} refused the admin token: "
                "check GUARD_ADMIN_TOKEN or keys/admin.token in the node's data dir"
            ) from None
        if e.status is None:
            raise SetupError(
                f"no guard answered at {', '.join(admin.urls)}: start one "
                "(lineage-node dev, or lineage-node run) or set GUARD_URL(S); "
                f"last error: {e.message}"
            ) from None
        raise
    return admin


# ---------------------------------------------------------------- transport


def _node_list(urls):
    if isinstance(urls, str):
        urls = urls.split(",")
    nodes = [u.strip().rstrip("/") for u in urls if u and u.strip()]
    if not nodes:
        raise SetupError("at least one node URL is needed, e.g. http://127.0.0.1:9200")
    for node in nodes:
        if not node.startswith(("http://", "https://")):
            raise SetupError(f"node URL {node!r} must start with http:// or https://")
    return nodes


def _quote(segment):
    return urllib.parse.quote(str(segment), safe="")


def _tls_context(ca_file):
    """Certificates of https:// nodes must chain to ``ca_file`` (PEM), or to ``$LINEAGE_CA``;
    with neither, to the system's roots."""
    ca_file = ca_file or os.environ.get("LINEAGE_CA")
    if not ca_file:
        return None
    try:
        return ssl.create_default_context(cafile=ca_file)
    except (OSError, ssl.SSLError) as e:
        raise SetupError(f"cannot use the CA bundle {ca_file}: {e}") from None


class _Nodes:
    """One logical call at a time over a list of nodes, with failover and retries."""

    def __init__(self, urls, token, timeout, retry_for, ca_file=None):
        self.urls = _node_list(urls)
        self.tls = _tls_context(ca_file)
        self.token = (token or "").strip()
        self.timeout = timeout
        self.retry_for = retry_for
        self.preferred = 0  # the node that answered last, tried first next time

    def call(self, method, path, body=None, query=None, idempotency_key=None):
        """The parsed JSON of the first non-503 answer; GuardError for an API error, or
        with status None when no node answered within ``retry_for`` seconds."""
        if query:
            pairs = {k: v for k, v in query.items() if v is not None}
            if pairs:
                path += "?" + urllib.parse.urlencode(pairs)
        data = None
        headers = {"Authorization": f"Bearer {self.token}", "Accept": "application/json"}
        if body is not None:
            data = json.dumps(body).encode("utf-8")
            headers["Content-Type"] = "application/json"
        if method == "POST":
            headers["Idempotency-Key"] = idempotency_key or secrets.token_hex(16)
        deadline = time.monotonic() + self.retry_for
        attempt = 0
        last = "no attempt made"
        while True:
            index = (self.preferred + attempt) % len(self.urls)
            url = self.urls[index] + path
            request = urllib.request.Request(url, data=data, headers=headers, method=method)
            try:
                with urllib.request.urlopen(
                    request, timeout=self.timeout, context=self.tls
                ) as reply:
                    text = reply.read()
                self.preferred = index
                return _decode(text, reply.status)
            except urllib.error.HTTPError as e:
                try:
                    text = e.read()
                except (HTTPException, OSError):
                    text = b""
                error = _api_error(e.code, text)
                # 503 means this node cannot decide now (no leader, leadership moved);
                # another node may. A quarantined agent stays quarantined everywhere.
                if e.code != 503 or error.code == "quarantined":
                    self.preferred = index
                    raise error from None
                last = f"{self.urls[index]}: {error.code}: {error.message}"
            except (urllib.error.URLError, HTTPException, OSError, socket.timeout) as e:
                last = f"{self.urls[index]}: {getattr(e, 'reason', e)}"
            attempt += 1
            pause = min(0.025 * attempt, 0.25)
            if time.monotonic() + pause >= deadline:
                raise GuardError(None, "unavailable", f"no node answered in {self.retry_for}s; last: {last}")
            time.sleep(pause)


def _decode(text, status):
    try:
        return json.loads(text.decode("utf-8"))
    except (UnicodeDecodeError, ValueError):
        raise GuardError(status, "bad_answer", f"the answer is not JSON: {text[:200]!r}") from None


def _api_error(status, text):
    try:
        body = json.loads(text.decode("utf-8"))
    except (UnicodeDecodeError, ValueError):
        body = None
    if isinstance(body, dict) and "code" in body:
        return GuardError(status, str(body["code"]), str(body.get("error", "")))
    # The reference server answers some framework errors in plain text (or nothing).
    return GuardError(status, "http_error", text.decode("utf-8", "replace")[:500])


# ---------------------------------------------------------------- clients


class _Client:
    """What both clients share: the nodes, and which of them answered last."""

    def __init__(self, url, token, timeout, retry_for, ca_file=None):
        self._nodes = _Nodes(url, token, timeout, retry_for, ca_file)

    @property
    def url(self):
        """The node that answered last."""
        return self._nodes.urls[self._nodes.preferred]

    @property
    def urls(self):
        return list(self._nodes.urls)


def _action_body(tool, input, cost):
    body = {"tool": tool, "input": {} if input is None else input}
    if cost is not None:
        body["cost"] = cost
    return body


def _outcome_body(status, detail):
    body = {"status": status}
    if detail is not None:
        body["detail"] = detail
    return body


class AgentClient(_Client):
    """Used by the agent itself, with its own token (``agt_<id>.<mac>``)."""

    def __init__(self, url, agent_id, token, timeout=30, retry_for=15, ca_file=None):
        super().__init__(url, token, timeout, retry_for, ca_file)
        self.agent_id = agent_id

    def _path(self, *parts):
        return "/v1/agents/" + "/".join(_quote(p) for p in (self.agent_id,) + parts)

    def request(self, tool, input=None, cost=None, idempotency_key=None):
        """Asks the guard before acting. Returns the decision: ``{"decision": "allowed",
        "action_id", "cost", "remaining"}``, ``{"decision": "denied", "reason", ...}`` or
        ``{"decision": "pending_approval", "action_id"}``."""
        body = _action_body(tool, input, cost)
        return self._nodes.call("POST", self._path("actions"), body, idempotency_key=idempotency_key)

    def authorize(self, tool, input=None, cost=None, approval_timeout=None, poll=0.5):
        """Requests, waits for a human when the policy says so, and returns the allowed
        decision. Raises ActionDenied when refused (also when an operator rejects)."""
        decision = self.request(tool, input, cost)
        action_id = decision.get("action_id")
        if decision.get("decision") == "pending_approval":
            status = self.wait_for_approval(action_id, timeout=approval_timeout, poll=poll)
            if status != "allowed":
                # The operator's reason is in the log, not in the action the agent sees.
                raise ActionDenied({"code": "rejected"}, action_id)
            return {"decision": "allowed", "action_id": action_id}
        if decision.get("decision") != "allowed":
            raise ActionDenied(decision.get("reason"), action_id)
        return decision

    def wait_for_approval(self, action_id, timeout=None, poll=0.5):
        """Polls the action until an operator decides it; returns its status
        (``allowed`` or ``denied``). Raises GuardError code ``approval_timeout`` after
        ``timeout`` seconds (default: wait as long as it takes)."""
        deadline = None if timeout is None else time.monotonic() + timeout
        while True:
            status = self.action(action_id).get("status")
            if status not in ("pending_approval", "requested"):
                return status
            if deadline is not None and time.monotonic() >= deadline:
                raise GuardError(None, "approval_timeout", f"{action_id} was not decided in {timeout}s")
            time.sleep(poll)

    def report(self, action_id, status, detail=None):
        """Reports how an allowed action went: ``success`` or ``failure`` (``harmful``
        is for operators). Returns the agent's status."""
        body = _outcome_body(status, detail)
        return self._nodes.call("POST", self._path("actions", action_id, "outcome"), body)

    def action(self, action_id):
        return self._nodes.call("GET", self._path("actions", action_id))

    def status(self):
        return self._nodes.call("GET", self._path())

    def tool(self, name, cost=None, approval_timeout=None):
        """Decorator: each call asks the guard with the call's arguments as input
        (``{"args": [...], "kwargs": {...}}``), waits for approval if needed (at most
        ``approval_timeout`` seconds, default as long as it takes), runs the function
        only if allowed, and reports success, or failure (then re-raises)."""

        def wrap(function):
            @functools.wraps(function)
            def guarded(*args, **kwargs):
                allowed = self.authorize(
                    name, {"args": list(args), "kwargs": kwargs}, cost, approval_timeout
                )
                action_id = allowed["action_id"]
                try:
                    result = function(*args, **kwargs)
                except BaseException as e:
                    self.report(action_id, "failure", f"{type(e).__name__}: {e}")
                    raise
                self.report(action_id, "success")
                return result

            return guarded

        return wrap


class AdminClient(_Client):
    """Used by operators, dashboards, monitors and tool backends, with the admin token."""

    def __init__(self, url, token, timeout=30, retry_for=15, ca_file=None):
        super().__init__(url, token, timeout, retry_for, ca_file)

    def _call(self, method, agent_id, *parts, body=None, query=None):
        path = "/v1/agents/" + "/".join(_quote(p) for p in (agent_id,) + parts)
        return self._nodes.call(method, path, body, query)

    def create_agent(self, agent_id, policy):
        """Creates an agent; returns ``{"agent": status, "token": "agt_..."}``."""
        return self._nodes.call("POST", "/v1/agents", {"agent_id": agent_id, "policy": policy})

    def agents(self):
        return self._nodes.call("GET", "/v1/agents")["agents"]

    def status(self, agent_id):
        return self._call("GET", agent_id)

    def token(self, agent_id):
        return self._call("GET", agent_id, "token")["token"]

    def agent(self, agent_id, timeout=30, retry_for=15):
        """An AgentClient for ``agent_id`` on the same nodes, with its token."""
        return AgentClient(self.urls, agent_id, self.token(agent_id), timeout, retry_for)

    def request(self, agent_id, tool, input=None, cost=None):
        return self._call("POST", agent_id, "actions", body=_action_body(tool, input, cost))

    def pending(self, agent_id):
        """Actions waiting for a human, in log order: ``[{"action", "requested_at", "seq"}]``.

        A waiting action whose request the node cannot read back intact is not in the
        list; it is named in a warning (``LineageWarning``) instead.
        """
        answer = self._call("GET", agent_id, "actions", "pending")
        for entry in answer.get("unreadable") or []:
            warnings.warn(
                "waiting action %s of %s cannot be shown: %s"
                % (entry.get("action_id"), entry.get("agent_id"), entry.get("error")),
                LineageWarning,
                stacklevel=2,
            )
        return answer["pending"]

    def action(self, agent_id, action_id):
        return self._call("GET", agent_id, "actions", action_id)

    def approve(self, agent_id, action_id, approver, note=None):
        body = {"approver": approver}
        if note is not None:
            body["note"] = note
        return self._call("POST", agent_id, "actions", action_id, "approve", body=body)

    def reject(self, agent_id, action_id, approver, reason, scar=None):
        body = {"approver": approver, "reason": reason}
        if scar is not None:
            body["scar"] = scar
        return self._call("POST", agent_id, "actions", action_id, "reject", body=body)

    def report(self, agent_id, action_id, status, detail=None):
        """An outcome for the agent's action; operators may report ``harmful``."""
        body = _outcome_body(status, detail)
        return self._call("POST", agent_id, "actions", action_id, "outcome", body=body)

    def scar(self, agent_id, severity, reason, action_id=None):
        body = {"severity": severity, "reason": reason}
        if action_id is not None:
            body["action_id"] = action_id
        return self._call("POST", agent_id, "scars", body=body)

    def terminate(self, agent_id, reason, by):
        return self._call("POST", agent_id, "terminate", body={"reason": reason, "by": by})

    def log(self, agent_id, after=None, limit=None):
        """One page of signed records with ``seq > after``: ``{"head", "records"}``."""
        return self._call("GET", agent_id, "log", query={"after": after, "limit": limit})

    def records(self, agent_id, page=1000):
        """Every record of the agent's log, page by page."""
        after = None
        while True:
            records = self.log(agent_id, after=after, limit=page)["records"]
            yield from records
            if len(records) < page:
                return
            after = records[-1]["seq"]

    def verify(self, agent_id):
        """The node re-verifies the agent's chain and signatures: ``{"ok", "records", ...}``."""
        return self._call("GET", agent_id, "verify")

    def public_key(self):
        return self._nodes.call("GET", "/v1/public-key")["public_key"]

    def cluster(self):
        """Lineage Cluster only: leader, term, commit index and each node's role and lag."""
        return self._nodes.call("GET", "/v1/cluster")
