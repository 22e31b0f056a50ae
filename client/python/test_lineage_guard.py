"""Tests for lineage_guard.py against real lineage-node processes (a three-node cluster on
127.0.0.1, started here). Needs the node binary: LINEAGE_NODE_BIN, or target/debug/
lineage-node in the workspace. `cargo test` runs this through node/tests/python_client.rs.

    python3 -m unittest -v test_lineage_guard     (from client/python/)
"""

import faulthandler
import os
import shutil
import signal
import socket
import subprocess
import tempfile
import threading
import time
import unittest
import urllib.request

import lineage_guard

# The whole suite's bound (node/tests/python_client.rs gives the process a longer one).
SUITE_TIMEOUT_SECONDS = 900
from lineage_guard import ActionDenied, AdminClient, AgentClient, GuardError, SetupError

HERE = os.path.dirname(os.path.abspath(__file__))
POLICY = {
    "budget": 100,
    "scar_limit": 10,
    "tools": {
        "search": {"cost": 1},
        "refund": {"cost": 5, "requires_approval": True},
        "flaky": {"cost": 2},
    },
}


def node_binary():
    path = os.environ.get("LINEAGE_NODE_BIN") or os.path.join(HERE, "..", "..", "target", "debug", "lineage-node")
    if not os.access(path, os.X_OK):
        raise RuntimeError(f"no lineage-node binary at {path}: build it, or set LINEAGE_NODE_BIN")
    return path


_next_port = [0]


def free_addresses(count):
    """Loopback addresses nothing listens on, with ports from below the ephemeral range:
    a port from bind(0) could be taken by an outgoing connection before a node binds it
    (the Rust tests' util::free_port does the same)."""
    lowest = 10_000
    try:
        with open("/proc/sys/net/ipv4/ip_local_port_range", encoding="ascii") as f:
            ephemeral_low = int(f.read().split()[0])
    except (OSError, ValueError, IndexError):
        ephemeral_low = 0
    span = ephemeral_low - lowest
    addresses = []
    base = os.getpid() * 7_919 % max(span, 1)
    for _ in range(max(span, 0)):
        if len(addresses) == count:
            break
        port = lowest + (base + _next_port[0]) % span
        _next_port[0] += 1
        with socket.socket() as probe:
            try:
                probe.bind(("127.0.0.1", port))
            except OSError:
                continue
        addresses.append(f"127.0.0.1:{port}")
    while len(addresses) < count:  # no usable range below the ephemeral one
        with socket.socket() as probe:
            probe.bind(("127.0.0.1", 0))
            addresses.append(f"127.0.0.1:{probe.getsockname()[1]}")
    return addresses


class Cluster:
    """Three lineage-node processes with shared keys under a temporary directory."""

    def __init__(self, size=3):
        self.binary = node_binary()
        self.dir = tempfile.mkdtemp(prefix="lineage-python-")
        keys = os.path.join(self.dir, "keys")
        subprocess.run([self.binary, "keygen", keys], check=True, stdout=subprocess.DEVNULL)
        with open(os.path.join(keys, "admin.token"), encoding="utf-8") as f:
            self.admin_token = f.read().strip()
        self.addresses = free_addresses(size)
        self.urls = [f"http://{a}" for a in self.addresses]
        peers = ",".join(f"{i + 1}={a}" for i, a in enumerate(self.addresses))
        self.processes = []
        for i, address in enumerate(self.addresses):
            log = open(os.path.join(self.dir, f"node-{i + 1}.log"), "wb")
            command = [
                self.binary, "run", "--id", str(i + 1), "--listen", address,
                "--data-dir", os.path.join(self.dir, f"node-{i + 1}"),
                "--keys-dir", keys, "--peers", peers,
            ]
            env = dict(os.environ, LINEAGE_LOG="warn")
            self.processes.append(subprocess.Popen(command, stdout=log, stderr=log, env=env))
            log.close()
        self.wait_until_ready(self.urls)

    def wait_until_ready(self, urls, seconds=60):
        deadline = time.monotonic() + seconds
        pending = list(urls)
        while pending and time.monotonic() < deadline:
            for url in list(pending):
                try:
                    with urllib.request.urlopen(url + "/readyz", timeout=2) as reply:
                        if reply.status == 200:
                            pending.remove(url)
                except OSError:
                    pass
            time.sleep(0.1)
        if pending:
            raise RuntimeError(f"nodes not ready after {seconds}s: {pending}; logs in {self.dir}")

    def leader_index(self):
        admin = AdminClient(self.urls, self.admin_token)
        leader = admin.cluster()["leader"]
        return int(leader) - 1

    def kill(self, index):
        self.processes[index].send_signal(signal.SIGKILL)
        self.processes[index].wait(timeout=10)

    def stop(self):
        for process in self.processes:
            if process.poll() is None:
                process.send_signal(signal.SIGKILL)
                process.wait(timeout=10)
        shutil.rmtree(self.dir, ignore_errors=True)


