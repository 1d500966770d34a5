//! The worker side of a launch: the hidden `lazarus worker` and `lazarus bench-worker`
//! subcommands. A worker reads its spec, joins its peers, reports on stdout and stops when the
//! launcher goes away.
//!
//! Reports leave through an [`EventSink`]: a writer thread owns stdout and the training thread
//! only queues. Step reports are dropped (and counted) when the queue is full, so a launcher
//! that stops reading — paused, or busy — never blocks a step; everything else waits for room.

use std::io::{BufRead, BufReader, Read, Write};
use std::net::{IpAddr, SocketAddr, TcpListener};
use std::sync::atomic::{AtomicBool, AtomicUsize, Ordering};
use std::sync::mpsc::{self, Receiver, Sender};
use std::sync::{Arc, Mutex};
use std::thread::JoinHandle;
use std::time::{Duration, Instant};

use lazarus_comm::{Fence, Rendezvous, TcpTransport};
use lazarus_runtime::{pause_signal, FaultHook, FaultPoint, PauseSignal};
use serde::de::DeserializeOwned;

use lazarus_protocol::{
    heartbeat_within, lease_without_recovery, parse_secret, ControlError, FailureKind, LauncherMessage, WorkerEvent, WorkerSpec,
};

mod step_profile;
mod train;

use train::train_worker;

/// Reports queued while the launcher is not reading: 64 Ki (a few MB of step reports, hours of
/// fast steps) before step reports are dropped.
const QUEUE: usize = 1 << 16;
/// Longest line the launcher may send (a spec holds the whole training configuration).
const MAX_LINE: u64 = 64 << 20;

/// Reports to the launcher, never blocking a step on a slow reader. Shared by the training
/// thread and the heartbeat thread.
pub struct EventSink {
    tx: Mutex<Option<Sender<WorkerEvent>>>,
    writer: Mutex<Option<JoinHandle<()>>>,
    /// Reports queued and not yet written (the writer counts them down).
    queued: Arc<AtomicUsize>,
    /// Step reports dropped since the last one that went out.
    dropped: Mutex<u64>,
}

impl EventSink {
    /// A writer thread that owns stdout. (The queue grows as it fills: nothing is reserved.)
    pub fn start() -> Self {
        let (tx, rx) = mpsc::channel::<WorkerEvent>();
        let queued = Arc::new(AtomicUsize::new(0));
        let count = queued.clone();
        let writer = std::thread::Builder::new()
            .name("lazarus-events".into())
            .spawn(move || {
                let mut out = std::io::stdout().lock();
                for ev in rx {
                    // A launcher that went away cannot be told anything; the worker stops when
                    // its stdin closes.
                    let _ = serde_json::to_writer(&mut out, &ev);
                    let _ = out.write_all(b"\n");
                    let _ = out.flush();
                    count.fetch_sub(1, Ordering::Relaxed);
                }
            })
            .ok();
        EventSink { tx: Mutex::new(Some(tx)), writer: Mutex::new(writer), queued, dropped: Mutex::new(0) }
    }

    /// A report that must arrive (listening, ready, heartbeats, a failed step, done).
    pub fn send(&self, ev: WorkerEvent) {
        if let Some(tx) = self.tx.lock().unwrap_or_else(|e| e.into_inner()).as_ref() {
            self.queued.fetch_add(1, Ordering::Relaxed);
            let _ = tx.send(ev);
        }
    }

    /// A step report: dropped, and counted in the next one, when [`QUEUE`] reports wait unread.
    pub fn step(
        &self,
        report: lazarus_model::StepReport,
        seconds: f64,
        wire_bytes: u64,
        snapshot: Option<lazarus_runtime::SnapshotStepStats>,
    ) {
        let tx = self.tx.lock().unwrap_or_else(|e| e.into_inner());
        let Some(tx) = tx.as_ref() else { return };
        let mut dropped = self.dropped.lock().unwrap_or_else(|e| e.into_inner());
        if self.queued.load(Ordering::Relaxed) >= QUEUE {
            *dropped += 1;
            return;
        }
        self.queued.fetch_add(1, Ordering::Relaxed);
        if tx.send(WorkerEvent::Step { report, seconds, wire_bytes, dropped: *dropped, snapshot }).is_ok() {
            *dropped = 0;
        }
    }

    /// Let everything queued go out (waits for the writer); nothing is sent after.
    pub fn finish(&self) {
        self.tx.lock().unwrap_or_else(|e| e.into_inner()).take();
        if let Some(w) = self.writer.lock().unwrap_or_else(|e| e.into_inner()).take() {
            let _ = w.join();
        }
    }
}

