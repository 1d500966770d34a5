//! The controller's listener, guarded: connections that cannot hurt it. The TLS handshake is
//! the controller's own, with a deadline: a client must finish it within [`HANDSHAKE_WITHIN`]
//! or it is closed — one that sends a byte and stops, or trickles, is not held. Handshakes under
//! way are bounded per peer address ([`PENDING_PER_PEER`]) and in all (half the controller's file
//! descriptors are its connections at most); at a bound the **oldest handshake under way** of
//! that peer (or of all) is dropped to make room, never the newcomer: an honest client finishes
//! its handshake in a round trip, so it is the newest, and a flood of silent connections from
//! its own address (a NAT, the same host) cannot lock it out. Without this a few hundred
//! half-open connections (a scanner, a stuck client, an attack) took every descriptor, and 33
//! silent connections from one address kept `lazarus status` from that address out. Dead peers
//! of live sessions are found out by HTTP/2 keepalives (set on the server).

use std::collections::{HashMap, VecDeque};
use std::net::IpAddr;
use std::pin::Pin;
use std::sync::{Arc, Mutex};
use std::task::{Context, Poll};
use std::time::Duration;

use tokio::io::{AsyncRead, AsyncWrite, ReadBuf};
use tokio::net::{TcpListener, TcpStream};
use tokio::task::AbortHandle;
use tokio_rustls::server::TlsStream;
use tokio_rustls::TlsAcceptor;
use tonic::transport::server::{Connected, TcpConnectInfo};

/// How long a new connection has to finish its TLS handshake.
pub const HANDSHAKE_WITHIN: Duration = Duration::from_secs(5);
/// Handshakes under way from one peer address, at most.
pub const PENDING_PER_PEER: usize = 32;

/// Open connections, and the handshakes under way (by peer, and in the order they began).
#[derive(Default)]
struct Counts {
    open: usize,
    next: u64,
    pending: HashMap<IpAddr, VecDeque<(u64, Option<AbortHandle>)>>,
    /// Every handshake under way, oldest first (entries of finished ones are skipped).
    order: VecDeque<(u64, IpAddr)>,
}

impl Counts {
    fn pending_of(&self, ip: &IpAddr) -> usize {
        self.pending.get(ip).map_or(0, VecDeque::len)
    }

    /// Drop the oldest handshake under way of `ip` (any peer's: None): its entry goes, and its
    /// task's handle comes back, to be aborted once the counts are let go (its slot's drop takes
    /// them). Whether there was one.
    fn evict_oldest(&mut self, ip: Option<IpAddr>, aborts: &mut Vec<AbortHandle>) -> bool {
        let victim = match ip {
            Some(ip) => self.pending.get(&ip).and_then(|q| q.front()).map(|(id, _)| (*id, ip)),
            None => loop {
                let Some((id, ip)) = self.order.pop_front() else { break None };
                if self.pending.get(&ip).is_some_and(|q| q.iter().any(|(i, _)| *i == id)) {
                    break Some((id, ip));
                }
            },
        };
        let Some((id, ip)) = victim else { return false };
        aborts.extend(self.finish(id, ip));
        true
    }

    /// The handshake `id` of `ip` is over (done, failed or dropped): its entry goes; its task's
    /// handle, if it had one.
    fn finish(&mut self, id: u64, ip: IpAddr) -> Option<AbortHandle> {
        let q = self.pending.get_mut(&ip)?;
        let at = q.iter().position(|(i, _)| *i == id)?;
        let (_, handle) = q.remove(at)?;
        if q.is_empty() {
            self.pending.remove(&ip);
        }
        handle
    }
}

/// A connection's place in the counts, given back when it is dropped (a handshake that failed
/// or was dropped, or the server done with the connection).
struct Slot {
    id: u64,
    ip: IpAddr,
    counts: Arc<Mutex<Counts>>,
}

impl Drop for Slot {
    fn drop(&mut self) {
        let mut c = self.counts.lock().unwrap_or_else(|e| e.into_inner());
        c.open = c.open.saturating_sub(1);
        c.finish(self.id, self.ip);
    }
}

/// A connection handed to the server: its TLS stream, and its place in the counts.
pub struct Guarded {
    stream: TlsStream<TcpStream>,
    _slot: Slot,
}

impl Connected for Guarded {
    type ConnectInfo = TcpConnectInfo;

    fn connect_info(&self) -> TcpConnectInfo {
        self.stream.get_ref().0.connect_info()
    }
}

impl AsyncRead for Guarded {
    fn poll_read(mut self: Pin<&mut Self>, cx: &mut Context<'_>, buf: &mut ReadBuf<'_>) -> Poll<std::io::Result<()>> {
        Pin::new(&mut self.stream).poll_read(cx, buf)
    }
}

impl AsyncWrite for Guarded {
    fn poll_write(mut self: Pin<&mut Self>, cx: &mut Context<'_>, buf: &[u8]) -> Poll<std::io::Result<usize>> {
        Pin::new(&mut self.stream).poll_write(cx, buf)
    }

