//! A hostile network, with real processes and real sockets on loopback: a stranger (a process
//! without the job's secret) that finds the workers' ports as they open and connects to each —
//! silently, a byte at a time, with garbage — must neither stall nor end the job.

mod common;

use std::collections::BTreeSet;
use std::io::Write;
use std::net::TcpStream;
use std::sync::atomic::{AtomicBool, AtomicUsize, Ordering};
use std::sync::Arc;
use std::time::Duration;

use common::hosts::children;
use common::{assert_same_losses, dir, log, signal, spawn_lazarus, uninterrupted, wait, wait_for_steps, worker_pids};

/// The TCP ports process `pid` listens on (its sockets in LISTEN, from /proc).
fn listening_ports(pid: i32) -> BTreeSet<u16> {
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
            // local_address, state 0A (LISTEN), inode
            (f.len() > 9 && f[3] == "0A" && inodes.contains(f[9])).then(|| u16::from_str_radix(f[1].rsplit(':').next()?, 16).ok()).flatten()
        })
        .collect()
}

/// A stranger that watches process `launcher`'s children and, at every port one of them opens,
/// connects `silent` times and leaves the connections silent, sends one of garbage, and
/// trickles one a byte every 100 ms. Counts the connections it got in (each made while the
/// port listened, that is, while its rank's rendezvous was under way).
struct Stranger {
    stop: Arc<AtomicBool>,
    got_in: Arc<AtomicUsize>,
    ports: Arc<AtomicUsize>,
    thread: Option<std::thread::JoinHandle<()>>,
}

impl Stranger {
    fn start(launcher: i32, silent: usize) -> Self {
        let (stop, got_in, ports) = (Arc::new(AtomicBool::new(false)), Arc::new(AtomicUsize::new(0)), Arc::new(AtomicUsize::new(0)));
        let thread = {
            let (stop, got_in, ports) = (stop.clone(), got_in.clone(), ports.clone());
            std::thread::spawn(move || {
                let mut seen = BTreeSet::new();
                let mut held: Vec<TcpStream> = Vec::new();
                let mut trickled: Vec<TcpStream> = Vec::new();
                let mut tick = 0u64;
                while !stop.load(Ordering::Relaxed) {
                    for pid in children(launcher) {
                        for port in listening_ports(pid) {
                            if !seen.insert(port) {
                                continue;
                            }
                            ports.fetch_add(1, Ordering::Relaxed);
                            for i in 0..silent + 2 {
                                let Ok(mut s) = TcpStream::connect(("127.0.0.1", port)) else { break };
                                got_in.fetch_add(1, Ordering::Relaxed);
                                match i {
                                    0 => {
                                        let _ = s.write_all(&[0xAB; 300]);
                                        held.push(s);
                                    }
                                    1 => trickled.push(s),
                                    _ => held.push(s),
                                }
                            }
                        }
                    }
                    tick += 1;
                    if tick.is_multiple_of(50) {
                        // "LZH1", then zeroes: a byte every 100 ms on each trickling connection.
                        let b = [0x31u8, 0x48, 0x5a, 0x4c].get((tick / 50) as usize).copied().unwrap_or(0);
                        trickled.retain_mut(|s| s.write_all(&[b]).is_ok());
                    }
                    std::thread::sleep(Duration::from_millis(2));
                }
            })
        };
        Stranger { stop, got_in, ports, thread: Some(thread) }
    }

    /// Stop; how many ports it found and how many connections it got in.
    fn stop(mut self) -> (usize, usize) {
        self.stop.store(true, Ordering::Relaxed);
        if let Some(t) = self.thread.take() {
            let _ = t.join();
        }
        (self.ports.load(Ordering::Relaxed), self.got_in.load(Ordering::Relaxed))
    }
}

/// A stranger at every worker port as it opens — at the start and at the rendezvous of the
/// move after a worker's SIGKILL — with 20 silent connections, one of garbage and one that
/// trickles: the job runs to its end with every step once and the losses of an uninterrupted
/// run. (A rank that took its peers' hellos one connection at a time, 2 s each, ran past its
/// 30-s rendezvous deadline behind them, and the job ended.)
#[test]
fn strangers_at_the_workers_ports_neither_stall_nor_end_the_job() {
    let d = dir("hostile-worker-ports");
    let path = d.join("log.jsonl");
    let want = uninterrupted("120", &d);
    let mut args = vec!["train", "--workers", "4", "--steps", "120", "--json-log", path.to_str().unwrap()];
    args.extend(common::tiny_model("8"));
    // Every rendezvous holds 300 ms once its port is open (LAZARUS_FAULT=listen:300): the
    // stranger, which looks every few ms, is at every port before the ranks connect.
    let (mut job, lines) = spawn_lazarus(&args, &[("LAZARUS_FAULT", "pace:10,listen:300")]);
    let stranger = Stranger::start(job.id() as i32, 20);
    let pids = worker_pids(&lines, 4, |_| {});
    // A move, with a rendezvous of new ports. (One: a second loss here could take every
    // replica of an expert, which then comes back from a snapshot a few steps stale — by
    // design, and no longer the uninterrupted run's losses.)
    wait_for_steps(&path, 20);
    signal(pids[3], libc::SIGKILL);
    let text = wait::job_success(&mut job, &lines, &path, "the job with a stranger at its workers' ports");
    let (ports, got_in) = stranger.stop();
    let (steps, moves) = log(&path);
    assert_same_losses(&steps, &want, "a stranger at every worker port");
    assert_eq!(moves.len(), 1, "one move, no rollback: {moves:?}\n{}", wait::tail(&text));
    eprintln!("the stranger found {ports} ports and got {got_in} connections in while they listened");
    // Each of the 3 accepting ports of the start and the 2 of the move: 22 connections.
    assert!(got_in >= 5 * 22, "the stranger got {got_in} connections in while ranks listened, of 110: it missed a rendezvous");
    let _ = std::fs::remove_dir_all(&d);
}
