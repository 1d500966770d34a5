//! `lazarus plan` and `lazarus prob`: the planning core on the command line.

use std::fmt::Write as _;
use std::path::PathBuf;

use anyhow::{bail, Context, Result};
use clap::Args;
use lazarus_plan::{
    place, plan_layer, probability_of_sets, recovery_curve, recovery_probability, ClusterShape, ModelPlan, Placement, PlanFile,
    PlanFileLayer, PlanPolicy, Strategy, PLAN_FORMAT,
};
use serde::Serialize;

use crate::io::{print, println, read_json, read_text, MAX_JSON_BYTES};

/// The embedded default of `lazarus plan --demo`: the paper's testbed (10 single-GPU nodes, 6
/// replica slots per GPU) and one layer of 16 experts with skewed, measured-looking loads.
const DEMO_LOADS: [f64; 16] =
    [3120.0, 1480.0, 910.0, 860.0, 640.0, 610.0, 420.0, 390.0, 370.0, 240.0, 210.0, 160.0, 150.0, 90.0, 60.0, 40.0];
const DEMO_NODES: usize = 10;
const DEMO_SLOTS: usize = 6;

/// The cluster shape, shared by `plan` and `prob`.
#[derive(Args, Debug)]
pub struct ClusterArgs {
    /// Number of nodes N.
    #[arg(long, allow_hyphen_values = true)]
    nodes: Option<String>,
    /// GPUs per node G.
    #[arg(long, default_value = "1", allow_hyphen_values = true)]
    gpus_per_node: String,
    /// Replica slots per GPU c.
    #[arg(long, allow_hyphen_values = true)]
    slots: Option<String>,
}

impl ClusterArgs {
    fn shape(&self) -> Result<ClusterShape> {
        Ok(ClusterShape::new(
            required("nodes", &self.nodes)?,
            parse_count("gpus-per-node", &self.gpus_per_node)?,
            required("slots", &self.slots)?,
        )?)
    }
}

#[derive(Args, Debug)]
pub struct PlanArgs {
    /// Tokens routed to each expert, comma-separated (expert ids are 0-based in this order).
    #[arg(long, allow_hyphen_values = true, conflicts_with_all = ["replicas", "loads_file", "demo"])]
    loads: Option<String>,
    /// Replica counts per expert; skips allocation.
    #[arg(long, allow_hyphen_values = true, conflicts_with_all = ["loads_file", "demo"])]
    replicas: Option<String>,
    /// JSON file: an array of per-layer load arrays; one plan per layer.
    #[arg(long, value_name = "FILE", conflicts_with = "demo")]
    loads_file: Option<PathBuf>,
    /// Plan the embedded example (the paper's 10-node testbed, 16 skewed experts) and compare
    /// all strategies.
    #[arg(long)]
    demo: bool,
    #[command(flatten)]
    cluster: ClusterArgs,
    /// Fault-tolerance floor f: every expert gets at least this many replicas (lowered when the
    /// slots cannot hold f per expert).
    #[arg(long, default_value = "2", allow_hyphen_values = true)]
    min_replicas: String,
    /// Placement strategy: lazarus, mro, spread or compact.
    #[arg(long, default_value = "lazarus")]
    strategy: String,
    /// With loads and --strategy lazarus: plan as the trainer does, the most fault-tolerant
    /// placement on which no node needs more than this many times its mean share of tokens
    /// under the balanced dispatcher (`lazarus train --workers` uses 1.05).
    #[arg(long, allow_hyphen_values = true)]
    max_imbalance: Option<String>,
    /// Machine-readable output.
    #[arg(long)]
    json: bool,
}

#[derive(Args, Debug)]
pub struct ProbArgs {
    /// Replica counts per expert, placed with --strategy.
    #[arg(long, allow_hyphen_values = true, conflicts_with = "placement_file")]
    replicas: Option<String>,
    /// A plan file (the JSON of `lazarus plan --json`); with several layers, the probability
    /// that the whole model recovers (every layer at once) unless --layer picks one.
    #[arg(long, value_name = "FILE")]
    placement_file: Option<PathBuf>,
    /// With --placement-file: the probability of this layer alone (0-based).
    #[arg(long, requires = "placement_file", allow_hyphen_values = true)]
    layer: Option<String>,
    #[command(flatten)]
    cluster: ClusterArgs,
    /// Number of failed nodes.
    #[arg(long, allow_hyphen_values = true)]
    failed: String,
    /// Placement strategy for --replicas: lazarus, mro, spread or compact.
    #[arg(long, default_value = "lazarus")]
    strategy: String,
    /// Machine-readable output.
    #[arg(long)]
    json: bool,
}

