//! A soak of many faults: a job of `lazarus controller` and up to three `lazarus
//! agent`s of two workers each — every one on a host of its own (a network namespace) where
//! namespaces can be made, on loopback otherwise. A fault injector picks, at random steps and
//! phases, among: a worker SIGKILLed; workers of two nodes SIGKILLed at once or a moment apart
//! (the second often during the move after the first); every node holding some expert
//! SIGKILLed at once (the job rolls back to its last checkpoint); an agent SIGKILLed; a worker
//! SIGSTOPped (found by its lease); a preemption notice (SIGTERM to an agent); a newcomer killed
//! before it was taken in; the controller SIGKILLed and started again with `--resume-job` after
//! 0–2 s (the agents wait for it with their workers paused); and a host's link taken down and
//! brought back after 0.2–3 s (a lease
//! is 0.5 s: sometimes the node is lost and its agent stops itself, and what it sends once the
//! link is back is refused; sometimes the link is back first and the job just waits). Faults are
//! paced by the job's steps (a window of steps between two, drawn from the seed), not by the
//! clock, and every step takes at least 8 ms (`LAZARUS_FAULT=pace:8`), so a fast machine and a
//! slow one see as many. Hosts
//! whose agent is gone get a new one after a while, which joins the running job. Throughout, a
//! stranger without the secret (on a host of its own) connects to every port of the job as it
//! opens — each rank's at every rendezvous, the controller's and its `/metrics` every 2 s —
//! silently, with garbage, with one TLS byte, a byte at a time. Faults are
//! chosen from `lazarus status --json` (members, standbys, the plan) so that the job keeps
//! workers to carry on: a surviving node, or a newcomer standing by.
//!
//! The job trains with `--deterministic`, so the bar is exact: the run must finish with no
//! hang, every step logged once with the loss bits of an uninterrupted run on one worker, the
//! same data cursor, and a final checkpoint whose tensors have the same bytes. It reports the
//! time each kind of fault cost. (Compared within a tolerance, as it was before deterministic
//! steps, a soak could not tell a lost update from float summation order: training is chaotic
//! enough that another worker count alone moves the tiny model's losses past 1e-4 after ~500
//! steps at the default learning rate; its small learning rates are from then.)
//!
//! The short soak (12 faults, 1,000 steps, lr 2e-5) runs in CI. The full one (≥ 50 faults and
//! ≥ 50 SIGKILLs, 4,500 steps, lr 1e-5) takes minutes:
//! `cargo test --release -p lazarus-cli --test soak_cli -- --ignored --nocapture`
//! (`LAZARUS_SOAK_FAULTS`, `LAZARUS_SOAK_KILLS`, `LAZARUS_SOAK_STEPS` and `LAZARUS_SOAK_SEED`
//! change it).

mod common;

use std::collections::{BTreeMap, BTreeSet};
use std::os::unix::fs::MetadataExt;
use std::path::PathBuf;
use std::process::Child;
use std::sync::mpsc::Receiver;
use std::time::{Duration, Instant};

use common::hosts::{children, start_agent_with_env, start_controller, Hosts};
use common::stranger::{Done, Plan as StrangerPlan, Stranger};
use common::{alive, cursor, dir, lazarus, log, signal, tiny_model};
use serde_json::Value;

/// Hosts for agents (each runs at most one agent of two workers; the job has room for three).
const AGENT_HOSTS: usize = 3;
const GPUS: usize = 2;
/// The least time a step of the soak's job takes (`LAZARUS_FAULT=pace:MS` on its workers): the
/// job runs at a slow machine's pace wherever it runs, so that its hosts, tended by the clock
/// (a new agent after a lost one, a link back), are as fast in steps as the faults, drawn by
/// steps. (Unpaced, a fast 2-core machine ran 4,500 steps in ~30 s and made 37–45 of 50 faults.)
const PACE_MS: u64 = 8;
/// How long the job may make no progress after a fault before the soak calls it a hang.
const HANG: Duration = Duration::from_secs(120);
/// Silent connections of the stranger's every visit to a port (besides one of garbage, one TLS
/// byte and one trickle).
const STRANGER_SILENT: usize = 8;
/// How long each rendezvous holds its port open before the ranks connect
/// (`LAZARUS_FAULT=listen:MS`), so that the stranger, which looks every few ms, is at it first.
const LISTEN_HOLD_MS: u64 = 50;

/// A small deterministic generator (the soak's choices follow from its seed).
struct Rng(u64);

