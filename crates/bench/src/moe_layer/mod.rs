//! The MoE-layer benchmark behind `lazarus bench moe-layer` (paper §6.5, Fig. 10a): one MoE
//! layer over the ranks, routing fixed so that one expert receives `ratio`× the tokens of each
//! other expert, timed forward+backward for the Lazarus dispatcher (replicas from the loads) and
//! for static expert parallelism (one replica per expert, padded buffers). This module is the
//! per-rank part; `launch.rs` starts the ranks as a job and is each rank's subcommand.

mod launch;

pub use launch::{run_moe_layer_bench_workers, run_rank, RANK_SUBCOMMAND};

use std::collections::BTreeMap;
use std::time::{Duration, Instant};

use candle_core::{Device, Tensor, Var};
use lazarus_comm::{all_gather, barrier, Group, Transport};
use lazarus_model::rng::SplitMix64;
use lazarus_plan::{min_max_load, plan_model, ClusterShape, PlanPolicy, ReplicaMap, Strategy};
use lazarus_runtime::{DispatchMode, DistributedMoe, ExpertWeights, RuntimeError, DEFAULT_BUCKET_BYTES};
use serde::{Deserialize, Serialize};

/// Which system a case runs.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "kebab-case")]
pub enum BenchSystem {
    /// Replicas from the loads, rank-balanced padding-free dispatch.
    Lazarus,
    /// As `Lazarus` but placed for fault tolerance alone (no throughput guard): what the guard
    /// buys, side by side.
    LazarusUnguarded,
    /// The same replicas with the paper's per-replica shares (Algorithm 1 as published).
    LazarusPerReplica,
    /// DeepSpeed-MoE: one replica per expert, padded buffers, padding rows computed.
    StaticEp,
    /// Static EP that skips computing the padding rows (stronger than DeepSpeed).
    StaticEpSkipPadding,
}

/// One measured configuration.
#[derive(Debug, Clone, Serialize, Deserialize)]
pub struct BenchCase {
    pub system: BenchSystem,
    /// The hot expert receives `ratio`× the mean expert load.
    pub ratio: f64,
}

/// The layer and the workload, the same on every rank.
#[derive(Debug, Clone, Serialize, Deserialize)]
pub struct MoeLayerBenchSpec {
    pub d_model: usize,
    pub d_ff: usize,
    pub experts: usize,
    /// Experts per token (each token's k choices are distinct experts).
    #[serde(default = "one")]
    pub top_k: usize,
    /// The experts' activation (SwiGLU: a first weight twice as wide).
    #[serde(default)]
    pub act: lazarus_model::config::Activation,
    /// Tokens per rank per step.
    pub tokens: usize,
    /// Expert replica slots per rank for the Lazarus plan.
    pub slots: usize,
    /// Throughput guard of the Lazarus (balanced) plan ([`place_balanced`]); `None`: the most
    /// fault-tolerant placement whatever its balance.
    pub max_imbalance: Option<f64>,
    pub warmup: usize,
    pub iters: usize,
    pub seed: u64,
    pub cases: Vec<BenchCase>,
    pub timeout_s: f64,
}

fn one() -> usize {
    1
}

impl MoeLayerBenchSpec {
    /// Bytes the benchmark needs on `world` ranks, about (checked before anything is
    /// allocated): every rank draws every expert's weights (one seed everywhere) and keeps its
    /// slots' with their gradients, and its tokens — up to the largest ratio times as many rows
    /// for a padded hot expert — pass through an expert's hidden layer forward and backward.
    pub fn memory_estimate(&self, world: usize) -> u128 {
        let (d, f, e) = (self.d_model as u128, self.d_ff as u128, self.experts as u128);
        let f1 = self.act.first_width(self.d_ff) as u128;
        let expert = d * f1 + f * d + d + f1;
        let ratio = self.cases.iter().map(|c| c.ratio).fold(1.0f64, f64::max).ceil().min(1e6) as u128;
        let rows = self.tokens as u128 * self.top_k.max(1) as u128 * ratio.max(1);
        let per_rank = 4 * (e * expert + 2 * self.slots as u128 * expert + 8 * rows * (d + f1));
        per_rank.saturating_mul(world as u128)
    }
}

