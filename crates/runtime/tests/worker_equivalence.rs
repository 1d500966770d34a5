//! The correctness guarantee of multi-worker training: same seed, same global batch — 1, 2, 3
//! and 4 workers (loopback TCP, one thread per rank) with uneven replica placements reproduce the
//! single-process trainer's per-step loss within 1e-4 relative over 20 steps, and its final
//! parameters within 1e-4; so do 1 and 4 workers with Mixtral's blocks, top-4 of 16 experts and a
//! shared expert; so do 2 workers with Qwen3-MoE's query and key norms, 3 with DeepSeek-MoE's
//! sigmoid, group-limited routing, and 1 and 3 workers
//! with loss-free balancing's routing bias; a checkpoint
//! the workers write resumes in the single-process trainer with the same parameters.

mod common;

use std::collections::BTreeMap;
use std::time::Duration;

use lazarus_comm::{Group, LocalTransport, TcpTransport, Transport};
use lazarus_model::{ModelConfig, TrainConfig, Trainer};
use lazarus_plan::ReplicaMap;
use lazarus_runtime::{DispatchMode, Worker, WorkerOptions};

const STEPS: u64 = 20;

fn config() -> TrainConfig {
    common::tiny_config(3, STEPS, 7, 5, (3, 40_000))
}

/// Mixtral's blocks (RMSNorm, rotary positions, SwiGLU experts, no biases), top-4 of 16 experts
/// and a shared expert, on the same shape.
fn modern() -> TrainConfig {
    let c = config();
    TrainConfig { model: ModelConfig { n_experts: 16, top_k: 4, shared_experts: 1, ..c.model.mixtral() }, ..c }
}

/// Uneven replicas: expert 0 gets an extra replica on rank 0 (two copies there when alone), the
/// others rotate over the ranks, shifted per layer.
fn uneven(world: usize, layers: usize, experts: usize) -> ReplicaMap {
    let layers = (0..layers)
        .map(|l| {
            (0..experts)
                .map(|e| {
                    let mut row = vec![0u32; world];
                    row[(e + l) % world] += 1;
                    if e == 0 {
                        row[0] += 1;
                        row[world - 1] += 1;
                    }
                    row
                })
                .collect()
        })
        .collect();
    ReplicaMap::new(0, layers).unwrap()
}

struct Run {
    losses: Vec<f64>,
    /// Per rank: every tensor that rank holds (shared ones and its experts), by name.
    params: Vec<BTreeMap<String, Vec<f32>>>,
}

fn single(config: TrainConfig) -> (Vec<f64>, BTreeMap<String, Vec<f32>>) {
    let mut t = Trainer::new(config).unwrap();
    let losses = (0..STEPS).map(|_| t.step().unwrap().loss).collect();
    let params =
        t.model.params().iter().map(|(n, v)| (n.to_string(), v.as_tensor().flatten_all().unwrap().to_vec1::<f32>().unwrap())).collect();
    (losses, params)
}

fn held(worker: &Worker, placement: &ReplicaMap, rank: usize) -> BTreeMap<String, Vec<f32>> {
    let model = &worker.trainer.model;
    let mut expert_names = BTreeMap::new();
    let mut local_elements = 0;
    for l in 0..placement.layer_count() {
        for (e, row) in placement.dense_layer(l).iter().enumerate() {
            // A worker keeps the experts placed on it and nothing of the others (also after
            // writing a checkpoint, for which rank 0 takes every expert in).
            assert_eq!(model.expert_resident(l, e).unwrap(), row[rank] > 0, "rank {rank} layer {l} expert {e}");
            for n in model.expert_param_names(l, e) {
                expert_names.insert(n.clone(), row[rank] > 0);
                if row[rank] > 0 {
                    local_elements += model.params().get(&n).unwrap().elem_count();
                }
            }
        }
    }
    assert_eq!(worker.resident_expert_elements(), local_elements);
    model
        .params()
        .iter()
        .filter(|(n, _)| expert_names.get(*n).copied().unwrap_or(true))
        .map(|(n, v)| (n.to_string(), v.as_tensor().flatten_all().unwrap().to_vec1::<f32>().unwrap()))
        .collect()
}

fn distributed(world: usize, placement: ReplicaMap, mode: DispatchMode, checkpoint: Option<std::path::PathBuf>) -> Run {
    distributed_with(config(), world, placement, mode, checkpoint)
}

