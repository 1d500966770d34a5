//! `lazarus sim`: replay a failure/spot trace (or a generated failure pattern) against Lazarus
//! and the DeepSpeed-MoE baselines in the discrete-event simulator.

use std::fmt::Write as _;
use std::path::PathBuf;
use std::time::Instant;

use crate::join_rule::JoinChoice;
use anyhow::{bail, Context, Result};
use clap::Args;
use lazarus_sim::{
    parse_duration_ms, simulate, CostModel, Dispatch, FailureMix, LoadModel, ModelSpec, Notices, Policy, PolicyReport, Scenario, Trace,
};
use serde::Serialize;

mod sweep;

#[derive(Args, Debug, Clone)]
pub struct SimArgs {
    /// Node trace in Bamboo's format (`ms_offset,add|remove,node_name` per line).
    #[arg(long, value_name = "FILE")]
    trace: Option<PathBuf>,
    /// Node availability series (`seconds,count` per line).
    #[arg(long, value_name = "FILE")]
    availability: Option<PathBuf>,
    /// Generated: one random node fails every DUR (e.g. 5m) down to --floor nodes.
    #[arg(long, value_name = "DUR")]
    fail_every: Option<String>,
    /// Generated: K random nodes fail together at time T, written K@T (e.g. 4@10m).
    #[arg(long, value_name = "K@T")]
    fail_at_once: Option<String>,
    /// Generated: every node fails after an exponential time with this mean, and returns
    /// after --repair.
    #[arg(long, value_name = "DUR")]
    poisson_mtbf: Option<String>,
    #[arg(long, value_name = "DUR", default_value = "10m")]
    repair: String,
    /// The causes of the failures, from a published report (llama3: Llama 3 405B's 419
    /// interruptions in 54 days on 16,384 GPUs): each failure is found out by its process's exit
    /// (--exit-detect) or by a time-out, as its cause is. Alone, it also sets the failure rate:
    /// each node fails as often as the report's GPUs did, times --gpus-per-node.
    #[arg(long, value_name = "NAME")]
    failure_mix: Option<String>,
    /// How long from a process's exit to its survivors aborting their collectives (with
    /// --failure-mix; default 1s).
    #[arg(long, value_name = "DUR")]
    exit_detect: Option<String>,
    /// How long a failure found out by silence costs: the lease or collective time-out (default
    /// 15s, the paper's).
    #[arg(long, value_name = "DUR")]
    failure_timeout: Option<String>,
    /// How long rebuilding the communication groups of a new configuration takes (default 10s,
    /// the paper's NCCL figure).
    #[arg(long, value_name = "DUR")]
    group_rebuild: Option<String>,
    /// Nodes at the start of a generated pattern.
    #[arg(long, default_value_t = 10)]
    nodes: usize,
    /// --fail-every stops at this many nodes (default: half of --nodes).
    #[arg(long)]
    floor: Option<usize>,
    /// gpt-s, gpt-m, gpt-l (the paper's) or deepseek-v3 (58 MoE layers of 256 experts, 671 B
    /// parameters).
    #[arg(long, default_value = "gpt-s")]
    model: String,
    /// Override the model's MoE layers (e.g. 58 for a DeepSeek-V3-like shape).
    #[arg(long)]
    layers: Option<usize>,
    /// Override the model's experts per layer.
    #[arg(long)]
    experts: Option<usize>,
    /// lazarus; the baselines ds (DeepSpeed-MoE: restart from storage), ds-ft (DS with
    /// Lazarus's reconfiguration), gemini (in-memory checkpoints, whole-job restart), moevement
    /// (per-expert snapshots, no job-wide rollback), torchft (replica groups leave and rejoin);
    /// or all.
    #[arg(long, default_value = "all")]
    policy: String,
    /// Use at most this many nodes; extra live nodes are spares.
    #[arg(long, default_value_t = 10)]
    max_nodes: usize,
    /// GPUs of a node (default 1, the paper's testbed); a node fails and joins whole.
    #[arg(long)]
    gpus_per_node: Option<usize>,
    /// The storage's bandwidth for checkpoints, all nodes together (default 10, the paper's NFS).
    #[arg(long, value_name = "GBPS")]
    storage_gbps: Option<f64>,
    /// One node's network bandwidth (default 100).
    #[arg(long, value_name = "GBPS")]
    network_gbps: Option<f64>,
    /// Lazarus's snapshot tier: bytes per second of the links given to expert snapshots, the
    /// job's together (default 625e6, the workers' ceiling; 0: no snapshots).
    #[arg(long, value_name = "BYTES_PER_S")]
    snapshot_bandwidth: Option<f64>,
    /// How Lazarus's dispatcher spreads an expert's tokens over its replicas, which sets its
    /// step: balanced (as ours does: the busiest GPU at its least) or even-split (the paper's
    /// per-replica shares).
    #[arg(long, value_name = "HOW", default_value = "balanced")]
    dispatch: String,
    /// Expert slots a GPU holds (default 6, the paper's testbed).
    #[arg(long)]
    slots_per_gpu: Option<usize>,
    /// Replay only [A, B) of the trace, e.g. 0:80m.
    #[arg(long, value_name = "A:B")]
    window: Option<String>,
    /// Simulated time (default: the window; else a trace's whole length, to its last event;
    /// else 30m).
    #[arg(long, value_name = "DUR")]
    duration: Option<String>,
    /// The share (0 to 1) of the trace's removals told beforehand — a spot instance's warning, a
    /// host's maintenance — drawn with --seed; a node in use that gives notice is drained.
    #[arg(long, value_name = "F", default_value_t = 0.0)]
    notice_share: f64,
    /// How long before its removal a notice comes.
    #[arg(long, value_name = "DUR", default_value = "2m")]
    notice_lead: String,
    /// Joined nodes are used after this wait.
    #[arg(long, value_name = "DUR")]
    scale_up_wait: Option<String>,
    /// When Lazarus takes in nodes that joined: wait, after --scale-up-wait (the paper's);
    /// repaid, where moves come often enough that waiting for one costs less than a move of
    /// their own, with the next move it makes anyway (a failure's, a drain's, a rebalance that
    /// repays itself) — at most until their idling has cost that much (rent or buy), 30 minutes.
    #[arg(long, value_enum, default_value_t = JoinChoice::Wait)]
    join_rule: JoinChoice,
    /// Steps between DeepSpeed-MoE's storage checkpoints (default 50, the paper's).
    #[arg(long, value_name = "STEPS")]
    checkpoint_every_ds: Option<u64>,
    /// Steps between the storage checkpoints of ds-ft, moevement and torchft (default 250).
    #[arg(long, value_name = "STEPS")]
    checkpoint_every_ft: Option<u64>,
    /// Steps between Lazarus's storage checkpoints (default 250).
    #[arg(long, value_name = "STEPS")]
    checkpoint_every_lazarus: Option<u64>,
    /// Steps between Lazarus's rebalance weighings (default 200).
    #[arg(long, value_name = "STEPS")]
    rebalance_every: Option<u64>,
    /// Lazarus's floor: replicas of every expert, on distinct nodes where it can (default 2).
    #[arg(long, value_name = "N")]
    min_replicas: Option<usize>,
    /// Seconds to relaunch and initialise after a failure, before reading the checkpoint.
    #[arg(long, allow_hyphen_values = true)]
    restart_s: Option<f64>,
    /// Expert loads per rebalance epoch from a routing trace: JSON [[loads per expert] per
    /// layer], a list of those, or a `lazarus train --json-log` (default: seeded drifting skew).
    #[arg(long, value_name = "FILE")]
    loads_trace: Option<PathBuf>,
    #[arg(long, default_value_t = 0)]
    seed: u64,
    /// One JSON object: each policy's samples, ETTR, counts and breakdown, the model and costs.
    #[arg(long)]
    json: bool,
    /// Write an SVG of throughput and trained samples over time (with --sweep: of ETTR per
    /// value).
    #[arg(long, value_name = "FILE")]
    plot: Option<PathBuf>,
    /// Run the scenario once per value of one setting and compare the policies' ETTR:
    /// KEY=V1,V2,… with KEY one of fail-every, poisson-mtbf, repair, notice-share, max-nodes,
    /// slots-per-gpu, min-replicas, checkpoint-every-lazarus, rebalance-every,
    /// snapshot-bandwidth, exit-detect, failure-timeout, group-rebuild, join-rule (at most 16 values).
    #[arg(long, value_name = "KEY=V1,V2,...")]
    sweep: Option<String>,
}

