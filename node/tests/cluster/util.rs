//! Starts real `lineage-node` processes on free loopback ports, each with its own data
//! directory and shared keys, and talks to them over real HTTP.
//!
//! Shared by several test binaries; not each uses every helper.
#![allow(dead_code)]

use std::collections::BTreeMap;
use std::net::TcpListener;
use std::path::{Path, PathBuf};
use std::process::{Child, Command, Stdio};
use std::time::{Duration, Instant};

use lineage_core::record::Record;
use lineage_core::verify::{verify_records, VerifyOptions};
use serde_json::{json, Value};

pub struct Cluster {
    pub dir: tempfile::TempDir,
    pub addrs: Vec<String>,
    children: std::sync::Mutex<Vec<Option<Child>>>,
    pub admin: String,
    pub http: reqwest::Client,
    /// Extra flags for every node; `{id}` in one stands for the node's id.
    pub extra_args: Vec<String>,
    /// `http`, or `https` for a cluster started with `start_tls`.
    pub scheme: &'static str,
    /// With TLS: the directory with `ca.pem` and each node's certificate and key.
    pub tls_dir: Option<PathBuf>,
    /// `LINEAGE_LOG` for every node (the node's own default when none).
    pub log_filter: Option<String>,
    /// Nodes this harness did not start (containers): never killed or restarted here.
    external: bool,
    /// Where each node keeps its data, when not under `dir` (a loop-mounted disk).
    data_dirs: Option<Vec<PathBuf>>,
    /// The first this many nodes are the new cluster's voters (`--peers`); the others are
    /// spares, started empty, that join only when an operator adds them.
    voters: usize,
    /// Where a node listens when not at its address (`listen_apart`).
    listen: Vec<Option<String>>,
}

/// Waits at most `limit` for `child` to exit by itself: its status, or `None` once the
/// limit has passed, the child then killed and reaped. Bounds a test that expects a
/// process to refuse to start.
pub fn exit_within(child: &mut Child, limit: Duration) -> Option<std::process::ExitStatus> {
    let start = Instant::now();
    loop {
        if let Some(status) = child.try_wait().expect("try_wait") {
            return Some(status);
        }
        if start.elapsed() > limit {
            let _ = child.kill();
            let _ = child.wait();
            return None;
        }
        std::thread::sleep(Duration::from_millis(20));
    }
}

/// A loopback port nothing listens on right now, and that no outgoing connection will
/// take before a node binds it.
///
/// A port the kernel hands out for `bind(0)` comes from the ephemeral range, which is
/// also where every outgoing connection (of this test, of the nodes) gets its local port:
/// between our probe and the node's bind, or while a killed node is down, a connection
/// may take it and the node then fails to listen. So ports come from below that range,
/// each used once per test process (a counter), starting at an offset from the pid so
/// that test binaries running side by side rarely probe the same ones.
pub fn free_port() -> u16 {
    use std::sync::atomic::{AtomicU32, Ordering};
    static NEXT: AtomicU32 = AtomicU32::new(0);
    const LOWEST: u32 = 10_000;
    let ephemeral_low = std::fs::read_to_string("/proc/sys/net/ipv4/ip_local_port_range")
        .ok()
        .and_then(|s| s.split_whitespace().next()?.parse::<u32>().ok())
        .unwrap_or(0);
    if ephemeral_low > LOWEST + 2_000 {
        let span = ephemeral_low - LOWEST;
        let base = std::process::id().wrapping_mul(7_919) % span;
        for _ in 0..span {
            let port = LOWEST + (base + NEXT.fetch_add(1, Ordering::Relaxed)) % span;
            if TcpListener::bind(("127.0.0.1", port as u16)).is_ok() {
                return port as u16;
            }
        }
    }
    let listener = TcpListener::bind("127.0.0.1:0").expect("bind a free port");
    listener.local_addr().expect("local addr").port()
}

/// The first of `n` consecutive free ports (for `lineage-node dev --base-port`, which
/// takes its nodes', witness's and checkpointer's ports one after another).
pub fn free_consecutive_ports(n: u16) -> u16 {
    loop {
        let first = free_port();
        let next: Vec<u16> = (1..n).map(|_| free_port()).collect();
        if next.iter().zip(1..).all(|(port, i)| *port == first + i) {
            return first;
        }
    }
}