impl Rng {
    fn below(&mut self, n: usize) -> usize {
        self.0 = self.0.wrapping_add(0x9E37_79B9_7F4A_7C15);
        let mut z = self.0;
        z = (z ^ (z >> 30)).wrapping_mul(0xBF58_476D_1CE4_E5B9);
        z = (z ^ (z >> 27)).wrapping_mul(0x94D0_49BB_1331_11EB);
        ((z ^ (z >> 31)) % n.max(1) as u64) as usize
    }

    fn millis(&mut self, from: u64, to: u64) -> Duration {
        Duration::from_millis(from + self.below((to - from) as usize) as u64)
    }

    /// A whole number in [from, to].
    fn within(&mut self, from: u64, to: u64) -> u64 {
        from + self.below((to - from + 1) as usize) as u64
    }
}

/// The steps between one fault and the next: drawn per window of steps, not of seconds, so that
/// a seed makes the same faults at the same steps on a fast machine and a slow one, and the
/// faults asked for (`need`; SIGKILLs come with about two faults in three) fit in the first half
/// of a job of `steps` steps. The other half is slack: steps a rollback trains again, draws the
/// job could not carry on from (no node left to carry it while a lost host's new agent starts),
/// a SIGKILL quota that lags the faults.
fn fault_gap(steps: u64, need: usize) -> (u64, u64) {
    let mean = (steps / 2 / need.max(1) as u64).max(4);
    (mean / 2, mean * 3 / 2)
}

/// The step lines and moves of a growing `--json-log`, read as they come (a rollback rewrites
/// the file: a new inode, read again from the start).
struct LogTail {
    path: PathBuf,
    inode: u64,
    offset: u64,
    partial: String,
    /// The highest step logged now.
    step: u64,
    /// The moves of the job (reconfiguration records), with when the soak saw each.
    moves: Vec<(Instant, Value)>,
}

impl LogTail {
    fn new(path: PathBuf) -> Self {
        LogTail { path, inode: 0, offset: 0, partial: String::new(), step: 0, moves: Vec::new() }
    }

    fn poll(&mut self) -> u64 {
        use std::io::{Read, Seek, SeekFrom};
        let Ok(mut f) = std::fs::File::open(&self.path) else { return self.step };
        let Ok(meta) = f.metadata() else { return self.step };
        if meta.ino() != self.inode || meta.len() < self.offset {
            (self.inode, self.offset, self.step) = (meta.ino(), 0, 0);
            self.partial.clear();
        }
        let mut more = String::new();
        if f.seek(SeekFrom::Start(self.offset)).and_then(|_| f.read_to_string(&mut more)).is_err() {
            return self.step;
        }
        self.offset += more.len() as u64;
        self.partial.push_str(&more);
        while let Some(end) = self.partial.find('\n') {
            let line: String = self.partial.drain(..=end).collect();
            let Ok(v) = serde_json::from_str::<Value>(&line) else { continue };
            if let Some(s) = v.get("step").and_then(Value::as_u64).filter(|_| v.get("event").is_none()) {
                self.step = self.step.max(s);
            } else if v["event"] == "reconfiguration" && !self.moves.iter().any(|(_, m)| m == &v) {
                // (A rewritten log repeats the records before it: each is kept once.)
                self.moves.push((Instant::now(), v));
            }
        }
        self.step
    }
}

/// An agent the soak started.
struct Agent {
    child: Child,
    lines: Receiver<String>,
    /// Its workers' ids, once the controller started them.
    workers: Vec<u64>,
}

impl Agent {
    fn pid(&self) -> i32 {
        self.child.id() as i32
    }

    fn read(&mut self) {
        for line in self.lines.try_iter() {
            if let Some(rest) = line.split("started workers (ranks ").nth(1) {
                self.workers = rest.trim_end_matches(')').split(", ").filter_map(|r| r.parse().ok()).collect();
            }
        }
    }

    /// Its worker processes still running and not stopped by the soak.
    fn worker_pids(&self, stopped: &[i32]) -> Vec<i32> {
        children(self.pid()).into_iter().filter(|&p| alive(p) && !stopped.contains(&p)).collect()
    }
}

#[derive(Debug, Clone, Copy, PartialEq, Eq, PartialOrd, Ord)]
enum Fault {
    WorkerKill,
    TwoNodesKill,
    HoldersKill,
    AgentKill,
    WorkerStop,
    Notice,
    NewcomerKill,
    Partition,
    ControllerKill,
}