fn dur(field: &str, s: &str) -> Result<u64> {
    parse_duration_ms(s).with_context(|| format!("--{field}"))
}

fn build(args: &SimArgs) -> Result<(Scenario, Vec<Policy>)> {
    let sources = [
        args.trace.is_some(),
        args.availability.is_some(),
        args.fail_every.is_some(),
        args.fail_at_once.is_some(),
        args.poisson_mtbf.is_some(),
    ];
    match sources.iter().filter(|&&b| b).count() {
        0 if args.failure_mix.is_some() => {}
        0 => bail!("give one of --trace, --availability, --fail-every, --fail-at-once, --poisson-mtbf or --failure-mix"),
        1 => {}
        _ => bail!("give only one of --trace, --availability, --fail-every, --fail-at-once and --poisson-mtbf"),
    }
    if args.nodes == 0 {
        bail!("invalid --nodes: 0 (must be ≥ 1)");
    }
    let window = window_of(args)?;
    let default_ms = window.map_or(30 * 60_000, |(a, b)| b - a);
    let mut duration_ms = match &args.duration {
        Some(d) => dur("duration", d)?,
        None => default_ms,
    };
    if duration_ms == 0 {
        bail!("invalid --duration: 0");
    }
    let mut trace = trace_of(args, duration_ms)?;
    let recorded = args.trace.is_some() || args.availability.is_some();
    if let Some((a, b)) = window {
        let inside = trace.events.iter().filter(|e| (a..b).contains(&e.ms)).count();
        if recorded && inside == 0 {
            tracing::warn!(
                "no event of the trace falls in --window {}: it ends at {}; the nodes present at the window's start stay throughout",
                args.window.as_deref().unwrap_or_default(),
                minutes(trace.end_ms())
            );
        }
        trace = trace.window(a, b);
    } else if recorded && args.duration.is_none() && trace.end_ms() > 0 {
        // A recorded trace is simulated whole unless told otherwise: cutting it at a default
        // length would leave out what happened later without a word.
        duration_ms = trace.end_ms();
        tracing::info!(
            "simulating the whole trace, {} to its last event (--window A:B or --duration for part of it)",
            minutes(duration_ms)
        );
    }
    let mut model = ModelSpec::preset(&args.model)?;
    if let Some(l) = args.layers {
        model.layers = l;
    }
    if let Some(e) = args.experts {
        model.experts = e;
    }
    let cost = cost_model(args)?;
    let loads = match &args.loads_trace {
        Some(p) => {
            let text = crate::io::read_text("loads-trace", p, crate::io::MAX_JSON_BYTES)?;
            LoadModel::from_trace_json(&text, model.layers, model.experts)
                .with_context(|| format!("invalid --loads-trace {}", p.display()))?
        }
        None => LoadModel::Skewed { seed: args.seed, skew: 1.0, drift: 0.3 },
    };
    let policies = match args.policy.as_str() {
        "all" => Policy::ALL.to_vec(),
        name => match Policy::ALL.into_iter().find(|p| p.name() == name) {
            Some(p) => vec![p],
            None => {
                let names: Vec<&str> = Policy::ALL.iter().map(|p| p.name()).collect();
                bail!("invalid --policy: {name:?} (expected {} or all)", names.join(", "))
            }
        },
    };
    if args.floor.is_some() && args.fail_every.is_none() {
        bail!("--floor is where --fail-every stops: it means nothing without it");
    }
    let notices = Notices { share: args.notice_share, lead_s: dur("notice-lead", &args.notice_lead)? as f64 / 1000.0, seed: args.seed };
    let mix = args.failure_mix.as_deref().map(FailureMix::preset).transpose().context("invalid --failure-mix")?;
    let (max_nodes, duration_s, seed) = (args.max_nodes, duration_ms as f64 / 1000.0, args.seed);
    let scenario = Scenario { trace, model, cost, loads, max_nodes, duration_s, notices, mix, seed };
    scenario.validate().map_err(named_flag)?;
    Ok((scenario, policies))
}