fn parse_count(field: &str, value: &str) -> Result<usize> {
    value.trim().parse::<usize>().map_err(|_| anyhow::anyhow!("invalid --{field}: '{value}' (expected a non-negative integer)"))
}

fn required(field: &str, value: &Option<String>) -> Result<usize> {
    match value {
        Some(v) => parse_count(field, v),
        None => bail!("--{field} is required"),
    }
}

fn parse_list<T: std::str::FromStr>(field: &str, value: &str, what: &str) -> Result<Vec<T>> {
    if value.trim().is_empty() {
        bail!("invalid --{field}: '' (expected a comma-separated list of {what})");
    }
    value
        .split(',')
        .enumerate()
        .map(|(i, s)| {
            s.trim().parse::<T>().map_err(|_| anyhow::anyhow!("invalid --{field}: '{}' at position {i} (expected {what})", s.trim()))
        })
        .collect()
}

/// `--max-imbalance` of `train --workers` and `bench moe-layer`: a ratio ≥ 1, or `inf` for no
/// throughput guard (`None`: the most fault-tolerant placement).
pub fn throughput_guard(value: f64) -> Result<Option<f64>> {
    if value.is_nan() || value < 1.0 {
        bail!("invalid --max-imbalance: {value} (expected a ratio ≥ 1, or inf for no guard)");
    }
    Ok(value.is_finite().then_some(value))
}

fn parse_strategy(value: &str) -> Result<Strategy> {
    Ok(value.parse::<Strategy>()?)
}

/// One planned layer as it goes into the plan file, with the fields that report how it was made.
fn layer_entry(loads: Option<&[f64]>, placement: &Placement, strategy: Strategy, applied_floor: Option<usize>) -> Result<PlanFileLayer> {
    let mut entry = PlanFileLayer::of(placement);
    entry.strategy = Some(strategy);
    entry.loads = loads.map(<[f64]>::to_vec);
    entry.replicas = Some(placement.replica_counts());
    entry.applied_floor = applied_floor;
    entry.imbalance = loads.map(|l| placement.load_balance(l)).transpose()?.map(|b| b.imbalance());
    entry.recovery = Some(recovery_curve(placement));
    Ok(entry)
}

/// Plan one layer from loads (allocation, then placement, by the scheduler) or place the given
/// replicas with the strategy.
fn plan_one(
    loads: Option<&[f64]>,
    replicas: Option<&[usize]>,
    shape: ClusterShape,
    policy: &PlanPolicy,
) -> Result<(PlanFileLayer, Placement)> {
    match (loads, replicas) {
        (_, Some(r)) => {
            if policy.max_imbalance.is_some() {
                bail!("--max-imbalance needs --loads (or --loads-file) and --strategy lazarus");
            }
            let p = place(r, shape, policy.strategy, loads)?;
            Ok((layer_entry(loads, &p, policy.strategy, None)?, p))
        }
        (Some(l), None) => {
            if policy.max_imbalance.is_some() && policy.strategy != Strategy::Lazarus {
                bail!("--max-imbalance needs --loads (or --loads-file) and --strategy lazarus");
            }
            let planned = plan_layer(l, shape, policy)?;
            Ok((layer_entry(Some(l), &planned.placement, policy.strategy, Some(planned.allocation.applied_floor))?, planned.placement))
        }
        (None, None) => bail!("one of --loads, --replicas, --loads-file or --demo is required"),
    }
}

