//! `lazarus sim --sweep KEY=V1,V2,…`: the same scenario once per value of one setting, each
//! policy's ETTR and samples side by side — what an operator asks before choosing the floor, the
//! slots per GPU or the checkpoint interval for the failure rate they expect.

use std::fmt::Write as _;

use anyhow::{bail, Context, Result};
use lazarus_sim::{simulate, PolicyReport};
use serde::Serialize;

use super::{build, named_flag, SimArgs};

/// The settings a sweep may vary.
const KEYS: [&str; 14] = [
    "fail-every",
    "poisson-mtbf",
    "repair",
    "notice-share",
    "max-nodes",
    "slots-per-gpu",
    "min-replicas",
    "checkpoint-every-lazarus",
    "rebalance-every",
    "snapshot-bandwidth",
    "exit-detect",
    "failure-timeout",
    "group-rebuild",
    "join-rule",
];
/// Most values of one sweep (each a whole simulation of every policy).
const MAX_VALUES: usize = 16;

/// `args` with the swept setting `key` at `value`.
fn with_value(args: &SimArgs, key: &str, value: &str) -> Result<SimArgs> {
    let mut a = args.clone();
    a.sweep = None;
    let number =
        |what: &str| -> Result<u64> { value.parse::<u64>().with_context(|| format!("invalid --sweep {key}: {value:?} is not {what}")) };
    match key {
        "fail-every" => a.fail_every = Some(value.to_string()),
        "poisson-mtbf" => a.poisson_mtbf = Some(value.to_string()),
        "repair" => a.repair = value.to_string(),
        "notice-share" => {
            a.notice_share = value.parse().with_context(|| format!("invalid --sweep {key}: {value:?} is not a share from 0 to 1"))?
        }
        "max-nodes" => a.max_nodes = number("a number of nodes")? as usize,
        "slots-per-gpu" => a.slots_per_gpu = Some(number("a number of slots")? as usize),
        "min-replicas" => a.min_replicas = Some(number("a number of replicas")? as usize),
        "checkpoint-every-lazarus" => a.checkpoint_every_lazarus = Some(number("a number of steps")?),
        "rebalance-every" => a.rebalance_every = Some(number("a number of steps")?),
        "snapshot-bandwidth" => {
            a.snapshot_bandwidth = Some(value.parse().with_context(|| format!("invalid --sweep {key}: {value:?} is not bytes per second"))?)
        }
        "exit-detect" => a.exit_detect = Some(value.to_string()),
        "failure-timeout" => a.failure_timeout = Some(value.to_string()),
        "group-rebuild" => a.group_rebuild = Some(value.to_string()),
        "join-rule" => {
            a.join_rule = <crate::join_rule::JoinChoice as clap::ValueEnum>::from_str(value, false)
                .map_err(|_| anyhow::anyhow!("invalid --sweep join-rule: {value:?} (expected wait or repaid)"))?
        }
        _ => bail!("invalid --sweep: {key:?} is no setting a sweep varies (one of {})", KEYS.join(", ")),
    }
    Ok(a)
}

/// `KEY=V1,V2,…` as the key and its values, checked.
fn parse(sweep: &str) -> Result<(&str, Vec<&str>)> {
    let Some((key, values)) = sweep.split_once('=') else {
        bail!("invalid --sweep: {sweep:?} (expected KEY=V1,V2,…, e.g. fail-every=5m,10m,30m)")
    };
    if !KEYS.contains(&key) {
        bail!("invalid --sweep: {key:?} is no setting a sweep varies (one of {})", KEYS.join(", "));
    }
    let values: Vec<&str> = values.split(',').map(str::trim).collect();
    if values.iter().any(|v| v.is_empty()) || values.len() > MAX_VALUES {
        bail!("invalid --sweep {key}: {} values (expected 1 to {MAX_VALUES}, none empty)", values.len());
    }
    Ok((key, values))
}

