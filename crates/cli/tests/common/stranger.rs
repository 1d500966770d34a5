//! A stranger on the job's network: a thread without the job's secret that watches a tree of
//! processes (a launcher and its workers, or a test's controller and agents and theirs), finds
//! every TCP port one of them listens on as it opens (from /proc), and connects to it in every
//! hostile way the controller's and the ranks' guards exist for — silently (held open), with
//! garbage, with the first byte of a TLS handshake and nothing more, and a byte every 100 ms —
//! from a host of its own (a network namespace) or from loopback. Long-lived ports (the
//! controller's, `/metrics`) are visited again every so often; the connections it holds are
//! bounded, the oldest let go first.
#![allow(dead_code)] // each test file uses part of it

use std::collections::{BTreeMap, BTreeSet, VecDeque};
use std::io::Write;
use std::net::{Ipv4Addr, SocketAddr, TcpStream};
use std::sync::atomic::{AtomicBool, AtomicUsize, Ordering};
use std::sync::Arc;
use std::time::{Duration, Instant};

use super::hosts::children;

/// The IPv4 TCP sockets process `pid` listens on (in LISTEN, from /proc): address and port.
pub fn listening(pid: i32) -> BTreeSet<(Ipv4Addr, u16)> {
    let inodes: BTreeSet<String> = std::fs::read_dir(format!("/proc/{pid}/fd"))
        .map(|d| {
            d.flatten()
                .filter_map(|e| std::fs::read_link(e.path()).ok())
                .filter_map(|l| l.to_str().and_then(|s| s.strip_prefix("socket:[")).map(|s| s.trim_end_matches(']').to_string()))
                .collect()
        })
        .unwrap_or_default();
    let table = std::fs::read_to_string(format!("/proc/{pid}/net/tcp")).unwrap_or_default();
    table
        .lines()
        .skip(1)
        .filter_map(|row| {
            let f: Vec<&str> = row.split_whitespace().collect();
            // local_address (hex, the address's bytes in host order), state 0A (LISTEN), inode
            if f.len() <= 9 || f[3] != "0A" || !inodes.contains(f[9]) {
                return None;
            }
            let (ip, port) = f[1].split_once(':')?;
            let ip = Ipv4Addr::from(u32::from_str_radix(ip, 16).ok()?.to_le_bytes());
            Some((ip, u16::from_str_radix(port, 16).ok()?))
        })
        .collect()
}

/// `pid` and every process below it.
pub fn descendants(pid: i32) -> Vec<i32> {
    let mut all = vec![pid];
    let mut at = 0;
    while at < all.len() {
        all.extend(children(all[at]));
        at += 1;
    }
    all
}

/// What a stranger does.
pub struct Plan {
    /// The root of the process tree it watches.
    pub root: i32,
    /// The network namespace it connects from (`/run/netns/NAME`); loopback if None.
    pub netns: Option<String>,
    /// Silent connections to each port it finds, besides one of garbage, one that sends 0x16
    /// and stops, and one that trickles.
    pub silent: usize,
    /// Visit a port that still listens again this long after the last visit (None: once).
    pub again: Option<Duration>,
    /// Connections held at most (the oldest let go first).
    pub hold: usize,
}

/// What a stranger did.
#[derive(Debug, Default, Clone, Copy)]
pub struct Done {
    /// Distinct ports found.
    pub ports: usize,
    /// Visits (a port's first and each later one).
    pub visits: usize,
    /// Connections that got in (each while its port listened).
    pub got_in: usize,
}

/// A running stranger; [`Stranger::stop`] ends it.
pub struct Stranger {
    stop: Arc<AtomicBool>,
    counts: Arc<[AtomicUsize; 3]>,
    thread: Option<std::thread::JoinHandle<()>>,
}

/// Enter network namespace `name` (this thread only).
fn enter(name: &str) -> std::io::Result<()> {
    use std::os::fd::AsRawFd;
    let f = std::fs::File::open(format!("/run/netns/{name}"))?;
    // SAFETY: setns on a namespace file this thread opened; it moves this thread alone.
    if unsafe { libc::setns(f.as_raw_fd(), libc::CLONE_NEWNET) } != 0 {
        return Err(std::io::Error::last_os_error());
    }
    Ok(())
}

