//! Setting a run up: the checkpoint directory checked and locked, a resumed run's settings
//! held to the checkpoint's, the model sized against this machine's memory, a new run's id.

use super::*;

/// The settings where `a` differs from `b` (the keys of `a`, dotted), as `key = a (WHOSE has
/// b)`, leaving out `steps` and `checkpoint_dir` (a resumed run may change those).
pub(super) fn differences(a: &serde_json::Value, b: &serde_json::Value, whose: &str) -> Vec<String> {
    fn differ(prefix: &str, a: &serde_json::Value, b: &serde_json::Value, whose: &str, out: &mut Vec<String>) {
        match (a.as_object(), b.as_object()) {
            (Some(x), Some(y)) => {
                for (k, va) in x {
                    if prefix.is_empty() && (k == "steps" || k == "checkpoint_dir") {
                        continue;
                    }
                    let key = if prefix.is_empty() { k.clone() } else { format!("{prefix}.{k}") };
                    match y.get(k) {
                        Some(vb) => differ(&key, va, vb, whose, out),
                        None => out.push(key),
                    }
                }
            }
            _ if a != b => out.push(format!("{prefix} = {a} ({whose} has {b})")),
            _ => {}
        }
    }
    let mut out = Vec::new();
    differ("", a, b, whose, &mut out);
    out
}

/// The total steps of a resumed run: `--steps`, else the `--config` file's `steps` if it sets
/// them, else the checkpoint's.
pub fn resume_steps(args: &TrainArgs) -> Result<Option<u64>> {
    if args.steps.is_some() {
        return Ok(args.steps);
    }
    let Some(path) = &args.model.config else { return Ok(None) };
    let said: toml::Value = toml::from_str(&config_text(args, path)?).with_context(|| format!("invalid --config {}", path.display()))?;
    match said.get("steps") {
        Some(v) => Ok(Some(
            v.as_integer()
                .and_then(|x| u64::try_from(x).ok())
                .ok_or_else(|| anyhow::anyhow!("invalid --config {}: steps = {v}", path.display()))?,
        )),
        None => Ok(None),
    }
}

/// With `--resume`, a `--config` may only say what the checkpoint says (it is read for its
/// `checkpoint_dir`, and `steps` may raise the total): any other setting would be ignored.
pub fn check_resumed_config(args: &TrainArgs, resumed: &TrainConfig) -> Result<()> {
    check_unchanged(args, resumed, "--resume continues the checkpoint's run", "the checkpoint")
}

/// Refuse flags or a `--config` file that would change the settings of a run taken up again
/// (`how` it is taken up, `whose` settings they are): flags may repeat them, not change them —
/// a change would otherwise be ignored without a word.
pub fn check_unchanged(args: &TrainArgs, resumed: &TrainConfig, how: &str, whose: &str) -> Result<()> {
    let mut flagged = resumed.clone();
    apply_flags(args, &mut flagged)?;
    let changed = differences(&serde_json::to_value(&flagged)?, &serde_json::to_value(resumed)?, whose);
    if !changed.is_empty() {
        bail!("{how} with its own settings; the flags would change {}", changed.join(", "));
    }
    let Some(path) = &args.model.config else { return Ok(()) };
    let text = config_text(args, path)?;
    toml::from_str::<TrainConfig>(&text).with_context(|| format!("invalid --config {}", path.display()))?;
    // Only what the file itself says (its missing keys are defaults, not settings).
    let said: toml::Value = toml::from_str(&text).with_context(|| format!("invalid --config {}", path.display()))?;
    let (a, b) = (serde_json::to_value(&said)?, serde_json::to_value(resumed)?);
    let diffs = differences(&a, &b, whose);
    if !diffs.is_empty() {
        bail!("{how} with its own settings; --config {} would change {}", path.display(), diffs.join(", "));
    }
    Ok(())
}

/// Refuse a configuration this machine cannot hold (`copies`: processes that each build the
/// whole model), before anything is allocated.
pub fn check_fits(cfg: &TrainConfig, copies: u128) -> Result<()> {
    let what = format!(
        "this run ({} parameters{}, activations, data)",
        cfg.model.parameter_count(),
        if copies > 1 { format!(", in {copies} processes") } else { String::new() }
    );
    crate::io::check_memory(
        cfg.memory_estimate().saturating_mul(copies),
        &what,
        "--experts, --d-model, --d-ff, --layers, --batch-size or --seq-len",
    )
}

/// `--checkpoint-dir`: a directory (created if missing) before training starts, not a file found
/// out at the first save.
pub(super) fn check_checkpoint_dir(cfg: &TrainConfig, resume: bool, overwrite: bool) -> Result<()> {
    if resume && overwrite {
        bail!("--overwrite-checkpoints starts a new run, --resume goes on with the saved one: give one of them");
    }
    if cfg.checkpoint_every > 0 && cfg.checkpoint_dir.is_none() {
        bail!("--checkpoint-every needs --checkpoint-dir (or checkpoint_dir in --config)");
    }
    if let Some(dir) = &cfg.checkpoint_dir {
        if dir.exists() && !dir.is_dir() {
            bail!("invalid --checkpoint-dir: {} is not a directory", dir.display());
        }
        if resume {
            if !dir.is_dir() {
                bail!("--resume: {} does not exist (no checkpoint to continue)", dir.display());
            }
        } else {
            // A checkpoint is no place for another run's: --resume goes on from it.
            if dir.join(lazarus_model::checkpoint::MANIFEST_FILE).exists() {
                bail!(
                    "--checkpoint-dir {} is a checkpoint, not a run's directory: add --resume to go on from it, or give \
                     another directory for a new run",
                    dir.display()
                );
            }
            // A fresh run would replace another run's checkpoints and move `latest` back.
            if let Some(held) = lazarus_model::checkpoint::held_checkpoint(dir).filter(|_| !overwrite) {
                bail!(
                    "--checkpoint-dir {} holds the checkpoints of a run (latest: {held}): add --resume to go on with it, or \
                     --overwrite-checkpoints to start a new run over them",
                    dir.display(),
                );
            }
            std::fs::create_dir_all(dir).with_context(|| format!("--checkpoint-dir: cannot create {}", dir.display()))?;
        }
        // The directory the run writes in (a resumed step's run's).
        lock_checkpoint_dir(&lazarus_model::checkpoint::run_dir_of(dir))?;
    }
    Ok(())
}

