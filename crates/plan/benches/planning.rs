//! Planning-core benchmarks: a DeepSeek-V3-like job and the dispatch schedule.
//!
//! * `deepseek_v3_like/all_layers`: 58 MoE layers × 256 experts on 128 nodes × 8 GPUs × 4 slots,
//!   skewed loads: allocation + placement + the full recovery curve (k = 0..127) of every layer.
//!   Target < 50 ms on one core.
//! * `deepseek_v3_like/model_curve`: the whole model's recovery curve over the same 58 layers as
//!   the trainer plans them (with the throughput guard, whose placements share nodes across
//!   layers irregularly: too large to count exactly, so sampled).
//! * `dispatch/64x256`: Algorithm 1's schedule for 64 ranks × 256 experts. Target < 1 ms.

use criterion::{black_box, criterion_group, criterion_main, Criterion};
use lazarus_plan::{allocate, place, plan_model, recovery_curve, ClusterShape, DispatchSchedule, PlanPolicy, Strategy};

struct Lcg(u64);
impl Lcg {
    fn next(&mut self) -> f64 {
        self.0 = self.0.wrapping_mul(6364136223846793005).wrapping_add(1442695040888963407);
        (self.0 >> 11) as f64 / (1u64 << 53) as f64
    }
}

/// Zipf(1.0)-like loads in a random expert order, different per layer.
fn skewed_loads(layer: u64, experts: usize, tokens: f64) -> Vec<f64> {
    let mut rng = Lcg(0x1a2a_0000 + layer);
    let weights: Vec<f64> = (1..=experts).map(|k| 1.0 / k as f64).collect();
    let total: f64 = weights.iter().sum();
    let mut loads: Vec<f64> = weights.iter().map(|w| (w / total * tokens).round()).collect();
    for i in (1..experts).rev() {
        let j = (rng.next() * (i + 1) as f64) as usize;
        loads.swap(i, j);
    }
    loads
}

fn plan_all_layers(layers: &[Vec<f64>], shape: ClusterShape) -> f64 {
    let mut worst = 1.0f64;
    for loads in layers {
        let alloc = allocate(loads, shape.total_slots(), 2).unwrap();
        let p = place(&alloc.replicas, shape, Strategy::Lazarus, Some(loads)).unwrap();
        let curve = recovery_curve(&p);
        worst = worst.min(curve[8].probability);
    }
    worst
}

fn bench_deepseek(c: &mut Criterion) {
    let shape = ClusterShape::new(128, 8, 4).unwrap();
    let layers: Vec<Vec<f64>> = (0..58).map(|l| skewed_loads(l, 256, 4096.0 * 8.0 * 2.0 * 128.0)).collect();
    c.bench_function("deepseek_v3_like/all_layers", |b| b.iter(|| plan_all_layers(black_box(&layers), shape)));
    let model = plan_model(&layers, shape, &PlanPolicy::trainer_default(shape.nodes), None).unwrap();
    assert!(model.recovery_curve().iter().any(|r| r.ci95.is_some()), "the bench measures the sampler");
    c.bench_function("deepseek_v3_like/model_curve", |b| b.iter(|| black_box(&model).recovery_curve()[8].probability));
}

fn bench_dispatch(c: &mut Criterion) {
    // 16 nodes × 4 GPUs × 8 slots = 64 ranks, 512 replicas of 256 experts.
    let shape = ClusterShape::new(16, 4, 8).unwrap();
    let loads = skewed_loads(7, 256, 64.0 * 8192.0);
    let alloc = allocate(&loads, shape.total_slots(), 1).unwrap();
    let placement = place(&alloc.replicas, shape, Strategy::Lazarus, Some(&loads)).unwrap();
    let replicas = placement.rank_replicas();
    let mut rng = Lcg(99);
    // Each rank routes 8192 token-slots (4096 tokens, top-2) with its own noisy view of the loads.
    let tokens: Vec<Vec<u64>> = loads.iter().map(|&l| (0..64).map(|_| (l / 64.0 * (0.5 + rng.next())).round() as u64).collect()).collect();
    c.bench_function("dispatch/64x256", |b| b.iter(|| DispatchSchedule::compute(black_box(&tokens), black_box(&replicas)).unwrap()));
}

criterion_group! {
    name = benches;
    config = Criterion::default().sample_size(20).measurement_time(std::time::Duration::from_secs(4));
    targets = bench_deepseek, bench_dispatch
}
criterion_main!(benches);