/// One case's outcome, the same on every rank.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct BenchResult {
    pub system: BenchSystem,
    pub ratio: f64,
    /// Forward+backward tokens (all ranks) per second at the median step time (a step lasts
    /// as long as its slowest rank).
    pub tokens_per_s: f64,
    /// Tokens/s at the slower and the faster quartile of the step times: the run's noise, to
    /// read a spread against (on a shared machine it can exceed the differences measured).
    pub tokens_per_s_quartiles: (f64, f64),
    /// A distribution-free 95% confidence interval of the median tokens/s (order statistics of
    /// the steps, [`median_ci95`]): how precisely this case's figure is known.
    pub tokens_per_s_ci95: (f64, f64),
    /// Bytes sent in the four all-to-alls of a step over the bytes of a row per (token, choice)
    /// whose expert is on another rank, in each of them: 1 for a dispatcher without padding that
    /// sends a row per slot; Lazarus sends a token once to each rank holding any of its choices,
    /// in all four exchanges (the holder combines its slots), so at top-k > 1 it is below 1;
    /// padding raises it.
    pub wire_bytes_ratio: f64,
    /// Median step seconds (per iteration, the slowest rank's).
    pub step_s: f64,
    /// Replicas per expert of the plan that ran.
    pub replicas: Vec<u32>,
    /// The plan's λ*/mean: the busiest rank's least possible tokens over the mean.
    pub imbalance: f64,
    /// Share of single-rank failures after which every expert still has a replica.
    pub survives_one_failure: f64,
    /// Rows the experts computed in one forward, over all ranks (padding included where the
    /// system computes it); the routed rows are `tokens × ranks`.
    pub expert_rows: u64,
}

/// Per-expert loads in units of the mean with expert 0 hot: it receives `ratio`× the mean, the
/// others share the rest equally (at ratio = experts every token goes to expert 0).
pub fn skewed_loads(experts: usize, ratio: f64) -> Vec<f64> {
    let rest = if experts > 1 { ((experts as f64 - ratio) / (experts as f64 - 1.0)).max(0.0) } else { 0.0 };
    (0..experts).map(|e| if e == 0 { ratio } else { rest }).collect()
}

/// R[e][rank] for a case: Lazarus allocates replicas from the loads (Eq. 1, floor 1) and places
/// them (the balanced dispatcher's plan under the throughput guard `max_imbalance`, the
/// per-replica one without it, since its shares are fixed by the replica counts); static EP
/// splits experts evenly, one replica each.
pub fn bench_placement(
    system: BenchSystem,
    loads: &[f64],
    world: usize,
    slots: usize,
    max_imbalance: Option<f64>,
) -> Result<Vec<Vec<u32>>, RuntimeError> {
    let map = match system {
        BenchSystem::StaticEp | BenchSystem::StaticEpSkipPadding => ReplicaMap::static_ep(0, 1, loads.len(), world)?,
        BenchSystem::Lazarus | BenchSystem::LazarusUnguarded | BenchSystem::LazarusPerReplica => {
            let shape = ClusterShape::new(world, 1, slots)?;
            let guard = if system == BenchSystem::Lazarus { max_imbalance } else { None };
            let policy = PlanPolicy { floor: 1, strategy: Strategy::Lazarus, max_imbalance: guard, keep_survivors: false };
            plan_model(&[loads.to_vec()], shape, &policy, None)?.replica_map()
        }
    };
    Ok(map.dense_layer(0))
}

