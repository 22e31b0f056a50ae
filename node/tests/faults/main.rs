//! Fault scenarios under steady load, each judged by the history checker: kill -9 of the
//! leader (with the leader's early acknowledgement, the default, and without), a frozen
//! leader (SIGSTOP), a follower whose disk is wiped. Each run is bounded in time; from
//! the fault's start, reads are probed on every node, and the longest stretch without a
//! served read (reported) must stay under a liveness bound derived from the election
//! timeouts.
//! A last test feeds the checker broken histories and logs to show it catches them.

#[path = "../cluster/util.rs"]
mod util;

mod docker;
mod history;

use std::collections::BTreeMap;
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::Arc;
use std::time::{Duration, Instant};

use history::{check, summarise, Answer, Event, History};
use serde_json::{json, Value};
use util::Cluster;

const AGENTS: usize = 3;

/// How the load's clients call: how many per agent, and the pause after each answer;
/// and each agent's budget.
#[derive(Clone, Copy)]
struct Shape {
    clients_per_agent: usize,
    pause: Duration,
    budget: u64,
}

/// Three clients per agent with a pause: calls of one agent overlap now and then.
const STEADY: Shape = Shape {
    clients_per_agent: 3,
    pause: Duration::from_millis(20),
    budget: BUDGET,
};
/// Eight clients per agent without pauses: the leader decides each agent's next writes
/// while earlier ones replicate (pipelining), all the time; budgets large enough that
/// allowed decisions are still being raced for when the fault comes.
const PIPELINED: Shape = Shape {
    clients_per_agent: 8,
    pause: Duration::ZERO,
    budget: 1_500,
};
/// Small enough that agents run out under load, so budget exhaustion races are exercised.
const BUDGET: u64 = 60;
/// How long one logical call keeps retrying (same key) before it counts as unanswered.
const CALL_DEADLINE: Duration = Duration::from_secs(6);

/// Every this many calls a client sends its request twice at once, under one key.
const TWIN_EVERY: usize = 5;
/// Every this many calls a client sends its request once more after it was answered, as
/// a client whose answer arrived just as it gave up would.
const RESEND_EVERY: usize = 3;

/// One logical call: POST with one idempotency key, retried across nodes on 503 and
/// transport errors until answered or the deadline passes. Every 200 is recorded; one
/// that is not a decision is recorded as malformed (a violation) and ends the call
/// unanswered.
async fn call(
    cluster: &Cluster,
    token: &str,
    agent: &str,
    key: &str,
    start_node: usize,
    history: &History,
) -> Option<Answer> {
    let started = Instant::now();
    let mut node = start_node;
    while started.elapsed() < CALL_DEADLINE {
        let (status, body) = cluster
            .post(
                node,
                &format!("/v1/agents/{agent}/actions"),
                token,
                json!({"tool": "work"}),
                Some(key),
            )
            .await;
        if status == 200 {
            let Some(answer) = Answer::from_json(&body) else {
                history.record(Event::Malformed {
                    key: key.to_string(),
                    body,
                });
                return None;
            };
            history.record(Event::Reply {
                key: key.to_string(),
                body,
            });
            return Some(answer);
        }
        history.errors.fetch_add(1, Ordering::Relaxed);
        node = (node + 1) % cluster.addrs.len();
        tokio::time::sleep(Duration::from_millis(30)).await;
    }
    None
}

/// Call number `n` of a client: once, twice at once under one key (`TWIN_EVERY`), or
/// once and then again after its answer (`RESEND_EVERY`). Calls that share a key are one
/// operation; every answer is recorded for the checker.
async fn logical_call(
    cluster: &Cluster,
    token: &str,
    agent: &str,
    key: &str,
    n: usize,
    history: &History,
) -> Option<Answer> {
    let start = n % cluster.addrs.len();
    if n.is_multiple_of(TWIN_EVERY) {
        let other = (start + 1) % cluster.addrs.len();
        let (a, b) = tokio::join!(
            call(cluster, token, agent, key, start, history),
            call(cluster, token, agent, key, other, history)
        );
        return a.or(b);
    }
    let answer = call(cluster, token, agent, key, start, history).await;
    if answer.is_some() && n.is_multiple_of(RESEND_EVERY) {
        let other = (start + 2) % cluster.addrs.len();
        call(cluster, token, agent, key, other, history).await;
    }
    answer
}

