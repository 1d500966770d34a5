//! `lazarus train`: the single-process trainer (here) and `--workers N` ([`workers`]), with one
//! set of flags ([`args`]) and one way of showing a run ([`report`]); `lazarus bench train`
//! ([`bench`]) and `lazarus bench recovery` ([`recovery_bench`]).

pub mod args;
pub mod bench;
mod job_view;
pub mod recovery_bench;
pub mod replay_sim;
pub mod report;
mod solo;
pub mod workers;

use std::time::Instant;

use anyhow::{bail, Context, Result};
use lazarus_model::Trainer;
use lazarus_protocol::stop_signal;
use lazarus_protocol::HeldOut;

use args::{check_resumed_config, resume_steps};
pub use args::{setup_run, TrainArgs};
use report::{print_banner, Reporter};
use solo::SoloStep;

/// `lazarus train`: in one process, or on `--workers N`; in a directory of the run's own
/// (`runs/DATE-TIME/`) unless told where, or told to keep nothing.
pub fn run(args: &TrainArgs) -> Result<()> {
    let (args, run_dir) = args::with_run_dir(args)?;
    let ran = match args.uses_workers() {
        true => workers::run_train_workers(&args, run_dir.as_deref()),
        false => run_train(&args, run_dir.as_deref()),
    };
    if let (Err(_), Some(dir)) = (&ran, &run_dir) {
        args::discard_if_unused(dir);
    }
    ran
}

/// The single-process trainer; `run_dir`: the directory of the run's own it was given.
fn run_train(args: &TrainArgs, run_dir: Option<&std::path::Path>) -> Result<()> {
    let args = &args::settle_resume(args)?;
    let device = lazarus_model::device::parse(args.model.device.as_deref().unwrap_or("cpu"))?;
    let trainer = if args.resume {
        let config = setup_run(args, 1)?;
        let Some(dir) = config.checkpoint_dir.clone() else {
            bail!("--resume needs --checkpoint-dir (or checkpoint_dir in --config)");
        };
        let t = Trainer::resume_on(&dir, resume_steps(args)?, &device).with_context(|| format!("resuming from {}", dir.display()))?;
        check_resumed_config(args, &t.config)?;
        args::set_aside_newer(t.config.checkpoint_dir.as_deref().unwrap_or(&dir), t.step)?;
        tracing::info!("resumed from {} at step {}", dir.display(), t.step);
        t
    } else {
        let t = Trainer::new_on(setup_run(args, 1)?, &device)?;
        if let Some(dir) = run_dir {
            args::keep_run_files(dir, &t.config)?;
        }
        t
    };
    let cfg = trainer.config.clone();
    if trainer.done() {
        bail!("nothing to do: the run is at step {} of --steps {}", trainer.step, cfg.steps);
    }
    let (first_step, shard) = (trainer.step, args.deterministic.then(|| args.shard_sequences.unwrap_or(1)));
    let mut solo = SoloStep::new(trainer, shard)?;
    let form = match shard {
        Some(1) => "single process, deterministic (shards of 1 sequence)".to_string(),
        Some(n) => format!("single process, deterministic (shards of {n} sequences)"),
        None => "single process".to_string(),
    };
    print_banner(solo.trainer(), &form, &lazarus_model::device::name(solo.trainer().model.device()));
    let mut reporter = Reporter::new(args, &cfg, first_step)?;
    let held_out = held_out(args, &cfg)?;
    stop_signal::install();
    while !solo.trainer().done() {
        let t0 = Instant::now();
        let r = solo.step()?;
        let trainer = solo.trainer();
        reporter.step(&r, t0.elapsed().as_secs_f64())?;
        if let Some(h) = &held_out {
            if h.due(r.step, trainer.done()) {
                reporter.eval(r.step, &evaluate_held_out(h, trainer)?, cfg.seq_len)?;
            }
        }
        if let Some(dir) = &cfg.checkpoint_dir {
            if cfg.checkpoint_every > 0 && r.step % cfg.checkpoint_every == 0 && r.step != cfg.steps {
                let path = trainer.save_checkpoint(dir)?;
                reporter.checkpointed(r.step, &path);
            }
        }
        if let Some((sig, name)) = stop_signal::requested() {
            return stop_early(trainer, &reporter, sig, name);
        }
    }
    let trainer = solo.trainer();
    let saved = match &cfg.checkpoint_dir {
        Some(dir) => Some(trainer.save_checkpoint(dir)?),
        None => None,
    };
    if let Some(m) = lazarus_model::device::gpu_memory(trainer.model.device()) {
        tracing::info!("GPU memory: {m}");
    }
    reporter.finish(trainer.step, trainer.unigram_entropy(), saved.as_deref())
}