/// (busiest rank's tokens over the mean, share of single-rank failures every expert survives)
/// of R[e][rank] under `system`'s dispatcher: the per-replica shares of Algorithm 1 are fixed by
/// the replica counts; every other system's is λ*, the least the placement allows (one
/// replica each for static EP, so also what it gets).
pub fn plan_quality(system: BenchSystem, replicas: &[Vec<u32>], loads: &[f64], world: usize) -> Result<(f64, f64), RuntimeError> {
    let holders: Vec<Vec<usize>> = replicas.iter().map(|r| (0..world).filter(|&k| r[k] > 0).collect()).collect();
    let imbalance = match system {
        BenchSystem::LazarusPerReplica => {
            let total: f64 = loads.iter().sum();
            let busiest = (0..world)
                .map(|k| replicas.iter().zip(loads).map(|(r, t)| t * r[k] as f64 / r.iter().sum::<u32>().max(1) as f64).sum::<f64>())
                .fold(0.0, f64::max);
            if total > 0.0 {
                (busiest * world as f64 / total).max(1.0)
            } else {
                1.0
            }
        }
        _ => min_max_load(&holders, loads, world)?.imbalance(),
    };
    let survivable = (0..world).filter(|&k| holders.iter().all(|h| h.iter().any(|&j| j != k))).count();
    Ok((imbalance, survivable as f64 / world as f64))
}

/// Token-major expert choices (top-1) for `n` tokens matching `loads` exactly up to rounding,
/// in a seeded order.
fn routed_choices(loads: &[f64], n: usize, k: usize, seed: u64) -> Result<Vec<u32>, RuntimeError> {
    let c: Vec<u32> = lazarus_model::routing::assign_from_loads(loads, n, k)?.into_iter().map(|e| e as u32).collect();
    // The tokens in a seeded order (each keeps its k distinct experts).
    let mut order: Vec<usize> = (0..n).collect();
    let mut rng = SplitMix64::new(seed);
    for i in (1..n).rev() {
        order.swap(i, rng.below(i + 1));
    }
    Ok(order.iter().flat_map(|&t| c[t * k..(t + 1) * k].iter().copied()).collect())
}

/// The order statistics bounding a 95% confidence interval of the median of `v`, without
/// assuming a distribution: the j-th smallest and j-th largest with the largest j such that
/// P(Binomial(n, ½) < j) ≤ 2.5% (n = 25: the 8th and 18th). Below 6 values even the range
/// covers less than 95%; it is returned all the same.
fn median_ci95(v: &[f64]) -> (f64, f64) {
    let mut s = v.to_vec();
    s.sort_by(f64::total_cmp);
    let n = s.len();
    if n == 0 {
        return (f64::NAN, f64::NAN);
    }
    // P(B < j) for B ~ Binomial(n, ½), summed term by term; terms kept as logarithms so that
    // 2^-n does not underflow for long runs.
    let mut j = 1;
    let (mut below, mut ln_term) = (0.0f64, n as f64 * 0.5f64.ln());
    for k in 0..n {
        below += ln_term.exp();
        if below > 0.025 {
            break;
        }
        j = k + 1;
        ln_term += ((n - k) as f64 / (k + 1) as f64).ln();
    }
    let j = j.min(n.div_ceil(2));
    (s[j - 1], s[n - j])
}

/// The q-quantile (0 ≤ q ≤ 1) of `v` by linear interpolation between order statistics.
fn quantile(v: &[f64], q: f64) -> f64 {
    let mut s = v.to_vec();
    s.sort_by(f64::total_cmp);
    if s.is_empty() {
        return f64::NAN;
    }
    let at = q * (s.len() - 1) as f64;
    let (lo, hi) = (at.floor() as usize, at.ceil() as usize);
    s[lo] + (s[hi] - s[lo]) * (at - lo as f64)
}

