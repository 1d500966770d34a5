//! Node agents with real processes: `train --workers N --gpus-per-node G` starts N/G agents on
//! loopback, and `lazarus controller` + `lazarus agent` run a job over gRPC as they would on
//! several hosts. An agent killed from outside takes its workers with it and training goes on
//! on the other nodes; a controller that is gone stops every node's workers cleanly; an agent
//! without the job's secret is refused; and, where network namespaces can be made, a node cut
//! off by a partition is lost by its lease while its agent stops its own workers.

mod common;

use std::process::Child;
use std::sync::mpsc;
use std::time::{Duration, Instant};

use common::hosts::{
    agent_pids, children, placement, start_agent, start_agent_with_env, start_agent_with_grace, start_controller, start_controller_keeping,
    wait_for_records, Hosts,
};
use common::{alive, assert_same_losses, dir, files, lazarus, log, signal, spawn_lazarus, uninterrupted, wait, wait_for_steps};
use serde_json::Value;

fn tiny() -> [&'static str; 16] {
    common::tiny_model("8")
}

fn all_gone(pids: &[i32], within: Duration) -> bool {
    let until = Instant::now() + within;
    while Instant::now() < until {
        if pids.iter().all(|&p| !alive(p)) {
            return true;
        }
        std::thread::sleep(Duration::from_millis(20));
    }
    false
}

#[test]
fn an_agent_killed_with_its_workers_does_not_stop_training() {
    let d = dir("agents-kill");
    let [(path, log_s), (ck, ck_s)] = files(&d, ["log.jsonl", "ck"]);
    let want = uninterrupted("60", &d);
    let mut args = vec!["train", "--workers", "4", "--gpus-per-node", "2"];
    args.extend(tiny());
    args.extend(["--steps", "60", "--json-log", &log_s, "--checkpoint-dir", &ck_s, "--checkpoint-every", "5"]);
    let (mut child, lines) = spawn_lazarus(&args, &[]);
    let mut text = Vec::new();
    let agents = agent_pids(&lines, 2, &mut text);
    wait_for_steps(&path, 10);
    let workers = children(agents[1]);
    assert_eq!(workers.len(), 2, "an agent runs its node's two workers");
    signal(agents[1], libc::SIGKILL);
    assert!(all_gone(&workers, Duration::from_secs(5)), "the workers of a killed agent die with it");
    text.extend(wait::job_success(&mut child, &lines, &path, "the run after an agent's SIGKILL"));
    let (steps, reconf) = log(&path);
    assert_same_losses(&steps, &want, "2 agents of 2 workers, one agent killed");
    assert_eq!(reconf.len(), 1, "{reconf:?}");
    assert_eq!(reconf[0]["workers"].as_u64(), Some(2), "{}", reconf[0]);
    assert_eq!(reconf[0]["lost"].as_array().map(Vec::len), Some(2), "both workers of the node: {}", reconf[0]);
    // The placement put every expert on both nodes: nothing is lost, nothing rolls back.
    assert_eq!(reconf[0]["cause"], "reconfigure", "{}", reconf[0]);
    assert!(text.iter().any(|l| l.contains("its agent") && l.contains("is gone")), "{}", text.join("\n"));
    // The final checkpoint resumes in one process.
    common::resumes_in_one_process(&ck, "62", &d);
}

#[test]
fn agents_of_a_controller_refuse_strangers_and_stop_cleanly_when_it_is_gone() {
    let d = dir("agents-controller");
    let (path, ck, secret) = (d.join("log.jsonl"), d.join("ck"), d.join("secret"));
    let (log_s, ck_s, secret_s) =
        (path.to_str().unwrap().to_string(), ck.to_str().unwrap().to_string(), secret.to_str().unwrap().to_string());
    let mut args = vec!["--listen", "127.0.0.1:0", "--secret-file", &secret_s, "--workers", "4", "--gpus-per-node", "2"];
    args.extend(tiny());
    args.extend(["--steps", "100000", "--json-log", &log_s, "--checkpoint-dir", &ck_s, "--checkpoint-every", "5", "--lease", "0.5"]);
    let (mut controller, ctl_lines, addr) = start_controller(&args, None);
    // Before any agent attached, its workers are expected, not alive.
    let out = lazarus(&["status", "--controller", &addr, "--secret-file", &secret_s]);
    let text = String::from_utf8_lossy(&out.stdout);
    assert!(out.status.success() && text.contains("workers    4 starting (lease"), "{text}");
    assert!(text.contains("starting: not heard from yet") && !text.contains("heard 0.00 s ago"), "{text}");
    // The secret file is the controller's, readable by its owner only.
    use std::os::unix::fs::PermissionsExt;
    assert_eq!(std::fs::metadata(&secret).unwrap().permissions().mode() & 0o777, 0o600);
    // An agent of another secret does not take this controller for its own: the TLS key the
    // secret pins is not the one this controller signs with. The status client neither.
    let wrong = d.join("wrong");
    std::fs::write(&wrong, "0123456789abcdef0123456789abcdef\n").unwrap();
    let (mut stranger, stranger_lines) = start_agent(&addr, "2", &wrong, None);
    let text = wait::failure(&mut stranger, &stranger_lines, "an agent of another secret", Duration::from_secs(30));
    assert!(text.iter().any(|l| l.contains("is not this job's controller")), "{}", text.join("\n"));
    let out = lazarus(&["status", "--controller", &addr, "--secret-file", wrong.to_str().unwrap()]);
    assert!(!out.status.success() && String::from_utf8_lossy(&out.stderr).contains("is not this job's controller"));
    // Two agents of two workers each bring the job's four.
    let mut agents: Vec<(Child, mpsc::Receiver<String>)> = (0..2).map(|_| start_agent(&addr, "2", &secret, None)).collect();
    wait_for_steps(&path, 12);
    // The status service answers at the same address.
    let out = lazarus(&["status", "--controller", &addr, "--json", "--secret-file", &secret_s]);
    assert!(out.status.success(), "{}", String::from_utf8_lossy(&out.stderr));
    let st: Value = serde_json::from_slice(&out.stdout).unwrap();
    assert_eq!(st["members"].as_array().map(Vec::len), Some(4), "{st}");
    // A running job at its most workers takes no third node, and one of another size is not
    // one of its nodes.
    for (gpus, why) in [("2", "--max-workers"), ("1", "nodes have 2 each")] {
        let (mut extra, extra_lines) = start_agent(&addr, gpus, &secret, None);
        let text = wait::failure(&mut extra, &extra_lines, format!("an agent of {gpus} GPUs refused"), Duration::from_secs(30));
        assert!(text.iter().any(|l| l.contains(why)), "{why:?} in {}", text.join("\n"));
    }
    // The controller dies: every node stops its workers within about a lease, and says why.
    let workers: Vec<i32> = agents.iter().flat_map(|(c, _)| children(c.id() as i32)).collect();
    assert_eq!(workers.len(), 4);
    signal(controller.id() as i32, libc::SIGKILL);
    let _ = controller.wait();
    drop(ctl_lines);
    for (child, lines) in &mut agents {
        let text = wait::failure(child, lines, "an agent stops when its controller is gone", Duration::from_secs(20));
        assert!(text.iter().any(|l| l.contains("agent stopped")), "{}", text.join("\n"));
    }
    assert!(all_gone(&workers, Duration::from_secs(5)), "no worker outlives its agent");
    // Nothing saved is lost: the latest checkpoint resumes in one process.
    let latest = std::fs::read_to_string(ck.join("latest")).unwrap();
    let step: u64 = latest.trim().trim_start_matches("step-").parse().unwrap();
    common::resumes_in_one_process(&ck, &(step + 2).to_string(), &d);
}

/// An agent facing a port that accepts connections but never answers (not a controller, or one
/// that is stuck) gives up after `--connect-timeout`, saying so, instead of waiting forever.
/// SIGTERM to a controller still waiting for its agents (`--wait-agents 600`) ends it at once,
/// saying nothing was trained, with the status of a process the signal ended — not after the
/// wait.
#[test]
fn a_controller_waiting_for_agents_stops_at_sigterm() {
    use std::os::unix::process::ExitStatusExt;
    let d = dir("agents-wait-sigterm");
    let secret = d.join("secret");
    let mut args = vec!["--listen", "127.0.0.1:0", "--secret-file", secret.to_str().unwrap(), "--workers", "2", "--wait-agents", "600"];
    args.extend(tiny());
    let (mut controller, lines, _) = start_controller(&args, None);
    signal(controller.id() as i32, libc::SIGTERM);
    let (status, text) = wait::exit(&mut controller, &lines, "the controller told to stop", Duration::from_secs(30));
    assert_eq!(status.code(), Some(128 + libc::SIGTERM), "{status:?}: {}", wait::tail(&text));
    assert!(status.signal().is_none());
    assert!(
        text.iter().any(|l| l.contains("SIGTERM while waiting for agents (0 of the job's 2 workers attached)")),
        "{}",
        wait::tail(&text)
    );
}

