//! `lazarus bench moe-layer`: one MoE layer over N worker processes with fixed skewed routing,
//! Lazarus (replicas from the loads, padding-free dispatch) against static expert parallelism
//! (one replica per expert, padded all-to-all), as in the paper's Fig. 10a.

use std::fmt::Write as _;

use anyhow::{bail, Result};
use clap::Args;
use lazarus_bench::moe_layer::{BenchCase, BenchResult, BenchSystem, MoeLayerBenchSpec};
use serde::Serialize;

use lazarus_agent::Confinement;

#[derive(Args, Debug)]
pub struct MoeLayerBenchArgs {
    /// Worker processes (one rank each).
    #[arg(long, default_value_t = 4)]
    workers: usize,
    #[arg(long, default_value_t = 1024)]
    d_model: usize,
    /// Hidden width of each expert.
    #[arg(long, default_value_t = 2048)]
    d_ff: usize,
    #[arg(long, default_value_t = 8)]
    experts: usize,
    /// Experts per token (1 to 8): each token's k choices are distinct experts.
    #[arg(long, default_value_t = 1)]
    top_k: usize,
    /// The experts' activation (gelu, or swiglu: Mixtral's, a first weight twice as wide).
    #[arg(long, default_value = "gelu", value_name = "gelu|swiglu")]
    expert_act: String,
    /// Tokens per worker per step.
    #[arg(long, default_value_t = 512)]
    tokens: usize,
    /// Expert replica slots per worker for the Lazarus plan (default: 2 × experts / workers).
    #[arg(long)]
    slots: Option<usize>,
    /// Hot-expert load ratios: the hot expert receives r× the mean expert load (1 ≤ r ≤
    /// experts / top-k, when every token has it among its choices; the others share the rest
    /// equally).
    #[arg(long, default_value = "1,2,4,8", value_delimiter = ',')]
    ratios: Vec<f64>,
    /// Systems to run (lazarus, lazarus-unguarded, lazarus-per-replica, static-ep,
    /// static-ep-skip-padding): fewer systems, more iterations in the same time.
    #[arg(long, value_delimiter = ',', value_parser = parse_system,
          default_value = "lazarus,lazarus-unguarded,lazarus-per-replica,static-ep,static-ep-skip-padding")]
    systems: Vec<BenchSystem>,
    #[arg(long, default_value_t = 1)]
    warmup: usize,
    /// Measured steps per case (the median step is reported, with its 95% confidence interval
    /// and the quartiles). 11 gives an interval between the 2nd and 10th fastest; on a noisy
    /// machine use more.
    #[arg(long, default_value_t = 11)]
    iters: usize,
    /// Pin worker r to cores [r·C, (r+1)·C) with C threads, like one GPU per worker. Default:
    /// cores / workers when there are at least as many cores as workers; with fewer, the workers
    /// share every core, which hides load imbalance (an idle rank's core goes to a busy one),
    /// and a warning says so.
    #[arg(long, conflicts_with = "cpus_per_worker")]
    cores_per_worker: Option<usize>,
    /// Cap each worker at this many CPUs (a Linux cgroup per worker, e.g. 0.5 for 4 workers on
    /// 2 cores), for machines with fewer cores than workers; as with pinning, a waiting rank's
    /// time is not lent to a busy one. Needs write access to the cgroup cpu controller.
    #[arg(long)]
    cpus_per_worker: Option<f64>,
    /// Throughput guard of the Lazarus plan: the most fault-tolerant placement on which no
    /// worker needs more than this many times its mean share of tokens; `inf`: the most
    /// fault-tolerant placement, however unbalanced.
    #[arg(long, default_value_t = lazarus_plan::DEFAULT_MAX_IMBALANCE)]
    max_imbalance: f64,
    /// Deadline of every collective, in seconds.
    #[arg(long, default_value_t = 120.0)]
    comm_timeout: f64,
    #[arg(long)]
    json: bool,
}

const SYSTEMS: [(&str, BenchSystem); 5] = [
    ("lazarus", BenchSystem::Lazarus),
    ("lazarus-unguarded", BenchSystem::LazarusUnguarded),
    ("lazarus-per-replica", BenchSystem::LazarusPerReplica),
    ("static-ep", BenchSystem::StaticEp),
    ("static-ep-skip-padding", BenchSystem::StaticEpSkipPadding),
];

