//! The local launcher: start N worker processes (hidden subcommands of this binary); the
//! controller's loop (`lazarus-controller`) runs them as a fleet, and so does a node agent.
//!
//! Workers never outlive the launcher: each is started with `PR_SET_PDEATHSIG = SIGKILL` (Linux;
//! killing the launcher by any signal kills them), and the launcher holds their stdin open, so
//! its end of file tells a worker the launcher is gone on any system. Progress never blocks
//! training: a reader thread per worker drains its stdout at once, and the worker's own writes
//! go through a queue (`lazarus-worker`).

mod confine;

pub use confine::{allowed_cpus, memory_available, physical_memory, Confinement, MemoryBound, QuotaGroups};

use lazarus_setting::Setting;
use std::io::{BufRead, BufReader, Read, Write};
use std::process::{Child, ChildStdin, Command, Stdio};
use std::sync::mpsc::{self, Receiver, RecvTimeoutError};
use std::time::{Duration, Instant};

use serde::Serialize;

use lazarus_protocol::ControlError;
use lazarus_protocol::{fresh_secret, secret_hex, WorkerEvent, WorkerSpec};

/// One started worker process.
struct Running {
    child: Child,
    /// Held open for the whole run: its closing tells the worker the launcher is gone.
    stdin: Option<ChildStdin>,
}

/// The worker processes of one job and their reports.
pub struct Job {
    workers: Vec<Running>,
    events: Receiver<(usize, Option<WorkerEvent>)>,
    /// Kept until the workers have exited (then the cgroups can be removed).
    _quota: Option<QuotaGroups>,
}

/// Start `world` copies of this binary's hidden `subcommand`, each confined as `confine` says,
/// and send each its [`WorkerSpec`] (with `job`, at `epoch`; sealing their connections if
/// `encrypt`). The rest of the start — addresses, readiness — is the controller's. On any
/// failure the started workers are killed.
pub fn launch<J: Serialize>(
    subcommand: &str,
    world: usize,
    timeout_s: f64,
    job: &J,
    confine: Confinement,
    epoch: u64,
    encrypt: bool,
) -> Result<Job, ControlError> {
    // One secret per job: only the processes started here can take a rank at its rendezvous.
    let secret = secret_hex(fresh_secret().map_err(|e| ControlError::io("drawing the job secret from /dev/urandom", e))?);
    let specs = (0..world)
        .map(|rank| serde_json::to_string(&WorkerSpec { rank, world, epoch, timeout_s, secret: secret.clone(), bind: None, encrypt, job }))
        .collect::<Result<Vec<_>, _>>()?;
    start_processes(subcommand, &specs, confine)
}

/// Start one copy of this binary's hidden `subcommand` per spec line (process i gets
/// `specs[i]` on its stdin and is "rank" i of the returned [`Job`]), each confined as `confine`
/// says; their reports queue in the job ([`Job::next_event`]).
pub fn start_processes(subcommand: &str, specs: &[String], confine: Confinement) -> Result<Job, ControlError> {
    let (tx, events) = mpsc::channel();
    spawn_processes(subcommand, specs, confine, events, tx, |rank, ev| (rank, ev))
}

/// The same, with every report sent to `to` as `wrap(rank, report)` (`None`: the process
/// ended) instead of the job's queue: an agent waits on its workers and its controller at once.
pub(crate) fn start_processes_reporting<T: Send + 'static>(
    subcommand: &str,
    specs: &[String],
    confine: Confinement,
    to: mpsc::Sender<T>,
    wrap: fn(usize, Option<WorkerEvent>) -> T,
) -> Result<Job, ControlError> {
    let (_, nothing) = mpsc::channel();
    spawn_processes(subcommand, specs, confine, nothing, to, wrap)
}