#[test]
fn an_agent_facing_a_silent_port_gives_up_after_its_connect_timeout() {
    let d = dir("agents-silent");
    let secret = d.join("secret");
    std::fs::write(&secret, "0123456789abcdef0123456789abcdef\n").unwrap();
    let listener = std::net::TcpListener::bind("127.0.0.1:0").unwrap();
    let addr = listener.local_addr().unwrap().to_string();
    let held = std::thread::spawn(move || listener.incoming().take(4).map_while(Result::ok).collect::<Vec<_>>());
    let started = Instant::now();
    let (mut agent, lines) = spawn_lazarus(
        &["agent", "--controller", &addr, "--gpus", "1", "--secret-file", secret.to_str().unwrap(), "--connect-timeout", "2"],
        &[],
    );
    let text = wait::failure(&mut agent, &lines, "an agent facing a silent port", Duration::from_secs(30));
    assert!(started.elapsed() < Duration::from_secs(15), "gave up after {:?}", started.elapsed());
    assert!(text.iter().any(|l| l.contains("--connect-timeout")), "{}", text.join("\n"));
    drop(held);
}

/// Connections that cannot hurt: 300 connections that never begin their handshake, made to a
/// controller that may open 256 files, neither block `lazarus status` nor keep its agents out
/// — the job runs to its end.
#[test]
fn half_open_connections_do_not_starve_the_controller() {
    use std::io::{BufRead, BufReader};
    use std::os::unix::process::CommandExt;
    let d = dir("agents-half-open");
    let [(path, log_s), (secret, secret_s)] = files(&d, ["log.jsonl", "secret"]);
    let mut args = vec!["controller", "--listen", "127.0.0.1:0", "--secret-file", &secret_s, "--workers", "2", "--gpus-per-node", "1"];
    args.extend(tiny());
    args.extend(["--steps", "10", "--json-log", &log_s]);
    let mut cmd = common::lazarus_command();
    cmd.args(&args).stdout(std::process::Stdio::null()).stderr(std::process::Stdio::piped());
    // SAFETY: only setrlimit between fork and exec.
    unsafe {
        cmd.pre_exec(|| {
            let lim = libc::rlimit { rlim_cur: 256, rlim_max: 256 };
            libc::setrlimit(libc::RLIMIT_NOFILE, &lim);
            Ok(())
        });
    }
    let mut controller = cmd.spawn().unwrap();
    let (tx, ctl_lines) = mpsc::channel();
    let stderr = controller.stderr.take().unwrap();
    std::thread::spawn(move || {
        for line in BufReader::new(stderr).lines().map_while(Result::ok) {
            let _ = tx.send(line);
        }
    });
    let addr = loop {
        let line = ctl_lines.recv_timeout(Duration::from_secs(60)).expect("the controller listens");
        if let Some(rest) = line.strip_prefix("controller listening on ") {
            break rest.split(':').take(2).collect::<Vec<_>>().join(":");
        }
    };
    let silent: Vec<std::net::TcpStream> = (0..300).filter_map(|_| std::net::TcpStream::connect(&addr).ok()).collect();
    assert!(!silent.is_empty());
    let until = Instant::now() + Duration::from_secs(30);
    let answered = loop {
        let out = lazarus(&["status", "--controller", &addr, "--timeout", "3", "--secret-file", &secret_s]);
        if out.status.success() {
            break true;
        }
        if Instant::now() >= until {
            break false;
        }
    };
    assert!(answered, "status answers while 300 silent connections are open");
    let mut agents: Vec<(Child, mpsc::Receiver<String>)> = (0..2).map(|_| start_agent(&addr, "1", &secret, None)).collect();
    wait::job_success(&mut controller, &ctl_lines, &path, "the job under 300 silent connections");
    for (child, lines) in &mut agents {
        wait::success(child, lines, "an agent at the job's end", Duration::from_secs(30));
    }
    assert_eq!(log(&path).0.len(), 10);
    drop(silent);
}

/// A job configured from one file: the controller's settings and the job's workers from its
/// `[controller]` table, every agent's from `[agent]`, the command line adding the rest.
#[test]
fn a_controller_and_its_agents_run_from_one_config_file() {
    let d = dir("agents-config");
    let (path, secret, file) = (d.join("log.jsonl"), d.join("secret"), d.join("job.toml"));
    std::fs::write(
        &file,
        format!(
            "steps = 8\n\n[controller]\nlisten = \"127.0.0.1:0\"\nsecret_file = {:?}\nworkers = 2\ngpus_per_node = 1\n\n[agent]\ngpus = 1\nsecret_file = {:?}\n",
            secret.to_str().unwrap(),
            secret.to_str().unwrap()
        ),
    )
    .unwrap();
    let (file_s, log_s) = (file.to_str().unwrap().to_string(), path.to_str().unwrap().to_string());
    let mut args = vec!["--config", &file_s, "--json-log", &log_s];
    args.extend(tiny());
    let (mut controller, ctl_lines, addr) = start_controller(&args, None);
    let mut agents: Vec<(Child, mpsc::Receiver<String>)> =
        (0..2).map(|_| spawn_lazarus(&["agent", "--config", &file_s, "--controller", &addr], &[])).collect();
    wait::job_success(&mut controller, &ctl_lines, &path, "the job of one config file");
    for (child, lines) in &mut agents {
        wait::success(child, lines, "an agent at the job's end", Duration::from_secs(30));
    }
    assert_eq!(log(&path).0.len(), 8, "the file's steps, on the file's two workers");
}

/// A TCP proxy on loopback to `to` that records every byte both ways.
fn recording_proxy(to: String) -> (String, std::sync::Arc<std::sync::Mutex<Vec<u8>>>) {
    use std::io::{Read, Write};
    use std::sync::{Arc, Mutex};
    let listener = std::net::TcpListener::bind("127.0.0.1:0").unwrap();
    let addr = listener.local_addr().unwrap().to_string();
    let seen = Arc::new(Mutex::new(Vec::new()));
    let all = seen.clone();
    std::thread::spawn(move || {
        for client in listener.incoming().map_while(Result::ok) {
            let Ok(server) = std::net::TcpStream::connect(&to) else { continue };
            for (mut from, mut into) in [(client.try_clone().unwrap(), server.try_clone().unwrap()), (server, client)] {
                let seen = all.clone();
                std::thread::spawn(move || {
                    let mut buf = [0u8; 8192];
                    while let Ok(n) = from.read(&mut buf) {
                        if n == 0 || into.write_all(&buf[..n]).is_err() {
                            break;
                        }
                        seen.lock().unwrap().extend_from_slice(&buf[..n]);
                    }
                    let _ = into.shutdown(std::net::Shutdown::Write);
                });
            }
        }
    });
    (addr, seen)
}

/// Everything between the controller and its agents, read on the wire (a recording proxy):
/// the job runs to its end, the session is TLS, and the secret appears nowhere — not in the
/// agents' hellos, not in their workers' specs, in any form.
#[test]
fn the_job_secret_never_crosses_the_wire_between_controller_and_agents() {
    let d = dir("agents-wire");
    let [(path, log_s), (secret, secret_s)] = files(&d, ["log.jsonl", "secret"]);
    let mut args = vec!["--listen", "127.0.0.1:0", "--secret-file", &secret_s, "--workers", "4", "--gpus-per-node", "2"];
    args.extend(tiny());
    args.extend(["--steps", "20", "--json-log", &log_s]);
    let (mut controller, ctl_lines, addr) = start_controller(&args, None);
    let (via, seen) = recording_proxy(addr);
    let mut agents: Vec<(Child, mpsc::Receiver<String>)> = (0..2).map(|_| start_agent(&via, "2", &secret, None)).collect();
    wait::job_success(&mut controller, &ctl_lines, &path, "the job through a recording proxy");
    for (child, lines) in &mut agents {
        wait::success(child, lines, "an agent at the job's end", Duration::from_secs(30));
    }
    assert_eq!(log(&path).0.len(), 20, "the job ran through the proxy");
    let bytes = seen.lock().unwrap().clone();
    let hex = std::fs::read_to_string(&secret).unwrap().trim().to_string();
    let raw = u128::from_str_radix(&hex, 16).unwrap();
    assert!(bytes.len() > 10_000, "the session went through the proxy: {} bytes", bytes.len());
    for form in [hex.as_bytes(), hex.to_uppercase().as_bytes(), &raw.to_le_bytes()[..], &raw.to_be_bytes()[..]] {
        assert!(!bytes.windows(8).any(|w| form.windows(8).any(|f| f == w)), "part of the secret crossed the wire");
    }
    // Nothing else is readable either: the workers' specs (JSON naming the model's shape) cross
    // inside TLS, whose records begin the session (a handshake record, 0x16, TLS 1.x).
    assert_eq!(&bytes[..2], &[0x16, 0x03], "the session starts with a TLS handshake");
    assert!(!bytes.windows(9).any(|w| w == b"\"d_model\""), "a worker's spec crossed the wire in clear");
}