fn parse_system(s: &str) -> Result<BenchSystem, String> {
    SYSTEMS.iter().find(|(name, _)| *name == s).map(|x| x.1).ok_or_else(|| {
        let names: Vec<&str> = SYSTEMS.iter().map(|x| x.0).collect();
        format!("unknown system {s:?} (expected one of {})", names.join(", "))
    })
}

#[derive(Serialize)]
struct Report<'a> {
    results: &'a [BenchResult],
    workers: usize,
    d_model: usize,
    d_ff: usize,
    experts: usize,
    top_k: usize,
    expert_act: &'a str,
    tokens_per_worker: usize,
    cores_per_worker: Option<usize>,
    cpus_per_worker: Option<f64>,
    /// The Lazarus plan's throughput guard (null: none).
    max_imbalance: Option<f64>,
    #[serde(flatten)]
    summary: Summary,
}

pub fn run_moe_layer_bench(args: &MoeLayerBenchArgs) -> Result<()> {
    let spec = bench_spec(args)?;
    crate::io::check_memory(
        spec.memory_estimate(args.workers),
        &format!("bench moe-layer ({} workers, each drawing {} experts of {} x {})", args.workers, args.experts, args.d_model, args.d_ff),
        "--d-model, --d-ff, --experts, --tokens or --workers",
    )?;
    let (cores_per_worker, confine) = confinement(args);
    if !args.json {
        tracing::info!(
            "bench moe-layer: {} workers{}, d_model {}, d_ff {}, {} experts ({}), top-{}, {} tokens per worker, ratios {:?}",
            args.workers,
            match (cores_per_worker, args.cpus_per_worker) {
                (Some(c), _) => format!(" pinned to {c} cores each"),
                (None, Some(f)) => format!(" capped at {f} CPUs each"),
                _ => " sharing the cores".to_string(),
            },
            args.d_model,
            args.d_ff,
            args.experts,
            args.expert_act,
            args.top_k,
            args.tokens,
            args.ratios
        );
    }
    let results = lazarus_bench::moe_layer::run_moe_layer_bench_workers(&spec, args.workers, confine, |_| Ok(()))?;
    let s = Summary::of(&results, &args.ratios);
    if args.json {
        let report = Report {
            results: &results,
            workers: args.workers,
            d_model: args.d_model,
            d_ff: args.d_ff,
            experts: args.experts,
            top_k: args.top_k,
            expert_act: &args.expert_act,
            tokens_per_worker: args.tokens,
            cores_per_worker,
            cpus_per_worker: args.cpus_per_worker,
            max_imbalance: spec.max_imbalance,
            summary: s,
        };
        return crate::io::println(&serde_json::to_string(&report)?);
    }
    crate::io::print(&table(&results, &s))
}

