//! Tampered storage: a record edited on disk is caught — at start-up when the records are
//! replayed, by the scrub when a checkpoint skipped them — and so is one cut from the end
//! (at start-up, against the end stored with the rows), and a byte flipped in a packed
//! run of records; the agent is quarantined (503 `quarantined`) while other agents keep
//! working. Records gone from the middle behind a checkpoint are refused by every read
//! across the hole.

#[path = "cluster/util.rs"]
mod util;

use std::path::Path;
use std::process::{Child, Command, Stdio};
use std::time::{Duration, Instant};

use redb::ReadableTable;
use reqwest::{Client, StatusCode};
use serde_json::{json, Value};

const ADMIN: &str = "an-admin-token-that-is-long-enough-0123456789";
const RECORDS: redb::TableDefinition<(&str, u64), &str> = redb::TableDefinition::new("records");

struct Node {
    child: Option<Child>,
    /// `LINEAGE_SCRUB_INTERVAL_SECS` (0: no scrub).
    scrub_secs: &'static str,
    /// `LINEAGE_SNAPSHOT_EVERY`: Raft entries between snapshots (the log purged behind).
    snapshot_every: &'static str,
    base: String,
    bind: String,
    data: tempfile::TempDir,
    http: Client,
}

impl Node {
    fn new() -> Node {
        let port = util::free_port();
        let bind = format!("127.0.0.1:{port}");
        Node {
            child: None,
            scrub_secs: "1",
            snapshot_every: "10000",
            base: format!("http://{bind}"),
            bind,
            data: tempfile::tempdir().unwrap(),
            http: Client::builder()
                .timeout(Duration::from_secs(5))
                .build()
                .unwrap(),
        }
    }

    async fn start(&mut self) {
        self.spawn();
        let start = Instant::now();
        loop {
            if let Ok(r) = self.http.get(format!("{}/readyz", self.base)).send().await {
                if r.status() == StatusCode::OK {
                    return;
                }
            }
            assert!(
                start.elapsed() < Duration::from_secs(15),
                "node not ready in 15 s; its log:\n{}",
                self.log()
            );
            tokio::time::sleep(Duration::from_millis(50)).await;
        }
    }

    /// Starts the node and waits (at most 30 s) for it to stop by itself: its exit status.
    fn start_expecting_it_to_stop(&mut self) -> std::process::ExitStatus {
        self.spawn();
        let mut child = self.child.take().unwrap();
        util::exit_within(&mut child, Duration::from_secs(30))
            .unwrap_or_else(|| panic!("the node still runs after 30 s; its log:\n{}", self.log()))
    }

    fn spawn(&mut self) {
        let child = Command::new(env!("CARGO_BIN_EXE_lineage-node"))
            .env("GUARD_DATA_DIR", self.data.path())
            .env("GUARD_BIND", &self.bind)
            .env("GUARD_ADMIN_TOKEN", ADMIN)
            .env("LINEAGE_SCRUB_INTERVAL_SECS", self.scrub_secs)
            .env("LINEAGE_SNAPSHOT_EVERY", self.snapshot_every)
            // Each apply committed durably, so the records are in the file when it is killed (by
            // default the state machine fsyncs every few seconds; the Raft log always).
            .env("LINEAGE_STATE_FSYNC_INTERVAL_MS", "0")
            .stdout(Stdio::null())
            .stderr(self.log_file())
            .spawn()
            .unwrap();
        self.child = Some(child);
    }

    /// Where the node's log goes (appended across restarts), beside its data.
    fn log_file(&self) -> std::fs::File {
        std::fs::OpenOptions::new()
            .create(true)
            .append(true)
            .open(self.data.path().join("node-stderr.log"))
            .unwrap()
    }

    fn log(&self) -> String {
        std::fs::read_to_string(self.data.path().join("node-stderr.log")).unwrap_or_default()
    }

