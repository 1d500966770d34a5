//! `lazarus train --workers N`: N local worker processes (hidden subcommand `lazarus worker`)
//! training one model over loopback TCP with the flexible dispatcher, and this process as
//! their launcher: it plans the expert placement, starts the workers, tells them each other's
//! addresses, and turns rank 0's step reports into the same progress bar, `--json-log` and
//! summary as the single-process trainer. There is no controller yet: a worker that dies ends
//! the run (the survivors stop with `PeerLost`), and the launcher says which one and how.
//!
//! Launcher ↔ worker protocol, one JSON object per line: the launcher writes a [`WorkerSpec`] to
//! the worker's stdin; the worker binds an ephemeral loopback port and answers
//! `{"event":"listening","addr":…}`; the launcher writes `{"addrs":[…]}` with every rank's
//! address; then the worker reports [`WorkerEvent`]s on stdout until `done` or `failed`.

use std::io::{BufRead, BufReader, Write};
use std::net::{SocketAddr, TcpListener};
use std::path::{Path, PathBuf};
use std::process::{Child, ChildStdin, Command, Stdio};
use std::sync::mpsc;
use std::time::{Duration, Instant};

use anyhow::{anyhow, bail, Context, Result};
use candle_core::Tensor;
use lazarus_comm::{CommError, Group, Rendezvous, TcpTransport};
use lazarus_model::{StepReport, TrainConfig, Trainer};
use lazarus_plan::{plan_model, ClusterShape, ModelPlan, PlanPolicy, ReplicaMap};
use lazarus_runtime::bench::{run_moe_layer_bench, MoeLayerBenchSpec};
use lazarus_runtime::{check_plan, validate_worker_config, DispatchMode, RuntimeError, Worker, WorkerOptions};
use serde::{Deserialize, Serialize};

use crate::training::{build_config, print_banner, Reporter, TrainArgs};

/// What every worker process is sent on its stdin: its rank in the job, and the job.
#[derive(Debug, Serialize, Deserialize)]
pub struct WorkerSpec<J> {
    pub rank: usize,
    pub world: usize,
    /// Transport epoch of the job (stale connections from another run are refused).
    pub epoch: u64,
    /// Deadline of every collective, seconds.
    pub timeout_s: f64,
    pub job: J,
}

/// A `train --workers` rank's job.
#[derive(Debug, Serialize, Deserialize)]
pub struct TrainJob {
    pub config: TrainConfig,
    pub plan: ReplicaMap,
    pub static_ep: bool,
    /// Resume from the latest checkpoint in this directory.
    pub resume: Option<PathBuf>,
}

#[derive(Debug, Serialize, Deserialize)]
struct Addrs {
    addrs: Vec<String>,
}

/// What a worker reports on stdout.
#[derive(Debug, Serialize, Deserialize)]
#[serde(tag = "event", rename_all = "snake_case")]
pub enum WorkerEvent {
    Listening {
        addr: String,
    },
    /// Connected to every peer and built its model.
    Ready {
        pid: u32,
    },
    /// A finished step (rank 0 only): the global report, its wall time and this rank's wire bytes.
    Step {
        report: StepReport,
        seconds: f64,
        wire_bytes: u64,
    },
    Done {
        checkpoint: Option<PathBuf>,
    },
    /// A benchmark's results (rank 0 only).
    BenchResults {
        results: Vec<lazarus_runtime::bench::BenchResult>,
    },
    /// The worker stopped: `kind` is "peer_lost", "timeout", "config" or "error".
    Failed {
        kind: String,
        message: String,
    },
}

fn emit(event: &WorkerEvent) {
    let mut out = std::io::stdout().lock();
    // A launcher that went away cannot be told anything; the worker ends at its next collective.
    let _ = serde_json::to_writer(&mut out, event);
    let _ = out.write_all(b"\n");
    let _ = out.flush();
}

fn read_line<T: serde::de::DeserializeOwned>(input: &mut impl BufRead, what: &str) -> Result<T> {
    let mut line = String::new();
    if input.read_line(&mut line)? == 0 {
        bail!("the launcher closed stdin before sending the {what}");
    }
    serde_json::from_str(line.trim()).with_context(|| format!("bad {what} from the launcher"))
}

