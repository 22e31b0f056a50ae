//! The checkpointer's rules one at a time (issue 23): what it accepts, each alarm it
//! raises and whom it blames, how it resyncs with a witness, what it keeps for the next
//! round, and what it remembers across a restart.
//!
//! The heads log here is scripted. A real cluster never rolls back, forks or rewrites an
//! agent's log, and those are the faults the checkpointer exists to catch, so the script
//! commits them on purpose. It signs with a real audit key through core's own
//! `Checkpoint::sign` and computes every root and proof with core's Merkle code, so each
//! honest answer is the one a node would give. Honest witnesses are this crate's own
//! `Witness`; a misbehaving witness answers from a script. The checkpointer is the real
//! one, with its redb state in a temporary directory, over real HTTP on 127.0.0.1.

use std::collections::HashMap;
use std::path::Path;
use std::sync::{Arc, Mutex};

use axum::body::Bytes;
use axum::extract::{Path as UrlPath, Query, State};
use axum::http::{HeaderMap, StatusCode};
use axum::response::{IntoResponse, Response};
use axum::routing::{get, post};
use axum::{Json, Router};
use base64::Engine;
use lineage_checkpointer::checkpointer::{Checkpointer, RoundReport, WitnessTarget};
use lineage_checkpointer::checkpointer_metrics::Metrics;
use lineage_checkpointer::cluster_client::ClusterClient;
use lineage_checkpointer::witness::Witness;
use lineage_core::heads::{Cosigner, HeadStatement};
use lineage_core::transparency::{self, Checkpoint, Hash};
use lineage_core::AuditKey;
use serde_json::json;
use sha2::{Digest, Sha256};

const ORIGIN: &str = "lineage.test/heads";
const PUBLISH_TOKEN: &str = "lop_publisher-token-for-the-test";
/// The scripted log serves at most this many leaves per page, so fetches page.
const LEAVES_PER_PAGE: usize = 2;

/// What the scripted heads log serves; the tests change it between rounds.
#[derive(Default)]
struct Script {
    /// Every agent's record hashes: the leaves of its own tree.
    records: HashMap<String, Vec<Hash>>,
    /// The heads log's leaves, in order.
    statements: Vec<HeadStatement>,
    /// Served as the checkpoint instead of the honest one.
    checkpoint_override: Option<String>,
    /// Answer the agent consistency proofs with 400.
    refuse_agent_proofs: bool,
    /// Every endpoint answers 503.
    down: bool,
    /// Status of a store of a witnessed checkpoint (200 when unset).
    store_status: Option<u16>,
    /// Witnessed checkpoints stored, with the bearer token each came with.
    stored: Vec<(String, String)>,
}

struct LogShared {
    key: AuditKey,
    script: Mutex<Script>,
}

impl LogShared {
    fn script(&self) -> std::sync::MutexGuard<'_, Script> {
        self.script.lock().unwrap_or_else(|p| p.into_inner())
    }
}

/// The heads log of a cluster, scripted, on a loopback port.
struct ScriptedLog {
    shared: Arc<LogShared>,
    url: String,
    server: tokio::task::JoinHandle<()>,
}

impl Drop for ScriptedLog {
    fn drop(&mut self) {
        self.server.abort();
    }
}

fn record_hash(agent: &str, seq: usize, salt: &str) -> Hash {
    Sha256::digest(format!("{agent}/{seq}/{salt}")).into()
}

fn leaf_bytes(statements: &[HeadStatement]) -> Vec<String> {
    statements.iter().map(HeadStatement::to_leaf).collect()
}

fn b64(hash: &Hash) -> String {
    base64::engine::general_purpose::STANDARD.encode(hash)
}

fn signed(key: &AuditKey, statements: &[HeadStatement]) -> String {
    Checkpoint {
        origin: ORIGIN.into(),
        size: statements.len() as u64,
        root: transparency::root(&leaf_bytes(statements)),
    }
    .sign(key)
    .expect("sign")
}