    /// SIGTERM, then wait: a graceful stop (which checkpoints agent states).
    fn stop_gracefully(&mut self) {
        if let Some(mut child) = self.child.take() {
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

    fn kill(&mut self) {
        if let Some(mut child) = self.child.take() {
            let _ = child.kill();
            let _ = child.wait();
        }
    }

    async fn call(
        &self,
        method: reqwest::Method,
        path: &str,
        token: &str,
        body: Option<Value>,
    ) -> (StatusCode, Value) {
        let mut request = self
            .http
            .request(method, format!("{}{path}", self.base))
            .bearer_auth(token);
        if let Some(body) = body {
            request = request.json(&body);
        }
        let reply = request.send().await.unwrap();
        (reply.status(), reply.json().await.unwrap_or(Value::Null))
    }

    async fn setup_agents(&self) -> String {
        self.two_agents_with(json!({"cost": 1})).await;
        ADMIN.to_string()
    }

    /// Agents "victim" and "bystander" whose one tool, `pay`, has `rule`, each asked to
    /// pay 10 and 20: the decisions, in that order.
    async fn two_agents_with(&self, rule: Value) -> Vec<Value> {
        let policy = json!({"budget": 100, "scar_limit": 10, "tools": {"pay": rule}});
        let mut decisions = Vec::new();
        for agent in ["victim", "bystander"] {
            let (status, _) = self
                .call(
                    reqwest::Method::POST,
                    "/v1/agents",
                    ADMIN,
                    Some(json!({"agent_id": agent, "policy": policy})),
                )
                .await;
            assert_eq!(status, StatusCode::OK);
            for amount in [10, 20] {
                let (_, decision) = self
                    .call(
                        reqwest::Method::POST,
                        &format!("/v1/agents/{agent}/actions"),
                        ADMIN,
                        Some(json!({"tool": "pay", "input": {"amount": amount}})),
                    )
                    .await;
                decisions.push(decision);
            }
        }
        decisions
    }
}

impl Drop for Node {
    fn drop(&mut self) {
        self.kill();
    }
}

/// Edits the amount inside the victim's first action request, as someone with disk
/// access would.
fn tamper(data: &Path) {
    let db = redb::Database::create(data.join("node/node.redb")).unwrap();
    let txn = db.begin_write().unwrap();
    {
        let mut table = txn.open_table(RECORDS).unwrap();
        util::one_row_per_record(&mut table, "victim");
        let line = table
            .get(("victim", 2))
            .unwrap()
            .unwrap()
            .value()
            .to_string();
        let edited = line.replacen("\"amount\":10", "\"amount\":1000", 1);
        assert_ne!(line, edited);
        table.insert(("victim", 2), edited.as_str()).unwrap();
    }
    txn.commit().unwrap();
}

/// Cuts the victim's newest record away, as a lost write or someone with disk access
/// would: every record left still parses and chains.
fn cut_newest(data: &Path) {
    let db = redb::Database::create(data.join("node/node.redb")).unwrap();
    let txn = db.begin_write().unwrap();
    {
        let mut table = txn.open_table(RECORDS).unwrap();
        util::one_row_per_record(&mut table, "victim");
        let newest = table
            .range(("victim", 0)..=("victim", u64::MAX))
            .unwrap()
            .next_back()
            .unwrap()
            .unwrap()
            .0
            .value()
            .1;
        assert!(newest > 0, "nothing to cut");
        table.remove(("victim", newest)).unwrap();
    }
    txn.commit().unwrap();
}

/// Takes the victim's record at seq 2 out of the middle of its log, as a lost page
/// would: the rows before and after it still parse, and the log still ends where it did.
fn cut_from_the_middle(data: &Path) {
    let db = redb::Database::create(data.join("node/node.redb")).unwrap();
    let txn = db.begin_write().unwrap();
    {
        let mut table = txn.open_table(RECORDS).unwrap();
        util::one_row_per_record(&mut table, "victim");
        assert!(
            table.remove(("victim", 2)).unwrap().is_some(),
            "no record 2"
        );
    }
    txn.commit().unwrap();
}

/// Flips one bit in the middle of the victim's first packed run (records stored
/// compressed), one that unpacking refuses (a few bits zstd does not look at would read
/// back the same records, which is no test).
fn flip_in_packed_run(data: &Path) {
    use lineage_node::store::{packed_run, record_rows::PACKED_RUNS};
    let db = redb::Database::create(data.join("node/node.redb")).unwrap();
    let txn = db.begin_write().unwrap();
    {
        let mut table = txn.open_table(PACKED_RUNS).unwrap();
        let runs: Vec<(u64, Vec<u8>)> = table
            .range(("victim", 0)..=("victim", u64::MAX))
            .unwrap()
            .map(|row| {
                let (key, row) = row.unwrap();
                (key.value().1, row.value().to_vec())
            })
            .collect();
        assert!(runs.len() >= 2, "{} packed runs", runs.len());
        let (first, row) = &runs[0];
        let flipped = (row.len() / 2..row.len())
            .map(|at| {
                let mut flipped = row.clone();
                flipped[at] ^= 0x04;
                flipped
            })
            .find(|flipped| packed_run::unpack(flipped).is_err())
            .expect("a flip that unpacking refuses");
        table
            .insert(("victim", *first), flipped.as_slice())
            .unwrap();
    }
    txn.commit().unwrap();
}

async fn wait_quarantined(node: &Node) -> Value {
    let start = Instant::now();
    loop {
        let (status, body) = node
            .call(reqwest::Method::GET, "/v1/agents/victim", ADMIN, None)
            .await;
        if status == StatusCode::SERVICE_UNAVAILABLE {
            return body;
        }
        assert!(
            start.elapsed() < Duration::from_secs(10),
            "not quarantined: {status} {body}"
        );
        tokio::time::sleep(Duration::from_millis(100)).await;
    }
}

async fn assert_only_victim_quarantined(node: &Node) {
    let body = wait_quarantined(node).await;
    assert_eq!(body["code"], "quarantined");
    // The Rust client reports it at once: retrying a quarantined agent cannot help (it
    // would answer `Unavailable` after its 10 s of retries instead).
    let client = lineage_client::Client::new(std::slice::from_ref(&node.base), ADMIN)
        .unwrap()
        .with_retry_for(Duration::from_secs(10));
    match client.status("victim").await {
        Err(lineage_client::ClientError::Api { status, code, .. }) => {
            assert_eq!((status, code.as_str()), (503, "quarantined"))
        }
        other => panic!("expected the quarantine at once, got {other:?}"),
    }
    assert!(
        body["error"]
            .as_str()
            .unwrap()
            .starts_with("agent log failed verification: "),
        "{body}"
    );
    let (_, list) = node
        .call(reqwest::Method::GET, "/v1/agents", ADMIN, None)
        .await;
    let states: Vec<(String, String)> = list["agents"]
        .as_array()
        .unwrap()
        .iter()
        .map(|a| {
            (
                a["agent_id"].as_str().unwrap().into(),
                a["state"].as_str().unwrap().into(),
            )
        })
        .collect();
    assert_eq!(
        states,
        [
            ("bystander".into(), "active".into()),
            ("victim".into(), "quarantined".into())
        ]
    );
    // Nothing more is decided for the victim; the bystander carries on.
    let (status, _) = node
        .call(
            reqwest::Method::POST,
            "/v1/agents/victim/actions",
            ADMIN,
            Some(json!({"tool": "pay"})),
        )
        .await;
    assert_eq!(status, StatusCode::SERVICE_UNAVAILABLE);
    let (status, decision) = node
        .call(
            reqwest::Method::POST,
            "/v1/agents/bystander/actions",
            ADMIN,
            Some(json!({"tool": "pay"})),
        )
        .await;
    assert_eq!(status, StatusCode::OK);
    assert_eq!(decision["decision"], "allowed");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_record_edited_on_disk_is_caught_at_start_up() {
    let mut node = Node::new();
    node.start().await;
    node.setup_agents().await;
    node.kill();
    tamper(node.data.path());
    node.start().await;
    assert_only_victim_quarantined(&node).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_record_edited_behind_a_checkpoint_is_caught_by_the_scrub() {
    let mut node = Node::new();
    node.start().await;
    node.setup_agents().await;
    node.stop_gracefully();
    tamper(node.data.path());
    // Start-up trusts the checkpoint, so the agent is served at first (the scrub off:
    // at one pass a second it could win the race with this read on a slow machine)...
    node.scrub_secs = "0";
    node.start().await;
    let (status, _) = node
        .call(reqwest::Method::GET, "/v1/agents/victim", ADMIN, None)
        .await;
    assert_eq!(status, StatusCode::OK);
    node.stop_gracefully();
    // ...until the scrub re-verifies the stored records.
    node.scrub_secs = "1";
    node.start().await;
    assert_only_victim_quarantined(&node).await;
}

/// Records gone from the middle of a log behind a checkpoint (start-up does not replay
/// them, and no scrub runs here) are caught by the reads themselves: `/verify` fails the
/// copy, naming the missing seqs and the node; a log page across the hole is never
/// served with a hole in it: the agent is quarantined on this node (503 `quarantined`,
/// as the scrub would do), and other agents are served.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn records_missing_behind_a_checkpoint_are_refused_by_the_reads() {
    let mut node = Node::new();
    node.scrub_secs = "0";
    node.start().await;
    node.setup_agents().await;
    node.stop_gracefully();
    cut_from_the_middle(node.data.path());
    node.start().await;
    let (status, body) = node
        .call(
            reqwest::Method::GET,
            "/v1/agents/victim/verify",
            ADMIN,
            None,
        )
        .await;
    assert_eq!(status, StatusCode::OK, "{body}");
    assert_eq!(
        (&body["ok"], &body["node"]),
        (&json!(false), &json!(1)),
        "{body}"
    );
    assert!(
        body["failure"]
            .to_string()
            .contains("records 2..3 are missing"),
        "{body}"
    );
    let (status, body) = node
        .call(reqwest::Method::GET, "/v1/agents/victim/log", ADMIN, None)
        .await;
    assert_eq!(status, StatusCode::SERVICE_UNAVAILABLE, "{body}");
    assert_eq!(body["code"], "quarantined", "{body}");
    let message = body["error"].as_str().unwrap_or_default();
    assert!(
        message.contains("records 2..3 are missing") && message.contains("node 1"),
        "{body}"
    );
    assert_only_victim_quarantined(&node).await;
}

/// A power cut during a commit that grew the state machine's file can leave on disk the
/// header stating the longer file without the growth. redb 2.6 cannot open that (it
/// asserts), and the node exited at every start (`power_loss.rs` met it). Here, after a
/// kill -9 (the header says recovery is required), the file is cut back to its length
/// before it grew: the node starts, and every decision it acknowledged is in the log.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_state_file_shorter_than_its_header_after_a_crash_still_starts() {
    let mut node = Node::new();
    node.scrub_secs = "0";
    node.start().await;
    let policy = json!({
        "budget": 1_000_000,
        "scar_limit": 10,
        "tools": {"pay": {"cost": 1}},
        "limits": {"max_requests_per_minute": 600_000},
    });
    let (status, _) = node
        .call(
            reqwest::Method::POST,
            "/v1/agents",
            ADMIN,
            Some(json!({"agent_id": "grower", "policy": policy})),
        )
        .await;
    assert_eq!(status, StatusCode::OK);
    let file = node.data.path().join("node/node.redb");
    let size = || std::fs::metadata(&file).unwrap().len();
    let before = size();
    let pad = "x".repeat(8 * 1024);
    let mut allowed = 0u64;
    for n in 0..3_000 {
        let (status, decision) = node
            .call(
                reqwest::Method::POST,
                "/v1/agents/grower/actions",
                ADMIN,
                Some(json!({"tool": "pay", "input": {"n": n, "pad": pad}})),
            )
            .await;
        assert_eq!(
            (status, &decision["decision"]),
            (StatusCode::OK, &json!("allowed"))
        );
        allowed += 1;
        if size() > before {
            break;
        }
    }
    let grown = size();
    assert!(grown > before, "the file did not grow in {allowed} actions");
    node.kill();
    let cut = std::fs::OpenOptions::new().write(true).open(&file).unwrap();
    cut.set_len(before).unwrap();
    cut.sync_all().unwrap();
    drop(cut);
    node.start().await;
    assert_actions_kept(&node, "grower", allowed).await;
    // The file was extended to the length its header states. Which way redb then
    // recovered (its own recovery, or the file found corrupted, moved aside and rebuilt
    // from the Raft log: a commit after the growth may have put both commit slots past
    // the cut) depends on where the commits' pages lay: either keeps every decision.
    let log = node.log();
    assert!(log.contains("extended for redb's recovery"), "{log}");
    let moved_aside = std::fs::read_dir(node.data.path().join("node"))
        .unwrap()
        .flatten()
        .any(|e| e.file_name().to_string_lossy().contains("damaged"));
    println!(
        "{allowed} actions; file {before} -> {grown} bytes, cut back; moved aside: {moved_aside}"
    );
}

/// `agent`'s log holds `allowed` requested actions, and verifies.
async fn assert_actions_kept(node: &Node, agent: &str, allowed: u64) {
    let (status, log) = node
        .call(
            reqwest::Method::GET,
            &format!("/v1/agents/{agent}/log?limit=5000"),
            ADMIN,
            None,
        )
        .await;
    assert_eq!(status, StatusCode::OK, "{log}");
    let requested = log["records"]
        .as_array()
        .unwrap()
        .iter()
        .filter(|r| r["kind"] == "action_requested")
        .count() as u64;
    assert_eq!(requested, allowed, "acknowledged actions lost");
    let (status, verified) = node
        .call(
            reqwest::Method::GET,
            &format!("/v1/agents/{agent}/verify"),
            ADMIN,
            None,
        )
        .await;
    assert_eq!(
        (status, &verified["ok"]),
        (StatusCode::OK, &json!(true)),
        "{verified}"
    );
}

/// One bit of the state file's magic number flipped while the node was down: redb
/// refuses such a file at every start (a bare "invalid data"), so without the check the
/// node never started again. The file is damage: moved aside and rebuilt from the Raft
/// log, with every acknowledged action.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_flipped_bit_in_the_state_files_magic_number_is_rebuilt_from_the_log() {
    let edit = |image: &mut Vec<u8>| image[4] ^= 0x01;
    an_edited_state_file_is_rebuilt(Stop::Kill, "10000", edit, "not redb's").await;
}

/// redb's header: flags at byte 9 (bit 0: which commit slot is newest), then two 128-byte
/// slots from byte 64; a slot's byte 1 says whether user tables exist. Clears it in the
/// newest slot.
fn clear_user_tables_in_the_newest_commit_slot(image: &mut [u8]) {
    let present = 64 + usize::from(image[9] & 1) * 128 + 1;
    assert_eq!(image[present], 1, "the newest commit has no user tables");
    image[present] = 0;
}

/// After a clean stop redb reads the newest commit slot without checking it: with its
/// "user tables present" byte cleared, every table read as absent, and the node took its
/// file for a new one without a word (its Raft log then brought the state back). The
/// slot's checksum is now checked first: the file is damage, moved aside and rebuilt
/// from the log, and every acknowledged action is there.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_damaged_commit_slot_after_a_clean_stop_is_caught_and_rebuilt() {
    an_edited_state_file_is_rebuilt(
        Stop::Graceful,
        "10000",
        |image: &mut Vec<u8>| clear_user_tables_in_the_newest_commit_slot(image),
        "fails its checksum",
    )
    .await;
}

