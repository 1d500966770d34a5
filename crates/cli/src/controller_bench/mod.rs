//! `lazarus bench controller`: a real controller process (`lazarus controller`) driven by
//! synthetic node agents on loopback ([`lazarus_agent::loadgen`]) at the size of a real
//! cluster — by default 1,024 nodes of 8 workers, 58 MoE layers of 256 experts. It measures
//! what the controller costs in steady state (CPU, memory, messages) and how fast a node loss
//! and a join of nodes are turned into commands at every agent, the next step included.
//!
//! The model the controller plans is the shape's (layers, experts) with tiny widths: the
//! controller holds no weights that matter, and its fakes train nothing.

use std::io::Write as _;
use std::net::{SocketAddr, TcpListener, TcpStream};
use std::path::{Path, PathBuf};
use std::process::{Child, Command, Stdio};
use std::time::{Duration, Instant};

use anyhow::{bail, Context, Result};
use clap::Args;
use lazarus_agent::loadgen::{LoadOptions, Mark, SyntheticFleet};
use serde::Serialize;

mod process;

use process::*;

#[derive(Args, Debug)]
pub struct ControllerBenchArgs {
    /// Nodes (synthetic agents) the job starts with.
    #[arg(long, default_value_t = 1024)]
    nodes: usize,
    /// Workers of each node.
    #[arg(long, default_value_t = 8)]
    gpus_per_node: usize,
    /// MoE layers of the model the controller plans.
    #[arg(long, default_value_t = 58)]
    layers: usize,
    /// Experts of each layer.
    #[arg(long, default_value_t = 256)]
    experts: usize,
    /// Nodes that join the running job at once, after the node loss.
    #[arg(long, default_value_t = 64)]
    joins: usize,
    /// Seconds between the steps rank 0 reports.
    #[arg(long, default_value_t = 1.0, value_name = "SECONDS")]
    step: f64,
    /// Seconds of steady state measured.
    #[arg(long, default_value_t = 10.0, value_name = "SECONDS")]
    steady: f64,
    /// The controller's lease, seconds (as `lazarus controller --lease`). Longer than a
    /// job's default (1 s): at a thousand nodes the controller and every synthetic agent share
    /// this machine's cores.
    #[arg(long, default_value_t = 5.0, value_name = "SECONDS")]
    lease: f64,
    /// The heartbeat of agents and workers, seconds (default: a fifth of the lease).
    #[arg(long, value_name = "SECONDS")]
    heartbeat: Option<f64>,
    /// Last, the experts' popularity drifts (each layer's loads reversed over its experts) and
    /// the controller weighs a rebalance this many steps after the last move (as `lazarus
    /// controller --rebalance-every`; 0: no rebalance phase, and none weighed before it).
    #[arg(long, default_value_t = 0)]
    rebalance_every: u64,
    /// Threads of the synthetic agents' runtime.
    #[arg(long, default_value_t = 2)]
    threads: usize,
    /// Keep the controller's files (its log, stderr, state) in this directory.
    #[arg(long, value_name = "DIR")]
    keep: Option<PathBuf>,
    #[arg(long)]
    json: bool,
}

/// Most nodes the benchmark starts (joins included): the controller's job limit.
const MOST_WORKERS: usize = lazarus_protocol::MAX_WORKERS;

/// The controller's join wait, seconds: the joiners, attaching together, share one move.
const JOIN_WAIT_S: &str = "3";

/// Tokens each replica is routed per step, as the fakes report it.
const TOKENS_PER_REPLICA: u64 = 1000;