impl ScriptedLog {
    async fn start() -> ScriptedLog {
        let shared = Arc::new(LogShared {
            key: AuditKey::from_seed([7; 32]),
            script: Mutex::default(),
        });
        let app = Router::new()
            .route("/v1/transparency/checkpoint", get(log_checkpoint))
            .route("/v1/transparency/vkey", get(log_vkey))
            .route("/v1/transparency/leaves", get(log_leaves))
            .route("/v1/transparency/proof/consistency", get(log_consistency))
            .route(
                "/v1/agents/{agent}/proof/consistency",
                get(agent_consistency),
            )
            .route("/v1/transparency/checkpoint/witnessed", post(log_store))
            .with_state(shared.clone());
        let (url, server) = serve(app).await;
        ScriptedLog {
            shared,
            url,
            server,
        }
    }

    fn vkey(&self) -> String {
        lineage_core::heads::log_vkey(ORIGIN, self.shared.key.public_key_hex()).expect("vkey")
    }

    /// Appends `n` records to `agent`'s log and states its new head.
    fn append(&self, agent: &str, n: usize) {
        let mut script = self.shared.script();
        let records = script.records.entry(agent.to_string()).or_default();
        for _ in 0..n {
            let seq = records.len();
            records.push(record_hash(agent, seq, "original"));
        }
        state(&mut script, agent);
    }

    /// Changes `agent`'s record `seq` (nothing is stated).
    fn rewrite(&self, agent: &str, seq: usize) {
        let mut script = self.shared.script();
        let records = script.records.get_mut(agent).expect("agent");
        records[seq] = record_hash(agent, seq, "rewritten");
    }

    /// Cuts `agent`'s log to `size` records and states that head.
    fn cut(&self, agent: &str, size: usize) {
        let mut script = self.shared.script();
        script.records.get_mut(agent).expect("agent").truncate(size);
        state(&mut script, agent);
    }

    /// States `agent`'s current head again (a new leaf, same size).
    fn state_again(&self, agent: &str) {
        state(&mut self.shared.script(), agent);
    }

    /// States the head of `agent`'s first `size` records, which stay as they are.
    fn state_at(&self, agent: &str, size: usize) {
        let mut script = self.shared.script();
        let all = script.records[agent].clone();
        script
            .records
            .insert(agent.to_string(), all[..size].to_vec());
        state(&mut script, agent);
        script.records.insert(agent.to_string(), all);
    }

    fn change(&self, f: impl FnOnce(&mut Script)) {
        f(&mut self.shared.script());
    }

    fn stored(&self) -> Vec<(String, String)> {
        self.shared.script().stored.clone()
    }
}

/// Appends a statement of `agent`'s head as its records stand.
fn state(script: &mut Script, agent: &str) {
    let records = &script.records[agent];
    let statement = HeadStatement {
        agent_id: agent.to_string(),
        size: records.len() as u64,
        root: hex::encode(transparency::root(records)),
        head_hash: records.last().map(hex::encode).unwrap_or_default(),
    };
    script.statements.push(statement);
}

fn unavailable() -> Response {
    (StatusCode::SERVICE_UNAVAILABLE, "down\n").into_response()
}

/// The two numbers a query names, or the 400 a node gives without them.
fn numbers(query: &HashMap<String, String>, a: &str, b: &str) -> Option<(usize, usize)> {
    let number = |name: &str| query.get(name)?.parse().ok();
    Some((number(a)?, number(b)?))
}

fn missing(what: &str) -> Response {
    (StatusCode::BAD_REQUEST, format!("{what}\n")).into_response()
}

async fn log_checkpoint(State(log): State<Arc<LogShared>>) -> Response {
    let script = log.script();
    if script.down {
        return unavailable();
    }
    script
        .checkpoint_override
        .clone()
        .unwrap_or_else(|| signed(&log.key, &script.statements))
        .into_response()
}

async fn log_vkey(State(log): State<Arc<LogShared>>) -> Response {
    lineage_core::heads::log_vkey(ORIGIN, log.key.public_key_hex())
        .expect("vkey")
        .into_response()
}

async fn log_leaves(
    State(log): State<Arc<LogShared>>,
    Query(query): Query<HashMap<String, String>>,
) -> Response {
    let script = log.script();
    if script.down {
        return unavailable();
    }
    let Some((start, end)) = numbers(&query, "start", "end") else {
        return missing("start and end");
    };
    let end = end
        .min(script.statements.len())
        .min(start + LEAVES_PER_PAGE);
    let leaves = script.statements.get(start..end).unwrap_or_default();
    Json(json!({ "leaves": leaves })).into_response()
}