struct Load {
    stop: Arc<AtomicBool>,
    tasks: Vec<tokio::task::JoinHandle<()>>,
    history: Arc<History>,
}

fn start_load(cluster: &Arc<Cluster>, tokens: &[String], scenario: &str, shape: Shape) -> Load {
    let stop = Arc::new(AtomicBool::new(false));
    let history = Arc::new(History::default());
    let mut tasks = Vec::new();
    for (a, agent_token) in tokens.iter().enumerate() {
        for c in 0..shape.clients_per_agent {
            let (cluster, stop, history) = (cluster.clone(), stop.clone(), history.clone());
            let token = agent_token.clone();
            let agent = format!("agent-{a}");
            let base_id = (a * shape.clients_per_agent + c) * 1_000;
            let scenario = scenario.to_string();
            tasks.push(tokio::spawn(async move {
                // A client whose call went unanswered continues as a new "thread": its old
                // call stays open in the history (it may or may not have taken effect).
                let mut thread = base_id;
                let mut n = 0;
                while !stop.load(Ordering::Relaxed) && n < 400 {
                    n += 1;
                    let key = format!("{scenario}-{agent}-{c}-{n}");
                    history.record(Event::Invoke {
                        client: thread,
                        agent: agent.clone(),
                        key: key.clone(),
                    });
                    match logical_call(&cluster, &token, &agent, &key, c + n, &history).await {
                        Some(answer) => history.record(Event::Return {
                            client: thread,
                            agent: agent.clone(),
                            answer,
                        }),
                        None => thread += 1,
                    }
                    tokio::time::sleep(shape.pause).await;
                }
            }));
        }
    }
    Load {
        stop,
        tasks,
        history,
    }
}

async fn stop_load(load: Load) -> (Vec<Event>, usize) {
    load.stop.store(true, Ordering::Relaxed);
    for task in load.tasks {
        task.await.unwrap();
    }
    (
        load.history.events(),
        load.history.errors.load(Ordering::Relaxed),
    )
}

async fn setup(cluster: &Cluster, budget: u64) -> Vec<String> {
    let policy = json!({"budget": budget, "scar_limit": 10, "tools": {"work": {"cost": 1}}});
    let mut tokens = Vec::new();
    for a in 0..AGENTS {
        tokens.push(
            cluster
                .create_agent(a % 3, &format!("agent-{a}"), policy.clone())
                .await,
        );
    }
    tokens
}

/// The longest the cluster may go without serving a read during a fault: 20 of the
/// longest election timeout a node draws (`lineage_node::raft_config`: 200 ms + 4 × 100
/// ms stagger + 100 ms window). A liveness bound, not a timing claim.
const LIVENESS_BOUND: Duration = Duration::from_millis(20 * 700);

/// Reads `GET /v1/agents/agent-0` on every node at once, every 25 ms, from before the
/// fault until stopped, and keeps when any node served one: the longest gap between two
/// served reads is how long the cluster was unavailable.
struct Prober {
    stop: Arc<AtomicBool>,
    task: tokio::task::JoinHandle<Vec<Instant>>,
}

impl Prober {
    fn start(cluster: &Arc<Cluster>) -> Prober {
        let stop = Arc::new(AtomicBool::new(false));
        let (cluster, stopped) = (cluster.clone(), stop.clone());
        let task = tokio::spawn(async move {
            let mut served = Vec::new();
            // Bounded: at most 10 minutes of probing.
            for _ in 0..24_000 {
                if stopped.load(Ordering::Relaxed) {
                    break;
                }
                let reads = (0..cluster.addrs.len()).map(|i| {
                    cluster
                        .http
                        .get(cluster.url(i, "/v1/agents/agent-0"))
                        .bearer_auth(cluster.admin.trim())
                        .timeout(Duration::from_secs(1))
                        .send()
                });
                let answers = futures_util::future::join_all(reads).await;
                if answers
                    .iter()
                    .any(|a| a.as_ref().is_ok_and(|r| r.status().is_success()))
                {
                    served.push(Instant::now());
                }
                tokio::time::sleep(Duration::from_millis(25)).await;
            }
            served
        });
        Prober { stop, task }
    }