/// The same damage on a lone node whose Raft log was purged behind its snapshots: the
/// state file was the only copy of the purged entries (a snapshot is built from it when
/// asked for, not kept), and no peer can send one. The node moves the file aside and
/// stops, naming what may be lost and what to do; it never starts with the agent's
/// spending forgotten. (Until 1f2d976 the drop-in mode ignored LINEAGE_SNAPSHOT_EVERY,
/// and the test above, then run with snapshots every 5 entries, rebuilt from a whole log.)
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_lone_node_with_a_purged_log_stops_on_a_damaged_state_file() {
    let mut node = Node::new();
    node.scrub_secs = "0";
    node.snapshot_every = "5";
    node.start().await;
    pay_from_a_new_agent(&node, 30).await;
    node.stop_gracefully();
    let file = node.data.path().join("node/node.redb");
    let mut image = std::fs::read(&file).unwrap();
    clear_user_tables_in_the_newest_commit_slot(&mut image);
    std::fs::write(&file, &image).unwrap();
    let status = node.start_expecting_it_to_stop();
    let log = node.log();
    assert!(!status.success(), "{log}");
    assert!(
        log.contains("moved aside")
            && log.contains("may have lost acknowledged decisions")
            && log.contains("only voter")
            && log.contains("Restore"),
        "{log}"
    );
}

