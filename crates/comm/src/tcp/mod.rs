//! TCP transport: one connection per pair of ranks, length-prefixed frames stamped with the
//! plan epoch. A reader thread per connection moves frames into one shared inbox, so a send
//! never blocks on a peer that is itself sending (no all-to-all deadlock), and a closed
//! connection is noticed at once whichever peer the caller is waiting for.

use std::collections::VecDeque;
use std::io::{ErrorKind, Read};
use std::net::{Shutdown, SocketAddr, TcpListener, TcpStream};
use std::sync::mpsc::{self, Receiver, RecvTimeoutError, Sender};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use crate::cpu_time::CpuMeter;
use crate::error::CommError;
use crate::Transport;

mod buffers;
mod out_of_band;
mod rendezvous;
mod seal;
mod tls;
use buffers::BufferPool;
pub use out_of_band::Encode;
use out_of_band::{lock, lock_within, write_frame, OutOfBandSender, Payload, Writer};
pub use rendezvous::Rendezvous;
use seal::{Opener, Sealer};

/// A connection's write side: its lock (frames never interleave), holding what seals its
/// frames when the data plane is encrypted.
pub(super) type WriteLock = Arc<Mutex<Option<Sealer>>>;

const MAGIC: u32 = 0x4c5a_5231; // "LZR1"
const HELLO: u32 = 0x4c5a_4831; // "LZH1"
/// The hello of a rank that seals its frames ([`seal`]): both ends of a connection must.
const HELLO_SEALED: u32 = 0x4c5a_4832; // "LZH2"
/// Header: magic u32, epoch u64, tag u64, length u64.
const HEADER: usize = 28;
/// Largest frame accepted from or sent to a peer (an expert's weights and moments are far
/// smaller); a larger header is a protocol error, never an allocation.
pub const MAX_FRAME: u64 = 1 << 30;
use crate::tags::{ABORT as ABORT_TAG, BYE as BYE_TAG};

enum Event {
    Frame { from: usize, epoch: u64, tag: u64, payload: Vec<u8> },
    Closed { from: usize, reason: String },
}

pub struct TcpTransport {
    rank: usize,
    world: usize,
    epoch: u64,
    streams: Vec<Option<TcpStream>>,
    inbox: Receiver<Event>,
    /// Frames that arrived from a peer before they were asked for.
    pending: Vec<VecDeque<(u64, Vec<u8>)>>,
    /// Out-of-band frames ([`crate::tags::is_out_of_band`]: snapshots) that arrived ahead of
    /// the frame asked for: set aside until they are asked for.
    parked: Vec<VecDeque<(u64, Vec<u8>)>>,
    /// Why each peer is gone, once it is.
    lost: Vec<Option<String>>,
    /// Peers that said goodbye: their EOF ends the connection without failing the step.
    left: Vec<bool>,
    /// The first loss seen (or reported by an abort frame): every later call fails with it.
    failed: Option<CommError>,
    /// Peers another rank reported lost in an abort frame.
    reported: Vec<bool>,
    /// One write lock per connection, shared with the out-of-band sender: frames never
    /// interleave (and are sealed in the order they are written).
    write_locks: Vec<WriteLock>,
    /// The threads that copy and write out-of-band frames, started by the first one.
    out_of_band: Option<OutOfBandSender>,
    /// Buffers of out-of-band frames already written, for the next ones ([`buffers`]).
    written: BufferPool,
    /// Buffers of received out-of-band frames given back, which the reader threads fill again.
    received: BufferPool,
    /// CPU time the threads spent on out-of-band frames (copy, write, and the reads of them).
    out_of_band_cpu: CpuMeter,
}

fn write_header(buf: &mut Vec<u8>, magic: u32, epoch: u64, tag: u64, len: u64) {
    buf.extend_from_slice(&magic.to_le_bytes());
    buf.extend_from_slice(&epoch.to_le_bytes());
    buf.extend_from_slice(&tag.to_le_bytes());
    buf.extend_from_slice(&len.to_le_bytes());
}