fn failure_kind(e: &anyhow::Error) -> &'static str {
    for cause in e.chain() {
        let comm = match cause.downcast_ref::<RuntimeError>() {
            Some(RuntimeError::Comm(c)) => Some(c),
            _ => cause.downcast_ref::<CommError>(),
        };
        match comm {
            Some(CommError::PeerLost { .. }) => return "peer_lost",
            Some(CommError::Timeout { .. }) => return "timeout",
            Some(_) => return "comm",
            None => {}
        }
        if matches!(cause.downcast_ref::<RuntimeError>(), Some(RuntimeError::Invalid { .. } | RuntimeError::Model(_))) {
            return "config";
        }
    }
    "error"
}

/// The hidden `lazarus worker` subcommand: one rank of a `train --workers` run.
/// Its errors go to the launcher as a `failed` event (and the exit code), not to stderr.
pub fn run_worker() -> Result<()> {
    let mut stdin = BufReader::new(std::io::stdin());
    finish_worker(worker_main(&mut stdin).map(|checkpoint| WorkerEvent::Done { checkpoint }))
}

/// The child side of a launch: read the spec, listen, tell the launcher, learn every rank's
/// address and connect to all of them.
fn join<J: serde::de::DeserializeOwned>(stdin: &mut impl BufRead) -> Result<(WorkerSpec<J>, TcpTransport)> {
    let spec: WorkerSpec<J> = read_line(stdin, "worker spec")?;
    let listener = TcpListener::bind("127.0.0.1:0").context("binding a loopback port")?;
    emit(&WorkerEvent::Listening { addr: listener.local_addr()?.to_string() });
    let addrs: Addrs = read_line(stdin, "address list")?;
    let addrs: Vec<SocketAddr> =
        addrs.addrs.iter().map(|a| a.parse().map_err(|_| anyhow!("invalid peer address {a:?}"))).collect::<Result<_>>()?;
    let timeout = Duration::from_secs_f64(spec.timeout_s);
    let t = TcpTransport::connect(listener, Rendezvous { rank: spec.rank, addrs, epoch: spec.epoch, timeout })?;
    Ok((spec, t))
}

/// Report a worker's outcome to the launcher; errors leave through the exit code.
fn finish_worker(result: Result<WorkerEvent>) -> Result<()> {
    match result {
        Ok(event) => {
            emit(&event);
            Ok(())
        }
        Err(e) => {
            emit(&WorkerEvent::Failed { kind: failure_kind(&e).into(), message: format!("{e:#}") });
            std::process::exit(1)
        }
    }
}

/// The hidden `lazarus bench-worker` subcommand: one rank of `bench moe-layer`.
pub fn run_bench_worker() -> Result<()> {
    let mut stdin = BufReader::new(std::io::stdin());
    finish_worker((|| {
        let (spec, mut t): (WorkerSpec<MoeLayerBenchSpec>, _) = join(&mut stdin)?;
        emit(&WorkerEvent::Ready { pid: std::process::id() });
        let results = run_moe_layer_bench(&mut t, &mut Group::world(spec.world), &spec.job)?;
        t.shutdown();
        Ok(if spec.rank == 0 { WorkerEvent::BenchResults { results } } else { WorkerEvent::Done { checkpoint: None } })
    })())
}

fn worker_main(stdin: &mut impl BufRead) -> Result<Option<PathBuf>> {
    let (spec, mut t): (WorkerSpec<TrainJob>, _) = join(stdin)?;
    let timeout = Duration::from_secs_f64(spec.timeout_s);
    let mut group = Group::world(spec.world);
    let job = spec.job;
    let mode = if job.static_ep { DispatchMode::StaticPadded } else { DispatchMode::Balanced };
    let options = WorkerOptions { plan: job.plan, mode, timeout };
    let mut worker = Worker::new(job.config.clone(), options, spec.rank, spec.world, job.resume.as_deref())?;
    emit(&WorkerEvent::Ready { pid: std::process::id() });
    let cfg = job.config;
    while !worker.done() {
        let t0 = Instant::now();
        let r = worker.step(&mut t, &mut group)?;
        if spec.rank == 0 {
            emit(&WorkerEvent::Step { report: r.report.clone(), seconds: t0.elapsed().as_secs_f64(), wire_bytes: r.wire_bytes });
        }
        if let Some(dir) = &cfg.checkpoint_dir {
            if cfg.checkpoint_every > 0 && r.report.step % cfg.checkpoint_every == 0 && !worker.done() {
                worker.save_checkpoint(&mut t, &mut group, dir)?;
            }
        }
    }
    let saved = match &cfg.checkpoint_dir {
        Some(dir) => worker.save_checkpoint(&mut t, &mut group, dir)?,
        None => None,
    };
    t.shutdown();
    Ok(saved)
}

