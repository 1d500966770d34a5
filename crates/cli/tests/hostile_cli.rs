//! A hostile network, with real processes and real sockets on loopback: a stranger (a process
//! without the job's secret) that finds the workers' ports as they open and connects to each —
//! silently, a byte at a time, with garbage — must neither stall nor end the job.

mod common;

use std::io::Write;
use std::net::TcpStream;
use std::time::Duration;

use common::stranger::{Plan, Stranger};
use common::{assert_same_losses, dir, files, log, signal, spawn_lazarus, uninterrupted, wait, wait_for_steps, worker_pids};

/// A stranger at every worker port as it opens — at the start and at the rendezvous of the
/// move after a worker's SIGKILL — with 20 silent connections, one of garbage, one TLS byte and one that
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
    let stranger = Stranger::start(Plan { root: job.id() as i32, netns: None, silent: 20, again: None, hold: usize::MAX });
    let pids = worker_pids(&lines, 4, |_| {});
    // A move, with a rendezvous of new ports. (One: a second loss here could take every
    // replica of an expert, which then comes back from a snapshot a few steps stale — by
    // design, and no longer the uninterrupted run's losses.)
    wait_for_steps(&path, 20);
    signal(pids[3], libc::SIGKILL);
    let text = wait::job_success(&mut job, &lines, &path, "the job with a stranger at its workers' ports");
    let common::stranger::Done { ports, got_in, .. } = stranger.stop();
    let (steps, moves) = log(&path);
    assert_same_losses(&steps, &want, "a stranger at every worker port");
    assert_eq!(moves.len(), 1, "one move, no rollback: {moves:?}\n{}", wait::tail(&text));
    eprintln!("the stranger found {ports} ports and got {got_in} connections in while they listened");
    // Each of the 3 accepting ports of the start and the 2 of the move: 23 connections.
    assert!(got_in >= 5 * 23, "the stranger got {got_in} connections in while ranks listened, of 115: it missed a rendezvous");
}

/// The flags of a `lazarus controller` job of two nodes of one GPU, `steps` steps of the tiny
/// model, with its secret file and log.
fn two_nodes_of_one<'a>(secret_s: &'a str, log_s: &'a str, steps: &'a str) -> Vec<&'a str> {
    let mut args = vec!["--listen", "127.0.0.1:0", "--secret-file", secret_s, "--workers", "2", "--gpus-per-node", "1"];
    args.extend(common::tiny_model("8"));
    args.extend(["--steps", steps, "--json-log", log_s]);
    args
}

/// `lazarus controller ARGS` with at most `fds` open files (so that half of them, the most
/// connections it keeps, is reached by a test's strangers); its stderr lines and address.
fn controller_with_fd_limit(args: &[&str], fds: u64) -> (std::process::Child, std::sync::mpsc::Receiver<String>, String) {
    use std::os::unix::process::CommandExt;
    let mut cmd = common::lazarus_command();
    cmd.arg("controller").args(args).stdout(std::process::Stdio::null()).stderr(std::process::Stdio::piped());
    // SAFETY: only setrlimit between fork and exec.
    unsafe {
        cmd.pre_exec(move || {
            let lim = libc::rlimit { rlim_cur: fds, rlim_max: fds };
            libc::setrlimit(libc::RLIMIT_NOFILE, &lim);
            Ok(())
        });
    }
    let mut child = cmd.spawn().unwrap();
    let lines = common::stderr_lines(&mut child);
    let line = wait::line(&lines, "the controller to listen", Duration::from_secs(60), &mut Vec::new(), |l| {
        l.starts_with("controller listening on ")
    });
    let addr = line["controller listening on ".len()..].split(':').take(2).collect::<Vec<_>>().join(":");
    (child, lines, addr)
}

/// Whether `s` was closed by the other end by `until` (a read sees EOF or a reset).
fn closed_by(s: &mut TcpStream, until: std::time::Instant) -> bool {
    use std::io::Read;
    let mut b = [0u8; 256];
    loop {
        let left = until.saturating_duration_since(std::time::Instant::now());
        if left.is_zero() {
            return false;
        }
        s.set_read_timeout(Some(left)).unwrap();
        match s.read(&mut b) {
            Ok(0) => return true,
            Ok(_) => continue,
            Err(e) if e.kind() == std::io::ErrorKind::WouldBlock || e.kind() == std::io::ErrorKind::TimedOut => return false,
            Err(_) => return true,
        }
    }
}