fn spawn_processes<T: Send + 'static>(
    subcommand: &str,
    specs: &[String],
    confine: Confinement,
    events: Receiver<(usize, Option<WorkerEvent>)>,
    tx: mpsc::Sender<T>,
    wrap: fn(usize, Option<WorkerEvent>) -> T,
) -> Result<Job, ControlError> {
    let world = specs.len();
    let exe = std::env::current_exe().map_err(|e| ControlError::io("locating the lazarus binary", e))?;
    let mut quota = None;
    match confine {
        Confinement::Shared => {}
        Confinement::Cores(c) => {
            let have = allowed_cpus().len();
            if c == 0 {
                return Err(ControlError::invalid(Setting::CoresPerWorker, "0 (every worker needs at least one core)"));
            }
            if c.saturating_mul(world) > have {
                return Err(ControlError::invalid(
                    Setting::CoresPerWorker,
                    format!("{c} x {world} workers needs {} cores, this process may use {have}", c.saturating_mul(world)),
                ));
            }
        }
        Confinement::CpuQuota(f) => {
            if !f.is_finite() || !(0.01..=1024.0).contains(&f) {
                return Err(ControlError::invalid(
                    Setting::CpusPerWorker,
                    format!("{f} (expected a number of CPUs between 0.01 and 1024)"),
                ));
            }
            quota = Some(QuotaGroups::create(world, f)?);
        }
    }
    let mut processes = Job { workers: Vec::with_capacity(world), events, _quota: None };
    for (rank, spec) in specs.iter().enumerate() {
        let mut cmd = Command::new(&exe);
        cmd.arg(subcommand).stdin(Stdio::piped()).stdout(Stdio::piped()).stderr(Stdio::inherit());
        cmd.env(lazarus_protocol::LOCAL_WORKER_ENV, rank.to_string());
        die_with_parent(&mut cmd);
        match confine {
            Confinement::Shared => {}
            Confinement::Cores(c) => {
                cmd.env("RAYON_NUM_THREADS", c.to_string());
                confine::pin(&mut cmd, allowed_cpus()[rank * c..(rank + 1) * c].to_vec());
            }
            Confinement::CpuQuota(f) => {
                cmd.env("RAYON_NUM_THREADS", (f.ceil() as usize).max(1).to_string());
                if let Some(g) = &quota {
                    confine::join_cgroup(&mut cmd, &g.dirs[rank].join("cgroup.procs"))?;
                }
            }
        }
        let started = cmd.spawn().map_err(|e| ControlError::io(format!("starting worker {rank}"), e));
        let mut child = match started {
            Ok(c) => c,
            Err(e) => {
                processes.kill_all();
                return Err(e);
            }
        };
        let stdout = child.stdout.take();
        let stdin = child.stdin.take();
        processes.workers.push(Running { child, stdin });
        if let Some(stdout) = stdout {
            let tx = tx.clone();
            std::thread::Builder::new()
                .name(format!("lazarus-worker-{rank}-out"))
                .spawn(move || read_events(rank, stdout, |r, ev| tx.send(wrap(r, ev)).is_ok()))
                .map_err(|e| ControlError::io("starting a reader thread", e))?;
        }
        if let Err(e) = processes.write_line(rank, spec) {
            processes.kill_all();
            return Err(e);
        }
    }
    processes._quota = quota;
    Ok(processes)
}

/// Longest report line read from a worker (a step report is a few hundred bytes; bench results
/// a few kilobytes); a longer line is skipped with a warning, never buffered whole.
const MAX_REPORT_LINE: usize = 1 << 20;

/// The first epoch of a new job: the clock in milliseconds, so that a leftover process of an
/// earlier job is refused at the rendezvous, and the epochs of a job (this, then one more per
/// reconfiguration) never meet another job's.
pub fn fresh_epoch() -> u64 {
    std::time::SystemTime::now().duration_since(std::time::UNIX_EPOCH).map_or(1, |d| d.as_millis() as u64)
}

/// Forward a worker's reports to `send` (until it returns false), then its end (`None`); a line
/// that is not a report is passed on as a log line.
fn read_events(rank: usize, stdout: std::process::ChildStdout, send: impl Fn(usize, Option<WorkerEvent>) -> bool) {
    let mut reader = BufReader::new(stdout);
    let mut line = Vec::new();
    loop {
        line.clear();
        match (&mut reader).take(MAX_REPORT_LINE as u64 + 1).read_until(b'\n', &mut line) {
            Ok(0) | Err(_) => break,
            Ok(_) => {}
        }
        if line.len() > MAX_REPORT_LINE {
            tracing::warn!("worker {rank}: a report line longer than {MAX_REPORT_LINE} bytes was skipped");
            // Skip the rest of it.
            let mut rest = Vec::new();
            while !line.ends_with(b"\n") && !rest.ends_with(b"\n") {
                rest.clear();
                match (&mut reader).take(MAX_REPORT_LINE as u64).read_until(b'\n', &mut rest) {
                    Ok(0) | Err(_) => break,
                    Ok(_) => {}
                }
            }
            continue;
        }
        let text = String::from_utf8_lossy(&line);
        let text = text.trim_end();
        match serde_json::from_str::<WorkerEvent>(text) {
            Ok(ev) => {
                if !send(rank, Some(ev)) {
                    return;
                }
            }
            Err(_) if !text.is_empty() => tracing::warn!("worker {rank}: {text}"),
            Err(_) => {}
        }
    }
    send(rank, None);
}