fn read_line<T: DeserializeOwned>(input: &mut impl BufRead, what: &str) -> Result<T, ControlError> {
    let mut line = String::new();
    let n = input.take(MAX_LINE).read_line(&mut line).map_err(|e| ControlError::io(format!("reading the {what} from the launcher"), e))?;
    if n == 0 {
        return Err(ControlError::Launch(format!("the launcher closed stdin before sending the {what}")));
    }
    serde_json::from_str(line.trim()).map_err(|e| ControlError::bad_message("worker spec", format!("bad {what} from the launcher: {e}")))
}

/// What the launcher says after the spec, read on a thread of its own: stdin closing means the
/// launcher is gone, and this process exits at once. An [`LauncherMessage::Abandon`] also calls
/// off a rendezvous of its epoch that is connecting right now.
/// The rendezvous being connected, if any: its epoch and the flag that calls it off.
type Connecting = Arc<Mutex<Option<(u64, Arc<AtomicBool>)>>>;

struct Inbox {
    rx: Receiver<LauncherMessage>,
    /// The rendezvous in progress: its epoch and the flag that calls it off.
    connecting: Connecting,
    /// What cuts the current transport's connections to ranks the controller gave up.
    fence: Arc<Mutex<Option<Fence>>>,
    /// Set to the epoch at which the controller asks this worker to pause between steps.
    pause: PauseSignal,
    /// The pause is the end: write the final checkpoint and finish ([`LauncherMessage::Finish`]).
    finish: Arc<AtomicBool>,
}

impl Inbox {
    fn start(mut stdin: BufReader<std::io::Stdin>, rank: usize) -> Result<Self, ControlError> {
        let (tx, rx) = mpsc::channel();
        let connecting: Connecting = Arc::new(Mutex::new(None));
        let calls = connecting.clone();
        let fence: Arc<Mutex<Option<Fence>>> = Arc::new(Mutex::new(None));
        let fences = fence.clone();
        let pause = pause_signal();
        let pauses = pause.clone();
        let finish = Arc::new(AtomicBool::new(false));
        let finishing = finish.clone();
        std::thread::Builder::new()
            .name("lazarus-launcher-watch".into())
            .spawn(move || loop {
                match read_line::<LauncherMessage>(&mut stdin, "launcher message") {
                    Ok(LauncherMessage::Fence { epoch, ranks }) => {
                        // Handled here, at once: the training thread may be blocked on them.
                        if let Some(f) = fences.lock().unwrap_or_else(|e| e.into_inner()).as_ref().filter(|f| f.epoch() == epoch) {
                            for r in ranks {
                                f.cut(r);
                            }
                        }
                    }
                    Ok(LauncherMessage::Pause { epoch }) => {
                        // Read by the training thread at its next gradient all-reduce.
                        pauses.store(epoch, Ordering::Relaxed);
                    }
                    Ok(LauncherMessage::Finish { epoch }) => {
                        finishing.store(true, Ordering::Relaxed);
                        pauses.store(epoch, Ordering::Relaxed);
                    }
                    Ok(m) => {
                        if let LauncherMessage::Abandon { epoch } = &m {
                            if let Some((e, flag)) = calls.lock().unwrap_or_else(|e| e.into_inner()).as_ref() {
                                if e == epoch {
                                    flag.store(true, Ordering::Relaxed);
                                }
                            }
                        }
                        if tx.send(m).is_err() {
                            return;
                        }
                    }
                    Err(ControlError::Launch(_)) => {
                        tracing::error!("worker {rank}: the launcher is gone (its pipe closed); stopping");
                        std::process::exit(3);
                    }
                    Err(e) => tracing::warn!("worker {rank}: {e}"),
                }
            })
            .map_err(|e| ControlError::io("starting the launcher watch", e))?;
        Ok(Inbox { rx, connecting, fence, pause, finish })
    }

    /// The next message, waiting at most `timeout`.
    fn next(&self, timeout: Duration) -> Result<LauncherMessage, ControlError> {
        self.rx.recv_timeout(timeout).map_err(|_| ControlError::Launch(format!("no word from the launcher within {} s", timeout.as_secs())))
    }
}

