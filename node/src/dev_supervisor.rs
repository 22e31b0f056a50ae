//! `lineage-node dev`'s supervisor. It starts every child (the nodes, the witness, the
//! checkpointer) in its own process group, with the kernel told to stop it if `dev` dies,
//! so no child outlives `dev` however `dev` ends. It prefixes each line a child prints
//! with the child's name. A child that fails (a node exits with 70 on a panic or a failed
//! fsync and recovers from disk on its next start; a kill by signal counts too) is
//! reported and started again after a growing delay; one that fails 5 times in 2 minutes
//! stops `dev` with an error, since restarting it is not helping. SIGINT, SIGTERM and
//! SIGHUP stop everything in order: the checkpointer, then the witness, then the nodes,
//! each with SIGTERM first and SIGKILL after 10 s. A child that stops cleanly (status 0)
//! is left stopped.

use std::collections::VecDeque;
use std::io::{BufRead, BufReader, Read, Write};
use std::os::unix::process::CommandExt;
use std::process::{Child, Command, ExitStatus, Stdio};
use std::time::{Duration, Instant};

/// Restart delays double from this to [`MAX_BACKOFF`] while a child keeps failing soon
/// after it started, so a child that cannot start does not spin.
const FIRST_BACKOFF: Duration = Duration::from_secs(1);
const MAX_BACKOFF: Duration = Duration::from_secs(30);
/// A child that ran this long before failing starts again after [`FIRST_BACKOFF`].
const STABLE_AFTER: Duration = Duration::from_secs(60);
/// This many failures of one child within [`CRASH_WINDOW`] stop `dev`.
const CRASH_LIMIT: usize = 5;
const CRASH_WINDOW: Duration = Duration::from_secs(120);
/// How long a child has to stop after SIGTERM before it gets SIGKILL.
const STOP_GRACE: Duration = Duration::from_secs(10);
const POLL: Duration = Duration::from_millis(200);

/// When a child is stopped relative to the others: lower first.
#[derive(Clone, Copy, PartialEq, Eq, PartialOrd, Ord, Debug)]
pub enum StopOrder {
    Checkpointer,
    Witness,
    Node,
}

/// A child that is restarted when it fails.
pub struct Supervised {
    pub name: String,
    order: StopOrder,
    make: Box<dyn Fn() -> Command>,
    child: Option<Child>,
    started: Instant,
    backoff: Duration,
    restart_at: Option<Instant>,
    failures: VecDeque<Instant>,
}

impl Supervised {
    pub fn spawn(
        name: String,
        order: StopOrder,
        make: Box<dyn Fn() -> Command>,
    ) -> Result<Self, String> {
        let child = start(&name, &make)?;
        Ok(Supervised {
            name,
            order,
            make,
            child: Some(child),
            started: Instant::now(),
            backoff: FIRST_BACKOFF,
            restart_at: None,
            failures: VecDeque::new(),
        })
    }

    /// Notices an exit and restarts when its delay has passed; an error when the child
    /// failed too often to go on.
    fn poll(&mut self) -> Result<(), String> {
        if let Some(status) = self
            .child
            .as_mut()
            .and_then(|c| c.try_wait().ok().flatten())
        {
            self.child = None;
            self.exited(status)?;
        }
        if self.restart_at.is_some_and(|at| Instant::now() >= at) {
            self.restart_at = None;
            match start(&self.name, &self.make) {
                Ok(child) => {
                    self.child = Some(child);
                    self.started = Instant::now();
                }
                // A child that cannot even start fails like one that exits at once.
                Err(e) => self.failed(&e)?,
            }
        }
        Ok(())
    }

    fn exited(&mut self, status: ExitStatus) -> Result<(), String> {
        if status.success() {
            // A clean stop, as systemd's Restart=on-failure: not a failure.
            say(&format!("{} stopped ({status})", self.name));
            return Ok(());
        }
        self.failed(&format!("{} exited ({status})", self.name))
    }

    /// Counts a failure and schedules the restart; an error once there are too many.
    fn failed(&mut self, what: &str) -> Result<(), String> {
        let now = Instant::now();
        self.failures.push_back(now);
        while self
            .failures
            .front()
            .is_some_and(|t| now.duration_since(*t) > CRASH_WINDOW)
        {
            self.failures.pop_front();
        }
        if self.failures.len() >= CRASH_LIMIT {
            return Err(format!(
                "{} failed {CRASH_LIMIT} times within {} s (last: {what}); stopping \
                 everything. Its last lines are above",
                self.name,
                CRASH_WINDOW.as_secs()
            ));
        }
        if self.started.elapsed() >= STABLE_AFTER {
            self.backoff = FIRST_BACKOFF;
        }
        say(&format!(
            "{what}; restarting in {:.0} s",
            self.backoff.as_secs_f64()
        ));
        self.restart_at = Some(now + self.backoff);
        self.backoff = (self.backoff * 2).min(MAX_BACKOFF);
        Ok(())
    }
}

/// A line from `dev` itself.
fn say(message: &str) {
    println!("{:<12}| {message}", "dev");
}