/// SIGTERM to the controller of agents: every worker finishes after the same step with the
/// final checkpoint, each agent says so (not that the job completed), and the controller does
/// not take its agents' last words for a partition's.
#[test]
fn a_controller_stopped_by_sigterm_ends_every_node_at_a_step_boundary_and_says_so() {
    let d = dir("agents-sigterm");
    let (path, ck, secret) = (d.join("log.jsonl"), d.join("ck"), d.join("secret"));
    let (log_s, ck_s, secret_s) =
        (path.to_str().unwrap().to_string(), ck.to_str().unwrap().to_string(), secret.to_str().unwrap().to_string());
    let mut args = vec!["--listen", "127.0.0.1:0", "--secret-file", &secret_s, "--workers", "4", "--gpus-per-node", "2"];
    args.extend(tiny());
    args.extend(["--steps", "100000", "--json-log", &log_s, "--checkpoint-dir", &ck_s]);
    let (mut controller, ctl_lines, addr) = start_controller(&args, None);
    let mut agents: Vec<(Child, mpsc::Receiver<String>)> = (0..2).map(|_| start_agent(&addr, "2", &secret, None)).collect();
    wait_for_steps(&path, 5);
    signal(controller.id() as i32, libc::SIGTERM);
    let (status, ctl_text) = wait::exit(&mut controller, &ctl_lines, "the controller stopped by SIGTERM", Duration::from_secs(30));
    assert_eq!(status.code(), Some(143), "{}", ctl_text.join("\n"));
    assert!(!ctl_text.iter().any(|l| l.contains("given up")), "a normal end warns of nothing: {}", ctl_text.join("\n"));
    let (steps, _) = log(&path);
    let last = steps.last().unwrap().0;
    assert_eq!(std::fs::read_to_string(ck.join("latest")).unwrap(), format!("step-{last:08}"), "the last logged step is saved");
    for (child, lines) in &mut agents {
        let text = wait::success(child, lines, "an agent of the stopped job", Duration::from_secs(30));
        let said = format!("asked to stop (SIGTERM): every worker finished after step {last}");
        assert!(text.iter().any(|l| l.contains(&said)), "{said:?} in {}", text.join("\n"));
    }
}

/// Elastic scale-up: a job started on one node of two workers takes in a second node that
/// attaches while it runs (after --join-wait, at a step boundary), loses its first node to a
/// SIGKILL, and takes in a third — every step once, the losses of an uninterrupted run, the
/// same data consumed, and a final checkpoint the single-process trainer resumes.
#[test]
fn nodes_that_attach_to_a_running_job_are_taken_in_and_replace_a_lost_one() {
    let d = dir("agents-join");
    let (path, ck, secret) = (d.join("log.jsonl"), d.join("ck"), d.join("secret"));
    let (log_s, ck_s, secret_s) =
        (path.to_str().unwrap().to_string(), ck.to_str().unwrap().to_string(), secret.to_str().unwrap().to_string());
    // Under 500 steps: beyond that, float summation order alone (1 vs 2 workers, no failure)
    // grows the tiny model's 1e-7 loss differences past 1e-4 — training is chaotic.
    let steps = "360";
    let (want, want_cursor) = common::uninterrupted_with_cursor(steps, &d);
    let mut args = vec!["--listen", "127.0.0.1:0", "--secret-file", &secret_s, "--workers", "2", "--gpus-per-node", "2"];
    args.extend(["--max-workers", "4", "--join-wait", "0.2", "--lease", "0.5", "--rebalance-every", "0"]);
    args.extend(tiny());
    args.extend(["--steps", steps, "--json-log", &log_s, "--checkpoint-dir", &ck_s, "--dashboard-listen", "127.0.0.1:0"]);
    let (mut controller, ctl_lines, addr, before) = common::hosts::start_controller_keeping(&args, None);
    let dashboard = before.iter().find_map(|l| l.split("dashboard: http://").nth(1)).expect("the dashboard's address").trim().to_string();
    // Paced (every step 15 ms or more): the job outlasts a join, a loss and a second join on
    // any machine.
    let agent = || start_agent_with_env(&addr, "2", &secret, None, "0", &common::paced(15));
    let mut first = agent();
    wait_for_steps(&path, 20);
    let _second = agent();
    let joined = wait_for_records(&path, 1);
    assert_eq!((joined[0]["cause"].as_str(), joined[0]["workers"].as_u64()), (Some("join"), Some(4)), "{}", joined[0]);
    assert_eq!(joined[0]["joined"], serde_json::json!([2, 3]));
    assert!(joined[0]["transfer_bytes"].as_u64().unwrap() > 0, "the newcomers are sent the job's state");
    signal(first.0.id() as i32, libc::SIGKILL);
    let _ = first.0.wait();
    let lost = wait_for_records(&path, 2);
    assert_eq!((lost[1]["cause"].as_str(), lost[1]["workers"].as_u64()), (Some("reconfigure"), Some(2)), "{}", lost[1]);
    assert_eq!(lost[1]["lost"], serde_json::json!([0, 1]));
    // The controller's dashboard has the join and the loss on its timeline, the lost members.
    let (host, path_q) = dashboard.split_at(dashboard.find('/').unwrap());
    let state_path = path_q.replacen("/dashboard?", "/dashboard/state?", 1);
    let state = wait::until("the loss on the dashboard", Duration::from_secs(30), || {
        let mut s = std::net::TcpStream::connect(host).map_err(|e| e.to_string())?;
        use std::io::{Read, Write};
        s.write_all(format!("GET {state_path} HTTP/1.1\r\nHost: x\r\n\r\n").as_bytes()).map_err(|e| e.to_string())?;
        let mut answer = String::new();
        let _ = s.read_to_string(&mut answer);
        let v: serde_json::Value = serde_json::from_str(answer.split("\r\n\r\n").nth(1).unwrap_or("")).unwrap_or_default();
        let kinds: Vec<&str> = v["timeline"].as_array().into_iter().flatten().filter_map(|e| e["kind"].as_str()).collect();
        if kinds.contains(&"reconfigure") && kinds.contains(&"join") {
            Ok(v.clone())
        } else {
            Err(answer)
        }
    });
    let lost_members = state["members"].as_array().unwrap().iter().filter(|m| m["state"] == "lost").count();
    assert_eq!(lost_members, 2, "the killed node's two workers: {state}");
    let _third = agent();
    let text = wait::job_success(&mut controller, &ctl_lines, &path, "the job completes");
    let (steps_seen, records) = log(&path);
    assert_eq!(records.len(), 3, "{records:?}");
    assert_eq!((records[2]["cause"].as_str(), records[2]["workers"].as_u64()), (Some("join"), Some(4)), "{}", records[2]);
    assert_eq!(records[2]["joined"], serde_json::json!([4, 5]));
    assert!(text.iter().any(|l| l.starts_with("joined: epoch 3, worker(s) 4, 5 taken in")), "{}", text.join("\n"));
    assert_same_losses(&steps_seen, &want, "joins, a node lost, a node joining again");
    assert_eq!(common::cursor(&ck), want_cursor, "the same windows of data, none lost or repeated");
    common::resumes_in_one_process(&ck, "362", &d);
}