/// 130 connections to the controller that each send the first byte of a TLS handshake (0x16)
/// and stop, from the address its agents and `lazarus status` come from, at a controller that
/// keeps 128 connections at most: status answers at once, every one of the 130 is closed by
/// the handshake deadline while the controller waits for its agents, and then two agents
/// attach and the job runs to its end. (Before, a byte passed the guard and tonic's handshake
/// had no deadline: 120 of them were still held 20 s on, for as long as the controller ran.)
#[test]
fn connections_that_send_one_byte_and_stop_are_dropped_and_lock_nobody_out() {
    let d = dir("hostile-one-byte");
    let [(path, log_s), (secret, secret_s)] = files(&d, ["log.jsonl", "secret"]);
    let args = two_nodes_of_one(&secret_s, &log_s, "20");
    let (mut controller, ctl_lines, addr) = controller_with_fd_limit(&args, 256);
    let mut strangers: Vec<TcpStream> = (0..130)
        .filter_map(|_| {
            let mut s = TcpStream::connect(&addr).ok()?;
            s.write_all(&[0x16]).ok()?;
            Some(s)
        })
        .collect();
    assert!(strangers.len() >= 100, "the strangers got in: {}", strangers.len());
    let began = std::time::Instant::now();
    let out = common::lazarus(&["status", "--controller", &addr, "--timeout", "5", "--secret-file", &secret_s]);
    assert!(out.status.success(), "status answers at once: {}", String::from_utf8_lossy(&out.stderr));
    // Every stranger is closed by the deadline (5 s from its connection), not held — while the
    // controller runs (it waits for its agents).
    let until = began + Duration::from_secs(30);
    let held = strangers.iter_mut().map(|s| closed_by(s, until)).filter(|&closed| !closed).count();
    assert_eq!(held, 0, "{held} one-byte connections still held 30 s on");
    assert!(controller.try_wait().unwrap().is_none(), "the controller waits for its agents");
    let mut agents: Vec<_> = (0..2).map(|_| common::hosts::start_agent(&addr, "1", &secret, None)).collect();
    wait::job_success(&mut controller, &ctl_lines, &path, "the job beside 130 one-byte connections");
    for (child, lines) in &mut agents {
        wait::success(child, lines, "an agent", Duration::from_secs(30));
    }
    assert_eq!(log(&path).0.len(), 20);
}

/// 40 silent connections from one address (beyond the 32 handshakes a peer may have under
/// way) held open while `lazarus status` asks from the same address: it is answered on its
/// first try — the oldest unfinished handshake makes room, not the newcomer. (Before, the
/// 33rd connection and every later one of that address were closed at once.)
#[test]
fn a_peers_silent_connections_do_not_lock_out_its_status_requests() {
    let d = dir("hostile-per-peer");
    let [(path, log_s), (secret, secret_s)] = files(&d, ["log.jsonl", "secret"]);
    let args = two_nodes_of_one(&secret_s, &log_s, "10");
    let (mut controller, ctl_lines, addr) = common::hosts::start_controller(&args, None);
    let silent: Vec<TcpStream> = (0..40).filter_map(|_| TcpStream::connect(&addr).ok()).collect();
    assert_eq!(silent.len(), 40);
    for i in 0..3 {
        let out = common::lazarus(&["status", "--controller", &addr, "--timeout", "3", "--secret-file", &secret_s]);
        assert!(out.status.success(), "status request {i}: {}", String::from_utf8_lossy(&out.stderr));
    }
    let mut agents: Vec<_> = (0..2).map(|_| common::hosts::start_agent(&addr, "1", &secret, None)).collect();
    wait::job_success(&mut controller, &ctl_lines, &path, "the job beside 40 silent connections");
    for (child, lines) in &mut agents {
        wait::success(child, lines, "an agent", Duration::from_secs(30));
    }
    drop(silent);
}

/// A secret or token "file" that is not one — `/dev/zero` (endless), a FIFO (whose open waits
/// for a writer), a directory, a file far too long — is refused at once naming the flag, by
/// every command that reads it; a metrics token too short to be one is refused too.
#[test]
fn secret_and_token_files_that_are_not_small_regular_files_are_refused_at_once() {
    let d = dir("hostile-files");
    let fifo = d.join("fifo");
    let c = std::ffi::CString::new(fifo.to_str().unwrap()).unwrap();
    // SAFETY: a path this test owns.
    assert_eq!(unsafe { libc::mkfifo(c.as_ptr(), 0o600) }, 0);
    let long = d.join("long");
    std::fs::write(&long, vec![b'a'; 1 << 20]).unwrap();
    let short = d.join("short");
    std::fs::write(&short, "abc\n").unwrap();
    let (fifo_s, long_s, short_s, dir_s) = (fifo.to_str().unwrap(), long.to_str().unwrap(), short.to_str().unwrap(), d.to_str().unwrap());
    for bad in ["/dev/zero", fifo_s, dir_s, long_s] {
        for cmd in [
            vec!["status", "--controller", "127.0.0.1:9", "--secret-file", bad],
            vec!["agent", "--controller", "127.0.0.1:9", "--gpus", "1", "--secret-file", bad],
            vec!["controller", "--listen", "127.0.0.1:0", "--workers", "2", "--gpus-per-node", "1", "--secret-file", bad],
            vec!["train", "--workers", "2", "--metrics-listen", "127.0.0.1:0", "--metrics-token-file", bad],
        ] {
            let out = common::lazarus(&cmd);
            let err = String::from_utf8_lossy(&out.stderr);
            let flag = cmd.iter().find(|a| a.ends_with("-file")).unwrap();
            assert!(!out.status.success() && err.contains(flag), "{cmd:?}: {err}");
        }
    }
    let out = common::lazarus(&["train", "--workers", "2", "--metrics-listen", "127.0.0.1:0", "--metrics-token-file", short_s]);
    let err = String::from_utf8_lossy(&out.stderr);
    assert!(!out.status.success() && err.contains("16 or more"), "{err}");
    let out = common::lazarus(&["train", "--workers", "2", "--metrics-token-file", short_s]);
    assert!(!out.status.success() && String::from_utf8_lossy(&out.stderr).contains("--metrics-listen"));
}
