//! The worker side of a launch: the hidden `lazarus worker` and `lazarus bench-worker`
//! subcommands. A worker reads its spec, joins its peers, reports on stdout and stops when the
//! launcher goes away.
//!
//! Reports leave through an [`EventSink`]: a writer thread owns stdout and the training thread
//! only queues. Step reports are dropped (and counted) when the queue is full, so a launcher
//! that stops reading — paused, or busy — never blocks a step; everything else waits for room.

use std::io::{BufRead, BufReader, Read, Write};
use std::net::{SocketAddr, TcpListener};
use std::path::PathBuf;
use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::mpsc::{self, Sender};
use std::sync::{Arc, Mutex};
use std::thread::JoinHandle;
use std::time::{Duration, Instant};

use lazarus_comm::{Group, Rendezvous, TcpTransport};
use lazarus_runtime::bench::{run_moe_layer_bench, MoeLayerBenchSpec};
use lazarus_runtime::{DispatchMode, Worker, WorkerOptions};
use serde::de::DeserializeOwned;

use crate::error::ControlError;
use crate::protocol::{Addrs, FailureKind, TrainJob, WorkerEvent, WorkerSpec};

/// Reports queued while the launcher is not reading: 64 Ki (a few MB of step reports, hours of
/// fast steps) before step reports are dropped.
const QUEUE: usize = 1 << 16;
/// Longest line the launcher may send (a spec holds the whole training configuration).
const MAX_LINE: u64 = 64 << 20;