/// The report of `bench controller --json`.
#[derive(Debug, Serialize)]
struct ControllerBenchReport {
    nodes: usize,
    gpus_per_node: usize,
    workers: usize,
    layers: usize,
    experts: usize,
    /// The controller's lease and heartbeat, seconds.
    lease_s: f64,
    heartbeat_s: f64,
    start: StartTimes,
    steady: Steady,
    node_loss: MoveTimes,
    join: MoveTimes,
    /// The rebalance weighed after the loads drifted (`--rebalance-every`).
    #[serde(skip_serializing_if = "Option::is_none")]
    rebalance: Option<RebalanceTimes>,
    /// The controller's resident memory at the end, and its high-water mark, MiB.
    rss_mib: f64,
    peak_rss_mib: f64,
    machine: String,
}

#[derive(Debug, Serialize)]
struct StartTimes {
    /// Planning, until the controller listens (profiling the model, the first plan).
    listening_s: f64,
    /// Until every agent was sent its workers.
    started_s: f64,
    /// Until every worker was ready and training began.
    training_s: f64,
    /// What each agent was sent to start its workers, MiB (the job with its replica map).
    start_mib_per_agent: f64,
    /// The controller's resident memory once it listened (planned), and once training began,
    /// MiB.
    rss_mib_listening: f64,
    rss_mib_training: f64,
}

#[derive(Debug, Serialize)]
struct Steady {
    seconds: f64,
    /// The controller's CPU time over the window, in cores (1.0: one core busy).
    controller_cores: f64,
    /// Messages the agents sent per second (heartbeats of agents and workers, reports).
    messages_per_s: f64,
    /// The controller's CPU time per message, microseconds.
    cpu_us_per_message: f64,
    steps: u64,
}

#[derive(Debug, Serialize)]
struct RebalanceTimes {
    /// The controller's record of it (`apply`, `shrink` or `skip`), and the seconds its
    /// weighing took on the controller's loop.
    decision: String,
    weigh_s: Option<f64>,
    /// Predicted gain over the horizon and cost of what it moves (of the whole candidate for a
    /// skip), seconds; expert states it would fetch.
    gain_s: Option<f64>,
    cost_s: Option<f64>,
    transfers: Option<u64>,
    /// The move, if applied, by the controller's record of it: its planning, and from the
    /// pause to the next step logged, seconds; bytes the workers fetched.
    #[serde(skip_serializing_if = "Option::is_none")]
    move_plan_s: Option<f64>,
    #[serde(skip_serializing_if = "Option::is_none")]
    move_s: Option<f64>,
    #[serde(skip_serializing_if = "Option::is_none")]
    move_bytes: Option<u64>,
    /// The move as the agents saw it, from the pause (ms): the last agent's order, every rank
    /// ready, the next step; and the bytes each agent received from the drift on (its orders
    /// and its nodes' transfers).
    #[serde(skip_serializing_if = "Option::is_none")]
    orders_out_ms: Option<f64>,
    #[serde(skip_serializing_if = "Option::is_none")]
    ready_ms: Option<f64>,
    #[serde(skip_serializing_if = "Option::is_none")]
    next_step_ms: Option<f64>,
    #[serde(skip_serializing_if = "Option::is_none")]
    order_bytes_per_agent: Option<f64>,
    /// The workers after the move (fewer than before when nodes were lost on the way: a
    /// weighing that outlasts the lease), and the moves of other causes (a rollback) the job
    /// made between the drift and it.
    #[serde(skip_serializing_if = "Option::is_none")]
    move_workers: Option<u64>,
    other_moves: Vec<String>,
}

#[derive(Debug, Default, Serialize)]
struct MoveTimes {
    /// From the loss (or the last joiner's start) to the first agent's order.
    first_order_ms: f64,
    /// To the last agent's order: the controller's commands are all out.
    orders_out_ms: f64,
    /// To every rank ready at the new epoch.
    ready_ms: f64,
    /// To the next step reported.
    next_step_ms: f64,
    /// The controller's own record of the move (its `--json-log`): detection, planning.
    detect_s: Option<f64>,
    plan_s: Option<f64>,
    /// What each agent was sent for the move, bytes (mean).
    order_bytes_per_agent: f64,
    /// A join: from the last joiner's start to the pause that begins the move (the join wait
    /// of the controller, so that nodes arriving together share one move).
    #[serde(skip_serializing_if = "Option::is_none")]
    attached_to_pause_ms: Option<f64>,
}