    /// The longest time without a served read from `from` to now.
    async fn longest_outage(self, from: Instant) -> Duration {
        let end = Instant::now();
        self.stop.store(true, Ordering::Relaxed);
        let served = self.task.await.expect("prober");
        let mut last = from;
        let mut longest = Duration::ZERO;
        for at in served.into_iter().filter(|at| *at >= from).chain([end]) {
            longest = longest.max(at - last);
            last = at;
        }
        longest
    }
}

async fn final_logs(cluster: &Cluster) -> Vec<BTreeMap<String, Vec<Value>>> {
    let mut all = Vec::new();
    for a in 0..AGENTS {
        cluster
            .converged_log(&format!("agent-{a}"), Duration::from_secs(20))
            .await;
    }
    for i in 0..cluster.addrs.len() {
        let mut logs = BTreeMap::new();
        for a in 0..AGENTS {
            let agent = format!("agent-{a}");
            logs.insert(
                agent.clone(),
                cluster.local_log(i, &agent).await.unwrap_or_default(),
            );
        }
        all.push(logs);
    }
    all
}

async fn run_scenario(name: &str, fault: impl AsyncFnOnce(&Cluster) -> ()) {
    run_scenario_on(name, Arc::new(Cluster::start(3).await), fault).await;
}

async fn run_scenario_on(
    name: &str,
    cluster: Arc<Cluster>,
    fault: impl AsyncFnOnce(&Cluster) -> (),
) {
    run_shaped_scenario(name, cluster, STEADY, fault).await;
}

/// Load, fault, heal, check: the same for processes on loopback and for containers.
async fn run_shaped_scenario(
    name: &str,
    cluster: Arc<Cluster>,
    shape: Shape,
    fault: impl AsyncFnOnce(&Cluster) -> (),
) {
    let public_key = cluster.public_key().await;
    let tokens = setup(&cluster, shape.budget).await;
    let load = start_load(&cluster, &tokens, name, shape);
    let prober = Prober::start(&cluster);
    tokio::time::sleep(Duration::from_secs(2)).await;
    // The clock starts at the fault, not when it heals.
    let fault_started = Instant::now();
    fault(&cluster).await;
    tokio::time::sleep(Duration::from_secs(2)).await;
    let outage = prober.longest_outage(fault_started).await;
    let (events, errors) = stop_load(load).await;
    let logs = final_logs(&cluster).await;
    let violations = check(&events, &logs, &public_key, shape.budget);
    let summary = summarise(&events);
    // How much the idempotency check had to hold: keys answered more than once (twins,
    // resends after an answer, retries).
    let mut replies_per_key: BTreeMap<&str, usize> = BTreeMap::new();
    for event in &events {
        if let Event::Reply { key, .. } = event {
            *replies_per_key.entry(key.as_str()).or_default() += 1;
        }
    }
    let report = json!({
        "scenario": name,
        "operations": summary.operations,
        "acknowledged": summary.acknowledged,
        "acknowledged_allowed": summary.acknowledged_allowed,
        "unanswered": summary.unanswered,
        "replies": replies_per_key.values().sum::<usize>(),
        "keys_answered_more_than_once": replies_per_key.values().filter(|n| **n > 1).count(),
        "client_errors_retried": errors,
        "longest_outage_ms": outage.as_millis() as u64,
        "violations": violations,
    });
    eprintln!("{report}");
    let dir = std::path::PathBuf::from(env!("CARGO_MANIFEST_DIR")).join("../target/test-artifacts");
    std::fs::create_dir_all(&dir).unwrap();
    std::fs::write(
        dir.join(format!("faults-{name}.json")),
        serde_json::to_string_pretty(&report).unwrap(),
    )
    .unwrap();
    assert!(violations.is_empty(), "{name}: {violations:#?}");
    assert!(
        summary.acknowledged_allowed > 0,
        "{name}: the load did nothing"
    );
    assert!(
        outage < LIVENESS_BOUND,
        "{name}: no read was served for {outage:?} (bound {LIVENESS_BOUND:?})"
    );
}