    fn poll_flush(mut self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<std::io::Result<()>> {
        Pin::new(&mut self.stream).poll_flush(cx)
    }

    fn poll_shutdown(mut self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<std::io::Result<()>> {
        Pin::new(&mut self.stream).poll_shutdown(cx)
    }
}

/// The most connections the controller keeps open: half its file descriptors (the rest are
/// its files, pipes and processes).
fn most_open() -> usize {
    let mut lim = libc::rlimit { rlim_cur: 0, rlim_max: 0 };
    // SAFETY: getrlimit writes the struct it is given.
    let soft = if unsafe { libc::getrlimit(libc::RLIMIT_NOFILE, &mut lim) } == 0 { lim.rlim_cur as usize } else { 1024 };
    (soft / 2).clamp(16, 65_536)
}

/// Accept from `listener` forever, handing the server (through the returned stream) every
/// connection whose TLS handshake (`tls`) finished in time; the others are closed.
pub fn incoming(listener: TcpListener, tls: TlsAcceptor) -> tokio_stream::wrappers::ReceiverStream<Result<Guarded, std::io::Error>> {
    let (tx, rx) = tokio::sync::mpsc::channel(64);
    let counts = Arc::new(Mutex::new(Counts::default()));
    let most = most_open();
    tokio::spawn(async move {
        loop {
            let (stream, peer) = match listener.accept().await {
                Ok(x) => x,
                Err(e) => {
                    // Out of descriptors, say: wait a little rather than spin.
                    tracing::debug!("accept: {e}");
                    tokio::time::sleep(Duration::from_millis(50)).await;
                    continue;
                }
            };
            let ip = peer.ip();
            let mut aborts = Vec::new();
            let id = {
                let mut c = counts.lock().unwrap_or_else(|e| e.into_inner());
                if c.pending_of(&ip) >= PENDING_PER_PEER {
                    c.evict_oldest(Some(ip), &mut aborts);
                    tracing::debug!("dropped the oldest unfinished handshake of {ip} for a connection from {peer}");
                }
                if c.open >= most && !c.evict_oldest(None, &mut aborts) {
                    // Every connection is an established session: the newcomer waits for room.
                    tracing::debug!("closed a connection from {peer}: {} open, none of them unfinished", c.open);
                    continue;
                }
                c.open += 1;
                c.next += 1;
                let id = c.next;
                c.pending.entry(ip).or_default().push_back((id, None));
                c.order.push_back((id, ip));
                id
            };
            for a in aborts {
                a.abort();
            }
            let slot = Slot { id, ip, counts: counts.clone() };
            let (tx, tls) = (tx.clone(), tls.clone());
            let task = tokio::spawn(async move {
                match tokio::time::timeout(HANDSHAKE_WITHIN, tls.accept(stream)).await {
                    Ok(Ok(stream)) => {
                        slot.counts.lock().unwrap_or_else(|e| e.into_inner()).finish(slot.id, slot.ip);
                        let _ = tx.send(Ok(Guarded { stream, _slot: slot })).await;
                    }
                    Ok(Err(e)) => tracing::debug!("closed a connection from {peer}: TLS handshake: {e}"),
                    Err(_) => tracing::debug!("closed a connection from {peer}: no TLS handshake within {} s", HANDSHAKE_WITHIN.as_secs()),
                }
            });
            // Its handle, for a drop to make room (unless it is over already).
            let mut c = counts.lock().unwrap_or_else(|e| e.into_inner());
            if let Some(entry) = c.pending.get_mut(&ip).and_then(|q| q.iter_mut().find(|(i, _)| *i == id)) {
                entry.1 = Some(task.abort_handle());
            }
        }
    });
    tokio_stream::wrappers::ReceiverStream::new(rx)
}

#[cfg(test)]
mod tests {
    use super::*;

    /// The bookkeeping alone: the oldest of a peer goes first, then the oldest of all; what is
    /// over is never dropped twice.
    #[test]
    fn the_oldest_unfinished_handshake_is_dropped_first() {
        let mut c = Counts::default();
        let (a, b): (IpAddr, IpAddr) = ("10.0.0.1".parse().unwrap(), "10.0.0.2".parse().unwrap());
        for (id, ip) in [(1, a), (2, b), (3, a), (4, b)] {
            c.pending.entry(ip).or_default().push_back((id, None));
            c.order.push_back((id, ip));
        }
        let mut aborts = Vec::new();
        assert!(c.evict_oldest(Some(a), &mut aborts));
        assert_eq!(c.pending[&a].iter().map(|e| e.0).collect::<Vec<_>>(), vec![3]);
        // 1 is gone already: the oldest of all is 2.
        assert!(c.evict_oldest(None, &mut aborts));
        assert_eq!(c.pending[&b].iter().map(|e| e.0).collect::<Vec<_>>(), vec![4]);
        assert!(c.finish(4, b).is_none() && !c.pending.contains_key(&b));
        assert!(c.evict_oldest(None, &mut aborts));
        assert!(!c.evict_oldest(None, &mut aborts), "none left");
        assert_eq!(c.pending_of(&a), 0);
    }
}