/// Longest collective deadline a job may set: a day. Beyond it a stuck peer is not "slow".
pub const MAX_COMM_TIMEOUT_S: f64 = 86_400.0;

/// `--comm-timeout` in seconds: more than 0, at most [`MAX_COMM_TIMEOUT_S`].
pub fn check_comm_timeout(secs: f64) -> Result<f64, ControlError> {
    if !secs.is_finite() || secs <= 0.0 || secs > MAX_COMM_TIMEOUT_S {
        return Err(ControlError::invalid(
            Setting::CommTimeout,
            format!("{secs} (expected seconds, more than 0 and at most {MAX_COMM_TIMEOUT_S})"),
        ));
    }
    Ok(secs)
}

/// Linux: the child gets SIGKILL when the thread that started it ends (the launcher's main
/// thread: the launcher's death by any signal); if the launcher died before that was set, the
/// child exits at once.
pub fn die_with_parent(cmd: &mut Command) {
    #[cfg(target_os = "linux")]
    {
        use std::os::unix::process::CommandExt;
        // SAFETY: getpid before the fork; between fork and exec only prctl, getppid and _exit,
        // all async-signal-safe.
        let parent = unsafe { libc::getpid() };
        unsafe {
            cmd.pre_exec(move || {
                if libc::prctl(libc::PR_SET_PDEATHSIG, libc::SIGKILL as libc::c_ulong, 0, 0, 0) != 0 {
                    return Err(std::io::Error::last_os_error());
                }
                if libc::getppid() != parent {
                    libc::_exit(1);
                }
                Ok(())
            });
        }
    }
    #[cfg(not(target_os = "linux"))]
    let _ = cmd;
}

impl Job {
    pub fn write_line(&mut self, rank: usize, line: &str) -> Result<(), ControlError> {
        let Some(stdin) = self.workers.get_mut(rank).and_then(|w| w.stdin.as_mut()) else { return Ok(()) };
        writeln!(stdin, "{line}").and_then(|_| stdin.flush()).map_err(|e| ControlError::io(format!("writing to worker {rank}"), e))
    }

    /// Kill worker `rank` (a hung one: it is found out by its silence).
    pub fn kill(&mut self, rank: usize) {
        if let Some(w) = self.workers.get_mut(rank) {
            let _ = w.child.kill();
        }
    }

    /// The next report of any worker, waiting at most `wait` (None: nothing came).
    pub fn next_event(&self, wait: Duration) -> Option<(usize, Option<WorkerEvent>)> {
        match self.events.recv_timeout(wait) {
            Ok(x) => Some(x),
            Err(RecvTimeoutError::Timeout) => None,
            Err(RecvTimeoutError::Disconnected) => {
                std::thread::sleep(wait.min(Duration::from_millis(50)));
                None
            }
        }
    }

    /// Reap every worker (after they finished or were killed).
    pub fn reap(&mut self) {
        self.wait_all();
    }

    /// Kill every worker still running.
    pub fn kill_all(&mut self) {
        for w in &mut self.workers {
            let _ = w.child.kill();
        }
    }

    /// Reap every worker, then close its stdin (closing first would tell a worker that is still
    /// flushing its last report that the launcher is gone).
    fn wait_all(&mut self) {
        for w in &mut self.workers {
            let _ = w.child.wait();
            w.stdin = None;
        }
    }

    /// How worker `rank` ended, once its stdout has closed (waits up to 2 s for the exit).
    pub fn exit_status(&mut self, rank: usize) -> String {
        let Some(w) = self.workers.get_mut(rank) else { return "unknown".into() };
        let until = Instant::now() + Duration::from_secs(2);
        loop {
            match w.child.try_wait() {
                Ok(Some(status)) => return describe_exit(&status),
                Ok(None) if Instant::now() < until => std::thread::sleep(Duration::from_millis(5)),
                Ok(None) => return "closed its output".into(),
                Err(e) => return e.to_string(),
            }
        }
    }

    /// Process ids of the workers, in rank order.
    pub fn pids(&self) -> Vec<u32> {
        self.workers.iter().map(|w| w.child.id()).collect()
    }
}

impl Drop for Job {
    /// Nothing outlives a job that is dropped, whatever the reason.
    fn drop(&mut self) {
        self.kill_all();
        self.wait_all();
    }
}

/// "exit code N" or "killed by signal N".
pub fn describe_exit(status: &std::process::ExitStatus) -> String {
    #[cfg(unix)]
    {
        use std::os::unix::process::ExitStatusExt;
        if let Some(sig) = status.signal() {
            return format!("killed by signal {sig}");
        }
    }
    match status.code() {
        Some(c) => format!("exit code {c}"),
        None => "unknown exit".into(),
    }
}