/// Every layer of a loads file planned with its report, the layers spread over the cores (they
/// are independent; the result does not depend on how many cores there are).
fn plan_layers(loads: &[Vec<f64>], shape: ClusterShape, policy: &PlanPolicy) -> Result<Vec<(PlanFileLayer, Placement)>> {
    let jobs: Vec<usize> = (0..loads.len()).collect();
    lazarus_plan::parallel::map_in_order(&jobs, |&i| {
        plan_one(Some(&loads[i]), None, shape, policy).with_context(|| format!("--loads-file layer {i}"))
    })
}

/// The plan file of planned layers; with several, the whole model's recovery too.
fn plan_file(layers: Vec<(PlanFileLayer, Placement)>) -> Result<(PlanFile, ModelPlan)> {
    let (entries, placements): (Vec<PlanFileLayer>, Vec<Placement>) = layers.into_iter().unzip();
    let plan = ModelPlan::new(0, placements)?;
    let mut file = plan.to_file();
    file.layers = entries;
    if plan.layers().len() > 1 {
        file.model_recovery = Some(plan.recovery_curve());
    }
    Ok((file, plan))
}

pub fn run_plan(args: &PlanArgs) -> Result<()> {
    if args.demo {
        return run_demo(args.json);
    }
    let shape = args.cluster.shape()?;
    let floor = parse_count("min-replicas", &args.min_replicas)?;
    let strategy = parse_strategy(&args.strategy)?;
    let max_imbalance = match args.max_imbalance.as_deref() {
        None => None,
        Some(v) => match v.trim().parse::<f64>() {
            Ok(x) if x.is_finite() && x >= 1.0 => Some(x),
            _ => bail!("invalid --max-imbalance: '{v}' (expected a finite ratio ≥ 1)"),
        },
    };
    let policy = PlanPolicy { floor, strategy, max_imbalance, keep_survivors: false };
    let layers = if let Some(path) = &args.loads_file {
        let loads: Vec<Vec<f64>> = read_json("loads-file", path)?;
        if loads.is_empty() {
            bail!("invalid --loads-file: {} holds no layers (expected an array of per-layer load arrays)", path.display());
        }
        plan_layers(&loads, shape, &policy)?
    } else {
        let loads = args.loads.as_deref().map(|s| parse_list::<f64>("loads", s, "numbers")).transpose()?;
        let replicas = args.replicas.as_deref().map(|s| parse_list::<usize>("replicas", s, "non-negative integers")).transpose()?;
        vec![plan_one(loads.as_deref(), replicas.as_deref(), shape, &policy)?]
    };
    let (file, plan) = plan_file(layers)?;
    if args.json {
        return println(&serde_json::to_string(&file)?);
    }
    let mut out = String::new();
    let many = file.layers.len() > 1;
    for (i, (entry, placement)) in file.layers.iter().zip(plan.layers()).enumerate() {
        if many {
            let _ = writeln!(out, "== layer {i} ==");
        }
        out.push_str(&human_report(entry, placement, floor));
    }
    if let Some(curve) = &file.model_recovery {
        let _ = writeln!(out, "\nwhole model ({} layers at once): recovery probability", file.layers.len());
        let _ = writeln!(out, "  failed  probability  method");
        for r in curve {
            let _ = writeln!(out, "  {:>6}  {:>11.6}  {}", r.failed, r.probability, r.method.name());
        }
    }
    print(&out)
}

