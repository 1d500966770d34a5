//! `lazarus bench train`: tokens/s of full training steps of the model, its matmul GFLOP/s
//! against the machine's measured GEMM peak, and — when PyTorch can be imported — the same model
//! trained by PyTorch eager on the same cores in the same run (`torch_moe.py`, embedded), with the
//! ratio.

use std::fmt::Write as _;
use std::io::Write as _;
use std::process::{Command, Stdio};

use anyhow::{bail, Context, Result};
use clap::Args;
use lazarus_bench::train::TrainBenchReport;
use lazarus_model::TrainConfig;
use serde::{Deserialize, Serialize};

use super::args::{build_config, ModelArgs, TrainArgs};

/// The PyTorch peer: the default model's shape with a per-expert loop, as a PyTorch user writes it.
const TORCH_MOE_PY: &str = include_str!("torch_moe.py");

#[derive(Args, Debug)]
pub struct BenchTrainArgs {
    /// Model and batch settings, as for `lazarus train` (defaults: the default model, 16 x 128).
    #[command(flatten)]
    model: ModelArgs,
    /// Measured full training steps (after 2 warm-up steps).
    #[arg(long, default_value_t = 10)]
    iters: usize,
    /// Python interpreter for the PyTorch peer (skipped, with the reason, if it cannot import torch).
    #[arg(long, default_value = "python3")]
    python: String,
    /// Do not run the PyTorch peer.
    #[arg(long)]
    no_torch: bool,
    /// Also report where a step's time goes: each phase (forward, backward, gradient norm, AdamW)
    /// and fused kernel with its wall time, its serial work (the calling thread's CPU time) and
    /// the cores busy meanwhile.
    #[arg(long)]
    profile: bool,
    #[arg(long)]
    json: bool,
}

/// What the PyTorch peer printed (its last line, JSON).
#[derive(Debug, Clone, Serialize, Deserialize)]
pub struct TorchReport {
    /// "pytorch" (the embedded peer's own model) or "transformers-mixtral" (transformers'
    /// MixtralForCausalLM, for a model with Mixtral's options where transformers is importable).
    #[serde(default = "pytorch")]
    pub system: String,
    pub threads: usize,
    pub params: usize,
    pub tokens_per_s: f64,
    pub step_s: f64,
}

fn pytorch() -> String {
    "pytorch".into()
}

#[derive(Debug, Serialize)]
struct BenchTrainOutput {
    lazarus: TrainBenchReport,
    pytorch: Option<TorchReport>,
    /// Why PyTorch did not run, when it did not.
    pytorch_skipped: Option<String>,
    /// Lazarus tokens/s over PyTorch's.
    ratio_vs_pytorch: Option<f64>,
}