/// A plan file (`lazarus plan --json`) for a job of `world` workers (one rank per GPU slot of
/// the plan: nodes × GPUs per node).
fn read_placement_file(path: &Path, world: usize) -> Result<ModelPlan> {
    let text = crate::io::read_text("placement-file", path, crate::io::MAX_JSON_BYTES)?;
    let plan = ModelPlan::from_json(&text).with_context(|| format!("invalid --placement-file {}", path.display()))?;
    if plan.shape().ranks() != world {
        bail!(
            "invalid --placement-file: {} plans {} ranks ({} nodes x {} GPUs), but --workers is {world}",
            path.display(),
            plan.shape().ranks(),
            plan.shape().nodes,
            plan.shape().gpus_per_node
        );
    }
    Ok(plan)
}

/// Router loads of the current model over the next `steps` global batches (forward only, on a
/// copy of the trainer so the workers' data order is untouched), summed per MoE layer.
fn measure_loads(trainer: &mut Trainer, steps: usize) -> Result<Vec<Vec<f64>>> {
    let cfg = trainer.config.clone();
    let mut loads = vec![vec![0.0; cfg.model.n_experts]; cfg.model.moe_layers()];
    for _ in 0..steps {
        let batch = trainer.sampler.next_batch(cfg.batch_size);
        let device = trainer.model.device().clone();
        let x = Tensor::from_vec(batch.inputs, (cfg.batch_size, cfg.seq_len), &device)?;
        let y = Tensor::from_vec(batch.targets, (cfg.batch_size, cfg.seq_len), &device)?;
        let out = trainer.model.forward(&x, &y, None)?;
        for (acc, stats) in loads.iter_mut().zip(&out.moe) {
            acc.iter_mut().zip(&stats.load).for_each(|(a, &c)| *a += c as f64);
        }
    }
    Ok(loads)
}

pub struct Running {
    rank: usize,
    child: Child,
    stdin: Option<ChildStdin>,
}

type Events = mpsc::Receiver<(usize, Option<WorkerEvent>)>;

impl Running {
    pub fn kill(&mut self) {
        let _ = self.child.kill();
    }

    pub fn wait(&mut self) {
        let _ = self.child.wait();
    }
}

/// How much of the machine each worker gets, so that a worker stands for one accelerator of
/// its own: by default workers share every core (an idle rank's core then goes to a busy one,
/// which hides load imbalance).
#[derive(Debug, Clone, Copy, PartialEq)]
pub enum Confinement {
    Shared,
    /// Worker r pinned to cores [r·C, (r+1)·C), thread pools sized to C.
    Cores(usize),
    /// Each worker in its own Linux cgroup capped at this many CPUs (CFS bandwidth, 10 ms
    /// period), for machines with fewer cores than workers; needs write access to the cgroup
    /// cpu controller (v1 `/sys/fs/cgroup/cpu` or v2 `/sys/fs/cgroup`).
    CpuQuota(f64),
}

/// Per-worker cgroups created for [`Confinement::CpuQuota`]; removed when dropped (once the
/// workers have exited; a cgroup with live processes cannot be removed).
pub struct QuotaGroups {
    dirs: Vec<PathBuf>,
}

impl Drop for QuotaGroups {
    fn drop(&mut self) {
        for d in &self.dirs {
            let _ = std::fs::remove_dir(d);
        }
    }
}

