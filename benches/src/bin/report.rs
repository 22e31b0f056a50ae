//! Every figure of the resource and speed goals, from one sitting: decisions/s, p50/p99,
//! CPU and fsyncs per decision (leader and followers), VmRSS, disk bytes per record and
//! verify records/s, for a 1-node and a 3-node cluster at a small and a large history;
//! memory after load and after restart with its growth; instructions per decision.
//! Each figure is printed with its ratio to the baselines measured in the same run: the
//! reference-style bounds (its storage path, its record lines, its one-core verify) and
//! another build of the node (`--baseline-node`, for example the build before a change).
//! Then the projection from this machine, where every node and the load generator share
//! the cores and the disk, to one machine per node: each node's CPU and fsyncs per
//! decision over the cores and the fsyncs per second measured here, so a goal this
//! machine cannot show is computed rather than asserted.
//!
//!   cargo build --release -p lineage-node -p lineage-benches
//!   target/release/report [--baseline-node PATH] [--small 100000] [--large 1000000]
//!     [--seconds 10] [--rounds 1] [--skip-memory] [--skip-instructions]
//!
//! Whichever build runs first after the part before measured up to a quarter more CPU per
//! decision here (seen with both builds, and with the same build against itself), so
//! `--rounds 2` runs each column's pair twice, in both orders (ABBA), and averages.
//! The parts are the other benchmarks, each run as its own process beside this one
//! (`cluster_load`, `memory_growth`, `instructions`; their own lines are shown as they
//! run), handing their figures over through `LINEAGE_BENCH_FIGURES`. The two builds take
//! turns: the baseline first at the small history, this build first at the large one, so
//! a drift of the shared machine does not fall on one build only. Nothing else should run
//! on the machine meanwhile: about 40 minutes in a release build at 100k and 1M records.

use std::path::{Path, PathBuf};
use std::process::Command;

use lineage_benches::sibling_binary;
use serde_json::Value;

/// Every figure the parts handed over, each with its labels (`bench`, `build`, `nodes`,
/// `history`, and `node`/`leader` for a node's own).
struct Figures(Vec<Value>);

impl Figures {
    /// The values of `name` whose labels match every `(label, value)` in `filter`.
    fn values(&self, name: &str, filter: &[(&str, Value)]) -> Vec<f64> {
        self.0
            .iter()
            .filter(|f| f["name"] == name)
            .filter(|f| filter.iter().all(|(label, value)| &f[*label] == value))
            .filter_map(|f| f["value"].as_f64())
            .collect()
    }

    /// The mean of those values, if there are any.
    fn mean(&self, name: &str, filter: &[(&str, Value)]) -> Option<f64> {
        let values = self.values(name, filter);
        (!values.is_empty()).then(|| values.iter().sum::<f64>() / values.len() as f64)
    }
}

/// Runs the benchmark `bench` (built beside this program) with `args`, its figures
/// labelled with `build` unless it labels them itself.
fn run_part(
    bench: &str,
    args: &[String],
    build: &str,
    scratch: &Path,
    figures: &mut Figures,
) -> Result<(), String> {
    let program = sibling_binary(bench, "-p lineage-benches")?;
    let file = scratch.join(format!("figures-{}.jsonl", figures.0.len()));
    println!("\n=== {bench} {} ({build})", args.join(" "));
    // The part before left gigabytes of dirty pages behind; written back during this
    // part, they took disk and CPU from whichever build ran first after it (its CPU per
    // decision up to a quarter higher). Flush them before starting.
    if let Err(e) = Command::new("sync").status() {
        println!("sync: {e} (figures may carry the last part's write-back)");
    }
    let status = Command::new(&program)
        .args(args)
        .env("LINEAGE_BENCH_FIGURES", &file)
        .status()
        .map_err(|e| format!("{}: {e}", program.display()))?;
    if !status.success() {
        return Err(format!("{bench} {} failed: {status}", args.join(" ")));
    }
    let text = std::fs::read_to_string(&file).unwrap_or_default();
    for line in text.lines() {
        let mut figure: Value =
            serde_json::from_str(line).map_err(|e| format!("{bench}'s figure {line:?}: {e}"))?;
        if let Value::Object(map) = &mut figure {
            map.insert("bench".into(), bench.into());
            map.entry("build").or_insert_with(|| build.into());
        }
        figures.0.push(figure);
    }
    Ok(())
}

