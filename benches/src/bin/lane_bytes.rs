//! What the leader's per-agent lanes (`agent_lanes`) hold, in heap bytes per lane.
//!
//! A lane is kept for every agent written since the last sweep; with pipelining on it
//! holds the agent's pending state, a copy of its `AgentState`. Measured by counting
//! every allocation (this program's global allocator), for `--lanes` lanes of a small
//! agent (one tool, 200-byte inputs) after 10 and after 100 decided actions: lanes never
//! given a pending state (the baseline, as with pipelining off), lanes with a write in
//! flight (its pending state held), lanes left idle once their write was applied (what
//! a load leaves), and one state alone. Then what an agent's state holds per action left
//! waiting for an approval, with 1 KiB and 60 KiB inputs, against the same number of
//! allowed actions (the baseline, in the same run).
//!
//!   cargo build --release -p lineage-benches && target/release/lane_bytes [--lanes 10000]

use std::alloc::{GlobalAlloc, Layout, System};
use std::sync::atomic::{AtomicIsize, Ordering};
use std::sync::Arc;

use lineage_core::guard::{decide, seal, AgentState, Command};
use lineage_core::{AuditKey, Policy, ToolRule};
use lineage_node::agent_lanes::{Lane, Lanes};

/// Bytes allocated and not yet freed, by anyone in this process.
static LIVE: AtomicIsize = AtomicIsize::new(0);

struct Counting;

// SAFETY: every call is passed to the system allocator unchanged; only a counter moves.
unsafe impl GlobalAlloc for Counting {
    unsafe fn alloc(&self, layout: Layout) -> *mut u8 {
        LIVE.fetch_add(layout.size() as isize, Ordering::Relaxed);
        // SAFETY: the caller's layout, as GlobalAlloc requires.
        unsafe { System.alloc(layout) }
    }

    unsafe fn dealloc(&self, ptr: *mut u8, layout: Layout) {
        LIVE.fetch_sub(layout.size() as isize, Ordering::Relaxed);
        // SAFETY: `ptr` came from `alloc` with this layout.
        unsafe { System.dealloc(ptr, layout) }
    }

    unsafe fn realloc(&self, ptr: *mut u8, layout: Layout, new_size: usize) -> *mut u8 {
        LIVE.fetch_add(
            new_size as isize - layout.size() as isize,
            Ordering::Relaxed,
        );
        // SAFETY: as in `alloc` and `dealloc`.
        unsafe { System.realloc(ptr, layout, new_size) }
    }
}

#[global_allocator]
static GLOBAL: Counting = Counting;

fn live() -> isize {
    LIVE.load(Ordering::Relaxed)
}

/// Heap bytes per agent lane.
#[derive(clap::Parser)]
struct Args {
    /// Lanes measured.
    #[arg(long, default_value_t = 10_000, value_parser = clap::builder::RangedU64ValueParser::<usize>::new().range(1..))]
    lanes: usize,
}

fn main() {
    let args = <Args as clap::Parser>::parse();
    let runtime = match tokio::runtime::Builder::new_current_thread().build() {
        Ok(runtime) => runtime,
        Err(e) => {
            eprintln!("lane_bytes: cannot start a runtime: {e}");
            std::process::exit(1);
        }
    };
    if let Err(e) = runtime.block_on(run(args.lanes)) {
        eprintln!("lane_bytes: {e}");
        std::process::exit(1);
    }
}

/// Decides each command on `state`, seals its records and applies them, a microsecond apart.
fn apply_commands(
    state: &mut AgentState,
    commands: impl Iterator<Item = Command>,
    key: &AuditKey,
) -> Result<(), String> {
    for (i, command) in commands.enumerate() {
        let now = 1_800_000_000_000_000 + i as i64;
        let decided =
            decide(state, &command, now, key.public_key_hex()).map_err(|e| format!("{e:?}"))?;
        for record in seal(state, decided.drafts, key, now) {
            state.apply(&record).map_err(|e| e.to_string())?;
        }
    }
    Ok(())
}

/// A small agent's state after `actions` allowed actions with 200-byte inputs.
fn small_agent(actions: u64, key: &AuditKey) -> Result<AgentState, String> {
    let mut state = AgentState::new();
    let create = Command::Create {
        agent_id: "agent-0".into(),
        policy: Policy::new(1_000_000_000).allow("send_email", ToolRule::cost(3)),
    };
    let requests = (0..actions).map(|n| Command::Request {
        tool: "send_email".into(),
        input: serde_json::json!({ "n": n, "body": "x".repeat(180) }),
        cost: None,
    });
    apply_commands(&mut state, std::iter::once(create).chain(requests), key)?;
    Ok(state)
}