/// Rewrites `agent`'s rows in a node's `records` table as one row per record, unsealed
/// (the layout older nodes wrote, which nodes still read), so a test can edit single
/// records the way someone with disk access would, past the rows' seals.
pub fn one_row_per_record(table: &mut redb::Table<(&'static str, u64), &'static str>, agent: &str) {
    use redb::ReadableTable;
    let rows: Vec<(u64, String)> = table
        .range((agent, 0)..=(agent, u64::MAX))
        .expect("read records")
        .map(|row| {
            let (key, text) = row.expect("read a row");
            let lines = lineage_node::store::record_rows::raw_lines(agent, 0, text.value())
                .expect("a row whose seal checks");
            (key.value().1, lines.to_string())
        })
        .collect();
    for (first, text) in rows {
        table.remove((agent, first)).expect("remove a row");
        for (offset, line) in (0u64..).zip(text.split('\n')) {
            table
                .insert((agent, first + offset), line)
                .expect("insert a row");
        }
    }
}

/// The first of `names` on PATH. When none is installed the calling test skips and says
/// so, unless `require_env` is set (CI sets it), in which case it fails.
pub fn program_or_skip(names: &[&str], require_env: &str) -> Option<PathBuf> {
    let found = std::env::var_os("PATH").and_then(|paths| {
        std::env::split_paths(&paths)
            .flat_map(|dir| names.iter().map(move |n| dir.join(n)))
            .find(|p| p.is_file())
    });
    if found.is_none() {
        let name = names[0];
        assert!(
            std::env::var_os(require_env).is_none(),
            "{name} is required here but not installed"
        );
        eprintln!("SKIPPED: {name} is not installed (apt-get install {name})");
    }
    found
}

/// The `lineage` CLI beside this test binary (another package: `cargo test --workspace`
/// builds it into the same target directory).
pub fn lineage_bin() -> PathBuf {
    let exe = std::env::current_exe().expect("test exe");
    let path = exe
        .parent()
        .and_then(Path::parent)
        .expect("target dir")
        .join("lineage");
    assert!(
        path.is_file(),
        "{} is missing: run `cargo build --workspace` first",
        path.display()
    );
    path
}

impl Cluster {
    pub async fn start(n: usize) -> Cluster {
        Self::start_with(n, &[]).await
    }

    pub async fn start_with(n: usize, extra_args: &[&str]) -> Cluster {
        Self::start_on(n, extra_args, None).await
    }

    /// `start_with` over TLS: `lineage-node certs` makes a CA and each node's certificate
    /// (127.0.0.1, localhost); the nodes serve HTTPS and the harness's client trusts the CA.
    pub async fn start_tls(n: usize, extra_args: &[&str]) -> Cluster {
        let mut cluster = Self::prepare(n, extra_args);
        let tls = cluster.dir.path().join("tls");
        let mut certs = Command::new(env!("CARGO_BIN_EXE_lineage-node"));
        certs.arg("certs").arg("--out").arg(&tls);
        for i in 0..n {
            certs.args(["--node", &format!("{}=127.0.0.1,localhost", i + 1)]);
        }
        let output = certs.output().expect("run lineage-node certs");
        assert!(
            output.status.success(),
            "certs: {}",
            String::from_utf8_lossy(&output.stderr)
        );
        let path = |name: &str| tls.join(name).display().to_string();
        cluster.extra_args.extend([
            "--tls-cert".into(),
            path("node-{id}.pem"),
            "--tls-key".into(),
            path("node-{id}.key"),
            "--tls-ca".into(),
            path("ca.pem"),
        ]);
        cluster.http = https_client(&tls.join("ca.pem"));
        cluster.scheme = "https";
        cluster.tls_dir = Some(tls);
        for i in 0..n {
            cluster.start_node(i);
        }
        cluster.wait_for_leader(Duration::from_secs(15)).await;
        cluster
    }

    /// `start_from_reference`'s keys and ports, with no node started yet.
    pub fn prepare_from_reference(n: usize, reference: &Path) -> Cluster {
        Self::prepare_keys(n, &[], Some(reference))
    }

    /// A cluster's keys and ports, with no node started yet (`start_node` starts each,
    /// then `wait_for_leader`).
    pub fn prepare(n: usize, extra_args: &[&str]) -> Cluster {
        Self::prepare_keys(n, extra_args, None)
    }

    /// `prepare`, the keys made by `keygen --from-reference reference` when given.
    fn prepare_keys(n: usize, extra_args: &[&str], reference: Option<&Path>) -> Cluster {
        let dir = tempfile::tempdir().expect("tempdir");
        let keys = dir.path().join("keys");
        let mut keygen = Command::new(env!("CARGO_BIN_EXE_lineage-node"));
        keygen.arg("keygen").arg(&keys);
        if let Some(reference) = reference {
            keygen.arg("--from-reference").arg(reference);
        }
        let status = keygen.stdout(Stdio::null()).status().expect("run keygen");
        assert!(status.success());
        let admin = std::fs::read_to_string(keys.join("admin.token")).expect("admin token");
        let addrs: Vec<String> = (0..n)
            .map(|_| format!("127.0.0.1:{}", free_port()))
            .collect();
        Cluster::new(dir, addrs, admin, extra_args, false)
    }

    /// A cluster whose audit and token keys are a reference guard's (`keygen
    /// --from-reference`), to import that guard's logs.
    pub async fn start_from_reference(n: usize, reference: &Path) -> Cluster {
        let cluster = Self::prepare_keys(n, &[], Some(reference));
        for i in 0..n {
            cluster.start_node(i);
        }
        cluster.wait_for_leader(Duration::from_secs(15)).await;
        cluster
    }

    /// `start_with`, each node keeping its data in the given directory (for example
    /// its own file system).
    pub async fn start_on(
        n: usize,
        extra_args: &[&str],
        data_dirs: Option<Vec<PathBuf>>,
    ) -> Cluster {
        let mut cluster = Self::prepare(n, extra_args);
        cluster.data_dirs = data_dirs;
        for i in 0..n {
            cluster.start_node(i);
        }
        cluster.wait_for_leader(Duration::from_secs(15)).await;
        cluster
    }

    /// `voters` nodes started as a cluster, and `spares` more with ports and keys but not
    /// started and not members (`start_node` runs one, waiting to be added).
    pub async fn start_with_spares(voters: usize, spares: usize) -> Cluster {
        let mut cluster = Self::prepare(voters + spares, &[]);
        cluster.voters = voters;
        for i in 0..voters {
            cluster.start_node(i);
        }
        cluster.wait_for_leader(Duration::from_secs(15)).await;
        cluster
    }

    /// Talks to nodes someone else runs (for example containers) at `addrs`, over HTTPS
    /// with the CA bundle `ca` when given.
    pub async fn attach(
        addrs: Vec<String>,
        admin: String,
        ca: Option<&std::path::Path>,
    ) -> Cluster {
        let dir = tempfile::tempdir().expect("tempdir");
        let mut cluster = Cluster::new(dir, addrs, admin, &[], true);
        if let Some(ca) = ca {
            cluster.http = https_client(ca);
            cluster.scheme = "https";
        }
        cluster.wait_for_leader(Duration::from_secs(60)).await;
        cluster
    }

    fn new(
        dir: tempfile::TempDir,
        addrs: Vec<String>,
        admin: String,
        extra_args: &[&str],
        external: bool,
    ) -> Cluster {
        let n = addrs.len();
        Cluster {
            dir,
            addrs,
            children: std::sync::Mutex::new((0..n).map(|_| None).collect()),
            admin,
            http: reqwest::Client::builder()
                .timeout(Duration::from_secs(5))
                .build()
                .expect("client"),
            extra_args: extra_args.iter().map(|a| a.to_string()).collect(),
            scheme: "http",
            tls_dir: None,
            log_filter: None,
            external,
            data_dirs: None,
            voters: n,
            listen: vec![None; n],
        }
    }

    /// Has node `i` listen on a port of its own, while its peers (`--peers` is built from
    /// `addrs`) and this harness still reach it at `addrs[i]`, where the test puts
    /// something in between. Returns where it listens.
    pub fn listen_apart(&mut self, i: usize) -> String {
        let listen = format!("127.0.0.1:{}", free_port());
        self.listen[i] = Some(listen.clone());
        listen
    }

    pub fn data_dir(&self, i: usize) -> PathBuf {
        if let Some(dirs) = &self.data_dirs {
            return dirs[i].clone();
        }
        self.dir.path().join(format!("node-{}", i + 1))
    }

    /// Node `i`'s process id, while this harness runs it.
    pub fn pid(&self, i: usize) -> Option<u32> {
        self.children()[i].as_ref().map(Child::id)
    }

    fn children(&self) -> std::sync::MutexGuard<'_, Vec<Option<Child>>> {
        self.children.lock().unwrap_or_else(|p| p.into_inner())
    }

    /// Starts node `i`, which must not be running (a second process would leak and fail
    /// to bind).
    pub fn start_node(&self, i: usize) {
        assert!(
            self.children()[i].is_none(),
            "node {} is already running",
            i + 1
        );
        let peers: Vec<String> = self.addrs[..self.voters]
            .iter()
            .enumerate()
            .map(|(j, a)| format!("{}={a}", j + 1))
            .collect();
        let log = std::fs::OpenOptions::new()
            .create(true)
            .append(true)
            .open(self.log_path(i))
            .expect("log file");
        let mut command = Command::new(env!("CARGO_BIN_EXE_lineage-node"));
        if let Some(filter) = &self.log_filter {
            command.env("LINEAGE_LOG", filter);
        }
        let child = command
            .args([
                "run",
                "--id",
                &(i + 1).to_string(),
                "--listen",
                self.listen[i].as_deref().unwrap_or(&self.addrs[i]),
            ])
            .args(
                self.listen[i]
                    .as_ref()
                    .map(|_| ["--advertise", self.addrs[i].as_str()])
                    .into_iter()
                    .flatten(),
            )
            .arg("--data-dir")
            .arg(self.data_dir(i))
            .arg("--keys-dir")
            .arg(self.dir.path().join("keys"))
            .arg("--peers")
            .arg(peers.join(","))
            .args(
                self.extra_args
                    .iter()
                    .map(|arg| arg.replace("{id}", &(i + 1).to_string())),
            )
            .stdout(Stdio::null())
            .stderr(log)
            .spawn()
            .expect("start lineage-node");
        self.children()[i] = Some(child);
    }

    /// Where node `i`'s stderr goes (appended to, by each start).
    pub fn log_path(&self, i: usize) -> PathBuf {
        self.dir.path().join(format!("node-{}.log", i + 1))
    }

    /// Node `i`'s log if it is a plain file (a test may make it a pipe, which reading to
    /// its end would wait on for good).
    fn log_file(&self, i: usize) -> Option<PathBuf> {
        let path = self.log_path(i);
        std::fs::metadata(&path)
            .is_ok_and(|meta| meta.is_file())
            .then_some(path)
    }

    /// The last `lines` lines of each node's log, for a failure message.
    pub fn log_tails(&self, lines: usize) -> String {
        // Each process's state first: a failure report is often cut short in the middle,
        // and a node that died at start-up is the first thing to know.
        let mut out = String::new();
        for (i, child) in self.children().iter_mut().enumerate() {
            let state = match child.as_mut().map(Child::try_wait) {
                None => "not started by the harness".to_string(),
                Some(Ok(None)) => match child.as_ref() {
                    Some(process) => format!("running; {}", thread_states(process.id())),
                    None => "running".to_string(),
                },
                Some(Ok(Some(status))) => format!("EXITED ({status})"),
                Some(Err(e)) => format!("unknown ({e})"),
            };
            out.push_str(&format!("node {}: {state}\n", i + 1));
        }
        for i in 0..self.addrs.len() {
            let text = self.log_file(i).map_or_else(
                || "(not a file)".to_string(),
                |log| std::fs::read_to_string(log).unwrap_or_default(),
            );
            let folded = fold_repeats(&text);
            let tail = &folded[folded.len().saturating_sub(lines)..];
            out.push_str(&format!(
                "--- node {} log (last {} lines, repeats folded):\n",
                i + 1,
                tail.len()
            ));
            for line in tail {
                out.push_str(line);
                out.push('\n');
            }
        }
        out
    }

    /// Copies the nodes' logs somewhere that outlives the test, for a failure report.
    pub fn keep_logs(&self) {
        let name = self
            .dir
            .path()
            .file_name()
            .unwrap_or_default()
            .to_string_lossy();
        let target = std::env::temp_dir().join(format!("lineage-cluster-failure{name}"));
        let _ = std::fs::create_dir_all(&target);
        for i in 0..self.addrs.len() {
            if let Some(log) = self.log_file(i) {
                let name = format!("node-{}.log", i + 1);
                let _ = std::fs::copy(log, target.join(&name));
            }
        }
        // Where a node hangs, its threads' stacks say where (opt-in: gdb is slow).
        if std::env::var_os("LINEAGE_TEST_STACKS").is_some() {
            for (i, child) in self.children().iter().enumerate() {
                if let Some(child) = child {
                    let stacks = Command::new("gdb")
                        .args(["-batch", "-ex", "thread apply all bt", "-p"])
                        .arg(child.id().to_string())
                        .output();
                    if let Ok(out) = stacks {
                        let _ = std::fs::write(
                            target.join(format!("node-{}.stacks", i + 1)),
                            out.stdout,
                        );
                    }
                }
            }
        }
        eprintln!("node logs kept in {}", target.display());
    }

    /// Deletes a (stopped) node's data directory: a replaced disk.
    pub fn wipe(&self, i: usize) {
        let _ = std::fs::remove_dir_all(self.data_dir(i));
    }

    /// SIGSTOP: the process is frozen, its sockets stay open.
    pub fn pause(&self, i: usize) {
        self.signal(i, "-STOP");
    }

    /// SIGCONT.
    pub fn resume(&self, i: usize) {
        self.signal(i, "-CONT");
    }

    /// SIGHUP: the node reloads its TLS certificate.
    pub fn hangup(&self, i: usize) {
        self.signal(i, "-HUP");
    }

    fn signal(&self, i: usize, signal: &str) {
        if let Some(child) = &self.children()[i] {
            let status = Command::new("kill")
                .arg(signal)
                .arg(child.id().to_string())
                .status()
                .expect("run kill");
            assert!(status.success(), "kill {signal} failed");
        }
    }

    /// Whether node `i`'s process has ended (by itself, or killed by a signal).
    pub fn has_exited(&self, i: usize) -> bool {
        self.children()[i]
            .as_mut()
            .is_some_and(|child| child.try_wait().ok().flatten().is_some())
    }

    pub fn is_running(&self, i: usize) -> bool {
        self.external || self.children()[i].is_some()
    }

    /// SIGTERM, then wait: a graceful stop (agent states checkpointed, all durable).
    pub fn stop_gracefully(&self, i: usize) {
        let taken = self.children()[i].take();
        if let Some(mut child) = taken {
            let _ = Command::new("kill")
                .arg("-TERM")
                .arg(child.id().to_string())
                .status();
            // A graceful stop exits 0; anything else (a panic on the way out, a lost
            // checkpoint) is a failure of the stop this test relies on.
            let status = child.wait().expect("wait for the node");
            assert!(status.success(), "graceful stop exited with {status}");
        }
    }

    /// kill -9.
    pub fn kill(&self, i: usize) {
        let taken = self.children()[i].take();
        if let Some(mut child) = taken {
            let _ = child.kill();
            let _ = child.wait();
        }
    }

    pub fn url(&self, i: usize, path: &str) -> String {
        format!("{}://{}{path}", self.scheme, self.addrs[i])
    }

    /// The leader's index as reported by node `i`, if it answers and knows one.
    pub async fn leader_seen_by(&self, i: usize) -> Option<usize> {
        let reply = self
            .http
            .get(self.url(i, "/v1/cluster"))
            .bearer_auth(&self.admin)
            .send()
            .await
            .ok()?;
        if !reply.status().is_success() {
            return None;
        }
        let body: Value = reply.json().await.ok()?;
        body["leader"].as_u64().map(|id| id as usize - 1)
    }

    /// Waits (bounded) until every live node reports the same leader, and returns it.
    pub async fn wait_for_leader(&self, limit: Duration) -> usize {
        let start = Instant::now();
        let mut seen = Vec::new();
        while start.elapsed() < limit {
            seen.clear();
            for i in 0..self.addrs.len() {
                if self.is_running(i) {
                    seen.push((i + 1, self.leader_seen_by(i).await));
                }
            }
            if let Some((_, Some(leader))) = seen.first() {
                if seen.iter().all(|(_, s)| *s == Some(*leader)) {
                    return *leader;
                }
            }
            tokio::time::sleep(Duration::from_millis(50)).await;
        }
        let views: Vec<String> = seen
            .iter()
            .map(|(node, leader)| match leader {
                Some(l) => format!("node {node} sees node {}", l + 1),
                None => format!("node {node} names no leader (or does not answer)"),
            })
            .collect();
        // A node that runs and names no leader may be stuck: where, says its stack.
        let mut stacks = String::new();
        for (node, leader) in &seen {
            if leader.is_none() {
                if let Some(pid) = self.pid(node - 1) {
                    stacks.push_str(&format!("--- node {node} stacks:\n{}", stack_digest(pid)));
                }
            }
        }
        panic!(
            "no leader agreed on within {limit:?}: {}\n{}{stacks}",
            views.join(", "),
            self.log_tails(40)
        );
    }

    /// Posts until the cluster answers with something other than 503 or a transport
    /// error (bounded), with one idempotency key for every attempt, as a client would.
    pub async fn post_until_served(
        &self,
        i: usize,
        path: &str,
        token: &str,
        body: Value,
        key: &str,
    ) -> (u16, Value) {
        let start = Instant::now();
        loop {
            let (status, reply) = self.post(i, path, token, body.clone(), Some(key)).await;
            if status != 0 && status != 503 {
                return (status, reply);
            }
            assert!(
                start.elapsed() < Duration::from_secs(10),
                "not served within 10 s: {status} {reply}"
            );
            tokio::time::sleep(Duration::from_millis(50)).await;
        }
    }

    pub async fn post(
        &self,
        i: usize,
        path: &str,
        token: &str,
        body: Value,
        key: Option<&str>,
    ) -> (u16, Value) {
        let mut request = self
            .http
            .post(self.url(i, path))
            .bearer_auth(token)
            .json(&body);
        if let Some(key) = key {
            request = request.header("Idempotency-Key", key);
        }
        match request.send().await {
            Ok(reply) => {
                let status = reply.status().as_u16();
                (status, reply.json().await.unwrap_or(Value::Null))
            }
            Err(e) => (0, json!({"transport_error": e.to_string()})),
        }
    }

    pub async fn get(&self, i: usize, path: &str, token: &str) -> (u16, Value) {
        match self
            .http
            .get(self.url(i, path))
            .bearer_auth(token)
            .send()
            .await
        {
            Ok(reply) => {
                let status = reply.status().as_u16();
                (status, reply.json().await.unwrap_or(Value::Null))
            }
            Err(e) => (0, json!({"transport_error": e.to_string()})),
        }
    }

    /// Creates an agent through node `i` and returns its token. A 503 (no leader yet,
    /// or leadership moved while the write was in flight, as happens in a cluster's first
    /// seconds) is retried with the same Idempotency-Key, as a client would, for 15 s.
    pub async fn create_agent(&self, i: usize, agent_id: &str, policy: Value) -> String {
        let key = format!("create-{agent_id}");
        let body = json!({"agent_id": agent_id, "policy": policy});
        let start = Instant::now();
        loop {
            let (status, answer) = self
                .post(
                    i,
                    "/v1/agents",
                    &self.admin.clone(),
                    body.clone(),
                    Some(&key),
                )
                .await;
            if status == 503 && start.elapsed() < Duration::from_secs(15) {
                tokio::time::sleep(Duration::from_millis(100)).await;
                continue;
            }
            assert_eq!(status, 200, "{answer}");
            return answer["token"].as_str().expect("token").to_string();
        }
    }

    /// Node `i`'s own copy of an agent's records (no forwarding).
    pub async fn local_log(&self, i: usize, agent_id: &str) -> Option<Vec<Value>> {
        let (status, body) = self
            .get(
                i,
                &format!("/v1/agents/{agent_id}/log?local=true&limit=5000"),
                &self.admin,
            )
            .await;
        (status == 200).then(|| body["records"].as_array().cloned().unwrap_or_default())
    }

    /// Waits (bounded) until every live node's copy of the agent's log is identical,
    /// and returns it.
    pub async fn converged_log(&self, agent_id: &str, limit: Duration) -> Vec<Value> {
        let start = Instant::now();
        loop {
            let mut logs = Vec::new();
            for i in 0..self.addrs.len() {
                if self.is_running(i) {
                    logs.push(self.local_log(i, agent_id).await);
                }
            }
            if let Some(Some(first)) = logs.first() {
                if logs.iter().all(|l| l.as_ref() == Some(first)) {
                    return first.clone();
                }
            }
            if start.elapsed() >= limit {
                self.keep_logs();
                let heads: Vec<_> = logs
                    .iter()
                    .map(|l| {
                        l.as_ref()
                            .map(|l| (l.len(), l.last().map(|r| r["hash"].clone())))
                    })
                    .collect();
                let mut views = Vec::new();
                for i in 0..self.addrs.len() {
                    let (status, view) = self.get(i, "/v1/cluster", &self.admin).await;
                    views.push(format!(
                        "node {}: {status} term {} commit {} applied {} leader {}",
                        i + 1,
                        view["term"],
                        view["commit_index"],
                        view["applied_index"],
                        view["leader"]
                    ));
                }
                panic!("replicas of {agent_id} did not converge within {limit:?}: (records, last hash) per node: {heads:?}; cluster views: {views:#?}");
            }
            tokio::time::sleep(Duration::from_millis(100)).await;
        }
    }

    /// Waits (bounded) until node `i` answers `/readyz` with 200 (a leader known, caught
    /// up, not under repair).
    pub async fn wait_ready(&self, i: usize, limit: Duration) {
        let start = Instant::now();
        loop {
            let ready = self
                .http
                .get(self.url(i, "/readyz"))
                .send()
                .await
                .map(|r| r.status().as_u16())
                .unwrap_or(0);
            if ready == 200 {
                return;
            }
            assert!(
                start.elapsed() < limit,
                "node {} not ready within {limit:?}\n{}",
                i + 1,
                self.log_tails(30)
            );
            tokio::time::sleep(Duration::from_millis(100)).await;
        }
    }

    /// The body of a GET on node `i` that must succeed (no token).
    pub async fn get_text(&self, i: usize, path: &str) -> String {
        let reply = self.http.get(self.url(i, path)).send().await.expect("GET");
        assert!(
            reply.status().is_success(),
            "GET {path}: {}",
            reply.status()
        );
        reply.text().await.expect("body")
    }

    /// Node `i`'s /metrics as `name{labels}` → value, without the `node` label.
    pub async fn metrics(&self, i: usize) -> BTreeMap<String, f64> {
        parse_metrics(&self.get_text(i, "/metrics").await)
    }

    /// The cluster's audit public key, from the first node that is running.
    pub async fn public_key(&self) -> String {
        let node = (0..self.addrs.len())
            .find(|i| self.is_running(*i))
            .expect("a running node");
        let (_, body) = self.get(node, "/v1/public-key", "").await;
        body["public_key"].as_str().expect("public key").to_string()
    }
}