pub fn run_controller_bench(args: &ControllerBenchArgs) -> Result<()> {
    check(args)?;
    let workers = args.nodes * args.gpus_per_node;
    let most = (args.nodes + args.joins) * args.gpus_per_node;
    let dir = bench_dir(args)?;
    let secret = lazarus_protocol::fresh_secret().context("drawing the job secret")?;
    let secret_file = dir.join("secret");
    write_secret(&secret_file, secret)?;
    let port = TcpListener::bind("127.0.0.1:0")?.local_addr()?.port();
    let listen: SocketAddr = ([127, 0, 0, 1], port).into();
    let lease = args.lease;
    let heartbeat = args.heartbeat.unwrap_or(lease / 5.0);
    say(
        args,
        &format!(
            "bench controller: {} nodes x {} workers, {} layers x {} experts; the controller plans its job",
            args.nodes, args.gpus_per_node, args.layers, args.experts
        ),
    );
    let begun = Instant::now();
    let mut controller = start_controller(args, &dir, &secret_file, listen, workers, most, lease, heartbeat)?;
    let pid = controller.child.id();
    let listening = wait_listening(&mut controller, listen, Duration::from_secs(900))?;
    let listening_s = listening.duration_since(begun).as_secs_f64();
    let rss_mib_listening = memory_mib(pid).0;
    say(args, &format!("listening after {listening_s:.1} s; {} agents attach", args.nodes));

    let opts = LoadOptions {
        controller: listen,
        secret,
        gpus: args.gpus_per_node,
        step_every: Duration::from_secs_f64(args.step),
        tokens_per_replica: TOKENS_PER_REPLICA,
    };
    let mut fleet = SyntheticFleet::new(opts, args.threads)?;
    let start = measure_start(args, &mut controller, &mut fleet, workers, (listening_s, rss_mib_listening))?;
    say(args, &format!("training after {:.1} s (every agent started after {:.1} s)", start.training_s, start.started_s));
    fleet.start_stepping();
    if !fleet.wait_until(Duration::from_secs(60), |p| p.steps_done >= 2) {
        bail!("no step in 60 s after the start: {:?}", fleet.trouble());
    }

    let steady = measure_steady(&fleet, pid, args.steady)?;
    say(args, &format!("steady: the controller uses {:.2} cores at {:.0} messages/s", steady.controller_cores, steady.messages_per_s));

    let victim = args.nodes - 1;
    let node_loss = measure_move(&mut fleet, &dir, args.nodes - 1, Duration::from_secs(300), |f| f.lose_node(victim), "reconfigure")?;
    controller.check_alive()?;
    say(args, &format!("node loss: orders out after {:.0} ms, next step after {:.0} ms", node_loss.orders_out_ms, node_loss.next_step_ms));

    let join = measure_join(args, &mut fleet, &dir)?;
    controller.check_alive()?;
    let rebalance = if args.rebalance_every > 0 {
        let r = measure_rebalance(&mut fleet, &dir, args)?;
        say(args, &format!("rebalance: {} after a weighing of {:.0} ms", r.decision, r.weigh_s.unwrap_or(f64::NAN) * 1e3));
        if let (Some(out), Some(step)) = (r.orders_out_ms, r.next_step_ms) {
            say(args, &format!("rebalance's move: orders out after {out:.0} ms, next step after {step:.0} ms"));
        }
        controller.check_alive()?;
        Some(r)
    } else {
        None
    };
    let (rss_mib, peak_rss_mib) = memory_mib(pid);
    controller.stop();
    drop(fleet);
    if args.keep.is_none() {
        let _ = std::fs::remove_dir_all(&dir);
    }
    let report = ControllerBenchReport {
        nodes: args.nodes,
        gpus_per_node: args.gpus_per_node,
        workers,
        layers: args.layers,
        experts: args.experts,
        lease_s: lease,
        heartbeat_s: heartbeat,
        start,
        steady,
        node_loss,
        join,
        rebalance,
        rss_mib,
        peak_rss_mib,
        machine: machine(),
    };
    if args.json {
        println!("{}", serde_json::to_string_pretty(&report)?);
    } else {
        print_report(&report);
    }
    Ok(())
}