impl Fault {
    fn name(self) -> &'static str {
        match self {
            Fault::WorkerKill => "a worker SIGKILLed",
            Fault::TwoNodesKill => "workers of two nodes SIGKILLed, 0-300 ms apart",
            Fault::HoldersKill => "every holder of an expert SIGKILLed at once",
            Fault::AgentKill => "an agent SIGKILLed",
            Fault::WorkerStop => "a worker SIGSTOPped",
            Fault::Notice => "a notice (SIGTERM to an agent)",
            Fault::NewcomerKill => "a newcomer SIGKILLed before it was taken in",
            Fault::Partition => "a host's link down for 0.2-3 s",
            Fault::ControllerKill => "the controller SIGKILLed, started again in 0-2 s",
        }
    }
}

/// One fault made: when, at which step, and when the job had logged two more steps.
struct Made {
    fault: Fault,
    at: Instant,
    step: u64,
}

/// What the controller says of the job now.
struct View {
    /// Agent hosts whose every worker is a member, and those whose workers stand by.
    members: Vec<usize>,
    standby: Vec<usize>,
    /// For each layer and expert, the agent hosts holding a replica.
    holders: Vec<Vec<BTreeSet<usize>>>,
}

struct Soak {
    rng: Rng,
    hosts: Option<Hosts>,
    addr: String,
    secret: PathBuf,
    agents: Vec<Option<Agent>>,
    /// When each agent host may get a new agent (its last one ended), and when its link comes back.
    free_at: Vec<Option<Instant>>,
    heal_at: Vec<Option<Instant>>,
    stopped: Vec<i32>,
    started_again: usize,
    /// SIGKILLs sent (several for a fault that takes several nodes).
    kills: usize,
}

impl Soak {
    fn netns(&self, host: usize) -> Option<&str> {
        self.hosts.as_ref().map(|h| h.names[host + 1].as_str())
    }

    fn start_agent(&mut self, host: usize) {
        // Its workers wait, paused, for a controller that takes the job back.
        // Every step takes at least PACE_MS: the hosts are tended by the clock, the faults are
        // drawn by steps, and a fast machine must not run the job past them.
        let pace = format!("pace:{PACE_MS},listen:{LISTEN_HOLD_MS}");
        let env = [("LAZARUS_FAULT", pace.as_str())];
        let (child, lines) = start_agent_with_env(&self.addr, &GPUS.to_string(), &self.secret, self.netns(host), "10", &env);
        self.agents[host] = Some(Agent { child, lines, workers: Vec::new() });
        self.free_at[host] = None;
    }

    /// Links to bring back, agents that ended, hosts to give a new agent.
    fn tend(&mut self) {
        let now = Instant::now();
        for host in 0..AGENT_HOSTS {
            if self.heal_at[host].is_some_and(|t| t <= now) {
                self.hosts.as_ref().unwrap().heal(host + 1);
                self.heal_at[host] = None;
            }
            if let Some(a) = self.agents[host].as_mut() {
                a.read();
                if let Ok(Some(_)) = a.child.try_wait() {
                    self.agents[host] = None;
                    self.free_at[host] = Some(now + self.rng.millis(150, 1000));
                }
            }
            if self.agents[host].is_none() && self.heal_at[host].is_none() && self.free_at[host].is_some_and(|t| t <= now) {
                self.start_agent(host);
                self.started_again += 1;
            }
        }
    }

    /// `lazarus status --json`, from the controller's host.
    fn status(&self) -> Option<Value> {
        let secret = self.secret.to_str().unwrap_or_default();
        let args = ["status", "--controller", &self.addr, "--json", "--timeout", "2", "--secret-file", secret];
        let out = match self.hosts.as_ref() {
            Some(h) => std::process::Command::new("ip")
                .args(["netns", "exec", &h.names[0], env!("CARGO_BIN_EXE_lazarus")])
                .args(args)
                .output()
                .ok()?,
            None => lazarus(&args),
        };
        serde_json::from_slice(&out.stdout).ok()
    }