/// After a clean stop redb trusts the region tracker page number in its header (no
/// checksum covers it); one bit flipped there keeps it inside the file, so no header check
/// can tell, and redb panicked at every start. The panic while opening is caught and the
/// file taken for damage: moved aside, rebuilt, every acknowledged action there.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_panic_in_redb_opening_the_state_file_is_damage_not_the_end_of_the_node() {
    // The tracker page's number starts at byte 32 (its page index's low byte).
    let edit = |image: &mut Vec<u8>| image[32] ^= 0x01;
    an_edited_state_file_is_rebuilt(Stop::Graceful, "10000", edit, "redb panicked opening it")
        .await;
}

/// A byte flipped in every copy of the agent's name after a clean stop: the live B-tree
/// pages holding it fail their checksums. redb checks pages only when told to, and the
/// node told it only after an unclean stop: the node started and answered 404 "agent not
/// found". A file up to 1 GiB is now checked after a clean stop too, so the damage is
/// found at start, the file moved aside and rebuilt with every action.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_page_damaged_after_a_clean_stop_is_found_at_start() {
    let edit = |image: &mut Vec<u8>| {
        let mut hits = 0;
        for at in 4096..image.len().saturating_sub(5) {
            if &image[at..at + 5] == b"payer" {
                image[at] ^= 0x20;
                hits += 1;
            }
        }
        assert!(hits > 0, "the agent's name is nowhere in the file");
    };
    an_edited_state_file_is_rebuilt(Stop::Graceful, "10000", edit, "moved aside").await;
}