/// Where the benchmark keeps its secret and the controller's files: `--keep`'s directory, or
/// a temporary one removed at the end.
fn bench_dir(args: &ControllerBenchArgs) -> Result<PathBuf> {
    let dir = match &args.keep {
        Some(d) => d.clone(),
        None => std::env::temp_dir().join(format!("lazarus-bench-controller-{}", std::process::id())),
    };
    std::fs::create_dir_all(&dir).with_context(|| format!("creating {}", dir.display()))?;
    Ok(dir)
}

/// The start: every synthetic agent attaches, and the job trains on all `workers`; how long
/// each part took, what it sent each agent, the controller's memory (`listening`: when it
/// listened and its memory then).
fn measure_start(
    args: &ControllerBenchArgs,
    controller: &mut Controller,
    fleet: &mut SyntheticFleet,
    workers: usize,
    listening: (f64, f64),
) -> Result<StartTimes> {
    let pid = controller.child.id();
    let attach_at = Instant::now();
    let before = fleet.traffic();
    fleet.attach(args.nodes);
    let stderr = controller.stderr.clone();
    let within = patience(args.nodes);
    let trained = wait_for(
        controller,
        fleet,
        within,
        |p| p.training && p.world == workers,
        || {
            // A worker lost during the start: the job goes on without its node and never reaches
            // its full size, so there is nothing to wait for.
            let text = std::fs::read_to_string(&stderr).unwrap_or_default();
            let lost = text.lines().filter(|l| l.contains(": no heartbeat for ")).count();
            (lost > 0).then(|| {
            format!(
                "the start did not survive: {lost} workers missed their lease before the job trained (--lease {} s too short for this machine?); the controller's messages: {}",
                args.lease,
                stderr.display()
            )
        })
        },
    )?;
    if !trained {
        bail!(
            "the job did not start training within {} s (synthetic agents: {:?}; controller: {})",
            within.as_secs(),
            fleet.trouble(),
            controller.tail()
        );
    }
    let marks = fleet.marks_since(attach_at);
    let started_at = marks.iter().filter(|(_, m)| matches!(m, Mark::Started { .. })).map(|(t, _)| *t).max().unwrap_or(attach_at);
    Ok(StartTimes {
        listening_s: listening.0,
        started_s: started_at.duration_since(attach_at).as_secs_f64(),
        training_s: attach_at.elapsed().as_secs_f64(),
        start_mib_per_agent: (fleet.traffic().received_bytes - before.received_bytes) as f64 / args.nodes as f64 / (1 << 20) as f64,
        rss_mib_listening: listening.1,
        rss_mib_training: memory_mib(pid).0,
    })
}

/// `--joins` new agents attach to the running job: the move that takes them in (none asked:
/// zeroes).
fn measure_join(args: &ControllerBenchArgs, fleet: &mut SyntheticFleet, dir: &Path) -> Result<MoveTimes> {
    if args.joins == 0 {
        return Ok(MoveTimes::default());
    }
    let m = measure_move(fleet, dir, args.nodes - 1 + args.joins, patience(args.nodes + args.joins), |f| f.attach(args.joins), "join")?;
    say(args, &format!("join of {}: orders out after {:.0} ms, next step after {:.0} ms", args.joins, m.orders_out_ms, m.next_step_ms));
    Ok(m)
}

