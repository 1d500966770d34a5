//! Jobs of `lazarus controller` + `lazarus agent` processes, on loopback or on hosts made of
//! network namespaces (a "switch" namespace with a bridge, one namespace per host wired to it by
//! a veth pair), whose links a test can take down and bring back.
#![allow(dead_code)] // each test file uses part of it

use std::io::{BufRead, BufReader};
use std::path::Path;
use std::process::{Child, Command, Stdio};
use std::sync::mpsc;
use std::time::{Duration, Instant};

use super::{log, spawn_lazarus};
use serde_json::Value;

/// The processes `pid` started, from any of its threads (a thread of `train --replay` starts
/// local agents too).
pub fn children(pid: i32) -> Vec<i32> {
    let tasks: Vec<std::path::PathBuf> =
        std::fs::read_dir(format!("/proc/{pid}/task")).map(|d| d.flatten().map(|e| e.path()).collect()).unwrap_or_default();
    tasks
        .iter()
        .flat_map(|t| {
            std::fs::read_to_string(t.join("children")).unwrap_or_default().split_whitespace().map(String::from).collect::<Vec<_>>()
        })
        .filter_map(|p| p.parse().ok())
        .collect()
}

/// `lazarus controller --listen` and its printed address.
pub fn start_controller(args: &[&str], netns: Option<&str>) -> (Child, mpsc::Receiver<String>, String) {
    let (child, lines, addr, _) = start_controller_keeping(args, netns);
    (child, lines, addr)
}

/// The same, with the lines it printed before it listened (the placement).
pub fn start_controller_keeping(args: &[&str], netns: Option<&str>) -> (Child, mpsc::Receiver<String>, String, Vec<String>) {
    let (child, lines) = match netns {
        None => {
            let mut all = vec!["controller"];
            all.extend(args);
            spawn_lazarus(&all, &[])
        }
        Some(ns) => spawn_in(ns, "controller", args, &[]),
    };
    let mut seen = Vec::new();
    let line = super::wait::line(&lines, "the controller to listen", Duration::from_secs(60), &mut seen, |l| {
        l.starts_with("controller listening on ")
    });
    seen.pop();
    let addr = line["controller listening on ".len()..].split(':').take(2).collect::<Vec<_>>().join(":");
    (child, lines, addr, seen)
}

/// `lazarus SUBCOMMAND args` in network namespace `ns`, with its stderr lines. `ip netns exec`
/// execs it: the child's pid is the command's.
pub fn spawn_in(ns: &str, subcommand: &str, args: &[&str], env: &[(&str, &str)]) -> (Child, mpsc::Receiver<String>) {
    let mut child = Command::new("ip")
        .args(["netns", "exec", ns, env!("CARGO_BIN_EXE_lazarus"), subcommand])
        .args(args)
        .env("LAZARUS_RUNS_DIR", super::runs_dir())
        .envs(env.iter().copied())
        .stdout(Stdio::null())
        .stderr(Stdio::piped())
        .spawn()
        .unwrap();
    let (tx, rx) = mpsc::channel();
    let stderr = child.stderr.take().unwrap();
    std::thread::spawn(move || {
        for line in BufReader::new(stderr).lines().map_while(Result::ok) {
            let _ = tx.send(line);
        }
    });
    (child, rx)
}

/// `lazarus agent --controller ADDR --gpus G` with the secret file, its stderr lines; an agent
/// that stops its workers as soon as its controller is lost (`--controller-grace 0`).
pub fn start_agent(addr: &str, gpus: &str, secret: &Path, netns: Option<&str>) -> (Child, mpsc::Receiver<String>) {
    start_agent_with_grace(addr, gpus, secret, netns, "0")
}

/// The same, waiting `grace` seconds for a controller to take the job back.
pub fn start_agent_with_grace(addr: &str, gpus: &str, secret: &Path, netns: Option<&str>, grace: &str) -> (Child, mpsc::Receiver<String>) {
    start_agent_with_env(addr, gpus, secret, netns, grace, &[])
}

/// [`start_agent_with_grace`] with `env` set for the agent and its workers.
pub fn start_agent_with_env(
    addr: &str,
    gpus: &str,
    secret: &Path,
    netns: Option<&str>,
    grace: &str,
    env: &[(&str, &str)],
) -> (Child, mpsc::Receiver<String>) {
    let args = ["--controller", addr, "--gpus", gpus, "--secret-file", secret.to_str().unwrap(), "--controller-grace", grace];
    match netns {
        None => {
            let mut all = vec!["agent"];
            all.extend(args);
            spawn_lazarus(&all, env)
        }
        Some(ns) => spawn_in(ns, "agent", &args, env),
    }
}

