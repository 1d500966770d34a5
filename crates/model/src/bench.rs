//! The training benchmark behind `lazarus bench train`: forward+backward throughput of a model,
//! the share of that time spent in expert FFNs, and the achieved GFLOP/s as a ratio to candle's
//! plain matmul GFLOP/s on the same shapes, measured side by side in one run.

use std::time::Instant;

use candle_core::{Device, Tensor, Var};
use serde::Serialize;

use crate::error::Result;
use crate::rng::SplitMix64;
use crate::trainer::{TrainConfig, Trainer};

#[derive(Debug, Clone, Serialize)]
pub struct TrainBenchReport {
    pub parameters: usize,
    pub batch_size: usize,
    pub seq_len: usize,
    pub iterations: usize,
    /// Forward+backward tokens per second.
    pub tokens_per_s: f64,
    /// Seconds per forward+backward (median over rounds).
    pub step_s: f64,
    /// Seconds per step in expert FFNs (forward+backward of the same token counts, alone).
    pub expert_ffn_s: f64,
    pub expert_share: f64,
    /// Matmul FLOPs of one forward+backward (3× the forward's).
    pub flops_per_step: f64,
    pub model_gflops: f64,
    /// candle's matmul alone on every matmul shape of the step, 3× each.
    pub matmul_gflops: f64,
    /// Median over rounds of (matmul time / model time) in the same round: model GFLOP/s as a
    /// share of candle's matmul GFLOP/s.
    pub ratio: f64,
}

/// (batch count, m, k, n): `batch` independent [m×k]·[k×n] products.
type MatmulShape = (usize, usize, usize, usize);

fn flops(shapes: &[MatmulShape]) -> f64 {
    shapes.iter().map(|&(b, m, k, n)| 2.0 * (b * m * k * n) as f64).sum()
}

fn median(v: &mut [f64]) -> f64 {
    v.sort_by(f64::total_cmp);
    match v.len() {
        0 => f64::NAN,
        n if n % 2 == 1 => v[n / 2],
        n => 0.5 * (v[n / 2 - 1] + v[n / 2]),
    }
}

fn random(shape: &[usize], rng: &mut SplitMix64, device: &Device) -> Result<Tensor> {
    let n: usize = shape.iter().product();
    let v: Vec<f32> = (0..n).map(|_| rng.normal() as f32 * 0.1).collect();
    Ok(Tensor::from_vec(v, shape, device)?)
}