class ClientTest(unittest.TestCase):
    @classmethod
    def setUpClass(cls):
        cls.cluster = Cluster()
        cls.admin = AdminClient(cls.cluster.urls, cls.cluster.admin_token)
        cls.count = 0

    @classmethod
    def tearDownClass(cls):
        cls.cluster.stop()

    def new_agent(self, policy=POLICY):
        ClientTest.count += 1
        agent_id = f"{self._testMethodName[5:15]}-{ClientTest.count}".replace("_", "-")
        created = self.admin.create_agent(agent_id, policy)
        return agent_id, AgentClient(self.cluster.urls, agent_id, created["token"])

    def test_a_decorated_tool_runs_only_when_allowed_and_reports(self):
        agent_id, agent = self.new_agent()
        calls = []

        @agent.tool("search")
        def search(q, limit=3):
            calls.append((q, limit))
            return [q] * limit

        self.assertEqual(search("late delivery", limit=2), ["late delivery"] * 2)
        self.assertEqual(calls, [("late delivery", 2)])
        status = agent.status()
        self.assertEqual((status["spent"], status["actions_allowed"]), (1, 1))
        action = agent.action("act-1")
        self.assertEqual(action["input"], {"args": ["late delivery"], "kwargs": {"limit": 2}})
        self.assertEqual((action["status"], action["outcome"]), ("completed", "success"))

        @agent.tool("delete_account")
        def delete_account(user):
            calls.append(("delete", user))

        with self.assertRaises(ActionDenied) as denied:
            delete_account(42)
        self.assertEqual(denied.exception.reason, {"code": "tool_not_allowed", "tool": "delete_account"})
        self.assertEqual(len(calls), 1, "a denied tool must not run")
        self.assertEqual(agent.status()["scar_score"], 3)

    def test_a_failing_tool_is_reported_as_failure_and_reraised(self):
        _, agent = self.new_agent()

        @agent.tool("flaky")
        def flaky():
            raise ValueError("upstream timed out")

        with self.assertRaises(ValueError):
            flaky()
        action = agent.action("act-1")
        self.assertEqual((action["status"], action["outcome"]), ("completed", "failure"))
        self.assertEqual(agent.status()["spent"], 2)

    def test_approval_waits_for_a_human_and_rejection_denies(self):
        agent_id, agent = self.new_agent()

        operator_errors = []

        def operator(verdicts):
            # An exception here would otherwise die with the thread, unseen, and leave
            # the agent below waiting: it is kept and fails the test.
            try:
                for _ in range(200):
                    for item in self.admin.pending(agent_id):
                        action = item["action"]
                        if verdicts.pop(0) == "approve":
                            self.admin.approve(agent_id, action["action_id"], "alice", note="ok")
                        else:
                            self.admin.reject(agent_id, action["action_id"], "bob", "not today")
                    if not verdicts:
                        return
                    time.sleep(0.05)
            except BaseException as e:
                operator_errors.append(e)

        worker = threading.Thread(target=operator, args=(["approve", "reject"],))
        worker.start()
        try:
            @agent.tool("refund", approval_timeout=60)
            def refund(order, amount):
                return f"refunded {amount} on {order}"

            self.assertEqual(refund("A-100", 40), "refunded 40 on A-100")
            with self.assertRaises(ActionDenied) as denied:
                agent.authorize("refund", {"order": "A-101"}, approval_timeout=60, poll=0.05)
            self.assertEqual(denied.exception.reason, {"code": "rejected"})
            self.assertEqual(denied.exception.action_id, "act-2")
        finally:
            worker.join(timeout=30)
        self.assertEqual(operator_errors, [])
        self.assertFalse(worker.is_alive(), "the operator thread did not finish")
        status = agent.status()
        self.assertEqual((status["spent"], status["actions_allowed"], status["actions_denied"]), (5, 1, 1))
        self.assertEqual(self.admin.pending(agent_id), [])

    def test_wait_for_approval_gives_up_after_its_timeout(self):
        _, agent = self.new_agent()
        decision = agent.request("refund", {"order": "A-7"})
        self.assertEqual(decision["decision"], "pending_approval")
        with self.assertRaises(GuardError) as timeout:
            agent.wait_for_approval(decision["action_id"], timeout=0.2, poll=0.05)
        self.assertEqual(timeout.exception.code, "approval_timeout")

    def test_api_errors_carry_status_and_code(self):
        agent_id, agent = self.new_agent()
        other_id, _ = self.new_agent()
        with self.assertRaises(GuardError) as missing:
            self.admin.status("nobody-here")
        self.assertEqual((missing.exception.status, missing.exception.code), (404, "not_found"))
        wrong_agent = AgentClient(self.cluster.urls, other_id, agent._nodes.token)
        with self.assertRaises(GuardError) as forbidden:
            wrong_agent.status()
        self.assertEqual((forbidden.exception.status, forbidden.exception.code), (403, "forbidden"))
        forged = AgentClient(self.cluster.urls, agent_id, f"agt_{agent_id}.{'0' * 64}")
        with self.assertRaises(GuardError) as unauthorized:
            forged.request("search")
        self.assertEqual((unauthorized.exception.status, unauthorized.exception.code), (401, "unauthorized"))
        with self.assertRaises(GuardError) as exists:
            self.admin.create_agent(agent_id, POLICY)
        self.assertEqual((exists.exception.status, exists.exception.code), (409, "agent_exists"))
        with self.assertRaises(GuardError) as unknown:
            agent.report("act-99", "success")
        self.assertEqual((unknown.exception.status, unknown.exception.code), (404, "unknown_action"))

    def test_a_retried_write_is_charged_once_on_any_node(self):
        agent_id, _ = self.new_agent()
        token = self.admin.token(agent_id)
        answers = [
            AgentClient(url, agent_id, token).request("search", {"q": "x"}, idempotency_key="retry-1")
            for url in self.cluster.urls
        ]
        self.assertEqual(answers[0]["decision"], "allowed")
        self.assertEqual(answers, [answers[0]] * 3)
        status = self.admin.status(agent_id)
        self.assertEqual((status["spent"], status["actions_allowed"]), (1, 1))

    def test_operator_calls_and_the_log(self):
        agent_id, agent = self.new_agent()
        agent.request("search", {"q": "a"})
        self.admin.scar(agent_id, "minor", "too chatty", action_id="act-1")
        self.assertIn(agent_id, [entry["agent_id"] for entry in self.admin.agents()])
        records = list(self.admin.records(agent_id, page=2))
        self.assertEqual([r["seq"] for r in records], list(range(len(records))))
        self.assertEqual(records[0]["kind"], "genesis")
        self.assertEqual(self.admin.log(agent_id, after=1, limit=1)["records"], records[2:3])
        verified = self.admin.verify(agent_id)
        self.assertTrue(verified["ok"])
        self.assertEqual(verified["records"], len(records))
        self.assertEqual(verified["public_key"], self.admin.public_key())
        status = self.admin.terminate(agent_id, "enough", "carol")
        self.assertFalse(status["alive"])
        denied = agent.request("search", {"q": "b"})
        self.assertEqual(denied["reason"]["code"], "terminated")
        with self.assertRaises(GuardError) as again:
            self.admin.terminate(agent_id, "twice", "carol")
        self.assertEqual(again.exception.code, "already_terminated")

    def test_connect_admin_explains_what_is_wrong(self):
        admin = lineage_guard.connect_admin(self.cluster.urls, self.cluster.admin_token)
        self.assertEqual(admin.urls, self.cluster.urls)
        with self.assertRaises(SetupError) as refused:
            lineage_guard.connect_admin(self.cluster.urls[0], "not-the-token")
        self.assertIn("refused the admin token", str(refused.exception))
        closed = f"http://{free_addresses(1)[0]}"
        with self.assertRaises(SetupError) as nobody:
            lineage_guard.connect_admin(closed, "t", retry_for=0.3)
        self.assertIn("no guard answered", str(nobody.exception))
        with self.assertRaises(SetupError):
            AgentClient("127.0.0.1:9200", "bot", "t")