/// A preemption notice: SIGTERM to the agent of a node that holds the only replica of an
/// expert. Its worker finishes the step in flight, the job moves off it — that expert's state
/// handed to a node that stays — and it leaves; no step is lost, nothing rolls back, the losses
/// and data are an uninterrupted run's, and the agent exits 0 saying it was drained.
#[test]
fn a_node_that_gives_notice_hands_over_its_last_replicas_before_it_leaves() {
    let d = dir("agents-drain");
    let (path, ck, secret) = (d.join("log.jsonl"), d.join("ck"), d.join("secret"));
    let (log_s, ck_s, secret_s) =
        (path.to_str().unwrap().to_string(), ck.to_str().unwrap().to_string(), secret.to_str().unwrap().to_string());
    let (want, want_cursor) = common::uninterrupted_with_cursor("300", &d);
    // Three nodes of one worker with two slots each for four experts: some expert has one
    // replica only.
    let mut args = vec!["--listen", "127.0.0.1:0", "--secret-file", &secret_s, "--workers", "3", "--slots-per-worker", "2"];
    args.extend(["--lease", "0.5", "--rebalance-every", "0"]);
    args.extend(tiny());
    args.extend(["--steps", "300", "--json-log", &log_s, "--checkpoint-dir", &ck_s]);
    let (mut controller, ctl_lines, addr, printed) = start_controller_keeping(&args, None);
    let held = placement(&printed, 0);
    let unique = |w: usize| held[w].iter().any(|e| (0..held.len()).filter(|&o| held[o].contains(e)).count() == 1);
    let victim = (0..held.len()).find(|&w| unique(w)).expect("some worker holds an expert alone");
    let mut agents: Vec<(Child, mpsc::Receiver<String>)> = Vec::new();
    let mut text = Vec::new();
    // One at a time, so that worker w is the w-th agent's.
    for _ in 0..3 {
        agents.push(start_agent(&addr, "1", &secret, None));
        agent_pids(&ctl_lines, 1, &mut text);
    }
    wait_for_steps(&path, 20);
    signal(agents[victim].0.id() as i32, libc::SIGTERM);
    let (drained, drained_lines) = &mut agents[victim];
    let agent_text = wait::success(drained, drained_lines, "the drained agent exits 0", Duration::from_secs(60));
    assert!(agent_text.iter().any(|l| l.contains("agent: drained")), "{}", agent_text.join("\n"));
    text.extend(wait::job_success(&mut controller, &ctl_lines, &path, "the job after the drain"));
    let (steps, records) = log(&path);
    assert_eq!(records.len(), 1, "one move, no rollback: {records:?}");
    let r = &records[0];
    assert_eq!((r["cause"].as_str(), r["workers"].as_u64()), (Some("drain"), Some(2)), "{r}");
    assert_eq!(r["lost"], serde_json::json!([victim]));
    assert!(r["transfer_bytes"].as_u64().unwrap() > 0, "its last replicas were handed over: {r}");
    assert!(text.iter().any(|l| l.contains(&format!("workers {victim} leave on notice"))), "{}", text.join("\n"));
    assert_same_losses(&steps, &want, "a node drained on notice");
    assert_eq!(common::cursor(&ck), want_cursor, "the same windows of data");
}

/// A failure trace replayed on local agents (`train --workers 4 --gpus-per-node 2 --replay`): a
/// node is killed and another comes, on the trace's (scaled) schedule; the job reconfigures,
/// takes the newcomer in after the scaled wait, and trains on with the uninterrupted losses.
#[test]
fn a_replayed_trace_kills_and_starts_local_agents_on_schedule() {
    let d = dir("agents-replay");
    let (path, trace) = (d.join("log.jsonl"), d.join("trace.csv"));
    std::fs::write(&trace, "# ms,change,node\n0,add,a\n0,add,b\n60000,remove,b\n90000,add,c\n").unwrap();
    let log_s = path.to_str().unwrap().to_string();
    let want = uninterrupted("360", &d);
    let mut args = vec!["train", "--workers", "4", "--gpus-per-node", "2", "--replay", trace.to_str().unwrap()];
    // Trace times x 0.01: b goes at 0.6 s, c comes at 0.9 s and waits 1.2 s (2 minutes x 0.01).
    args.extend(["--replay-scale", "0.01", "--rebalance-every", "0", "--steps", "360", "--json-log", &log_s]);
    args.extend(tiny());
    // Paced (every step 15 ms or more): the 360 steps outlast the trace's last event (a join at
    // about 2 s) on any machine.
    let (mut child, lines) = spawn_lazarus(&args, &common::paced(15));
    let text = wait::job_success(&mut child, &lines, &path, "a job replaying a trace");
    assert!(text.iter().any(|l| l.contains("node b goes: its agent killed (SIGKILL)")), "{}", text.join("\n"));
    assert!(text.iter().any(|l| l.contains("node c comes")), "{}", text.join("\n"));
    let (steps, records) = log(&path);
    let causes: Vec<&str> = records.iter().map(|r| r["cause"].as_str().unwrap()).collect();
    assert_eq!(causes, vec!["reconfigure", "join"], "{records:?}");
    assert_eq!((records[0]["workers"].as_u64(), records[1]["workers"].as_u64()), (Some(2), Some(4)));
    assert_same_losses(&steps, &want, "a replayed trace");
    // The same trace through the simulator, calibrated to the run: side by side.
    let text = std::fs::read_to_string(&path).unwrap();
    let sim: Value =
        text.lines().map(|l| serde_json::from_str::<Value>(l).unwrap()).find(|v| v["event"] == "replay_vs_sim").expect("a comparison");
    assert_eq!(sim["measured_samples"].as_f64(), Some(360.0 * 8.0), "{sim}");
    assert_eq!((sim["measured_reconfigurations"].as_u64(), sim["measured_joins"].as_u64()), (Some(1), Some(1)), "{sim}");
    let ratio = sim["ratio"].as_f64().unwrap();
    assert!(ratio > 0.5 && ratio < 1.5, "predicted / measured samples {ratio}: {sim}");
    assert!(sim["predicted_reconfigurations"].as_u64().unwrap() >= 1, "the simulator saw the failure: {sim}");
}

/// Three hosts as network namespaces: the controller on one, an agent of two workers on each of
/// the others. The third host is cut off by a partition mid-run: the controller loses its
/// workers by their lease (the survivors are told to cut their connections to them, so their
/// step fails at once instead of at the 30 s collective deadline) and training goes on on the
/// second host; the cut-off agent hears nothing from the controller for a lease and stops its
/// workers.
#[test]
fn a_node_cut_off_by_a_partition_is_lost_by_its_lease_and_stops_its_own_workers() {
    let tag = format!("{}", std::process::id() % 100_000);
    let Some(hosts) = Hosts::new(&tag, 3) else {
        eprintln!("skipped: network namespaces cannot be made here (needs root and iproute2)");
        return;
    };
    let d = dir("agents-partition");
    let [(path, log_s), (secret, secret_s)] = files(&d, ["log.jsonl", "secret"]);
    let want = uninterrupted("60", &d);
    let mut args =
        vec!["--listen", "10.231.0.1:7070", "--secret-file", &secret_s, "--workers", "4", "--gpus-per-node", "2", "--lease", "0.5"];
    args.extend(tiny());
    args.extend(["--steps", "60", "--json-log", &log_s]);
    let (mut controller, ctl_lines, addr) = start_controller(&args, Some(&hosts.names[0]));
    assert_eq!(addr, "10.231.0.1:7070");
    let mut kept = start_agent(&addr, "2", &secret, Some(&hosts.names[1]));
    let mut cut = start_agent(&addr, "2", &secret, Some(&hosts.names[2]));
    wait_for_steps(&path, 10);
    // The agent runs under `ip netns exec`, which execs it: the pid is the agent's.
    let cut_workers = children(cut.0.id() as i32);
    assert_eq!(cut_workers.len(), 2);
    let cut_at = Instant::now();
    hosts.partition(2);
    let text = wait::failure(&mut cut.0, &cut.1, "the cut-off agent", Duration::from_secs(20));
    assert!(text.iter().any(|l| l.contains("the controller was silent")), "{}", text.join("\n"));
    // Its workers' ranks (agents are numbered in order of arrival).
    let started = text.iter().find_map(|l| l.split("started workers (ranks ").nth(1)).expect("the agent started its workers");
    let cut_ranks: Vec<u64> = started.trim_end_matches(')').split(", ").map(|r| r.parse().unwrap()).collect();
    assert!(cut_at.elapsed() < Duration::from_secs(10), "the cut-off agent stops within about a lease");
    assert!(all_gone(&cut_workers, Duration::from_secs(5)), "its workers stop with it");
    wait::job_success(&mut controller, &ctl_lines, &path, "training on the other host");
    let (steps, reconf) = log(&path);
    assert_same_losses(&steps, &want, "a host cut off");
    assert_eq!(reconf.len(), 1, "{reconf:?}");
    assert_eq!(reconf[0]["lost"], serde_json::json!(cut_ranks), "{}", reconf[0]);
    assert_eq!(reconf[0]["cause"], "reconfigure", "expert states fetched from the other host: {}", reconf[0]);
    let recovery_s = reconf[0]["recovery_s"].as_f64().unwrap();
    assert!(recovery_s < 10.0, "found out by the lease and fenced, not at the 30 s deadline: {recovery_s} s");
    wait::success(&mut kept.0, &kept.1, "the agent on the other host", Duration::from_secs(30));
}