/// kill -9 of the leader, restarted two seconds later.
async fn kill_and_restart_leader(cluster: &Cluster) {
    let leader = cluster.wait_for_leader(Duration::from_secs(5)).await;
    cluster.kill(leader);
    tokio::time::sleep(Duration::from_secs(2)).await;
    cluster.start_node(leader);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn leader_killed_and_restarted_under_load() {
    run_scenario("leader-kill", kill_and_restart_leader).await;
}

/// The same with the leader's early acknowledgement off (the nodes' default is on): the
/// plain path, where every append waits for its fsync, stays covered.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn leader_killed_and_restarted_under_load_without_early_ack() {
    let cluster = Cluster::start_with(3, &["--leader-early-ack", "false"]).await;
    run_scenario_on(
        "leader-kill-plain",
        Arc::new(cluster),
        kill_and_restart_leader,
    )
    .await;
}

/// The leader, which must be pipelining now: its count of writes decided on a pending
/// state while earlier ones were in flight grows (polled, bounded at 10 s).
async fn pipelining_leader(cluster: &Cluster) -> usize {
    let leader = cluster.wait_for_leader(Duration::from_secs(5)).await;
    let pipelined = async || cluster.metrics(leader).await["lineage_writes_pipelined_total"];
    let before = pipelined().await;
    let start = Instant::now();
    while pipelined().await <= before {
        assert!(
            start.elapsed() < Duration::from_secs(10),
            "the leader is not pipelining before the fault: the scenario would test nothing"
        );
        tokio::time::sleep(Duration::from_millis(100)).await;
    }
    leader
}

/// kill -9 of a leader that is pipelining: writes decided on pending states are in
/// flight when it dies, some committed, some not. None may be acknowledged and lost, and
/// no later write may be applied on top of one that was not.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn leader_killed_while_pipelining() {
    let cluster = Arc::new(Cluster::start(3).await);
    run_shaped_scenario(
        "leader-kill-pipelined",
        cluster,
        PIPELINED,
        async |cluster: &Cluster| {
            let leader = pipelining_leader(cluster).await;
            cluster.kill(leader);
            tokio::time::sleep(Duration::from_secs(2)).await;
            cluster.start_node(leader);
        },
    )
    .await;
}