class TokenDiscoveryTest(unittest.TestCase):
    def setUp(self):
        self.saved = {k: os.environ.pop(k) for k in list(os.environ) if k.startswith("GUARD_")}
        self.cwd = os.getcwd()
        self.dir = tempfile.mkdtemp(prefix="lineage-python-env-")
        os.chdir(self.dir)

    def tearDown(self):
        os.chdir(self.cwd)
        shutil.rmtree(self.dir, ignore_errors=True)
        for key in [k for k in os.environ if k.startswith("GUARD_")]:
            del os.environ[key]
        os.environ.update(self.saved)

    def write(self, path, text):
        os.makedirs(os.path.dirname(os.path.join(self.dir, path)), exist_ok=True)
        with open(os.path.join(self.dir, path), "w", encoding="utf-8") as f:
            f.write(text)

    def test_the_token_is_found_in_order(self):
        with self.assertRaises(SetupError) as none:
            lineage_guard.find_admin_token()
        self.assertIn("GUARD_ADMIN_TOKEN", str(none.exception))
        self.write("lineage-data/keys/admin.token", "from-dev\n")
        self.assertEqual(lineage_guard.find_admin_token(), "from-dev")
        self.write("guard-data/keys/admin.token", "from-guard-data\n")
        self.assertEqual(lineage_guard.find_admin_token(), "from-guard-data")
        self.write("elsewhere/keys/admin.token", "from-data-dir\n")
        os.environ["GUARD_DATA_DIR"] = os.path.join(self.dir, "elsewhere")
        self.assertEqual(lineage_guard.find_admin_token(), "from-data-dir")
        self.write(".env", "# comment\nexport GUARD_ADMIN_TOKEN='from-dotenv'\n")
        self.assertEqual(lineage_guard.find_admin_token(), "from-dotenv")
        os.environ["GUARD_ADMIN_TOKEN"] = " from-env "
        self.assertEqual(lineage_guard.find_admin_token(), "from-env")

    def test_load_dotenv_keeps_what_is_set(self):
        self.write(".env", "GUARD_URL=http://127.0.0.1:1\nGUARD_ADMIN_TOKEN=\"x\"\nnot a pair\n")
        os.environ["GUARD_URL"] = "http://kept"
        self.assertEqual(lineage_guard.load_dotenv(), ["GUARD_ADMIN_TOKEN"])
        self.assertEqual((os.environ["GUARD_URL"], os.environ["GUARD_ADMIN_TOKEN"]), ("http://kept", "x"))