fn parse_header(h: &[u8; HEADER]) -> (u32, u64, u64, u64) {
    let u32_at = |i: usize| u32::from_le_bytes(h[i..i + 4].try_into().expect("4 bytes"));
    let u64_at = |i: usize| u64::from_le_bytes(h[i..i + 8].try_into().expect("8 bytes"));
    (u32_at(0), u64_at(4), u64_at(12), u64_at(20))
}

/// The loss an abort frame from `from` reports (its payload names the lost rank; a rank that
/// does not exist is read as the sender itself).
fn abort_error(from: usize, payload: &[u8], world: usize) -> CommError {
    let lost =
        payload.get(..8).and_then(|b| b.try_into().ok()).map(u64::from_le_bytes).filter(|&r| r < world as u64).map_or(from, |r| r as usize);
    CommError::PeerLost { peer: lost, reason: format!("reported by rank {from}") }
}

fn reader(mut stream: TcpStream, from: usize, tx: Sender<Event>, pool: BufferPool, out_of_band_cpu: CpuMeter, mut opener: Option<Opener>) {
    let closed = |reason: String| Event::Closed { from, reason };
    loop {
        let h = match read_header(&mut stream, &mut opener) {
            Ok(h) => h,
            Err(reason) => {
                let _ = tx.send(closed(reason));
                return;
            }
        };
        let (magic, epoch, tag, len) = parse_header(&h);
        if magic != MAGIC {
            let _ = tx.send(closed(format!("bad frame magic {magic:#x}")));
            return;
        }
        if len > MAX_FRAME {
            let _ = tx.send(closed(format!("frame of {len} bytes exceeds the {MAX_FRAME}-byte limit")));
            return;
        }
        // A snapshot lands in a buffer given back, if one fits. Otherwise reserve up to 64 MiB
        // from the header (a tensor-sized frame then lands without regrowing); beyond that grow
        // as bytes arrive, so a lying header cannot make us allocate up to the frame limit.
        let out_of_band = crate::tags::is_out_of_band(tag);
        let on_wire = if opener.is_some() { seal::sealed_len(len as usize) } else { len as usize };
        let kept = if out_of_band { pool.take(on_wire) } else { None };
        let mut payload = kept.unwrap_or_else(|| Vec::with_capacity(on_wire.min(64 << 20)));
        let mut read = || read_payload(&mut stream, &mut opener, len as usize, &mut payload);
        let got = if out_of_band { out_of_band_cpu.measure(read) } else { read() };
        if let Err(reason) = got {
            let _ = tx.send(closed(reason));
            return;
        }
        if tx.send(Event::Frame { from, epoch, tag, payload }).is_err() {
            return; // transport dropped
        }
    }
}

/// What a sealed record that does not open says.
const NOT_SEALED: &str = "a sealed frame that does not open (altered, replayed, or not this connection's)";

/// Why reading a frame from a peer ended the connection.
fn lost_mid_frame(e: std::io::Error) -> String {
    match e.kind() {
        ErrorKind::UnexpectedEof => "connection closed mid-frame".into(),
        _ => format!("connection lost mid-frame: {e}"),
    }
}

fn unsealed(e: seal::Unsealed) -> String {
    match e {
        seal::Unsealed::Refused => NOT_SEALED.into(),
        seal::Unsealed::Alert => "the peer closed its TLS session".into(),
    }
}

/// The next frame's header: in clear, or one sealed record.
fn read_header(stream: &mut TcpStream, opener: &mut Option<Opener>) -> Result<[u8; HEADER], String> {
    let closed = |e: std::io::Error| if e.kind() == ErrorKind::UnexpectedEof { "connection closed".to_string() } else { e.to_string() };
    let Some(o) = opener else {
        let mut h = [0u8; HEADER];
        stream.read_exact(&mut h).map_err(closed)?;
        return Ok(h);
    };
    let mut record = [0u8; HEADER + seal::RECORD_OVERHEAD];
    stream.read_exact(&mut record).map_err(closed)?;
    let (head, body) = record.split_at_mut(seal::RECORD_HEADER);
    let head: [u8; seal::RECORD_HEADER] = (&*head).try_into().expect("a record header");
    o.open(&head, body, HEADER).map_err(unsealed)?;
    Ok(body[..HEADER].try_into().expect("a header"))
}