/// The error of a rendezvous that was called off: a peer's, so recoverable.
fn called_off(epoch: u64) -> ControlError {
    ControlError::Runtime(lazarus_runtime::RuntimeError::Comm(lazarus_comm::CommError::Rendezvous(format!(
        "the rendezvous of epoch {epoch} was called off (a rank of it was lost)"
    ))))
}

/// What every rendezvous of a job shares: the collective deadline, the job's secret, and the
/// address to listen on.
#[derive(Clone, Copy)]
struct Net {
    timeout: Duration,
    secret: u128,
    bind: IpAddr,
    encrypt: bool,
    /// How long every rendezvous holds between learning its peers' addresses and connecting
    /// (`LAZARUS_FAULT=listen:MS`: tests, whose strangers find the ports open; zero otherwise).
    hold: Duration,
}

/// The hold `LAZARUS_FAULT=listen:MS` asks of every rendezvous (at most 10 s), or zero.
fn listen_hold() -> Duration {
    let spec = std::env::var("LAZARUS_FAULT").unwrap_or_default();
    let ms = spec.split(',').find_map(|item| item.strip_prefix("listen:")?.parse::<u64>().ok()).unwrap_or(0);
    Duration::from_millis(ms.min(10_000))
}

/// Bind, say where, wait for every rank's address at `epoch`, connect to all of them (with the
/// job's secret). An [`LauncherMessage::Abandon`] of the epoch ends it at any point.
fn rendezvous(sink: &EventSink, inbox: &Inbox, rank: usize, world: usize, epoch: u64, net: Net) -> Result<TcpTransport, ControlError> {
    let Net { timeout, secret, bind, encrypt, hold } = net;
    let cancel = Arc::new(AtomicBool::new(false));
    *inbox.connecting.lock().unwrap_or_else(|e| e.into_inner()) = Some((epoch, cancel.clone()));
    let result = (|| {
        let listener = TcpListener::bind((bind, 0)).map_err(|e| ControlError::io(format!("binding a port on {bind}"), e))?;
        let addr = listener.local_addr().map_err(|e| ControlError::io("reading the bound address", e))?;
        sink.send(WorkerEvent::Listening { addr: addr.to_string(), epoch });
        let addrs = loop {
            match inbox.next(timeout + Duration::from_secs(60))? {
                LauncherMessage::Addrs { epoch: e, addrs } if e == epoch => break addrs,
                LauncherMessage::Addrs { .. } => continue, // another epoch's: stale
                LauncherMessage::Abandon { epoch: e } if e == epoch => return Err(called_off(epoch)),
                LauncherMessage::Abandon { .. } | LauncherMessage::Pause { .. } | LauncherMessage::Finish { .. } => continue,
                other => {
                    return Err(ControlError::bad_message("launcher message", format!("{other:?} during the rendezvous of epoch {epoch}")))
                }
            }
        };
        if addrs.len() != world {
            return Err(ControlError::bad_message("address list", format!("{} addresses for a world of {world}", addrs.len())));
        }
        let addrs: Vec<SocketAddr> = addrs
            .iter()
            .map(|a| a.parse().map_err(|_| ControlError::bad_message("address list", format!("invalid peer address {a:?}"))))
            .collect::<Result<_, _>>()?;
        std::thread::sleep(hold);
        let r = Rendezvous { rank, addrs, epoch, timeout, secret, cancel: Some(cancel.clone()), encrypt };
        let t = TcpTransport::connect(listener, r).map_err(|e| ControlError::Runtime(e.into()))?;
        *inbox.fence.lock().unwrap_or_else(|e| e.into_inner()) = Some(t.fence());
        Ok(t)
    })();
    *inbox.connecting.lock().unwrap_or_else(|e| e.into_inner()) = None;
    result
}

/// The child side of a launch: read the spec, start listening to the launcher, rendezvous at the
/// spec's epoch.
fn join<J: DeserializeOwned>(
    sink: &EventSink,
    on_spec: impl FnOnce(&WorkerSpec<J>),
) -> Result<(WorkerSpec<J>, Inbox, TcpTransport), ControlError> {
    let (spec, inbox, t) = join_unless(sink, on_spec, |_| false)?;
    let t = t.ok_or_else(|| ControlError::Launch("no rendezvous".into()))?;
    Ok((spec, inbox, t))
}