/// A job of 2 agents × 2 workers whose controller saves its state, on a port of its own (outside
/// the kernel's ephemeral range: no other test's listener takes it while there is no controller).
struct RestartableJob {
    d: common::Scratch,
    path: std::path::PathBuf,
    ck: std::path::PathBuf,
    secret: std::path::PathBuf,
    listen: String,
    steps: String,
}

impl RestartableJob {
    fn new(name: &str, port_offset: u32, steps: &str) -> Self {
        let d = dir(name);
        let listen = format!("127.0.0.1:{}", 21_000 + (std::process::id() * 7 + port_offset) % 6_000);
        RestartableJob { path: d.join("log.jsonl"), ck: d.join("ck"), secret: d.join("secret"), d, listen, steps: steps.into() }
    }

    fn controller(&self, extra: &[&str]) -> (Child, mpsc::Receiver<String>, String) {
        let s = |p: &std::path::Path| p.to_str().unwrap().to_string();
        let (secret, log, ck) = (s(&self.secret), s(&self.path), s(&self.ck));
        let mut args = vec!["--listen", &self.listen, "--secret-file", &secret, "--workers", "4", "--gpus-per-node", "2"];
        args.extend(tiny());
        args.extend(["--steps", &self.steps, "--json-log", &log, "--checkpoint-dir", &ck, "--checkpoint-every", "10", "--lease", "0.5"]);
        args.extend(extra);
        start_controller(&args, None)
    }
}

/// The controller SIGKILLed mid-run: its agents keep their workers, paused with their state;
/// a new controller started with `--resume-job` (same address, secret and flags) takes the job
/// back from what it saved and what the agents report, and training goes on — every step once,
/// the losses of an uninterrupted run, no rollback, the `--json-log` continued.
#[test]
fn a_controller_killed_mid_run_and_started_again_takes_the_job_back_with_nothing_lost() {
    let d = dir("agents-controller-restart");
    let (path, ck, secret) = (d.join("log.jsonl"), d.join("ck"), d.join("secret"));
    let (log_s, ck_s, secret_s) =
        (path.to_str().unwrap().to_string(), ck.to_str().unwrap().to_string(), secret.to_str().unwrap().to_string());
    let want = uninterrupted("80", &d);
    let job = |listen: &str, resume: bool| {
        let mut args = vec!["--listen", listen, "--secret-file", &secret_s, "--workers", "4", "--gpus-per-node", "2"];
        args.extend(tiny());
        args.extend(["--steps", "80", "--json-log", &log_s, "--checkpoint-dir", &ck_s, "--checkpoint-every", "10", "--lease", "0.5"]);
        if resume {
            args.push("--resume-job");
        }
        args.iter().map(|a| a.to_string()).collect::<Vec<String>>()
    };
    // A port outside the kernel's ephemeral range: no other test's listener takes it while
    // there is no controller.
    let listen = format!("127.0.0.1:{}", 21_000 + std::process::id() % 6_000);
    let first = job(&listen, false);
    let (mut controller, ctl_lines, addr) = start_controller(&first.iter().map(String::as_str).collect::<Vec<_>>(), None);
    let mut agents: Vec<(Child, mpsc::Receiver<String>)> =
        (0..2).map(|_| start_agent_with_grace(&addr, "2", &secret, None, "60")).collect();
    wait_for_steps(&path, 15);
    let workers: Vec<i32> = agents.iter().flat_map(|(c, _)| children(c.id() as i32)).collect();
    assert_eq!(workers.len(), 4);
    signal(controller.id() as i32, libc::SIGKILL);
    let _ = controller.wait();
    drop(ctl_lines);
    let killed_at = log(&path).0.len();
    let lost_at = Instant::now();
    // Without a controller the workers pause: no step is trained, none is lost. Each agent says
    // so once it finds the controller gone; then the controller stays away for 2 s in all (the
    // fault's chosen length, which the move's detection time must count).
    for (i, (_, lines)) in agents.iter().enumerate() {
        wait::line(lines, format!("agent {i} waiting for a controller"), Duration::from_secs(30), &mut Vec::new(), |l| {
            l.contains("wait up to")
        });
    }
    // A controller that would change the job (its learning rate, its steps, the workers it was
    // started with), or start a new job over its saved state, is refused by name before it
    // listens: the job waits on, untouched.
    let refused = |args: Vec<String>, want: &[&str]| {
        let mut a = vec!["controller".to_string()];
        a.extend(args);
        let out = lazarus(&a.iter().map(String::as_str).collect::<Vec<_>>());
        let err = String::from_utf8_lossy(&out.stderr);
        assert!(!out.status.success() && want.iter().all(|w| err.contains(w)), "{want:?}: {err}");
    };
    let with = |extra: &[&str]| job(&listen, true).into_iter().chain(extra.iter().map(|s| s.to_string())).collect::<Vec<_>>();
    refused(with(&["--lr", "0.5"]), &["--resume-job takes job", "lr = 0.5 (the job has 0.002)"]);
    let mut more_steps = job(&listen, true);
    let at = more_steps.iter().position(|a| a == "80").unwrap();
    more_steps[at] = "90".into();
    refused(more_steps, &["--steps 90 would change steps (the job has 80)"]);
    let mut two = job(&listen, true);
    two[5] = "2".into(); // --workers 2
    refused(two, &["--workers 2 would change the workers it was started with (4; it has 4 now)"]);
    refused(job(&listen, false), &["holds the state of job", "--resume-job takes it back"]);
    std::thread::sleep(Duration::from_secs(2).saturating_sub(lost_at.elapsed()));
    assert!(workers.iter().all(|&w| alive(w)), "the workers wait for a controller");
    assert!(agents.iter_mut().all(|(c, _)| c.try_wait().unwrap().is_none()), "the agents wait for a controller");
    assert!(ck.join("controller-state.json").exists(), "the controller saved what a new one needs");
    let again = job(&addr, true);
    let (mut controller, ctl_lines, again_addr) = start_controller(&again.iter().map(String::as_str).collect::<Vec<_>>(), None);
    assert_eq!(again_addr, addr);
    let text = wait::job_success(&mut controller, &ctl_lines, &path, "the job taken back completes");
    let (steps, reconf) = log(&path);
    assert!(steps.len() > killed_at, "steps after the restart");
    eprintln!("killed after {killed_at} steps logged; {}", reconf[0]);
    let numbers: Vec<u64> = steps.iter().map(|s| s.0).collect();
    assert_eq!(numbers, (1..=80).collect::<Vec<u64>>(), "every step once, in order");
    assert_same_losses(&steps, &want, "the controller killed and started again");
    assert_eq!(reconf.len(), 1, "{reconf:?}");
    assert_eq!(reconf[0]["cause"], "controller", "{}", reconf[0]);
    assert_eq!(reconf[0]["workers"].as_u64(), Some(4), "{}", reconf[0]);
    assert_eq!(reconf[0]["lost"], serde_json::json!([]), "{}", reconf[0]);
    let (detect, recovery) = (reconf[0]["detect_s"].as_f64().unwrap(), reconf[0]["recovery_s"].as_f64().unwrap());
    assert!(
        detect >= 2.0 && recovery > detect,
        "counted from the loss of the controller (the 2 s without one): {}\n{}",
        reconf[0],
        text.join("\n")
    );
    for (child, lines) in &mut agents {
        let text = wait::success(child, lines, "an agent taken back", Duration::from_secs(30));
        assert!(text.iter().any(|l| l.contains("taken back by the controller")), "{}", text.join("\n"));
    }
    assert!(!ck.join("controller-state.json").exists(), "a completed job leaves nothing to take back");
}