    fn view(&mut self) -> Option<View> {
        let v = self.status()?;
        if v["phase"] != "running" {
            return None;
        }
        // Each worker's state and rank.
        let mut state: BTreeMap<u64, (String, Option<u64>)> = BTreeMap::new();
        for m in v["members"].as_array()? {
            state.insert(m["node"].as_u64()?, (m["state"].as_str()?.to_string(), m["rank"].as_u64()));
        }
        let mut view = View { members: Vec::new(), standby: Vec::new(), holders: Vec::new() };
        // The agent host of each rank.
        let mut host_of_rank: BTreeMap<u64, usize> = BTreeMap::new();
        for (host, a) in self.agents.iter_mut().enumerate() {
            let Some(a) = a.as_mut() else { continue };
            a.read();
            if a.workers.is_empty() || self.heal_at[host].is_some() {
                continue;
            }
            let of = |s: &str| a.workers.iter().all(|w| state.get(w).is_some_and(|x| x.0 == s));
            if of("member") {
                view.members.push(host);
                for w in &a.workers {
                    host_of_rank.insert(state[w].1?, host);
                }
            } else if of("standby") {
                view.standby.push(host);
            }
        }
        // The plan file: layer → placement by node (in rank order, G ranks each) → its experts.
        let experts = v["plan"]["experts"].as_u64()? as usize;
        for layer in v["plan"]["layers"].as_array()? {
            let mut holders = vec![BTreeSet::new(); experts];
            for (n, experts) in layer["placement"].as_array()?.iter().enumerate() {
                let host = *host_of_rank.get(&((n * GPUS) as u64))?;
                for e in experts.as_array()? {
                    holders.get_mut(e.as_u64()? as usize)?.insert(host);
                }
            }
            view.holders.push(holders);
        }
        Some(view)
    }

    fn kill_a_worker(&mut self, host: usize) -> bool {
        let a = self.agents[host].as_ref().unwrap();
        let pids = a.worker_pids(&self.stopped);
        if pids.is_empty() {
            return false;
        }
        signal(pids[self.rng.below(pids.len())], libc::SIGKILL);
        self.kills += 1;
        true
    }

    /// Make one fault of a kind the job can carry on from now; which, if any.
    fn fault(&mut self) -> Option<Fault> {
        let View { members, standby, holders } = self.view()?;
        // Sets of nodes holding every replica of some expert that the job can lose: a node
        // stays, or a newcomer stands by to carry the job on from the last checkpoint.
        let mut sets: Vec<Vec<usize>> = holders
            .iter()
            .flatten()
            .filter(|s| s.len() < members.len() || !standby.is_empty())
            .map(|s| s.iter().copied().collect())
            .collect();
        sets.sort();
        sets.dedup();
        // A kind drawn with fixed weights, made only if the job can carry on from it now (else
        // the soak waits and draws again): every kind gets its share, whatever the state.
        let kinds = [
            Fault::WorkerKill,
            Fault::WorkerKill,
            Fault::AgentKill,
            Fault::WorkerStop,
            Fault::Notice,
            Fault::Partition,
            Fault::TwoNodesKill,
            Fault::HoldersKill,
            Fault::NewcomerKill,
            Fault::ControllerKill,
        ];
        let can = |kind: Fault| match kind {
            Fault::Partition => self.hosts.is_some() && members.len() >= 2,
            Fault::TwoNodesKill => members.len() >= 3,
            Fault::HoldersKill => !sets.is_empty(),
            Fault::NewcomerKill => !standby.is_empty(),
            _ => members.len() >= 2,
        };
        let kind = kinds[self.rng.below(kinds.len())];
        if !can(kind) || members.is_empty() {
            return None;
        }
        let host = members[self.rng.below(members.len())];
        let made = match kind {
            Fault::WorkerKill => self.kill_a_worker(host),
            Fault::TwoNodesKill => {
                let other = members.iter().copied().filter(|&h| h != host).nth(self.rng.below(members.len() - 1)).unwrap();
                let gap = self.rng.millis(0, 300);
                self.kill_a_worker(host) && {
                    std::thread::sleep(gap);
                    self.kill_a_worker(other)
                }
            }
            Fault::HoldersKill => {
                let set = sets[self.rng.below(sets.len())].clone();
                // Every one of them, at once (no short cut on a failed kill).
                let killed: Vec<bool> = set.into_iter().map(|h| self.kill_a_worker(h)).collect();
                killed.iter().all(|&k| k)
            }
            Fault::AgentKill => {
                signal(self.agents[host].as_ref().unwrap().pid(), libc::SIGKILL);
                self.kills += 1;
                true
            }
            Fault::WorkerStop => {
                let pids = self.agents[host].as_ref().unwrap().worker_pids(&self.stopped);
                let w = pids.get(self.rng.below(pids.len().max(1))).copied();
                w.inspect(|&w| {
                    signal(w, libc::SIGSTOP);
                    self.stopped.push(w);
                })
                .is_some()
            }
            Fault::Notice => {
                signal(self.agents[host].as_ref().unwrap().pid(), libc::SIGTERM);
                true
            }
            Fault::NewcomerKill => {
                signal(self.agents[standby[self.rng.below(standby.len())]].as_ref().unwrap().pid(), libc::SIGKILL);
                self.kills += 1;
                true
            }
            Fault::Partition => {
                self.hosts.as_ref().unwrap().partition(host + 1);
                self.heal_at[host] = Some(Instant::now() + self.rng.millis(200, 3000));
                true
            }
            // The soak's loop holds the controller: it kills it and starts it again.
            Fault::ControllerKill => true,
        };
        made.then_some(kind)
    }
}