/// [`join`], without the rendezvous when `standing_by(spec)`.
fn join_unless<J: DeserializeOwned>(
    sink: &EventSink,
    on_spec: impl FnOnce(&WorkerSpec<J>),
    standing_by: impl FnOnce(&WorkerSpec<J>) -> bool,
) -> Result<(WorkerSpec<J>, Inbox, Option<TcpTransport>), ControlError> {
    let mut stdin = BufReader::new(std::io::stdin());
    let spec: WorkerSpec<J> = read_line(&mut stdin, "worker spec")?;
    on_spec(&spec);
    if spec.rank >= spec.world || !spec.timeout_s.is_finite() || spec.timeout_s <= 0.0 || spec.timeout_s > 1e6 {
        return Err(ControlError::bad_message(
            "worker spec",
            format!("rank {} of {}, timeout {} s", spec.rank, spec.world, spec.timeout_s),
        ));
    }
    let secret =
        parse_secret(&spec.secret).ok_or_else(|| ControlError::bad_message("worker spec", "the job secret is not 32 hex digits"))?;
    let bind = bind_ip(spec.bind.as_deref())?;
    let inbox = Inbox::start(stdin, spec.rank)?;
    if standing_by(&spec) {
        return Ok((spec, inbox, None));
    }
    let t = rendezvous(
        sink,
        &inbox,
        spec.rank,
        spec.world,
        spec.epoch,
        Net { timeout: Duration::from_secs_f64(spec.timeout_s), secret, bind, encrypt: spec.encrypt, hold: listen_hold() },
    )?;
    Ok((spec, inbox, Some(t)))
}

/// The address a worker listens on for its peers: its spec's, or loopback.
fn bind_ip(bind: Option<&str>) -> Result<IpAddr, ControlError> {
    match bind {
        None => Ok(IpAddr::from([127, 0, 0, 1])),
        Some(b) => b.parse().map_err(|_| ControlError::bad_message("worker spec", format!("bind address {b:?} is not an IP address"))),
    }
}

/// The kind of failure a worker reports for `e`.
fn failure_kind(e: &ControlError) -> FailureKind {
    match e {
        ControlError::Runtime(r) => FailureKind::of_runtime(r),
        ControlError::Invalid { .. }
        | ControlError::BadMessage { .. }
        | ControlError::Plan(_)
        | ControlError::Model(_)
        | ControlError::Json(_) => FailureKind::Config,
        _ => FailureKind::Error,
    }
}

/// Whether a failed step or move can be recovered from: its cause is another rank (lost, late
/// or out of step), not this one.
fn recoverable(e: &ControlError) -> bool {
    matches!(e, ControlError::Runtime(r) if matches!(FailureKind::of_runtime(r), FailureKind::PeerLost | FailureKind::Timeout | FailureKind::Comm))
}

/// Report how the worker ended and return its exit code (0: done).
fn finish(sink: &EventSink, result: Result<WorkerEvent, ControlError>) -> i32 {
    let code = match result {
        Ok(ev) => {
            sink.send(ev);
            0
        }
        Err(e) => {
            sink.send(WorkerEvent::Failed { kind: failure_kind(&e), message: e.to_string() });
            1
        }
    };
    sink.finish();
    code
}

/// The hidden `lazarus worker` subcommand: one rank of `train --workers N`. Returns the exit
/// code; its errors go to the launcher as a `failed` report.
pub fn run_train_worker() -> i32 {
    // SIGINT (a Ctrl-C reaches the whole process group) and SIGTERM are the launcher's to
    // handle: it asks every rank to finish after the same step with a checkpoint. A worker
    // still ends with its launcher (its pipe closes) or by SIGKILL.
    // SAFETY: setting two dispositions before any thread of this process exists.
    unsafe {
        libc::signal(libc::SIGINT, libc::SIG_IGN);
        libc::signal(libc::SIGTERM, libc::SIG_IGN);
    }
    let sink = Arc::new(EventSink::start());
    let result = train_worker(&sink);
    finish(&sink, result)
}

/// Heartbeats to the launcher every `every`, from a thread of their own: a worker stopped or
/// hung (SIGSTOP) falls silent and is found out within its lease.
fn start_heartbeats(sink: &Arc<EventSink>, every: Duration) {
    let sink = sink.clone();
    let _ = std::thread::Builder::new().name("lazarus-heartbeat".into()).spawn(move || loop {
        std::thread::sleep(every);
        sink.send(WorkerEvent::Heartbeat);
    });
}