/// `value`, and its ratio to each baseline that was measured.
fn cell(value: Option<f64>, baselines: &[Option<f64>]) -> String {
    let Some(value) = value else {
        return "-".into();
    };
    let mut text = if value >= 100.0 {
        format!("{value:.0}")
    } else {
        format!("{value:.2}")
    };
    for baseline in baselines {
        match baseline {
            Some(b) if *b > 0.0 => text.push_str(&format!(" ({:.2}x)", value / b)),
            _ => text.push_str(" (-)"),
        }
    }
    text
}

fn print_row(label: &str, cells: &[String]) {
    print!("{label:<54}");
    for cell in cells {
        print!(" | {cell:<24}");
    }
    println!();
}

/// The highest reference storage bound any part measured (the disk's best showing).
fn reference_bound(figures: &Figures) -> Option<f64> {
    figures
        .values("reference_bound_decisions_per_second", &[])
        .into_iter()
        .reduce(f64::max)
}

/// The (cluster size, history) columns of the cluster_load tables, after printing their
/// heads.
fn print_load_columns(sizes: &[u64]) -> Vec<(u64, u64)> {
    let columns: Vec<(u64, u64)> = [1u64, 3]
        .iter()
        .flat_map(|&nodes| sizes.iter().map(move |&size| (nodes, size)))
        .collect();
    print_row(
        "",
        &columns
            .iter()
            .map(|(n, h)| format!("{n} node(s), {h} records"))
            .collect::<Vec<_>>(),
    );
    columns
}

/// The cluster_load table: one column per cluster size and history.
fn print_load_table(figures: &Figures, sizes: &[u64], one_core_verify: f64) {
    println!("\ncluster_load, 16 clients over 16 agents: this build (÷ baselines)");
    let columns = print_load_columns(sizes);
    let reference = reference_bound(figures);
    let rows: [(&str, &str, Option<bool>, Option<f64>); 11] = [
        (
            "decisions/s (÷ reference storage bound, ÷ baseline)",
            "decisions_per_second",
            None,
            reference,
        ),
        ("p50 ms (÷ baseline)", "p50_ms", None, None),
        ("p99 ms (÷ baseline)", "p99_ms", None, None),
        (
            "leader CPU µs/decision (÷ baseline)",
            "cpu_us_per_decision",
            Some(true),
            None,
        ),
        (
            "follower CPU µs/decision (÷ baseline)",
            "cpu_us_per_decision",
            Some(false),
            None,
        ),
        (
            "leader fsyncs/decision (÷ baseline)",
            "fsyncs_per_decision",
            Some(true),
            None,
        ),
        (
            "follower fsyncs/decision (÷ baseline)",
            "fsyncs_per_decision",
            Some(false),
            None,
        ),
        (
            "leader VmRSS MB after load (÷ baseline)",
            "vmrss_bytes",
            Some(true),
            None,
        ),
        (
            "disk B/record (÷ its line, ÷ baseline)",
            "disk_bytes_per_record",
            Some(true),
            None,
        ),
        (
            "verify records/s (÷ one-core reference, ÷ baseline)",
            "verify_records_per_second",
            Some(true),
            Some(one_core_verify),
        ),
        ("errors (÷ baseline)", "errors", None, None),
    ];
    for (label, name, leader, fixed_baseline) in rows {
        let cells: Vec<String> = columns
            .iter()
            .map(|&column| load_cell(figures, name, leader, fixed_baseline, column))
            .collect();
        print_row(label, &cells);
    }
}

/// One figure of cluster_load's table for a cluster size and history: this build's
/// value (a node's: the leader's, or the followers' mean), with its ratio to
/// `fixed_baseline` (or, for disk, to the records' lines) and to the baseline build.
fn load_cell(
    figures: &Figures,
    name: &str,
    leader: Option<bool>,
    fixed_baseline: Option<f64>,
    (nodes, history): (u64, u64),
) -> String {
    let pick = |build: &str| {
        let mut filter = vec![
            ("bench", Value::from("cluster_load")),
            ("build", build.into()),
            ("nodes", nodes.into()),
            ("history", history.into()),
        ];
        if let Some(leader) = leader {
            filter.push(("leader", leader.into()));
        }
        let value = figures.mean(name, &filter)?;
        Some(if name == "vmrss_bytes" {
            value / 1e6
        } else {
            value
        })
    };
    let mut baselines = Vec::new();
    if name == "disk_bytes_per_record" {
        baselines.push(figures.mean(
            "line_bytes_per_record",
            &[
                ("bench", "cluster_load".into()),
                ("build", "this".into()),
                ("nodes", nodes.into()),
                ("history", history.into()),
            ],
        ));
    } else if fixed_baseline.is_some() {
        baselines.push(fixed_baseline);
    }
    baselines.push(pick("baseline"));
    cell(pick("this"), &baselines)
}

