//! Formats pinned before the storage modules are split (issue 20): what this code wrote
//! must still load and give the same state after any refactor.
//!
//! The fixtures in `tests/fixtures/format-pin/` were made by this code from a fixed
//! history (fixed keys and clocks, so the records are byte for byte the same each time):
//! - `proposal.json`: the Raft entries' payloads as serialized (group commits with an
//!   idempotent answer, a heads round);
//! - `datadir.tar.gz`: a data directory after those entries were appended, applied and
//!   checkpointed, and the store closed cleanly (segment log and watermark, no vote yet, redb);
//! - `snapshot-meta.json`, `snapshot.bin`: the state machine's snapshot of it;
//! - `expected.json`: the state all of them must give.
//!
//! Only a deliberate format change (with its migration) remakes them:
//! `LINEAGE_WRITE_FORMAT_FIXTURES=1 cargo test -p lineage-node --test format_pin`.

mod spool;

use std::path::{Path, PathBuf};
use std::process::Command as Process;

use lineage_core::guard::{decide, seal, AgentState, Command, Outcome};
use lineage_core::{AuditKey, Policy, ToolRule};
use lineage_node::raft_types::{
    AppendRecords, Batch, IdempotentAnswer, Proposal, RecordLine, TypeConfig,
};
use lineage_node::store::{self, AgentSlot, StateMachine};
use openraft::storage::{RaftLogStorage, RaftStateMachine};
use openraft::testing::log_id;
use openraft::{Entry, EntryPayload, RaftLogReader, SnapshotMeta};
use serde_json::{json, Value};

fn fixtures() -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR")).join("tests/fixtures/format-pin")
}

/// The fixed history: one agent through every kind of write, one Raft entry each, with
/// an idempotent answer on the second, then a heads round.
fn history() -> Vec<Proposal> {
    let key = AuditKey::from_seed([7; 32]);
    let policy = Policy::new(20)
        .allow("search", ToolRule::cost(1))
        .allow("pay", ToolRule::cost(5).with_approval());
    let commands = [
        Command::Create {
            agent_id: "bot".into(),
            policy,
        },
        Command::Request {
            tool: "search".into(),
            input: json!({"q": "flights", "score": 0.1}),
            cost: None,
        },
        Command::Report {
            action_id: "act-1".into(),
            outcome: Outcome::success("3 results"),
        },
        Command::Request {
            tool: "pay".into(),
            input: json!({"to": "acme", "eur": 40}),
            cost: None,
        },
        Command::Approve {
            action_id: "act-2".into(),
            approver: "alice".into(),
            claimed_by: None,
            note: Some("invoice 7".into()),
        },
        Command::Request {
            tool: "shell".into(),
            input: json!({"cmd": "ls"}),
            cost: None,
        },
    ];
    let mut state = AgentState::new();
    let mut proposals = Vec::new();
    for (i, command) in commands.iter().enumerate() {
        let now = 1_800_000_000_000_000 + i as i64 * 1_000;
        let decided = decide(&state, command, now, key.public_key_hex()).expect("decide");
        let records = seal(&state, decided.drafts, &key, now);
        for record in &records {
            state.apply(record).expect("fold");
        }
        let idempotency = (i == 1).then(|| IdempotentAnswer {
            key: "request-1".into(),
            status: 200,
            body: serde_json::to_string(&decided.decision).expect("answer"),
            request: "digest-of-request-1".into(),
        });
        proposals.push(Proposal::Writes(Batch(std::sync::Arc::new(vec![
            AppendRecords {
                agent_id: "bot".into(),
                records: records
                    .into_iter()
                    .map(|r| RecordLine::new(r).expect("line"))
                    .collect(),
                idempotency,
                authority: None,
            },
        ]))));
    }
    proposals.push(Proposal::HeadsRound {
        origin: "lineage.local/cluster".into(),
    });
    proposals
}

fn entries(proposals: &[Proposal]) -> Vec<Entry<TypeConfig>> {
    proposals
        .iter()
        .enumerate()
        .map(|(i, p)| Entry {
            log_id: log_id(1, 1, i as u64 + 1),
            payload: EntryPayload::Normal(p.clone()),
        })
        .collect()
}

/// What a state machine holds, as the fixtures record it.
fn state_of(sm: &StateMachine) -> Value {
    let data = sm.read_data();
    let status = match data.agents.get("bot") {
        Some(AgentSlot::Active(state)) => serde_json::to_value(state.status()).expect("status"),
        other => panic!("agent bot not loaded: {other:?}"),
    };
    let size = data.heads.tree.size();
    drop(data);
    let heads = json!({
        "size": size,
        "rounds": sm.heads_rounds().expect("heads rounds"),
    });
    let lines: Vec<String> = sm
        .records("bot", 0, 100)
        .expect("records")
        .iter()
        .map(|r| r.to_line())
        .collect();
    let answer = sm
        .idempotent_answer("bot", "request-1")
        .expect("idempotency row")
        .map(|a| json!({"status": a.status, "body": a.body, "request": a.request}));
    json!({"status": status, "lines": lines, "heads": heads, "idempotent_answer": answer})
}