/// Run every case of `spec` on this rank; every rank must call it together.
pub fn run_moe_layer_bench(t: &mut dyn Transport, world: &mut Group, spec: &MoeLayerBenchSpec) -> Result<Vec<BenchResult>, RuntimeError> {
    let (d, n) = (spec.d_model, spec.tokens);
    let rank = t.rank();
    let timeout = Duration::from_secs_f64(spec.timeout_s);
    let dev = Device::Cpu;
    let mut local = SplitMix64::new(spec.seed ^ ((rank as u64 + 1) * 0x9e37_79b9));
    let h_data: Vec<f32> = (0..n * d).map(|_| local.normal() as f32).collect();
    let g_data: Vec<f32> = (0..n * d).map(|_| local.normal() as f32 * 1e-3).collect();
    let h = Tensor::from_vec(h_data, (n, d), &dev)?;
    let grad = Tensor::from_vec(g_data, (n, d), &dev)?;
    // Every case is set up first, then the steps are interleaved (step k of every case in turn):
    // a slow spell of a shared machine then hits every case alike instead of one of them.
    let mut cases = set_up_cases(spec, rank, t.world())?;
    for it in 0..spec.warmup + spec.iters {
        for c in cases.iter_mut() {
            barrier(t, world, timeout)?;
            let start = Instant::now();
            let fwd = c.layer.forward_routed(t, world, &h, Some(&c.choices))?;
            let grads = c.layer.backward(t, world, &fwd, &grad)?;
            let elapsed = start.elapsed().as_secs_f64();
            if it >= spec.warmup {
                c.times.push(elapsed);
                c.wire += fwd.wire_bytes + grads.wire_bytes;
                c.needed += 4 * fwd.rows_sent * d as u64 * 4;
                c.rows = fwd.expert_rows;
            }
        }
    }
    spec.cases.iter().zip(&cases).map(|(case, c)| c.result(t, world, case, spec)).collect()
}

/// One case as this rank runs it: its layer and routing, and what its measured steps took.
struct CaseRun {
    layer: DistributedMoe,
    choices: Vec<u32>,
    replicas: Vec<Vec<u32>>,
    loads: Vec<f64>,
    times: Vec<f64>,
    wire: u64,
    needed: u64,
    rows: u64,
}

/// Every case's layer on this rank (of `ranks`): the same weights everywhere (same seed), each
/// rank keeping the experts it holds in the case; its tokens' routing for the case's skew.
fn set_up_cases(spec: &MoeLayerBenchSpec, rank: usize, ranks: usize) -> Result<Vec<CaseRun>, RuntimeError> {
    let (d, f, e_count) = (spec.d_model, spec.d_ff, spec.experts);
    let f1 = spec.act.first_width(spec.d_ff);
    let dev = Device::Cpu;
    let mut rng = SplitMix64::new(spec.seed);
    let mut tensor = |shape: &[usize], std: f64| -> Result<Tensor, RuntimeError> {
        let len: usize = shape.iter().product();
        Ok(Tensor::from_vec((0..len).map(|_| (rng.normal() * std) as f32).collect::<Vec<f32>>(), shape, &dev)?)
    };
    let gate = Var::from_tensor(&tensor(&[d, e_count], 0.02)?)?;
    let all_experts: Vec<ExpertWeights> = (0..e_count)
        .map(|_| {
            ExpertWeights::new(
                vec![
                    Var::from_tensor(&tensor(&[d, f1], 0.02)?)?,
                    Var::from_tensor(&tensor(&[f1], 0.0)?)?,
                    Var::from_tensor(&tensor(&[f, d], 0.02)?)?,
                    Var::from_tensor(&tensor(&[d], 0.0)?)?,
                ],
                spec.act,
            )
        })
        .collect::<Result<_, RuntimeError>>()?;
    let mut cases = Vec::with_capacity(spec.cases.len());
    for case in &spec.cases {
        let loads = skewed_loads(e_count, case.ratio);
        let replicas = bench_placement(case.system, &loads, ranks, spec.slots, spec.max_imbalance)?;
        let experts: BTreeMap<usize, ExpertWeights> =
            (0..e_count).filter(|&e| replicas[e][rank] > 0).map(|e| (e, all_experts[e].clone())).collect();
        let layer = DistributedMoe {
            gate: gate.clone(),
            route_bias: None,
            experts,
            replicas: replicas.clone(),
            top_k: spec.top_k,
            router: lazarus_model::routing::Router::default(),
            timeout: Duration::from_secs_f64(spec.timeout_s),
            mode: match case.system {
                BenchSystem::Lazarus | BenchSystem::LazarusUnguarded => DispatchMode::Balanced,
                BenchSystem::LazarusPerReplica => DispatchMode::Flexible,
                BenchSystem::StaticEp => DispatchMode::StaticPadded,
                BenchSystem::StaticEpSkipPadding => DispatchMode::StaticSkipPadding,
            },
            bucket_bytes: DEFAULT_BUCKET_BYTES,
            catching_up: Vec::new(),
        };
        let choices = routed_choices(&loads, spec.tokens, spec.top_k, spec.seed ^ rank as u64)?;
        cases.push(CaseRun { layer, choices, replicas, loads, times: Vec::new(), wire: 0, needed: 0, rows: 0 });
    }
    Ok(cases)
}