impl QuotaGroups {
    fn create(world: usize, cpus: f64) -> Result<Self> {
        const PERIOD_US: u64 = 10_000;
        let quota = (cpus * PERIOD_US as f64).round() as u64;
        let v1 = Path::new("/sys/fs/cgroup/cpu");
        let (base, v2) = if v1.join("cpu.cfs_quota_us").exists() {
            (v1.to_path_buf(), false)
        } else if std::fs::read_to_string("/sys/fs/cgroup/cgroup.subtree_control").is_ok_and(|c| c.split_whitespace().any(|x| x == "cpu")) {
            (PathBuf::from("/sys/fs/cgroup"), true)
        } else {
            bail!("invalid --cpus-per-worker: no writable cgroup cpu controller (cgroup v1 /sys/fs/cgroup/cpu or v2 with cpu in /sys/fs/cgroup/cgroup.subtree_control)");
        };
        let mut groups = QuotaGroups { dirs: Vec::with_capacity(world) };
        for rank in 0..world {
            let dir = base.join(format!("lazarus-{}-{rank}", std::process::id()));
            std::fs::create_dir_all(&dir).with_context(|| format!("--cpus-per-worker: cannot create cgroup {}", dir.display()))?;
            groups.dirs.push(dir.clone());
            let write = |file: &str, value: String| {
                std::fs::write(dir.join(file), &value)
                    .with_context(|| format!("--cpus-per-worker: cannot write {value:?} to {}", dir.join(file).display()))
            };
            if v2 {
                write("cpu.max", format!("{quota} {PERIOD_US}"))?;
            } else {
                write("cpu.cfs_period_us", PERIOD_US.to_string())?;
                write("cpu.cfs_quota_us", quota.to_string())?;
            }
        }
        Ok(groups)
    }
}

/// Start `world` copies of this binary's hidden `subcommand`, send each its [`WorkerSpec`], wait
/// for every rank's listening address and send all of them the list, each worker confined as
/// `confine` says. On any failure the started workers are killed. Keep the returned
/// [`QuotaGroups`] until the workers have exited.
pub fn launch<J: Serialize>(
    subcommand: &str,
    world: usize,
    timeout_s: f64,
    job: &J,
    confine: Confinement,
) -> Result<(Vec<Running>, Events, Option<QuotaGroups>)> {
    let exe = std::env::current_exe().context("locating the lazarus binary")?;
    let mut quota_groups = None;
    match confine {
        Confinement::Shared => {}
        Confinement::Cores(c) => {
            let have = allowed_cpus().len();
            if c == 0 || c * world > have {
                bail!("invalid --cores-per-worker: {c} x {world} workers needs {} cores, this process may use {have}", c * world);
            }
        }
        Confinement::CpuQuota(f) => {
            if !f.is_finite() || f < 0.01 {
                bail!("invalid --cpus-per-worker: {f} (expected a number of CPUs ≥ 0.01)");
            }
            quota_groups = Some(QuotaGroups::create(world, f)?);
        }
    }
    let epoch = std::time::SystemTime::now().duration_since(std::time::UNIX_EPOCH).map_or(1, |d| d.as_secs());
    let mut workers: Vec<Running> = Vec::with_capacity(world);
    let (tx, rx) = mpsc::channel::<(usize, Option<WorkerEvent>)>();
    let started = (|| -> Result<()> {
        for rank in 0..world {
            let mut cmd = Command::new(&exe);
            cmd.arg(subcommand).stdin(Stdio::piped()).stdout(Stdio::piped()).stderr(Stdio::inherit());
            match confine {
                Confinement::Shared => {}
                Confinement::Cores(c) => {
                    cmd.env("RAYON_NUM_THREADS", c.to_string());
                    pin(&mut cmd, allowed_cpus()[rank * c..(rank + 1) * c].to_vec());
                }
                Confinement::CpuQuota(f) => {
                    cmd.env("RAYON_NUM_THREADS", (f.ceil() as usize).max(1).to_string());
                    if let Some(g) = &quota_groups {
                        join_cgroup(&mut cmd, &g.dirs[rank].join("cgroup.procs"))?;
                    }
                }
            }
            let mut child = cmd.spawn().with_context(|| format!("starting worker {rank}"))?;
            let stdout = child.stdout.take().ok_or_else(|| anyhow!("worker {rank}: no stdout"))?;
            let mut stdin = child.stdin.take();
            workers.push(Running { rank, child, stdin: None });
            let tx = tx.clone();
            std::thread::spawn(move || {
                for line in BufReader::new(stdout).lines() {
                    let Ok(line) = line else { break };
                    match serde_json::from_str::<WorkerEvent>(&line) {
                        Ok(ev) => {
                            if tx.send((rank, Some(ev))).is_err() {
                                return;
                            }
                        }
                        Err(_) => eprintln!("worker {rank}: {line}"),
                    }
                }
                let _ = tx.send((rank, None));
            });
            let spec = WorkerSpec { rank, world, epoch, timeout_s, job };
            if let Some(s) = stdin.as_mut() {
                writeln!(s, "{}", serde_json::to_string(&spec)?).with_context(|| format!("writing to worker {rank}"))?;
            }
            workers[rank].stdin = stdin;
        }
        let mut addrs: Vec<Option<String>> = vec![None; world];
        let deadline = Instant::now() + Duration::from_secs(60);
        while addrs.iter().any(Option::is_none) {
            match rx.recv_timeout(deadline.saturating_duration_since(Instant::now())) {
                Ok((rank, Some(WorkerEvent::Listening { addr }))) => addrs[rank] = Some(addr),
                Ok((rank, Some(WorkerEvent::Failed { kind, message }))) => bail!("worker {rank}: {kind}: {message}"),
                Ok((rank, _)) => bail!("worker {rank} ended before it was listening"),
                Err(_) => bail!("workers did not all start listening within 60 s"),
            }
        }
        let line = serde_json::to_string(&Addrs { addrs: addrs.into_iter().flatten().collect() })?;
        for w in workers.iter_mut() {
            if let Some(s) = w.stdin.as_mut() {
                writeln!(s, "{line}").with_context(|| format!("writing to worker {}", w.rank))?;
            }
            w.stdin = None; // close: the worker reads nothing more
        }
        Ok(())
    })();
    if let Err(e) = started {
        for w in &mut workers {
            let _ = w.child.kill();
            let _ = w.child.wait();
        }
        return Err(e);
    }
    Ok((workers, rx, quota_groups))
}