enum Stop {
    Graceful,
    Kill,
}

/// A node (snapshots every `snapshot_every` entries, no scrub) that paid 30 times
/// is stopped, and its state file changed by `edit`: it starts with every
/// acknowledged action, having moved the file aside and said `why`.
async fn an_edited_state_file_is_rebuilt(
    stop: Stop,
    snapshot_every: &'static str,
    edit: impl FnOnce(&mut Vec<u8>),
    why: &str,
) {
    let mut node = Node::new();
    node.scrub_secs = "0";
    node.snapshot_every = snapshot_every;
    node.start().await;
    let allowed = pay_from_a_new_agent(&node, 30).await;
    match stop {
        Stop::Graceful => node.stop_gracefully(),
        Stop::Kill => node.kill(),
    }
    let file = node.data.path().join("node/node.redb");
    let mut image = std::fs::read(&file).unwrap();
    edit(&mut image);
    std::fs::write(&file, &image).unwrap();
    node.start().await;
    assert_actions_kept(&node, "payer", allowed).await;
    let log = node.log();
    assert!(log.contains("moved aside") && log.contains(why), "{log}");
}

/// A new agent "payer" whose tool `pay` costs 1, asked to pay `times` times: how many
/// were allowed (all).
async fn pay_from_a_new_agent(node: &Node, times: u64) -> u64 {
    let policy = json!({"budget": 1_000, "scar_limit": 10, "tools": {"pay": {"cost": 1}}});
    let (status, _) = node
        .call(
            reqwest::Method::POST,
            "/v1/agents",
            ADMIN,
            Some(json!({"agent_id": "payer", "policy": policy})),
        )
        .await;
    assert_eq!(status, StatusCode::OK);
    for n in 0..times {
        let (status, decision) = node
            .call(
                reqwest::Method::POST,
                "/v1/agents/payer/actions",
                ADMIN,
                Some(json!({"tool": "pay", "input": {"n": n}})),
            )
            .await;
        assert_eq!(
            (status, &decision["decision"]),
            (StatusCode::OK, &json!("allowed"))
        );
    }
    times
}