fn tar(args: &[&str], dir: &Path) {
    let status = Process::new("tar")
        .args(args)
        .current_dir(dir)
        .status()
        .expect("run tar");
    assert!(status.success(), "tar {args:?}");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn what_this_code_wrote_still_loads_and_gives_the_same_state() {
    let proposals = history();
    if std::env::var_os("LINEAGE_WRITE_FORMAT_FIXTURES").is_some() {
        write_fixtures(&proposals).await;
        return;
    }
    let dir = fixtures();
    let expected: Value = serde_json::from_str(
        &std::fs::read_to_string(dir.join("expected.json")).expect("expected.json"),
    )
    .expect("JSON");

    // The entries' bytes: today's history serializes exactly as pinned, and the pinned
    // bytes read back as today's history.
    let pinned = std::fs::read_to_string(dir.join("proposal.json")).expect("proposal.json");
    assert_eq!(
        serde_json::to_string_pretty(&proposals).expect("serialize"),
        pinned.trim_end(),
        "a serialized Proposal changed"
    );
    let read: Vec<Proposal> = serde_json::from_str(&pinned).expect("pinned proposals parse");
    assert_eq!(read, proposals);

    // The data directory: the log's entries and the state machine's state.
    let data = tempfile::tempdir().expect("tempdir");
    tar(
        &["-xzf", &dir.join("datadir.tar.gz").display().to_string()],
        data.path(),
    );
    let (mut log, mut sm) =
        store::open(&data.path().join("node")).expect("the pinned data dir opens");
    let mut reader = log.get_log_reader().await;
    let stored = reader
        .try_get_log_entries(1..proposals.len() as u64 + 1)
        .await
        .expect("log entries");
    assert_eq!(stored, entries(&proposals), "the segment log reads back");
    assert_eq!(state_of(&sm), expected, "the redb state machine");
    // Its agent checkpoint predates the action book (it held every action's input): it
    // does not parse as today's state, so the agent's records were replayed instead.
    let lines = expected["lines"].as_array().map_or(0, Vec::len) as u64;
    assert_eq!(sm.read_data().records_replayed_at_open, lines);

    // The snapshot installs into an empty node and gives the same state.
    let meta: SnapshotMeta<u64, openraft::BasicNode> = serde_json::from_str(
        &std::fs::read_to_string(dir.join("snapshot-meta.json")).expect("snapshot-meta.json"),
    )
    .expect("meta");
    let bytes = std::fs::read(dir.join("snapshot.bin")).expect("snapshot.bin");
    // The streaming writer makes the pinned bytes, from the pinned state.
    assert_eq!(spool::build(&mut sm).await, meta, "the snapshot's meta");
    let served = sm
        .get_current_snapshot()
        .await
        .expect("current snapshot")
        .expect("a snapshot was built");
    let mut served_body = served.snapshot;
    let served_bytes = spool::body_bytes(&mut served_body).await;
    assert!(
        served_bytes == bytes,
        "the snapshot body changed: {}",
        String::from_utf8_lossy(&served_bytes)
    );
    let empty = tempfile::tempdir().expect("tempdir");
    let (_log, mut fresh) = store::open(empty.path()).expect("open");
    fresh
        .install_snapshot(&meta, spool::spool_of(&bytes))
        .await
        .expect("the pinned snapshot installs");
    assert_eq!(state_of(&fresh), expected, "the snapshot");
    // The installed state, written out again, is the body it was installed from.
    let served = fresh
        .get_current_snapshot()
        .await
        .expect("current snapshot")
        .expect("the installed snapshot");
    let mut served_body = served.snapshot;
    assert!(
        spool::body_bytes(&mut served_body).await == bytes,
        "served as received"
    );
}

async fn write_fixtures(proposals: &[Proposal]) {
    let dir = fixtures();
    std::fs::create_dir_all(&dir).expect("fixtures dir");
    std::fs::write(
        dir.join("proposal.json"),
        serde_json::to_string_pretty(proposals).expect("serialize") + "\n",
    )
    .expect("write proposal.json");
    let data = tempfile::tempdir().expect("tempdir");
    let node = data.path().join("node");
    let expected = {
        let (mut log, mut sm) = store::open(&node).expect("open");
        log.append_and_wait(entries(proposals))
            .await
            .expect("append");
        sm.apply(entries(proposals)).await.expect("apply");
        sm.checkpoint_agents().expect("checkpoint");
        let meta = spool::build(&mut sm).await;
        std::fs::write(
            dir.join("snapshot-meta.json"),
            serde_json::to_string_pretty(&meta).expect("meta") + "\n",
        )
        .expect("write meta");
        let body = sm
            .get_current_snapshot()
            .await
            .expect("current snapshot")
            .expect("a snapshot was built");
        let mut spooled = body.snapshot;
        std::fs::write(
            dir.join("snapshot.bin"),
            spool::body_bytes(&mut spooled).await,
        )
        .expect("write snapshot");
        state_of(&sm)
    };
    store::mark_clean_stop(&node);
    std::fs::write(
        dir.join("expected.json"),
        serde_json::to_string_pretty(&expected).expect("expected") + "\n",
    )
    .expect("write expected.json");
    tar(
        &[
            "--sort=name",
            "--owner=0",
            "--group=0",
            "--mtime=@0",
            "-czf",
            &dir.join("datadir.tar.gz").display().to_string(),
            "node",
        ],
        data.path(),
    );
    eprintln!("format fixtures written to {}", dir.display());
}