/// Move the child into the cgroup whose `cgroup.procs` is `procs` before it runs any code.
fn join_cgroup(cmd: &mut Command, procs: &Path) -> Result<()> {
    #[cfg(target_os = "linux")]
    {
        use std::os::unix::ffi::OsStrExt;
        use std::os::unix::process::CommandExt;
        let path = std::ffi::CString::new(procs.as_os_str().as_bytes()).context("cgroup path")?;
        // SAFETY: between fork and exec the closure only calls open, write and close on a path
        // built before the fork — all async-signal-safe. Writing "0" moves the calling process.
        unsafe {
            cmd.pre_exec(move || {
                let fd = libc::open(path.as_ptr(), libc::O_WRONLY);
                if fd < 0 {
                    return Err(std::io::Error::last_os_error());
                }
                let ok = libc::write(fd, b"0".as_ptr().cast(), 1) == 1;
                let err = std::io::Error::last_os_error();
                libc::close(fd);
                if ok {
                    Ok(())
                } else {
                    Err(err)
                }
            });
        }
    }
    #[cfg(not(target_os = "linux"))]
    let _ = (cmd, procs);
    Ok(())
}

/// The CPU ids this process may run on, ascending (its affinity mask: a container or `taskset`
/// may allow CPUs 8–15 only); elsewhere than Linux, 0..available_parallelism.
pub fn allowed_cpus() -> Vec<usize> {
    #[cfg(target_os = "linux")]
    {
        // SAFETY: sched_getaffinity writes at most size_of::<cpu_set_t>() bytes into `set`.
        unsafe {
            let mut set: libc::cpu_set_t = std::mem::zeroed();
            if libc::sched_getaffinity(0, std::mem::size_of::<libc::cpu_set_t>(), &mut set) == 0 {
                let cpus: Vec<usize> = (0..libc::CPU_SETSIZE as usize).filter(|&c| libc::CPU_ISSET(c, &set)).collect();
                if !cpus.is_empty() {
                    return cpus;
                }
            }
        }
    }
    (0..std::thread::available_parallelism().map_or(1, |n| n.get())).collect()
}

/// Restrict the child to `cores` (Linux; elsewhere only the thread-pool size applies).
fn pin(cmd: &mut Command, cores: Vec<usize>) {
    #[cfg(target_os = "linux")]
    {
        use std::os::unix::process::CommandExt;
        // SAFETY: between fork and exec the closure only builds a CPU set on the stack and calls
        // sched_setaffinity, both async-signal-safe.
        unsafe {
            cmd.pre_exec(move || {
                let mut set: libc::cpu_set_t = std::mem::zeroed();
                for &c in &cores {
                    libc::CPU_SET(c, &mut set);
                }
                if libc::sched_setaffinity(0, std::mem::size_of::<libc::cpu_set_t>(), &set) != 0 {
                    return Err(std::io::Error::last_os_error());
                }
                Ok(())
            });
        }
    }
    #[cfg(not(target_os = "linux"))]
    let _ = (cmd, cores);
}