impl Stranger {
    pub fn start(plan: Plan) -> Self {
        let stop = Arc::new(AtomicBool::new(false));
        let counts: Arc<[AtomicUsize; 3]> = Arc::new(Default::default());
        let thread = {
            let (stop, counts) = (stop.clone(), counts.clone());
            std::thread::spawn(move || {
                if let Some(ns) = &plan.netns {
                    enter(ns).unwrap_or_else(|e| panic!("the stranger enters network namespace {ns}: {e}"));
                }
                watch(&plan, &stop, &counts)
            })
        };
        Stranger { stop, counts, thread: Some(thread) }
    }

    /// What it did so far.
    pub fn done(&self) -> Done {
        let c = |i: usize| self.counts[i].load(Ordering::Relaxed);
        Done { ports: c(0), visits: c(1), got_in: c(2) }
    }

    /// Stop (its connections close); what it did.
    pub fn stop(mut self) -> Done {
        self.stop.store(true, Ordering::Relaxed);
        if let Some(t) = self.thread.take() {
            let _ = t.join();
        }
        self.done()
    }
}

impl Drop for Stranger {
    fn drop(&mut self) {
        self.stop.store(true, Ordering::Relaxed);
    }
}

fn watch(plan: &Plan, stop: &AtomicBool, counts: &[AtomicUsize; 3]) {
    let mut last_visit: BTreeMap<(Ipv4Addr, u16), Instant> = BTreeMap::new();
    let mut held: VecDeque<TcpStream> = VecDeque::new();
    let mut trickled: VecDeque<TcpStream> = VecDeque::new();
    let mut tick = 0u64;
    while !stop.load(Ordering::Relaxed) {
        for pid in descendants(plan.root) {
            for (ip, port) in listening(pid) {
                let due = match last_visit.get(&(ip, port)) {
                    None => {
                        counts[0].fetch_add(1, Ordering::Relaxed);
                        true
                    }
                    Some(t) => plan.again.is_some_and(|a| t.elapsed() >= a),
                };
                if !due {
                    continue;
                }
                last_visit.insert((ip, port), Instant::now());
                counts[1].fetch_add(1, Ordering::Relaxed);
                let ip = if ip.is_unspecified() { Ipv4Addr::LOCALHOST } else { ip };
                visit(SocketAddr::from((ip, port)), plan.silent, &mut held, &mut trickled, &counts[2]);
                while held.len() + trickled.len() > plan.hold {
                    if held.pop_front().is_none() {
                        trickled.pop_front();
                    }
                }
            }
        }
        tick += 1;
        if tick.is_multiple_of(50) {
            // "LZH1", then zeroes: a byte every ~100 ms on each trickling connection.
            let b = [0x31u8, 0x48, 0x5a, 0x4c].get((tick / 50) as usize).copied().unwrap_or(0);
            trickled.retain_mut(|s| s.write_all(&[b]).is_ok());
        }
        std::thread::sleep(Duration::from_millis(2));
    }
}

/// The connections of one visit to `addr`: garbage, a trickle, one TLS byte, `silent` silent.
fn visit(addr: SocketAddr, silent: usize, held: &mut VecDeque<TcpStream>, trickled: &mut VecDeque<TcpStream>, got_in: &AtomicUsize) {
    for i in 0..silent + 3 {
        let Ok(mut s) = TcpStream::connect_timeout(&addr, Duration::from_millis(500)) else { break };
        got_in.fetch_add(1, Ordering::Relaxed);
        match i {
            0 => {
                let _ = s.write_all(&[0xAB; 300]);
                held.push_back(s);
            }
            1 => trickled.push_back(s),
            2 => {
                let _ = s.write_all(&[0x16]);
                held.push_back(s);
            }
            _ => held.push_back(s),
        }
    }
}