pub fn run_bench_train(args: &BenchTrainArgs) -> Result<()> {
    if args.iters == 0 {
        bail!("invalid --iters: 0 (must be at least 1)");
    }
    if args.iters > 10_000 {
        bail!("invalid --iters: {} (at most 10000)", args.iters);
    }
    // Its flags are the model's and its own: it runs 2 + --iters steps of a fresh model in this
    // process and keeps nothing.
    let config = build_config(&TrainArgs::of_model(args.model.clone(), None))?;
    if let Some(dir) = &config.checkpoint_dir {
        bail!("checkpoint_dir {} in --config does not apply to bench train (it writes nothing)", dir.display());
    }
    // The same memory estimate `train` makes, before anything is allocated.
    super::args::check_fits(&config, 1)?;
    let device = lazarus_model::device::parse(args.model.device.as_deref().unwrap_or("cpu"))?;
    let r = lazarus_bench::train::train_benchmark(&config, &device, 2, args.iters, args.profile)?;
    let (pytorch, pytorch_skipped) = match args.no_torch {
        true => (None, Some("--no-torch".to_string())),
        false => match run_torch(&args.python, &config, &r.device, r.threads, args.iters) {
            Ok(t) => (Some(t), None),
            Err(e) => (None, Some(format!("{e:#}"))),
        },
    };
    let ratio_vs_pytorch = pytorch.as_ref().map(|t| r.tokens_per_s / t.tokens_per_s);
    let out = BenchTrainOutput { lazarus: r, pytorch, pytorch_skipped, ratio_vs_pytorch };
    if args.json {
        crate::io::println(&serde_json::to_string(&out)?)?;
        return Ok(());
    }
    let r = &out.lazarus;
    let mut s = String::new();
    let _ = writeln!(
        s,
        "model            {:.2}M parameters, batch {} x {} tokens, {} full steps on {}",
        r.parameters as f64 / 1e6,
        r.batch_size,
        r.seq_len,
        r.iterations,
        if r.device == "cpu" { format!("{} cores", r.threads) } else { r.device.clone() }
    );
    let _ = writeln!(s, "training step    {:.0} tokens/s ({:.3} s per step: forward, backward, clipping, AdamW)", r.tokens_per_s, r.step_s);
    let _ = writeln!(s, "expert FFNs      {:.3} s per step = {:.0}% of a step", r.expert_ffn_s, 100.0 * r.expert_share);
    let _ = writeln!(
        s,
        "achieved         {:.1} GFLOP/s = {:.0}% of this device's measured {} GEMM peak ({:.1} GFLOP/s; matmul FLOPs {:.2e} per step)",
        r.model_gflops,
        100.0 * r.utilisation,
        r.peak_dtype,
        r.peak_gflops,
        r.flops_per_step
    );
    if let (Some(l), Some(g)) = (r.launches_per_step, r.gemms_per_step) {
        let path = if r.gpu_kernels { "Lazarus's GPU kernels" } else { "candle's composite ops" };
        let _ = writeln!(s, "launches         {l:.0} kernels and {g:.0} cuBLAS products per step ({path})");
    }
    if !r.profile.is_empty() {
        let gpu = r.device != "cpu";
        let _ = writeln!(
            s,
            "profile          per step, mean over the measured steps; serial = the calling thread's CPU time{}",
            if gpu { "; gpu = device time between CUDA events (phases synchronised)" } else { "" }
        );
        let _ = writeln!(
            s,
            "  {:<11} {:<34} {:>6} {:>9} {:>7} {:>9} {:>6}{}",
            "phase",
            "scope",
            "calls",
            "wall ms",
            "share",
            "serial ms",
            "cores",
            if gpu { format!(" {:>9}", "gpu ms") } else { String::new() }
        );
        let step = r.profile.first().map_or(f64::NAN, |p| p.wall_s);
        for p in &r.profile {
            let _ = writeln!(
                s,
                "  {:<11} {:<34} {:>6.0} {:>9.2} {:>6.1}% {:>9.2} {:>6.1}",
                p.phase,
                p.scope,
                p.calls_per_step,
                1e3 * p.wall_s,
                100.0 * p.wall_s / step,
                1e3 * p.serial_s,
                p.busy_cores
            );
            if gpu {
                s.pop();
                let _ = writeln!(s, " {:>9.2}", 1e3 * p.gpu_s);
            }
        }
    }
    if let Some(m) = &r.gpu_memory {
        let _ = writeln!(s, "GPU memory       {m}");
    }
    match (&out.pytorch, &out.pytorch_skipped, out.ratio_vs_pytorch) {
        (Some(t), _, Some(ratio)) => {
            let what = if t.system == "transformers-mixtral" { "transformers' MixtralForCausalLM" } else { "same model shape" };
            let _ =
                writeln!(s, "PyTorch eager    {:.0} tokens/s ({:.3} s per step, {} threads), {what}", t.tokens_per_s, t.step_s, t.threads);
            let goal = if r.device == "cpu" { "goal >= 1.0 on 2 cores, >= 0.8 on 16" } else { "goal >= 1.0" };
            let _ = writeln!(
                s,
                "ratio            {ratio:.2} of PyTorch's tokens/s on the same {} ({goal})",
                if r.device == "cpu" { "cores" } else { "GPU" }
            );
        }
        (_, Some(why), _) => {
            let _ = writeln!(s, "PyTorch eager    not run: {why}");
        }
        _ => {}
    }
    crate::io::print(&s)?;
    Ok(())
}

