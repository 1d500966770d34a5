//! Communication for Lazarus workers: a [`Transport`] trait, a TCP implementation with one
//! connection per pair of ranks, and collectives built on it — all-gather, all-to-all-v with
//! arbitrary per-peer sizes, all-reduce (direct for small buffers, ring for large ones),
//! broadcast, barrier, send/recv of named buffers — over the whole world or any sub-group (e.g.
//! the ranks that hold one expert).
//!
//! Every call takes a timeout and returns a typed [`CommError`] instead of hanging. Frames are
//! stamped with the plan epoch; a frame from an older epoch is rejected (`StaleEpoch`). When a
//! peer's connection drops, the transport tells every other peer (an abort frame), so all ranks
//! learn of the loss within one round trip rather than at their own time-outs.

pub mod auth;
mod collectives;
pub mod cpu_time;
mod error;
pub mod exact;
pub mod pinned;
pub mod tags;
mod tcp;

pub use collectives::{
    all_gather, all_reduce_sum_f32, all_to_all_v, barrier, broadcast, bytes_to_f32, f32_to_bytes, f32_wire, recv_named, send_named, Group,
    RING_THRESHOLD_BYTES,
};
pub use error::CommError;
pub use tcp::{Encode, Fence, Rendezvous, TcpTransport};

use std::time::Instant;

/// The instant `timeout` from now; a timeout too long to represent (years) means "no deadline
/// worth speaking of" rather than an overflow panic.
pub fn deadline_after(timeout: std::time::Duration) -> Instant {
    let now = Instant::now();
    now.checked_add(timeout).or_else(|| now.checked_add(std::time::Duration::from_secs(100 * 365 * 86_400))).unwrap_or(now)
}

/// Run `encode` on this thread: the bytes of an out-of-band frame sent at once.
pub(crate) fn encode_now(size_hint: usize, encode: Encode) -> Result<Vec<u8>, CommError> {
    let mut payload = Vec::with_capacity(size_hint);
    encode(&mut payload).map_err(|reason| CommError::invalid("payload", reason))?;
    Ok(payload)
}

/// Point-to-point messaging between the ranks of one plan epoch.
pub trait Transport: Send {
    fn rank(&self) -> usize;
    fn world(&self) -> usize;
    fn epoch(&self) -> u64;
    /// Send `payload` to `peer` (which may be this rank) under `tag`.
    fn send(&mut self, peer: usize, tag: u64, payload: &[u8], deadline: Instant) -> Result<(), CommError>;
    /// Send an out-of-band frame ([`tags::is_out_of_band`]: a snapshot) to `peer` without
    /// waiting for it to be written: it travels while the caller goes on. A frame that cannot be
    /// delivered closes the connection, so the next collective with `peer` fails. This default
    /// sends it at once.
    fn send_out_of_band(&mut self, peer: usize, tag: u64, payload: Vec<u8>, deadline: Instant) -> Result<(), CommError> {
        self.send(peer, tag, &payload, deadline)
    }
    /// [`Transport::send_out_of_band`] of the bytes `encode` writes (about `size_hint` of
    /// them), run off the caller's thread where the transport has one: a snapshot's copy of an
    /// expert's weights and moments then leaves the training thread as well. Whatever `encode`
    /// reads must stay unchanged until it has run (the caller's to ensure). This default runs it
    /// at once.
    fn send_out_of_band_encoded(
        &mut self,
        peer: usize,
        tag: u64,
        size_hint: usize,
        encode: Encode,
        deadline: Instant,
    ) -> Result<(), CommError> {
        self.send_out_of_band(peer, tag, encode_now(size_hint, encode)?, deadline)
    }
    /// The next message from `peer`; it must carry `tag` (collectives run in the same order on
    /// every rank, so per-peer order is enough).
    fn recv(&mut self, peer: usize, tag: u64, deadline: Instant) -> Result<Vec<u8>, CommError>;
    /// The peers this transport knows to be gone — its own connections that failed and losses
    /// other ranks reported — ascending. What a survivor tells the controller after a step
    /// failed. A transport that cannot lose peers has none.
    fn lost_peers(&mut self) -> Vec<usize> {
        Vec::new()
    }

    /// An out-of-band frame ([`tags::is_out_of_band`]) from `peer` with `tag` that has already
    /// arrived, without waiting — even after the transport failed: a snapshot that got here
    /// before its sender was lost is still good.
    fn take_arrived(&mut self, peer: usize, tag: u64) -> Option<Vec<u8>> {
        let _ = (peer, tag);
        None
    }

    /// Out-of-band frames this rank queued that are not on the wire yet (nor dropped): more than
    /// none when the next round comes says the sender could not keep up. A transport that
    /// sends them at once has none.
    fn out_of_band_backlog(&self) -> usize {
        0
    }

    /// CPU time this rank's transport has spent on out-of-band frames so far (copying, writing
    /// and reading them), added up over its threads. A transport without threads of its own for
    /// them counts none.
    fn out_of_band_cpu(&self) -> std::time::Duration {
        std::time::Duration::ZERO
    }

    /// Give back the buffer of an out-of-band frame this rank received and no longer needs (a
    /// snapshot replaced by a newer one): the next such frame is read into it. This default
    /// drops it.
    fn recycle(&mut self, buffer: Vec<u8>) {
        drop(buffer);
    }
}

/// A one-rank transport: the single-process case runs exactly the same code as N processes.
#[derive(Debug, Default)]
pub struct LocalTransport {
    epoch: u64,
    queue: std::collections::VecDeque<(u64, Vec<u8>)>,
}

impl LocalTransport {
    pub fn new(epoch: u64) -> Self {
        LocalTransport { epoch, queue: Default::default() }
    }
}

impl Transport for LocalTransport {
    fn rank(&self) -> usize {
        0
    }
    fn world(&self) -> usize {
        1
    }
    fn epoch(&self) -> u64 {
        self.epoch
    }
    fn send(&mut self, peer: usize, tag: u64, payload: &[u8], _deadline: Instant) -> Result<(), CommError> {
        if peer != 0 {
            return Err(CommError::invalid("peer", format!("{peer} (world size is 1)")));
        }
        self.queue.push_back((tag, payload.to_vec()));
        Ok(())
    }
    fn recv(&mut self, peer: usize, tag: u64, _deadline: Instant) -> Result<Vec<u8>, CommError> {
        if peer != 0 {
            return Err(CommError::invalid("peer", format!("{peer} (world size is 1)")));
        }
        match self.queue.pop_front() {
            Some((t, p)) if t == tag => Ok(p),
            Some((t, _)) => Err(CommError::Protocol { peer, reason: format!("expected tag {tag:#x}, got {t:#x}") }),
            None => Err(CommError::Protocol { peer, reason: "receive from self with nothing sent".into() }),
        }
    }
}
