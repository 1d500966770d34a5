//! Real processes on loopback: four ranks run all-reduces in a loop; one is killed with SIGKILL
//! mid-collective; every survivor must return `PeerLost` within 2 s — no hang, no panic — and
//! name rank 2, and only rank 2, among its lost peers.
//!
//! The peers are this test binary itself, started with `LAZARUS_COMM_PEER=1` to run
//! [`peer_process`] (a no-op in a normal test run).

use std::io::{BufRead, BufReader, Write};
use std::net::{SocketAddr, TcpListener};
use std::process::{Command, Stdio};
use std::sync::mpsc;
use std::time::{Duration, Instant};

use lazarus_comm::{all_reduce_sum_f32, CommError, Group, Rendezvous, TcpTransport};

#[test]
fn peer_process() {
    if std::env::var("LAZARUS_COMM_PEER").is_err() {
        return;
    }
    let rank: usize = std::env::var("LAZARUS_COMM_RANK").unwrap().parse().unwrap();
    let listener = TcpListener::bind("127.0.0.1:0").unwrap();
    println!("PORT {}", listener.local_addr().unwrap().port());
    std::io::stdout().flush().unwrap();
    let mut line = String::new();
    std::io::stdin().read_line(&mut line).unwrap();
    let addrs: Vec<SocketAddr> = line.trim().split(',').map(|a| a.parse().unwrap()).collect();
    let world = addrs.len();
    let mut t = TcpTransport::connect(listener, Rendezvous::new(rank, addrs, 1, Duration::from_secs(20))).unwrap();
    let mut g = Group::world(world);
    let mut buf = vec![1.0f32; 1 << 20];
    for step in 0.. {
        match all_reduce_sum_f32(&mut t, &mut g, &mut buf, Duration::from_secs(30)) {
            Ok(()) => {
                buf.iter_mut().for_each(|x| *x = 1.0);
                println!("STEP {step}");
            }
            Err(e) => {
                let kind = match e {
                    CommError::PeerLost { .. } => "PeerLost",
                    CommError::Timeout { .. } => "Timeout",
                    _ => "Other",
                };
                use lazarus_comm::Transport;
                println!("ERR {kind} {e} LOST {:?}", t.lost_peers());
                std::io::stdout().flush().unwrap();
                // Stay until the test ends (it closes stdin, then kills us): a survivor that
                // exited here would close its connections, and a slower survivor would find
                // it lost too — a race of the test, not of the transport.
                let _ = std::io::stdin().read_line(&mut String::new());
                return;
            }
        }
        std::io::stdout().flush().unwrap();
    }
}

#[test]
fn sigkill_mid_collective_gives_peer_lost_within_two_seconds() {
    let exe = std::env::current_exe().unwrap();
    let world = 4;
    let mut children = Vec::new();
    let (tx, rx) = mpsc::channel::<(usize, String, Instant)>();
    let mut ports = vec![0u16; world];
    let mut stdins = Vec::new();
    for rank in 0..world {
        let mut child = Command::new(&exe)
            .args(["--exact", "peer_process", "--nocapture", "--test-threads=1"])
            .env("LAZARUS_COMM_PEER", "1")
            .env("LAZARUS_COMM_RANK", rank.to_string())
            .stdin(Stdio::piped())
            .stdout(Stdio::piped())
            .stderr(Stdio::null())
            .spawn()
            .unwrap();
        let stdout = child.stdout.take().unwrap();
        stdins.push(child.stdin.take().unwrap());
        let tx = tx.clone();
        std::thread::spawn(move || {
            for line in BufReader::new(stdout).lines().map_while(Result::ok) {
                let _ = tx.send((rank, line, Instant::now()));
            }
        });
        children.push(child);
    }
    let deadline = Instant::now() + Duration::from_secs(60);
    let mut got = 0;
    while got < world {
        let (rank, line, _) = rx.recv_timeout(deadline - Instant::now()).expect("peers report their ports");
        // The test harness prints "test peer_process ... " before the peer's first line.
        if let Some(i) = line.find("PORT ") {
            ports[rank] = line[i + 5..].trim().parse().unwrap();
            got += 1;
        }
    }
    let addrs: Vec<String> = ports.iter().map(|p| format!("127.0.0.1:{p}")).collect();
    for s in &mut stdins {
        writeln!(s, "{}", addrs.join(",")).unwrap();
    }
    // Wait until every rank has completed a few all-reduces, then kill rank 2.
    let mut steps = vec![0usize; world];
    while steps.iter().any(|&s| s < 3) {
        let (rank, line, _) = rx.recv_timeout(deadline - Instant::now()).expect("peers make progress");
        if line.starts_with("STEP ") {
            steps[rank] += 1;
        }
        assert!(!line.starts_with("ERR"), "rank {rank} failed early: {line}");
    }
    children[2].kill().unwrap(); // SIGKILL on Unix
    let killed_at = Instant::now();
    let mut outcome: Vec<Option<(String, Duration)>> = vec![None; world];
    while outcome.iter().enumerate().filter(|(r, o)| *r != 2 && o.is_none()).count() > 0 {
        let Ok((rank, line, at)) = rx.recv_timeout(Duration::from_secs(10)) else { break };
        if line.starts_with("ERR") && rank != 2 {
            outcome[rank] = Some((line, at.saturating_duration_since(killed_at)));
        }
    }
    drop(stdins);
    for mut c in children {
        let _ = c.kill();
        let _ = c.wait();
    }
    for (rank, o) in outcome.iter().enumerate() {
        if rank == 2 {
            continue;
        }
        let (line, after) = o.as_ref().unwrap_or_else(|| panic!("rank {rank} never reported an error"));
        assert!(line.starts_with("ERR PeerLost"), "rank {rank}: {line}");
        // What a survivor would tell the controller: rank 2, and nobody else, is gone.
        assert!(line.ends_with("LOST [2]"), "rank {rank}: {line}");
        assert!(*after < Duration::from_secs(2), "rank {rank} took {after:?}");
        eprintln!("rank {rank}: {line} after {after:?}");
    }
}