fn proof_answer(leaves: &[impl AsRef<[u8]> + Clone], old: usize, size: usize) -> Response {
    if old > size || size > leaves.len() {
        return (StatusCode::BAD_REQUEST, "out of range\n").into_response();
    }
    let proof = transparency::consistency_proof(&leaves[..size], old as u64).expect("proof");
    Json(json!({ "proof": proof.iter().map(b64).collect::<Vec<_>>() })).into_response()
}

async fn log_consistency(
    State(log): State<Arc<LogShared>>,
    Query(query): Query<HashMap<String, String>>,
) -> Response {
    let script = log.script();
    if script.down {
        return unavailable();
    }
    let Some((old, size)) = numbers(&query, "old", "size") else {
        return missing("old and size");
    };
    proof_answer(&leaf_bytes(&script.statements), old, size)
}

async fn agent_consistency(
    State(log): State<Arc<LogShared>>,
    UrlPath(agent): UrlPath<String>,
    Query(query): Query<HashMap<String, String>>,
) -> Response {
    let script = log.script();
    if script.refuse_agent_proofs {
        return (StatusCode::BAD_REQUEST, "no proof for you\n").into_response();
    }
    let Some((old, size)) = numbers(&query, "old", "size") else {
        return missing("old and size");
    };
    let records = script.records.get(&agent).cloned().unwrap_or_default();
    proof_answer(&records, old, size)
}

async fn log_store(
    State(log): State<Arc<LogShared>>,
    headers: HeaderMap,
    body: String,
) -> Response {
    let mut script = log.script();
    let status = script.store_status.unwrap_or(200);
    if status == 200 {
        let bearer = headers
            .get("authorization")
            .and_then(|v| v.to_str().ok())
            .unwrap_or_default()
            .to_string();
        script.stored.push((bearer, body));
    }
    StatusCode::from_u16(status)
        .unwrap_or(StatusCode::INTERNAL_SERVER_ERROR)
        .into_response()
}

async fn serve(app: Router) -> (String, tokio::task::JoinHandle<()>) {
    // The listener is bound here and kept, so the port cannot be taken in between.
    let listener = tokio::net::TcpListener::bind("127.0.0.1:0")
        .await
        .expect("bind");
    let url = format!("http://{}", listener.local_addr().expect("addr"));
    let server = tokio::spawn(async move {
        axum::serve(listener, app).await.expect("serve");
    });
    (url, server)
}

/// How the scripted witness answers `add-checkpoint`.
#[derive(Clone)]
enum Answer {
    /// As this crate's witness does (it trusts the scripted log).
    Honest,
    /// 200 with a cosignature under the witness's name by another key.
    CosignWithAnotherKey,
    /// This status and body.
    Plain(u16, String),
}

struct WitnessShared {
    honest: Witness,
    answer: Mutex<Answer>,
    requests: Mutex<usize>,
}

/// A witness whose answers the test chooses; `Answer::Honest` is the real witness.
struct ScriptedWitness {
    shared: Arc<WitnessShared>,
    target: WitnessTarget,
    server: tokio::task::JoinHandle<()>,
}

impl Drop for ScriptedWitness {
    fn drop(&mut self) {
        self.server.abort();
    }
}

fn now_secs() -> u64 {
    std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)
        .map_or(0, |d| d.as_secs())
}

impl ScriptedWitness {
    async fn start(dir: &Path, name: &str, log: &ScriptedLog, answer: Answer) -> ScriptedWitness {
        let seed = Sha256::digest(name.as_bytes()).into();
        let honest = Witness::open(&dir.join(name), name, seed).expect("witness");
        honest.add_log(ORIGIN, &log.vkey()).expect("trust the log");
        let vkey = honest.vkey();
        let shared = Arc::new(WitnessShared {
            honest,
            answer: Mutex::new(answer),
            requests: Mutex::new(0),
        });
        let app = Router::new()
            .route("/add-checkpoint", post(witness_add))
            .route("/{origin_hash}/checkpoint", get(witness_monitoring))
            .with_state(shared.clone());
        let (url, server) = serve(app).await;
        let target = WitnessTarget::parse(&format!("{url}={vkey}")).expect("target");
        ScriptedWitness {
            shared,
            target,
            server,
        }
    }

