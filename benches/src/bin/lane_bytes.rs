//! What the leader's per-agent lanes (`agent_lanes`) hold, in heap bytes per lane.
//!
//! A lane is kept for every agent written since the last sweep; with pipelining on it
//! holds the agent's pending state, a copy of its `AgentState`. Measured by counting
//! every allocation (this program's global allocator), for `--lanes` lanes of a small
//! agent (one tool, 200-byte inputs) after 10 and after 100 decided actions: lanes never
//! given a pending state (the baseline, as with pipelining off), lanes with a write in
//! flight (its pending state held), lanes left idle once their write was applied (what
//! a load leaves), and one state alone.
//!
//!   cargo build --release -p lineage-benches && target/release/lane_bytes [--lanes 10000]

use std::alloc::{GlobalAlloc, Layout, System};
use std::sync::atomic::{AtomicIsize, Ordering};
use std::sync::Arc;

use lineage_benches::flag;
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

fn main() {
    let runtime = match tokio::runtime::Builder::new_current_thread().build() {
        Ok(runtime) => runtime,
        Err(e) => {
            eprintln!("lane_bytes: cannot start a runtime: {e}");
            std::process::exit(1);
        }
    };
    if let Err(e) = runtime.block_on(run()) {
        eprintln!("lane_bytes: {e}");
        std::process::exit(1);
    }
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
    for (i, command) in std::iter::once(create).chain(requests).enumerate() {
        let now = 1_800_000_000_000_000 + i as i64;
        let decided =
            decide(&state, &command, now, key.public_key_hex()).map_err(|e| format!("{e:?}"))?;
        for record in seal(&state, decided.drafts, key, now) {
            state.apply(&record).map_err(|e| e.to_string())?;
        }
    }
    Ok(state)
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

async fn run() -> Result<(), String> {
    let count = flag("--lanes", 10_000).max(1) as usize;
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
    Ok(())
}
