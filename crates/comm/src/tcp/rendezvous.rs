//! How ranks connect: rank r connects to every lower rank and accepts every higher one, and each
//! connection proves the job's secret both ways ([`crate::auth`]) before it carries a frame.
//!
//! The accepting side is reachable by anyone who can reach its port, so it must neither stall
//! nor fail because of a stranger. Its design:
//!
//! - **Concurrent handshakes.** Accepted connections are advanced side by side on non-blocking
//!   sockets (one loop, no thread per connection): a silent or slow connection never delays a
//!   rank's hello behind it. Before, hellos were read one connection at a time with a 2-second
//!   wait each, so ten silent connections held the ranks for 20 s and a byte dripped every
//!   1.5 s held them for good.
//! - **A deadline per connection, not per read** ([`HANDSHAKE_WITHIN`]): a connection that has
//!   not finished its handshake in that time is dropped, however it trickles its bytes.
//! - **Bounded.** At most [`MAX_PENDING`] handshakes at once; a new connection beyond that
//!   evicts the one that has got least far, the oldest of those (a rank's hello comes with its
//!   connection and its proof one round trip after the answer, so a connection that has sent
//!   nothing is a stranger's), and the reasons kept for the error message are bounded too. At
//!   most [`MAX_PENDING`] connections are taken in between two passes over the handshakes, so
//!   a flood cannot push a rank's hello out before it is read.
//! - **Only what is asked for is read**: the hello (header, then nonce) and the proof, never a
//!   byte beyond, so the first frames a rank sends after its proof stay in the socket for the
//!   transport's reader.
//!
//! The checks of a hello are a pure function ([`check_hello`]); the loop is the shell around
//! it. The connecting side retries a peer that closed the connection before answering (it
//! may have been evicted under a flood) until the rendezvous deadline.

use lazarus_setting::Setting;
use std::io::{ErrorKind, Read, Write};
use std::net::{SocketAddr, TcpListener, TcpStream};
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::Arc;
use std::time::{Duration, Instant};

use super::seal::{Opener, Sealer};
use super::tls::{read_exact_by, DataTls};
use super::{parse_header, write_header, HEADER, HELLO, HELLO_SEALED};
use crate::auth::{rendezvous_context as proof_context, NONCE, PROOF};
use crate::error::CommError;

/// How ranks find each other: rank r listens on `addrs[r]`.
pub struct Rendezvous {
    pub rank: usize,
    pub addrs: Vec<SocketAddr>,
    pub epoch: u64,
    pub timeout: Duration,
    /// The job's secret: every connection proves it both ways ([`crate::auth`]: it never
    /// crosses the network), so no other process can take a rank or pose as one.
    pub secret: u128,
    /// Set from outside to give the rendezvous up at once (a peer was lost before it connected).
    pub cancel: Option<Arc<AtomicBool>>,
    /// Seal every frame (TLS 1.3 records under the keys of a TLS handshake pinned by the
    /// secret: [`super::tls`], [`super::seal`]); every rank of the job must say the same.
    pub encrypt: bool,
}

impl Rendezvous {
    /// A rendezvous with no secret (0) that cannot be cancelled: tests and benchmarks in one process.
    pub fn new(rank: usize, addrs: Vec<SocketAddr>, epoch: u64, timeout: Duration) -> Self {
        Rendezvous { rank, addrs, epoch, timeout, secret: 0, cancel: None, encrypt: false }
    }

    fn cancelled(&self) -> Result<(), CommError> {
        match &self.cancel {
            Some(c) if c.load(Ordering::Relaxed) => {
                Err(CommError::Rendezvous(format!("rank {}: the rendezvous of epoch {} was called off", self.rank, self.epoch)))
            }
            _ => Ok(()),
        }
    }

    fn hello_magic(&self) -> u32 {
        if self.encrypt {
            HELLO_SEALED
        } else {
            HELLO
        }
    }
}

/// How long an accepted connection has to finish its handshake (hello and proof), in all.
pub(super) const HANDSHAKE_WITHIN: Duration = Duration::from_secs(2);
/// The most handshakes under way at once on the accepting side.
pub(super) const MAX_PENDING: usize = 64;
/// The most reasons for refused connections kept for the error message (the rest are counted).
const MAX_REASONS: usize = 16;

/// The bytes of a hello after its header: the connecting rank's nonce.
pub(super) const HELLO_BODY: u64 = NONCE as u64;

/// What seals and opens a connection's frames, when the data plane is encrypted.
pub(super) type Halves = Option<(Sealer, Opener)>;