/// What one build's cluster_load figures for a cluster size and history say about the
/// machine: each a bound on decisions/s, in the order the projection table prints them.
struct Bounds {
    /// This machine's cores over the CPU every process here took per decision (all
    /// nodes and the load generator): the ceiling the measured figure runs into.
    shared_cpu: f64,
    /// Those cores over the busiest node's CPU per decision alone: each node on a
    /// machine of its own, the generator elsewhere.
    own_cpu: f64,
    /// The machine's fsyncs per second over the most fsyncs any node made per decision
    /// (at this load's group commits; a heavier load groups more): each node with a
    /// disk of its own.
    own_disk: f64,
}

impl Bounds {
    fn of(
        figures: &Figures,
        build: &str,
        (nodes, history): (u64, u64),
        cores: f64,
    ) -> Option<Bounds> {
        let filter = [
            ("bench", Value::from("cluster_load")),
            ("build", build.into()),
            ("nodes", nodes.into()),
            ("history", history.into()),
        ];
        // A node's figure, the leader's or the followers' mean over the rounds.
        let node = |name: &str, leader: bool| {
            let mut filter = filter.to_vec();
            filter.push(("leader", leader.into()));
            figures.mean(name, &filter)
        };
        let followers = nodes.saturating_sub(1) as f64;
        let (leader_cpu, leader_fsyncs) = (
            node("cpu_us_per_decision", true)?,
            node("fsyncs_per_decision", true)?,
        );
        let (follower_cpu, follower_fsyncs) = if followers > 0.0 {
            (
                node("cpu_us_per_decision", false)?,
                node("fsyncs_per_decision", false)?,
            )
        } else {
            (0.0, 0.0)
        };
        let generator = figures.mean("generator_cpu_us_per_decision", &filter)?;
        let ceiling = figures.mean("fsyncs_per_second_ceiling", &[])?;
        Some(Bounds {
            shared_cpu: cores * 1e6 / (leader_cpu + followers * follower_cpu + generator),
            own_cpu: cores * 1e6 / leader_cpu.max(follower_cpu),
            own_disk: ceiling / leader_fsyncs.max(follower_fsyncs),
        })
    }

    fn projected(&self) -> f64 {
        self.own_cpu.min(self.own_disk)
    }
}