/// A worker SIGKILLed while there is no controller: its agent tells the new controller of its
/// end when it re-attaches, the new controller loses its node whole and moves the job to the
/// other node's workers, with every expert's state (each expert has a replica on both nodes).
#[test]
fn a_worker_lost_while_there_is_no_controller_is_recovered_from_by_the_new_one() {
    let job = RestartableJob::new("agents-controller-gap-loss", 1, "60");
    let want = uninterrupted("60", &job.d);
    let (mut controller, ctl_lines, addr) = job.controller(&[]);
    let mut agents: Vec<(Child, mpsc::Receiver<String>)> =
        (0..2).map(|_| start_agent_with_grace(&addr, "2", &job.secret, None, "60")).collect();
    wait_for_steps(&job.path, 12);
    signal(controller.id() as i32, libc::SIGKILL);
    let _ = controller.wait();
    drop(ctl_lines);
    // The agent finds its controller gone; then one of its workers is killed, and the agent
    // reaps it (its /proc entry goes) before any controller is back.
    wait::line(&agents[1].1, "the agent waiting for a controller", Duration::from_secs(30), &mut Vec::new(), |l| l.contains("wait up to"));
    let victim = children(agents[1].0.id() as i32)[0];
    signal(victim, libc::SIGKILL);
    wait::until_true(format!("the agent to reap its worker {victim}"), Duration::from_secs(30), || {
        !std::path::Path::new(&format!("/proc/{victim}")).exists()
    });
    // Started as a supervisor starts it: a running job's state in the checkpoint directory is
    // taken back (no checkpoint would be resumed instead).
    let (mut controller, ctl_lines, _) = job.controller(&["--resume-if-any"]);
    wait::job_success(&mut controller, &ctl_lines, &job.path, "the job taken back");
    let (steps, reconf) = log(&job.path);
    assert_eq!(steps.iter().map(|s| s.0).collect::<Vec<u64>>(), (1..=60).collect::<Vec<u64>>(), "every step once, in order");
    assert_same_losses(&steps, &want, "a worker lost while there was no controller");
    assert_eq!(reconf.len(), 1, "{reconf:?}");
    assert_eq!(reconf[0]["cause"], "controller", "{}", reconf[0]);
    assert_eq!(reconf[0]["workers"].as_u64(), Some(2), "{}", reconf[0]);
    assert_eq!(reconf[0]["lost"].as_array().map(Vec::len), Some(2), "the node of the lost worker, whole: {}", reconf[0]);
    let [(kept, kept_lines), (lost, lost_lines)] = &mut agents[..] else { unreachable!() };
    wait::success(kept, kept_lines, "the agent of the node kept", Duration::from_secs(30));
    wait::exit(lost, lost_lines, "the agent of the lost node", Duration::from_secs(30));
}

/// The controller SIGKILLed and every node lost with it (both agents and their workers killed):
/// the controller started again with `--resume-job` waits for the saved members, finds none
/// within its re-attach window, and — new nodes having attached meanwhile — carries the job on
/// from the last checkpoint by itself, saying so: the log is cut back to the checkpoint and
/// every step after it is trained once more, with the losses of an uninterrupted run.
#[test]
fn a_job_none_of_whose_nodes_come_back_goes_on_from_its_last_checkpoint_with_new_ones() {
    let job = RestartableJob::new("agents-controller-all-lost", 5, "60");
    let want = uninterrupted("60", &job.d);
    let (mut controller, ctl_lines, addr) = job.controller(&[]);
    let agents: Vec<(Child, mpsc::Receiver<String>)> =
        (0..2).map(|_| start_agent_with_grace(&addr, "2", &job.secret, None, "60")).collect();
    wait_for_steps(&job.path, 25);
    signal(controller.id() as i32, libc::SIGKILL);
    let _ = controller.wait();
    drop(ctl_lines);
    // Every node lost with it: its agents and their workers.
    for (mut agent, _) in agents {
        let workers = children(agent.id() as i32);
        signal(agent.id() as i32, libc::SIGKILL);
        for w in workers {
            signal(w, libc::SIGKILL);
        }
        let _ = agent.wait();
    }
    let (mut controller, ctl_lines, addr) = job.controller(&["--resume-job"]);
    let mut fresh: Vec<(Child, mpsc::Receiver<String>)> =
        (0..2).map(|_| start_agent_with_grace(&addr, "2", &job.secret, None, "60")).collect();
    let text = wait::job_success(&mut controller, &ctl_lines, &job.path, "the job goes on from its checkpoint");
    assert!(text.iter().any(|l| l.contains("no member came back")), "and says so: {}", text.join("\n"));
    // The log as a reader takes it: a rollback cuts it back to its step.
    let mut steps: Vec<(u64, f64)> = Vec::new();
    let mut rollbacks = Vec::new();
    for line in std::fs::read_to_string(&job.path).unwrap().lines() {
        let v: serde_json::Value = serde_json::from_str(line).unwrap();
        if v["event"] == "reconfiguration" && v["cause"] == "rollback" {
            let to = v["step"].as_u64().unwrap();
            steps.retain(|s| s.0 <= to);
            rollbacks.push(v);
        } else if !v["event"].is_string() {
            steps.push((v["step"].as_u64().unwrap(), v["loss"].as_f64().unwrap()));
        }
    }
    assert_eq!(rollbacks.len(), 1, "{rollbacks:?}");
    let to = rollbacks[0]["step"].as_u64().unwrap();
    assert!(to >= 20 && to % 10 == 0, "back to the last checkpoint the first controller saw: {}", rollbacks[0]);
    assert_eq!(rollbacks[0]["workers"].as_u64(), Some(4), "the new nodes' workers: {}", rollbacks[0]);
    assert_same_losses(&steps, &want, "carried on from the checkpoint by new nodes");
    for (child, lines) in &mut fresh {
        wait::success(child, lines, "an agent at the job's end", Duration::from_secs(30));
    }
}

/// The controller SIGKILLed at chosen instants around a worker's loss — while the loss is found
/// out, while the survivors report, during the move it decided — and started again after 0 to
/// 1 s: whatever it had saved and whatever the workers had heard, the new controller takes the
/// job back with every step once and the losses of an uninterrupted run.
#[test]
fn a_controller_killed_during_a_recovery_is_taken_over_at_every_phase() {
    for (i, (after_ms, down_ms)) in [(0u64, 0u64), (15, 300), (40, 1000)].into_iter().enumerate() {
        let job = RestartableJob::new(&format!("agents-controller-phase-{i}"), 2 + i as u32, "60");
        let want = uninterrupted("60", &job.d);
        let (mut controller, ctl_lines, addr) = job.controller(&[]);
        let mut agents: Vec<(Child, mpsc::Receiver<String>)> =
            (0..2).map(|_| start_agent_with_grace(&addr, "2", &job.secret, None, "60")).collect();
        wait_for_steps(&job.path, 12);
        let victim = children(agents[1].0.id() as i32)[0];
        signal(victim, libc::SIGKILL);
        std::thread::sleep(Duration::from_millis(after_ms));
        signal(controller.id() as i32, libc::SIGKILL);
        let _ = controller.wait();
        drop(ctl_lines);
        std::thread::sleep(Duration::from_millis(down_ms));
        let (mut controller, ctl_lines, _) = job.controller(&["--resume-job"]);
        let what = format!("killed {after_ms} ms after the worker, down {down_ms} ms");
        wait::job_success(&mut controller, &ctl_lines, &job.path, format!("{what}: the job taken back"));
        let (steps, reconf) = log(&job.path);
        assert_eq!(steps.iter().map(|s| s.0).collect::<Vec<u64>>(), (1..=60).collect::<Vec<u64>>(), "{what}: every step once");
        assert_same_losses(&steps, &want, &what);
        assert!(reconf.iter().all(|r| r["cause"] != "rollback"), "{what}: nothing rolled back: {reconf:?}");
        let epochs: Vec<u64> = reconf.iter().map(|r| r["epoch"].as_u64().unwrap()).collect();
        assert!(epochs.windows(2).all(|w| w[0] < w[1]), "{what}: the epochs go on from the saved one: {reconf:?}");
        eprintln!(
            "{what}: {}",
            reconf.iter().map(|r| format!("{} at epoch {} from step {}", r["cause"], r["epoch"], r["step"])).collect::<Vec<_>>().join("; ")
        );
        assert_eq!(reconf.last().unwrap()["workers"].as_u64(), Some(2), "{what}: {reconf:?}");
        for (child, lines) in &mut agents {
            wait::exit(child, lines, format!("{what}: an agent"), Duration::from_secs(30));
        }
    }
}

