//! The run's own directory: a `lazarus train` not told where to keep what it makes keeps it in
//! `runs/DATE-TIME/` under the working directory (the trainers ML users know do the same:
//! Lightning's `lightning_logs/`, Hugging Face's `output_dir`): its checkpoints, the settings it
//! ran with (`config.toml`, a `--config` file for another run like it), its JSON log
//! (`log.jsonl`) and its tokenizer. `eval`, `generate` and `export` take the directory as their
//! `--checkpoint`; `train --resume` goes on with the newest. `--no-save` keeps nothing;
//! `--checkpoint-dir DIR` chooses the directory (then nothing else is written there but what
//! the flags ask for); `LAZARUS_RUNS_DIR` moves `runs/`.

use super::*;

/// The variable that names the directory runs are kept under (default `runs`).
pub const RUNS_ENV: &str = "LAZARUS_RUNS_DIR";

/// The JSON log of a run in its own directory (unless `--json-log` says where).
pub const RUN_LOG: &str = "log.jsonl";
/// The settings a run in its own directory ran with.
pub const RUN_CONFIG: &str = "config.toml";
/// A copy of the tokenizer a run in its own directory read its text with.
pub const RUN_TOKENIZER: &str = "tokenizer.json";

/// Where runs are kept: `$LAZARUS_RUNS_DIR`, else `runs` in the working directory.
pub fn runs_root() -> PathBuf {
    std::env::var_os(RUNS_ENV).filter(|v| !v.is_empty()).map_or_else(|| PathBuf::from("runs"), PathBuf::from)
}

/// `args` with a run directory of its own where nothing says where the run's checkpoints go (no
/// `--checkpoint-dir`, no `checkpoint_dir` in `--config`, no `--no-save`), and that directory:
/// a new one named for this moment, or with `--resume` the newest under [`runs_root`] holding a
/// checkpoint. Its JSON log goes there too unless `--json-log` says where.
pub fn with_run_dir(args: &TrainArgs) -> Result<(TrainArgs, Option<PathBuf>)> {
    let told = args.no_save || args.resume_if_any || args.checkpoint_dir.is_some() || build_config(args)?.checkpoint_dir.is_some();
    if told {
        return Ok((args.clone(), None));
    }
    let root = runs_root();
    let dir = if args.resume { newest_run(&root)? } else { fresh_run_dir(&root, lazarus_protocol::when::unix_ms_now())? };
    let mut a = args.clone();
    a.checkpoint_dir = Some(dir.clone());
    if a.json_log.is_none() {
        a.json_log = Some(dir.join(RUN_LOG));
    }
    if a.tensorboard.is_none() {
        a.tensorboard = Some(dir.clone());
    }
    Ok((a, Some(dir)))
}

/// A new directory under `root` named for `unix_ms` (`-2`, `-3`, … after it if a run of the
/// same second has that name), made now so that no other run takes it; absolute, so that the
/// checkpoints' record of it holds wherever the run is resumed from.
pub fn fresh_run_dir(root: &Path, unix_ms: u64) -> Result<PathBuf> {
    std::fs::create_dir_all(root).with_context(|| format!("creating the runs directory {} ({RUNS_ENV})", root.display()))?;
    let root = std::path::absolute(root).with_context(|| format!("the runs directory {}", root.display()))?;
    let stamp = lazarus_protocol::when::utc_stamp(unix_ms);
    for n in 1..=100 {
        let dir = root.join(if n == 1 { stamp.clone() } else { format!("{stamp}-{n}") });
        match std::fs::create_dir(&dir) {
            Ok(()) => return Ok(dir),
            Err(e) if e.kind() == std::io::ErrorKind::AlreadyExists => continue,
            Err(e) => return Err(e).with_context(|| format!("creating the run directory {}", dir.display())),
        }
    }
    bail!("{}: 100 runs started in the second {stamp}; give --checkpoint-dir DIR", root.display())
}

/// The newest run under `root` that holds a checkpoint (run directories are named for when they
/// began, so the greatest name).
pub fn newest_run(root: &Path) -> Result<PathBuf> {
    let none = || anyhow::anyhow!("--resume: no run under {} holds a checkpoint (give --checkpoint-dir DIR)", root.display());
    let entries = std::fs::read_dir(root).map_err(|_| none())?;
    let newest = entries
        .flatten()
        .map(|e| e.path())
        .filter(|p| p.is_dir() && lazarus_model::checkpoint::held_checkpoint(p).is_some())
        .max_by(|a, b| a.file_name().cmp(&b.file_name()))
        .ok_or_else(none)?;
    std::path::absolute(&newest).with_context(|| format!("the run directory {}", newest.display()))
}

