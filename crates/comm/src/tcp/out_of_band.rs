//! The out-of-band sender: two threads of the transport that copy and write snapshot frames
//! ([`crate::tags::is_out_of_band`]) while the caller goes on with the next step. A snapshot
//! budget is what the link carries in one step time (MoEtion §4), so written from the training
//! thread it would hold that thread for up to a step; here it overlaps the step's compute, as
//! the snapshot tier asks.
//!
//! * The copy thread runs each frame's [`Encode`] — the copy of an expert's weights and moments
//!   into a frame buffer — so that copy leaves the training thread too. It never waits on a
//!   socket: a caller that must not change what a queued frame reads until it is copied (the
//!   optimizer's next update) waits for copies only, never for a slow peer.
//! * The write thread writes the copied frames in order. Each connection has one write lock,
//!   taken by whoever writes a frame on it — this thread or the transport's own calls — so
//!   frames never interleave. An ordered frame waits behind at most the one snapshot frame being
//!   written.
//! * What the snapshot tier's default budget paces itself by is measured here: how many frames
//!   are still waiting ([`OutOfBandSender::backlog`]: did the last round make it onto the wire
//!   in a step?) and the CPU time these threads (and the readers, for the frames they read)
//!   spent on them (a [`CpuMeter`]). The threads run at the normal priority: in the idle
//!   scheduling class they did not measurably cost the step less, and a host kept busy by other
//!   processes (a data loader) could starve them past the receiver's deadline.

use std::io::Write;
use std::net::{Shutdown, TcpStream};
use std::sync::atomic::{AtomicBool, AtomicUsize, Ordering};
use std::sync::mpsc::{self, Receiver, Sender};
use std::sync::{Arc, Mutex, MutexGuard, TryLockError};
use std::time::{Duration, Instant};

use super::buffers::BufferPool;
use super::{write_header, HEADER, MAGIC, MAX_FRAME};
use crate::cpu_time::CpuMeter;

/// Writes an out-of-band frame's payload into the (empty) buffer it is given, on the
/// transport's copy thread; an error drops the frame and closes its connection.
pub type Encode = Box<dyn FnOnce(&mut Vec<u8>) -> Result<(), String> + Send>;

/// What an out-of-band frame carries: bytes ready to go, or what writes them.
pub(super) enum Payload {
    Bytes(Vec<u8>),
    /// Room to reserve (a pool buffer of that size is used again) and the writer.
    Encode(usize, Encode),
}

/// One connection's write side as the sender thread holds it.
pub(super) struct Writer {
    pub stream: TcpStream,
    pub lock: super::WriteLock,
}

struct Job {
    queued: Queued,
    peer: usize,
    epoch: u64,
    tag: u64,
    payload: Payload,
    deadline: Instant,
}

/// A frame copied and ready to write.
struct Ready {
    _queued: Queued,
    peer: usize,
    header: Vec<u8>,
    payload: Vec<u8>,
    deadline: Instant,
}

/// Handle to the sender threads; dropping it stops them after the frame in hand (frames still
/// queued are dropped: they belong to an epoch that is over).
pub(super) struct OutOfBandSender {
    jobs: Sender<Job>,
    closing: Arc<AtomicBool>,
    backlog: Arc<AtomicUsize>,
}

/// One frame counted in the backlog until it is on the wire or dropped.
struct Queued(Arc<AtomicUsize>);

impl Queued {
    fn new(backlog: &Arc<AtomicUsize>) -> Self {
        backlog.fetch_add(1, Ordering::Relaxed);
        Queued(backlog.clone())
    }
}

impl Drop for Queued {
    fn drop(&mut self) {
        self.0.fetch_sub(1, Ordering::Relaxed);
    }
}

impl OutOfBandSender {
    /// Start the threads with the write side of every connection (`None` for this rank and for
    /// peers without one); frames are copied into buffers from `written`, and each goes back
    /// there once it is on the wire.
    pub(super) fn start(writers: Vec<Option<Writer>>, written: BufferPool, cpu: CpuMeter) -> std::io::Result<Self> {
        let (jobs, rx) = mpsc::channel();
        let (ready, to_write) = mpsc::channel();
        let closing = Arc::new(AtomicBool::new(false));
        let writers: Arc<[Option<Writer>]> = writers.into();
        let (stop, w, pool, meter) = (closing.clone(), writers.clone(), written.clone(), cpu.clone());
        std::thread::Builder::new().name("lazarus-comm-oow".into()).spawn(move || write(to_write, &w, &stop, &pool, &meter))?;
        let stop = closing.clone();
        std::thread::Builder::new().name("lazarus-comm-oob".into()).spawn(move || copy(rx, ready, &writers, &stop, &written, &cpu))?;
        Ok(OutOfBandSender { jobs, closing, backlog: Arc::default() })
    }

    /// Queue a frame with `tag` for `peer`; false if the threads are gone.
    pub(super) fn queue(&self, peer: usize, epoch: u64, tag: u64, payload: Payload, deadline: Instant) -> bool {
        self.jobs.send(Job { queued: Queued::new(&self.backlog), peer, epoch, tag, payload, deadline }).is_ok()
    }

    /// Frames queued and not yet written nor dropped.
    pub(super) fn backlog(&self) -> usize {
        self.backlog.load(Ordering::Relaxed)
    }
}