/// After a controller took the job back, the host of rank 0 cut off by a partition (found by the
/// soak): its agent waits for a controller, finds its node given up when the link is back, and
/// stops; the job goes on on the other host with every step logged once (the steps rank 0 ran
/// but could not report come from the survivors' copies).
#[test]
fn a_partition_after_a_takeover_loses_no_step() {
    let tag = format!("t{}", std::process::id() % 100_000);
    let Some(hosts) = Hosts::new(&tag, 3) else {
        eprintln!("skipped: network namespaces cannot be made here (needs root and iproute2)");
        return;
    };
    let d = dir("agents-takeover-partition");
    let (path, ck, secret) = (d.join("log.jsonl"), d.join("ck"), d.join("secret"));
    let (log_s, ck_s, secret_s) =
        (path.to_str().unwrap().to_string(), ck.to_str().unwrap().to_string(), secret.to_str().unwrap().to_string());
    let want = uninterrupted("300", &d);
    let mut args =
        vec!["--listen", "10.231.0.1:7070", "--secret-file", &secret_s, "--workers", "4", "--gpus-per-node", "2", "--lease", "0.5"];
    args.extend(tiny());
    args.extend(["--steps", "300", "--json-log", &log_s, "--checkpoint-dir", &ck_s, "--checkpoint-every", "25"]);
    let (mut controller, ctl_lines, addr) = start_controller(&args, Some(&hosts.names[0]));
    let mut agents: Vec<(Child, mpsc::Receiver<String>)> =
        (1..=2).map(|h| start_agent_with_grace(&addr, "2", &secret, Some(&hosts.names[h]), "5")).collect();
    wait_for_steps(&path, 10);
    signal(controller.id() as i32, libc::SIGKILL);
    let _ = controller.wait();
    drop(ctl_lines);
    std::thread::sleep(Duration::from_millis(300));
    args.push("--resume-job");
    let (mut controller, ctl_lines, _) = start_controller(&args, Some(&hosts.names[0]));
    let at = log(&path).0.len();
    wait_for_steps(&path, at + 30);
    // The host whose agent started rank 0.
    let mut texts: Vec<Vec<String>> = vec![Vec::new(), Vec::new()];
    for (i, (_, lines)) in agents.iter().enumerate() {
        texts[i].extend(lines.try_iter());
    }
    let rank0 = texts.iter().position(|t| t.iter().any(|l| l.contains("started workers (ranks 0,"))).expect("rank 0's agent");
    hosts.partition(rank0 + 1);
    std::thread::sleep(Duration::from_millis(1500));
    hosts.heal(rank0 + 1);
    let text = wait::job_success(&mut controller, &ctl_lines, &path, "the controller");
    let (steps, reconf) = log(&path);
    assert_same_losses(&steps, &want, &format!("rank 0's host cut off after a takeover: {reconf:?}\n{}", text.join("\n")));
    for (child, lines) in &mut agents {
        wait::exit(child, lines, "an agent", Duration::from_secs(40));
    }
}

/// The controller SIGKILLed while a node that joined stands by to be taken in. Whatever the race
/// between the kill and the join — the node's workers started or not, its attach welcomed or
/// not, its rejoin refused by the new controller (it held nothing, so it was not saved) and made
/// again as a newcomer's, or taken in by the move that takes the job back — the job completes
/// with every step once and the losses of an uninterrupted run, and the node ends up a member
/// with its workers.
#[test]
fn a_node_standing_by_when_the_controller_is_lost_joins_the_job_taken_back() {
    // Every step takes at least 10 ms (`LAZARUS_FAULT=pace:10` on the workers): the job lasts
    // 6 s or more on any machine, longer than a restart and a join take on a fast one; a slow
    // one is waited for as long as it logs steps.
    let steps = "600";
    let job = RestartableJob::new("agents-controller-standby", 9, steps);
    let want = uninterrupted(steps, &job.d);
    let s = |p: &std::path::Path| p.to_str().unwrap().to_string();
    let (secret, log_s, ck) = (s(&job.secret), s(&job.path), s(&job.ck));
    let mut args = vec!["--listen", &job.listen, "--secret-file", &secret, "--workers", "4", "--gpus-per-node", "2"];
    args.extend(["--max-workers", "6", "--join-wait", "1", "--lease", "0.5"]);
    args.extend(tiny());
    args.extend(["--steps", steps, "--json-log", &log_s, "--checkpoint-dir", &ck, "--checkpoint-every", "100"]);
    let (mut controller, ctl_lines, addr) = start_controller(&args, None);
    let agent = || start_agent_with_env(&addr, "2", &job.secret, None, "60", &common::paced(10));
    let mut agents: Vec<(Child, mpsc::Receiver<String>)> = vec![agent(), agent()];
    wait_for_steps(&job.path, 20);
    agents.push(agent());
    let mut seen = Vec::new();
    wait::line(&ctl_lines, "the third node standing by", Duration::from_secs(60), &mut seen, |l| l.contains("standing by to be taken in"));
    signal(controller.id() as i32, libc::SIGKILL);
    let _ = controller.wait();
    drop(ctl_lines);
    args.push("--resume-job");
    let (mut controller, ctl_lines, _) = start_controller(&args, None);
    let text = wait::job_success(&mut controller, &ctl_lines, &job.path, "the job taken back");
    let (steps, reconf) = log(&job.path);
    let what = format!("a node standing by when the controller was lost: {reconf:?}");
    assert_same_losses(&steps, &want, &what);
    assert!(reconf.iter().any(|r| r["cause"] == "controller"), "the job was taken back: {what}");
    assert!(reconf.iter().all(|r| r["cause"] != "rollback"), "nothing rolled back: {what}");
    // The node is a member at the end: the job's last move has every node's workers, and it
    // took the newcomer's in (by a join, or in the move that took the job back).
    let last = reconf.last().unwrap_or_else(|| panic!("{what}"));
    assert_eq!(last["workers"].as_u64(), Some(6), "{what}\n{}", wait::tail(&text));
    let joined = reconf.iter().filter_map(|r| r["joined"].as_array()).map(Vec::len).sum::<usize>();
    assert!(joined >= 2, "the newcomer's two workers were taken in: {what}");
    // Its agent ends as a member's does: every one of its workers finished the job.
    let (newcomer, newcomer_lines) = &mut agents[2];
    let said = wait::success(newcomer, newcomer_lines, "the newcomer's agent", Duration::from_secs(30));
    assert!(said.iter().any(|l| l.contains("agent: the job completed")), "{}", said.join("\n"));
    for (i, (child, lines)) in agents[..2].iter_mut().enumerate() {
        wait::success(child, lines, format!("the agent of node {i}"), Duration::from_secs(30));
    }
}

