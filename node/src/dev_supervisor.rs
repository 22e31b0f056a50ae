//! `lineage-node dev`'s supervisor: restarts a node that fails (a node stops itself with
//! status 70 on a panic, a failed fsync or a storage assertion, and recovers from disk
//! when started again; a kill by signal counts too), and stops every child on Ctrl-C or
//! SIGTERM. A node that stops cleanly (status 0) is left stopped.

use std::process::{Child, Command};
use std::time::{Duration, Instant};

/// Restart delays grow from this to [`MAX_BACKOFF`] while a node keeps exiting soon after
/// it started, so a node that cannot start does not spin.
const FIRST_BACKOFF: Duration = Duration::from_millis(500);
const MAX_BACKOFF: Duration = Duration::from_secs(30);
/// A node that ran this long before exiting starts again after [`FIRST_BACKOFF`].
const STABLE_AFTER: Duration = Duration::from_secs(60);
const POLL: Duration = Duration::from_millis(200);

/// A child that is restarted when it exits.
pub struct Supervised {
    pub name: String,
    make: Box<dyn Fn() -> Command>,
    child: Option<Child>,
    started: Instant,
    backoff: Duration,
    restart_at: Option<Instant>,
}

impl Supervised {
    pub fn spawn(name: String, make: Box<dyn Fn() -> Command>) -> Result<Self, String> {
        let child = make()
            .spawn()
            .map_err(|e| format!("cannot start {name}: {e}"))?;
        Ok(Supervised {
            name,
            make,
            child: Some(child),
            started: Instant::now(),
            backoff: FIRST_BACKOFF,
            restart_at: None,
        })
    }

    /// Notices an exit and restarts when its delay has passed.
    fn poll(&mut self) {
        if let Some(child) = &mut self.child {
            if let Ok(Some(status)) = child.try_wait() {
                self.child = None;
                if status.success() {
                    // A clean stop (SIGTERM or Ctrl-C of its own): as systemd's
                    // Restart=on-failure, not a failure to restart from.
                    println!("dev: {} stopped ({status})", self.name);
                    return;
                }
                if self.started.elapsed() >= STABLE_AFTER {
                    self.backoff = FIRST_BACKOFF;
                }
                println!(
                    "dev: {} exited ({status}); restarting in {:.1} s",
                    self.name,
                    self.backoff.as_secs_f64()
                );
                self.restart_at = Some(Instant::now() + self.backoff);
                self.backoff = (self.backoff * 2).min(MAX_BACKOFF);
            }
        }
        if self.restart_at.is_some_and(|at| Instant::now() >= at) {
            self.restart_at = None;
            match (self.make)().spawn() {
                Ok(child) => {
                    self.child = Some(child);
                    self.started = Instant::now();
                }
                Err(e) => {
                    println!("dev: cannot restart {}: {e}", self.name);
                    self.restart_at = Some(Instant::now() + self.backoff);
                }
            }
        }
    }

    fn stop(&mut self) {
        if let Some(mut child) = self.child.take() {
            let _ = child.kill();
            let _ = child.wait();
        }
    }
}

/// Keeps `supervised` running until Ctrl-C or SIGTERM, then stops them and `others`.
pub fn run(mut supervised: Vec<Supervised>, others: Vec<Child>) -> Result<(), String> {
    let runtime = tokio::runtime::Builder::new_current_thread()
        .enable_all()
        .build()
        .map_err(|e| format!("runtime: {e}"))?;
    runtime.block_on(async {
        let mut terminate =
            tokio::signal::unix::signal(tokio::signal::unix::SignalKind::terminate()).ok();
        // Made once, so a Ctrl-C that arrives while a tick runs is not lost.
        let ctrl_c = tokio::signal::ctrl_c();
        tokio::pin!(ctrl_c);
        let mut tick = tokio::time::interval(POLL);
        loop {
            tokio::select! {
                _ = &mut ctrl_c => break,
                _ = async {
                    match terminate.as_mut() {
                        Some(signal) => { signal.recv().await; }
                        None => std::future::pending::<()>().await,
                    }
                } => break,
                _ = tick.tick() => supervised.iter_mut().for_each(Supervised::poll),
            }
        }
    });
    for process in &mut supervised {
        process.stop();
    }
    for mut child in others {
        let _ = child.kill();
        let _ = child.wait();
    }
    Ok(())
}
