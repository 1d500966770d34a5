//! `lazarus plan` and `lazarus prob`: the planning core on the command line.

use std::fmt::Write as _;
use std::path::{Path, PathBuf};

use anyhow::{bail, Context, Result};
use clap::Args;
use lazarus_plan::{
    allocate, place, place_balanced, recovery_curve, recovery_probability, ClusterShape, Placement, RecoveryEstimate, Strategy,
};
use serde::Serialize;

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
    /// JSON file with a plan: an array with one array of expert ids per node.
    #[arg(long, value_name = "FILE")]
    placement_file: Option<PathBuf>,
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

fn read_json<T: serde::de::DeserializeOwned>(field: &str, path: &Path) -> Result<T> {
    let text = std::fs::read_to_string(path).with_context(|| format!("--{field}: cannot read {}", path.display()))?;
    serde_json::from_str(&text).with_context(|| format!("--{field}: {} is not valid", path.display()))
}

/// One planned layer, in the JSON shape scripts depend on.
#[derive(Serialize)]
struct LayerReport {
    strategy: Strategy,
    #[serde(skip_serializing_if = "Option::is_none")]
    loads: Option<Vec<f64>>,
    replicas: Vec<usize>,
    #[serde(skip_serializing_if = "Option::is_none")]
    applied_floor: Option<usize>,
    placement: Vec<Vec<usize>>,
    /// With loads: the busiest GPU's least possible tokens over the mean (balanced dispatcher).
    #[serde(skip_serializing_if = "Option::is_none")]
    imbalance: Option<f64>,
    recovery: Vec<RecoveryEstimate>,
}

fn plan_layer(
    loads: Option<&[f64]>,
    replicas: Option<&[usize]>,
    shape: ClusterShape,
    floor: usize,
    strategy: Strategy,
    max_imbalance: Option<f64>,
) -> Result<(LayerReport, Placement)> {
    let (replicas, applied_floor) = match (loads, replicas) {
        (_, Some(r)) => (r.to_vec(), None),
        (Some(l), None) => {
            let a = allocate(l, shape.total_slots(), floor)?;
            (a.replicas, Some(a.applied_floor))
        }
        (None, None) => bail!("one of --loads, --replicas, --loads-file or --demo is required"),
    };
    let placement = match (strategy, loads, max_imbalance) {
        (Strategy::Lazarus, Some(l), Some(m)) => place_balanced(&replicas, shape, l, m)?,
        (_, _, Some(_)) => bail!("--max-imbalance needs --loads (or --loads-file) and --strategy lazarus"),
        _ => place(&replicas, shape, strategy, loads)?,
    };
    let imbalance = loads.map(|l| placement.load_balance(l)).transpose()?.map(|b| b.imbalance());
    let recovery = recovery_curve(&placement);
    Ok((
        LayerReport {
            strategy,
            loads: loads.map(<[f64]>::to_vec),
            replicas,
            applied_floor,
            placement: placement.nodes().to_vec(),
            imbalance,
            recovery,
        },
        placement,
    ))
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
    if let Some(path) = &args.loads_file {
        let layers: Vec<Vec<f64>> = read_json("loads-file", path)?;
        if layers.is_empty() {
            bail!("invalid --loads-file: {} holds no layers (expected an array of per-layer load arrays)", path.display());
        }
        let mut reports = Vec::with_capacity(layers.len());
        for (i, loads) in layers.iter().enumerate() {
            let (report, placement) =
                plan_layer(Some(loads), None, shape, floor, strategy, max_imbalance).with_context(|| format!("--loads-file layer {i}"))?;
            reports.push((report, placement));
        }
        if args.json {
            print_layers_json(&reports)?;
        } else {
            for (i, (report, placement)) in reports.iter().enumerate() {
                println!("== layer {i} ==");
                print!("{}", human_report(report, placement, floor));
            }
        }
        return Ok(());
    }
    let loads = args.loads.as_deref().map(|s| parse_list::<f64>("loads", s, "numbers")).transpose()?;
    let replicas = args.replicas.as_deref().map(|s| parse_list::<usize>("replicas", s, "non-negative integers")).transpose()?;
    let (report, placement) = plan_layer(loads.as_deref(), replicas.as_deref(), shape, floor, strategy, max_imbalance)?;
    if args.json {
        println!("{}", serde_json::to_string(&report)?);
    } else {
        print!("{}", human_report(&report, &placement, floor));
    }
    Ok(())
}

/// `{"layers": [...]}`: the multi-layer JSON shape of `--loads-file` (and of the demo).
fn print_layers_json(reports: &[(LayerReport, Placement)]) -> Result<()> {
    #[derive(Serialize)]
    struct Layers<'a> {
        layers: Vec<&'a LayerReport>,
    }
    let out = Layers { layers: reports.iter().map(|(r, _)| r).collect() };
    println!("{}", serde_json::to_string(&out)?);
    Ok(())
}