/// A frame's payload of `len` bytes appended to `payload`: in clear, or as sealed records of at
/// most 16 KiB, each opened in place where it landed.
fn read_payload(stream: &mut TcpStream, opener: &mut Option<Opener>, len: usize, payload: &mut Vec<u8>) -> Result<(), String> {
    let Some(o) = opener else {
        let n = stream.take(len as u64).read_to_end(payload).map_err(lost_mid_frame)?;
        return if n == len { Ok(()) } else { Err("connection closed mid-frame".into()) };
    };
    let mut left = len;
    while left > 0 {
        let plain = left.min(seal::MAX_PLAINTEXT);
        let mut head = [0u8; seal::RECORD_HEADER];
        stream.read_exact(&mut head).map_err(lost_mid_frame)?;
        let start = payload.len();
        let body = plain + seal::RECORD_OVERHEAD - seal::RECORD_HEADER;
        let n = stream.take(body as u64).read_to_end(payload).map_err(lost_mid_frame)?;
        if n != body {
            return Err("connection closed mid-frame".into());
        }
        o.open(&head, &mut payload[start..], plain).map_err(unsealed)?;
        payload.truncate(start + plain);
        left -= plain;
    }
    Ok(())
}

impl TcpTransport {
    /// Connect rank `r.rank` to every other rank, each connection authenticated both ways
    /// ([`rendezvous`]). `listener` must be bound to `r.addrs[r.rank]`.
    pub fn connect(listener: TcpListener, r: Rendezvous) -> Result<Self, CommError> {
        let world = r.addrs.len();
        if r.rank >= world {
            return Err(CommError::invalid("rank", format!("{} (world size {world})", r.rank)));
        }
        let rendezvous::Connected { streams, mut halves } = rendezvous::establish(listener, &r)?;
        let (tx, inbox) = mpsc::channel();
        let received = BufferPool::default();
        let out_of_band_cpu = CpuMeter::default();
        let mut sealers: Vec<Option<Sealer>> = Vec::with_capacity(world);
        for (peer, s) in streams.iter().enumerate() {
            let (sealer, opener) = halves[peer].take().map_or((None, None), |(s, o)| (Some(s), Some(o)));
            sealers.push(sealer);
            if let Some(s) = s {
                let read = s.try_clone().map_err(|e| CommError::Rendezvous(format!("clone: {e}")))?;
                let tx = tx.clone();
                let (pool, meter) = (received.clone(), out_of_band_cpu.clone());
                std::thread::Builder::new()
                    .name(format!("lazarus-comm-rx-{peer}"))
                    .spawn(move || reader(read, peer, tx, pool, meter, opener))
                    .map_err(|e| CommError::Rendezvous(format!("reader thread: {e}")))?;
            }
        }
        Ok(TcpTransport {
            rank: r.rank,
            world,
            epoch: r.epoch,
            streams,
            inbox,
            pending: (0..world).map(|_| VecDeque::new()).collect(),
            parked: (0..world).map(|_| VecDeque::new()).collect(),
            lost: vec![None; world],
            left: vec![false; world],
            failed: None,
            reported: vec![false; world],
            write_locks: sealers.into_iter().map(|s| Arc::new(Mutex::new(s))).collect(),
            out_of_band: None,
            written: BufferPool::default(),
            received,
            out_of_band_cpu,
        })
    }