impl Drop for Cluster {
    fn drop(&mut self) {
        if std::thread::panicking() && !self.external {
            self.keep_logs();
        }
        for i in 0..self.addrs.len() {
            self.kill(i);
        }
    }
}

/// A client that trusts only the CA in `ca` (PEM).
pub fn https_client(ca: &std::path::Path) -> reqwest::Client {
    let pem = std::fs::read(ca).expect("read the CA");
    let mut builder = reqwest::Client::builder()
        .timeout(Duration::from_secs(5))
        .use_rustls_tls()
        .tls_built_in_root_certs(false);
    for certificate in reqwest::Certificate::from_pem_bundle(&pem).expect("CA bundle") {
        builder = builder.add_root_certificate(certificate);
    }
    builder.build().expect("https client")
}

/// `name{labels} value` lines of the exposition format, keyed by `name{labels}` without
/// the `node` label (every series of a node carries it).
pub fn parse_metrics(text: &str) -> BTreeMap<String, f64> {
    text.lines()
        .filter(|l| !l.starts_with('#') && !l.is_empty())
        .filter_map(|l| {
            let (series, value) = l.rsplit_once(' ')?;
            let series = match series.split_once('{') {
                Some((name, labels)) => {
                    let labels: Vec<&str> = labels
                        .trim_end_matches('}')
                        .split(',')
                        .filter(|label| !label.starts_with("node=\""))
                        .collect();
                    if labels.is_empty() {
                        name.to_string()
                    } else {
                        format!("{name}{{{}}}", labels.join(","))
                    }
                }
                None => series.to_string(),
            };
            Some((series, value.parse().ok()?))
        })
        .collect()
}