/// Every rank's connection to `r.rank`, authenticated (None for itself), and what seals each.
pub(super) struct Connected {
    pub streams: Vec<Option<TcpStream>>,
    pub halves: Vec<Halves>,
}

/// Connect rank `r.rank` to every other rank: connect to lower ranks, accept higher ones.
/// `listener` must be bound to `r.addrs[r.rank]`.
pub(super) fn establish(listener: TcpListener, r: &Rendezvous) -> Result<Connected, CommError> {
    let world = r.addrs.len();
    let deadline = crate::deadline_after(r.timeout);
    let mut c = Connected { streams: (0..world).map(|_| None).collect(), halves: (0..world).map(|_| None).collect() };
    let tls = r.encrypt.then(|| DataTls::new(r.secret)).transpose().map_err(CommError::Rendezvous)?;
    for peer in 0..r.rank {
        let (stream, halves) = connect_to(r, peer, deadline, tls.as_ref())?;
        c.streams[peer] = Some(stream);
        c.halves[peer] = halves;
    }
    accept_higher(listener, r, deadline, tls.as_ref(), &mut c)?;
    Ok(c)
}

/// Connect to lower rank `peer` and shake hands, retrying until `deadline` while it cannot be
/// reached or closes the connection before answering.
fn connect_to(r: &Rendezvous, peer: usize, deadline: Instant, tls: Option<&DataTls>) -> Result<(TcpStream, Halves), CommError> {
    let at = r.addrs[peer];
    let fail = |e: String| CommError::Rendezvous(format!("rank {} to rank {peer} at {at}: {e}", r.rank));
    loop {
        r.cancelled()?;
        let mut stream = match TcpStream::connect_timeout(&at, Duration::from_millis(200)) {
            Ok(s) => s,
            Err(e) if Instant::now() < deadline => {
                let _ = e;
                std::thread::sleep(Duration::from_millis(20));
                continue;
            }
            Err(e) => return Err(CommError::Rendezvous(format!("rank {} cannot reach rank {peer} at {at}: {e}", r.rank))),
        };
        stream.set_nodelay(true).ok();
        match connect_handshake(&mut stream, r, peer, deadline, tls) {
            Ok(halves) => return Ok((stream, halves)),
            // Closed before it answered (evicted under a flood of connections, or restarting):
            // again, while there is time.
            Err(Handshake::Closed(_)) if Instant::now() < deadline => std::thread::sleep(Duration::from_millis(20)),
            Err(Handshake::Closed(e) | Handshake::Failed(e)) => return Err(fail(e)),
        }
    }
}

/// Why a connecting handshake did not complete.
enum Handshake {
    /// The peer closed the connection before it answered: worth another try.
    Closed(String),
    /// Anything else: the rendezvous fails.
    Failed(String),
}

/// The connecting side of a connection's handshake on `stream`, from rank `r.rank` to `peer`:
/// its hello and nonce; the accepting rank's nonce and proof, checked; its own proof; then, on
/// an encrypted data plane, the TLS handshake.
fn connect_handshake(
    stream: &mut TcpStream,
    r: &Rendezvous,
    peer: usize,
    deadline: Instant,
    tls: Option<&DataTls>,
) -> Result<Halves, Handshake> {
    let ours = crate::auth::nonce().map_err(|e| Handshake::Failed(format!("drawing a nonce: {e}")))?;
    let mut b = Vec::with_capacity(HEADER + HELLO_BODY as usize);
    write_header(&mut b, r.hello_magic(), r.epoch, r.rank as u64, HELLO_BODY);
    b.extend_from_slice(&ours);
    stream.write_all(&b).map_err(|e| Handshake::Closed(format!("hello: {e}")))?;
    let mut answer = [0u8; NONCE + PROOF];
    read_exact_by(stream, &mut answer, deadline).map_err(|e| {
        let sealed = if r.encrypt { "seals" } else { "does not seal" };
        let why = format!("no answer to the hello ({e}; this rank {sealed} its frames: does the peer?)");
        match e.kind() {
            ErrorKind::UnexpectedEof | ErrorKind::ConnectionReset | ErrorKind::ConnectionAborted => Handshake::Closed(why),
            _ => Handshake::Failed(why),
        }
    })?;
    let (theirs, proof) = answer.split_at(NONCE);
    if !crate::auth::verify(r.secret, &proof_context("accept", r.rank, peer, r.epoch), &ours, theirs, proof) {
        return Err(Handshake::Failed("it did not prove it knows the job's secret (another job's rank, or not a rank)".into()));
    }
    let own = crate::auth::prove(r.secret, &proof_context("connect", r.rank, peer, r.epoch), theirs, &ours);
    stream.write_all(&own).map_err(|e| Handshake::Failed(format!("proof: {e}")))?;
    let halves = tls.map(|t| t.connect(stream, deadline)).transpose().map_err(Handshake::Failed)?;
    stream.set_read_timeout(None).ok();
    stream.set_write_timeout(None).ok();
    Ok(halves)
}