    /// `n` connected ranks on loopback in this process (tests, benchmarks).
    pub fn local_group(n: usize, epoch: u64) -> Result<Vec<TcpTransport>, CommError> {
        let listeners: Vec<TcpListener> =
            (0..n).map(|_| TcpListener::bind("127.0.0.1:0")).collect::<Result<_, _>>().map_err(|e| CommError::Rendezvous(e.to_string()))?;
        let addrs: Vec<SocketAddr> =
            listeners.iter().map(|l| l.local_addr()).collect::<Result<_, _>>().map_err(|e| CommError::Rendezvous(e.to_string()))?;
        let handles: Vec<_> = listeners
            .into_iter()
            .enumerate()
            .map(|(rank, l)| {
                let addrs = addrs.clone();
                std::thread::spawn(move || TcpTransport::connect(l, Rendezvous::new(rank, addrs, epoch, Duration::from_secs(10))))
            })
            .collect();
        handles.into_iter().map(|h| h.join().map_err(|_| CommError::Rendezvous("rendezvous thread panicked".into()))?).collect()
    }

    /// Record a lost peer, tell everyone else, and return the error every call now gets.
    fn lose(&mut self, peer: usize, reason: String) -> CommError {
        self.lost[peer] = Some(reason.clone());
        if let Some(s) = &self.streams[peer] {
            let _ = s.shutdown(Shutdown::Both);
        }
        let err = CommError::PeerLost { peer, reason };
        if self.failed.is_none() {
            self.failed = Some(err.clone());
            let mut header = Vec::with_capacity(HEADER);
            write_header(&mut header, MAGIC, self.epoch, ABORT_TAG, 8);
            let lost = (peer as u64).to_le_bytes();
            for (p, s) in self.streams.iter_mut().enumerate() {
                if let (Some(s), None) = (s, &self.lost[p]) {
                    let Some(mut held) = lock_within(&self.write_locks[p], Duration::from_millis(200)) else { continue };
                    // A frame cut short leaves the byte stream unusable: close it.
                    if write_frame(s, &mut held, &header, &lost, Instant::now() + Duration::from_millis(200)).is_err() {
                        let _ = s.shutdown(Shutdown::Both);
                    }
                }
            }
        }
        err
    }

    /// Process whatever has already arrived without waiting: data frames are queued, abort and
    /// close events become the transport's failure. Returns that failure, if any.
    fn drain_control(&mut self) -> Option<CommError> {
        while let Ok(ev) = self.inbox.try_recv() {
            match ev {
                Event::Frame { from, tag, .. } if tag == BYE_TAG => self.left[from] = true,
                Event::Frame { from, tag, payload, .. } if tag == ABORT_TAG => {
                    let err = self.note_abort(from, &payload);
                    self.failed.get_or_insert(err);
                }
                Event::Frame { from, tag, payload, .. } => self.pending[from].push_back((tag, payload)),
                Event::Closed { from, reason } => {
                    if self.left[from] {
                        self.lost[from] = Some("peer left".into());
                    } else if self.failed.is_none() {
                        self.lose(from, reason);
                    }
                }
            }
        }
        self.failed.clone()
    }

    /// An abort frame from `from`: remember whom it reports lost.
    fn note_abort(&mut self, from: usize, payload: &[u8]) -> CommError {
        let err = abort_error(from, payload, self.world);
        if let CommError::PeerLost { peer, .. } = &err {
            self.reported[*peer] = true;
        }
        err
    }

    /// Leave cleanly: say goodbye to every peer, then close. Peers that still wait for a
    /// message from this rank get `PeerLost`; the others carry on.
    pub fn shutdown(&mut self) {
        if self.failed.is_none() {
            self.failed = Some(CommError::invalid("transport", "already shut down"));
        }
        // Snapshots still queued belong to a run that is over.
        self.out_of_band = None;
        let mut header = Vec::with_capacity(HEADER);
        write_header(&mut header, MAGIC, self.epoch, BYE_TAG, 0);
        for (p, s) in self.streams.iter_mut().enumerate() {
            let Some(s) = s else { continue };
            if let Some(mut held) = lock_within(&self.write_locks[p], Duration::from_millis(200)) {
                let _ = write_frame(s, &mut held, &header, &[], Instant::now() + Duration::from_millis(200));
            }
            let _ = s.shutdown(Shutdown::Both);
        }
    }