/// `--window A:B` in milliseconds, checked.
fn window_of(args: &SimArgs) -> Result<Option<(u64, u64)>> {
    let Some(w) = &args.window else { return Ok(None) };
    let Some((a, b)) = w.split_once(':') else { bail!("invalid --window: {w:?} (expected A:B, e.g. 0:80m)") };
    let (a, b) = (dur("window", a)?, dur("window", b)?);
    if b <= a {
        bail!("invalid --window: {w:?} (the end must be after the start)");
    }
    Ok(Some((a, b)))
}

/// The nodes' comings and goings: a recorded trace (Bamboo's or an availability file) or one
/// generated by `--fail-every`, `--fail-at-once` or `--poisson-mtbf` over `duration_ms`.
fn trace_of(args: &SimArgs, duration_ms: u64) -> Result<Trace> {
    Ok(if let Some(p) = &args.trace {
        let text = crate::io::read_text("trace", p, crate::io::MAX_JSON_BYTES)?;
        Trace::parse_bamboo(&text, &p.display().to_string())?
    } else if let Some(p) = &args.availability {
        let text = crate::io::read_text("availability", p, crate::io::MAX_JSON_BYTES)?;
        Trace::parse_availability(&text, &p.display().to_string())?
    } else if let Some(e) = &args.fail_every {
        let every = dur("fail-every", e)?;
        if every == 0 {
            bail!("invalid --fail-every: {e} (must be > 0)");
        }
        let floor = args.floor.unwrap_or(args.nodes / 2);
        if floor >= args.nodes {
            bail!("invalid --floor: {floor} (nodes fail down to it: it must be below --nodes {})", args.nodes);
        }
        Trace::fail_every(args.nodes, every, floor, args.seed)?
    } else if let Some(k) = &args.fail_at_once {
        let Some((k, t)) = k.split_once('@') else { bail!("invalid --fail-at-once: {k:?} (expected K@T, e.g. 4@10m)") };
        let k: usize = k.parse().map_err(|_| anyhow::anyhow!("invalid --fail-at-once: count {k:?}"))?;
        Trace::fail_at_once(args.nodes, k, dur("fail-at-once", t)?, args.seed)?
    } else if let Some(mtbf) = &args.poisson_mtbf {
        let mtbf = dur("poisson-mtbf", mtbf)?;
        if mtbf == 0 {
            bail!("invalid --poisson-mtbf: 0 (must be > 0)");
        }
        Trace::poisson(args.nodes, mtbf as f64, dur("repair", &args.repair)?, duration_ms, args.seed)?
    } else {
        // A failure mix alone: each node fails at the report's rate per GPU.
        let mix = FailureMix::preset(args.failure_mix.as_deref().unwrap_or_default()).context("invalid --failure-mix")?;
        let mtbf = mix.node_mtbf_ms(args.gpus_per_node.unwrap_or(CostModel::default().gpus_per_node));
        Trace::poisson(args.nodes, mtbf, dur("repair", &args.repair)?, duration_ms, args.seed)?
    })
}