/// The benchmark's spec from its flags, each checked.
fn bench_spec(args: &MoeLayerBenchArgs) -> Result<MoeLayerBenchSpec> {
    let bad = |field: &str, v: String, why: &str| -> Result<()> { bail!("invalid --{field}: {v} ({why})") };
    if args.workers == 0 || args.workers > 64 {
        bad("workers", args.workers.to_string(), "expected 1 to 64")?;
    }
    if args.experts < args.workers {
        bad("experts", args.experts.to_string(), "static expert parallelism needs at least one expert per worker")?;
    }
    for (field, v) in [("d-model", args.d_model), ("d-ff", args.d_ff), ("tokens", args.tokens), ("iters", args.iters)] {
        if v == 0 {
            bad(field, v.to_string(), "must be at least 1")?;
        }
    }
    if args.iters > 1000 {
        bad("iters", args.iters.to_string(), "at most 1000 measured steps per case")?;
    }
    if !(1..=lazarus_model::config::MAX_TOP_K).contains(&args.top_k) || args.top_k > args.experts {
        bad("top-k", args.top_k.to_string(), &format!("expected 1 to {} and at most --experts", lazarus_model::config::MAX_TOP_K))?;
    }
    let act: lazarus_model::config::Activation = toml::Value::String(args.expert_act.clone())
        .try_into()
        .map_err(|_| anyhow::anyhow!("invalid --expert-act: '{}' (expected gelu or swiglu)", args.expert_act))?;
    let most = args.experts as f64 / args.top_k as f64;
    if let Some(r) = args.ratios.iter().find(|r| !r.is_finite() || **r < 1.0 || **r > most) {
        bad("ratios", r.to_string(), &format!("each must be between 1 and experts / top-k ({most})"))?;
    }
    lazarus_agent::launcher::check_comm_timeout(args.comm_timeout)?;
    let max_imbalance = crate::planning::throughput_guard(args.max_imbalance)?;
    let slots = args.slots.unwrap_or_else(|| (2 * args.experts).div_ceil(args.workers));
    if slots * args.workers < args.experts {
        bad("slots", slots.to_string(), "slots × workers must cover every expert")?;
    }
    let mut systems: Vec<BenchSystem> = Vec::new();
    for s in &args.systems {
        if !systems.contains(s) {
            systems.push(*s);
        }
    }
    let cases: Vec<BenchCase> =
        args.ratios.iter().flat_map(|&ratio| systems.iter().map(move |&system| BenchCase { system, ratio })).collect();
    Ok(MoeLayerBenchSpec {
        d_model: args.d_model,
        d_ff: args.d_ff,
        experts: args.experts,
        top_k: args.top_k,
        act,
        tokens: args.tokens,
        slots,
        max_imbalance,
        warmup: args.warmup,
        iters: args.iters,
        seed: 7,
        cases,
        timeout_s: args.comm_timeout,
    })
}

/// How the workers are confined: without a flag, each worker gets cores of its own when the
/// machine has enough (an accelerator each, as the comparison needs); otherwise they share,
/// and the user is told. The cores each worker gets, and the confinement.
fn confinement(args: &MoeLayerBenchArgs) -> (Option<usize>, Confinement) {
    let have = lazarus_agent::allowed_cpus().len();
    let cores_per_worker = match (args.cores_per_worker, args.cpus_per_worker) {
        (None, None) if have >= args.workers => Some(have / args.workers),
        (c, _) => c,
    };
    let confine = match (cores_per_worker, args.cpus_per_worker) {
        (Some(c), _) => Confinement::Cores(c),
        (None, Some(f)) => Confinement::CpuQuota(f),
        (None, None) => Confinement::Shared,
    };
    if matches!(confine, Confinement::Shared) {
        tracing::warn!(
            "warning: {} workers share {have} cores, so an idle worker's CPU goes to a busy one and load imbalance costs \
             nothing: the comparison is not meaningful. Cap each worker with --cpus-per-worker (e.g. {:.2}) instead.",
            args.workers,
            0.5 * have as f64 / args.workers as f64
        );
    }
    (cores_per_worker, confine)
}

/// What the cases say together (NaN, null in JSON, where a figure's cases were not run).
#[derive(Serialize)]
struct Summary {
    /// (max − min) / max of Lazarus tokens/s across the ratios.
    lazarus_spread: f64,
    /// The same for the plan without the throughput guard.
    lazarus_unguarded_spread: f64,
    /// The least Lazarus tokens/s at a skewed ratio over its tokens/s at 1:1 (NaN when 1:1 or
    /// no skewed ratio was run): what the spread cannot say, whether skew costs anything (≥ 1:
    /// nothing; a faster skewed case raises the spread, not this).
    lazarus_kept_under_skew: f64,
    /// The widest 95% confidence interval of a Lazarus case's median tokens/s, over that median:
    /// how precisely the run pins the figures the spread is computed from.
    lazarus_ci95_width: f64,
    /// (ratio, lazarus / static-ep): against DeepSpeed-MoE's way (padding computed).
    speedup: Vec<(f64, f64)>,
    /// (ratio, lazarus / static-ep-skip-padding): against a stronger static baseline.
    speedup_vs_skip_padding: Vec<(f64, f64)>,
}