    /// A handle that cuts this transport's connections to chosen peers from another thread
    /// (see [`Fence`]).
    pub fn fence(&self) -> Fence {
        Fence { epoch: self.epoch, streams: self.streams.iter().map(|s| s.as_ref().and_then(|s| s.try_clone().ok())).collect() }
    }

    /// Drop every connection without a goodbye, as a crash would.
    pub fn abort_connections(&mut self) {
        for s in self.streams.iter().flatten() {
            let _ = s.shutdown(Shutdown::Both);
        }
    }
}

/// Cuts a transport's connections to peers the controller gave up (lost by their lease: hung,
/// or cut off by a partition). A peer that is silent but connected would otherwise hold every
/// collective until its deadline; once cut, whatever waits on it fails at once with
/// [`CommError::PeerLost`], and the step is abandoned.
pub struct Fence {
    epoch: u64,
    streams: Vec<Option<TcpStream>>,
}

impl Fence {
    /// The epoch of the transport it cuts.
    pub fn epoch(&self) -> u64 {
        self.epoch
    }

    /// Cut the connection to `rank` (nothing if there is none).
    pub fn cut(&self, rank: usize) {
        if let Some(Some(s)) = self.streams.get(rank) {
            let _ = s.shutdown(Shutdown::Both);
        }
    }
}

impl Drop for TcpTransport {
    fn drop(&mut self) {
        self.shutdown();
    }
}

impl Transport for TcpTransport {
    fn rank(&self) -> usize {
        self.rank
    }

    fn world(&self) -> usize {
        self.world
    }

    fn epoch(&self) -> u64 {
        self.epoch
    }

    fn send(&mut self, peer: usize, tag: u64, payload: &[u8], deadline: Instant) -> Result<(), CommError> {
        if peer >= self.world {
            return Err(CommError::invalid("peer", format!("{peer} (world size {})", self.world)));
        }
        if crate::tags::is_control(tag) {
            return Err(CommError::invalid("tag", format!("{tag:#x} is reserved for control frames")));
        }
        if payload.len() as u64 > MAX_FRAME {
            return Err(CommError::invalid("payload", format!("{} bytes exceeds the {MAX_FRAME}-byte frame limit", payload.len())));
        }
        let result = self.send_frame(peer, tag, payload, deadline);
        self.fail_on(result)
    }

    fn send_out_of_band(&mut self, peer: usize, tag: u64, payload: Vec<u8>, deadline: Instant) -> Result<(), CommError> {
        out_of_band_tag(tag)?;
        if peer == self.rank || peer >= self.world || payload.len() as u64 > MAX_FRAME {
            return self.send(peer, tag, &payload, deadline);
        }
        self.queue_out_of_band(peer, tag, Payload::Bytes(payload), deadline)
    }

    fn send_out_of_band_encoded(
        &mut self,
        peer: usize,
        tag: u64,
        size_hint: usize,
        encode: Encode,
        deadline: Instant,
    ) -> Result<(), CommError> {
        out_of_band_tag(tag)?;
        if peer == self.rank || peer >= self.world {
            return self.send(peer, tag, &crate::encode_now(size_hint, encode)?, deadline);
        }
        self.queue_out_of_band(peer, tag, Payload::Encode(size_hint, encode), deadline)
    }

    fn recv(&mut self, peer: usize, tag: u64, deadline: Instant) -> Result<Vec<u8>, CommError> {
        if peer >= self.world {
            return Err(CommError::invalid("peer", format!("{peer} (world size {})", self.world)));
        }
        let result = self.recv_frame(peer, tag, deadline);
        self.fail_on(result)
    }

    fn out_of_band_backlog(&self) -> usize {
        self.out_of_band.as_ref().map_or(0, OutOfBandSender::backlog)
    }

    fn out_of_band_cpu(&self) -> Duration {
        self.out_of_band_cpu.total()
    }