fn distributed_with(
    config: TrainConfig,
    world: usize,
    placement: ReplicaMap,
    mode: DispatchMode,
    checkpoint: Option<std::path::PathBuf>,
) -> Run {
    let options = WorkerOptions { plan: placement.clone(), mode, timeout: Duration::from_secs(30), device: candle_core::Device::Cpu };
    let transports: Vec<Box<dyn Transport>> = if world == 1 {
        vec![Box::new(LocalTransport::new(0))]
    } else {
        TcpTransport::local_group(world, 0).unwrap().into_iter().map(|t| Box::new(t) as Box<dyn Transport>).collect()
    };
    let handles: Vec<_> = transports
        .into_iter()
        .enumerate()
        .map(|(rank, mut t)| {
            let (options, placement, checkpoint, config) = (options.clone(), placement.clone(), checkpoint.clone(), config.clone());
            std::thread::spawn(move || {
                let mut group = Group::world(world);
                let mut w = Worker::new(config, options, rank, world, None).unwrap();
                let mut losses = Vec::new();
                while !w.done() {
                    losses.push(w.step(t.as_mut(), &mut group).unwrap().report.loss);
                }
                if let Some(dir) = &checkpoint {
                    w.save_checkpoint(t.as_mut(), &mut group, dir).unwrap();
                }
                (losses, held(&w, &placement, rank))
            })
        })
        .collect();
    let mut run = Run { losses: Vec::new(), params: Vec::new() };
    for h in handles {
        let (losses, params) = h.join().unwrap();
        if run.losses.is_empty() {
            run.losses = losses.clone();
        }
        assert_eq!(losses, run.losses, "every rank reports the same global loss");
        run.params.push(params);
    }
    run
}

fn assert_matches(run: &Run, reference: &(Vec<f64>, BTreeMap<String, Vec<f32>>), what: &str) {
    let (losses, params) = reference;
    assert_eq!(run.losses.len(), losses.len());
    for (s, (a, b)) in run.losses.iter().zip(losses).enumerate() {
        assert!((a - b).abs() <= 1e-4 * b.abs(), "{what}: step {} loss {a} vs single-process {b}", s + 1);
    }
    let mut covered = BTreeMap::new();
    for (rank, held) in run.params.iter().enumerate() {
        for (name, v) in held {
            let r = &params[name];
            let worst = v.iter().zip(r).map(|(a, b)| (a - b).abs() as f64).fold(0.0, f64::max);
            assert!(worst <= 1e-4, "{what}: rank {rank} {name} differs by {worst}");
            covered.insert(name.clone(), ());
        }
    }
    assert_eq!(covered.len(), params.len(), "{what}: some tensor is held by no rank");
}

#[test]
fn one_to_four_workers_reproduce_the_single_process_trainer() {
    let reference = single(config());
    assert!(reference.0[STEPS as usize - 1] < reference.0[0], "the reference run learns");
    let layers = config().model.moe_layers();
    for world in 1..=4 {
        let run = distributed(world, uneven(world, layers, 4), DispatchMode::Flexible, None);
        assert_matches(&run, &reference, &format!("{world} workers"));
    }
    let run = distributed(3, uneven(3, layers, 4), DispatchMode::Balanced, None);
    assert_matches(&run, &reference, "3 workers, rank-balanced dispatch");
}

/// Loss-free balancing: each rank routes its share by the same bias and moves it by the step's
/// global loads, so 1 and 3 workers keep the single process's bias (a dense tensor every rank
/// holds) and its losses.
#[test]
fn loss_free_balancing_on_workers_reproduces_the_single_process_trainer() {
    let mut c = config();
    c.model.balance = lazarus_model::config::Balance::Bias;
    c.model.bias_update_rate = 0.01;
    let reference = single(c.clone());
    let bias = &reference.1["blocks.0.moe.gate.bias"];
    assert!(bias.iter().any(|&b| b != 0.0), "the bias moved: {bias:?}");
    let layers = c.model.moe_layers();
    for world in [1, 3] {
        let run = distributed_with(c.clone(), world, uneven(world, layers, 4), DispatchMode::Flexible, None);
        assert_matches(&run, &reference, &format!("loss-free balancing on {world} workers"));
    }
    let run = distributed_with(c.clone(), 3, uneven(3, layers, 4), DispatchMode::Deterministic, None);
    assert_matches(&run, &reference, "loss-free balancing on 3 workers, deterministic");
}

#[test]
fn static_expert_parallel_baseline_reproduces_it_too() {
    let reference = single(config());
    let run = distributed(2, ReplicaMap::static_ep(0, config().model.moe_layers(), 4, 2).unwrap(), DispatchMode::StaticPadded, None);
    assert_matches(&run, &reference, "static EP on 2 workers");
}