/// Starts one child: its own process group (a Ctrl-C at the terminal reaches `dev`
/// alone, which stops the children in order), SIGTERM from the kernel if `dev` dies,
/// and its output prefixed with its name.
fn start(name: &str, make: &dyn Fn() -> Command) -> Result<Child, String> {
    let mut command = make();
    let parent = std::process::id();
    command
        .process_group(0)
        .stdin(Stdio::null())
        .stdout(Stdio::piped())
        .stderr(Stdio::piped());
    // SAFETY: runs in the child between fork and exec, where only async-signal-safe calls
    // are allowed; prctl, getppid and _exit are, and nothing here allocates.
    unsafe {
        command.pre_exec(move || {
            if libc::prctl(libc::PR_SET_PDEATHSIG, libc::SIGTERM) != 0 {
                return Err(std::io::Error::last_os_error());
            }
            // `dev` died before the line above took effect: nobody would stop us.
            if libc::getppid() as u32 != parent {
                libc::_exit(1);
            }
            Ok(())
        });
    }
    let mut child = command
        .spawn()
        .map_err(|e| format!("cannot start {name}: {e}"))?;
    if let Some(stdout) = child.stdout.take() {
        forward_lines(name.to_string(), stdout, false);
    }
    if let Some(stderr) = child.stderr.take() {
        forward_lines(name.to_string(), stderr, true);
    }
    Ok(child)
}

/// Copies a child's output to ours, each line prefixed with its name. Bytes that are not
/// UTF-8 are shown replaced rather than stopping the copy (a stopped copy would fill the
/// pipe and block the child).
fn forward_lines(name: String, stream: impl Read + Send + 'static, to_stderr: bool) {
    std::thread::spawn(move || {
        let mut reader = BufReader::new(stream);
        let mut line = Vec::new();
        loop {
            line.clear();
            match reader.read_until(b'\n', &mut line) {
                Ok(0) | Err(_) => return,
                Ok(_) => {}
            }
            let text = String::from_utf8_lossy(&line);
            let text = text.trim_end_matches(['\n', '\r']);
            let _ = if to_stderr {
                writeln!(std::io::stderr().lock(), "{name:<12}| {text}")
            } else {
                writeln!(std::io::stdout().lock(), "{name:<12}| {text}")
            };
        }
    });
}

/// Keeps `children` running until SIGINT, SIGTERM or SIGHUP (then stops them in order
/// and returns Ok), or until one fails too often (then stops them and returns the error).
pub fn run(mut children: Vec<Supervised>) -> Result<(), String> {
    let runtime = tokio::runtime::Builder::new_current_thread()
        .enable_all()
        .build()
        .map_err(|e| format!("runtime: {e}"))?;
    let outcome = runtime.block_on(async {
        use tokio::signal::unix::{signal, SignalKind};
        let mut stops = Vec::new();
        for kind in [
            SignalKind::interrupt(),
            SignalKind::terminate(),
            SignalKind::hangup(),
        ] {
            stops.push(signal(kind).map_err(|e| format!("signal handler: {e}"))?);
        }
        let [interrupt, terminate, hangup] = &mut stops[..] else {
            return Err("signal handlers".to_string());
        };
        let mut tick = tokio::time::interval(POLL);
        loop {
            tokio::select! {
                _ = interrupt.recv() => return Ok("SIGINT"),
                _ = terminate.recv() => return Ok("SIGTERM"),
                _ = hangup.recv() => return Ok("SIGHUP"),
                _ = tick.tick() => {
                    for child in &mut children {
                        child.poll()?;
                    }
                }
            }
        }
    });
    match &outcome {
        Ok(signal) => say(&format!("{signal}: stopping everything")),
        Err(e) => say(e),
    }
    stop_all(&mut children);
    outcome.map(|_| ())
}

/// Stops the children group by group (`StopOrder`): SIGTERM to each process group, then
/// SIGKILL to what is left after [`STOP_GRACE`].
pub fn stop_all(children: &mut [Supervised]) {
    children.sort_by_key(|c| c.order);
    let mut start = 0;
    while start < children.len() {
        let order = children[start].order;
        let end = children[start..]
            .iter()
            .position(|c| c.order != order)
            .map_or(children.len(), |n| start + n);
        let group = &mut children[start..end];
        for child in group.iter().filter_map(|c| c.child.as_ref()) {
            signal_group(child, libc::SIGTERM);
        }
        let deadline = Instant::now() + STOP_GRACE;
        loop {
            let running = group
                .iter_mut()
                .filter_map(|c| c.child.as_mut())
                .map(|child| matches!(child.try_wait(), Ok(None)))
                .filter(|running| *running)
                .count();
            if running == 0 || Instant::now() >= deadline {
                break;
            }
            std::thread::sleep(Duration::from_millis(50));
        }
        for supervised in group.iter_mut() {
            if let Some(mut child) = supervised.child.take() {
                if matches!(child.try_wait(), Ok(None)) {
                    say(&format!(
                        "{} did not stop within {STOP_GRACE:?}: SIGKILL",
                        supervised.name
                    ));
                    signal_group(&child, libc::SIGKILL);
                }
                let _ = child.wait();
            }
        }
        start = end;
    }
}

fn signal_group(child: &Child, signal: libc::c_int) {
    if let Ok(pid) = libc::pid_t::try_from(child.id()) {
        // SAFETY: kill(2) with a process group id (negative) we created; no memory is
        // touched.
        unsafe {
            libc::kill(-pid, signal);
        }
    }
}
