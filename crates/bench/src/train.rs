//! The training benchmark behind `lazarus bench train`: tokens/s of full training steps
//! (forward, backward, clipping, AdamW — what `lazarus train` runs), the share of a step spent in
//! expert FFNs, and the achieved matmul GFLOP/s against the machine's measured GEMM peak. The
//! side-by-side run of PyTorch is the CLI's (it starts a process).

use std::collections::BTreeMap;
use std::time::{Duration, Instant};

use candle_core::{Device, Tensor, Var};
use serde::Serialize;

use lazarus_model::profile;
use lazarus_model::rng::SplitMix64;
use lazarus_model::{Result, TrainConfig, Trainer};

#[derive(Debug, Clone, Serialize)]
pub struct TrainBenchReport {
    /// Where the step ran: `cpu` or `cuda:N`.
    pub device: String,
    pub parameters: usize,
    pub batch_size: usize,
    pub seq_len: usize,
    pub iterations: usize,
    /// Cores the step is spread over.
    pub threads: usize,
    /// Tokens per second of full training steps.
    pub tokens_per_s: f64,
    /// Seconds per full training step (median over the measured steps).
    pub step_s: f64,
    /// Seconds per step in expert FFNs: forward+backward of the same token counts alone, each
    /// layer's experts as the one grouped node the step runs them in.
    pub expert_ffn_s: f64,
    pub expert_share: f64,
    /// Matmul FLOPs of one forward+backward (3× the forward's).
    pub flops_per_step: f64,
    pub model_gflops: f64,
    /// The device's GEMM peak in the step's product type (`peak_dtype`) as measured here: on the
    /// CPU an f32 1024³ product on every core, on a GPU an f32 4096³ or a bf16 8192³ product
    /// through candle (cuBLAS); best of 3.
    pub peak_gflops: f64,
    /// `f32`, or `bf16` for a mixed-precision step on a GPU.
    pub peak_dtype: String,
    /// `model_gflops / peak_gflops`: the model FLOP utilisation of the device.
    pub utilisation: f64,
    /// On a GPU: its memory at the end (the peak is what the run needs).
    #[serde(skip_serializing_if = "Option::is_none")]
    pub gpu_memory: Option<lazarus_model::device::GpuMemory>,
    /// On a GPU: bytes in use after each measured step (flat when a step leaves nothing behind).
    #[serde(skip_serializing_if = "Vec::is_empty")]
    pub gpu_used_after_step: Vec<u64>,
    /// Where a step's time went (`--profile`): see [`lazarus_model::profile`].
    #[serde(skip_serializing_if = "Vec::is_empty")]
    pub profile: Vec<ProfileRow>,
    /// On a GPU: kernel launches per step (candle's and Lazarus's).
    #[serde(skip_serializing_if = "Option::is_none")]
    pub launches_per_step: Option<f64>,
    /// On a GPU: cuBLAS matrix products per step.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub gemms_per_step: Option<f64>,
    /// Whether the step ran Lazarus's GPU kernels (false: candle's composite ops,
    /// `LAZARUS_GPU_KERNELS=composite`, or the CPU).
    pub gpu_kernels: bool,
}

/// One scope of the step's profile, per step (the mean over the measured steps).
#[derive(Debug, Clone, Serialize)]
pub struct ProfileRow {
    /// `step` for the whole step; else forward, backward, grad-norm, adamw.
    pub phase: String,
    /// A fused kernel's pass, `(phase)` for the whole phase, `(outside kernels)` for the rest of
    /// it (candle's own ops and autograd), `(outside phases)` for the step's rest.
    pub scope: String,
    pub calls_per_step: f64,
    /// Wall seconds per step.
    pub wall_s: f64,
    /// The calling thread's CPU seconds per step: serial work, which more cores cannot shorten.
    pub serial_s: f64,
    /// The process's CPU time over the wall time: cores busy on average.
    pub busy_cores: f64,
    /// Device seconds per step between the scope's CUDA events (0 off a GPU).
    pub gpu_s: f64,
}