    fn answer(&self, answer: Answer) {
        *self.shared.answer.lock().unwrap_or_else(|p| p.into_inner()) = answer;
    }

    fn requests(&self) -> usize {
        *self
            .shared
            .requests
            .lock()
            .unwrap_or_else(|p| p.into_inner())
    }

    /// Submits `note` (size `size`, from `old` with `proof`) to the honest witness
    /// directly, as another checkpointer of the same log would.
    fn submit_directly(&self, old: u64, proof: &[String], note: &str) -> u16 {
        let body = format!(
            "old {old}\n{}\n{note}",
            proof.iter().map(|p| format!("{p}\n")).collect::<String>()
        );
        self.shared
            .honest
            .add_checkpoint(body.as_bytes(), now_secs)
            .expect("add-checkpoint")
            .status
    }
}

async fn witness_add(State(witness): State<Arc<WitnessShared>>, body: Bytes) -> Response {
    *witness.requests.lock().unwrap_or_else(|p| p.into_inner()) += 1;
    let answer = witness
        .answer
        .lock()
        .unwrap_or_else(|p| p.into_inner())
        .clone();
    match answer {
        Answer::Honest => {
            let reply = witness
                .honest
                .add_checkpoint(&body, now_secs)
                .expect("add-checkpoint");
            let status = StatusCode::from_u16(reply.status).expect("status");
            (status, reply.body).into_response()
        }
        Answer::CosignWithAnotherKey => {
            let text = String::from_utf8_lossy(&body);
            let note = text.split_once("\n\n").map_or("", |(_, note)| note);
            let checkpoint_text = note.split_once("\n\n").map_or("", |(text, _)| text);
            let impostor = Cosigner::new("w1", AuditKey::from_seed([12; 32])).expect("cosigner");
            impostor
                .cosign(&format!("{checkpoint_text}\n"), now_secs())
                .into_response()
        }
        Answer::Plain(status, body) => {
            (StatusCode::from_u16(status).expect("status"), body).into_response()
        }
    }
}

async fn witness_monitoring(
    State(witness): State<Arc<WitnessShared>>,
    UrlPath(origin_hash): UrlPath<String>,
) -> Response {
    match witness.honest.monitoring_checkpoint(&origin_hash) {
        Ok(Some(note)) => note.into_response(),
        _ => (StatusCode::NOT_FOUND, "none\n").into_response(),
    }
}

async fn open(
    dir: &Path,
    log: &ScriptedLog,
    witnesses: Vec<WitnessTarget>,
    quorum: usize,
) -> (Checkpointer, Metrics) {
    let metrics = Metrics::new(1.0).expect("metrics");
    let client =
        ClusterClient::new(vec![log.url.clone()], Some(PUBLISH_TOKEN.into())).expect("client");
    let checkpointer = Checkpointer::open(dir, client, witnesses, quorum, None, metrics.clone())
        .await
        .expect("open");
    (checkpointer, metrics)
}

async fn round(checkpointer: &Checkpointer) -> RoundReport {
    checkpointer.round().await.expect("round")
}

fn log_alarms(metrics: &Metrics) -> u64 {
    metrics
        .inconsistencies
        .with_label_values(&["monitor", "log"])
        .get()
}

fn evidence_files(dir: &Path) -> Vec<String> {
    let mut files: Vec<String> = std::fs::read_dir(dir.join("evidence"))
        .expect("evidence dir")
        .map(|e| std::fs::read_to_string(e.expect("entry").path()).expect("evidence"))
        .collect();
    files.sort();
    files
}