#[test]
fn a_checkpoint_written_by_workers_resumes_in_the_single_process_trainer() {
    let reference = single(config());
    let dir = std::env::temp_dir().join(format!("lazarus-worker-ckpt-{}", std::process::id()));
    let _ = std::fs::remove_dir_all(&dir);
    distributed(3, uneven(3, config().model.moe_layers(), 4), DispatchMode::Flexible, Some(dir.clone()));
    let resumed = Trainer::resume(&dir, None).unwrap();
    assert_eq!(resumed.step, STEPS);
    for (name, var) in resumed.model.params().iter() {
        let v = var.as_tensor().flatten_all().unwrap().to_vec1::<f32>().unwrap();
        let worst = v.iter().zip(&reference.1[name]).map(|(a, b)| (a - b).abs()).fold(0.0f32, f32::max);
        assert!(worst <= 1e-4, "{name} differs by {worst} after the round trip");
    }
    let _ = std::fs::remove_dir_all(&dir);
}

#[test]
fn mixtral_blocks_with_top4_of_16_and_a_shared_expert_on_1_and_4_workers() {
    let reference = single(modern());
    assert!(reference.0[STEPS as usize - 1] < reference.0[0], "the reference run learns");
    assert!(reference.1.keys().any(|n| n.contains("moe.shared")) && !reference.1.keys().any(|n| n.ends_with(".b")));
    let layers = modern().model.moe_layers();
    for world in [1, 4] {
        let run = distributed_with(modern(), world, uneven(world, layers, 16), DispatchMode::Flexible, None);
        assert_matches(&run, &reference, &format!("Mixtral blocks on {world} workers"));
    }
}

/// Qwen3-MoE's blocks (Mixtral's with an RMSNorm on each head's queries and keys) with its
/// attention's shape (2 key/value heads for 4 query heads, heads of 12 beside a width of 32,
/// RMSNorm ε 1e-6), top-4 of 16 unnormalised, on 2 workers: the norms' weights are replicated
/// tensors like the others.
#[test]
fn qwen_moe_blocks_on_2_workers() {
    let c = config();
    let model = ModelConfig {
        n_experts: 16,
        top_k: 4,
        normalize_top_k: false,
        n_kv_heads: Some(2),
        head_dim: Some(12),
        norm_eps: 1e-6,
        ..c.model.qwen_moe()
    };
    let reference = one_process_matched_on(TrainConfig { model, ..c }, 2, "Qwen3-MoE blocks on 2 workers");
    assert!(reference.1.contains_key("blocks.0.attn.q_norm.w"));
}

/// Qwen2-MoE's blocks (q/k/v biases, a shared expert behind its gate: replicated tensors like
/// the others), top-2 of 8 unnormalised, on 3 workers.
#[test]
fn qwen2_moe_blocks_on_3_workers() {
    let c = config();
    let qwen2 = TrainConfig { model: ModelConfig { n_experts: 8, top_k: 2, ..c.model.qwen2_moe() }, ..c };
    let reference = one_process_matched_on(qwen2, 3, "Qwen2-MoE blocks on 3 workers");
    assert!(reference.1.contains_key("blocks.0.moe.shared_gate.w") && reference.1.contains_key("blocks.0.attn.qkv.b"));
}

/// DeepSeek-MoE's routing (a sigmoid router, renormalised and scaled, top-2 from the best 2 of 4
/// expert groups, a shared expert) with loss-free balancing, on 3 workers.
#[test]
fn deepseek_moe_routing_on_3_workers() {
    let c = config();
    let mut model = ModelConfig { n_experts: 8, top_k: 2, expert_groups: 4, top_groups: 2, routed_scaling: 2.5, ..c.model.deepseek_moe() };
    model.balance = lazarus_model::config::Balance::Bias;
    model.bias_update_rate = 0.01;
    let reference = one_process_matched_on(TrainConfig { model, ..c }, 3, "DeepSeek-MoE routing on 3 workers");
    assert!(reference.0[STEPS as usize - 1] < reference.0[0], "the reference run learns");
}

/// `config` on `world` workers ([`uneven`]'s placement of its experts) matches its run in one
/// process, which is returned (losses, weights).
fn one_process_matched_on(config: TrainConfig, world: usize, what: &str) -> (Vec<f64>, BTreeMap<String, Vec<f32>>) {
    let reference = single(config.clone());
    let (layers, experts) = (config.model.moe_layers(), config.model.n_experts);
    let run = distributed_with(config, world, uneven(world, layers, experts), DispatchMode::Flexible, None);
    assert_matches(&run, &reference, what);
    reference
}