/// Default windows of an evaluation during training.
const EVAL_WINDOWS: usize = 64;

/// The held-out data of `--eval-data`, and when to evaluate on it.
pub(super) fn held_out(args: &TrainArgs, cfg: &lazarus_model::TrainConfig) -> Result<Option<HeldOut>> {
    let Some(path) = &args.eval_data else { return Ok(None) };
    let table = matches!(args::eval_data_format(args), Some("parquet" | "arrow"))
        || path.split(',').all(|p| lazarus_model::data::TableFormat::of_name(std::path::Path::new(p)).is_some());
    let mut source = args::data_file("eval-data", path, args::eval_data_format(args), args.model.data_column.as_deref().filter(|_| table))?;
    // Its token cache beside the training data's.
    if let (lazarus_model::DataSource::Parquet(t) | lazarus_model::DataSource::Arrow(t), Some(dir)) = (&mut source, &args.model.data_cache)
    {
        t.cache = Some(dir.clone());
    }
    let tokenizer = lazarus_model::tokenizer::TextTokenizer::open(cfg.tokenizer.as_deref()).context("--tokenizer")?;
    let mut tokens = source.load_with(cfg.model.vocab_size, &tokenizer).context("--eval-data")?;
    let windows = args.eval_windows.unwrap_or(EVAL_WINDOWS);
    // What the evaluations read, no more: the windows and the last one's target.
    tokens.truncate(windows.saturating_mul(cfg.seq_len).saturating_add(1));
    if lazarus_model::eval::windows_in(tokens.len(), cfg.seq_len) == 0 {
        bail!("invalid --eval-data: {path} holds {} tokens, not one window of --seq-len {} and its last target", tokens.len(), cfg.seq_len);
    }
    Ok(Some(HeldOut { tokens, every: args.eval_every, windows }))
}

/// The held-out loss of the single process's model.
fn evaluate_held_out(h: &HeldOut, trainer: &Trainer) -> Result<lazarus_model::eval::Evaluation> {
    let c = &trainer.config;
    Ok(lazarus_model::eval::evaluate(&trainer.model, &h.tokens, c.seq_len, Some(h.windows), c.batch_size)?)
}

/// A stop signal arrived: the step in flight finished, so save it (where checkpoints go), show
/// the summary and exit 128 + the signal's number, as a process killed by it would — a scheduler
/// sees the run did not finish, and `--resume` carries it on from this step.
fn stop_early(trainer: &Trainer, reporter: &Reporter, sig: i32, name: &str) -> Result<()> {
    let saved = match &trainer.config.checkpoint_dir {
        Some(dir) => Some(trainer.save_checkpoint(dir)?),
        None => None,
    };
    match &saved {
        Some(p) => {
            tracing::warn!("{name}: stopped after step {}; checkpoint {} written (--resume goes on from it)", trainer.step, p.display())
        }
        None => tracing::warn!("{name}: stopped after step {}; nothing saved (no --checkpoint-dir)", trainer.step),
    }
    reporter.finish(trainer.step, trainer.unigram_entropy(), saved.as_deref())?;
    std::process::exit(128 + sig)
}