/// Asserts that `log` (records as the API returns them) verifies with `public_key`.
pub fn verify_log(log: &[Value], public_key: &str) {
    let records: Vec<Record> = log
        .iter()
        .map(|r| serde_json::from_value(r.clone()).expect("record"))
        .collect();
    let report = verify_records(
        &records,
        &VerifyOptions {
            public_key: Some(public_key.to_string()),
            checkpoint: None,
        },
    );
    assert!(report.ok, "{report:?}");
}

/// A log's lines with runs of the same message (timestamps aside) folded into the first
/// and a count, so a burst of identical warnings does not push the cause out of a tail.
fn fold_repeats(text: &str) -> Vec<String> {
    // A tracing line starts with a 27-character RFC 3339 timestamp and a space.
    let message = |line: &str| line.get(28..).unwrap_or(line).to_string();
    let mut folded: Vec<String> = Vec::new();
    let mut last = String::new();
    let mut repeats = 0usize;
    for line in text.lines() {
        if !folded.is_empty() && message(line) == last {
            repeats += 1;
            continue;
        }
        if repeats > 0 {
            folded.push(format!("    ... and {repeats} more like it"));
            repeats = 0;
        }
        last = message(line);
        folded.push(line.to_string());
    }
    if repeats > 0 {
        folded.push(format!("    ... and {repeats} more like it"));
    }
    folded
}

