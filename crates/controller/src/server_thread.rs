//! A server that runs on a thread of its own (the status server, the metrics server): told to
//! stop and joined when dropped, so that a job's end closes its ports.

use std::net::SocketAddr;
use std::thread::JoinHandle;

pub(crate) struct ServerThread {
    addr: SocketAddr,
    stop: Option<tokio::sync::watch::Sender<bool>>,
    thread: Option<JoinHandle<()>>,
}

impl ServerThread {
    /// The server listening at `addr` on `thread`, which stops once `stop` says true.
    pub(crate) fn new(addr: SocketAddr, stop: tokio::sync::watch::Sender<bool>, thread: JoinHandle<()>) -> Self {
        ServerThread { addr, stop: Some(stop), thread: Some(thread) }
    }

    pub(crate) fn addr(&self) -> SocketAddr {
        self.addr
    }
}

impl Drop for ServerThread {
    fn drop(&mut self) {
        if let Some(s) = self.stop.take() {
            let _ = s.send(true);
        }
        if let Some(t) = self.thread.take() {
            let _ = t.join();
        }
    }
}