/// Reports to the launcher, never blocking a step on a slow reader.
pub struct EventSink {
    tx: Option<Sender<WorkerEvent>>,
    writer: Option<JoinHandle<()>>,
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
        EventSink { tx: Some(tx), writer, queued, dropped: Mutex::new(0) }
    }

    /// A report that must arrive (a handful per run: listening, ready, done or failed).
    pub fn send(&self, ev: WorkerEvent) {
        if let Some(tx) = &self.tx {
            self.queued.fetch_add(1, Ordering::Relaxed);
            let _ = tx.send(ev);
        }
    }

    /// A step report: dropped, and counted in the next one, when [`QUEUE`] reports wait unread.
    pub fn step(&self, report: lazarus_model::StepReport, seconds: f64, wire_bytes: u64) {
        let Some(tx) = &self.tx else { return };
        let mut dropped = self.dropped.lock().unwrap_or_else(|e| e.into_inner());
        if self.queued.load(Ordering::Relaxed) >= QUEUE {
            *dropped += 1;
            return;
        }
        self.queued.fetch_add(1, Ordering::Relaxed);
        if tx.send(WorkerEvent::Step { report, seconds, wire_bytes, dropped: *dropped }).is_ok() {
            *dropped = 0;
        }
    }

    /// Let everything queued go out (waits for the writer).
    pub fn finish(mut self) {
        self.tx = None;
        if let Some(w) = self.writer.take() {
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
    serde_json::from_str(line.trim()).map_err(|e| ControlError::invalid("worker spec", format!("bad {what} from the launcher: {e}")))
}

/// The child side of a launch: read the spec, listen, tell the launcher, learn every rank's
/// address, connect to all of them; from then on, stdin closing means the launcher is gone and
/// this process exits.
fn join<J: DeserializeOwned>(sink: &EventSink) -> Result<(WorkerSpec<J>, TcpTransport), ControlError> {
    let mut stdin = BufReader::new(std::io::stdin());
    let spec: WorkerSpec<J> = read_line(&mut stdin, "worker spec")?;
    if spec.rank >= spec.world || !spec.timeout_s.is_finite() || spec.timeout_s <= 0.0 || spec.timeout_s > 1e6 {
        return Err(ControlError::invalid("worker spec", format!("rank {} of {}, timeout {} s", spec.rank, spec.world, spec.timeout_s)));
    }
    let listener = TcpListener::bind("127.0.0.1:0").map_err(|e| ControlError::io("binding a loopback port", e))?;
    let addr = listener.local_addr().map_err(|e| ControlError::io("reading the bound address", e))?;
    sink.send(WorkerEvent::Listening { addr: addr.to_string() });
    let addrs: Addrs = read_line(&mut stdin, "address list")?;
    if addrs.addrs.len() != spec.world {
        return Err(ControlError::invalid("address list", format!("{} addresses for a world of {}", addrs.addrs.len(), spec.world)));
    }
    let addrs: Vec<SocketAddr> = addrs
        .addrs
        .iter()
        .map(|a| a.parse().map_err(|_| ControlError::invalid("address list", format!("invalid peer address {a:?}"))))
        .collect::<Result<_, _>>()?;
    let rank = spec.rank;
    std::thread::Builder::new()
        .name("lazarus-launcher-watch".into())
        .spawn(move || {
            let mut rest = Vec::new();
            let _ = stdin.read_to_end(&mut rest);
            tracing::error!("worker {rank}: the launcher is gone (its pipe closed); stopping");
            std::process::exit(3);
        })
        .map_err(|e| ControlError::io("starting the launcher watch", e))?;
    let timeout = Duration::from_secs_f64(spec.timeout_s);
    let t = TcpTransport::connect(listener, Rendezvous { rank: spec.rank, addrs, epoch: spec.epoch, timeout })
        .map_err(|e| ControlError::Runtime(e.into()))?;
    Ok((spec, t))
}

/// The kind of failure a worker reports for `e`.
fn failure_kind(e: &ControlError) -> FailureKind {
    match e {
        ControlError::Runtime(r) => FailureKind::of_runtime(r),
        ControlError::Invalid { .. } | ControlError::Plan(_) | ControlError::Model(_) | ControlError::Json(_) => FailureKind::Config,
        _ => FailureKind::Error,
    }
}

/// Report how the worker ended and return its exit code (0: done).
fn finish(sink: EventSink, result: Result<WorkerEvent, ControlError>) -> i32 {
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
    let sink = EventSink::start();
    let result = train_worker(&sink).map(|checkpoint| WorkerEvent::Done { checkpoint });
    finish(sink, result)
}

fn train_worker(sink: &EventSink) -> Result<Option<PathBuf>, ControlError> {
    let (spec, mut t): (WorkerSpec<TrainJob>, _) = join(sink)?;
    let timeout = Duration::from_secs_f64(spec.timeout_s);
    let mut group = Group::world(spec.world);
    let job = spec.job;
    let mode = if job.static_ep { DispatchMode::StaticPadded } else { DispatchMode::Balanced };
    let options = WorkerOptions { plan: job.plan, mode, timeout };
    let mut worker = Worker::new(job.config.clone(), options, spec.rank, spec.world, job.resume.as_deref())?;
    sink.send(WorkerEvent::Ready { pid: std::process::id() });
    let cfg = job.config;
    while !worker.done() {
        let t0 = Instant::now();
        let r = worker.step(&mut t, &mut group)?;
        if spec.rank == 0 {
            sink.step(r.report.clone(), t0.elapsed().as_secs_f64(), r.wire_bytes);
        }
        if let Some(dir) = &cfg.checkpoint_dir {
            if cfg.checkpoint_every > 0 && r.report.step.is_multiple_of(cfg.checkpoint_every) && !worker.done() {
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

/// The hidden `lazarus bench-worker` subcommand: one rank of `bench moe-layer`.
pub fn run_bench_worker() -> i32 {
    let sink = EventSink::start();
    let result = (|| {
        let (spec, mut t): (WorkerSpec<MoeLayerBenchSpec>, _) = join(&sink)?;
        sink.send(WorkerEvent::Ready { pid: std::process::id() });
        let results = run_moe_layer_bench(&mut t, &mut Group::world(spec.world), &spec.job)?;
        t.shutdown();
        Ok(if spec.rank == 0 { WorkerEvent::BenchResults { results } } else { WorkerEvent::Done { checkpoint: None } })
    })();
    finish(sink, result)
}
