//! The controller's listener, guarded: connections that cannot hurt it. A client must begin its
//! HTTP/2 handshake within [`HANDSHAKE_WITHIN`] or it is closed; one peer may hold at most
//! [`PENDING_PER_PEER`] connections that have not begun it yet, and the controller at most
//! half its file descriptors in connections. Without this a few hundred half-open connections
//! (a scanner, a stuck client, an attack) take every descriptor, and `lazarus status` and
//! legitimate agents cannot connect. Dead peers of live sessions are found out by HTTP/2
//! keepalives (set on the server).

use std::collections::HashMap;
use std::net::IpAddr;
use std::pin::Pin;
use std::sync::{Arc, Mutex};
use std::task::{Context, Poll};
use std::time::Duration;

use tokio::io::{AsyncRead, AsyncWrite, ReadBuf};
use tokio::net::{TcpListener, TcpStream};
use tonic::transport::server::{Connected, TcpConnectInfo};

/// How long a new connection has to send its first bytes (the HTTP/2 preface).
pub const HANDSHAKE_WITHIN: Duration = Duration::from_secs(5);
/// Connections of one peer address that have not begun their handshake, at most.
pub const PENDING_PER_PEER: usize = 32;

/// Open connections, and those of each peer still before their handshake.
#[derive(Default)]
struct Counts {
    open: usize,
    pending: HashMap<IpAddr, usize>,
}

/// A connection handed to the server: the socket, and its place in the counts (given back when
/// the server drops it).
pub struct Guarded {
    stream: TcpStream,
    counts: Arc<Mutex<Counts>>,
}

impl Drop for Guarded {
    fn drop(&mut self) {
        let mut c = self.counts.lock().unwrap_or_else(|e| e.into_inner());
        c.open = c.open.saturating_sub(1);
    }
}

impl Connected for Guarded {
    type ConnectInfo = TcpConnectInfo;

    fn connect_info(&self) -> TcpConnectInfo {
        self.stream.connect_info()
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
/// connection that began its handshake in time and fits the limits; the others are closed.
pub fn incoming(listener: TcpListener) -> tokio_stream::wrappers::ReceiverStream<Result<Guarded, std::io::Error>> {
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
            {
                let mut c = counts.lock().unwrap_or_else(|e| e.into_inner());
                let pending = c.pending.get(&ip).copied().unwrap_or(0);
                if c.open >= most || pending >= PENDING_PER_PEER {
                    tracing::debug!("closed a connection from {peer}: {} open, {pending} of its own not begun", c.open);
                    continue; // dropped: closed at once
                }
                c.open += 1;
                *c.pending.entry(ip).or_default() += 1;
            }
            let guarded = Guarded { stream, counts: counts.clone() };
            let (tx, counts) = (tx.clone(), counts.clone());
            tokio::spawn(async move {
                let mut first = [0u8; 1];
                let began = matches!(tokio::time::timeout(HANDSHAKE_WITHIN, guarded.stream.peek(&mut first)).await, Ok(Ok(n)) if n > 0);
                {
                    let mut c = counts.lock().unwrap_or_else(|e| e.into_inner());
                    if let Some(p) = c.pending.get_mut(&ip) {
                        *p = p.saturating_sub(1);
                        if *p == 0 {
                            c.pending.remove(&ip);
                        }
                    }
                }
                if began {
                    let _ = tx.send(Ok(guarded)).await;
                } else {
                    tracing::debug!("closed a connection from {peer}: no handshake within {} s", HANDSHAKE_WITHIN.as_secs());
                }
            });
        }
    });
    tokio_stream::wrappers::ReceiverStream::new(rx)
}