/// What one soak found, for its report and assertions.
struct Outcome {
    made: Vec<Made>,
    kills: usize,
    /// Whether the hosts were network namespaces (partitions possible).
    namespaces: bool,
    started_again: usize,
    wall: Duration,
    steps: Vec<(u64, f64)>,
    /// The job's moves, with when the soak saw each.
    moves: Vec<(Instant, Value)>,
    step_s: f64,
    refused: usize,
    /// What the stranger did.
    stranger: Done,
    controller: Vec<String>,
}

/// How much a soak does: at least `faults` faults and `kills` SIGKILLs, over a job of `steps`
/// steps at learning rate `lr` (decaying to a tenth); it ends earlier if the job does.
struct Plan {
    faults: usize,
    kills: usize,
    steps: String,
    lr: &'static str,
    min_lr: &'static str,
    seed: u64,
}

fn soak(tag: &str, plan: &Plan) -> Outcome {
    let Plan { faults, kills, ref steps, lr, min_lr, seed } = *plan;
    let steps = steps.as_str();
    let d = dir(tag);
    let (path, ck, secret) = (d.join("log.jsonl"), d.join("ck"), d.join("secret"));
    // The controller's host, the agents' and the stranger's.
    let hosts = Hosts::new(&format!("{}{}", &tag[5..7], std::process::id() % 10_000), 1 + AGENT_HOSTS + 1);
    if hosts.is_none() {
        eprintln!("soak: network namespaces cannot be made here (needs root and iproute2): all on loopback, no partitions");
    }
    // The uninterrupted run, on one worker.
    let reference = d.join("reference.jsonl");
    let ref_ck = d.join("reference-ck");
    let mut args = vec!["train", "--workers", "1", "--deterministic", "--steps", steps, "--lr", lr, "--min-lr", min_lr];
    args.extend(["--json-log", reference.to_str().unwrap()]);
    args.extend(["--checkpoint-dir", ref_ck.to_str().unwrap()]);
    args.extend(tiny_model("12"));
    // Tens of thousands of steps at scale: a bound that grows with them (50 ms a step).
    let total: u64 = steps.parse().expect("a number of steps");
    let out = common::lazarus_within(&args, common::COMMAND_LIMIT.max(Duration::from_millis(50 * total)));
    assert!(out.status.success(), "{}", String::from_utf8_lossy(&out.stderr));
    let want: Vec<(u64, f64)> = log(&reference).0;

    let listen = if hosts.is_some() { "10.231.0.1:7070" } else { "127.0.0.1:0" };
    let (log_s, ck_s, secret_s) = (path.to_str().unwrap(), ck.to_str().unwrap(), secret.to_str().unwrap());
    let mut args = vec!["--listen", listen, "--secret-file", secret_s, "--workers", "4", "--gpus-per-node", "2"];
    args.extend(["--max-workers", "6", "--join-wait", "0.5", "--lease", "0.5", "--slots-per-worker", "2"]);
    args.extend(["--lr", lr, "--min-lr", min_lr, "--steps", steps, "--json-log", log_s]);
    args.extend(["--checkpoint-dir", ck_s, "--checkpoint-every", "25", "--rebalance-every", "100", "--deterministic"]);
    // No snapshots: a restore from one taken a step before the failure changes the losses on
    // purpose (that expert's last update is lost), and this soak compares every loss with the
    // uninterrupted run's; an expert that loses every replica rolls back, exactly.
    args.extend(["--snapshot-bandwidth", "0"]);
    // Served for the stranger to find (nobody scrapes it).
    let metrics = if hosts.is_some() { "10.231.0.1:0" } else { "127.0.0.1:0" };
    args.extend(["--metrics-listen", metrics]);
    args.extend(tiny_model("12"));
    let ctl_host = hosts.as_ref().map(|h| h.names[0].clone());
    let (mut controller, mut ctl_lines, addr) = start_controller(&args, ctl_host.as_deref());
    // A controller started again listens where the first did and takes the job back.
    let mut again_args: Vec<String> = args.iter().map(|a| a.to_string()).collect();
    again_args[1] = addr.clone();
    again_args.push("--resume-job".into());
    let begun = Instant::now();
    let mut s = Soak {
        rng: Rng(seed),
        hosts,
        addr,
        secret,
        agents: (0..AGENT_HOSTS).map(|_| None).collect(),
        free_at: vec![None; AGENT_HOSTS],
        heal_at: vec![None; AGENT_HOSTS],
        stopped: Vec::new(),
        started_again: 0,
        kills: 0,
    };
    // A stranger, from a host of its own, at every port of the job as it opens (the ranks' at
    // each rendezvous) and at the controller's and /metrics every 2 s.
    let stranger = Stranger::start(StrangerPlan {
        root: std::process::id() as i32,
        netns: s.hosts.as_ref().map(|h| h.names[AGENT_HOSTS + 1].clone()),
        silent: STRANGER_SILENT,
        again: Some(Duration::from_secs(2)),
        hold: 200,
    });
    s.start_agent(0);
    s.start_agent(1);
    let mut tail = LogTail::new(path.clone());
    let mut controller_text: Vec<String> = Vec::new();
    let running = |c: &mut Child| matches!(c.try_wait(), Ok(None));
    // The first steps; then a third agent comes (and joins).
    while tail.poll() < 10 {
        assert!(running(&mut controller) && begun.elapsed() < HANG, "the job starts");
        std::thread::sleep(Duration::from_millis(20));
    }
    s.free_at[2] = Some(Instant::now());
    let mut made: Vec<Made> = Vec::new();
    let (gap_lo, gap_hi) = fault_gap(total, faults.max(kills * 3 / 2));
    let mut next_at = tail.poll() + s.rng.within(gap_lo, gap_hi);
    while (made.len() < faults || s.kills < kills) && running(&mut controller) {
        // Tend the hosts until the job reaches the step of the next fault.
        let (mut seen, mut moved_at) = (tail.poll(), Instant::now());
        while running(&mut controller) && seen < next_at {
            s.tend();
            let now = tail.poll();
            if now != seen {
                (seen, moved_at) = (now, Instant::now());
            }
            assert!(moved_at.elapsed() < HANG, "the job makes no progress at step {seen}:\n{}", controller_text.join("\n"));
            std::thread::sleep(Duration::from_millis(5));
        }
        controller_text.extend(ctl_lines.try_iter());
        let Some(fault) = s.fault() else {
            // Nothing the job can carry on from now: draw again a step later.
            next_at = tail.poll() + 1;
            continue;
        };
        let (at, step) = (Instant::now(), tail.poll());
        if fault == Fault::ControllerKill {
            signal(controller.id() as i32, libc::SIGKILL);
            let _ = controller.wait();
            s.kills += 1;
            controller_text.extend(ctl_lines.try_iter());
            controller_text.push(format!("soak: the controller SIGKILLed at step {step}"));
            std::thread::sleep(s.rng.millis(0, 2000));
            let again: Vec<&str> = again_args.iter().map(String::as_str).collect();
            (controller, ctl_lines, _) = start_controller(&again, ctl_host.as_deref());
        }
        // Wait for the job to log two more steps (a rollback's re-run ones included).
        while running(&mut controller) && tail.poll() < step + 2 {
            s.tend();
            if at.elapsed() > HANG {
                controller_text.extend(ctl_lines.try_iter());
                let _ = controller.kill();
                panic!("the job hangs after {} at step {step}:\n{}", fault.name(), controller_text.join("\n"));
            }
            std::thread::sleep(Duration::from_millis(5));
        }
        controller_text.push(format!("soak: {} at step {step}", fault.name()));
        made.push(Made { fault, at, step });
        next_at = step + s.rng.within(gap_lo, gap_hi);
    }
    // Let the job finish: links healed, no new faults. (Bounded by its progress, not by the
    // clock: tens of thousands of steps at scale take longer than any fixed bound a short soak
    // would have.)
    let (mut seen, mut moved_at) = (tail.poll(), Instant::now());
    let status = loop {
        s.tend();
        let now = tail.poll();
        if now != seen {
            (seen, moved_at) = (now, Instant::now());
        }
        controller_text.extend(ctl_lines.try_iter());
        if let Some(st) = controller.try_wait().unwrap() {
            break st;
        }
        assert!(moved_at.elapsed() < HANG, "the soak does not finish: no progress at step {seen}:\n{}", controller_text.join("\n"));
        std::thread::sleep(Duration::from_millis(20));
    };
    let wall = begun.elapsed();
    let stranger = stranger.stop();
    tail.poll();
    // Its last lines: the reader of its stderr ends when the pipe closes.
    while let Ok(line) = ctl_lines.recv_timeout(Duration::from_secs(5)) {
        controller_text.push(line);
    }
    for w in &s.stopped {
        // SAFETY: a signal to a process this test stopped (gone already, most likely).
        unsafe {
            libc::kill(*w, libc::SIGKILL);
        }
    }
    for a in s.agents.iter_mut().flatten() {
        let _ = a.child.wait();
    }
    // What the controllers said, beside the log, for a failure to be read (removed with the
    // directory when the soak passes).
    let _ = std::fs::write(d.join("controller.txt"), controller_text.join("\n"));
    assert!(status.success(), "the soak's job finishes:\n{}", controller_text.join("\n"));
    let (steps_logged, _) = log(&path);
    let numbers: Vec<u64> = steps_logged.iter().map(|(s, _)| *s).collect();
    assert_eq!(numbers, (1..=want.len() as u64).collect::<Vec<_>>(), "the soak: every step logged exactly once");
    if let Some(((s, got), (_, w))) = steps_logged.iter().zip(&want).find(|((_, a), (_, b))| a.to_bits() != b.to_bits()) {
        panic!("the soak: step {s} loss {got:e} vs uninterrupted {w:e}: not the same bits");
    }
    assert_eq!(cursor(&ck), cursor(&ref_ck), "the same windows of data");
    assert!(tensor_bytes(&ck) == tensor_bytes(&ref_ck), "the final checkpoint's tensors have the uninterrupted run's bytes");
    // The median step time of the run, from its step lines.
    let mut step_times: Vec<f64> = std::fs::read_to_string(&path)
        .unwrap()
        .lines()
        .filter_map(|l| serde_json::from_str::<Value>(l).ok())
        .filter_map(|v| Some(v["tokens"].as_f64()? / v["tokens_per_s"].as_f64()?))
        .collect();
    step_times.sort_by(f64::total_cmp);
    let step_s = step_times[step_times.len() / 2];
    let refused = controller_text.iter().filter(|l| l.contains("its messages are refused")).count();
    Outcome {
        made,
        kills: s.kills,
        namespaces: s.hosts.is_some(),
        started_again: s.started_again,
        wall,
        steps: steps_logged,
        moves: tail.moves,
        step_s,
        refused,
        stranger,
        controller: controller_text,
    }
}