/// The launcher side of `lazarus train --workers N`.
pub fn run_train_workers(args: &TrainArgs) -> Result<()> {
    let world = args.workers.unwrap_or(1);
    if world == 0 || world > 64 {
        bail!("invalid --workers: {world} (expected 1 to 64)");
    }
    if !args.comm_timeout.is_finite() || args.comm_timeout <= 0.0 {
        bail!("invalid --comm-timeout: {} (expected seconds > 0)", args.comm_timeout);
    }
    let (mut trainer, resume) = if args.resume {
        let config = build_config(args)?;
        let Some(dir) = config.checkpoint_dir.clone() else {
            bail!("--resume needs --checkpoint-dir (or checkpoint_dir in --config)");
        };
        let t = Trainer::resume(&dir, args.steps).with_context(|| format!("resuming from {}", dir.display()))?;
        eprintln!("resuming from {} at step {}", dir.display(), t.step);
        (t, Some(dir))
    } else {
        (Trainer::new(build_config(args)?)?, None)
    };
    let cfg = trainer.config.clone();
    if trainer.done() {
        bail!("nothing to do: the run is at step {} of --steps {}", trainer.step, cfg.steps);
    }
    validate_worker_config(&cfg, world)?;
    let (moe_layers, experts) = (cfg.model.moe_layers(), cfg.model.n_experts);
    let plan = if args.static_ep {
        if args.placement_file.is_some() {
            bail!("--static-ep places experts itself; drop --placement-file");
        }
        ReplicaMap::static_ep(0, moe_layers, experts, world)?
    } else if let Some(path) = &args.placement_file {
        read_placement_file(path, world)?.replica_map()
    } else {
        if args.profile_steps == 0 {
            bail!("invalid --profile-steps: 0 (the measured-load plan needs at least 1; or give --placement-file)");
        }
        let slots = args.slots_per_worker.unwrap_or_else(|| (2 * experts).div_ceil(world).max(1));
        if slots * world < experts {
            bail!("invalid --slots-per-worker: {slots} x {world} workers < {experts} experts");
        }
        let guard = crate::planning::throughput_guard(args.max_imbalance)?;
        let loads = measure_loads(&mut trainer, args.profile_steps)?;
        let shape = ClusterShape::new(world, 1, slots)?;
        plan_model(&loads, shape, &PlanPolicy::trainer(world, guard), None)?.replica_map()
    };
    let mode = if args.static_ep { DispatchMode::StaticPadded } else { DispatchMode::Balanced };
    check_plan(&plan, moe_layers, experts, world, mode).context("--placement-file")?;
    print_banner(&trainer, &format!("{world} workers, {}", if args.static_ep { "static expert parallelism" } else { "lazarus dispatch" }));
    for (l, layer) in plan.layers().iter().enumerate() {
        let per_worker: Vec<String> = (0..world)
            .map(|r| {
                let held: Vec<String> = layer
                    .iter()
                    .enumerate()
                    .filter(|(_, row)| row[r] > 0)
                    .map(|(e, row)| if row[r] > 1 { format!("{e}x{}", row[r]) } else { e.to_string() })
                    .collect();
                format!("w{r}[{}]", held.join(","))
            })
            .collect();
        eprintln!("placement L{l}: {}", per_worker.join(" "));
    }

    let job = TrainJob { config: cfg.clone(), plan, static_ep: args.static_ep, resume };
    let (mut workers, rx, _quota) = launch("worker", world, args.comm_timeout, &job, Confinement::Shared)?;
    let result = supervise(&mut workers, &rx, args, &cfg, trainer.step, trainer.unigram_entropy());
    if result.is_err() {
        // Nothing may outlive a failed run.
        for w in &mut workers {
            let _ = w.child.kill();
        }
    }
    for w in &mut workers {
        let _ = w.child.wait();
    }
    result
}