/// Hold `DIR/.lock` (flock) for the life of this process: two runs writing one checkpoint
/// directory would replace each other's checkpoints and `latest`.
pub(super) fn lock_checkpoint_dir(dir: &Path) -> Result<()> {
    use std::io::{Read, Seek, Write};
    use std::os::unix::io::AsRawFd;
    static HELD: std::sync::Mutex<Vec<PathBuf>> = std::sync::Mutex::new(Vec::new());
    let mut held = HELD.lock().unwrap_or_else(|e| e.into_inner());
    let key = dir.canonicalize().unwrap_or_else(|_| dir.to_path_buf());
    if held.contains(&key) {
        return Ok(());
    }
    let path = dir.join(".lock");
    let mut f = std::fs::OpenOptions::new()
        .read(true)
        .write(true)
        .create(true)
        .truncate(false)
        .open(&path)
        .with_context(|| format!("--checkpoint-dir: cannot open {}", path.display()))?;
    // SAFETY: flock on a descriptor this function owns.
    if unsafe { libc::flock(f.as_raw_fd(), libc::LOCK_EX | libc::LOCK_NB) } != 0 {
        let mut owner = String::new();
        let _ = f.read_to_string(&mut owner);
        let owner = owner.trim();
        let who = if owner.is_empty() { "another run".to_string() } else { format!("another run (pid {owner})") };
        bail!("--checkpoint-dir {}: {who} is writing checkpoints there", dir.display());
    }
    let _ = f.set_len(0).and_then(|_| f.rewind()).and_then(|_| write!(f, "{}", std::process::id()));
    // Kept open (and locked) until this process ends; the kernel releases it however it ends.
    std::mem::forget(f);
    held.push(key);
    Ok(())
}

/// `args` with `--resume-if-any` settled: `--resume` when the checkpoint directory (the flag's or
/// the `--config` file's) holds a run's checkpoint (its `latest`, or a `step-*` where `latest`
/// is missing), else a new run.
pub fn settle_resume(args: &TrainArgs) -> Result<TrainArgs> {
    let mut a = args.clone();
    if a.resume_if_any {
        let dir = build_config(args)?.checkpoint_dir;
        let Some(dir) = dir else { bail!("--resume-if-any needs --checkpoint-dir (or checkpoint_dir in --config)") };
        let held = lazarus_model::checkpoint::held_checkpoint(&dir);
        a.resume = held.is_some();
        a.resume_if_any = false;
        if let Some(held) = held {
            tracing::info!("--resume-if-any: {} holds a run ({held}): going on with it", dir.display());
        }
    }
    Ok(a)
}

/// The configuration of a run that starts now: flags checked for combinations that would ignore
/// one, the checkpoint directory usable, the whole thing small enough for this machine with
/// `copies` processes holding the model.
pub fn setup_run(args: &TrainArgs, copies: u128) -> Result<TrainConfig> {
    args.check_combinations()?;
    let mut cfg = build_config(args)?;
    if args.keep_checkpoints.is_some() && cfg.checkpoint_dir.is_none() {
        bail!("--keep-checkpoints needs --checkpoint-dir (or checkpoint_dir in --config)");
    }
    check_checkpoint_dir(&cfg, args.resume, args.overwrite_checkpoints)?;
    if !args.resume {
        check_fits(&cfg, copies)?;
        start_run(&mut cfg)?;
    }
    Ok(cfg)
}

/// A fresh run gets its id; its checkpoint directory becomes its own (what an earlier run left
/// there — allowed by --overwrite-checkpoints — is set aside, not deleted, and said where).
pub(super) fn start_run(cfg: &mut TrainConfig) -> Result<()> {
    let run = lazarus_model::checkpoint::fresh_run_id()?;
    if let Some(dir) = &cfg.checkpoint_dir {
        let aside = lazarus_model::checkpoint::start_run(dir, &run).with_context(|| format!("--checkpoint-dir {}", dir.display()))?;
        if let Some(aside) = aside {
            tracing::warn!("--overwrite-checkpoints: the earlier run's checkpoints are kept in {}", aside.display());
        }
    }
    cfg.run = Some(run);
    Ok(())
}

/// A run resumed from `dir` at `step`: its checkpoints of later steps are set aside before the
/// run writes over them, and the user is told where they are.
pub fn set_aside_newer(dir: &Path, step: u64) -> Result<()> {
    let moved = lazarus_model::checkpoint::set_aside_newer(dir, step).with_context(|| format!("--checkpoint-dir {}", dir.display()))?;
    if let Some(first) = moved.first() {
        tracing::warn!(
            "--resume goes on from step {step}: {} newer checkpoint(s) of this run would be written over; kept in {}",
            moved.len(),
            first.parent().unwrap_or(first).display()
        );
    }
    Ok(())
}
