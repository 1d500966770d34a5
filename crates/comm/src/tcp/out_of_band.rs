//! The out-of-band sender: a thread of the transport that writes snapshot frames
//! ([`crate::tags::is_out_of_band`]) while the caller goes on with the next step. A snapshot
//! budget is what the link carries in one step time (MoEtion §4), so written from the training
//! thread it would hold that thread for up to a step; here it overlaps the step's compute, as
//! the snapshot tier asks.
//!
//! Each connection has one write lock, taken by whoever writes a frame on it — this thread or
//! the transport's own calls — so frames never interleave. An ordered frame waits behind at most
//! the one snapshot frame being written.

use std::io::Write;
use std::net::{Shutdown, TcpStream};
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::mpsc::{self, Receiver, Sender};
use std::sync::{Arc, Mutex, MutexGuard, TryLockError};
use std::time::{Duration, Instant};

/// One connection's write side as the sender thread holds it.
pub(super) struct Writer {
    pub stream: TcpStream,
    pub lock: Arc<Mutex<()>>,
}

struct Job {
    peer: usize,
    header: Vec<u8>,
    payload: Vec<u8>,
    deadline: Instant,
}

/// Handle to the sender thread; dropping it stops the thread after the frame in hand (frames
/// still queued are dropped: they belong to an epoch that is over).
pub(super) struct OutOfBandSender {
    jobs: Sender<Job>,
    closing: Arc<AtomicBool>,
}

impl OutOfBandSender {
    /// Start the thread with the write side of every connection (`None` for this rank and for
    /// peers without one).
    pub(super) fn start(writers: Vec<Option<Writer>>) -> std::io::Result<Self> {
        let (jobs, rx) = mpsc::channel();
        let closing = Arc::new(AtomicBool::new(false));
        let stop = closing.clone();
        std::thread::Builder::new().name("lazarus-comm-oob".into()).spawn(move || run(rx, writers, stop))?;
        Ok(OutOfBandSender { jobs, closing })
    }

    /// Queue a frame (`header` then `payload`) for `peer`; false if the thread is gone.
    pub(super) fn queue(&self, peer: usize, header: Vec<u8>, payload: Vec<u8>, deadline: Instant) -> bool {
        self.jobs.send(Job { peer, header, payload, deadline }).is_ok()
    }
}

impl Drop for OutOfBandSender {
    fn drop(&mut self) {
        self.closing.store(true, Ordering::Relaxed);
    }
}

fn run(rx: Receiver<Job>, writers: Vec<Option<Writer>>, closing: Arc<AtomicBool>) {
    for job in rx {
        if closing.load(Ordering::Relaxed) {
            return;
        }
        let Some(Some(w)) = writers.get(job.peer) else { continue };
        let _held = lock(&w.lock);
        if write_frame(&w.stream, &job.header, &job.payload, job.deadline).is_err() {
            // A frame cut short leaves the byte stream unusable: close it, and the transport's
            // reader sees the connection end (the step fails there, as any lost peer's would).
            let _ = w.stream.shutdown(Shutdown::Both);
        }
    }
}

/// Take a connection's write lock (a panic while it was held leaves nothing half-done that
/// the lock protects: the connection itself is closed on any failed write).
pub(super) fn lock(m: &Mutex<()>) -> MutexGuard<'_, ()> {
    m.lock().unwrap_or_else(|p| p.into_inner())
}

/// Take a connection's write lock if it frees within `wait` (a best-effort control frame gives
/// up rather than wait behind a snapshot stuck on a stalled peer).
pub(super) fn lock_within(m: &Mutex<()>, wait: Duration) -> Option<MutexGuard<'_, ()>> {
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

/// Write a frame (`header`, then `payload`) by `deadline`: the socket's write timeout is set
/// again before each write call, so a peer that drains slowly cannot stretch the wait past the
/// deadline (a timeout per call would restart with every partial write).
pub(super) fn write_frame(stream: &TcpStream, header: &[u8], payload: &[u8], deadline: Instant) -> std::io::Result<()> {
    let mut s = stream;
    for mut part in [header, payload] {
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