fn human_report(report: &LayerReport, placement: &Placement, floor: usize) -> String {
    let shape = placement.shape();
    let mut out = String::new();
    let _ = writeln!(
        out,
        "strategy {} on {} nodes x {} GPU(s) x {} slots = {} replica slots",
        report.strategy,
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
    for (e, &r) in report.replicas.iter().enumerate() {
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
    for r in &report.recovery {
        let ci = r.ci95.map(|[lo, hi]| format!(" (95% CI {lo:.4}-{hi:.4})")).unwrap_or_default();
        let _ = writeln!(out, "  {:>6}  {:>11.6}  {}{ci}", r.failed, r.probability, r.method.name());
    }
    out
}

fn run_demo(json: bool) -> Result<()> {
    let shape = ClusterShape::new(DEMO_NODES, 1, DEMO_SLOTS)?;
    let floor = 2;
    let mut reports = Vec::new();
    for strategy in Strategy::ALL {
        reports.push(plan_layer(Some(&DEMO_LOADS), None, shape, floor, strategy, None)?);
    }
    if json {
        return print_layers_json(&reports);
    }
    println!("Lazarus planning demo: one MoE layer of {} experts with skewed loads on the paper's testbed", DEMO_LOADS.len());
    println!("({DEMO_NODES} nodes x 1 GPU x {DEMO_SLOTS} replica slots), floor {floor}.\n");
    let (report, placement) = &reports[0];
    print!("{}", human_report(report, placement, floor));
    print_strategy_table(&reports, DEMO_NODES);

    // Where the paper's MRO is not optimal: the last group of experts does not fit on the nodes
    // left (Σ r_rep > N) and has to be truncated.
    let shape = ClusterShape::new(TRUNCATED_NODES, 1, TRUNCATED_SLOTS)?;
    let mut truncated = Vec::new();
    for strategy in Strategy::ALL {
        truncated.push(plan_layer(Some(&TRUNCATED_LOADS), None, shape, floor, strategy, None)?);
    }
    println!(
        "\nA truncated case: {} experts with loads {:?} on {TRUNCATED_NODES} nodes x {TRUNCATED_SLOTS} slots \
         (replicas {:?}).",
        TRUNCATED_LOADS.len(),
        TRUNCATED_LOADS,
        truncated[0].0.replicas
    );
    println!("MRO's last group is cut short; the lazarus plan recovers more often:");
    print_strategy_table(&truncated, TRUNCATED_NODES);
    Ok(())
}

/// A layer on which MRO is not optimal (found by the exhaustive oracle's kind of search).
const TRUNCATED_LOADS: [f64; 7] = [167.0, 147.0, 113.0, 535.0, 100.0, 179.0, 671.0];
const TRUNCATED_NODES: usize = 6;
const TRUNCATED_SLOTS: usize = 3;

fn print_strategy_table(reports: &[(LayerReport, Placement)], nodes: usize) {
    println!("\nrecovery probability by strategy (same replicas):");
    let mut header = String::from("  failed");
    for (r, _) in reports {
        let _ = write!(header, " {:>9}", r.strategy.name());
    }
    println!("{header}");
    for k in 0..nodes {
        let mut line = format!("  {k:>6}");
        for (r, _) in reports {
            let _ = write!(line, " {:>9.4}", r.recovery[k].probability);
        }
        println!("{line}");
    }
}

pub fn run_prob(args: &ProbArgs) -> Result<()> {
    let failed = parse_count("failed", &args.failed)?;
    let gpus = parse_count("gpus-per-node", &args.cluster.gpus_per_node)?;
    let placement = if let Some(path) = &args.placement_file {
        let nodes: Vec<Vec<usize>> = read_json("placement-file", path)?;
        let Some(first) = nodes.first() else {
            bail!("invalid --placement-file: {} lists no nodes", path.display());
        };
        let per_node = first.len();
        if gpus == 0 || per_node % gpus != 0 || per_node == 0 {
            bail!("invalid --placement-file: node 0 lists {per_node} entries, not a positive multiple of --gpus-per-node {gpus}");
        }
        if let Some(n) = &args.cluster.nodes {
            let n = parse_count("nodes", n)?;
            if n != nodes.len() {
                bail!("invalid --nodes: {n} (the placement file lists {} nodes)", nodes.len());
            }
        }
        if let Some(c) = &args.cluster.slots {
            let c = parse_count("slots", c)?;
            if c * gpus != per_node {
                bail!("invalid --slots: {c} (the placement file has {per_node} entries per node with {gpus} GPU(s) per node)");
            }
        }
        let experts = nodes.iter().flatten().copied().max().map_or(0, |m| m + 1);
        let shape = ClusterShape::new(nodes.len(), gpus, per_node / gpus)?;
        Placement::from_nodes(shape, experts, nodes).with_context(|| format!("--placement-file {}", path.display()))?
    } else {
        let Some(replicas) = &args.replicas else {
            bail!("one of --replicas or --placement-file is required");
        };
        let replicas = parse_list::<usize>("replicas", replicas, "non-negative integers")?;
        let shape = args.cluster.shape()?;
        place(&replicas, shape, parse_strategy(&args.strategy)?, None)?
    };
    let estimate = recovery_probability(&placement, failed)?;
    if args.json {
        #[derive(Serialize)]
        struct Out {
            probability: f64,
            method: &'static str,
            #[serde(skip_serializing_if = "Option::is_none")]
            ci95: Option<[f64; 2]>,
        }
        let out = Out { probability: estimate.probability, method: estimate.method.name(), ci95: estimate.ci95 };
        println!("{}", serde_json::to_string(&out)?);
    } else {
        let ci = estimate.ci95.map(|[lo, hi]| format!(", 95% CI {lo:.4}-{hi:.4}")).unwrap_or_default();
        println!(
            "recovery probability with {failed} of {} nodes failed: {:.6} ({}{ci})",
            placement.shape().nodes,
            estimate.probability,
            estimate.method.name()
        );
    }
    Ok(())
}