pub fn train_benchmark(config: &TrainConfig, warmup: usize, iterations: usize) -> Result<TrainBenchReport> {
    let mut trainer = Trainer::new(config.clone())?;
    let device = trainer.model.device().clone();
    let (b, t) = (config.batch_size, config.seq_len);
    let mc = config.model.clone();
    let (d, f, e, v, h) = (mc.d_model, mc.d_ff, mc.n_experts, mc.vocab_size, mc.n_heads);
    for _ in 0..warmup.max(1) {
        trainer.step()?;
    }
    // The expert token counts of one real forward pass fix the expert shapes.
    let probe = trainer.sampler.next_batch(b);
    let x = Tensor::from_vec(probe.inputs, (b, t), &device)?;
    let y = Tensor::from_vec(probe.targets, (b, t), &device)?;
    let loads: Vec<Vec<u64>> = trainer.model.forward(&x, &y, None)?.moe.iter().map(|m| m.load.clone()).collect();

    let mut rng = SplitMix64::new(11);
    // Expert FFN inputs: (layer, expert, x).
    let mut expert_inputs = Vec::new();
    let mut expert_shapes: Vec<MatmulShape> = Vec::new();
    for (layer, layer_loads) in loads.iter().enumerate() {
        for (expert, &n) in layer_loads.iter().enumerate() {
            if n == 0 {
                continue;
            }
            let n = n as usize;
            expert_shapes.push((1, n, d, f));
            expert_shapes.push((1, n, f, d));
            expert_inputs.push((layer, expert, Var::from_tensor(&random(&[n, d], &mut rng, &device)?)?));
        }
    }

    // Every matmul of one forward pass.
    let n_tok = b * t;
    let mut shapes: Vec<MatmulShape> = Vec::new();
    for block in 0..mc.n_layers {
        shapes.push((1, n_tok, d, 3 * d));
        shapes.push((b * h, t, d / h, t));
        shapes.push((b * h, t, t, d / h));
        shapes.push((1, n_tok, d, d));
        if mc.is_moe(block) {
            shapes.push((1, n_tok, d, e));
        } else {
            shapes.push((1, n_tok, d, f));
            shapes.push((1, n_tok, f, d));
        }
    }
    shapes.push((1, n_tok, d, v));
    shapes.extend_from_slice(&expert_shapes);
    let step_flops = 3.0 * flops(&shapes);
    let mut operands = Vec::with_capacity(shapes.len());
    for &(bb, m, k, n) in &shapes {
        operands.push(if bb == 1 {
            (random(&[m, k], &mut rng, &device)?, random(&[k, n], &mut rng, &device)?)
        } else {
            (random(&[bb, m, k], &mut rng, &device)?, random(&[bb, k, n], &mut rng, &device)?)
        });
    }

    // Rounds interleave the three measurements so that a slow spell of this (shared, noisy)
    // machine hits all of them alike; each figure is the median over rounds.
    let (mut step_times, mut expert_times, mut matmul_times) = (Vec::new(), Vec::new(), Vec::new());
    for _ in 0..iterations {
        // Forward+backward of the whole model on a real batch.
        let batch = trainer.sampler.next_batch(b);
        let x = Tensor::from_vec(batch.inputs, (b, t), &device)?;
        let y = Tensor::from_vec(batch.targets, (b, t), &device)?;
        let start = Instant::now();
        let out = trainer.model.forward(&x, &y, None)?;
        let grads = out.loss.backward()?;
        step_times.push(start.elapsed().as_secs_f64());
        drop(grads);

        // Expert FFNs alone, forward+backward, with the token counts measured above.
        let start = Instant::now();
        for (layer, expert, xin) in &expert_inputs {
            let names = trainer.model.expert_param_names(*layer, *expert);
            let p = |i: usize| trainer.model.params().get(&names[i]).expect("expert tensor").as_tensor().clone();
            let y = crate::ops::expert_ffn(xin.as_tensor(), &p(0), &p(1), &p(2), &p(3))?;
            drop(y.sum_all()?.backward()?);
        }
        expert_times.push(start.elapsed().as_secs_f64());

        // The same matmul shapes through candle's matmul alone, 3× each (forward, and the two
        // backward products have the same FLOPs).
        let start = Instant::now();
        for (a, c) in &operands {
            for _ in 0..3 {
                drop(a.matmul(c)?);
            }
        }
        matmul_times.push(start.elapsed().as_secs_f64());
    }
    // The ratio is taken per round (same spell of the machine for both) and then the median.
    let mut ratios: Vec<f64> = matmul_times.iter().zip(&step_times).map(|(m, s)| m / s).collect();
    let ratio = median(&mut ratios);
    let step_s = median(&mut step_times);
    let expert_s = median(&mut expert_times);
    let mm_s = median(&mut matmul_times);
    let model_gflops = step_flops / step_s / 1e9;
    let matmul_gflops = step_flops / mm_s / 1e9;
    Ok(TrainBenchReport {
        parameters: trainer.model.params().num_elements(),
        batch_size: b,
        seq_len: t,
        iterations,
        tokens_per_s: (b * t) as f64 / step_s,
        step_s,
        expert_ffn_s: expert_s,
        expert_share: expert_s / step_s,
        flops_per_step: step_flops,
        model_gflops,
        matmul_gflops,
        ratio,
    })
}