    fn take_arrived(&mut self, peer: usize, tag: u64) -> Option<Vec<u8>> {
        if peer >= self.world || !crate::tags::is_out_of_band(tag) {
            return None;
        }
        self.drain_control();
        for q in [&mut self.parked[peer], &mut self.pending[peer]] {
            if let Some(i) = q.iter().position(|(t, _)| *t == tag) {
                return q.remove(i).map(|(_, p)| p);
            }
        }
        None
    }

    fn recycle(&mut self, buffer: Vec<u8>) {
        self.received.give(buffer);
    }

    fn lost_peers(&mut self) -> Vec<usize> {
        self.drain_control();
        (0..self.world).filter(|&p| p != self.rank && ((self.lost[p].is_some() && !self.left[p]) || self.reported[p])).collect()
    }
}

/// Only out-of-band tags may go out of band.
fn out_of_band_tag(tag: u64) -> Result<(), CommError> {
    match crate::tags::is_out_of_band(tag) {
        true => Ok(()),
        false => Err(CommError::invalid("tag", format!("{tag:#x} is not an out-of-band tag"))),
    }
}

impl TcpTransport {
    /// Hand an out-of-band frame to the sender threads (started by the first one).
    fn queue_out_of_band(&mut self, peer: usize, tag: u64, payload: Payload, deadline: Instant) -> Result<(), CommError> {
        if let Some(e) = &self.failed {
            return Err(e.clone());
        }
        if let Some(reason) = &self.lost[peer] {
            return Err(CommError::PeerLost { peer, reason: reason.clone() });
        }
        if self.out_of_band.is_none() {
            let writers = self
                .streams
                .iter()
                .zip(&self.write_locks)
                .map(|(s, lock)| s.as_ref().and_then(|s| s.try_clone().ok()).map(|stream| Writer { stream, lock: lock.clone() }))
                .collect();
            let sender = OutOfBandSender::start(writers, self.written.clone(), self.out_of_band_cpu.clone())
                .map_err(|e| CommError::invalid("transport", format!("out-of-band sender: {e}")))?;
            self.out_of_band = Some(sender);
        }
        match &self.out_of_band {
            Some(sender) if sender.queue(peer, self.epoch, tag, payload, deadline) => Ok(()),
            _ => Err(CommError::invalid("transport", "the out-of-band sender has stopped")),
        }
    }

    /// Any error but a bad argument leaves the transport unusable: frames of an abandoned call
    /// may still be in flight, and the step is abandoned everywhere anyway (the runtime builds a
    /// new transport for the next epoch).
    fn fail_on<T>(&mut self, result: Result<T, CommError>) -> Result<T, CommError> {
        if let Err(e) = &result {
            if !matches!(e, CommError::Invalid { .. }) && self.failed.is_none() {
                self.failed = Some(e.clone());
            }
        }
        result
    }

    fn send_frame(&mut self, peer: usize, tag: u64, payload: &[u8], deadline: Instant) -> Result<(), CommError> {
        if let Some(e) = &self.failed {
            return Err(e.clone());
        }
        if peer == self.rank {
            self.pending[peer].push_back((tag, payload.to_vec()));
            return Ok(());
        }
        if let Some(reason) = &self.lost[peer] {
            return Err(CommError::PeerLost { peer, reason: reason.clone() });
        }
        let remaining = deadline.saturating_duration_since(Instant::now());
        if remaining.is_zero() {
            return Err(CommError::Timeout { peer, what: "send".into() });
        }
        let Some(stream) = self.streams[peer].as_mut() else {
            return Err(CommError::PeerLost { peer, reason: "no connection".into() });
        };
        let mut header = Vec::with_capacity(HEADER);
        write_header(&mut header, MAGIC, self.epoch, tag, payload.len() as u64);
        let result = {
            let mut held = lock(&self.write_locks[peer]);
            write_frame(stream, &mut held, &header, payload, deadline)
        };
        let Err(e) = result else { return Ok(()) };
        // A frame cut short leaves the byte stream unusable: the connection is closed either way.
        if matches!(e.kind(), ErrorKind::WouldBlock | ErrorKind::TimedOut) {
            self.lost[peer] = Some("send timed out mid-frame".into());
            if let Some(s) = &self.streams[peer] {
                let _ = s.shutdown(Shutdown::Both);
            }
            return Err(CommError::Timeout { peer, what: "send".into() });
        }
        // A broken pipe is often the echo of an earlier loss that another peer already reported
        // (prefer that root cause), or of a peer that left cleanly (only this call fails).
        if let Some(err) = self.drain_control() {
            return Err(err);
        }
        if self.left[peer] {
            return Err(CommError::PeerLost { peer, reason: "peer left".into() });
        }
        Err(self.lose(peer, e.to_string()))
    }