/// The cost model: its defaults, with what the flags set.
fn cost_model(args: &SimArgs) -> Result<CostModel> {
    let mut cost = CostModel::default();
    override_with(&mut cost.gpus_per_node, args.gpus_per_node);
    override_with(&mut cost.slots_per_gpu, args.slots_per_gpu);
    if let Some(w) = &args.scale_up_wait {
        cost.scale_up_wait_s = dur("scale-up-wait", w)? as f64 / 1000.0;
    }
    cost.join_rule = args.join_rule.rule();
    override_with(&mut cost.checkpoint_every_ds, args.checkpoint_every_ds);
    override_with(&mut cost.checkpoint_every_ds_ft, args.checkpoint_every_ft);
    override_with(&mut cost.checkpoint_every_lazarus, args.checkpoint_every_lazarus);
    override_with(&mut cost.rebalance_every, args.rebalance_every);
    override_with(&mut cost.min_replicas, args.min_replicas);
    override_with(&mut cost.restart_s, args.restart_s);
    override_with(&mut cost.storage_gbps, args.storage_gbps);
    override_with(&mut cost.network_gbps, args.network_gbps);
    override_with(&mut cost.snapshot_bandwidth, args.snapshot_bandwidth);
    cost.dispatch = match args.dispatch.as_str() {
        "balanced" => Dispatch::Balanced,
        "even-split" => Dispatch::EvenSplit,
        other => bail!("invalid --dispatch: {other:?} (expected balanced or even-split)"),
    };
    if let Some(d) = &args.exit_detect {
        cost.exit_detect_s = dur("exit-detect", d)? as f64 / 1000.0;
    }
    if let Some(d) = &args.failure_timeout {
        cost.failure_timeout_s = dur("failure-timeout", d)? as f64 / 1000.0;
    }
    if let Some(d) = &args.group_rebuild {
        cost.group_rebuild_s = dur("group-rebuild", d)? as f64 / 1000.0;
    }
    Ok(cost)
}