/// A waiting action whose request record no longer reads back intact (here edited on
/// disk behind a checkpoint, with no scrub to quarantine the agent) is listed apart, with
/// why, in both approval queue pages: never shown with the changed input, and never
/// taking the rest of the queue (its agent's or anyone's) down with a 500.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_damaged_request_leaves_the_rest_of_the_approval_queue_readable() {
    let mut node = Node::new();
    node.scrub_secs = "0";
    node.start().await;
    let decisions = node
        .two_agents_with(json!({"cost": 1, "requires_approval": true}))
        .await;
    for decision in decisions {
        assert_eq!(decision["decision"], "pending_approval", "{decision}");
    }
    node.stop_gracefully();
    tamper(node.data.path());
    node.start().await;

    let (status, queue) = node
        .call(
            reqwest::Method::GET,
            "/v1/agents/victim/actions/pending",
            ADMIN,
            None,
        )
        .await;
    assert_eq!(status, StatusCode::OK, "{queue}");
    let inputs: Vec<&Value> = queue["pending"]
        .as_array()
        .unwrap()
        .iter()
        .map(|entry| &entry["action"]["input"])
        .collect();
    assert_eq!(inputs, [&json!({"amount": 20})], "{queue}");
    let unreadable = &queue["unreadable"];
    assert_eq!(unreadable.as_array().map(Vec::len), Some(1), "{queue}");
    assert_eq!(unreadable[0]["action_id"], "act-1", "{queue}");
    assert_eq!(unreadable[0]["seq"], 2, "{queue}");
    assert!(
        !queue.to_string().contains("1000"),
        "the changed input shown: {queue}"
    );

    let (status, page) = node
        .call(reqwest::Method::GET, "/v1/actions/pending", ADMIN, None)
        .await;
    assert_eq!(status, StatusCode::OK, "{page}");
    assert_eq!(page["total"], 4, "{page}");
    let shown: Vec<(String, Value)> = page["pending"]
        .as_array()
        .unwrap()
        .iter()
        .map(|entry| {
            (
                entry["agent_id"].as_str().unwrap().to_string(),
                entry["action"]["input"].clone(),
            )
        })
        .collect();
    assert_eq!(
        shown,
        [
            ("bystander".to_string(), json!({"amount": 10})),
            ("bystander".to_string(), json!({"amount": 20})),
            ("victim".to_string(), json!({"amount": 20})),
        ],
        "{page}"
    );
    assert_eq!(page["unreadable"][0]["agent_id"], "victim", "{page}");
    assert_eq!(page["unreadable"][0]["action_id"], "act-1", "{page}");
    the_cli_names_the_unreadable_request(&node);
    the_rust_client_names_the_unreadable_request(&node).await;
    // An intact queue has no `unreadable` at all, as the reference answers.
    let (_, intact) = node
        .call(
            reqwest::Method::GET,
            "/v1/agents/bystander/actions/pending",
            ADMIN,
            None,
        )
        .await;
    assert_eq!(intact.as_object().map(|o| o.len()), Some(1), "{intact}");
}

/// The Rust client's `pending_queue` names the unreadable request beside the readable
/// one; `pending` returns the readable one alone.
async fn the_rust_client_names_the_unreadable_request(node: &Node) {
    let client = lineage_client::Client::new(std::slice::from_ref(&node.base), ADMIN)
        .unwrap()
        .with_retry_for(Duration::from_secs(5));
    let queue = client.pending_queue("victim").await.unwrap();
    let inputs: Vec<&Value> = queue.pending.iter().map(|p| &p.action["input"]).collect();
    assert_eq!(inputs, [&json!({"amount": 20})], "{queue:?}");
    let named: Vec<(&str, &str, u64)> = queue
        .unreadable
        .iter()
        .map(|u| (u.agent_id.as_str(), u.action_id.as_str(), u.seq))
        .collect();
    assert_eq!(named, [("victim", "act-1", 2)], "{queue:?}");
    assert!(!queue.unreadable[0].error.is_empty(), "{queue:?}");
    assert_eq!(client.pending("victim").await.unwrap(), queue.pending);
    let intact = client.pending_queue("bystander").await.unwrap();
    assert_eq!((intact.pending.len(), intact.unreadable.len()), (2, 0));
}

