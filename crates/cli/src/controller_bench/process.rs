//! The benchmarked controller as a process: started with the benchmark's flags, its
//! listening and its job's progress waited for, its CPU time and memory read from /proc.

use super::*;

pub(super) fn write_secret(path: &Path, secret: u128) -> Result<()> {
    use std::os::unix::fs::OpenOptionsExt as _;
    let mut f = std::fs::OpenOptions::new().write(true).create(true).truncate(true).mode(0o600).open(path)?;
    writeln!(f, "{}", lazarus_protocol::secret_hex(secret))?;
    Ok(())
}

/// The controller under test, with where its output goes.
pub(super) struct Controller {
    pub(super) child: Child,
    pub(super) stderr: PathBuf,
}

impl Controller {
    pub(super) fn check_alive(&mut self) -> Result<()> {
        if let Some(status) = self.child.try_wait()? {
            bail!("the controller exited ({status}): {}", self.tail());
        }
        Ok(())
    }

    /// The end of its stderr.
    pub(super) fn tail(&self) -> String {
        let text = std::fs::read_to_string(&self.stderr).unwrap_or_default();
        let lines: Vec<&str> = text.lines().collect();
        lines[lines.len().saturating_sub(8)..].join("\n")
    }

    pub(super) fn stop(&mut self) {
        // SAFETY: a signal to our own child.
        unsafe {
            libc::kill(self.child.id() as libc::pid_t, libc::SIGKILL);
        }
        let _ = self.child.wait();
    }
}

impl Drop for Controller {
    fn drop(&mut self) {
        if matches!(self.child.try_wait(), Ok(None)) {
            self.stop();
        }
    }
}

#[allow(clippy::too_many_arguments)] // the job's shape and timing, each its own
pub(super) fn start_controller(
    args: &ControllerBenchArgs,
    dir: &Path,
    secret_file: &Path,
    listen: SocketAddr,
    workers: usize,
    most: usize,
    lease: f64,
    heartbeat: f64,
) -> Result<Controller> {
    let exe = std::env::current_exe().context("finding this executable")?;
    let stderr = dir.join("controller.stderr");
    let n = |x: usize| x.to_string();
    let f = |x: f64| x.to_string();
    let mut cmd = Command::new(exe);
    cmd.arg("controller")
        .args(["--listen", &listen.to_string()])
        .arg("--secret-file")
        .arg(secret_file)
        .args(["--workers", &n(workers), "--gpus-per-node", &n(args.gpus_per_node), "--max-workers", &n(most)])
        .args(["--join-wait", JOIN_WAIT_S, "--wait-agents", "900"])
        .args(["--layers", &n(args.layers), "--moe-every", "1", "--experts", &n(args.experts)])
        .args(["--d-model", "8", "--heads", "1", "--d-ff", "8", "--batch-size", &n(most), "--seq-len", "2"])
        .args(["--steps", "1000000", "--profile-steps", "1", "--rebalance-every", &args.rebalance_every.to_string()])
        .args(["--lease", &f(lease), "--heartbeat", &f(heartbeat)])
        .arg("--checkpoint-dir")
        .arg(dir.join("checkpoints"))
        .arg("--overwrite-checkpoints")
        .arg("--json-log")
        .arg(dir.join("log.jsonl"))
        .stdin(Stdio::null())
        .stdout(Stdio::from(std::fs::File::create(dir.join("controller.stdout"))?))
        .stderr(Stdio::from(std::fs::File::create(&stderr)?));
    let child = cmd.spawn().context("starting the controller")?;
    Ok(Controller { child, stderr })
}

/// How long a start or a move of `nodes` nodes may take before the bench gives up: generous (at
/// 1,024 nodes on a 2-core VM a start took 3 s, a join 3 s, a rebalance's move 5–10 s), but not
/// so long that a job that can no longer get there keeps a test waiting for a quarter of an hour.
pub(super) fn patience(nodes: usize) -> Duration {
    Duration::from_secs_f64(120.0 + 0.25 * nodes as f64)
}

/// Wait until `done` holds of the fakes' plane, at most `within`, while the controller runs and
/// `failed` says nothing.
pub(super) fn wait_for(
    controller: &mut Controller,
    fleet: &SyntheticFleet,
    within: Duration,
    done: impl Fn(&lazarus_agent::loadgen::PlaneView) -> bool,
    failed: impl Fn() -> Option<String>,
) -> Result<bool> {
    let until = Instant::now() + within;
    while Instant::now() < until {
        if fleet.wait_until(Duration::from_secs(1), &done) {
            return Ok(true);
        }
        controller.check_alive().map_err(|e| e.context(format!("synthetic agents: {:?}", fleet.trouble())))?;
        if let Some(why) = failed() {
            bail!(why);
        }
    }
    Ok(false)
}

pub(super) fn wait_listening(c: &mut Controller, addr: SocketAddr, within: Duration) -> Result<Instant> {
    let until = Instant::now() + within;
    loop {
        c.check_alive()?;
        if TcpStream::connect_timeout(&addr, Duration::from_millis(200)).is_ok() {
            return Ok(Instant::now());
        }
        if Instant::now() >= until {
            bail!("the controller did not listen at {addr} within {} s: {}", within.as_secs(), c.tail());
        }
        std::thread::sleep(Duration::from_millis(50));
    }
}

/// The controller's CPU time so far, seconds (user + system, from /proc).
pub(super) fn cpu_seconds(pid: u32) -> Result<f64> {
    let stat = std::fs::read_to_string(format!("/proc/{pid}/stat")).context("reading the controller's /proc stat")?;
    // The fields after the command's closing parenthesis: utime and stime are the 12th and 13th.
    let rest = stat.rsplit_once(')').map(|(_, r)| r).unwrap_or_default();
    let fields: Vec<&str> = rest.split_whitespace().collect();
    let ticks = |i: usize| fields.get(i).and_then(|v| v.parse::<f64>().ok()).unwrap_or(0.0);
    // SAFETY: sysconf has no preconditions.
    let hz = unsafe { libc::sysconf(libc::_SC_CLK_TCK) }.max(1) as f64;
    Ok((ticks(11) + ticks(12)) / hz)
}

/// The controller's resident memory and its high-water mark, MiB.
pub(super) fn memory_mib(pid: u32) -> (f64, f64) {
    let status = std::fs::read_to_string(format!("/proc/{pid}/status")).unwrap_or_default();
    let kib = |key: &str| {
        status
            .lines()
            .find(|l| l.starts_with(key))
            .and_then(|l| l.split_whitespace().nth(1))
            .and_then(|v| v.parse::<f64>().ok())
            .unwrap_or(0.0)
    };
    (kib("VmRSS:") / 1024.0, kib("VmHWM:") / 1024.0)
}