fn human_report(report: &PlanFileLayer, placement: &Placement, floor: usize) -> String {
    let shape = placement.shape();
    let mut out = String::new();
    let _ = writeln!(
        out,
        "strategy {} on {} nodes x {} GPU(s) x {} slots = {} replica slots",
        report.strategy.unwrap_or_default(),
        shape.nodes,
        shape.gpus_per_node,
        shape.slots_per_gpu,
        shape.total_slots()
    );
    if let Some(applied) = report.applied_floor {
        if applied != floor {
            let _ =
                writeln!(out, "fault-tolerance floor lowered from {floor} to {applied}: the slots cannot hold {floor} replicas per expert");
        } else {
            let _ = writeln!(out, "fault-tolerance floor {applied}: fewer than {applied} failed nodes always recover");
        }
    }
    let total_load: f64 = report.loads.as_ref().map_or(0.0, |l| l.iter().sum());
    let _ = writeln!(out, "\nexpert        load   share  replicas  nodes");
    let holders = placement.holders();
    for (e, r) in placement.replica_counts().into_iter().enumerate() {
        let (load, share) = match &report.loads {
            Some(l) => (format!("{:>10.1}", l[e]), format!("{:>6.1}%", if total_load > 0.0 { 100.0 * l[e] / total_load } else { 0.0 })),
            None => (format!("{:>10}", "-"), format!("{:>7}", "-")),
        };
        let _ = writeln!(out, "{e:>6} {load} {share} {r:>9} {:>6}", holders[e].len());
    }
    let _ = writeln!(out, "\nnode map (expert ids per GPU):");
    for (n, _) in placement.nodes().iter().enumerate() {
        let gpus: Vec<String> = (0..shape.gpus_per_node)
            .map(|g| {
                let ids: Vec<String> = placement.gpu(n, g).iter().map(|e| e.to_string()).collect();
                format!("[{}]", ids.join(" "))
            })
            .collect();
        let _ = writeln!(out, "  node {n:>3}: {}", gpus.join(" "));
    }
    if let Some(imb) = report.imbalance {
        let _ = writeln!(out, "\nbusiest GPU: {imb:.3}x its mean share of tokens at best (balanced dispatcher; 1.000 = no GPU idles)");
    }
    let _ = writeln!(out, "\nrecovery probability (uniformly random node failures):");
    let _ = writeln!(out, "  failed  probability  method");
    for r in report.recovery.iter().flatten() {
        let ci = r.ci95.map(|[lo, hi]| format!(" (95% CI {lo:.4}-{hi:.4})")).unwrap_or_default();
        let _ = writeln!(out, "  {:>6}  {:>11.6}  {}{ci}", r.failed, r.probability, r.method.name());
    }
    out
}

/// Each strategy on one layer's loads, with the same allocation.
fn every_strategy(loads: &[f64], shape: ClusterShape, floor: usize) -> Result<Vec<(PlanFileLayer, Placement)>> {
    Strategy::ALL
        .into_iter()
        .map(|strategy| plan_one(Some(loads), None, shape, &PlanPolicy { floor, strategy, max_imbalance: None, keep_survivors: false }))
        .collect()
}

fn run_demo(json: bool) -> Result<()> {
    let shape = ClusterShape::new(DEMO_NODES, 1, DEMO_SLOTS)?;
    let floor = 2;
    let reports = every_strategy(&DEMO_LOADS, shape, floor)?;
    if json {
        #[derive(Serialize)]
        struct Demo<'a> {
            format: &'a str,
            shape: ClusterShape,
            experts: usize,
            /// One entry per strategy, all on the same loads and allocation.
            strategies: Vec<&'a PlanFileLayer>,
        }
        let demo = Demo { format: PLAN_FORMAT, shape, experts: DEMO_LOADS.len(), strategies: reports.iter().map(|r| &r.0).collect() };
        return println(&serde_json::to_string(&demo)?);
    }
    let mut out = String::new();
    let _ = writeln!(out, "Lazarus planning demo: one MoE layer of {} experts with skewed loads on the paper's testbed", DEMO_LOADS.len());
    let _ = writeln!(out, "({DEMO_NODES} nodes x 1 GPU x {DEMO_SLOTS} replica slots), floor {floor}.\n");
    let (report, placement) = &reports[0];
    out.push_str(&human_report(report, placement, floor));
    strategy_table(&mut out, &reports, DEMO_NODES);

    // Where the paper's MRO is not optimal: the last group of experts does not fit on the nodes
    // left (Σ r_rep > N) and has to be truncated.
    let shape = ClusterShape::new(TRUNCATED_NODES, 1, TRUNCATED_SLOTS)?;
    let truncated = every_strategy(&TRUNCATED_LOADS, shape, floor)?;
    let _ = writeln!(
        out,
        "\nA truncated case: {} experts with loads {:?} on {TRUNCATED_NODES} nodes x {TRUNCATED_SLOTS} slots (replicas {:?}).",
        TRUNCATED_LOADS.len(),
        TRUNCATED_LOADS,
        truncated[0].1.replica_counts()
    );
    let _ = writeln!(out, "MRO's last group is cut short; the lazarus plan recovers more often:");
    strategy_table(&mut out, &truncated, TRUNCATED_NODES);
    print(&out)
}