/// A row of the projection table: its label and the bound it shows.
type BoundRow = (&'static str, fn(&Bounds) -> f64);

/// The projection from this machine's shared cores and disk to one machine per node,
/// computed from the CPU and fsyncs each node took per decision.
fn print_projection(figures: &Figures, sizes: &[u64], reference: Option<f64>) {
    let cores = std::thread::available_parallelism().map_or(1, |n| n.get());
    println!(
        "\nprojection, decisions/s: the CPU and fsyncs each node took per decision, over {cores} cores and this disk's fsyncs/s (÷ baseline)"
    );
    let columns = print_load_columns(sizes);
    let rows: [BoundRow; 4] = [
        ("CPU bound, nodes and generator sharing this machine", |b| {
            b.shared_cpu
        }),
        ("CPU bound, each node on a machine like this alone", |b| {
            b.own_cpu
        }),
        ("fsync bound, each node with a disk like this alone", |b| {
            b.own_disk
        }),
        (
            "projected, one machine per node (÷ ref. bound, ÷ baseline)",
            Bounds::projected,
        ),
    ];
    let count = rows.len();
    for (index, (label, pick)) in rows.into_iter().enumerate() {
        let cells: Vec<String> = columns
            .iter()
            .map(|&column| {
                let this = Bounds::of(figures, "this", column, cores as f64).map(|b| pick(&b));
                let baseline =
                    Bounds::of(figures, "baseline", column, cores as f64).map(|b| pick(&b));
                let baselines = if index + 1 == count {
                    vec![reference, baseline]
                } else {
                    vec![baseline]
                };
                cell(this, &baselines)
            })
            .collect();
        print_row(label, &cells);
    }
}

/// memory_growth's table: one node, after load and after restart, at each history.
fn print_memory_table(figures: &Figures, sizes: &[u64]) {
    println!("\nmemory_growth, one node, 16 agents: this build (÷ baseline)");
    print_row(
        "",
        &sizes
            .iter()
            .map(|h| format!("{h} records"))
            .chain(std::iter::once(format!("growth {}→{}", sizes[0], sizes[1])))
            .collect::<Vec<_>>(),
    );
    let rows = [
        ("VmRSS MB after load", "vmrss_after_load_bytes", 1e6),
        ("RssAnon MB after load", "rssanon_after_load_bytes", 1e6),
        ("VmRSS MB after restart", "vmrss_after_restart_bytes", 1e6),
        (
            "RssAnon MB after restart",
            "rssanon_after_restart_bytes",
            1e6,
        ),
        (
            "first decision after restart, s",
            "first_decision_after_restart_s",
            1.0,
        ),
        (
            "disk B/record after purge (÷ line)",
            "purged_disk_bytes_per_record",
            1.0,
        ),
        (
            "disk blocks B/record after purge (÷ line)",
            "purged_disk_block_bytes_per_record",
            1.0,
        ),
    ];
    for (label, name, unit) in rows {
        let pick = |build: &str, history: u64| {
            figures
                .mean(
                    name,
                    &[
                        ("bench", "memory_growth".into()),
                        ("build", build.into()),
                        ("history", history.into()),
                    ],
                )
                .map(|v| v / unit)
        };
        let mut cells: Vec<String> = sizes
            .iter()
            .map(|&history| {
                let baseline = if name.starts_with("purged_disk_") {
                    figures.mean(
                        "purged_line_bytes_per_record",
                        &[
                            ("bench", "memory_growth".into()),
                            ("build", "this".into()),
                            ("history", history.into()),
                        ],
                    )
                } else {
                    pick("baseline", history)
                };
                cell(pick("this", history), &[baseline])
            })
            .collect();
        let growth = |build: &str| Some(pick(build, sizes[1])? / pick(build, sizes[0])?);
        cells.push(cell(growth("this"), &[growth("baseline")]));
        print_row(label, &cells);
    }
}

fn print_instructions(figures: &Figures) {
    let pick = |name: &str, build: &str| {
        figures.mean(
            name,
            &[("bench", "instructions".into()), ("build", build.into())],
        )
    };
    println!(
        "\ninstructions (callgrind), one node, one client, sequential: this build (÷ baseline)"
    );
    print_row(
        "instructions per decision",
        &[cell(
            pick("instructions_per_decision", "this"),
            &[pick("instructions_per_decision", "baseline")],
        )],
    );
    print_row(
        "fsyncs per decision",
        &[cell(
            pick("sequential_fsyncs_per_decision", "this"),
            &[pick("sequential_fsyncs_per_decision", "baseline")],
        )],
    );
}

/// Every figure of the resource and speed goals, from one sitting.
#[derive(clap::Parser)]
struct Args {
    /// Another build of the node, measured beside this one.
    #[arg(long = "baseline-node")]
    baseline: Option<PathBuf>,
    /// Records at the small history.
    #[arg(long, default_value_t = 100_000, value_parser = clap::value_parser!(u64).range(1..=100_000_000))]
    small: u64,
    /// Records at the large history.
    #[arg(long, default_value_t = 1_000_000, value_parser = clap::value_parser!(u64).range(1..=100_000_000))]
    large: u64,
    /// Seconds of each measured load.
    #[arg(long, default_value_t = 10, value_parser = clap::value_parser!(u64).range(1..=300))]
    seconds: u64,
    /// Rounds of each column's pair of builds (2: both orders, averaged).
    #[arg(long, default_value_t = 1, value_parser = clap::value_parser!(u64).range(1..=10))]
    rounds: u64,
    /// Leave out memory_growth.
    #[arg(long)]
    skip_memory: bool,
    /// Leave out instructions.
    #[arg(long)]
    skip_instructions: bool,
}

fn main() {
    let args = <Args as clap::Parser>::parse();
    lineage_benches::exit_on_error("report", run(args));
}

fn run(args: Args) -> Result<(), String> {
    let sizes = [args.small, args.large];
    let seconds = args.seconds.to_string();
    let rounds = args.rounds;
    let baseline = args.baseline.clone();
    let this = sibling_binary("lineage-node", "-p lineage-node")?;
    if let Some(path) = &baseline {
        if !path.exists() {
            return Err(format!("{}: no such file", path.display()));
        }
    }
    let scratch = tempfile::tempdir().map_err(|e| e.to_string())?;
    let mut figures = Figures(Vec::new());

    println!(
        "report: history sizes {sizes:?}, {seconds} s of load each, this build {}, baseline {}",
        this.display(),
        baseline
            .as_ref()
            .map_or("none".into(), |p| p.display().to_string())
    );
    let one_core_verify = lineage_benches::one_core_verify_rate(100_000)?;
    println!("one core verifies {one_core_verify:.0} records/s the reference's way (one line after another)");

    for (turn, &size) in sizes.iter().enumerate() {
        for nodes in [1, 3] {
            let mut builds: Vec<(&str, &Path)> = Vec::new();
            for round in 0..rounds {
                let mut pair: Vec<(&str, &Path)> = vec![("this", &this)];
                if let Some(path) = &baseline {
                    pair.push(("baseline", path));
                    if (turn + round as usize).is_multiple_of(2) {
                        pair.reverse();
                    }
                }
                builds.extend(pair);
            }
            for (build, binary) in builds {
                let part = [
                    "--nodes".to_string(),
                    nodes.to_string(),
                    "--history".into(),
                    size.to_string(),
                    "--seconds".into(),
                    seconds.clone(),
                    "--node".into(),
                    binary.display().to_string(),
                ];
                run_part("cluster_load", &part, build, scratch.path(), &mut figures)?;
            }
        }
    }
    if !args.skip_memory {
        let mut part = vec![
            "--small".to_string(),
            sizes[0].to_string(),
            "--large".into(),
            sizes[1].to_string(),
        ];
        if let Some(path) = &baseline {
            part.extend(["--baseline-node".into(), path.display().to_string()]);
        }
        run_part("memory_growth", &part, "this", scratch.path(), &mut figures)?;
    }
    if !args.skip_instructions {
        let mut part = Vec::new();
        if let Some(path) = &baseline {
            part.extend(["--baseline-node".to_string(), path.display().to_string()]);
        }
        run_part("instructions", &part, "this", scratch.path(), &mut figures)?;
    }

    println!("\n=== report: every figure from this sitting");
    print_load_table(&figures, &sizes, one_core_verify);
    print_projection(&figures, &sizes, reference_bound(&figures));
    if !args.skip_memory {
        print_memory_table(&figures, &sizes);
    }
    if !args.skip_instructions {
        print_instructions(&figures);
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;
    use serde_json::json;

    /// A 3-node run: the leader took 200 µs and 0.25 fsyncs per decision, each follower
    /// 100 µs and 0.5 fsyncs, the generator 50 µs; the disk does 1,000 fsyncs/s.
    fn three_nodes() -> Figures {
        let run = json!({"bench": "cluster_load", "build": "this", "nodes": 3, "history": 10});
        let node = |name: &str, value: f64, leader: bool| {
            let mut f = run.clone();
            f["name"] = name.into();
            f["value"] = value.into();
            f["leader"] = leader.into();
            f
        };
        let mut generator = run.clone();
        generator["name"] = "generator_cpu_us_per_decision".into();
        generator["value"] = 50.0.into();
        Figures(vec![
            node("cpu_us_per_decision", 200.0, true),
            node("cpu_us_per_decision", 100.0, false),
            node("cpu_us_per_decision", 100.0, false),
            node("fsyncs_per_decision", 0.25, true),
            node("fsyncs_per_decision", 0.5, false),
            node("fsyncs_per_decision", 0.5, false),
            generator,
            json!({"bench": "cluster_load", "name": "fsyncs_per_second_ceiling", "value": 1000.0}),
        ])
    }

    #[test]
    fn bounds_come_from_each_nodes_cost_per_decision() {
        let bounds = Bounds::of(&three_nodes(), "this", (3, 10), 2.0).expect("figures");
        // 2 cores over 200 + 2 × 100 + 50 µs; over the leader's 200 µs alone.
        assert!((bounds.shared_cpu - 2e6 / 450.0).abs() < 1e-6);
        assert!((bounds.own_cpu - 2e6 / 200.0).abs() < 1e-6);
        // The followers' 0.5 fsyncs per decision bound the disk: 1,000 / 0.5.
        assert!((bounds.own_disk - 2000.0).abs() < 1e-6);
        assert!((bounds.projected() - 2000.0).abs() < 1e-6);
    }

    #[test]
    fn no_bounds_without_the_runs_figures() {
        let figures = three_nodes();
        assert!(Bounds::of(&figures, "baseline", (3, 10), 2.0).is_none());
        assert!(Bounds::of(&figures, "this", (3, 99), 2.0).is_none());
        assert!(Bounds::of(&Figures(Vec::new()), "this", (1, 10), 2.0).is_none());
    }
}