impl CaseRun {
    /// The case's figures over every rank: a step lasts as long as its slowest rank (every step
    /// starts at a barrier); bytes are summed over ranks.
    fn result(
        &self,
        t: &mut dyn Transport,
        world: &mut Group,
        case: &BenchCase,
        spec: &MoeLayerBenchSpec,
    ) -> Result<BenchResult, RuntimeError> {
        let ranks = t.world();
        let timeout = Duration::from_secs_f64(spec.timeout_s);
        let iters = self.times.len();
        let mut mine: Vec<u8> =
            [(self.wire as f64), (self.needed as f64), (self.rows as f64)].iter().flat_map(|x| x.to_le_bytes()).collect();
        mine.extend(self.times.iter().flat_map(|x| x.to_le_bytes()));
        let all = all_gather(t, world, &mine, timeout)?;
        let mut steps = vec![0.0f64; iters];
        let (mut wire_all, mut needed_all, mut rows_all) = (0.0, 0.0, 0.0);
        for (r, b) in all.iter().enumerate() {
            if b.len() != 8 * (3 + iters) {
                return Err(RuntimeError::Invalid {
                    field: "bench result",
                    reason: format!("rank {r} sent {} bytes, expected {}", b.len(), 8 * (3 + iters)),
                });
            }
            let at = |i: usize| f64::from_le_bytes(b[8 * i..8 * i + 8].try_into().expect("8 bytes"));
            wire_all += at(0);
            needed_all += at(1);
            rows_all += at(2);
            for (i, s) in steps.iter_mut().enumerate() {
                *s = s.max(at(3 + i));
            }
        }
        let step_s = quantile(&steps, 0.5);
        let tokens = (ranks * spec.tokens) as f64;
        let (imbalance, survives_one_failure) = plan_quality(case.system, &self.replicas, &self.loads, ranks)?;
        Ok(BenchResult {
            imbalance,
            survives_one_failure,
            system: case.system,
            ratio: case.ratio,
            tokens_per_s: tokens / step_s,
            tokens_per_s_quartiles: (tokens / quantile(&steps, 0.75), tokens / quantile(&steps, 0.25)),
            tokens_per_s_ci95: {
                let (fast, slow) = median_ci95(&steps);
                (tokens / slow, tokens / fast)
            },
            wire_bytes_ratio: if needed_all > 0.0 { wire_all / needed_all } else { 1.0 },
            step_s,
            replicas: self.replicas.iter().map(|r| r.iter().sum()).collect(),
            expert_rows: rows_all as u64,
        })
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn lazarus_gives_the_hot_expert_more_replicas_and_static_ep_one_each() {
        let loads = skewed_loads(8, 4.0);
        let lz = bench_placement(BenchSystem::Lazarus, &loads, 4, 4, None).unwrap();
        let counts: Vec<u32> = lz.iter().map(|r| r.iter().sum()).collect();
        assert_eq!(counts.iter().sum::<u32>(), 16);
        assert!(counts[0] > counts[1], "{counts:?}");
        let ep = bench_placement(BenchSystem::StaticEp, &loads, 4, 4, None).unwrap();
        assert!(ep.iter().all(|r| r.iter().sum::<u32>() == 1));
        assert_eq!(plan_quality(BenchSystem::StaticEp, &ep, &loads, 4).unwrap().1, 0.0, "one replica each: no failure is survivable");
    }

    #[test]
    fn the_guard_trades_a_survivable_failure_for_no_idle_worker_at_8_to_1() {
        let loads = skewed_loads(8, 8.0);
        let ft = bench_placement(BenchSystem::Lazarus, &loads, 4, 4, None).unwrap();
        let guarded = bench_placement(BenchSystem::Lazarus, &loads, 4, 4, Some(1.05)).unwrap();
        let quality = |r: &[Vec<u32>]| plan_quality(BenchSystem::Lazarus, r, &loads, 4).unwrap();
        let (a, b) = (quality(&ft), quality(&guarded));
        assert!((a.0 - 4.0 / 3.0).abs() < 1e-9 && a.1 == 0.5, "{a:?}");
        assert!((b.0 - 1.0).abs() < 1e-9 && b.1 == 0.25, "{b:?}");
        // The per-replica dispatcher cannot use the guard's freedom, so it keeps the optimum.
        assert_eq!(bench_placement(BenchSystem::LazarusPerReplica, &loads, 4, 4, Some(1.05)).unwrap(), ft);
        // Per-replica shares: 9 equal shares of every token, four on each of workers 2 and 3.
        let (imb, _) = plan_quality(BenchSystem::LazarusPerReplica, &ft, &loads, 4).unwrap();
        assert!((imb - 16.0 / 9.0).abs() < 1e-9, "{imb}");
    }

    #[test]
    fn the_median_interval_uses_binomial_order_statistics() {
        let v: Vec<f64> = (1..=25).map(f64::from).collect();
        assert_eq!(median_ci95(&v), (8.0, 18.0), "n = 25: the 8th and 18th");
        let v: Vec<f64> = (1..=10).rev().map(f64::from).collect();
        assert_eq!(median_ci95(&v), (2.0, 9.0), "n = 10: the 2nd and 9th (P(B < 2) = 1.1%)");
        assert_eq!(median_ci95(&[3.0, 1.0, 2.0]), (1.0, 3.0), "too few steps: the range");
        assert_eq!(median_ci95(&[4.0]), (4.0, 4.0));
        // Long runs: 2^-2000 underflows, its logarithm does not. Normal approximation:
        // j ≈ n/2 − 1.96·√n/2 = 956.2 for n = 2000, so the 956th or so.
        let v: Vec<f64> = (1..=2000).map(f64::from).collect();
        let (lo, hi) = median_ci95(&v);
        assert!((950.0..=960.0).contains(&lo) && hi == 2001.0 - lo, "{lo} {hi}");
    }

    #[test]
    fn quantiles_interpolate_between_order_statistics() {
        let v = [4.0, 1.0, 3.0, 2.0, 5.0];
        assert_eq!(quantile(&v, 0.5), 3.0);
        assert_eq!(quantile(&v, 0.25), 2.0);
        assert_eq!(quantile(&[1.0, 2.0], 0.5), 1.5, "even count: between the middle two");
        assert_eq!(quantile(&[7.0], 0.75), 7.0);
        assert!(quantile(&[], 0.5).is_nan());
    }

    #[test]
    fn routed_choices_follow_the_loads() {
        let c = routed_choices(&skewed_loads(8, 4.0), 1600, 1, 1).unwrap();
        assert_eq!(c.iter().filter(|&&e| e == 0).count(), 800, "4x the mean of 200");
        for e in 1..8 {
            let n = c.iter().filter(|&&x| x == e).count();
            assert!((114..=115).contains(&n), "expert {e}: {n}, the other 800 shared evenly");
        }
        let all = routed_choices(&skewed_loads(8, 8.0), 100, 1, 1).unwrap();
        assert!(all.iter().all(|&e| e == 0), "8x the mean of 8 experts is every token");
        // Top-8 of 64 with the hot expert at 8x the mean (every token): each token's 8 choices
        // are distinct, and the loads follow.
        let c = routed_choices(&skewed_loads(64, 8.0), 512, 8, 3).unwrap();
        assert_eq!(c.len(), 512 * 8);
        for t in c.chunks(8) {
            let mut s = t.to_vec();
            s.sort();
            s.dedup();
            assert_eq!(s.len(), 8, "{t:?}");
        }
        assert_eq!(c.iter().filter(|&&e| e == 0).count(), 512);
    }
}