/// `lazarus bench controller` drives a real controller process with synthetic agents over the
/// real protocol: the job starts, a node is lost and the survivors are moved (only the lost
/// node's experts travel), nodes join, and the report says what each took.
#[test]
fn bench_controller_drives_a_real_controller_through_a_node_loss_a_join_and_a_rebalance() {
    let d = dir("bench-controller");
    let keep = d.join("run");
    let args = [
        "bench",
        "controller",
        "--nodes",
        "6",
        "--gpus-per-node",
        "2",
        "--layers",
        "3",
        "--experts",
        "8",
        "--joins",
        "2",
        "--steady",
        "1",
        "--step",
        "0.1",
        "--lease",
        "2",
        "--rebalance-every",
        "3",
        "--json",
        "--keep",
        keep.to_str().unwrap(),
    ];
    let out = lazarus(&args);
    assert!(out.status.success(), "{}", String::from_utf8_lossy(&out.stderr));
    let r: Value = serde_json::from_slice(&out.stdout).unwrap();
    assert_eq!((r["workers"].as_u64(), r["layers"].as_u64(), r["experts"].as_u64()), (Some(12), Some(3), Some(8)), "{r}");
    assert!(r["steady"]["messages_per_s"].as_f64().unwrap() > 0.0 && r["steady"]["steps"].as_u64().unwrap() > 0, "{r}");
    for what in ["node_loss", "join"] {
        let m = &r[what];
        let (first, out_ms, ready, step) = (
            m["first_order_ms"].as_f64().unwrap(),
            m["orders_out_ms"].as_f64().unwrap(),
            m["ready_ms"].as_f64().unwrap(),
            m["next_step_ms"].as_f64().unwrap(),
        );
        assert!(0.0 <= first && first <= out_ms && out_ms <= ready && ready <= step, "{what}: {m}");
        assert!(m["plan_s"].as_f64().is_some(), "{what}: the controller's record of the move: {m}");
    }
    // The controller's log: the loss moved the survivors (no rollback), then the joiners came in.
    let records: Vec<Value> = std::fs::read_to_string(keep.join("log.jsonl"))
        .unwrap()
        .lines()
        .filter_map(|l| serde_json::from_str::<Value>(l).ok())
        .filter(|v| v["event"] == "reconfiguration")
        .collect();
    let causes: Vec<&str> = records.iter().map(|v| v["cause"].as_str().unwrap()).collect();
    // Last, the loads drift and the next rebalance weighed moves the experts (the fakes' loads
    // were balanced by the plan before: every earlier weighing skips).
    assert_eq!(causes, ["reconfigure", "join", "rebalance"], "{records:?}");
    assert_eq!((records[0]["lost"].as_array().unwrap().len(), records[0]["workers"].as_u64()), (2, Some(10)));
    assert_eq!((records[1]["workers"].as_u64(), records[2]["workers"].as_u64()), (Some(14), Some(14)));
    let b = &r["rebalance"];
    assert_eq!(b["decision"], "apply", "{b}");
    assert!(b["weigh_s"].as_f64().is_some_and(|s| s > 0.0) && b["transfers"].as_u64() > Some(0), "{b}");
    assert!(b["move_s"].as_f64().is_some_and(|s| s > 0.0), "the move's record: {b}");
    assert_eq!((b["move_workers"].as_u64(), b["other_moves"].clone()), (Some(14), serde_json::json!([])), "{b}");
    let bad = lazarus(&["bench", "controller", "--nodes", "1"]);
    assert!(!bad.status.success() && String::from_utf8_lossy(&bad.stderr).contains("--nodes"));
    let bad = lazarus(&["bench", "controller", "--nodes", "1025", "--gpus-per-node", "16"]);
    assert!(!bad.status.success() && String::from_utf8_lossy(&bad.stderr).contains("16384"), "{}", String::from_utf8_lossy(&bad.stderr));
    // A rebalance phase that would wait for days is refused before anything starts.
    let bad = lazarus(&["bench", "controller", "--rebalance-every", "100000"]);
    let err = String::from_utf8_lossy(&bad.stderr);
    assert!(!bad.status.success() && err.contains("invalid --rebalance-every: 100000") && err.contains("at most 3600 s"), "{err}");
}

/// An agent whose workers could not listen where it says they will (an address this node does
/// not have) is refused before it attaches, naming --host — it cannot fail the job's start for
/// the healthy nodes — and the controller logs where each agent's connection came from, not
/// only the address it claims.
#[test]
fn an_agent_with_a_host_it_cannot_listen_on_is_refused_before_it_attaches() {
    let d = dir("agents-bad-host");
    let [(path, log_s), (secret, secret_s)] = files(&d, ["log.jsonl", "secret"]);
    let mut args = vec!["--listen", "127.0.0.1:0", "--secret-file", &secret_s, "--workers", "2", "--gpus-per-node", "1"];
    args.extend(tiny());
    args.extend(["--steps", "10", "--json-log", &log_s]);
    let (mut controller, ctl_lines, addr) = start_controller(&args, None);
    let (mut bad, bad_lines) =
        spawn_lazarus(&["agent", "--controller", &addr, "--gpus", "1", "--secret-file", &secret_s, "--host", "10.255.255.1"], &[]);
    let text = wait::failure(&mut bad, &bad_lines, "an agent with --host 10.255.255.1", Duration::from_secs(30));
    assert!(text.iter().any(|l| l.contains("--host") && l.contains("10.255.255.1")), "{}", text.join("\n"));
    let mut agents: Vec<(Child, mpsc::Receiver<String>)> = (0..2).map(|_| start_agent(&addr, "1", &secret, None)).collect();
    let text = wait::job_success(&mut controller, &ctl_lines, &path, "the job of the healthy nodes");
    for (child, lines) in &mut agents {
        wait::success(child, lines, "a healthy agent", Duration::from_secs(30));
    }
    assert_eq!(log(&path).0.len(), 10);
    let attached: Vec<&String> = text.iter().filter(|l| l.contains(" attached from ")).collect();
    assert_eq!(attached.len(), 2, "{}", text.join("\n"));
    assert!(
        attached.iter().all(|l| l.contains("attached from 127.0.0.1:") && l.contains("its workers listening on 127.0.0.1")),
        "where it came from, and what it claims: {attached:?}"
    );
}

/// The controller SIGSTOPped mid-job for 1, 3 and then 20 s (a stall: a long GC-like pause, a
/// host swapping, a debugger) and let go with SIGCONT. Its agents find it silent past their
/// lease and pause their workers after the step in flight; it does not count its own silence
/// against their leases, and when it speaks again on their sessions they go on with it — every
/// step once, the losses of an uninterrupted run, nothing rolled back, every node still in.
#[test]
fn a_controller_stalled_for_1_3_and_20_seconds_keeps_its_job() {
    let steps = "400";
    let job = RestartableJob::new("agents-controller-stalled", 11, steps);
    let want = uninterrupted(steps, &job.d);
    let (mut controller, ctl_lines, addr) = job.controller(&[]);
    // Paced (every step 10 ms or more): the job outlasts its three stalls on any machine.
    let agent = || start_agent_with_env(&addr, "2", &job.secret, None, "60", &common::paced(10));
    let mut agents: Vec<(Child, mpsc::Receiver<String>)> = vec![agent(), agent()];
    let pid = controller.id() as i32;
    let mut at = 20;
    for stall in [1u64, 3, 20] {
        wait_for_steps(&job.path, at);
        signal(pid, libc::SIGSTOP);
        std::thread::sleep(Duration::from_secs(stall)); // the stall's length: the fault itself
        signal(pid, libc::SIGCONT);
        at = wait::logged(&job.path) + 30;
    }
    let text = wait::job_success(&mut controller, &ctl_lines, &job.path, "the job of a controller stalled three times");
    let (steps, moves) = log(&job.path);
    let what = format!("a controller stalled for 1, 3 and 20 s: {moves:?}");
    assert_same_losses(&steps, &want, &what);
    assert!(moves.iter().all(|m| m["cause"] != "rollback" && m["lost"] == serde_json::json!([])), "nothing lost: {what}");
    assert!(moves.iter().all(|m| m["workers"].as_u64() == Some(4)), "every node still in: {what}\n{}", wait::tail(&text));
    for (i, (child, lines)) in agents.iter_mut().enumerate() {
        let said = wait::success(child, lines, format!("agent {i}"), Duration::from_secs(30));
        eprintln!(
            "agent {i}: {}",
            said.iter().filter(|l| l.contains("spoke again") || l.contains("silent")).cloned().collect::<Vec<_>>().join(" | ")
        );
    }
}

/// A node that attached to a running job and stood by, never taken in before the job completed
/// (its join wait outlasts the job): its agent exits 0 saying so — a batch system (Slurm) logs
/// no error for a good job's node.
#[test]
fn a_node_still_standing_by_when_the_job_completes_exits_0() {
    let d = dir("agents-standby-end");
    let [(path, log_s), (secret, secret_s)] = files(&d, ["log.jsonl", "secret"]);
    let mut args = vec!["--listen", "127.0.0.1:0", "--secret-file", &secret_s, "--workers", "2", "--gpus-per-node", "1"];
    args.extend(["--max-workers", "3", "--join-wait", "3600"]);
    args.extend(tiny());
    args.extend(["--steps", "300", "--json-log", &log_s]);
    let (mut controller, ctl_lines, addr) = start_controller(&args, None);
    let agent = || start_agent_with_env(&addr, "1", &secret, None, "0", &common::paced(10));
    let mut agents: Vec<(Child, mpsc::Receiver<String>)> = vec![agent(), agent()];
    wait_for_steps(&path, 10);
    agents.push(agent());
    let mut seen = Vec::new();
    wait::line(&ctl_lines, "the third node standing by", Duration::from_secs(60), &mut seen, |l| l.contains("standing by to be taken in"));
    wait::job_success(&mut controller, &ctl_lines, &path, "the job with a node standing by");
    let (standby, standby_lines) = &mut agents[2];
    let said = wait::success(standby, standby_lines, "the agent standing by at the end", Duration::from_secs(60));
    assert!(said.iter().any(|l| l.contains("was not taken in before the end")), "{}", said.join("\n"));
    for (child, lines) in &mut agents[..2] {
        wait::success(child, lines, "a member's agent", Duration::from_secs(30));
    }
    assert_eq!(log(&path).1.len(), 0, "nobody was taken in");
}