/// The one alarm of a round, which must be of `kind`.
fn the_alarm<'a>(report: &'a RoundReport, kind: &str) -> &'a str {
    assert_eq!(report.alarms.len(), 1, "one alarm expected: {report:?}");
    let alarm = &report.alarms[0];
    assert!(
        alarm.starts_with(&format!("{kind}: ")),
        "expected {kind}, got {alarm}"
    );
    alarm
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_honest_log_is_accepted_cosigned_and_stored_and_nothing_is_done_twice() {
    let dir = tempfile::tempdir().expect("tempdir");
    let log = ScriptedLog::start().await;
    let witness = ScriptedWitness::start(dir.path(), "w1", &log, Answer::Honest).await;
    for agent in ["a", "b", "c", "d", "e"] {
        log.append(agent, 3);
    }
    let (checkpointer, metrics) = open(dir.path(), &log, vec![witness.target.clone()], 1).await;
    assert_eq!(checkpointer.log_vkey(), log.vkey(), "the vkey is fetched");

    // Five leaves, fetched over three pages.
    let report = round(&checkpointer).await;
    assert_eq!(
        report,
        RoundReport {
            size: 5,
            new_statements: 5,
            cosigned_by: vec!["w1".into()],
            alarms: vec![],
            stored: true,
        }
    );
    let stored = log.stored();
    assert_eq!(stored.len(), 1);
    assert_eq!(stored[0].0, format!("Bearer {PUBLISH_TOKEN}"));
    let witnessed = lineage_core::heads::verify_witnessed(
        &stored[0].1,
        &log.vkey(),
        std::slice::from_ref(&witness.target.vkey),
        1,
    )
    .expect("the stored note verifies with the log's key and the witness's");
    assert_eq!(witnessed.checkpoint.size, 5);
    assert_eq!(metrics.checkpoint_size.get(), 5);
    assert_eq!(metrics.cosigned_size.with_label_values(&["w1"]).get(), 5);
    assert!(metrics.checkpoint_age.get().abs() < f64::EPSILON);

    // Nothing new: no submission and no store.
    let requests = witness.requests();
    let report = round(&checkpointer).await;
    assert_eq!((report.size, report.new_statements), (5, 0));
    assert!(
        report.cosigned_by.is_empty() && !report.stored,
        "{report:?}"
    );
    assert_eq!(
        witness.requests(),
        requests,
        "an already cosigned size is not sent again"
    );

    // Honest growth, including an agent stated twice in one batch.
    log.append("a", 2);
    log.append("a", 1);
    log.append("f", 1);
    let report = round(&checkpointer).await;
    assert_eq!((report.size, report.new_statements), (8, 3));
    assert_eq!(report.cosigned_by, vec!["w1".to_string()]);
    assert!(report.alarms.is_empty(), "{report:?}");
    assert_eq!(log_alarms(&metrics), 0);
    assert!(evidence_files(dir.path()).is_empty());
    assert_eq!(log.stored().len(), 2);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_checkpoint_not_signed_by_the_log_key_alarms_once_and_is_never_accepted() {
    let dir = tempfile::tempdir().expect("tempdir");
    let log = ScriptedLog::start().await;
    log.append("a", 2);
    log.append("b", 2);
    let (checkpointer, metrics) = open(dir.path(), &log, vec![], 1).await;
    let impostor = AuditKey::from_seed([8; 32]);
    let forged = signed(&impostor, &log.shared.script().statements);
    log.change(|s| s.checkpoint_override = Some(forged.clone()));

    for _ in 0..3 {
        let report = round(&checkpointer).await;
        the_alarm(&report, "bad_checkpoint_signature");
        assert_eq!(report.size, 0, "nothing is accepted: {report:?}");
    }
    assert_eq!(log_alarms(&metrics), 1, "a standing fault counts once");
    let evidence = evidence_files(dir.path());
    assert_eq!(evidence.len(), 1, "one evidence file for one fault");
    assert!(evidence[0].contains(&forged), "{}", evidence[0]);
    assert!(evidence[0].starts_with("alarm: bad_checkpoint_signature\nsource: monitor\n"));
    assert_eq!(metrics.unresolved_evidence.get(), 1);

    log.change(|s| s.checkpoint_override = None);
    let report = round(&checkpointer).await;
    assert_eq!((report.size, report.alarms.len()), (2, 0), "{report:?}");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn rollback_and_fork_are_caught_after_a_restart_and_the_pinned_key_holds() {
    let dir = tempfile::tempdir().expect("tempdir");
    let log = ScriptedLog::start().await;
    for agent in ["a", "b", "c"] {
        log.append(agent, 1);
    }
    {
        let (checkpointer, _) = open(dir.path(), &log, vec![], 1).await;
        assert_eq!(round(&checkpointer).await.size, 3);
    }
    // Restarted: what was accepted is on disk.
    let (checkpointer, metrics) = open(dir.path(), &log, vec![], 1).await;
    let honest = log.shared.script().statements.clone();

    log.change(|s| {
        s.statements.pop();
    });
    let report = round(&checkpointer).await;
    let alarm = the_alarm(&report, "heads_rollback");
    assert!(
        alarm.contains("size 2") && alarm.contains("size 3"),
        "{alarm}"
    );
    assert_eq!(report.size, 3, "the accepted checkpoint stands");

    log.change(|s| {
        s.statements.push(HeadStatement {
            agent_id: "c".into(),
            size: 9,
            root: hex::encode([1u8; 32]),
            head_hash: hex::encode([2u8; 32]),
        });
    });
    let report = round(&checkpointer).await;
    the_alarm(&report, "heads_fork");
    assert_eq!(report.size, 3);
    assert_eq!(log_alarms(&metrics), 2);

    log.change(|s| s.statements = honest);
    let report = round(&checkpointer).await;
    assert_eq!((report.size, report.alarms.len()), (3, 0), "{report:?}");
    drop(checkpointer);

    let other =
        lineage_core::heads::log_vkey(ORIGIN, AuditKey::from_seed([9; 32]).public_key_hex())
            .expect("vkey");
    let client = ClusterClient::new(vec![log.url.clone()], None).expect("client");
    let refused = Checkpointer::open(
        dir.path(),
        client,
        vec![],
        1,
        Some(other),
        Metrics::new(1.0).expect("metrics"),
    )
    .await;
    let Err(e) = refused else {
        panic!("a different log key than the pinned one must be refused")
    };
    assert!(e.to_string().contains("differs from the key pinned"), "{e}");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn leaves_that_do_not_extend_the_accepted_tree_alarm() {
    let dir = tempfile::tempdir().expect("tempdir");
    let log = ScriptedLog::start().await;
    log.append("a", 1);
    log.append("b", 1);
    let (checkpointer, metrics) = open(dir.path(), &log, vec![], 1).await;
    assert_eq!(round(&checkpointer).await.size, 2);

    // An accepted leaf rewritten, and the log signs the rewritten tree.
    log.append("c", 1);
    let honest = log.shared.script().statements.clone();
    log.change(|s| s.statements[0].head_hash = hex::encode([3u8; 32]));
    let report = round(&checkpointer).await;
    let alarm = the_alarm(&report, "heads_not_extending");
    assert!(alarm.contains("2..3"), "{alarm}");
    assert_eq!(report.size, 2);

    // New leaves served that are not the ones the signed root covers.
    log.change(|s| s.statements = honest.clone());
    let signed_honestly = signed(&log.shared.key, &honest);
    log.change(|s| {
        s.checkpoint_override = Some(signed_honestly);
        s.statements[2].size = 5;
    });
    let report = round(&checkpointer).await;
    the_alarm(&report, "heads_not_extending");
    assert_eq!(log_alarms(&metrics), 2);

    log.change(|s| {
        s.checkpoint_override = None;
        s.statements = honest;
    });
    let report = round(&checkpointer).await;
    assert_eq!((report.size, report.alarms.len()), (3, 0), "{report:?}");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_agent_log_cut_short_or_rewritten_is_an_alarm_against_the_log() {
    let dir = tempfile::tempdir().expect("tempdir");
    let log = ScriptedLog::start().await;
    log.append("a", 4);
    log.append("b", 1);
    let (checkpointer, metrics) = open(dir.path(), &log, vec![], 1).await;
    assert_eq!(round(&checkpointer).await.alarms, Vec::<String>::new());

    // Cut short, while another agent grows honestly in the same round.
    log.cut("a", 2);
    log.append("b", 1);
    let alarm = the_alarm(&round(&checkpointer).await, "agent_head_inconsistent").to_string();
    assert!(alarm.contains("agent a: log cut short: size 2"), "{alarm}");

    // The same size stated again with another root.
    log.rewrite("a", 1);
    log.state_again("a");
    let alarm = the_alarm(&round(&checkpointer).await, "agent_head_inconsistent").to_string();
    assert!(
        alarm.contains("size 2 stated again with another root"),
        "{alarm}"
    );

    // Grown, but not from the witnessed records: the consistency proof fails.
    log.rewrite("a", 0);
    log.append("a", 3);
    let alarm = the_alarm(&round(&checkpointer).await, "agent_head_inconsistent").to_string();
    assert!(
        alarm.contains("size 5 does not extend the witnessed size 2"),
        "{alarm}"
    );

    // Grown, and the cluster cannot prove it.
    log.append("a", 1);
    log.change(|s| s.refuse_agent_proofs = true);
    let alarm = the_alarm(&round(&checkpointer).await, "agent_head_inconsistent").to_string();
    assert!(
        alarm.contains("cannot prove size 6 extends size 5"),
        "{alarm}"
    );
    log.change(|s| s.refuse_agent_proofs = false);

    // Within one batch each statement is checked against the one before it.
    log.append("a", 2);
    log.state_at("a", 7);
    let alarm = the_alarm(&round(&checkpointer).await, "agent_head_inconsistent").to_string();
    assert!(
        alarm.contains("size 7 after a witnessed head of size 8"),
        "{alarm}"
    );

    // Honest growth after all that raises nothing.
    log.append("a", 1);
    log.append("b", 1);
    let report = round(&checkpointer).await;
    assert!(report.alarms.is_empty(), "{report:?}");
    assert_eq!(log_alarms(&metrics), 5);
    let evidence = evidence_files(dir.path());
    assert_eq!(evidence.len(), 5);
    assert!(evidence
        .iter()
        .all(|e| e.contains("new statement: {\"agent_id\":\"a\"")));
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_misbehaving_witness_is_blamed_and_a_failing_one_is_only_retried() {
    let dir = tempfile::tempdir().expect("tempdir");
    let log = ScriptedLog::start().await;
    log.append("a", 1);
    let witness =
        ScriptedWitness::start(dir.path(), "w1", &log, Answer::CosignWithAnotherKey).await;
    let (checkpointer, metrics) = open(dir.path(), &log, vec![witness.target.clone()], 1).await;
    let blamed = || {
        metrics
            .inconsistencies
            .with_label_values(&["w1", "witness"])
            .get()
    };

    let report = round(&checkpointer).await;
    the_alarm(&report, "bad_cosignature");
    assert!(
        report.cosigned_by.is_empty() && !report.stored,
        "{report:?}"
    );
    assert_eq!(metrics.cosigned_size.with_label_values(&["w1"]).get(), 0);

    witness.answer(Answer::Plain(403, "unknown log\n".into()));
    let alarm = the_alarm(&round(&checkpointer).await, "witness_refused").to_string();
    assert!(alarm.contains("403: unknown log"), "{alarm}");

    witness.answer(Answer::Plain(409, "a lot\n".into()));
    the_alarm(&round(&checkpointer).await, "witness_protocol");

    // It names our own size each time: resent once, then a fork.
    witness.answer(Answer::Plain(409, "1\n".into()));
    let before = witness.requests();
    the_alarm(&round(&checkpointer).await, "witness_fork");
    assert_eq!(witness.requests() - before, 2, "resent once at our size");

    // Ahead of us with nothing signed by the log to show.
    witness.answer(Answer::Plain(409, "40\n".into()));
    the_alarm(&round(&checkpointer).await, "witness_ahead_unproven");
    assert_eq!(blamed(), 5);
    assert_eq!(log_alarms(&metrics), 0, "none of this is the log's fault");

    // A 5xx is not an alarm: counted, and tried again next round.
    witness.answer(Answer::Plain(503, "busy\n".into()));
    let report = round(&checkpointer).await;
    assert!(report.alarms.is_empty(), "{report:?}");
    assert_eq!(metrics.witness_errors.with_label_values(&["w1"]).get(), 1);
    assert!(
        metrics.checkpoint_age.get() > 0.0,
        "the checkpoint waits for a quorum"
    );

    // An answer larger than any witness sends is not read whole, and is no answer to act
    // on: counted and tried again, as a 5xx (read whole, this one was a bad cosignature).
    witness.answer(Answer::Plain(200, "x".repeat(1 << 20)));
    let report = round(&checkpointer).await;
    assert!(report.alarms.is_empty(), "{report:?}");
    assert_eq!(metrics.witness_errors.with_label_values(&["w1"]).get(), 2);
    // A refusal padded past the bound is still a refusal, blamed on the witness.
    witness.answer(Answer::Plain(403, "x".repeat(1 << 20)));
    the_alarm(&round(&checkpointer).await, "witness_refused");
    assert_eq!(blamed(), 6);

    witness.answer(Answer::Honest);
    let report = round(&checkpointer).await;
    assert_eq!(report.cosigned_by, vec!["w1".to_string()]);
    assert!(report.stored && report.alarms.is_empty(), "{report:?}");
    assert!(metrics.checkpoint_age.get().abs() < f64::EPSILON);
    assert_eq!(blamed(), 6);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn witnesses_are_resynced_and_what_was_not_stored_is_stored_later() {
    let dir = tempfile::tempdir().expect("tempdir");
    let log = ScriptedLog::start().await;
    log.append("a", 1);
    log.append("b", 1);
    let w1 = ScriptedWitness::start(dir.path(), "w1", &log, Answer::Honest).await;
    let w2 = ScriptedWitness::start(dir.path(), "w2", &log, Answer::Honest).await;

    // w2 already holds size 2 of this log from someone else.
    let at_two = signed(&log.shared.key, &log.shared.script().statements);
    assert_eq!(w2.submit_directly(0, &[], &at_two), 200);
    log.append("c", 1);
    log.append("d", 1);

    let (checkpointer, metrics) = open(
        dir.path(),
        &log,
        vec![w1.target.clone(), w2.target.clone()],
        2,
    )
    .await;
    log.change(|s| s.store_status = Some(503));
    let report = round(&checkpointer).await;
    assert_eq!(report.size, 4);
    assert_eq!(report.cosigned_by, vec!["w1".to_string(), "w2".to_string()]);
    assert!(!report.stored && report.alarms.is_empty(), "{report:?}");
    assert_eq!(
        w2.requests(),
        2,
        "w2 answered 409 at 2 and cosigned from there"
    );
    assert!(log.stored().is_empty());

    // The cluster takes the cosigned note at the next round, with nothing new to sign.
    log.change(|s| s.store_status = None);
    let report = round(&checkpointer).await;
    assert!(report.stored && report.cosigned_by.is_empty(), "{report:?}");
    let stored = log.stored();
    assert_eq!(stored.len(), 1);
    let vkeys = [w1.target.vkey.clone(), w2.target.vkey.clone()];
    let witnessed = lineage_core::heads::verify_witnessed(&stored[0].1, &log.vkey(), &vkeys, 2)
        .expect("both cosignatures");
    assert_eq!(witnessed.checkpoint.size, 4);

    // The cluster down: the round ends early, counted, with no alarm.
    log.change(|s| s.down = true);
    let report = round(&checkpointer).await;
    assert_eq!(report, RoundReport::default());
    assert_eq!(metrics.fetch_errors.get(), 1);
    log.change(|s| s.down = false);
    log.append("e", 1);
    let report = round(&checkpointer).await;
    assert_eq!(
        (report.size, report.cosigned_by.len()),
        (5, 2),
        "{report:?}"
    );
    // After the outage the cluster gets the new checkpoint, cosigned by both.
    assert!(report.stored && report.alarms.is_empty(), "{report:?}");
    let stored = log.stored();
    assert_eq!(stored.len(), 2);
    let witnessed = lineage_core::heads::verify_witnessed(&stored[1].1, &log.vkey(), &vkeys, 2)
        .expect("both cosignatures");
    assert_eq!(witnessed.checkpoint.size, 5);
    assert_eq!(
        metrics
            .inconsistencies
            .with_label_values(&["monitor", "log"])
            .get(),
        0
    );
}