class FailoverTest(unittest.TestCase):
    def test_the_client_moves_on_when_the_leader_is_killed(self):
        cluster = Cluster()
        try:
            admin = AdminClient(cluster.urls, cluster.admin_token)
            created = admin.create_agent("survivor", POLICY)
            agent = AgentClient(cluster.urls, "survivor", created["token"], timeout=5, retry_for=30)
            for i in range(3):
                self.assertEqual(agent.request("search", {"i": i})["decision"], "allowed")
            leader = cluster.leader_index()
            agent._nodes.preferred = leader  # its next call goes to the dead node first
            cluster.kill(leader)
            for i in range(3, 8):
                self.assertEqual(agent.request("search", {"i": i})["decision"], "allowed")
            self.assertNotEqual(agent.url, cluster.urls[leader])
            status = agent.status()
            self.assertEqual((status["spent"], status["actions_allowed"]), (8, 8))
            survivors = [url for i, url in enumerate(cluster.urls) if i != leader]
            for url in survivors:
                self.assertTrue(AdminClient(url, cluster.admin_token).verify("survivor")["ok"])
        finally:
            cluster.stop()


def setUpModule():
    # A hang prints every thread's stack and ends the run rather than waiting forever.
    faulthandler.dump_traceback_later(SUITE_TIMEOUT_SECONDS, exit=True)


def tearDownModule():
    faulthandler.cancel_dump_traceback_later()


if __name__ == "__main__":
    unittest.main()