/// A hello's header, checked: the rank it claims, if it may connect to `r.rank` now. `taken`
/// says whether a rank is connected already. Pure: what the accepting side decides of a hello.
pub(super) fn check_hello(header: &[u8; HEADER], r: &Rendezvous, taken: impl Fn(usize) -> bool) -> Result<usize, String> {
    let (magic, epoch, peer, len) = parse_header(header);
    let world = r.addrs.len() as u64;
    if (magic == HELLO || magic == HELLO_SEALED) && magic != r.hello_magic() {
        let (they, we) = if r.encrypt { ("does not seal", "seals") } else { ("seals", "does not seal") };
        return Err(format!("rank {peer} {they} its frames and this rank {we} ({} must be the job's)", Setting::EncryptData));
    }
    if (magic != HELLO && magic != HELLO_SEALED) || len != HELLO_BODY || peer <= r.rank as u64 || peer >= world || taken(peer as usize) {
        return Err(format!("unexpected hello (magic {magic:#x}, rank {peer}, {len} bytes)"));
    }
    if epoch != r.epoch {
        return Err(format!("rank {peer} at epoch {epoch}, current epoch {}", r.epoch));
    }
    Ok(peer as usize)
}

/// An accepted connection whose handshake is under way.
struct Pending {
    stream: TcpStream,
    from: SocketAddr,
    since: Instant,
    /// The bytes of the current stage read so far.
    got: Vec<u8>,
    stage: Stage,
}

impl Pending {
    /// How far its handshake got, least first: the stage, the bytes of it, and the newer the
    /// further (of two equally far, the older is dropped first).
    fn progress(&self) -> (u8, usize, Instant) {
        let stage = match self.stage {
            Stage::Header => 0,
            Stage::Nonce { .. } => 1,
            Stage::Proof { .. } => 2,
        };
        (stage, self.got.len(), self.since)
    }
}

enum Stage {
    /// Reading the hello's header.
    Header,
    /// Reading the nonce of rank `peer`'s hello.
    Nonce { peer: usize },
    /// Answered with this rank's nonce and proof; reading rank `peer`'s proof.
    Proof { peer: usize, ours: [u8; NONCE], theirs: [u8; NONCE] },
}

impl Stage {
    fn wants(&self) -> usize {
        match self {
            Stage::Header => HEADER,
            Stage::Nonce { .. } => HELLO_BODY as usize,
            Stage::Proof { .. } => PROOF,
        }
    }
}

/// What one pass over a pending handshake came to.
enum Advance {
    /// Still waiting for bytes (whether any came this pass).
    Waiting { progressed: bool },
    /// Rank `peer`, authenticated.
    Done { peer: usize },
    /// Refused, and why.
    Refused(String),
}

/// Accept every higher rank, each authenticated, until `deadline`; strangers' connections are
/// handled beside theirs and dropped (module note).
fn accept_higher(
    listener: TcpListener,
    r: &Rendezvous,
    deadline: Instant,
    tls: Option<&DataTls>,
    c: &mut Connected,
) -> Result<(), CommError> {
    let world = r.addrs.len();
    listener.set_nonblocking(true).map_err(|e| CommError::Rendezvous(format!("listener: {e}")))?;
    let mut waiting = world - r.rank - 1;
    let mut pending: Vec<Pending> = Vec::new();
    let mut refused = Refusals::default();
    while waiting > 0 {
        let mut progressed = accept_queued(&listener, &mut pending, &mut refused)?;
        let mut i = 0;
        while i < pending.len() {
            match advance(&mut pending[i], r, |p| c.streams[p].is_some()) {
                Advance::Waiting { progressed: p } => {
                    progressed |= p;
                    if pending[i].since.elapsed() >= HANDSHAKE_WITHIN {
                        let p = pending.swap_remove(i);
                        refused.note(p.from, format!("no complete handshake within {} s", HANDSHAKE_WITHIN.as_secs()));
                    } else {
                        i += 1;
                    }
                }
                Advance::Done { peer } => {
                    let mut p = pending.swap_remove(i);
                    p.stream.set_nonblocking(false).map_err(|e| CommError::Rendezvous(format!("rank {peer}'s connection: {e}")))?;
                    progressed = true;
                    // The peer proved the secret: its TLS handshake, if any, follows at once.
                    let within = deadline.min(Instant::now() + HANDSHAKE_WITHIN);
                    match tls.map(|t| t.accept(&mut p.stream, within)).transpose() {
                        Ok(halves) => {
                            p.stream.set_read_timeout(None).ok();
                            p.stream.set_write_timeout(None).ok();
                            c.streams[peer] = Some(p.stream);
                            c.halves[peer] = halves;
                            waiting -= 1;
                        }
                        Err(why) => refused.note(p.from, format!("rank {peer}: {why}")),
                    }
                }
                Advance::Refused(why) => {
                    let p = pending.swap_remove(i);
                    refused.note(p.from, why);
                    progressed = true;
                }
            }
        }
        if waiting == 0 {
            break;
        }
        r.cancelled()?;
        if Instant::now() >= deadline {
            return Err(CommError::Rendezvous(format!("rank {}: {waiting} higher rank(s) never connected{}", r.rank, refused.summary())));
        }
        if !progressed {
            std::thread::sleep(Duration::from_millis(2));
        }
    }
    Ok(())
}