/// A scenario's error as the flags name what is wrong (the simulator names its own fields).
fn named_flag(e: lazarus_sim::SimError) -> anyhow::Error {
    let lazarus_sim::SimError::Invalid { field, value, reason } = &e else { return e.into() };
    let flag = match *field {
        "gpus_per_node" => "--gpus-per-node",
        "slots_per_gpu" => "--slots-per-gpu",
        "gpus_per_node × slots_per_gpu" => "--gpus-per-node × --slots-per-gpu",
        "max_nodes" => "--max-nodes",
        "min_replicas" => "--min-replicas",
        "restart_s" => "--restart-s",
        "storage_gbps" => "--storage-gbps",
        "network_gbps" => "--network-gbps",
        "snapshot_bandwidth" => "--snapshot-bandwidth",
        "scale_up_wait_s" => "--scale-up-wait",
        "checkpoint_every_ds" => "--checkpoint-every-ds",
        "checkpoint_every_ds_ft" => "--checkpoint-every-ft",
        "checkpoint_every_lazarus" => "--checkpoint-every-lazarus",
        "rebalance_every" => "--rebalance-every",
        "model" => "--layers × --experts",
        "model.layers" => "--layers",
        "model.experts" => "--experts",
        "duration" => "--duration",
        "notices.share" => "--notice-share",
        "notices.lead_s" => "--notice-lead",
        _ => return e.into(),
    };
    anyhow::anyhow!("invalid {flag}: {value} ({reason})")
}

#[derive(Serialize)]
struct PolicyJson<'a> {
    policy: &'static str,
    trained_samples: f64,
    avg_samples_per_s: f64,
    /// Effective training time ratio: time on steps that count over the wall time.
    ettr: f64,
    steps: u64,
    restarts: u64,
    reconfigurations: u64,
    rebalances: u64,
    drains: u64,
    checkpoints: u64,
    /// Failures of nodes in use, and those found out by an exit.
    failures: usize,
    failures_seen_by_exit: u64,
    /// Moves that restored experts from snapshots instead of a rollback (Lazarus), the experts,
    /// and their steps behind the job, summed.
    snapshot_restores: u64,
    experts_restored: u64,
    restored_stale_steps: u64,
    breakdown: &'a lazarus_sim::Breakdown,
    nodes_in_use: &'a [(f64, usize)],
}

#[derive(Serialize)]
struct Report<'a> {
    policies: Vec<PolicyJson<'a>>,
    model: &'a ModelSpec,
    cost: &'a CostModel,
    failure_mix: Option<&'a FailureMix>,
    duration_s: f64,
    trace_events: usize,
    /// Seconds the simulation itself took.
    sim_wall_s: f64,
}

