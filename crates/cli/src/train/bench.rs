//! `lazarus bench train`: forward+backward throughput of the model and its matmul GFLOP/s.

use std::fmt::Write as _;

use anyhow::{bail, Result};
use clap::Args;

use super::args::{build_config, TrainArgs};

#[derive(Args, Debug)]
pub struct BenchTrainArgs {
    /// Model and batch settings, as for `lazarus train` (defaults: the default model, 16 x 128).
    #[command(flatten)]
    train: TrainArgs,
    /// Measured forward+backward passes (after 2 warm-up steps).
    #[arg(long, default_value_t = 5)]
    iters: usize,
    #[arg(long)]
    json: bool,
}

pub fn run_bench_train(args: &BenchTrainArgs) -> Result<()> {
    if args.iters == 0 {
        bail!("invalid --iters: 0 (must be at least 1)");
    }
    let config = build_config(&args.train)?;
    let r = lazarus_model::bench::train_benchmark(&config, 2, args.iters)?;
    if args.json {
        crate::io::println(&serde_json::to_string(&r)?)?;
    } else {
        let mut out = String::new();
        let _ = writeln!(
            out,
            "model            {:.2}M parameters, batch {} x {} tokens, {} iterations",
            r.parameters as f64 / 1e6,
            r.batch_size,
            r.seq_len,
            r.iterations
        );
        let _ = writeln!(out, "forward+backward {:.0} tokens/s ({:.3} s per step)", r.tokens_per_s, r.step_s);
        let _ = writeln!(out, "expert FFNs      {:.3} s per step = {:.0}% of forward+backward", r.expert_ffn_s, 100.0 * r.expert_share);
        let _ = writeln!(out, "achieved         {:.1} GFLOP/s (matmul FLOPs {:.2e} per step)", r.model_gflops, r.flops_per_step);
        let _ = writeln!(out, "plain matmul     {:.1} GFLOP/s on the same shapes", r.matmul_gflops);
        let _ = writeln!(out, "ratio            {:.2} (goal >= 0.5)", r.ratio);
        crate::io::print(&out)?;
    }
    Ok(())
}