impl Summary {
    fn of(results: &[lazarus_bench::moe_layer::BenchResult], ratios: &[f64]) -> Self {
        let spread_of = |system: BenchSystem| -> f64 {
            let (lo, hi) = results
                .iter()
                .filter(|r| r.system == system)
                .fold((f64::INFINITY, 0.0f64), |(a, b), r| (a.min(r.tokens_per_s), b.max(r.tokens_per_s)));
            if hi > 0.0 {
                (hi - lo) / hi
            } else {
                f64::NAN
            }
        };
        let kept_under_skew = {
            let lazarus = |skewed: bool| results.iter().filter(move |r| r.system == BenchSystem::Lazarus && (r.ratio > 1.0) == skewed);
            match lazarus(false).find(|r| r.ratio == 1.0) {
                Some(balanced) => lazarus(true).map(|r| r.tokens_per_s / balanced.tokens_per_s).fold(f64::NAN, f64::min),
                None => f64::NAN,
            }
        };
        let ci95_width = results
            .iter()
            .filter(|r| r.system == BenchSystem::Lazarus)
            .map(|r| (r.tokens_per_s_ci95.1 - r.tokens_per_s_ci95.0) / r.tokens_per_s)
            .fold(f64::NAN, f64::max);
        let ratio_to = |base: BenchSystem| -> Vec<(f64, f64)> {
            ratios
                .iter()
                .map(|&k| {
                    let get = |s: BenchSystem| results.iter().find(|r| r.system == s && r.ratio == k).map_or(f64::NAN, |r| r.tokens_per_s);
                    (k, get(BenchSystem::Lazarus) / get(base))
                })
                .collect()
        };
        Summary {
            lazarus_spread: spread_of(BenchSystem::Lazarus),
            lazarus_unguarded_spread: spread_of(BenchSystem::LazarusUnguarded),
            lazarus_kept_under_skew: kept_under_skew,
            lazarus_ci95_width: ci95_width,
            speedup: ratio_to(BenchSystem::StaticEp),
            speedup_vs_skip_padding: ratio_to(BenchSystem::StaticEpSkipPadding),
        }
    }
}

/// The cases as a table, and the summary's lines under it.
fn table(results: &[lazarus_bench::moe_layer::BenchResult], s: &Summary) -> String {
    let mut out = String::new();
    let _ = writeln!(
        out,
        "{:<11} {:>6} {:>12} {:>15} {:>10} {:>11} {:>10} {:>10}  replicas",
        "system", "ratio", "tokens/s", "95% CI", "step s", "wire ratio", "imbalance", "P(1 fail)"
    );
    for r in results {
        let system = match r.system {
            BenchSystem::Lazarus => "lazarus",
            BenchSystem::LazarusUnguarded => "unguarded",
            BenchSystem::LazarusPerReplica => "per-replica",
            BenchSystem::StaticEp => "static-ep",
            BenchSystem::StaticEpSkipPadding => "static-skip",
        };
        let reps: Vec<String> = r.replicas.iter().map(u32::to_string).collect();
        let _ = writeln!(
            out,
            "{system:<11} {:>6} {:>12.0} {:>15} {:>10.3} {:>11.2} {:>10.3} {:>10.2}  [{}]",
            r.ratio,
            r.tokens_per_s,
            format!("{:.0}–{:.0}", r.tokens_per_s_ci95.0, r.tokens_per_s_ci95.1),
            r.step_s,
            r.wire_bytes_ratio,
            r.imbalance,
            r.survives_one_failure,
            reps.join(",")
        );
    }
    let shown = |x: f64, unit: &str| if x.is_finite() { format!("{x:.2}{unit}") } else { "not run".into() };
    let _ = writeln!(
        out,
        "lazarus tokens/s spread across ratios: {} (without the throughput guard: {}); widest 95% CI of a lazarus median: {}",
        shown(100.0 * s.lazarus_spread, "%"),
        shown(100.0 * s.lazarus_unguarded_spread, "%"),
        shown(100.0 * s.lazarus_ci95_width, "%")
    );
    let _ = writeln!(out, "lazarus tokens/s at its most costly skew: {} of its 1:1 figure", shown(100.0 * s.lazarus_kept_under_skew, "%"));
    for ((k, sp), (_, skip)) in
        s.speedup.iter().zip(&s.speedup_vs_skip_padding).filter(|((_, sp), (_, skip))| sp.is_finite() || skip.is_finite())
    {
        let _ =
            writeln!(out, "lazarus / static-ep at {k}:1: {} (vs static EP skipping padding rows: {})", shown(*sp, "x"), shown(*skip, "x"));
    }
    out
}