impl Drop for OutOfBandSender {
    fn drop(&mut self) {
        self.closing.store(true, Ordering::Relaxed);
    }
}

/// The copy thread: each job's payload into a buffer, then on to the write thread.
fn copy(rx: Receiver<Job>, ready: Sender<Ready>, writers: &[Option<Writer>], closing: &AtomicBool, pool: &BufferPool, cpu: &CpuMeter) {
    for job in rx {
        if closing.load(Ordering::Relaxed) {
            return;
        }
        let payload = match job.payload {
            Payload::Bytes(b) => Ok(b),
            Payload::Encode(size, encode) => cpu.measure(|| {
                let mut buffer = pool.take(size).unwrap_or_else(|| Vec::with_capacity(size));
                let encoded = std::panic::catch_unwind(std::panic::AssertUnwindSafe(|| encode(&mut buffer)));
                encoded.unwrap_or_else(|_| Err("the frame's writer panicked".into())).and_then(|()| match buffer.len() as u64 {
                    n if n > MAX_FRAME => Err(format!("a frame of {n} bytes exceeds the {MAX_FRAME}-byte limit")),
                    _ => Ok(buffer),
                })
            }),
        };
        let payload = match payload {
            Ok(p) => p,
            Err(reason) => {
                // A bug of the caller's, not a fault of the link; both ends will see the
                // connection close, so say here which frame and why.
                eprintln!(
                    "lazarus-comm: out-of-band frame {:#x} for rank {} not sent: {reason}; closing that connection",
                    job.tag, job.peer
                );
                // The peer waits for this frame: close the connection, so that it learns at once.
                if let Some(Some(w)) = writers.get(job.peer) {
                    let _ = w.stream.shutdown(Shutdown::Both);
                }
                continue;
            }
        };
        let mut header = Vec::with_capacity(HEADER);
        write_header(&mut header, MAGIC, job.epoch, job.tag, payload.len() as u64);
        if ready.send(Ready { _queued: job.queued, peer: job.peer, header, payload, deadline: job.deadline }).is_err() {
            return;
        }
    }
}

/// The write thread: copied frames onto their connections, in order.
fn write(rx: Receiver<Ready>, writers: &[Option<Writer>], closing: &AtomicBool, written: &BufferPool, cpu: &CpuMeter) {
    for frame in rx {
        if closing.load(Ordering::Relaxed) {
            return;
        }
        let Some(Some(w)) = writers.get(frame.peer) else { continue };
        let failed = {
            let mut held = lock(&w.lock);
            cpu.measure(|| write_frame(&w.stream, &mut held, &frame.header, &frame.payload, frame.deadline).is_err())
        };
        if failed {
            // A frame cut short leaves the byte stream unusable: close it, and the transport's
            // reader sees the connection end (the step fails there, as any lost peer's would).
            let _ = w.stream.shutdown(Shutdown::Both);
        }
        written.give(frame.payload);
    }
}

/// Take a connection's write lock (a panic while it was held leaves nothing half-done that
/// the lock protects: the connection itself is closed on any failed write).
pub(super) fn lock<T>(m: &Mutex<T>) -> MutexGuard<'_, T> {
    m.lock().unwrap_or_else(|p| p.into_inner())
}

/// Take a connection's write lock if it frees within `wait` (a best-effort control frame gives
/// up rather than wait behind a snapshot stuck on a stalled peer).
pub(super) fn lock_within<T>(m: &Mutex<T>, wait: Duration) -> Option<MutexGuard<'_, T>> {
    let until = Instant::now() + wait;
    loop {
        match m.try_lock() {
            Ok(g) => return Some(g),
            Err(TryLockError::Poisoned(p)) => return Some(p.into_inner()),
            Err(TryLockError::WouldBlock) => {}
        }
        if Instant::now() >= until {
            return None;
        }
        std::thread::sleep(Duration::from_millis(1));
    }
}

/// Write a frame (`header`, then `payload`) by `deadline`, each sealed first when the connection
/// is encrypted (`sealer`, held under the connection's write lock: records are numbered in the
/// order they are written). The socket's write timeout is set again before each write call, so a
/// peer that drains slowly cannot stretch the wait past the deadline (a timeout per call would
/// restart with every partial write).
pub(super) fn write_frame(
    stream: &TcpStream,
    sealer: &mut Option<super::Sealer>,
    header: &[u8],
    payload: &[u8],
    deadline: Instant,
) -> std::io::Result<()> {
    let parts: [&[u8]; 2] = match sealer {
        None => [header, payload],
        Some(seal) => [seal.seal_frame(header, payload), &[]],
    };
    let mut s = stream;
    for mut part in parts {
        while !part.is_empty() {
            let remaining = deadline.saturating_duration_since(Instant::now());
            if remaining.is_zero() {
                return Err(std::io::Error::new(std::io::ErrorKind::TimedOut, "deadline passed mid-frame"));
            }
            s.set_write_timeout(Some(remaining))?;
            match s.write(part) {
                Ok(0) => return Err(std::io::Error::new(std::io::ErrorKind::WriteZero, "connection closed mid-frame")),
                Ok(n) => part = &part[n..],
                Err(e) if e.kind() == std::io::ErrorKind::Interrupted => {}
                Err(e) => return Err(e),
            }
        }
    }
    Ok(())
}