pub fn run_sim(args: &SimArgs) -> Result<()> {
    if let Some(sweep) = &args.sweep {
        return sweep::run_sweep(args, sweep);
    }
    let (scenario, policies) = build(args)?;
    let start = Instant::now();
    let reports: Vec<PolicyReport> = policies.iter().map(|&p| simulate(&scenario, p)).collect::<Result<_, _>>().map_err(named_flag)?;
    let sim_wall_s = start.elapsed().as_secs_f64();
    if let Some(path) = &args.plot {
        let title = format!("{} on {} nodes max, {:.0} min", scenario.model.name, scenario.max_nodes, scenario.duration_s / 60.0);
        std::fs::write(path, lazarus_sim::svg::render(&reports, scenario.duration_s, &title))
            .with_context(|| format!("--plot: cannot write {}", path.display()))?;
    }
    if args.json {
        return crate::io::println(&serde_json::to_string(&json_report(&scenario, &reports, sim_wall_s))?);
    }
    crate::io::print(&text_report(&scenario, &reports, sim_wall_s))
}

/// The report as `--json` prints it.
fn json_report<'a>(scenario: &'a Scenario, reports: &'a [PolicyReport], sim_wall_s: f64) -> Report<'a> {
    Report {
        policies: reports
            .iter()
            .map(|r| PolicyJson {
                policy: r.policy.name(),
                trained_samples: r.trained_samples,
                avg_samples_per_s: r.avg_samples_per_s,
                ettr: r.ettr,
                steps: r.steps,
                restarts: r.restarts,
                reconfigurations: r.reconfigurations,
                rebalances: r.rebalances,
                drains: r.drains,
                checkpoints: r.checkpoints,
                failures: r.failures_s.len(),
                failures_seen_by_exit: r.failures_seen_by_exit,
                snapshot_restores: r.snapshot_restores,
                experts_restored: r.experts_restored,
                restored_stale_steps: r.restored_stale_steps,
                breakdown: &r.breakdown,
                nodes_in_use: &r.nodes_in_use,
            })
            .collect(),
        model: &scenario.model,
        cost: &scenario.cost,
        failure_mix: scenario.mix.as_ref(),
        duration_s: scenario.duration_s,
        trace_events: scenario.trace.events.len(),
        sim_wall_s,
    }
}

/// The report as a table and the lines under it.
fn text_report(scenario: &Scenario, reports: &[PolicyReport], sim_wall_s: f64) -> String {
    let mut out = String::new();
    let _ = writeln!(
        out,
        "{} ({} layers x {} experts), {:.0} min, at most {} nodes, {} trace events; simulated in {:.2} s",
        scenario.model.name,
        scenario.model.layers,
        scenario.model.experts,
        scenario.duration_s / 60.0,
        scenario.max_nodes,
        scenario.trace.events.len(),
        sim_wall_s
    );
    let _ = writeln!(
        out,
        "{:<9} {:>11} {:>9} {:>6} {:>8} {:>9}   {:>6} {:>6} {:>6} {:>6} {:>6} {:>6} {:>6} {:>6} {:>6}",
        "policy",
        "samples",
        "samples/s",
        "ETTR",
        "restarts",
        "reconfigs",
        "compute",
        "ckpt",
        "restart",
        "lost",
        "detect",
        "reconf",
        "xfer",
        "rebal",
        "idle"
    );
    let pct = |x: f64| format!("{:.1}%", 100.0 * x / scenario.duration_s);
    for r in reports {
        let b = &r.breakdown;
        let _ = writeln!(
            out,
            "{:<9} {:>11.0} {:>9.2} {:>6.3} {:>8} {:>9}   {:>6} {:>6} {:>6} {:>6} {:>6} {:>6} {:>6} {:>6} {:>6}",
            r.policy.name(),
            r.trained_samples,
            r.avg_samples_per_s,
            r.ettr,
            r.restarts,
            r.reconfigurations,
            pct(b.compute_s),
            pct(b.checkpoint_s),
            pct(b.restart_s),
            pct(b.lost_work_s),
            pct(b.detect_s),
            pct(b.reconfig_s),
            pct(b.transfer_s),
            pct(b.rebalance_s),
            pct(b.idle_s)
        );
    }
    if let Some(mix) = &scenario.mix {
        let seen: Vec<String> =
            reports.iter().map(|r| format!("{} {}/{}", r.policy.name(), r.failures_seen_by_exit, r.failures_s.len())).collect();
        let _ = writeln!(out, "failures found out by an exit ({} mix; the rest by a time-out): {}", mix.name, seen.join(", "));
    }
    for r in reports.iter().filter(|r| r.snapshot_restores > 0) {
        let _ = writeln!(
            out,
            "{}: {} failures restored {} experts from snapshots instead of a rollback ({:.1} steps stale on average)",
            r.policy.name(),
            r.snapshot_restores,
            r.experts_restored,
            r.restored_stale_steps as f64 / r.experts_restored.max(1) as f64
        );
    }
    let get = |p: Policy| reports.iter().find(|r| r.policy == p).map(|r| r.trained_samples);
    if let Some(l) = get(Policy::Lazarus) {
        for p in Policy::ALL.into_iter().filter(|&p| p != Policy::Lazarus) {
            if let Some(x) = get(p) {
                let _ = writeln!(out, "lazarus / {}: {:.2}x samples", p.name(), l / x.max(1e-9));
            }
        }
    }
    out
}