/// Heap bytes of an agent's state after `actions` requests for one tool with inputs of
/// about `input_bytes`, each left waiting for an approval if `waiting`, else allowed.
fn state_bytes(
    actions: u64,
    input_bytes: usize,
    waiting: bool,
    key: &AuditKey,
) -> Result<isize, String> {
    let before = live();
    let mut state = AgentState::new();
    let rule = ToolRule {
        requires_approval: waiting,
        ..ToolRule::cost(1)
    };
    let create = Command::Create {
        agent_id: "agent-0".into(),
        policy: Policy::new(1_000_000_000).allow("refund", rule).limits(
            lineage_core::policy::GrowthLimits {
                max_pending_approvals: std::num::NonZeroU32::new(actions as u32 + 1),
                ..Default::default()
            },
        ),
    };
    let requests = (0..actions).map(|n| Command::Request {
        tool: "refund".into(),
        input: serde_json::json!({ "n": n, "memo": "x".repeat(input_bytes) }),
        cost: None,
    });
    apply_commands(&mut state, std::iter::once(create).chain(requests), key)?;
    if waiting && state.pending_count() as u64 != actions {
        return Err(format!("{} of {actions} wait", state.pending_count()));
    }
    let bytes = live() - before;
    drop(state);
    Ok(bytes)
}

/// What a lane is left holding.
#[derive(Clone, Copy)]
enum Left {
    /// Never given a pending state (pipelining off).
    Empty,
    /// A write decided on `state` and still in flight.
    InFlight,
    /// A write decided on `state`, queued and then applied: the lane goes idle.
    Answered,
}

/// Heap bytes per lane of `count` lanes, each taken through one write as `left` says.
async fn bytes_per_lane(count: usize, state: &AgentState, left: Left) -> f64 {
    let mut held: Vec<Arc<Lane>> = Vec::with_capacity(count);
    let mut flying = Vec::with_capacity(count);
    let before = live();
    let lanes = Arc::new(Lanes::new(true));
    for n in 0..count {
        // Held, as a lane with a write in flight is, so no sweep drops it.
        let lane = lanes.lane(&format!("agent-{n}"));
        if !matches!(left, Left::Empty) {
            let mut turn = lane.turn(None).await;
            let in_flight = turn.in_flight(None);
            turn.set_pending(state.clone());
            drop(turn);
            match left {
                Left::Answered => in_flight.applied(),
                _ => flying.push(in_flight),
            }
        }
        held.push(lane);
    }
    // The writes in flight are counted beside their lanes, as the node keeps them.
    let bytes = live() - before;
    drop(flying);
    drop(held);
    drop(lanes);
    bytes as f64 / count as f64
}

async fn run(count: usize) -> Result<(), String> {
    let key = AuditKey::generate().map_err(|e| e.to_string())?;
    println!("lane_bytes: {count} lanes of a small agent (one tool, 200-byte inputs)");
    for actions in [10, 100] {
        let state = small_agent(actions, &key)?;
        let before = live();
        let copy = state.clone();
        let alone = live() - before;
        drop(copy);
        let empty = bytes_per_lane(count, &state, Left::Empty).await;
        let flying = bytes_per_lane(count, &state, Left::InFlight).await;
        let idle = bytes_per_lane(count, &state, Left::Answered).await;
        println!(
            "  after {actions} actions: the state alone {alone} B; a lane never given a \
             pending state (baseline) {empty:.0} B, with a write in flight {flying:.0} B \
             ({:.2}x), idle after its write was applied {idle:.0} B ({:.2}x)",
            flying / empty,
            idle / empty
        );
    }
    const WAITING: u64 = 1_000;
    // 60 KiB: the largest that stays within the default `max_input_bytes` with its JSON.
    for input_bytes in [1024, 60 * 1024] {
        let allowed = state_bytes(WAITING, input_bytes, false, &key)?;
        let waiting = state_bytes(WAITING, input_bytes, true, &key)?;
        println!(
            "  {WAITING} actions with {input_bytes}-byte inputs: the state {allowed} B when \
             allowed (baseline), {waiting} B when waiting for an approval ({:.2}x): {:.0} B \
             more per waiting action",
            waiting as f64 / allowed as f64,
            (waiting - allowed) as f64 / WAITING as f64
        );
    }
    Ok(())
}