/// `lineage agent pending` names the victim's unreadable request, in its table and in its
/// JSON, and does not call the queue empty; the Python client warns of it.
fn the_cli_names_the_unreadable_request(node: &Node) {
    let script = "import sys, warnings, lineage_guard\n\
        admin = lineage_guard.AdminClient(sys.argv[1], sys.argv[2], retry_for=5)\n\
        with warnings.catch_warnings(record=True) as caught:\n\
        \x20   warnings.simplefilter('always')\n\
        \x20   pending = admin.pending('victim')\n\
        named = [str(w.message) for w in caught if issubclass(w.category, lineage_guard.LineageWarning)]\n\
        print(len(pending), named)\n";
    let output = Command::new("python3")
        .args(["-c", script, &node.base, ADMIN])
        .env(
            "PYTHONPATH",
            Path::new(env!("CARGO_MANIFEST_DIR")).join("../client/python"),
        )
        .env("PYTHONDONTWRITEBYTECODE", "1")
        .output()
        .unwrap_or_else(|e| panic!("cannot run python3 (it is needed for this test): {e}"));
    let said = String::from_utf8_lossy(&output.stdout);
    assert!(output.status.success(), "{output:?}");
    assert!(
        said.starts_with("1 ") && said.contains("act-1 of victim cannot be shown"),
        "{said}"
    );
    let token_file = node.data.path().join("admin.token");
    std::fs::write(&token_file, ADMIN).unwrap();
    let cli = |args: &[&str]| {
        let output = Command::new(util::lineage_bin())
            .args(args)
            .args(["--url", &node.base, "--token-file"])
            .arg(&token_file)
            .output()
            .expect("run lineage");
        assert!(output.status.success(), "{output:?}");
        String::from_utf8(output.stdout).unwrap()
    };
    let text = cli(&["agent", "pending", "victim"]);
    assert!(
        text.contains("cannot be shown: victim act-1 at seq 2"),
        "{text}"
    );
    assert!(!text.contains("no action is waiting"), "{text}");
    let listed: Value = serde_json::from_str(&cli(&["agent", "pending", "--json"])).unwrap();
    assert_eq!(
        listed["pending"].as_array().map(Vec::len),
        Some(3),
        "{listed}"
    );
    assert_eq!(listed["unreadable"][0]["action_id"], "act-1", "{listed}");
}

/// The newest record cut away leaves a log that verifies on its own: start-up holds it to
/// the end committed with the rows, rather than taking it for the whole log (which would
/// refund what the cut action spent).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_record_cut_from_the_end_on_disk_is_caught_at_start_up() {
    let mut node = Node::new();
    node.start().await;
    node.setup_agents().await;
    node.kill();
    cut_newest(node.data.path());
    node.start().await;
    assert_only_victim_quarantined(&node).await;
}

/// Records stored packed (compressed, at a snapshot) with one bit flipped on disk: the
/// victim is quarantined, whether start-up or the scrub reads the run first, never
/// served from the records before the flip (which would refund what the rest spent).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_bit_flipped_in_a_packed_run_is_caught() {
    let mut node = Node::new();
    node.start().await;
    node.setup_agents().await;
    for amount in 0..40 {
        let (status, _) = node
            .call(
                reqwest::Method::POST,
                "/v1/agents/victim/actions",
                ADMIN,
                Some(json!({"tool": "pay", "input": {"amount": amount, "memo": "rent"}})),
            )
            .await;
        assert_eq!(status, StatusCode::OK);
    }
    let (status, body) = node
        .call(reqwest::Method::POST, "/v1/node/snapshot", ADMIN, None)
        .await;
    assert_eq!(status, StatusCode::OK, "{body}");
    node.kill();
    flip_in_packed_run(node.data.path());
    node.start().await;
    assert_only_victim_quarantined(&node).await;
}