/// Take the connections queued on `listener` (at most [`MAX_PENDING`]) into `pending`,
/// evicting beyond [`MAX_PENDING`] the one that got least far. Whether any came.
fn accept_queued(listener: &TcpListener, pending: &mut Vec<Pending>, refused: &mut Refusals) -> Result<bool, CommError> {
    let mut any = false;
    for _ in 0..MAX_PENDING {
        match listener.accept() {
            Ok((stream, from)) => {
                any = true;
                if stream.set_nonblocking(true).is_err() {
                    continue;
                }
                stream.set_nodelay(true).ok();
                if pending.len() >= MAX_PENDING {
                    let last = (0..pending.len()).min_by_key(|&i| pending[i].progress()).expect("MAX_PENDING > 0");
                    let p = pending.swap_remove(last);
                    refused.note(p.from, format!("dropped unfinished for a newer connection ({MAX_PENDING} under way)"));
                }
                pending.push(Pending { stream, from, since: Instant::now(), got: Vec::new(), stage: Stage::Header });
            }
            Err(e) if e.kind() == ErrorKind::WouldBlock => return Ok(any),
            Err(e) if e.kind() == ErrorKind::Interrupted || e.kind() == ErrorKind::ConnectionAborted => {}
            Err(e) => return Err(CommError::Rendezvous(format!("accept: {e}"))),
        }
    }
    Ok(any)
}

/// Read what `p`'s current stage still wants (never more) and act on it once it is whole.
fn advance(p: &mut Pending, r: &Rendezvous, taken: impl Fn(usize) -> bool) -> Advance {
    let mut progressed = false;
    loop {
        let want = p.stage.wants();
        let mut buf = [0u8; 64];
        let missing = want - p.got.len();
        match p.stream.read(&mut buf[..missing]) {
            Ok(0) => return Advance::Refused(stage_failed(&p.stage, "closed")),
            Ok(n) => {
                progressed = true;
                p.got.extend_from_slice(&buf[..n]);
            }
            Err(e) if e.kind() == ErrorKind::WouldBlock => return Advance::Waiting { progressed },
            Err(e) if e.kind() == ErrorKind::Interrupted => continue,
            Err(e) => return Advance::Refused(stage_failed(&p.stage, &e.to_string())),
        }
        if p.got.len() < want {
            continue;
        }
        let got = std::mem::take(&mut p.got);
        p.stage = match &p.stage {
            Stage::Header => match check_hello(&got[..].try_into().expect("a header"), r, &taken) {
                Ok(peer) => Stage::Nonce { peer },
                Err(why) => return Advance::Refused(why),
            },
            Stage::Nonce { peer } => {
                let theirs: [u8; NONCE] = got[..].try_into().expect("a nonce");
                match answer(&mut p.stream, r, *peer, &theirs) {
                    Ok(ours) => Stage::Proof { peer: *peer, ours, theirs },
                    Err(why) => return Advance::Refused(why),
                }
            }
            Stage::Proof { peer, ours, theirs } => {
                if taken(*peer) || !crate::auth::verify(r.secret, &proof_context("connect", *peer, r.rank, r.epoch), ours, theirs, &got) {
                    return Advance::Refused(format!("rank {peer} without the job's secret"));
                }
                return Advance::Done { peer: *peer };
            }
        };
    }
}