/// Why the PyTorch peer cannot train this configuration, if it cannot: it has the default
/// model's structure (byte vocabulary, an MoE in every block, dropless routing) with Lazarus's
/// block options (norm, positions, activation, biases, top-k, shared experts), but one flag for
/// both kinds of bias.
fn torch_mismatch(config: &TrainConfig) -> Option<String> {
    let m = &config.model;
    let checks = [
        (m.vocab_size == 256, format!("vocab {} (the peer has 256)", m.vocab_size)),
        (m.attn_bias == m.ffn_bias, "biases on the attention but not the FFNs, or back (the peer has one switch)".to_string()),
        (!m.qkv_bias || m.attn_bias, "biases on q/k/v only (the peer has one switch)".to_string()),
        (!m.shared_expert_gate, "a gated shared expert (the peer's are ungated)".to_string()),
        (m.kv_heads() == m.n_heads && m.head_dim.is_none(), "grouped-query attention or heads of their own width".to_string()),
        (!m.qk_norm, "query and key norms".to_string()),
        (m.latent_attention.is_none(), "latent attention (the peer's is multi-head)".to_string()),
        (m.dense_first == 0 && m.dense_d_ff.is_none(), "dense blocks first (the peer has an MoE in every block)".to_string()),
        (m.norm_eps == 1e-5, format!("norm ε {} (the peer uses 1e-5)", m.norm_eps)),
        (m.moe_every == 1, format!("an MoE every {} blocks (the peer has one in every block)", m.moe_every)),
        (m.capacity_factor.is_none(), "a capacity factor (the peer is dropless)".to_string()),
        (m.aux_loss_coef == 0.01, format!("aux loss coefficient {} (the peer uses 0.01)", m.aux_loss_coef)),
        (m.balance == lazarus_model::config::Balance::Aux, "loss-free balancing (the peer trains on the auxiliary loss)".to_string()),
    ];
    checks.into_iter().find(|(ok, _)| !ok).map(|(_, why)| format!("the PyTorch peer cannot match {why}"))
}

/// The peer's flags for the block options of `m`.
fn torch_block_args(m: &lazarus_model::ModelConfig) -> Vec<String> {
    use lazarus_model::config::{Activation, NormKind, Positions};
    let mut v = vec!["--top-k".to_string(), m.top_k.to_string(), "--shared".into(), m.shared_experts.to_string()];
    if m.norm == NormKind::Rms {
        v.extend(["--norm".into(), "rms".into()]);
    }
    if m.positions == Positions::Rope {
        v.extend(["--rope".into(), m.rope_theta.to_string()]);
    }
    if m.expert_act == Activation::Swiglu {
        v.extend(["--act".into(), "swiglu".into()]);
    }
    if !m.ffn_bias {
        v.push("--no-bias".into());
    }
    if !m.normalize_top_k {
        v.push("--no-normalize".into());
    }
    v
}