/// The profile rows of `steps` measured steps from per-step totals keyed by (phase, kernel), and
/// the whole steps' own totals (see [`lazarus_model::profile`]).
fn profile_rows(totals: &BTreeMap<(&'static str, &'static str), profile::Totals>, whole: profile::Totals, steps: usize) -> Vec<ProfileRow> {
    let per_step = |d: Duration| d.as_secs_f64() / steps.max(1) as f64;
    let row = |phase: &str, scope: &str, t: &profile::Totals| ProfileRow {
        phase: phase.to_string(),
        scope: scope.to_string(),
        calls_per_step: t.calls as f64 / steps.max(1) as f64,
        wall_s: per_step(t.wall),
        serial_s: per_step(t.thread_cpu),
        busy_cores: if t.wall.is_zero() { 0.0 } else { t.process_cpu.as_secs_f64() / t.wall.as_secs_f64() },
        gpu_s: per_step(t.gpu),
    };
    let mut rows = vec![row("step", "(step)", &whole)];
    let phases: Vec<&str> = totals.keys().filter(|(_, k)| *k == profile::WHOLE_PHASE).map(|(p, _)| *p).collect();
    for phase in &phases {
        let whole_phase = totals[&(*phase, profile::WHOLE_PHASE)];
        rows.push(row(phase, "(phase)", &whole_phase));
        let kernels: Vec<_> = totals.iter().filter(|((p, k), _)| p == phase && *k != profile::WHOLE_PHASE).collect();
        let in_kernels = kernels.iter().fold(profile::Totals::default(), |a, (_, t)| a.plus(**t));
        for ((_, k), t) in kernels {
            rows.push(row(phase, k, t));
        }
        rows.push(row(phase, "(outside kernels)", &whole_phase.minus(in_kernels)));
    }
    let in_phases = phases.iter().fold(profile::Totals::default(), |a, p| a.plus(totals[&(*p, profile::WHOLE_PHASE)]));
    rows.push(row("step", "(outside phases)", &whole.minus(in_phases)));
    rows
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

/// f32 GEMM GFLOP/s of a `n`³ product on every core (best of `reps`): the peak the model's
/// GFLOP/s is measured against.
pub fn gemm_peak_gflops(n: usize, reps: usize) -> f64 {
    let a: Vec<f32> = (0..n * n).map(|i| ((i % 7) as f32 - 3.0) * 0.1).collect();
    let b = a.clone();
    let mut c = vec![0f32; n * n];
    let mut best = f64::INFINITY;
    for _ in 0..reps.max(1) {
        let start = Instant::now();
        // SAFETY: a, b and c are n×n row-major and distinct.
        unsafe {
            gemm::gemm(
                n,
                n,
                n,
                c.as_mut_ptr(),
                1,
                n as isize,
                false,
                a.as_ptr(),
                1,
                n as isize,
                b.as_ptr(),
                1,
                n as isize,
                0.0,
                1.0,
                false,
                false,
                false,
                gemm::Parallelism::Rayon(0),
            )
        };
        best = best.min(start.elapsed().as_secs_f64());
    }
    std::hint::black_box(&c);
    2.0 * (n * n * n) as f64 / best / 1e9
}

/// GEMM GFLOP/s of an `n`³ product of `dtype` through candle on `device` (best of `reps`; the
/// GPU's peak the model is measured against; the CPU's is f32).
pub fn device_peak_gflops(device: &Device, n: usize, reps: usize, dtype: candle_core::DType) -> Result<f64> {
    if device.is_cpu() {
        return Ok(gemm_peak_gflops(n, reps));
    }
    let mut rng = SplitMix64::new(5);
    let (a, b) = (random(&[n, n], &mut rng, device)?.to_dtype(dtype)?, random(&[n, n], &mut rng, device)?.to_dtype(dtype)?);
    drop(a.matmul(&b)?);
    device.synchronize()?;
    let mut best = f64::INFINITY;
    for _ in 0..reps.max(1) {
        let start = Instant::now();
        let c = a.matmul(&b)?;
        device.synchronize()?;
        best = best.min(start.elapsed().as_secs_f64());
        drop(c);
    }
    Ok(2.0 * (n * n * n) as f64 / best / 1e9)
}

/// The training benchmark on `device` (see [`lazarus_model::device::parse`]); with `with_profile`, where
/// each step's time went ([`lazarus_model::profile`]).
pub fn train_benchmark(
    config: &TrainConfig,
    device: &Device,
    warmup: usize,
    iterations: usize,
    with_profile: bool,
) -> Result<TrainBenchReport> {
    let mut trainer = Trainer::new_on(config.clone(), device)?;
    let device = trainer.model.device().clone();
    let (b, t) = (config.batch_size, config.seq_len);
    let mc = config.model.clone();
    let (d, f) = (mc.d_model, mc.d_ff);
    for _ in 0..warmup.max(1) {
        trainer.step()?;
    }
    // The expert token counts of one real forward pass fix the expert shapes.
    let probe = trainer.sampler.peek_batch(b)?;
    let x = Tensor::from_vec(probe.inputs, (b, t), &device)?;
    let y = Tensor::from_vec(probe.targets, (b, t), &device)?;
    let loads: Vec<Vec<u64>> = trainer.model.forward(&x, &y, None)?.moe.iter().map(|m| m.load.clone()).collect();

    let (expert_inputs, expert_flops) = expert_rows(&loads, d, f, &device)?;
    let step_flops = 3.0 * (flops(&forward_matmuls(&mc, b, t)) + expert_flops);

    // Rounds interleave the two measurements so that a slow spell of this (shared, noisy)
    // machine hits both alike; each figure is the median over rounds.
    let (mut step_times, mut expert_times, mut used_after_step) = (Vec::new(), Vec::new(), Vec::new());
    let (mut totals, mut whole) = (BTreeMap::new(), profile::Totals::default());
    let (mut launches, mut gemms) = (0u64, 0u64);
    #[cfg(feature = "cuda")]
    if let (true, Device::Cuda(d)) = (with_profile, &device) {
        profile::enable_gpu(Some(d.cuda_stream()));
    }
    for _ in 0..iterations {
        // One full training step, as `lazarus train` runs it (on a GPU: timed to its end).
        profile::enable(with_profile);
        device.synchronize()?;
        let (l0, g0) = profile::launches();
        let step_scope = profile::phase("step");
        let start = Instant::now();
        let stepped = trainer.step();
        device.synchronize()?;
        step_times.push(start.elapsed().as_secs_f64());
        drop(step_scope);
        let (l1, g1) = profile::launches();
        (launches, gemms) = (launches + (l1 - l0), gemms + (g1 - g0));
        if let Err(e) = stepped {
            profile::enable(false);
            return Err(e);
        }
        for ((phase, kernel), t) in profile::totals() {
            let acc: &mut profile::Totals =
                if (phase, kernel) == ("step", profile::WHOLE_PHASE) { &mut whole } else { totals.entry((phase, kernel)).or_default() };
            *acc = acc.plus(t);
        }
        profile::enable(false);
        used_after_step.extend(lazarus_model::device::gpu_memory(&device).map(|m| m.used));

        expert_times.push(time_experts(&trainer, &expert_inputs, &device)?);
    }
    #[cfg(feature = "cuda")]
    profile::enable_gpu(None);
    let step_s = median(&mut step_times);
    let expert_s = median(&mut expert_times);
    let model_gflops = step_flops / step_s / 1e9;
    let bf16 = config.dtype == lazarus_model::Precision::Bf16 && !device.is_cpu();
    let (peak_n, peak_dtype) = match (device.is_cpu(), bf16) {
        (true, _) => (1024, candle_core::DType::F32),
        (false, false) => (4096, candle_core::DType::F32),
        (false, true) => (8192, candle_core::DType::BF16),
    };
    let peak_gflops = device_peak_gflops(&device, peak_n, 3, peak_dtype)?;
    let per_step = |c: u64| (!device.is_cpu()).then_some(c as f64 / iterations.max(1) as f64);
    Ok(TrainBenchReport {
        device: lazarus_model::device::name(&device),
        parameters: trainer.model.params().num_elements(),
        batch_size: b,
        seq_len: t,
        iterations,
        threads: lazarus_model::ops::threads(),
        tokens_per_s: (b * t) as f64 / step_s,
        step_s,
        expert_ffn_s: expert_s,
        expert_share: expert_s / step_s,
        flops_per_step: step_flops,
        model_gflops,
        peak_gflops,
        peak_dtype: if bf16 { "bf16" } else { "f32" }.into(),
        utilisation: model_gflops / peak_gflops,
        gpu_memory: lazarus_model::device::gpu_memory(&device),
        gpu_used_after_step: used_after_step,
        profile: if with_profile { profile_rows(&totals, whole, iterations) } else { Vec::new() },
        launches_per_step: per_step(launches),
        gemms_per_step: per_step(gemms),
        gpu_kernels: trainer.model.gpu_kernels(),
    })
}

/// One MoE layer's expert rows, grouped by expert as the step groups them: (layer, each
/// expert's rows, the rows as one input).
type ExpertInput = (usize, Vec<usize>, Var);

/// Random rows for each MoE layer's experts in the counts of one real forward pass (`loads`),
/// and the flops of their forward.
fn expert_rows(loads: &[Vec<u64>], d: usize, f: usize, device: &Device) -> Result<(Vec<ExpertInput>, f64)> {
    let mut rng = SplitMix64::new(11);
    let mut inputs = Vec::new();
    let mut expert_flops = 0.0;
    for (layer, layer_loads) in loads.iter().enumerate() {
        let counts: Vec<usize> = layer_loads.iter().map(|&n| n as usize).collect();
        let rows: usize = counts.iter().sum();
        expert_flops += counts.iter().map(|&n| flops(&[(1, n, d, f), (1, n, f, d)])).sum::<f64>();
        inputs.push((layer, counts, Var::from_tensor(&random(&[rows, d], &mut rng, device)?)?));
    }
    Ok((inputs, expert_flops))
}

/// Every matmul of one forward pass of model `mc` on a batch of `b` sequences of `t` tokens,
/// the experts' aside.
fn forward_matmuls(mc: &lazarus_model::ModelConfig, b: usize, t: usize) -> Vec<MatmulShape> {
    let (d, e, v, h) = (mc.d_model, mc.n_experts, mc.vocab_size, mc.n_heads);
    let n_tok = b * t;
    let mut shapes: Vec<MatmulShape> = Vec::new();
    for block in 0..mc.n_layers {
        let hd = mc.head_width();
        // The projections in, then scores and values over heads of their width.
        let head = match &mc.latent_attention {
            None => {
                shapes.push((1, n_tok, d, mc.qkv_width()));
                hd
            }
            Some(la) => {
                // Latent attention: heads of head width + rotary part (the values padded to it).
                let qk = hd + la.rope_dim;
                match la.q_rank {
                    Some(q) => shapes.extend([(1, n_tok, d, q), (1, n_tok, q, h * qk)]),
                    None => shapes.push((1, n_tok, d, h * qk)),
                }
                shapes.extend([(1, n_tok, d, la.kv_rank + la.rope_dim), (1, n_tok, la.kv_rank, h * 2 * hd)]);
                qk
            }
        };
        shapes.push((b * h, t, head, t));
        shapes.push((b * h, t, t, head));
        shapes.push((1, n_tok, mc.attention_width(), d));
        if mc.is_moe(block) {
            shapes.push((1, n_tok, d, e));
        } else {
            let f = mc.dense_width();
            shapes.push((1, n_tok, d, f));
            shapes.push((1, n_tok, f, d));
        }
    }
    shapes.push((1, n_tok, d, v));
    shapes
}

/// Expert FFNs alone, forward+backward, each layer's experts as the one node the step runs them
/// in, with the token counts measured: the seconds they took.
fn time_experts(trainer: &Trainer, inputs: &[ExpertInput], device: &Device) -> Result<f64> {
    let start = Instant::now();
    for (layer, counts, xin) in inputs {
        let weights: Vec<[Tensor; 4]> = (0..counts.len())
            .map(|expert| {
                let vars = trainer.model.expert_vars(*layer, expert)?;
                let refs: Vec<&Tensor> = vars.iter().map(|v| v.as_tensor()).collect();
                Ok(lazarus_model::ops::ffn_weights(&refs)?)
            })
            .collect::<Result<_>>()?;
        let refs: Vec<[&Tensor; 4]> = weights.iter().map(|w| w.each_ref()).collect();
        let sink = lazarus_model::ops::WeightGradSink::new();
        let act = trainer.model.expert_act();
        let y = lazarus_model::ops::grouped_expert_ffn_to_sink(xin.as_tensor(), &refs, counts, act, &sink)?;
        let mut grads = y.sum_all()?.backward()?;
        sink.drain_into(&mut grads)?;
    }
    device.synchronize()?;
    Ok(start.elapsed().as_secs_f64())
}

#[cfg(test)]
mod tests {
    use super::*;
    use lazarus_model::ModelConfig;

    #[test]
    fn the_profile_splits_each_step_into_phases_and_kernels_that_add_up() {
        let mut config = TrainConfig { batch_size: 2, seq_len: 8, ..TrainConfig::default() };
        config.model = ModelConfig { d_model: 16, d_ff: 32, n_heads: 2, n_layers: 2, n_experts: 4, ..config.model };
        let plain = train_benchmark(&config, &Device::Cpu, 1, 2, false).unwrap();
        assert!(plain.profile.is_empty(), "no profile unless asked");
        let r = train_benchmark(&config, &Device::Cpu, 1, 2, true).unwrap();
        let find = |phase: &str, scope: &str| r.profile.iter().find(|p| p.phase == phase && p.scope == scope);
        let step = find("step", "(step)").expect("the whole step");
        assert_eq!(r.profile[0].scope, "(step)");
        let phases: Vec<&ProfileRow> = r.profile.iter().filter(|p| p.scope == "(phase)").collect();
        let names: Vec<&str> = phases.iter().map(|p| p.phase.as_str()).collect();
        assert_eq!(names, ["adamw", "backward", "batch", "forward", "grad-norm", "release"]);
        let rest = find("step", "(outside phases)").unwrap();
        let sum: f64 = phases.iter().map(|p| p.wall_s).sum::<f64>() + rest.wall_s;
        assert!((sum - step.wall_s).abs() <= 1e-6 * step.wall_s.max(1.0), "{sum} vs {}", step.wall_s);
        // Each MoE layer's grouped expert node, once a step forward and once backward.
        for scope in ["grouped-expert-ffn-to-sink.fwd", "grouped-expert-ffn-to-sink.bwd"] {
            let phase = if scope.ends_with("fwd") { "forward" } else { "backward" };
            assert_eq!(find(phase, scope).map(|p| p.calls_per_step), Some(2.0), "{scope}: {:?}", r.profile);
        }
        for phase in &phases {
            let kernels: Vec<&ProfileRow> = r.profile.iter().filter(|p| p.phase == phase.phase && p.scope != "(phase)").collect();
            let wall: f64 = kernels.iter().map(|p| p.wall_s).sum();
            assert!((wall - phase.wall_s).abs() <= 1e-6 * phase.wall_s.max(1.0), "{}: kernels + outside = phase", phase.phase);
            for p in kernels {
                assert!(p.wall_s >= 0.0 && p.serial_s >= 0.0 && p.busy_cores >= 0.0, "{p:?}");
            }
        }
        assert!(step.serial_s > 0.0 && step.serial_s <= step.wall_s * 1.05 + 1e-3, "serial work is part of the step: {step:?}");
    }
}