/// The fault-injection hook `LAZARUS_FAULT` asks for on this worker (original rank `rank`):
/// `RANK:PHASE:STEP[,…]` with PHASE one of `forward`, `all_reduce`, `vote` (a step's phases, at
/// step STEP), `transfer` or `rendezvous` (the state transfers, or the rendezvous, of a move at
/// STEP committed steps), `snapshot` (after committing step STEP, before sending its
/// snapshots). The worker kills itself with SIGKILL there — a real death at a chosen phase, for tests.
/// `pace:MS` makes every step of every worker take at least MS milliseconds (at most 10,000): a
/// fast machine then runs a test's job at a slow one's pace. (`listen:MS` holds every
/// rendezvous: [`listen_hold`].)
fn fault_hook(rank: usize, from_job: &str) -> Result<Option<FaultHook>, ControlError> {
    let spec = match from_job {
        "" => match std::env::var("LAZARUS_FAULT") {
            Ok(s) => s,
            Err(_) => return Ok(None),
        },
        s => s.to_string(),
    };
    let mut mine: Vec<(FaultPoint, u64)> = Vec::new();
    let mut pace: Option<Duration> = None;
    for item in spec.split(',').filter(|s| !s.is_empty()) {
        let bad = || {
            ControlError::bad_message(
                "LAZARUS_FAULT",
                format!(
                    "{item:?} (expected RANK:PHASE:STEP, PHASE forward|all_reduce|vote|transfer|rendezvous|snapshot, pace:MS or listen:MS up to 10000)"
                ),
            )
        };
        let parts: Vec<&str> = item.split(':').collect();
        if let ["listen", ms] = parts[..] {
            ms.parse::<u64>().ok().filter(|&m| m <= 10_000).ok_or_else(bad)?;
            continue;
        }
        if let ["pace", ms] = parts[..] {
            let ms: u64 = ms.parse().ok().filter(|&m| m <= 10_000).ok_or_else(bad)?;
            pace = Some(Duration::from_millis(ms));
            continue;
        }
        let [r, phase, step] = parts[..] else { return Err(bad()) };
        let point = match phase {
            "forward" => FaultPoint::Forward,
            "all_reduce" => FaultPoint::AllReduce,
            "vote" => FaultPoint::Vote,
            "transfer" => FaultPoint::Transfer,
            "rendezvous" => FaultPoint::Rendezvous,
            "snapshot" => FaultPoint::Snapshot,
            _ => return Err(bad()),
        };
        let (r, step): (usize, u64) = (r.parse().map_err(|_| bad())?, step.parse().map_err(|_| bad())?);
        if r == rank {
            mine.push((point, step));
        }
    }
    if mine.is_empty() && pace.is_none() {
        return Ok(None);
    }
    let last_forward: Mutex<Option<Instant>> = Mutex::new(None);
    Ok(Some(Arc::new(move |point: FaultPoint, step: u64| {
        if let (Some(pace), FaultPoint::Forward) = (pace, point) {
            let mut last = last_forward.lock().unwrap_or_else(|e| e.into_inner());
            if let Some(t) = *last {
                std::thread::sleep(pace.saturating_sub(t.elapsed()));
            }
            *last = Some(Instant::now());
        }
        if mine.contains(&(point, step)) {
            tracing::warn!("worker {rank}: LAZARUS_FAULT: killing this worker at {point:?} of step {step}");
            // SAFETY: a signal to this very process.
            unsafe {
                libc::kill(libc::getpid(), libc::SIGKILL);
            }
        }
    })))
}

/// One rank of a job started by [`crate::run_local_job`] (a benchmark's hidden subcommand):
/// its spec, heartbeats as a job without recovery has them (a hung rank is found out), the
/// rendezvous, then `work` on the connected transport. Rank 0's value, if any, goes back as the
/// job's results. Returns the process's exit code.
pub fn run_rank<J: DeserializeOwned>(
    work: impl FnOnce(&WorkerSpec<J>, &mut TcpTransport) -> Result<Option<serde_json::Value>, ControlError>,
) -> i32 {
    let sink = Arc::new(EventSink::start());
    let result = (|| {
        let beat = |spec: &WorkerSpec<J>| start_heartbeats(&sink, heartbeat_within(lease_without_recovery(spec.timeout_s)));
        let (spec, _inbox, mut t): (WorkerSpec<J>, _, _) = join(&sink, beat)?;
        sink.send(WorkerEvent::Ready { pid: std::process::id(), epoch: spec.epoch, moved: None });
        let results = work(&spec, &mut t)?;
        t.shutdown();
        Ok(match results {
            Some(results) if spec.rank == 0 => WorkerEvent::Results { results },
            _ => WorkerEvent::Done { checkpoint: None },
        })
    })();
    finish(&sink, result)
}