/// The soak's report: faults by kind with the moves they caused and the time each cost; joins.
fn report(o: &Outcome) {
    eprintln!(
        "soak: {} faults ({} SIGKILLs) in {:.0} s, {} steps (median {:.1} ms a step), {} agents started again, {} given-up agents heard from again (refused)",
        o.made.len(),
        o.kills,
        o.wall.as_secs_f64(),
        o.steps.len(),
        o.step_s * 1e3,
        o.started_again,
        o.refused
    );
    let st = o.stranger;
    eprintln!(
        "soak: a stranger found {} ports of the job, visited them {} times and got {} connections in (silent, garbage, one TLS byte, trickled)",
        st.ports, st.visits, st.got_in
    );
    // Each move the job made for a fault is the soak's last fault before it was seen; joins
    // and rebalances are moves of their own.
    let mut by_kind: BTreeMap<Fault, (usize, BTreeMap<String, usize>, f64)> = BTreeMap::new();
    let mut other: BTreeMap<String, (usize, f64, u64)> = BTreeMap::new();
    for m in &o.made {
        by_kind.entry(m.fault).or_default().0 += 1;
    }
    for (seen, r) in &o.moves {
        let cause = r["cause"].as_str().unwrap_or("?").to_string();
        let recovery_s = r["recovery_s"].as_f64().unwrap_or(0.0);
        let fault = o.made.iter().rev().find(|m| m.at <= *seen);
        match fault {
            Some(m) if cause != "join" && cause != "rebalance" => {
                let e = by_kind.entry(m.fault).or_default();
                *e.1.entry(cause.clone()).or_default() += 1;
                // A rollback also re-runs the steps since its checkpoint.
                let redone = if cause == "rollback" { m.step.saturating_sub(r["step"].as_u64().unwrap_or(m.step)) } else { 0 };
                e.2 += recovery_s + redone as f64 * o.step_s;
            }
            _ => {
                let e = other.entry(cause).or_default();
                e.0 += 1;
                e.1 += recovery_s;
                e.2 += r["transfer_bytes"].as_u64().unwrap_or(0);
            }
        }
    }
    eprintln!(
        "soak: time lost to each kind of fault (failure → next completed step of each move it caused, plus the steps a rollback re-ran):"
    );
    for (kind, (n, moves, lost)) in by_kind {
        let moves: Vec<String> = moves.iter().map(|(c, k)| format!("{k} {c}")).collect();
        let moves = if moves.is_empty() { "no move".to_string() } else { moves.join(", ") };
        eprintln!("soak:   {n:>3} × {:<46} {lost:>7.2} s in all  ({moves})", kind.name());
    }
    for (cause, (n, s, bytes)) in other {
        eprintln!("soak:   {n:>3} × {cause:<46} {s:>7.2} s in all  ({:.1} MB moved)", bytes as f64 / 1e6);
    }
}