/// Drive the rendezvous, relay progress, and on the first failure wait (bounded) for the
/// survivors to notice and report how they stopped.
fn supervise(
    workers: &mut [Running],
    rx: &Events,
    args: &TrainArgs,
    cfg: &TrainConfig,
    first_step: u64,
    unigram_entropy: f64,
) -> Result<()> {
    let world = workers.len();
    let start_deadline = Duration::from_secs_f64(args.comm_timeout.max(10.0) + 60.0);
    let mut finished: Vec<Option<Result<Option<PathBuf>, String>>> = (0..world).map(|_| None).collect();
    let mut ready = 0;
    let mut reporter: Option<Reporter> = None;
    // Rank 0 may report steps before every other rank's `ready` has been read.
    let mut early: Vec<(StepReport, f64)> = Vec::new();
    let mut failed_at: Option<Instant> = None;
    let mut first_failure: Option<String> = None;
    loop {
        if finished.iter().all(Option::is_some) {
            break;
        }
        let wait = match failed_at {
            // Survivors get the collective deadline plus a margin to notice on their own.
            Some(t) => (Duration::from_secs_f64(args.comm_timeout + 5.0)).saturating_sub(t.elapsed()),
            None => start_deadline,
        };
        let (rank, event) = match rx.recv_timeout(wait) {
            Ok(x) => x,
            Err(_) if failed_at.is_some() => break,
            Err(_) if ready < world => bail!("workers did not all start within {} s", start_deadline.as_secs()),
            Err(_) => continue,
        };
        match event {
            Some(WorkerEvent::Ready { pid }) => {
                eprintln!("worker {rank}: pid {pid} ready");
                ready += 1;
                if ready == world {
                    let mut r = Reporter::new(args, cfg, first_step)?;
                    for (report, seconds) in early.drain(..) {
                        r.step(&report, seconds)?;
                    }
                    reporter = Some(r);
                }
            }
            Some(WorkerEvent::Step { report, seconds, .. }) => match reporter.as_mut() {
                Some(r) => r.step(&report, seconds)?,
                None => early.push((report, seconds)),
            },
            Some(WorkerEvent::Done { checkpoint }) => finished[rank] = Some(Ok(checkpoint)),
            Some(WorkerEvent::Listening { .. } | WorkerEvent::BenchResults { .. }) => {}
            Some(WorkerEvent::Failed { kind, message }) => {
                if let Some(r) = &reporter {
                    r.pause();
                }
                let since = failed_at.map(|t| format!(" ({} ms after the first failure)", t.elapsed().as_millis())).unwrap_or_default();
                eprintln!("worker {rank}: stopped: {kind}: {message}{since}");
                first_failure.get_or_insert_with(|| format!("worker {rank}: {kind}: {message}"));
                failed_at.get_or_insert_with(Instant::now);
                finished[rank] = Some(Err(kind));
            }
            None => {
                // Stdout closed: the process ended. Without a final event it was killed or crashed.
                if finished[rank].is_none() {
                    if let Some(r) = &reporter {
                        r.pause();
                    }
                    let status = workers[rank].child.wait().map(|s| describe_exit(&s)).unwrap_or_else(|e| e.to_string());
                    eprintln!("worker {rank}: died ({status})");
                    first_failure.get_or_insert_with(|| format!("worker {rank} died ({status})"));
                    failed_at.get_or_insert_with(Instant::now);
                    finished[rank] = Some(Err("died".into()));
                }
            }
        }
    }
    if let Some(f) = first_failure {
        let stopped: Vec<String> = finished
            .iter()
            .enumerate()
            .map(|(r, f)| match f {
                Some(Ok(_)) => format!("{r}: finished"),
                Some(Err(k)) => format!("{r}: {k}"),
                None => format!("{r}: no answer (killed)"),
            })
            .collect();
        bail!("training stopped: {f}; workers {}", stopped.join(", "));
    }
    let checkpoint = finished.first().and_then(|f| f.as_ref()).and_then(|f| f.as_ref().ok()).cloned().flatten();
    match &reporter {
        Some(r) => r.finish(cfg.steps, unigram_entropy, checkpoint.as_deref()),
        None => bail!("the workers finished without starting"),
    }
    Ok(())
}

fn describe_exit(status: &std::process::ExitStatus) -> String {
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