/// One client's actions for "worker", sequential, until `stop` or the node stops
/// answering; returns the answers it got, and counts them in `acked` as they come.
async fn pay_until_stopped(
    http: Client,
    base: String,
    client: usize,
    stop: std::sync::Arc<std::sync::atomic::AtomicBool>,
    acked: std::sync::Arc<std::sync::atomic::AtomicUsize>,
) -> Vec<Value> {
    let mut acknowledged = Vec::new();
    for n in 0..5_000 {
        if stop.load(std::sync::atomic::Ordering::Relaxed) {
            break;
        }
        let input = json!({"to": format!("payee-{client}-{n}"), "memo": "m".repeat(200)});
        let reply = http
            .post(format!("{base}/v1/agents/worker/actions"))
            .bearer_auth(ADMIN)
            .json(&json!({"tool": "pay", "input": input}))
            .send()
            .await;
        let Ok(reply) = reply else { break };
        if reply.status() != StatusCode::OK {
            break;
        }
        let Ok(answer) = reply.json::<Value>().await else {
            break;
        };
        assert_eq!(answer["decision"], "allowed", "{answer}");
        acknowledged.push(answer);
        acked.fetch_add(1, std::sync::atomic::Ordering::Relaxed);
    }
    acknowledged
}

/// How many packed runs `agent` has in a stopped node's state file.
fn packed_runs_of(data: &Path, agent: &str) -> usize {
    use lineage_node::store::record_rows::PACKED_RUNS;
    let db = redb::Database::open(data.join("node/node.redb")).unwrap();
    let txn = db.begin_read().unwrap();
    let table = txn.open_table(PACKED_RUNS).unwrap();
    table.range((agent, 0)..=(agent, u64::MAX)).unwrap().count()
}

/// kill -9 while the node packs records (clients writing, merges every second): after the
/// restart every acknowledged action is there as it was answered, nothing acknowledged is
/// refunded, and the whole log verifies.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_node_killed_while_packing_loses_no_acknowledged_action() {
    let mut node = Node::new();
    node.start().await;
    let policy = json!({"budget": 1u64 << 40, "scar_limit": 10, "tools": {"pay": {"cost": 3}},
        "limits": {"max_requests_per_minute": 100000}});
    let (status, body) = node
        .call(
            reqwest::Method::POST,
            "/v1/agents",
            ADMIN,
            Some(json!({"agent_id": "worker", "policy": policy})),
        )
        .await;
    assert_eq!(status, StatusCode::OK, "{body}");
    // Three clients for at least three merge passes and 100 acknowledged actions (a
    // loaded machine answers slowly: counted, not timed; at most 60 s, and more than 50
    // are asserted below); then kill -9 with requests in flight.
    let stop = std::sync::Arc::new(std::sync::atomic::AtomicBool::new(false));
    let acked = std::sync::Arc::new(std::sync::atomic::AtomicUsize::new(0));
    let clients: Vec<_> = (0..3)
        .map(|client| {
            let (http, base) = (node.http.clone(), node.base.clone());
            tokio::spawn(pay_until_stopped(
                http,
                base,
                client,
                stop.clone(),
                acked.clone(),
            ))
        })
        .collect();
    let started = Instant::now();
    while started.elapsed() < Duration::from_millis(3_200)
        || (acked.load(std::sync::atomic::Ordering::Relaxed) < 100
            && started.elapsed() < Duration::from_secs(60))
    {
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
    node.kill();
    stop.store(true, std::sync::atomic::Ordering::Relaxed);
    let mut acknowledged = Vec::new();
    for client in clients {
        acknowledged.extend(client.await.unwrap());
    }
    assert!(
        acknowledged.len() > 50,
        "{} acknowledged",
        acknowledged.len()
    );
    assert!(
        packed_runs_of(node.data.path(), "worker") > 0,
        "nothing was packed before the kill"
    );

    node.start().await;
    for answer in &acknowledged {
        let id = answer["action_id"].as_str().unwrap();
        let (status, action) = node
            .call(
                reqwest::Method::GET,
                &format!("/v1/agents/worker/actions/{id}"),
                ADMIN,
                None,
            )
            .await;
        assert_eq!(status, StatusCode::OK, "{id}: {action}");
        assert_eq!(action["status"], "allowed", "{id}: {action}");
    }
    let lowest_remaining = acknowledged
        .iter()
        .map(|a| a["remaining"].as_u64().unwrap())
        .min()
        .unwrap();
    let (_, status) = node
        .call(reqwest::Method::GET, "/v1/agents/worker", ADMIN, None)
        .await;
    assert!(
        status["remaining"].as_u64().unwrap() <= lowest_remaining,
        "refunded: {status} after an answer with {lowest_remaining} remaining"
    );
    assert!(status["actions_allowed"].as_u64().unwrap() >= acknowledged.len() as u64);
    let (_, verified) = node
        .call(
            reqwest::Method::GET,
            "/v1/agents/worker/verify",
            ADMIN,
            None,
        )
        .await;
    assert_eq!(verified["ok"], true, "{verified}");
    assert_eq!(
        verified["records"],
        status["head"]["seq"].as_u64().unwrap() + 1
    );
}