fn check(args: &ControllerBenchArgs) -> Result<()> {
    if args.nodes < 2 {
        bail!("invalid --nodes: {} (expected at least 2: one is lost)", args.nodes);
    }
    lazarus_protocol::node_gpus(lazarus_setting::Setting::GpusPerNode, args.gpus_per_node)?;
    if (args.nodes + args.joins).saturating_mul(args.gpus_per_node) > MOST_WORKERS {
        bail!("invalid --nodes/--joins: {} nodes of {} (at most {MOST_WORKERS} workers)", args.nodes + args.joins, args.gpus_per_node);
    }
    if args.layers == 0 || args.layers > 256 {
        bail!("invalid --layers: {} (expected 1 to 256)", args.layers);
    }
    if args.experts < 2 || args.experts > 1024 {
        bail!("invalid --experts: {} (expected 2 to 1024)", args.experts);
    }
    for (name, v, most) in [("--step", args.step, 60.0), ("--steady", args.steady, 3600.0)] {
        if !v.is_finite() || v <= 0.0 || v > most {
            bail!("invalid {name}: {v} (expected seconds above 0, at most {most})");
        }
    }
    if !args.lease.is_finite() || !(0.05..=600.0).contains(&args.lease) {
        bail!("invalid --lease: {} (expected 0.05 to 600 seconds)", args.lease);
    }
    if let Some(h) = args.heartbeat.filter(|h| !h.is_finite() || *h <= 0.0 || *h >= args.lease) {
        bail!("invalid --heartbeat: {h} (expected seconds above 0, below the lease {})", args.lease);
    }
    if args.threads == 0 || args.threads > 256 {
        bail!("invalid --threads: {} (expected 1 to 256)", args.threads);
    }
    // The rebalance phase waits for the weighing, --rebalance-every steps of --step seconds
    // away: bounded, as every phase is.
    let wait = rebalance_wait(args);
    if wait > MOST_PHASE {
        bail!(
            "invalid --rebalance-every: {} (at --step {} s its phase could take {:.0} s; at most {:.0} s: lower it or --step)",
            args.rebalance_every,
            args.step,
            wait.as_secs_f64(),
            MOST_PHASE.as_secs_f64()
        );
    }
    Ok(())
}

/// Longest a phase of the benchmark may wait.
const MOST_PHASE: Duration = Duration::from_secs(3600);

/// How long the rebalance phase waits for its weighing: it comes `--rebalance-every` steps after
/// the last move and after a weighing, with room for the machine's pace.
fn rebalance_wait(args: &ControllerBenchArgs) -> Duration {
    Duration::from_secs_f64((2 * args.rebalance_every.min(1 << 40) + 30) as f64 * args.step + 60.0)
}

fn say(args: &ControllerBenchArgs, line: &str) {
    if !args.json {
        eprintln!("{line}");
    } else {
        tracing::info!("{line}");
    }
}

fn measure_steady(fleet: &SyntheticFleet, pid: u32, seconds: f64) -> Result<Steady> {
    let (t0, cpu0, traffic0, steps0) = (Instant::now(), cpu_seconds(pid)?, fleet.traffic(), fleet.plane().steps_done);
    std::thread::sleep(Duration::from_secs_f64(seconds));
    let (wall, cpu, traffic, steps) = (t0.elapsed().as_secs_f64(), cpu_seconds(pid)? - cpu0, fleet.traffic(), fleet.plane().steps_done);
    let messages = (traffic.agent_heartbeats + traffic.worker_heartbeats + traffic.reports)
        - (traffic0.agent_heartbeats + traffic0.worker_heartbeats + traffic0.reports);
    Ok(Steady {
        seconds: wall,
        controller_cores: cpu / wall,
        messages_per_s: messages as f64 / wall,
        cpu_us_per_message: if messages > 0 { cpu * 1e6 / messages as f64 } else { 0.0 },
        steps: steps - steps0,
    })
}