/// Train the same model with PyTorch eager on `device` (`cpu` or `cuda:N`, as ours ran) and
/// `threads` threads (this process's cores: the child inherits its CPU affinity) and read its
/// report.
fn run_torch(python: &str, config: &TrainConfig, device: &str, threads: usize, iters: usize) -> Result<TorchReport> {
    if let Some(why) = torch_mismatch(config) {
        bail!(why);
    }
    let probe = Command::new(python).args(["-c", "import torch"]).stdout(Stdio::null()).stderr(Stdio::null()).status();
    match probe {
        Ok(s) if s.success() => {}
        Ok(_) => bail!("{python} cannot import torch"),
        Err(e) => bail!("cannot start {python}: {e}"),
    }
    let m = &config.model;
    // A model with Mixtral's options trains against transformers' own Mixtral when it imports.
    let hf = lazarus_model::hf::family_mismatch(m).is_none()
        && lazarus_model::hf::Family::of(m) == lazarus_model::hf::Family::Mixtral
        && Command::new(python)
            .args(["-c", "import transformers"])
            .stdout(Stdio::null())
            .stderr(Stdio::null())
            .status()
            .is_ok_and(|s| s.success());
    // The peer drops its first max(3, steps/4) steps and takes the median of the rest.
    let steps = (iters + 4).max(12);
    let mut child = Command::new(python)
        .arg("-")
        .args(["--device", device, "--threads", &threads.to_string(), "--steps", &steps.to_string()])
        // bf16 for bf16: the peer casts its whole model (its weights too), the closest eager
        // PyTorch user's equivalent of our mixed precision.
        .args(["--dtype", if config.dtype == lazarus_model::Precision::Bf16 { "bfloat16" } else { "float32" }])
        .args(["--batch", &config.batch_size.to_string(), "--seq", &config.seq_len.to_string()])
        .args(["--d", &m.d_model.to_string(), "--layers", &m.n_layers.to_string(), "--heads", &m.n_heads.to_string()])
        .args(["--experts", &m.n_experts.to_string(), "--dff", &m.d_ff.to_string()])
        .args(torch_block_args(m))
        .args(if hf { &["--hf"][..] } else { &[] })
        .stdin(Stdio::piped())
        .stdout(Stdio::piped())
        .stderr(Stdio::piped())
        .spawn()
        .with_context(|| format!("starting {python}"))?;
    child.stdin.take().context("python's stdin")?.write_all(TORCH_MOE_PY.as_bytes())?;
    let out = child.wait_with_output()?;
    if !out.status.success() {
        let err = String::from_utf8_lossy(&out.stderr);
        bail!("the PyTorch peer failed ({}): {}", out.status, err.lines().last().unwrap_or(""));
    }
    let text = String::from_utf8_lossy(&out.stdout);
    let last = text.lines().rev().find(|l| l.trim_start().starts_with('{')).context("the PyTorch peer printed no report")?;
    let report: TorchReport = serde_json::from_str(last).with_context(|| format!("the PyTorch peer's report: {last}"))?;
    if !(report.tokens_per_s.is_finite() && report.tokens_per_s > 0.0) {
        bail!("the PyTorch peer reported {} tokens/s", report.tokens_per_s);
    }
    Ok(report)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_peer_is_matched_to_the_default_model_and_refuses_what_it_cannot_train() {
        let default = TrainConfig::default();
        assert_eq!(torch_mismatch(&default), None);
        let mut c = default.clone();
        c.model.attn_bias = false;
        assert!(torch_mismatch(&c).unwrap().contains("biases"));
        c.model = c.model.mixtral();
        assert_eq!(torch_mismatch(&c), None);
        assert_eq!(torch_block_args(&c.model).join(" "), "--top-k 2 --shared 0 --norm rms --rope 1000000 --act swiglu --no-bias");
        for (model, named) in [
            (lazarus_model::ModelConfig { n_kv_heads: Some(1), ..c.model.clone() }, "grouped-query"),
            (c.model.clone().qwen_moe(), "query and key norms"),
            (c.model.clone().qwen2_moe(), "q/k/v"),
        ] {
            let why = torch_mismatch(&TrainConfig { model, ..c.clone() }).unwrap();
            assert!(why.contains(named), "{why}");
        }
        let mut c = default;
        c.model.capacity_factor = Some(1.25);
        assert!(torch_mismatch(&c).unwrap().contains("capacity"));
    }

    #[test]
    fn a_python_without_torch_is_a_reason_not_a_failure() {
        let err = run_torch("/nonexistent/python3", &TrainConfig::default(), "cpu", 2, 5).unwrap_err();
        assert!(err.to_string().contains("cannot start /nonexistent/python3"), "{err}");
    }
}