/// `ms` as minutes, as the trace's length is said.
fn minutes(ms: u64) -> String {
    format!("{:.1} min", ms as f64 / 60_000.0)
}

/// `setting` as given, if it was (a flag left out keeps the default).
fn override_with<T>(setting: &mut T, given: Option<T>) {
    if let Some(v) = given {
        *setting = v;
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use clap::Parser;
    use proptest::prelude::*;

    #[derive(Parser)]
    struct Cli {
        #[command(flatten)]
        args: SimArgs,
    }

    proptest! {
        #![proptest_config(ProptestConfig { cases: 200, ..ProptestConfig::default() })]

        /// Whatever the numbers, a scenario is either one the simulator takes (validated) or
        /// refused naming a flag that was given — never a meaningless run, never a field name.
        #[test]
        fn a_scenario_is_valid_or_refused_naming_a_given_flag(
            gpus in 0usize..3, slots in 0usize..3, max_nodes in 0usize..3, layers in 0usize..3, experts in 0usize..3,
            restart in prop::sample::select(vec!["-1", "NaN", "inf", "0", "5"]), min_replicas in 0usize..3,
            floor in 0usize..12, every in prop::sample::select(vec!["0", "5m"]), ckpt in 0u64..3,
        ) {
            let (gpus, slots, max_nodes, layers, experts, min_replicas, floor, ckpt) = (
                gpus.to_string(), slots.to_string(), max_nodes.to_string(), layers.to_string(), experts.to_string(),
                min_replicas.to_string(), floor.to_string(), ckpt.to_string(),
            );
            let argv = [
                "sim", "--fail-every", every, "--nodes", "10", "--gpus-per-node", &gpus, "--slots-per-gpu", &slots,
                "--max-nodes", &max_nodes, "--layers", &layers, "--experts", &experts, "--restart-s", restart,
                "--min-replicas", &min_replicas, "--floor", &floor, "--checkpoint-every-lazarus", &ckpt,
            ];
            let args = Cli::try_parse_from(argv).unwrap().args;
            match build(&args) {
                Ok((scenario, _)) => prop_assert!(scenario.validate().is_ok()),
                Err(e) => {
                    let e = e.to_string();
                    let flag = e.strip_prefix("invalid ").and_then(|r| r.split(':').next()).unwrap_or_default();
                    prop_assert!(
                        flag.split(" × ").all(|f| argv.contains(&f)),
                        "{e}: names no given flag"
                    );
                }
            }
        }
    }
}