/// Make a move happen (`cause`), and time it as the agents saw it: the orders reaching
/// `agents` agents, every rank ready, the next step; with the controller's record of it.
fn measure_move(
    fleet: &mut SyntheticFleet,
    dir: &Path,
    agents: usize,
    within: Duration,
    make: impl FnOnce(&mut SyntheticFleet),
    cause: &str,
) -> Result<MoveTimes> {
    let p0 = fleet.plane();
    let records_before = records(dir, cause);
    let traffic0 = fleet.traffic();
    let t0 = Instant::now();
    make(fleet);
    let world = agents * fleet.gpus();
    let moved = fleet.wait_until(within, |p| p.epoch > p0.epoch && p.world == world && p.training && p.steps_done > p0.steps_done);
    if !moved {
        bail!(
            "the {cause} did not complete within {} s (the fakes' plane: {:?}; trouble: {:?})",
            within.as_secs(),
            fleet.plane(),
            fleet.trouble()
        );
    }
    // The next step reported, and the controller's record of the move (written once the step
    // is logged).
    let until = Instant::now() + Duration::from_secs(30);
    let stepped = |marks: &[(Instant, Mark)]| {
        let ready = marks.iter().position(|(_, m)| matches!(m, Mark::AllReady { epoch } if *epoch > p0.epoch));
        ready.is_some_and(|r| marks[r..].iter().any(|(_, m)| matches!(m, Mark::Step { .. })))
    };
    while Instant::now() < until && !(stepped(&fleet.marks_since(t0)) && records(dir, cause) > records_before) {
        std::thread::sleep(Duration::from_millis(20));
    }
    let marks = fleet.marks_since(t0);
    // A join counts from the controller's pause that begins it (nodes that attach within the
    // join wait share one move).
    let from = marks.iter().find(|(_, m)| matches!(m, Mark::Paused { .. })).map_or(t0, |(t, _)| *t);
    let joined_at = marks.iter().filter(|(_, m)| matches!(m, Mark::Started { .. })).map(|(t, _)| *t).max();
    let line = timeline(&marks, from, p0.epoch);
    if line.orders < agents {
        tracing::warn!("the {cause}: {} of {agents} agents got their orders", line.orders);
    }
    let record = last_record(dir, cause);
    let received = fleet.traffic().received_bytes - traffic0.received_bytes;
    Ok(MoveTimes {
        first_order_ms: line.first_order_ms,
        orders_out_ms: line.orders_out_ms,
        ready_ms: line.ready_ms,
        next_step_ms: line.next_step_ms,
        detect_s: record.as_ref().and_then(|r| r["detect_s"].as_f64()),
        plan_s: record.as_ref().and_then(|r| r["plan_s"].as_f64()),
        order_bytes_per_agent: received as f64 / agents.max(1) as f64,
        attached_to_pause_ms: joined_at.map(|j| from.saturating_duration_since(j).as_secs_f64() * 1e3),
    })
}

/// A move as the fakes saw it, milliseconds from `from`: the first and the last agent's order
/// of an epoch after `epoch`, every rank ready, the next step; and how many agents had orders.
struct Timeline {
    first_order_ms: f64,
    orders_out_ms: f64,
    ready_ms: f64,
    next_step_ms: f64,
    orders: usize,
}

fn timeline(marks: &[(Instant, Mark)], from: Instant, epoch: u64) -> Timeline {
    let ms = |t: Instant| t.saturating_duration_since(from).as_secs_f64() * 1e3;
    let orders: Vec<Instant> =
        marks.iter().filter(|(_, m)| matches!(m, Mark::Ordered { epoch: e, .. } if *e > epoch)).map(|(t, _)| *t).collect();
    let ready = marks.iter().find(|(_, m)| matches!(m, Mark::AllReady { epoch: e } if *e > epoch)).map(|(t, _)| *t);
    let step = marks.iter().find(|(t, m)| matches!(m, Mark::Step { .. }) && ready.is_some_and(|r| *t >= r)).map(|(t, _)| *t);
    Timeline {
        first_order_ms: orders.iter().min().map_or(0.0, |&t| ms(t)),
        orders_out_ms: orders.iter().max().map_or(0.0, |&t| ms(t)),
        ready_ms: ready.map_or(0.0, ms),
        next_step_ms: step.map_or(0.0, ms),
        orders: orders.len(),
    }
}