/// Network namespaces made for one test; removed when dropped.
pub struct Hosts {
    pub names: Vec<String>,
    switch: String,
    tag: String,
}

fn ip(args: &[&str]) -> bool {
    Command::new("ip").args(args).stdout(Stdio::null()).stderr(Stdio::null()).status().is_ok_and(|s| s.success())
}

impl Hosts {
    /// Hosts 10.231.0.1, .2, … named `lz{tag}{i}`; None where namespaces cannot be made here
    /// (not root, no `ip`).
    pub fn new(tag: &str, n: usize) -> Option<Self> {
        let switch = format!("lz{tag}s");
        let mut hosts = Hosts { names: Vec::new(), switch: switch.clone(), tag: tag.to_string() };
        if !ip(&["netns", "add", &switch]) {
            return None;
        }
        let ok = ip(&["-n", &switch, "link", "add", "br0", "type", "bridge"]) && ip(&["-n", &switch, "link", "set", "br0", "up"]);
        if !ok {
            return None;
        }
        for i in 0..n {
            let name = format!("lz{tag}{i}");
            if !ip(&["netns", "add", &name]) {
                return None;
            }
            hosts.names.push(name.clone());
            let (veth, port) = (format!("lz{tag}v{i}"), format!("lz{tag}p{i}"));
            let addr = format!("10.231.0.{}/24", i + 1);
            let ok = ip(&["link", "add", &veth, "type", "veth", "peer", "name", &port])
                && ip(&["link", "set", &veth, "netns", &name])
                && ip(&["link", "set", &port, "netns", &switch])
                && ip(&["-n", &switch, "link", "set", &port, "master", "br0"])
                && ip(&["-n", &switch, "link", "set", &port, "up"])
                && ip(&["-n", &name, "addr", "add", &addr, "dev", &veth])
                && ip(&["-n", &name, "link", "set", &veth, "up"])
                && ip(&["-n", &name, "link", "set", "lo", "up"]);
            if !ok {
                return None;
            }
        }
        Some(hosts)
    }

    /// Cut host `i` off the switch (both directions).
    pub fn partition(&self, i: usize) {
        assert!(ip(&["-n", &self.switch, "link", "set", &format!("lz{}p{i}", self.tag), "down"]));
    }

    /// Wire host `i` to the switch again.
    pub fn heal(&self, i: usize) {
        assert!(ip(&["-n", &self.switch, "link", "set", &format!("lz{}p{i}", self.tag), "up"]));
    }
}

impl Drop for Hosts {
    fn drop(&mut self) {
        for n in self.names.iter().chain([&self.switch]) {
            ip(&["netns", "del", n]);
        }
    }
}

/// Read `lines` until `want` agents have attached (`agent A attached from ADDR (pid P), …`); their
/// pids in order of arrival. Every line read is kept in `seen`.
pub fn agent_pids(lines: &mpsc::Receiver<String>, want: usize, seen: &mut Vec<String>) -> Vec<i32> {
    let mut pids = Vec::new();
    while pids.len() < want {
        let what = format!("agent {} of {want} to attach", pids.len() + 1);
        let line = super::wait::line(lines, what, Duration::from_secs(120), seen, |l| l.contains(" attached from "));
        pids.push(line.split("(pid ").nth(1).unwrap().split(')').next().unwrap().parse().unwrap());
    }
    pids
}

/// Wait until the `--json-log` at `path` has `n` reconfiguration records, for as long as the
/// log grows (a move's record comes a recovery after the last step's, well within
/// [`super::wait::STALL`]).
pub fn wait_for_records(path: &Path, n: usize) -> Vec<Value> {
    let mut at = (super::wait::logged(path), Instant::now());
    loop {
        let (_, records) = log(path);
        if records.len() >= n {
            return records;
        }
        let now = super::wait::logged(path);
        if now != at.0 {
            at = (now, Instant::now());
        }
        assert!(
            at.1.elapsed() < super::wait::STALL,
            "waited for reconfiguration record {n} in {}: the log stopped at line {now} with {records:?}",
            path.display()
        );
        std::thread::sleep(Duration::from_millis(20));
    }
}

/// The experts of MoE layer `layer` each worker holds, from the `placement L0: w0[1,3] w1[2x2]`
/// lines a job prints.
pub fn placement(lines: &[String], layer: usize) -> Vec<Vec<usize>> {
    let prefix = format!("placement L{layer}: ");
    let line = lines.iter().find_map(|l| l.strip_prefix(&prefix)).expect("the placement is printed");
    line.split_whitespace()
        .map(|w| {
            let inner = w.split('[').nth(1).unwrap().trim_end_matches(']');
            inner.split(',').filter(|x| !x.is_empty()).map(|x| x.split('x').next().unwrap().parse().unwrap()).collect()
        })
        .collect()
}