#[derive(Serialize)]
struct PointJson<'a> {
    value: &'a str,
    policies: Vec<PolicyPoint>,
}

#[derive(Serialize)]
struct PolicyPoint {
    policy: &'static str,
    ettr: f64,
    trained_samples: f64,
    restarts: u64,
    reconfigurations: u64,
}

/// Run the sweep and print (or write) what it found.
pub(super) fn run_sweep(args: &SimArgs, sweep: &str) -> Result<()> {
    let (key, values) = parse(sweep)?;
    // Every value's scenario first: a bad value is refused before any simulation runs.
    let built = values
        .iter()
        .map(|value| build(&with_value(args, key, value)?).with_context(|| format!("--sweep {key}={value}")))
        .collect::<Result<Vec<_>>>()?;
    let mut points: Vec<Vec<PolicyReport>> = Vec::with_capacity(values.len());
    for (scenario, policies) in &built {
        let reports = policies.iter().map(|&p| simulate(scenario, p)).collect::<Result<Vec<_>, _>>().map_err(named_flag)?;
        points.push(reports);
    }
    let names: Vec<&'static str> = points.first().map(|r| r.iter().map(|r| r.policy.name()).collect()).unwrap_or_default();
    if let Some(path) = &args.plot {
        let series: Vec<(&str, Vec<f64>)> =
            names.iter().enumerate().map(|(k, &n)| (n, points.iter().map(|r| r[k].ettr).collect())).collect();
        let values: Vec<String> = values.iter().map(|v| v.to_string()).collect();
        let svg = lazarus_sim::svg::render_sweep(key, &values, &series, &format!("ETTR as {key} varies"));
        std::fs::write(path, svg).with_context(|| format!("--plot: cannot write {}", path.display()))?;
    }
    if args.json {
        let json: Vec<PointJson> = values
            .iter()
            .zip(&points)
            .map(|(value, reports)| PointJson {
                value,
                policies: reports
                    .iter()
                    .map(|r| PolicyPoint {
                        policy: r.policy.name(),
                        ettr: r.ettr,
                        trained_samples: r.trained_samples,
                        restarts: r.restarts,
                        reconfigurations: r.reconfigurations,
                    })
                    .collect(),
            })
            .collect();
        return crate::io::println(&serde_json::json!({ "sweep": key, "points": json }).to_string());
    }
    let mut out = String::new();
    let _ = writeln!(out, "ETTR (samples) as {key} varies");
    let _ = write!(out, "{key:<14}");
    for n in &names {
        let _ = write!(out, " {n:>18}");
    }
    let _ = writeln!(out);
    for (value, reports) in values.iter().zip(&points) {
        let _ = write!(out, "{value:<14}");
        for r in reports {
            let _ = write!(out, " {:>18}", format!("{:.3} ({})", r.ettr, si(r.trained_samples)));
        }
        let _ = writeln!(out);
    }
    crate::io::print(&out)
}

/// A count with its SI prefix (474.7M).
fn si(x: f64) -> String {
    match x {
        x if x >= 1e9 => format!("{:.1}G", x / 1e9),
        x if x >= 1e6 => format!("{:.1}M", x / 1e6),
        x if x >= 1e3 => format!("{:.1}k", x / 1e3),
        x => format!("{x:.0}"),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_sweep_names_a_setting_and_at_most_sixteen_values() {
        assert_eq!(parse("fail-every=5m, 10m").unwrap(), ("fail-every", vec!["5m", "10m"]));
        for (bad, said) in [
            ("fail-every", "expected KEY=V1"),
            ("colour=red", "no setting a sweep varies"),
            ("max-nodes=4,,8", "none empty"),
            (&*format!("max-nodes={}", vec!["4"; 17].join(",")), "17 values"),
        ] {
            let e = parse(bad).unwrap_err().to_string();
            assert!(e.contains(said), "{bad}: {e}");
        }
        assert_eq!(si(474_693_248.0), "474.7M");
        assert_eq!(si(812.0), "812");
    }
}