/// The controller's reconfiguration records of `cause` in its `--json-log`.
fn records_of(dir: &Path, cause: &str) -> Vec<serde_json::Value> {
    log_events(dir, "reconfiguration").into_iter().filter(|v| v["cause"] == cause).collect()
}

/// The controller's `--json-log` lines of `event`.
fn log_events(dir: &Path, event: &str) -> Vec<serde_json::Value> {
    let text = std::fs::read_to_string(dir.join("log.jsonl")).unwrap_or_default();
    text.lines().filter_map(|l| serde_json::from_str::<serde_json::Value>(l).ok()).filter(|v| v["event"] == event).collect()
}

fn records(dir: &Path, cause: &str) -> usize {
    records_of(dir, cause).len()
}

/// The loads drift; the controller's next rebalance record, and its move if it applies one.
fn measure_rebalance(fleet: &mut SyntheticFleet, dir: &Path, args: &ControllerBenchArgs) -> Result<RebalanceTimes> {
    const OTHER: [&str; 4] = ["reconfigure", "rollback", "join", "drain"];
    let events = || log_events(dir, "rebalance");
    let before = events().len();
    let moves_before = records(dir, "rebalance");
    let others_before: Vec<usize> = OTHER.iter().map(|c| records(dir, c)).collect();
    let p0 = fleet.plane();
    let (t0, traffic0) = (Instant::now(), fleet.traffic());
    fleet.drift();
    // The weighing comes `--rebalance-every` steps after the last move (and after a weighing).
    let within = rebalance_wait(args);
    let until = Instant::now() + within;
    while events().len() <= before {
        if Instant::now() > until {
            bail!("no rebalance weighed within {} s (the fakes' plane: {:?})", within.as_secs(), fleet.plane());
        }
        std::thread::sleep(Duration::from_millis(50));
    }
    // (The first weighing may still have seen loads of before the drift: take the first whose
    // step comes after it.)
    let d = loop {
        let after: Vec<serde_json::Value> =
            events().into_iter().skip(before).filter(|v| v["step"].as_u64() > Some(p0.steps_done)).collect();
        if let Some(d) = after.into_iter().next() {
            break d;
        }
        if Instant::now() > until {
            bail!("no rebalance weighed on the drifted loads within {} s", within.as_secs());
        }
        std::thread::sleep(Duration::from_millis(50));
    };
    let decision = d["decision"].as_str().unwrap_or("?").to_string();
    // An applied one: the controller's record of its move (written once the next step is).
    let moved = if decision == "skip" {
        None
    } else {
        let within = patience(args.nodes + args.joins);
        let until = Instant::now() + within;
        while records(dir, "rebalance") <= moves_before {
            if Instant::now() > until {
                let others: Vec<String> =
                    OTHER.iter().zip(&others_before).filter(|(c, &b)| records(dir, c) > b).map(|(c, _)| c.to_string()).collect();
                bail!(
                    "the rebalance's move did not complete in {} s (moves of other causes since the drift: {others:?}; the fakes' plane: {:?}; trouble: {:?})",
                    within.as_secs(),
                    fleet.plane(),
                    fleet.trouble()
                );
            }
            std::thread::sleep(Duration::from_millis(50));
        }
        last_record(dir, "rebalance")
    };
    let field = |k: &str| moved.as_ref().and_then(|r| r[k].as_f64());
    // As the fakes saw the move: from the pause that begins it.
    let marks = fleet.marks_since(t0);
    let paused = marks.iter().find(|(_, m)| matches!(m, Mark::Paused { epoch, .. } if *epoch == p0.epoch)).map(|(t, _)| *t);
    let line = paused.filter(|_| moved.is_some()).map(|from| timeline(&marks, from, p0.epoch));
    Ok(RebalanceTimes {
        orders_out_ms: line.as_ref().map(|l| l.orders_out_ms),
        ready_ms: line.as_ref().map(|l| l.ready_ms),
        next_step_ms: line.as_ref().map(|l| l.next_step_ms),
        order_bytes_per_agent: moved.as_ref().map(|_| {
            (fleet.traffic().received_bytes - traffic0.received_bytes) as f64 / (fleet.plane().world / fleet.gpus().max(1)).max(1) as f64
        }),
        decision,
        weigh_s: d["weigh_s"].as_f64(),
        gain_s: d["gain_s"].as_f64(),
        cost_s: d["cost_s"].as_f64(),
        transfers: d["transfers"].as_u64(),
        move_plan_s: field("plan_s"),
        move_s: field("recovery_s"),
        move_bytes: moved.as_ref().and_then(|r| r["transfer_bytes"].as_u64()),
        move_workers: moved.as_ref().and_then(|r| r["workers"].as_u64()),
        other_moves: OTHER
            .iter()
            .zip(others_before)
            .flat_map(|(c, before)| std::iter::repeat_n(c.to_string(), records(dir, c).saturating_sub(before)))
            .collect(),
    })
}