/// What a new run in its own directory keeps beside its checkpoints: the settings it runs with,
/// as a `--config` file for another run like it (without this run's directory and id), and a
/// copy of its tokenizer.
pub fn keep_run_files(dir: &Path, cfg: &TrainConfig) -> Result<()> {
    let mut settings = toml::Table::try_from(cfg).context("the run's settings as TOML")?;
    settings.remove("checkpoint_dir");
    settings.remove("run");
    // A rotary base said of a model with learned positions is refused as doing nothing.
    if cfg.model.positions != lazarus_model::config::Positions::Rope {
        if let Some(toml::Value::Table(model)) = settings.get_mut("model") {
            model.remove("rope_theta");
        }
    }
    let text = format!(
        "# The settings of the run in this directory, as `lazarus train --config` reads them (a new run\n\
         # started with this file gets a directory of its own).\n{}",
        toml::to_string(&settings).context("the run's settings as TOML")?
    );
    let path = dir.join(RUN_CONFIG);
    std::fs::write(&path, text).with_context(|| format!("writing {}", path.display()))?;
    if let Some(tokenizer) = cfg.tokenizer.as_deref().filter(|t| t.is_file()) {
        let to = dir.join(RUN_TOKENIZER);
        std::fs::copy(tokenizer, &to).with_context(|| format!("copying the tokenizer {} to {}", tokenizer.display(), to.display()))?;
    }
    Ok(())
}

/// A run directory made for a run that then failed before it wrote anything of its own (no
/// checkpoint, no step in its log) is removed: a mistyped flag leaves no empty run behind.
pub fn discard_if_unused(dir: &Path) {
    let logged = std::fs::metadata(dir.join(RUN_LOG)).is_ok_and(|m| m.len() > 0);
    if lazarus_model::checkpoint::held_checkpoint(dir).is_none() && !logged {
        let _ = std::fs::remove_dir_all(dir);
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn temp(name: &str) -> PathBuf {
        let d = std::env::temp_dir().join(format!("lazarus-run-dir-{name}-{}", std::process::id()));
        let _ = std::fs::remove_dir_all(&d);
        d
    }

    #[test]
    fn runs_of_the_same_second_get_directories_of_their_own_and_the_newest_is_resumed() {
        let root = temp("same-second");
        let ms = 1_795_903_524_999;
        let a = fresh_run_dir(&root, ms).unwrap();
        let b = fresh_run_dir(&root, ms).unwrap();
        assert!(a.is_absolute() && a.ends_with("20261128-220524") && b.ends_with("20261128-220524-2"), "{a:?} {b:?}");
        let e = newest_run(&root).unwrap_err().to_string();
        assert!(e.contains("no run under") && e.contains("holds a checkpoint"), "{e}");
        // A run holds a checkpoint once it names its latest; a later one without does not count.
        std::fs::write(a.join("latest"), "step-00000003").unwrap();
        std::fs::create_dir(a.join("step-00000003")).unwrap();
        fresh_run_dir(&root, ms + 60_000).unwrap();
        assert_eq!(newest_run(&root).unwrap(), a);
        std::fs::write(b.join("latest"), "step-00000001").unwrap();
        std::fs::create_dir(b.join("step-00000001")).unwrap();
        assert_eq!(newest_run(&root).unwrap(), b);
        let _ = std::fs::remove_dir_all(&root);
    }

    #[test]
    fn a_runs_settings_read_back_as_a_config_for_a_new_run() {
        let dir = temp("settings");
        std::fs::create_dir_all(&dir).unwrap();
        let cfg =
            TrainConfig { steps: 7, grad_clip: None, checkpoint_dir: Some(dir.clone()), run: Some("abc".into()), ..TrainConfig::default() };
        keep_run_files(&dir, &cfg).unwrap();
        let text = std::fs::read_to_string(dir.join(RUN_CONFIG)).unwrap();
        let back: TrainConfig = toml::from_str(&text).unwrap();
        assert_eq!((back.steps, back.grad_clip, back.checkpoint_dir, back.run), (7, None, None, None), "clipping off stays off");
        assert_eq!(back.model, cfg.model);
        let _ = std::fs::remove_dir_all(&dir);
    }
}