/// A layer on which MRO is not optimal (found by the exhaustive oracle's kind of search).
const TRUNCATED_LOADS: [f64; 7] = [167.0, 147.0, 113.0, 535.0, 100.0, 179.0, 671.0];
const TRUNCATED_NODES: usize = 6;
const TRUNCATED_SLOTS: usize = 3;

fn strategy_table(out: &mut String, reports: &[(PlanFileLayer, Placement)], nodes: usize) {
    let _ = writeln!(out, "\nrecovery probability by strategy (same replicas):");
    let mut header = String::from("  failed");
    for (r, _) in reports {
        let _ = write!(header, " {:>9}", r.strategy.unwrap_or_default().name());
    }
    let _ = writeln!(out, "{header}");
    for k in 0..nodes {
        let mut line = format!("  {k:>6}");
        for (r, _) in reports {
            let p = r.recovery.as_ref().and_then(|c| c.get(k)).map_or(f64::NAN, |e| e.probability);
            let _ = write!(line, " {:>9.4}", p);
        }
        let _ = writeln!(out, "{line}");
    }
}

pub fn run_prob(args: &ProbArgs) -> Result<()> {
    let failed = parse_count("failed", &args.failed)?;
    let (nodes, estimate, what) = if let Some(path) = &args.placement_file {
        let text = read_text("placement-file", path, MAX_JSON_BYTES)?;
        let plan = ModelPlan::from_json(&text).with_context(|| format!("invalid --placement-file {}", path.display()))?;
        let shape = plan.shape();
        let given = [("nodes", &args.cluster.nodes, shape.nodes), ("slots", &args.cluster.slots, shape.slots_per_gpu)];
        for (flag, value, have) in given {
            if let Some(v) = value {
                let v = parse_count(flag, v)?;
                if v != have {
                    bail!("invalid --{flag}: {v} (the plan in {} has {have})", path.display());
                }
            }
        }
        let gpus = parse_count("gpus-per-node", &args.cluster.gpus_per_node)?;
        if gpus != 1 && gpus != shape.gpus_per_node {
            bail!("invalid --gpus-per-node: {gpus} (the plan in {} has {})", path.display(), shape.gpus_per_node);
        }
        match &args.layer {
            Some(l) => {
                let l = parse_count("layer", l)?;
                let Some(p) = plan.layers().get(l) else {
                    bail!("invalid --layer: {l} (the plan has {} layers)", plan.layers().len());
                };
                (shape.nodes, recovery_probability(p, failed)?, format!("layer {l}"))
            }
            None => {
                let what =
                    if plan.layers().len() > 1 { format!("the whole model ({} layers)", plan.layers().len()) } else { "the plan".into() };
                (shape.nodes, probability_of_sets(shape.nodes, &plan.holder_sets(), failed)?, what)
            }
        }
    } else {
        let Some(replicas) = &args.replicas else {
            bail!("one of --replicas or --placement-file is required");
        };
        let replicas = parse_list::<usize>("replicas", replicas, "non-negative integers")?;
        let shape = args.cluster.shape()?;
        let placement = place(&replicas, shape, parse_strategy(&args.strategy)?, None)?;
        (shape.nodes, recovery_probability(&placement, failed)?, "the plan".to_string())
    };
    if args.json {
        #[derive(Serialize)]
        struct Out {
            probability: f64,
            method: &'static str,
            #[serde(skip_serializing_if = "Option::is_none")]
            ci95: Option<[f64; 2]>,
        }
        let out = Out { probability: estimate.probability, method: estimate.method.name(), ci95: estimate.ci95 };
        return println(&serde_json::to_string(&out)?);
    }
    let ci = estimate.ci95.map(|[lo, hi]| format!(", 95% CI {lo:.4}-{hi:.4}")).unwrap_or_default();
    println(&format!(
        "recovery probability of {what} with {failed} of {nodes} nodes failed: {:.6} ({}{ci})",
        estimate.probability,
        estimate.method.name()
    ))
}