    fn recv_frame(&mut self, peer: usize, tag: u64, deadline: Instant) -> Result<Vec<u8>, CommError> {
        if let Some(e) = &self.failed {
            return Err(e.clone());
        }
        if crate::tags::is_out_of_band(tag) {
            return self.recv_out_of_band(peer, tag, deadline);
        }
        loop {
            if let Some((t, payload)) = self.pending[peer].pop_front() {
                if t != tag && crate::tags::is_out_of_band(t) {
                    self.parked[peer].push_back((t, payload));
                    continue;
                }
                if t != tag {
                    return Err(CommError::Protocol { peer, reason: format!("expected tag {tag:#x}, got {t:#x}") });
                }
                return Ok(payload);
            }
            if peer == self.rank {
                return Err(CommError::Protocol { peer, reason: "receive from self with nothing sent".into() });
            }
            self.await_frame(peer, tag, deadline)?;
        }
    }

    /// An out-of-band frame: it travels beside the ordered stream (written by the sender's own
    /// thread), so it may arrive before or after ordered frames sent around it; those stay
    /// queued, in order, for the calls that ask for them.
    fn recv_out_of_band(&mut self, peer: usize, tag: u64, deadline: Instant) -> Result<Vec<u8>, CommError> {
        loop {
            for q in [&mut self.parked[peer], &mut self.pending[peer]] {
                if let Some(i) = q.iter().position(|(t, _)| *t == tag) {
                    return Ok(q.remove(i).map(|(_, p)| p).unwrap_or_default());
                }
            }
            if peer == self.rank {
                return Err(CommError::Protocol { peer, reason: "receive from self with nothing sent".into() });
            }
            self.await_frame(peer, tag, deadline)?;
        }
    }

    /// Wait for the next event from any peer while waiting on `peer` for `tag`: a data frame
    /// is queued; a goodbye, an abort, a stale frame or a closed connection is dealt with.
    fn await_frame(&mut self, peer: usize, tag: u64, deadline: Instant) -> Result<(), CommError> {
        if let Some(reason) = &self.lost[peer] {
            return Err(CommError::PeerLost { peer, reason: reason.clone() });
        }
        let remaining = deadline.saturating_duration_since(Instant::now());
        match self.inbox.recv_timeout(remaining) {
            Ok(Event::Frame { from, epoch, tag: t, payload }) => {
                if t == BYE_TAG {
                    self.left[from] = true;
                    return Ok(());
                }
                if t == ABORT_TAG {
                    let err = self.note_abort(from, &payload);
                    self.failed = Some(err.clone());
                    return Err(err);
                }
                if epoch < self.epoch {
                    return Err(CommError::StaleEpoch { peer: from, got: epoch, current: self.epoch });
                }
                if epoch > self.epoch {
                    return Err(CommError::Protocol {
                        peer: from,
                        reason: format!("frame from newer epoch {epoch} (ours is {})", self.epoch),
                    });
                }
                self.pending[from].push_back((t, payload));
                Ok(())
            }
            Ok(Event::Closed { from, reason }) => {
                if self.left[from] {
                    self.lost[from] = Some("peer left".into());
                    return Ok(());
                }
                Err(self.lose(from, reason))
            }
            Err(RecvTimeoutError::Timeout) => Err(CommError::Timeout { peer, what: format!("message with tag {tag:#x}") }),
            Err(RecvTimeoutError::Disconnected) => Err(self.lose(peer, "all connections closed".into())),
        }
    }
}