/// A process's threads by state and kernel wait channel, e.g. "14 threads: 13 S
/// futex_wait_queue, 1 D ext4_sync_file": a thread in D sleeps in the kernel (a disk).
fn thread_states(pid: u32) -> String {
    let Ok(tasks) = std::fs::read_dir(format!("/proc/{pid}/task")) else {
        return "no /proc entry".into();
    };
    let mut counts: BTreeMap<String, usize> = BTreeMap::new();
    for task in tasks.flatten() {
        let path = task.path();
        let stat = std::fs::read_to_string(path.join("stat")).unwrap_or_default();
        // The state follows the command name, which is in parentheses.
        let state = stat
            .rsplit_once(") ")
            .and_then(|(_, rest)| rest.split(' ').next())
            .unwrap_or("?")
            .to_string();
        let wchan = std::fs::read_to_string(path.join("wchan")).unwrap_or_default();
        *counts.entry(format!("{state} {wchan}")).or_default() += 1;
    }
    let total: usize = counts.values().sum();
    let parts: Vec<String> = counts.iter().map(|(k, n)| format!("{n} {k}")).collect();
    format!("{total} threads: {}", parts.join(", "))
}

/// The frames of our code and of openraft and redb in each thread of `pid`, from gdb
/// (where it is installed): enough to see where a node that does not answer is stuck.
fn stack_digest(pid: u32) -> String {
    let output = Command::new("timeout")
        .args(["30", "gdb", "-batch", "-ex", "thread apply all bt", "-p"])
        .arg(pid.to_string())
        .stdin(Stdio::null())
        .output();
    let Ok(output) = output else {
        return "(gdb did not run)\n".into();
    };
    let text = String::from_utf8_lossy(&output.stdout);
    // A frame line is "#N  0xADDR in FUNCTION ..." or, at a function's start, "#N  FUNCTION
    // ...": ours are those whose function is in our crates, openraft or redb.
    let ours = |line: &str| {
        let function = match line.split_once(" in ") {
            Some((_, rest)) => rest,
            None => line.split_once("  ").map_or("", |(_, rest)| rest),
        };
        ["lineage_", "openraft::", "redb::"]
            .iter()
            .any(|crate_name| function.starts_with(crate_name))
    };
    let mut out = String::new();
    for thread in text.split("\nThread ").skip(1) {
        let frames: Vec<&str> = thread
            .lines()
            .filter(|l| l.starts_with('#') && ours(l))
            .take(6)
            .collect();
        if !frames.is_empty() {
            out.push_str(thread.lines().next().unwrap_or_default());
            out.push('\n');
            for frame in frames {
                // gdb's frame lines carry argument lists; the function and file suffice.
                out.push_str(&format!(
                    "  {}\n",
                    frame.chars().take(200).collect::<String>()
                ));
            }
        }
    }
    if out.is_empty() {
        // gdb may be missing, or not allowed to attach (ptrace): say which.
        let stderr = String::from_utf8_lossy(&output.stderr);
        out.push_str(&format!(
            "(no frames of ours; gdb exited {}: {})\n",
            output.status,
            stderr.lines().next().unwrap_or("no message")
        ));
    }
    // Bounded, so the log tails above stay in view of a report that is cut short.
    out.lines().take(80).map(|l| format!("{l}\n")).collect()
}

/// Each requested action's input key (`input.k`), with its action id.
pub fn actions_by_key(log: &[Value]) -> BTreeMap<String, String> {
    log.iter()
        .filter(|r| r["kind"] == "action_requested")
        .map(|r| {
            (
                r["payload"]["input"]["k"]
                    .as_str()
                    .unwrap_or("")
                    .to_string(),
                r["payload"]["action_id"].as_str().unwrap_or("").to_string(),
            )
        })
        .collect()
}