/// This rank's answer to rank `peer`'s hello with nonce `theirs`: its own nonce and proof.
fn answer(stream: &mut TcpStream, r: &Rendezvous, peer: usize, theirs: &[u8; NONCE]) -> Result<[u8; NONCE], String> {
    let ours = crate::auth::nonce().map_err(|e| format!("drawing a nonce: {e}"))?;
    let mut b = Vec::with_capacity(NONCE + PROOF);
    b.extend_from_slice(&ours);
    b.extend_from_slice(&crate::auth::prove(r.secret, &proof_context("accept", peer, r.rank, r.epoch), theirs, &ours));
    // 48 bytes on a connection that has sent only its hello: the socket takes them at once.
    match stream.write(&b) {
        Ok(n) if n == b.len() => Ok(ours),
        Ok(_) => Err("answer: cut short".into()),
        Err(e) => Err(format!("answer: {e}")),
    }
}

/// Why a handshake ended at stage `s` with the connection `what` (closed, or an error).
fn stage_failed(s: &Stage, what: &str) -> String {
    match s {
        Stage::Header => format!("no hello ({what})"),
        Stage::Nonce { peer } => format!("rank {peer}'s hello cut short ({what})"),
        Stage::Proof { peer, .. } => format!("rank {peer} without the job's secret: no proof ({what})"),
    }
}

/// The connections refused on the way, for the error message should the rendezvous fail:
/// the first [`MAX_REASONS`], and how many in all.
#[derive(Default)]
struct Refusals {
    first: Vec<String>,
    all: usize,
}

impl Refusals {
    fn note(&mut self, from: SocketAddr, why: String) {
        self.all += 1;
        if self.first.len() < MAX_REASONS {
            self.first.push(format!("{from}: {why}"));
        }
    }

    fn summary(&self) -> String {
        match self.all {
            0 => String::new(),
            n if n <= self.first.len() => format!("; refused: {}", self.first.join("; ")),
            n => format!("; refused {n} connections: {}; …", self.first.join("; ")),
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn r(rank: usize, world: usize, encrypt: bool) -> Rendezvous {
        let addrs = (0..world).map(|i| SocketAddr::from(([127, 0, 0, 1], 9000 + i as u16))).collect();
        Rendezvous { encrypt, ..Rendezvous::new(rank, addrs, 5, Duration::from_secs(1)) }
    }

    fn header(magic: u32, epoch: u64, rank: u64, len: u64) -> [u8; HEADER] {
        let mut b = Vec::new();
        write_header(&mut b, magic, epoch, rank, len);
        b.try_into().unwrap()
    }

    /// Every way a hello's header can be refused, and the one way it is taken, on a small
    /// instance: every rank claimed, epoch, length and magic.
    #[test]
    fn a_hello_is_taken_only_from_a_higher_rank_not_yet_connected_of_this_epoch_and_framing() {
        let me = r(1, 4, false);
        let taken = |p: usize| p == 3;
        for claimed in 0..6u64 {
            for (magic, epoch, len) in
                [(HELLO, 5, HELLO_BODY), (HELLO, 4, HELLO_BODY), (HELLO, 5, 3), (HELLO_SEALED, 5, HELLO_BODY), (0x1234, 5, HELLO_BODY)]
            {
                let got = check_hello(&header(magic, epoch, claimed, len), &me, taken);
                let ok = claimed == 2 && magic == HELLO && epoch == 5 && len == HELLO_BODY;
                assert_eq!(got.is_ok(), ok, "rank {claimed} magic {magic:#x} epoch {epoch} len {len}: {got:?}");
                if ok {
                    assert_eq!(got, Ok(2));
                }
            }
        }
        let sealed = check_hello(&header(HELLO_SEALED, 5, 2, HELLO_BODY), &me, |_| false).unwrap_err();
        assert!(sealed.contains(&Setting::EncryptData.to_string()), "{sealed}");
        let stale = check_hello(&header(HELLO, 4, 2, HELLO_BODY), &me, |_| false).unwrap_err();
        assert!(stale.contains("epoch 4, current epoch 5"), "{stale}");
        assert_eq!(check_hello(&header(HELLO_SEALED, 5, 2, HELLO_BODY), &r(1, 4, true), |_| false), Ok(2));
    }

    #[test]
    fn refusals_keep_their_first_reasons_and_count_the_rest() {
        let mut f = Refusals::default();
        assert_eq!(f.summary(), "");
        let from = SocketAddr::from(([127, 0, 0, 1], 1));
        for i in 0..100 {
            f.note(from, format!("why {i}"));
        }
        let s = f.summary();
        assert!(s.starts_with("; refused 100 connections: 127.0.0.1:1: why 0;") && s.contains("why 15") && !s.contains("why 16"), "{s}");
    }
}