/// The controller's last reconfiguration record of `cause`.
fn last_record(dir: &Path, cause: &str) -> Option<serde_json::Value> {
    records_of(dir, cause).pop()
}

fn print_report(r: &ControllerBenchReport) {
    println!(
        "controller at {} nodes x {} workers ({} workers), {} layers x {} experts; lease {} s, heartbeat {} s",
        r.nodes, r.gpus_per_node, r.workers, r.layers, r.experts, r.lease_s, r.heartbeat_s
    );
    println!(
        "  start:     listening after {:.1} s (planning, {:.0} MiB); every agent started after {:.1} s ({:.2} MiB each); training after {:.1} s ({:.0} MiB)",
        r.start.listening_s, r.start.rss_mib_listening, r.start.started_s, r.start.start_mib_per_agent, r.start.training_s, r.start.rss_mib_training
    );
    println!(
        "  steady:    {:.2} cores, {:.0} messages/s, {:.1} µs of controller CPU per message, {} steps in {:.1} s",
        r.steady.controller_cores, r.steady.messages_per_s, r.steady.cpu_us_per_message, r.steady.steps, r.steady.seconds
    );
    for (what, m) in [("node loss", &r.node_loss), ("join", &r.join)] {
        println!(
            "  {what:<10} first order {:.0} ms, orders out {:.0} ms, ready {:.0} ms, next step {:.0} ms; decided in {} (its record); {:.0} KiB to each agent",
            m.first_order_ms,
            m.orders_out_ms,
            m.ready_ms,
            m.next_step_ms,
            m.plan_s.map_or("?".into(), |s| format!("{:.0} ms", s * 1e3)),
            m.order_bytes_per_agent / 1024.0
        );
    }
    println!("  memory:    {:.0} MiB resident, {:.0} MiB at most", r.rss_mib, r.peak_rss_mib);
    println!("  machine:   {}", r.machine);
}

/// This machine, in a line: its processor and how many cores this process may use.
fn machine() -> String {
    let cpuinfo = std::fs::read_to_string("/proc/cpuinfo").unwrap_or_default();
    let model = cpuinfo.lines().find(|l| l.starts_with("model name")).and_then(|l| l.split_once(':')).map_or("?", |(_, m)| m.trim());
    format!("{model}, {} cores", lazarus_agent::allowed_cpus().len())
}