/// SIGSTOP of a leader that is pipelining, for 3 s: it lives on with its lanes, writes
/// in flight and pending states while another node leads, and resumes as a deposed
/// leader whose queued writes fail (breaking its lanes) or were truncated.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn leader_frozen_while_pipelining() {
    let cluster = Arc::new(Cluster::start(3).await);
    run_shaped_scenario(
        "leader-sigstop-pipelined",
        cluster,
        PIPELINED,
        async |cluster: &Cluster| {
            let leader = pipelining_leader(cluster).await;
            cluster.pause(leader);
            tokio::time::sleep(Duration::from_secs(3)).await;
            cluster.resume(leader);
        },
    )
    .await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn leader_frozen_with_sigstop_under_load() {
    run_scenario("leader-sigstop", async |cluster: &Cluster| {
        let leader = cluster.wait_for_leader(Duration::from_secs(5)).await;
        cluster.pause(leader);
        tokio::time::sleep(Duration::from_secs(3)).await;
        cluster.resume(leader);
    })
    .await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn follower_disk_wiped_under_load() {
    run_scenario("follower-wipe", async |cluster: &Cluster| {
        let leader = cluster.wait_for_leader(Duration::from_secs(5)).await;
        let victim = (leader + 1) % 3;
        cluster.kill(victim);
        cluster.wipe(victim);
        tokio::time::sleep(Duration::from_secs(1)).await;
        cluster.start_node(victim);
    })
    .await;
}

#[test]
#[expect(
    clippy::too_many_lines,
    reason = "a table of broken histories and logs, each with the violation it must produce"
)]
fn the_checker_catches_broken_histories_and_logs() {
    let key = lineage_core::AuditKey::from_seed([2; 32]);
    // A real log: create, then three allowed requests.
    let mut state = lineage_core::guard::AgentState::new();
    let mut records = Vec::new();
    let policy = lineage_core::Policy::new(BUDGET).allow("work", lineage_core::ToolRule::cost(1));
    let mut commands = vec![lineage_core::Command::Create {
        agent_id: "agent-0".into(),
        policy,
    }];
    for _ in 0..3 {
        commands.push(lineage_core::Command::Request {
            tool: "work".into(),
            input: Value::Null,
            cost: None,
        });
    }
    for (i, command) in commands.iter().enumerate() {
        let now = 1_800_000_000_000_000 + i as i64;
        let decided =
            lineage_core::guard::decide(&state, command, now, key.public_key_hex()).unwrap();
        for r in lineage_core::guard::seal(&state, decided.drafts, &key, now) {
            state.apply(&r).unwrap();
            records.push(serde_json::to_value(&r).unwrap());
        }
    }
    let log: BTreeMap<String, Vec<Value>> = [("agent-0".to_string(), records)].into();
    let logs = vec![log.clone(), log.clone(), log.clone()];
    let allowed = |n: u64| Answer::Allowed {
        action_id: format!("act-{n}"),
        remaining: BUDGET - n,
    };
    let honest: Vec<Event> = (1..=3u64)
        .flat_map(|n| {
            let key = format!("k{n}");
            let body = json!({"action_id": format!("act-{n}"), "cost": 1, "decision": "allowed", "remaining": BUDGET - n});
            [
                Event::Invoke { client: 0, agent: "agent-0".into(), key: key.clone() },
                Event::Reply { key, body },
                Event::Return { client: 0, agent: "agent-0".into(), answer: allowed(n) },
            ]
        })
        .collect();
    assert_eq!(
        check(&honest, &logs, key.public_key_hex(), BUDGET),
        Vec::<String>::new()
    );

    // A client that lies about an answer.
    let mut lying = honest.clone();
    if let Event::Return { answer, .. } = &mut lying[5] {
        *answer = Answer::Allowed {
            action_id: "act-2".into(),
            remaining: BUDGET,
        };
    }
    let found = check(&lying, &logs, key.public_key_hex(), BUDGET);
    assert!(
        found.iter().any(|v| v.contains("not linearizable")),
        "{found:?}"
    );

    // Two answers for one key.
    let mut twice = honest.clone();
    twice.push(Event::Reply {
        key: "k1".into(),
        body: json!({"decision": "denied"}),
    });
    let found = check(&twice, &logs, key.public_key_hex(), BUDGET);
    assert!(
        found.iter().any(|v| v.contains("two different answers")),
        "{found:?}"
    );

    // A 200 whose body is not a decision.
    let mut malformed = honest.clone();
    malformed.push(Event::Malformed {
        key: "k1".into(),
        body: json!({"status": "ok"}),
    });
    let found = check(&malformed, &logs, key.public_key_hex(), BUDGET);
    assert!(
        found.iter().any(|v| v.contains("not a decision")),
        "{found:?}"
    );

    // An answered key whose action the final log does not hold (the answer was made up,
    // or the write behind it lost).
    let mut unlogged = honest.clone();
    unlogged.push(Event::Invoke {
        client: 1,
        agent: "agent-0".into(),
        key: "k9".into(),
    });
    unlogged.push(Event::Reply {
        key: "k9".into(),
        body: json!({"action_id": "act-9", "decision": "denied", "reason": {"code": "budget_exceeded"}}),
    });
    let found = check(&unlogged, &logs, key.public_key_hex(), BUDGET);
    assert!(
        found
            .iter()
            .any(|v| v.contains("act-9 was requested 0 times")),
        "{found:?}"
    );

    // An acknowledged decision missing from the final log (a replica lost it).
    let mut short = log.clone();
    short.get_mut("agent-0").unwrap().truncate(6);
    let found = check(
        &honest,
        &[short.clone(), short.clone(), short],
        key.public_key_hex(),
        BUDGET,
    );
    assert!(
        found.iter().any(|v| v.contains("act-3 appears 0 times")),
        "{found:?}"
    );

    // Replicas that differ.
    let mut other = log.clone();
    other.get_mut("agent-0").unwrap().pop();
    let found = check(
        &honest,
        &[log.clone(), other, log.clone()],
        key.public_key_hex(),
        BUDGET,
    );
    assert!(
        found
            .iter()
            .any(|v| v.contains("node 2 holds different logs")),
        "{found:?}"
    );

    // Overspending (checked with a budget lower than what the log spent).
    let found = check(&[], &logs, key.public_key_hex(), 2);
    assert!(
        found.iter().any(|v| v.contains("spent 3 of a budget of 2")),
        "{found:?}"
    );

    // A log signed by another key.
    let found = check(
        &honest,
        &logs,
        lineage_core::AuditKey::from_seed([3; 32]).public_key_hex(),
        BUDGET,
    );
    assert!(
        found.iter().any(|v| v.contains("fails verification")),
        "{found:?}"
    );
}