fn env_or<T: std::str::FromStr>(name: &str, default: T) -> T {
    std::env::var(name).ok().and_then(|s| s.parse().ok()).unwrap_or(default)
}

/// The short soak, in CI: a dozen faults over 1,000 steps.
#[test]
fn a_short_soak_of_kills_stops_partitions_and_rejoins_loses_nothing() {
    let plan = Plan { faults: 12, kills: 0, steps: "1000".into(), lr: "2e-5", min_lr: "2e-6", seed: 7 };
    let o = soak("soak-short", &plan);
    report(&o);
    assert!(o.made.len() >= 8, "the soak made its faults: {}\n{}", o.made.len(), o.controller.join("\n"));
    assert!(o.moves.iter().any(|(_, r)| r["cause"] == "join"), "agents rejoined: {:?}", o.moves);
    // The controller's port, /metrics and at least the four ranks' of the start.
    assert!(o.stranger.ports >= 6, "the stranger found the job's ports: {:?}", o.stranger);
}

/// The full soak: at least 50 faults and 50 SIGKILLs, at `--lr 1e-5` over 4,500 steps (float
/// order alone stays within 5e-5 of one process there, with 6 workers).
#[test]
#[ignore = "minutes long: run by hand (see the file's note)"]
fn a_soak_of_fifty_kills_and_more_loses_nothing() {
    let plan = Plan {
        faults: env_or("LAZARUS_SOAK_FAULTS", 50),
        kills: env_or("LAZARUS_SOAK_KILLS", 50),
        steps: env_or("LAZARUS_SOAK_STEPS", "4500".to_string()),
        lr: "1e-5",
        min_lr: "1e-6",
        seed: env_or("LAZARUS_SOAK_SEED", 1),
    };
    let o = soak("soak-full", &plan);
    report(&o);
    assert!(o.made.len() >= plan.faults && o.kills >= plan.kills, "the job ended first: {} faults, {} SIGKILLs", o.made.len(), o.kills);
    let made = |f: Fault| o.made.iter().any(|m| m.fault == f);
    assert!(made(Fault::WorkerStop), "a SIGSTOP");
    assert!(made(Fault::Partition) || !o.namespaces, "a partition");
    assert!(o.stranger.ports >= 6, "the stranger found the job's ports: {:?}", o.stranger);
    assert!(o.moves.iter().any(|(_, r)| r["cause"] == "rollback"), "every holder of an expert lost at least once: {:?}", o.moves);
}

/// The bytes of the newest checkpoint's tensors in `ck` (model, then optimizer state).
fn tensor_bytes(ck: &std::path::Path) -> Vec<u8> {
    let latest = std::fs::read_to_string(ck.join("latest")).unwrap();
    let at = ck.join(latest.trim());
    let mut bytes = std::fs::read(at.join("model.safetensors")).unwrap();
    bytes.extend(std::fs::read(at.join("optimizer.safetensors")).unwrap());
    bytes
}