/// The linearizability check reads the order from the answers (`act-N` is the N-th
/// request to take effect): a call that began after another was answered must come
/// later, and a place no answer names must be takeable by a call never answered that
/// began before the answers above it. Hundreds of calls left in flight are checked at
/// once (a general search grew exponentially with them).
#[test]
fn the_linearizability_check_reads_the_order_from_the_answers() {
    let invoke = |client: usize| Event::Invoke {
        client,
        agent: "agent-0".into(),
        key: format!("c{client}"),
    };
    // The model's answer at place `n`: allowed while budget lasts, then terminated.
    let answer = |client: usize, n: u64| Event::Return {
        client,
        agent: "agent-0".into(),
        answer: match BUDGET.checked_sub(n) {
            Some(remaining) => Answer::Allowed {
                action_id: format!("act-{n}"),
                remaining,
            },
            None => Answer::Denied {
                action_id: format!("act-{n}"),
                code: "terminated".into(),
            },
        },
    };
    let verdict = |events: &[Event]| -> Vec<String> {
        let logs = vec![BTreeMap::new()];
        check(events, &logs, "", BUDGET)
            .into_iter()
            .filter(|v| v.contains("linearizable"))
            .collect()
    };
    let found = verdict(&[invoke(0), answer(0, 2), invoke(1), answer(1, 1)]);
    assert!(
        found
            .iter()
            .any(|v| v.contains("act-1 began after act-2 was answered")),
        "{found:?}"
    );
    let found = verdict(&[invoke(0), answer(0, 2)]);
    assert!(
        found
            .iter()
            .any(|v| v.contains("place 1 was taken by no call")),
        "{found:?}"
    );
    // The call that took place 1 began after act-2 was answered: too late.
    let found = verdict(&[invoke(0), answer(0, 2), invoke(1)]);
    assert!(
        found
            .iter()
            .any(|v| v.contains("place 1 was taken by no call")),
        "{found:?}"
    );
    // Begun before: it may have taken place 1, its answer lost.
    assert_eq!(
        verdict(&[invoke(1), invoke(0), answer(0, 2)]),
        Vec::<String>::new()
    );
    // The model's answer at each place: a wrong remaining is caught.
    let wrong = Event::Return {
        client: 0,
        agent: "agent-0".into(),
        answer: Answer::Allowed {
            action_id: "act-1".into(),
            remaining: BUDGET,
        },
    };
    let found = verdict(&[invoke(0), wrong]);
    assert!(
        found.iter().any(|v| v.contains("where the model answers")),
        "{found:?}"
    );
    // 300 calls in flight, then 50 answered above them.
    let mut many: Vec<Event> = (0..300).map(invoke).collect();
    for n in 301..=350u64 {
        let client = 1000 + n as usize;
        many.push(invoke(client));
        many.push(answer(client, n));
    }
    assert_eq!(verdict(&many), Vec::<String>::new());
    // One place too many: 299 in flight cannot fill 300 places.
    let found = verdict(&many[1..]);
    assert!(
        found.iter().any(|v| v.contains("was taken by no call")),
        "{found:?}"
    );
}
